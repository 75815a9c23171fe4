// Host entry point of the compiled decode_mtp CUDA kernels (declared in cuda_api.hpp).
#include <cuda_runtime.h>

#include <string>

#include "cuda_api.hpp"
#include "gdn/decode_mtp/cuda.cuh"

namespace gdn::cuda_api {
Status decode_mtp(const decode_mtp::Params& params, void* stream, int split) {
  if (params.state.device.type != DeviceType::kCUDA)
    return Status::invalid("decode_mtp: the CUDA path needs CUDA arrays, state is on " +
                           to_string(params.state.device));
  const int device = params.state.device.index;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError,
                  std::string("decode_mtp: no usable CUDA device: ") + cudaGetErrorString(err));
  }
  // Launch on the arrays' device: the caller's stream belongs to it.
  if (previous != device && cudaSetDevice(device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError, "decode_mtp: cannot select CUDA device " +
                                              std::to_string(device) + ": " + cudaGetErrorString(err));
  }
  Status status =
      decode_mtp::launch_cuda(params, static_cast<cudaStream_t>(stream), split);
  const cudaError_t err = status.is_ok() ? cudaGetLastError() : cudaSuccess;
  if (previous != device) (void)cudaSetDevice(previous);
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string("decode_mtp: CUDA error after launch: ") + cudaGetErrorString(err));
  return status;
}

}  // namespace gdn::cuda_api
