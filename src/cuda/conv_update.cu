// Compiled instantiation of causal_conv1d_update's CUDA launcher (gdn/conv/cuda.cuh).
#include <cuda_runtime.h>

#include "cuda_api_conv.hpp"
#include "gdn/conv/cuda.cuh"

namespace gdn::cuda_api {

Status causal_conv1d_update(const conv::Params& params, void* stream) {
  const int device = params.conv_state.device.index;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kCudaError, "causal_conv1d_update: no usable CUDA device");
  }
  // Launch on the arrays' device; the caller's stream belongs to it.
  if (params.conv_state.device.type == DeviceType::kCUDA && previous != device) cudaSetDevice(device);
  Status status = conv::launch_cuda(params, static_cast<cudaStream_t>(stream));
  if (params.conv_state.device.type == DeviceType::kCUDA && previous != device) cudaSetDevice(previous);
  return status;
}

}  // namespace gdn::cuda_api
