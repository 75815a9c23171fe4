// Replay verify on the CPU: the whole call is validated first, then every (request, value head)
// reads its checkpoint row by row, replays the accepted window tokens, stores the checkpoint once
// and runs the new tokens (outputs only); after all of them, every request saves its new tokens
// into its window. The fp32 math is decode_mtp's CPU path, shared code and the same rounding
// points, so with an fp32 state a chain of replay calls matches write-every-token decode_mtp and
// one-token-at-a-time decoding bit for bit. Host-only; parallel with OpenMP when enabled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gdn/core/cpu_call.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::replay {
namespace cpu_detail {

using decode_mtp::cpu_detail::delta_rule_row;
using decode_mtp::cpu_detail::dot;
using decode_mtp::cpu_detail::HeadInputs;
using decode_mtp::cpu_detail::load_row;
using decode_mtp::cpu_detail::Scratch;
using decode_mtp::cpu_detail::StateRow;

// One (request, value head). Scratch token positions 0..n-1 hold the replayed window tokens,
// n..n+T-1 the new ones. Each state row is read once from the checkpoint, advanced through the n
// replayed tokens, stored back (the row was read first, so the slot is its own source safely),
// then advanced through the new tokens for their outputs only. kRatio = 0: run-time ratio.
template <class StateT, int kRatio>
void run_head(const Params& p, const Problem& pr, const RowInfo& row, int64_t hv, Scratch& sc) {
  const int64_t ratio = kRatio == kRuntimeValue ? pr.ratio : kRatio;
  const int64_t h = hv / ratio;  // grouped GVA: value head hv reads key head hv / r
  const HeadInputs inputs(p, pr, h, hv);
  const int64_t K = pr.K, V = pr.V, n = row.replay, T = row.T;

  for (int64_t j = 0; j < n; ++j) {  // raw window token j: same loads and math as its first pass
    load_row(p.window_k.data, p.window_k.dtype, window_offset(p.window_k, row.slot, j) + h * K, K,
             sc.k.data() + j * K);
    load_row(p.window_v.data, p.window_v.dtype, window_offset(p.window_v, row.slot, j) + hv * V, V,
             sc.v.data() + j * V);
    inputs.finish_token(
        load_float(p.window_a.data, p.window_a.dtype, window_offset(p.window_a, row.slot, j) + hv),
        load_float(p.window_b.data, p.window_b.dtype, window_offset(p.window_b, row.slot, j) + hv),
        j, sc);
  }
  for (int64_t t = 0; t < T; ++t) inputs.load_call_token(row.begin + t, n + t, sc);

  const auto checkpoint = StateRow<StateT>::at(p, pr, row.slot, hv);
  float* Sr = sc.row.data();
  for (int64_t r = 0; r < V; ++r) {
    checkpoint.load(r, K, Sr);
    for (int64_t j = 0; j < n; ++j) delta_rule_row(Sr, sc, j, r, K, V);
    if (n > 0) checkpoint.store(r, K, Sr);  // n = 0 would store what was just read
    for (int64_t t = n; t < n + T; ++t) {
      delta_rule_row(Sr, sc, t, r, K, V);
      sc.o[size_t(t * V + r)] = dot(Sr, sc.q.data() + t * K, K);
    }
  }
  decode_mtp::cpu_detail::store_outputs(p, pr, row.begin, T, hv, n, sc);
}

// Copies `count` elements (same dtype on both sides) between run-time-typed arrays.
inline void copy_elements(const TensorView& dst, int64_t dst_offset, const TensorView& src,
                          int64_t src_offset, int64_t count) {
  const auto esize = size_t(dtype_size(src.dtype));
  std::memcpy(static_cast<char*>(dst.data) + size_t(dst_offset) * esize,
              static_cast<const char*>(src.data) + size_t(src_offset) * esize,
              size_t(count) * esize);
}

// Saves a live row's T new tokens into its slot's window (raw k, v, a, b rows, bytes as given)
// and records window_len[slot] = T.
inline void save_window(const Params& p, const Problem& pr, const RowInfo& row) {
  const int64_t HK = pr.H * pr.K;
  for (int64_t t = 0; t < row.T; ++t) {
    const int64_t l = row.begin + t, qkv_row = l * p.mixed_qkv.strides[0];
    copy_elements(p.window_k, window_offset(p.window_k, row.slot, t), p.mixed_qkv, qkv_row + HK,
                  HK);
    copy_elements(p.window_v, window_offset(p.window_v, row.slot, t), p.mixed_qkv, qkv_row + 2 * HK,
                  pr.HV * pr.V);
    copy_elements(p.window_a, window_offset(p.window_a, row.slot, t), p.a, l * p.a.strides[0],
                  pr.HV);
    copy_elements(p.window_b, window_offset(p.window_b, row.slot, t), p.b, l * p.b.strides[0],
                  pr.HV);
  }
  p.window_len.ptr<int32_t>()[row.slot] = int32_t(row.T);
}

// run_cpu_call's run: the validated call, for its state dtype and head ratio.
struct RunAll {
  template <class StateT, int kRatio>
  void operator()(const Params& p, const Problem& pr, const std::vector<RowInfo>& rows) const {
    int64_t max_tokens = 0, tokens = 0;
    for (const RowInfo& r : rows) {
      if (!r.live) continue;
      max_tokens = std::max(max_tokens, r.replay + r.T);
      tokens += r.replay + r.T;
    }
    const bool parallel = decode_mtp::cpu_detail::use_threads(pr, tokens);
    // Every window read happens in this pass; the saves below start only after it has finished.
    decode_mtp::cpu_detail::for_each_head(
        pr, parallel, max_tokens, [&](int64_t i, int64_t hv, Scratch& sc) {
          if (rows[size_t(i)].live) run_head<StateT, kRatio>(p, pr, rows[size_t(i)], hv, sc);
        });
    (void)parallel;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
#endif
    for (int64_t i = 0; i < pr.N; ++i)
      if (rows[size_t(i)].live) save_window(p, pr, rows[size_t(i)]);
  }
};

}  // namespace cpu_detail

// Runs replay verify on host memory. Validates everything first: on error nothing is written.
inline Status run_cpu(const Params& p) {
  return run_cpu_call<Problem, RowInfo>(p, cpu_detail::RunAll{});
}

}  // namespace gdn::replay
