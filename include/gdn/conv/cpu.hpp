// causal_conv1d_update on the CPU: the whole call is validated first (an invalid row fails the call
// before anything is written), then every (request, block of channels) slides its W-tap window
// over the request's tokens. Host-only; parallel with OpenMP when enabled (large calls only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/conv/params.hpp"
#include "gdn/core/cpu_call.hpp"

namespace gdn::conv {
namespace cpu_detail {

// Channels handled together: every per-channel loop below runs over a block of this many
// contiguous channels (vectorisable); the block's window lives on the stack.
inline constexpr int64_t kBlock = 256;

template <class T>
void gather_typed(const T* src, int64_t stride, int64_t n, float* dst) {
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_float(src[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_float(src[k * stride]);
  }
}

template <class T>
void scatter_typed(T* dst, int64_t stride, int64_t n, const float* src) {
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) dst[k] = from_float<T>(src[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k * stride] = from_float<T>(src[k]);
  }
}

// n elements p[offset + k * stride] of a run-time-typed floating array <-> fp32 (one switch per
// span, not per element).
inline void gather(const void* p, DType t, int64_t offset, int64_t stride, int64_t n, float* dst) {
  switch (t) {
    case DType::kBFloat16:
      gather_typed(static_cast<const bf16_t*>(p) + offset, stride, n, dst);
      break;
    case DType::kFloat16:
      gather_typed(static_cast<const f16_t*>(p) + offset, stride, n, dst);
      break;
    default:
      gather_typed(static_cast<const float*>(p) + offset, stride, n, dst);
      break;
  }
}

inline void scatter(void* p, DType t, int64_t offset, int64_t stride, int64_t n, const float* src) {
  switch (t) {
    case DType::kBFloat16:
      scatter_typed(static_cast<bf16_t*>(p) + offset, stride, n, src);
      break;
    case DType::kFloat16:
      scatter_typed(static_cast<f16_t*>(p) + offset, stride, n, src);
      break;
    default:
      scatter_typed(static_cast<float*>(p) + offset, stride, n, src);
      break;
  }
}

// The values n floats take once stored in (and read back from) an array of dtype t.
inline void round_to(DType t, const float* src, int64_t n, float* dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = gdn::round_to(t, src[k]);
}

// The W taps of channels [c0, c0 + n) of `weight` [D, W]: w[j][c] is tap j of channel c0 + c.
inline void load_taps(const TensorView& weight, int64_t c0, int64_t n, int64_t W,
                      float (*w)[kBlock]) {
  for (int64_t j = 0; j < W; ++j)
    gather(weight.data, weight.dtype, c0 * weight.strides[0] + j, weight.strides[0], n, w[j]);
}

// One token of the convolution over n channels: acc = act(sum_j w[j] * window[j] + w[W - 1] * x),
// window holding the W - 1 inputs before x, oldest first. The sum runs over the taps in ascending
// order, as on every path, so every run that uses this agrees bit for bit.
inline void convolve_token(const float (*w)[kBlock], float* const* window, const float* x,
                           int64_t W, int64_t n, Activation activation, float* acc) {
  for (int64_t c = 0; c < n; ++c) acc[c] = 0.0f;
  for (int64_t j = 0; j < W - 1; ++j)
    for (int64_t c = 0; c < n; ++c) acc[c] += w[j][c] * window[j][c];
  for (int64_t c = 0; c < n; ++c) acc[c] += w[W - 1][c] * x[c];
  if (activation == Activation::kSiLU)
    for (int64_t c = 0; c < n; ++c) acc[c] = acc[c] / (1.0f + std::exp(-acc[c]));
}

// Moves a window of W - 1 slots on by one token: the oldest slot takes x as a state of dtype
// `state` stores it and becomes the newest.
inline void push_window(float** window, int64_t W, DType state, const float* x, int64_t n) {
  float* oldest = window[0];
  for (int64_t j = 0; j + 1 < W - 1; ++j) window[j] = window[j + 1];
  window[W - 2] = oldest;
  round_to(state, x, n, window[W - 2]);
}

// Blocks of kBlock channels that D channels make.
inline int64_t channel_blocks(int64_t D) { return (D + kBlock - 1) / kBlock; }

// The run of a checked conv call: run_block(p, pr, row, c0, n) for every request row and block of
// channels [c0, c0 + n), on OpenMP threads when `parallel`; `dynamic` schedules the blocks one at
// a time (rows of unequal lengths), else in equal static shares.
template <class Params, class Problem, class RowInfo, class RunBlock>
void run_channel_blocks(const Params& p, const Problem& pr, const std::vector<RowInfo>& rows,
                        bool parallel, bool dynamic, RunBlock&& run_block) {
  const int64_t blocks = channel_blocks(pr.D);
  const int64_t tasks = int64_t(rows.size()) * blocks;
  const auto task = [&](int64_t i) {
    const int64_t c0 = (i % blocks) * kBlock;
    run_block(p, pr, rows[size_t(i / blocks)], c0, std::min(kBlock, pr.D - c0));
  };
  (void)parallel;
  (void)dynamic;
#if defined(_OPENMP)
  if (dynamic) {
#pragma omp parallel for schedule(dynamic) if (parallel)
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel)
#endif
  for (int64_t i = 0; i < tasks; ++i) task(i);
}

// One request, channels [c0, c0 + n): read the accepted window, shift the buffer, convolve the
// new tokens.
inline void run_block(const Params& p, const Problem& pr, const RowInfo& row, int64_t c0,
                      int64_t n) {
  const int64_t W = pr.W;
  // Buffer position `pos` of channels c0.. : base offset and the stride between channels.
  const int64_t channel_stride = p.layout == StateLayout::kChannelsMajor ? pr.buffer_len : 1;
  const auto at = [&](int64_t pos) {
    return state_offset(p.layout, pr.slot_stride, pr.D, pr.buffer_len, row.slot, c0, pos);
  };
  float w[kConvMaxWidth][kBlock];
  float storage[kConvMaxWidth][kBlock];  // window slots, oldest first, rotated through `window`
  float x[kBlock], acc[kBlock];
  float* window[kConvMaxWidth];
  load_taps(p.weight, c0, n, W, w);
  // Read the whole accepted window before the buffer is rewritten (old and new windows overlap).
  for (int64_t j = 0; j < W - 1; ++j) {
    window[j] = storage[j];
    gather(p.conv_state.data, p.conv_state.dtype, at(row.offset + j), channel_stride, n, window[j]);
  }
  window[W - 1] = storage[W - 1];  // free slot for the newest input
  for (int64_t j = 0; j + 1 < W - 1; ++j)
    scatter(p.conv_state.data, p.conv_state.dtype, at(j), channel_stride, n, window[j + 1]);
  for (int64_t t = 0; t < row.T; ++t) {
    const int64_t l = row.begin + t;
    gather(p.x.data, p.x.dtype, l * p.x.strides[0] + c0, 1, n, x);  // before out: may be x itself
    convolve_token(w, window, x, W, n, p.activation, acc);
    scatter(p.out.data, p.out.dtype, l * p.out.strides[0] + c0, 1, n, acc);
    scatter(p.conv_state.data, p.conv_state.dtype, at(W - 2 + t), channel_stride, n, x);
    push_window(window, W, p.conv_state.dtype, x, n);
  }
}

}  // namespace cpu_detail

// Runs causal_conv1d_update on host memory. Validates everything first: on error nothing is
// written. Skipped rows (T = 0, null conv slot) leave their output rows and the pool untouched.
inline Status run_cpu(const Params& p) {
  Problem pr;
  std::vector<RowInfo> rows;
  GDN_RETURN_IF_ERROR(check_cpu_call(p, &pr, &rows));
  // Tasks of one request's block of channels keep the parallel loop balanced for small N; small
  // calls stay on one thread (a parallel region costs more than they do).
  const bool parallel =
      int64_t(rows.size()) * cpu_detail::channel_blocks(pr.D) * cpu_detail::kBlock > 65536;
  cpu_detail::run_channel_blocks(p, pr, rows, parallel, /*dynamic=*/false, cpu_detail::run_block);
  return Status::ok();
}

}  // namespace gdn::conv
