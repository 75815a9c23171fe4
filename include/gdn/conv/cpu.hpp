// causal_conv1d_update on the CPU: the whole call is validated first (an invalid row fails the call
// before anything is written), then every (request, channel) slides its W-tap window over the
// request's tokens. Host-only; parallel with OpenMP when enabled.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/conv/params.hpp"

namespace gdn::conv {
namespace cpu_detail {

// The value a float takes once stored in (and read back from) an array of dtype t.
inline float round_to(DType t, float v) noexcept {
  switch (t) {
    case DType::kBFloat16: return to_float(to_bf16(v));
    case DType::kFloat16: return to_float(to_f16(v));
    default: return v;
  }
}

inline float activate(Activation act, float v) noexcept {
  return act == Activation::kSiLU ? v / (1.0f + std::exp(-v)) : v;
}

// One (request, channel): read the accepted window, shift the buffer, convolve the new tokens.
inline void run_channel(const Params& p, const Problem& pr, const RowInfo& row, int64_t c) {
  const int64_t W = pr.W;
  float w[kConvMaxWidth];
  for (int64_t j = 0; j < W; ++j)
    w[j] = load_float(p.weight.data, p.weight.dtype, c * p.weight.strides[0] + j);
  const auto at = [&](int64_t pos) {
    return state_offset(p.layout, pr.slot_stride, pr.D, pr.buffer_len, row.slot, c, pos);
  };
  // window[0..W-2]: the W-1 previous inputs as stored, oldest first. Read completely before the
  // buffer is rewritten (the old and new windows overlap).
  float window[kConvMaxWidth];
  for (int64_t j = 0; j < W - 1; ++j)
    window[j] = load_float(p.conv_state.data, p.conv_state.dtype, at(row.offset + j));
  for (int64_t j = 0; j + 1 < W - 1; ++j)
    store_float(p.conv_state.data, p.conv_state.dtype, at(j), window[j + 1]);
  for (int64_t t = 0; t < row.T; ++t) {
    const int64_t l = row.begin + t;
    // Read before out is written: out may be x itself.
    const float xv = load_float(p.x.data, p.x.dtype, l * p.x.strides[0] + c);
    float acc = 0.0f;
    for (int64_t j = 0; j < W - 1; ++j) acc += w[j] * window[j];
    acc += w[W - 1] * xv;
    store_float(p.out.data, p.out.dtype, l * p.out.strides[0] + c, activate(p.activation, acc));
    store_float(p.conv_state.data, p.conv_state.dtype, at(W - 2 + t), xv);
    for (int64_t j = 0; j + 1 < W - 1; ++j) window[j] = window[j + 1];
    window[W - 2] = round_to(p.conv_state.dtype, xv);
  }
}

}  // namespace cpu_detail

// Runs causal_conv1d_update on host memory. Validates everything first: on error nothing is
// written. Skipped rows (T = 0, null conv slot) leave their output rows and the pool untouched.
inline Status run_cpu(const Params& p) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  if (pr.device.type != DeviceType::kCPU)
    return Status::invalid("run_cpu was given tensors on " + to_string(pr.device));
  GDN_RETURN_IF_ERROR(check_rows(p, pr));
  std::vector<RowInfo> rows;
  rows.reserve(size_t(pr.N));
  for (int64_t i = 0; i < pr.N; ++i) {
    RowInfo info;
    RowAction action;
    (void)check_row(p, pr, i, &info, &action);
    if (action == RowAction::kRun) rows.push_back(info);
  }
  // Tasks of up to 256 channels of one request keep the parallel loop balanced for small N.
  constexpr int64_t kChannelsPerTask = 256;
  const int64_t blocks = (pr.D + kChannelsPerTask - 1) / kChannelsPerTask;
  const int64_t tasks = int64_t(rows.size()) * blocks;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (tasks * kChannelsPerTask > 65536)
#endif
  for (int64_t task = 0; task < tasks; ++task) {
    const RowInfo& row = rows[size_t(task / blocks)];
    const int64_t c0 = (task % blocks) * kChannelsPerTask;
    const int64_t c1 = std::min(pr.D, c0 + kChannelsPerTask);
    for (int64_t c = c0; c < c1; ++c) cpu_detail::run_channel(p, pr, row, c);
  }
  return Status::ok();
}

}  // namespace gdn::conv
