// Host-callable CUDA entry points of causal_conv1d_update (src/cuda/conv_update.cu) and
// causal_conv1d_prefill (src/cuda/conv_prefill.cu), target gdn::kernels. Declared without CUDA
// headers so host-compiled code (the binding, a C++ engine) can call them; cudaStream_t travels as
// void*.
#pragma once

#include "gdn/conv/params.hpp"
#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/status.hpp"

namespace gdn::cuda_api {

// Launches causal_conv1d_update on `stream` (on the device that holds the arrays). Validates the
// arguments on the host; reads no device memory, never synchronises.
Status causal_conv1d_update(const conv::Params& params, void* stream);

// Launches causal_conv1d_prefill on `stream` (on the device that holds the arrays). Validates the
// arguments on the host; reads no device memory, never synchronises. Requests whose indices are
// invalid on the device write no state, get zero outputs and increment `error_count` when given.
Status causal_conv1d_prefill(const conv_prefill::Params& params, void* stream);

}  // namespace gdn::cuda_api
