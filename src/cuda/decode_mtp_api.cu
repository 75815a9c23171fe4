// Host entry point of the compiled decode_mtp CUDA kernels (declared in cuda_api.hpp).
#include <cuda_runtime.h>

#include <string>

#include "gdn/decode_mtp/cuda.cuh"
#include "gdn/kernels/cuda_api.hpp"

namespace gdn::cuda_api {
Status decode_mtp(const decode_mtp::Params& params, void* stream, int split) {
  return cuda::on_array_device("decode_mtp", params.state, "state", [&] {
    return decode_mtp::launch_cuda(params, static_cast<cudaStream_t>(stream), split);
  });
}

}  // namespace gdn::cuda_api
