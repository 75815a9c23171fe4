// Host-callable CUDA entry point of prefill (src/cuda/prefill_api.cu, target gdn::kernels).
// Declared without CUDA headers so host-compiled code (the binding, a C++ engine) can call it;
// cudaStream_t travels as void*.
#pragma once

#include "gdn/core/status.hpp"
#include "gdn/prefill/params.hpp"

namespace gdn::cuda_api {

// Launches prefill on `stream` (on the device that holds the arrays). Validates the arguments on
// the host; reads no device memory, never synchronises. Requests whose indices are invalid on the
// device write nothing, get zero outputs and increment `error_count` when given. `pass` pins how
// the state pass runs (prefill::StatePass; kAuto chooses by occupancy, mean request length and
// the device's shared memory).
Status prefill(const prefill::Params& params, void* stream,
               prefill::StatePass pass = prefill::StatePass::kAuto);

// The workspace bytes prefill(params, stream) with kAuto needs on the arrays' device (0: none), for
// a caller that takes it from its own allocator. Validates the arguments like prefill; launches
// nothing.
Status prefill_workspace_bytes(const prefill::Params& params, int64_t* bytes);

}  // namespace gdn::cuda_api
