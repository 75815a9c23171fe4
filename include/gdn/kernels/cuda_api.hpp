// Host-callable entry points of the compiled CUDA kernels (src/cuda/*.cu, target gdn::kernels).
// Declared without CUDA headers so host-compiled code (the binding, a C++ engine) can call them;
// cudaStream_t travels as void*.
#pragma once

#include <string>

#include "gdn/core/status.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::cuda_api {

// Number of visible CUDA devices (0 when there is no driver or no device).
int device_count();
// Whether this build holds a kernel image that runs on `device`; `why` explains a refusal.
bool kernels_available(int device, std::string* why);
// Launches decode_mtp on `stream`. Validates arguments on the host; reads no device memory.
// `split` pins the CTAs per value head (1, 2, 4, 8; 0 = chosen from the shapes): a knob for
// benchmarks and tests, never needed for correctness.
Status decode_mtp(const decode_mtp::Params& params, void* stream, int split = 0);

}  // namespace gdn::cuda_api
