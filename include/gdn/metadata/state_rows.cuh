// metadata: the state rows of all G KV-cache groups in ONE CUDA launch. The grid covers
// (launch_rows x (S + 1)) elements in x (S spec columns, then one thread writing the non-spec
// row's destination and source) and the groups in y; the group table (pointer, row stride,
// rows, columns per group) travels by value in the kernel argument. Counts are read from the plan
// header in device memory, so a captured launch replays correctly after the plan buffer is
// refreshed with a new step (same launch_rows). Out-of-range rows are never read: they get the pad
// id and are added to the optional error counter. In replay mode the spec column-0 thread reads
// the row's one column (start) and writes it to checkpoint_indices and column 0 of the spec row;
// the other spec threads write the pad id.
// The launcher allocates nothing, never synchronises and sets no attributes (capture-safe).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gdn/core/cuda/launch.cuh"
#include "gdn/metadata/state_rows.hpp"

namespace gdn::metadata {
namespace cuda_detail {

inline constexpr int kStateRowThreads = 256;

// A template so that every translation unit including this header shares one definition.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    state_rows_kernel(const __grid_constant__ StateRowsArgs a) {
  const int32_t g = int32_t(blockIdx.y);
  const int32_t width = a.S + 1;  // S spec columns, then the non-spec column
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const RowCounts rc = read_row_counts(a);
  if (g == 0 && e == 0 && rc.plan_errors > 0 && a.error_count)
    atomicAdd(a.error_count, rc.plan_errors);
  const int64_t row = e / width;
  if (row >= a.launch_rows) return;
  const int32_t j = int32_t(row);
  const int32_t c = int32_t(e - row * width);
  const GroupTable& t = a.tables[g];
  int32_t errors = 0;
  if (c < a.S) {
    if (j >= rc.spec_written) return;
    int32_t v = a.pad_id;
    if (j < rc.spec_live && (!a.replay || c == 0)) {
      const int32_t request = a.plan[a.spec_request + j];
      const int32_t start = a.plan[a.spec_start + j];
      if (row_readable(t, request, start, a.replay ? 1 : a.S))
        v = t.data[request * t.row_stride + start + c];
      else
        errors += (c == 0);
    }
    a.spec_out[g * a.spec_group_stride + int64_t(j) * a.S + c] = v;
    if (a.replay && c == 0) a.checkpoint_out[g * a.checkpoint_group_stride + j] = v;
    if (g == 0 && c == 0 && a.accepted) errors += gather_accepted(a, j, j < rc.spec_live);
  } else {
    if (j >= rc.non_spec_written) return;
    int32_t dst = a.pad_id, src = a.pad_id;
    if (j < rc.non_spec_live && !non_spec_entries(a, t, j, &dst, &src)) {
      errors += 1;
      dst = src = a.pad_id;
    }
    a.non_spec_out[g * a.non_spec_group_stride + j] = dst;
    if (a.non_spec_source_out) a.non_spec_source_out[g * a.non_spec_source_group_stride + j] = src;
    // While gathering every thread reads the count from `accepted`, never this plan word.
    if (g == 0 && a.accepted) gather_non_spec_accepted(a, j, j < rc.non_spec_live);
  }
  if (errors && a.error_count) atomicAdd(a.error_count, errors);
}

}  // namespace cuda_detail

// One launch over validated arguments (see make_state_rows_args) on `stream`, on the current
// device.
inline Status launch_state_rows_cuda(const StateRowsArgs& a, cudaStream_t stream) {
  const int64_t elements = int64_t(a.launch_rows) * (a.S + 1);
  const int64_t blocks =
      (elements + cuda_detail::kStateRowThreads - 1) / cuda_detail::kStateRowThreads;
  if (blocks > INT32_MAX)
    return Status::unsupported("launch_rows x (S + 1) = " + std::to_string(elements) +
                               " elements exceed one grid");
  const dim3 grid(unsigned(blocks), unsigned(a.num_groups));
  cuda_detail::state_rows_kernel<cuda_detail::kStateRowThreads>
      <<<grid, cuda_detail::kStateRowThreads, 0, stream>>>(a);
  return cuda::launch_status("metadata state rows:");
}

// Fills every group's state rows from the device plan buffer `p.plan` in one launch on `stream`.
// All arrays of the pass (plan, block tables, outputs, error_count, and num_accepted_tokens when
// it is to be gathered) live on the current CUDA device.
inline Status launch_state_rows_cuda(const Params& p, cudaStream_t stream) {
  GDN_RETURN_IF_ERROR(check_state_rows_arguments(p, DeviceType::kCUDA));
  return launch_state_rows_cuda(make_state_rows_args(p), stream);
}

}  // namespace gdn::metadata
