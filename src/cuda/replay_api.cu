// Host entry point of the compiled replay-verify CUDA kernels (declared in cuda_api_replay.hpp).
#include <cuda_runtime.h>

#include "gdn/kernels/cuda_api_replay.hpp"
#include "gdn/replay/cuda.cuh"

namespace gdn::cuda_api {
Status replay(const replay::Params& params, void* stream, int split) {
  if (params.state.device.type != DeviceType::kCUDA)
    return Status::invalid("replay: the CUDA path needs CUDA arrays, state is on " +
                           to_string(params.state.device));
  return cuda::on_device("replay", params.state.device.index, [&] {
    return replay::launch_cuda(params, static_cast<cudaStream_t>(stream), split);
  });
}

}  // namespace gdn::cuda_api
