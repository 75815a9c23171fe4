// Compiled instantiation of causal_conv1d_prefill's CUDA launcher (gdn/conv_prefill/cuda.cuh).
#include <cuda_runtime.h>

#include "gdn/conv_prefill/cuda.cuh"
#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api_conv.hpp"

namespace gdn::cuda_api {

Status causal_conv1d_prefill(const conv_prefill::Params& params, void* stream) {
  return cuda::on_array_device("causal_conv1d_prefill", params.conv_state, "conv_state", [&] {
    return conv_prefill::launch_cuda(params, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gdn::cuda_api
