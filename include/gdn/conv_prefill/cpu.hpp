// causal_conv1d_prefill on the CPU: the whole call is validated first (an invalid row fails the
// call before anything is written), then every (request, block of channels) slides its W-tap
// window over the request's tokens, with the per-token math of causal_conv1d_update's CPU run
// (gdn/conv/cpu.hpp), so the two agree bit for bit. Host-only; parallel with OpenMP when enabled
// (large calls only).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/conv/cpu.hpp"
#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/cpu_call.hpp"

namespace gdn::conv_prefill {
namespace cpu_detail {

// causal_conv1d_update's span loaders and stores (run-time dtype <-> fp32).
namespace span = conv::cpu_detail;

// Channels handled together, as in causal_conv1d_update's CPU run.
inline constexpr int64_t kBlock = span::kBlock;

// One request, channels [c0, c0 + n). Everything read from the initial slot is read before the
// final slot is written, so the two may be one slot.
inline void run_block(const Params& p, const Problem& pr, const RowInfo& row, int64_t c0,
                      int64_t n) {
  const int64_t W = pr.W, H = W - 1;
  const int64_t channel_stride = p.layout == StateLayout::kChannelsMajor ? pr.buffer_len : 1;
  const auto at = [&](int64_t slot, int64_t pos) {
    return conv::state_offset(p.layout, pr.slot_stride, pr.D, pr.buffer_len, slot, c0, pos);
  };
  float w[kConvMaxWidth][kBlock];
  float storage[kConvMaxWidth][kBlock];  // window slots, oldest first, rotated through `window`
  float x[kBlock], acc[kBlock];
  float* window[kConvMaxWidth];
  span::load_taps(p.weight, c0, n, W, w);
  for (int64_t j = 0; j < H; ++j) {
    window[j] = storage[j];
    if (row.initial >= 0)
      span::gather(p.conv_state.data, p.conv_state.dtype, at(row.initial, j), channel_stride, n,
                   window[j]);
    else
      std::fill(window[j], window[j] + n, 0.0f);
  }
  window[H] = storage[H];  // free slot for the newest input
  for (int64_t t = 0; t < row.T; ++t) {
    const int64_t l = row.begin + t;
    span::gather(p.x.data, p.x.dtype, l * p.x.strides[0] + c0, 1, n, x);  // before out: may be x
    span::convolve_token(w, window, x, W, n, p.activation, acc);
    span::scatter(p.out.data, p.out.dtype, l * p.out.strides[0] + c0, 1, n, acc);
    span::push_window(window, W, p.conv_state.dtype, x, n);
  }
  if (row.final_slot < 0) return;
  // The columns past the window: the initial slot's (what one-token updates leave), read before
  // the final slot is written; nothing to copy when the two are one slot.
  if (row.final_slot != row.initial) {
    for (int64_t pos = H; pos < pr.buffer_len; ++pos) {
      if (row.initial >= 0)
        span::gather(p.conv_state.data, p.conv_state.dtype, at(row.initial, pos), channel_stride, n,
                     x);
      else
        std::fill(x, x + n, 0.0f);
      span::scatter(p.conv_state.data, p.conv_state.dtype, at(row.final_slot, pos), channel_stride,
                    n, x);
    }
  }
  for (int64_t j = 0; j < H; ++j)
    span::scatter(p.conv_state.data, p.conv_state.dtype, at(row.final_slot, j), channel_stride, n,
                  window[j]);
}

}  // namespace cpu_detail

// Runs causal_conv1d_prefill on host memory. Validates everything first: on error nothing is
// written. Padded rows (T = 0) leave their slots untouched; a null final slot is not written.
inline Status run_cpu(const Params& p) {
  Problem pr;
  std::vector<RowInfo> rows;
  GDN_RETURN_IF_ERROR(check_cpu_call(p, &pr, &rows));
  int64_t tokens = 0;
  for (const RowInfo& r : rows) tokens += r.T;
  const bool parallel =
      tokens * pr.D > 65536 && int64_t(rows.size()) * cpu_detail::span::channel_blocks(pr.D) > 1;
  // Requests of unequal lengths: blocks scheduled one at a time.
  cpu_detail::span::run_channel_blocks(p, pr, rows, parallel, /*dynamic=*/true,
                                       cpu_detail::run_block);
  return Status::ok();
}

}  // namespace gdn::conv_prefill
