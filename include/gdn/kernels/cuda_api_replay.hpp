// Host-callable CUDA entry point of replay verify (src/cuda/replay_api.cu, target gdn::kernels).
// Declared without CUDA headers so host-compiled code (the binding, a C++ engine) can call it;
// cudaStream_t travels as void*.
#pragma once

#include "gdn/core/status.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::cuda_api {

// Launches replay verify on `stream` (two kernels: the replay step, then the window save), on the
// device that holds the arrays. Validates on the host; reads no device memory, never
// synchronises. `split` as in decode_mtp (a benchmark knob; 0 = chosen from the shapes).
Status replay(const replay::Params& params, void* stream, int split = 0);

}  // namespace gdn::cuda_api
