// Host entry point of the compiled replay-verify CUDA kernels (declared in cuda_api_replay.hpp).
#include <cuda_runtime.h>

#include "gdn/kernels/cuda_api_replay.hpp"
#include "gdn/replay/cuda.cuh"

namespace gdn::cuda_api {
Status replay(const replay::Params& params, void* stream, int split) {
  return cuda::on_array_device("replay", params.state, "state", [&] {
    return replay::launch_cuda(params, static_cast<cudaStream_t>(stream), split);
  });
}

}  // namespace gdn::cuda_api
