// Host-callable CUDA entry point of causal_conv1d_update (src/cuda/conv_update.cu, target
// gdn::kernels). Declared without CUDA headers so host-compiled code (the binding, a C++ engine)
// can call it; cudaStream_t travels as void*.
#pragma once

#include "gdn/conv/params.hpp"
#include "gdn/core/status.hpp"

namespace gdn::cuda_api {

// Launches causal_conv1d_update on `stream` (on the device that holds the arrays). Validates the
// arguments on the host; reads no device memory, never synchronises.
Status causal_conv1d_update(const conv::Params& params, void* stream);

}  // namespace gdn::cuda_api
