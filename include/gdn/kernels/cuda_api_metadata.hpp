// Host-callable CUDA entry points of the metadata builder (src/cuda/metadata_state_rows.cu, target
// gdn::kernels). Declared without CUDA headers so host-compiled code (the binding, a C++ engine)
// can call them; cudaStream_t travels as void*. None of them synchronises or allocates.
#pragma once

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"
#include "gdn/metadata/builder.hpp"
#include "gdn/metadata/params.hpp"

namespace gdn::cuda_api {

// One launch filling every group's state rows from the device plan buffer `params.plan`, on
// `stream`, on the device that holds the arrays.
Status metadata_state_rows(const metadata::Params& params, void* stream);

// One whole step: the plan on the host into `params.plan` (a host buffer, pinned for a truly
// asynchronous copy), one cudaMemcpyAsync of it into `device_plan` (same layout), then the
// state-row launch reading `device_plan`. The host buffer must not be rewritten before the copy
// has executed (keep two and alternate, or wait on an event recorded after this call).
Status metadata_step(const metadata::Params& params, const TensorView& device_plan, void* stream);

// One cudaMemcpyAsync of a planned host buffer into the device plan buffer (same layout): what a
// step does before replaying a graph that captured the state-row launch.
Status metadata_copy_plan(const TensorView& host_plan, const TensorView& device_plan, int64_t words,
                          void* stream);

// The CUDA runtime operations a CUDA metadata::Builder needs (builder.hpp), compiled here:
//   builder.initialize(config, gdn::cuda_api::metadata_builder_ops());
const metadata::DeviceOps& metadata_builder_ops();

// Waits for `stream`. For benchmarks and the debug shadow check only; the builder never calls it.
Status synchronize_stream(void* stream);

}  // namespace gdn::cuda_api
