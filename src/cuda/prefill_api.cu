// Compiled instantiation of prefill's CUDA launcher (gdn/prefill/cuda.cuh).
#include <cuda_runtime.h>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api_prefill.hpp"
#include "gdn/prefill/cuda.cuh"

namespace gdn::cuda_api {

Status prefill(const prefill::Params& params, void* stream) {
  if (params.state.device.type != DeviceType::kCUDA)
    return Status::invalid("prefill: the CUDA path needs CUDA arrays, state is on " +
                           to_string(params.state.device));
  return cuda::on_device("prefill", params.state.device.index, [&] {
    return prefill::launch_cuda(params, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gdn::cuda_api
