// Runs an operation whose params view host arrays on the GPU, for tests: every byte range the
// views cover (overlapping ranges merged, so views of one buffer stay one buffer) is copied to the
// device, the views are pointed there, the launch runs and is waited for, and every range is
// copied back.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::testing {

template <class Launch>
Status run_mirrored(const std::vector<TensorView*>& views, Launch&& launch) {
  struct Range {
    uint8_t *lo, *hi;
    uint8_t* dev = nullptr;
  };
  std::vector<Range> ranges;
  for (TensorView* v : views) {
    if (!v->present()) continue;
    int64_t span = 1;  // elements from the first to one past the last
    for (int d = 0; d < v->ndim; ++d)
      span += v->shape[d] > 0 ? (v->shape[d] - 1) * v->strides[d] : 0;
    auto* lo = static_cast<uint8_t*>(v->data);
    ranges.push_back({lo, lo + span * dtype_size(v->dtype)});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.lo < b.lo; });
  std::vector<Range> merged;
  for (const Range& r : ranges) {
    if (!merged.empty() && r.lo < merged.back().hi)
      merged.back().hi = std::max(merged.back().hi, r.hi);
    else
      merged.push_back(r);
  }
  const auto fail = [&](const char* what) {
    const std::string why = cudaGetErrorString(cudaGetLastError());
    for (Range& r : merged)
      if (r.dev) cudaFree(r.dev);
    return Status(StatusCode::kCudaError, std::string(what) + ": " + why);
  };
  for (Range& r : merged) {
    if (cudaMalloc(&r.dev, size_t(r.hi - r.lo)) != cudaSuccess) return fail("cudaMalloc");
    if (cudaMemcpy(r.dev, r.lo, size_t(r.hi - r.lo), cudaMemcpyHostToDevice) != cudaSuccess)
      return fail("upload");
  }
  for (TensorView* v : views) {
    if (!v->present()) continue;
    auto* lo = static_cast<uint8_t*>(v->data);
    const Range& r = *std::find_if(merged.begin(), merged.end(),
                                   [&](const Range& m) { return lo >= m.lo && lo < m.hi; });
    v->data = r.dev + (lo - r.lo);
    v->device = {DeviceType::kCUDA, 0};
  }
  const Status status = launch();
  if (cudaDeviceSynchronize() != cudaSuccess) return fail("kernel");
  for (Range& r : merged)
    if (cudaMemcpy(r.lo, r.dev, size_t(r.hi - r.lo), cudaMemcpyDeviceToHost) != cudaSuccess)
      return fail("download");
  for (Range& r : merged) cudaFree(r.dev);
  return status;
}

}  // namespace gdn::testing
