// Compiled instantiation of causal_conv1d_update's CUDA launcher (gdn/conv/cuda.cuh).
#include <cuda_runtime.h>

#include "gdn/conv/cuda.cuh"
#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api_conv.hpp"

namespace gdn::cuda_api {

Status causal_conv1d_update(const conv::Params& params, void* stream) {
  return cuda::on_array_device("causal_conv1d_update", params.conv_state, "conv_state", [&] {
    return conv::launch_cuda(params, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gdn::cuda_api
