// Compiled instantiation of prefill's CUDA launcher (gdn/prefill/cuda.cuh).
#include <cuda_runtime.h>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api_prefill.hpp"
#include "gdn/prefill/cuda.cuh"

namespace gdn::cuda_api {

Status prefill(const prefill::Params& params, void* stream, prefill::StatePass pass) {
  return cuda::on_array_device("prefill", params.state, "state", [&] {
    return prefill::launch_cuda(params, static_cast<cudaStream_t>(stream), pass);
  });
}

Status prefill_workspace_bytes(const prefill::Params& params, int64_t* bytes) {
  return cuda::on_array_device("prefill", params.state, "state",
                               [&] { return prefill::cuda_workspace_bytes(params, bytes); });
}

}  // namespace gdn::cuda_api
