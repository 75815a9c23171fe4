// A causal_conv1d_prefill test case with owning host buffers, a float64 reference of the tests'
// own (docs prefill.md §2, gdn-math.md §3.3 with an accepted count of 1), and the token-by-token
// check against causal_conv1d_update. Shared by the CPU and GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "conv_case.hpp"
#include "gdn/conv/params.hpp"
#include "gdn/conv_prefill/params.hpp"

namespace gdn::testing::conv_prefill_test {

using conv_test::Buffer;
using conv_test::out_tolerance;
using conv_test::stored_as;

struct Config {
  int64_t D = 40, W = 4, num_spec = 2, slots = 24;
  std::vector<int64_t> T;        // tokens per request (0 = padded row)
  std::vector<int64_t> initial;  // initial slot per request; empty = distinct random valid slots
  std::vector<int64_t> final_;   // final slot per request; empty = distinct random valid slots
  DType x_dtype = DType::kFloat32, out_dtype = DType::kFloat32, weight_dtype = DType::kFloat32,
        state_dtype = DType::kFloat32, index_dtype = DType::kInt32;
  conv::StateLayout layout = conv::StateLayout::kChannelsMajor;
  conv::Activation activation = conv::Activation::kSiLU;
  int64_t x_row_pad = 0, out_row_pad = 0, weight_row_pad = 0, slot_pad = 0;
  int64_t index_stride = 1;  // indices taken as a column of an [N, index_stride] array
  int64_t first_valid_slot = 0;
  bool in_place = false;  // out is x itself
  uint32_t seed = 1;
};

struct Case {
  Config cfg;
  int64_t N = 0, L = 0, buffer_len = 0, x_stride = 0, out_stride = 0, w_stride = 0, slot_stride = 0;
  Buffer x, out, weight, state;
  std::vector<int64_t> initial_, final_;            // resolved slots per request
  std::vector<uint8_t> initial_bytes, final_bytes;  // index_dtype storage, [N, index_stride]
  std::vector<int32_t> cu;

  explicit Case(Config c) : cfg(std::move(c)) {
    N = int64_t(cfg.T.size());
    buffer_len = cfg.W - 1 + cfg.num_spec;
    cu.assign(size_t(N + 1), 0);
    for (int64_t i = 0; i < N; ++i) cu[size_t(i + 1)] = cu[size_t(i)] + int32_t(cfg.T[size_t(i)]);
    L = cu.back();
    x_stride = cfg.D + cfg.x_row_pad;
    out_stride = cfg.in_place ? x_stride : cfg.D + cfg.out_row_pad;
    w_stride = cfg.W + cfg.weight_row_pad;
    slot_stride = cfg.D * buffer_len + cfg.slot_pad;
    std::mt19937 rng(cfg.seed);
    std::normal_distribution<float> n01;
    x = Buffer(cfg.x_dtype, L * x_stride);
    weight = Buffer(cfg.weight_dtype, cfg.D * w_stride);
    state = Buffer(cfg.state_dtype, cfg.slots * slot_stride);
    for (int64_t e = 0; e < x.count; ++e) x.set(e, n01(rng));
    for (int64_t e = 0; e < weight.count; ++e) weight.set(e, 0.5f * n01(rng));
    for (int64_t e = 0; e < state.count; ++e) state.set(e, n01(rng));
    if (cfg.in_place) {
      out = Buffer(cfg.x_dtype, 0);  // unused: out is x
    } else {
      out = Buffer(cfg.out_dtype, L * out_stride);
      poison_out();
    }
    // Distinct random slots: initial ones from the front of a permutation, final ones from the
    // back.
    std::vector<int64_t> perm(size_t(cfg.slots - cfg.first_valid_slot));
    std::iota(perm.begin(), perm.end(), cfg.first_valid_slot);
    std::shuffle(perm.begin(), perm.end(), rng);
    initial_ = cfg.initial;
    final_ = cfg.final_;
    if (initial_.empty())
      for (int64_t i = 0; i < N; ++i) initial_.push_back(perm[size_t(i) % perm.size()]);
    if (final_.empty())
      for (int64_t i = 0; i < N; ++i)
        final_.push_back(perm[perm.size() - 1 - size_t(i) % perm.size()]);
    const size_t bytes =
        size_t(std::max<int64_t>(N * cfg.index_stride, 1) * dtype_size(cfg.index_dtype));
    initial_bytes.assign(bytes, 0xEE);
    final_bytes.assign(bytes, 0xEE);
    for (int64_t i = 0; i < N; ++i) {
      set_initial(i, initial_[size_t(i)]);
      set_final(i, final_[size_t(i)]);
    }
  }

  void store_index(std::vector<uint8_t>& v, int64_t i, int64_t s) const {
    uint8_t* p = v.data() + i * cfg.index_stride * dtype_size(cfg.index_dtype);
    if (cfg.index_dtype == DType::kInt64) {
      std::memcpy(p, &s, 8);
    } else {
      const int32_t v32 = int32_t(s);
      std::memcpy(p, &v32, 4);
    }
  }
  void set_initial(int64_t i, int64_t s) {
    initial_[size_t(i)] = s;
    store_index(initial_bytes, i, s);
  }
  void set_final(int64_t i, int64_t s) {
    final_[size_t(i)] = s;
    store_index(final_bytes, i, s);
  }

  void poison_out() {
    for (int64_t e = 0; e < out.count; ++e) out.set(e, NAN);
  }
  Buffer& out_buffer() { return cfg.in_place ? x : out; }

  int64_t state_index(int64_t slot, int64_t c, int64_t pos) const {
    return conv::state_offset(cfg.layout, slot_stride, cfg.D, buffer_len, slot, c, pos);
  }

  TensorView state_view() {
    if (cfg.layout == conv::StateLayout::kChannelsMajor)
      return TensorView::make(state.data(), cfg.state_dtype, {cfg.slots, cfg.D, buffer_len},
                              {slot_stride, buffer_len, 1});
    return TensorView::make(state.data(), cfg.state_dtype, {cfg.slots, buffer_len, cfg.D},
                            {slot_stride, cfg.D, 1});
  }

  // Views over host memory; the GPU tests swap in device pointers.
  conv_prefill::Params params() {
    conv_prefill::Params p;
    p.x = TensorView::make(x.data(), cfg.x_dtype, {L, cfg.D}, {x_stride, 1});
    Buffer& o = out_buffer();
    p.out = TensorView::make(o.data(), o.dtype, {L, cfg.D}, {out_stride, 1});
    p.weight = TensorView::make(weight.data(), cfg.weight_dtype, {cfg.D, cfg.W}, {w_stride, 1});
    p.conv_state = state_view();
    p.initial_state_indices =
        TensorView::make(initial_bytes.data(), cfg.index_dtype, {N}, {cfg.index_stride});
    p.final_state_indices =
        TensorView::make(final_bytes.data(), cfg.index_dtype, {N}, {cfg.index_stride});
    p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {N + 1});
    p.layout = cfg.layout;
    p.activation = cfg.activation;
    p.first_valid_slot = cfg.first_valid_slot;
    return p;
  }
};

// What the reference expects: outputs (NaN where no request writes) and the pool afterwards, plus
// which pool elements the call writes.
struct Expected {
  std::vector<double> out;    // [L, D], NaN = not written
  std::vector<double> state;  // pool element values (as the state dtype stores them)
  std::vector<bool> written;  // pool elements the call writes
};

// Float64 reference: F = [history (zeros for a null initial slot) | stored inputs]; the taps over
// earlier tokens use the values as the pool stores them, the current token's tap its raw input;
// the final slot gets the last W - 1 entries of F and the initial slot's columns past them. The
// initial slots are read from the pool before the call (the tests never let a request read a slot
// another request writes).
inline Expected reference(const Case& c) {
  const Config& g = c.cfg;
  const int64_t H = g.W - 1;
  Expected e;
  e.out.assign(size_t(c.L * g.D), NAN);
  e.state.resize(size_t(c.state.count));
  e.written.assign(size_t(c.state.count), false);
  for (int64_t k = 0; k < c.state.count; ++k) e.state[size_t(k)] = c.state.get(k);
  for (int64_t i = 0; i < c.N; ++i) {
    const int64_t T = c.cu[size_t(i + 1)] - c.cu[size_t(i)];
    if (T == 0) continue;
    const int64_t init = c.initial_[size_t(i)] < g.first_valid_slot ? -1 : c.initial_[size_t(i)];
    const int64_t fin = c.final_[size_t(i)] < g.first_valid_slot ? -1 : c.final_[size_t(i)];
    for (int64_t ch = 0; ch < g.D; ++ch) {
      std::vector<double> frame, raw, tail;
      for (int64_t j = 0; j < H; ++j)
        frame.push_back(init < 0 ? 0.0 : double(c.state.get(c.state_index(init, ch, j))));
      for (int64_t pos = H; pos < c.buffer_len; ++pos)
        tail.push_back(init < 0 ? 0.0 : double(c.state.get(c.state_index(init, ch, pos))));
      for (int64_t t = 0; t < T; ++t) {
        const double v = c.x.get((c.cu[size_t(i)] + t) * c.x_stride + ch);
        raw.push_back(v);
        frame.push_back(stored_as(g.state_dtype, v));
      }
      for (int64_t t = 0; t < T; ++t) {
        double s = 0.0;
        for (int64_t j = 0; j < H; ++j)
          s += double(c.weight.get(ch * c.w_stride + j)) * frame[size_t(t + j)];
        s += double(c.weight.get(ch * c.w_stride + H)) * raw[size_t(t)];
        e.out[size_t((c.cu[size_t(i)] + t) * g.D + ch)] =
            g.activation == conv::Activation::kSiLU ? s / (1.0 + std::exp(-s)) : s;
      }
      if (fin < 0) continue;
      for (int64_t pos = 0; pos < c.buffer_len; ++pos) {
        const size_t k = size_t(c.state_index(fin, ch, pos));
        e.state[k] = pos < H ? frame[size_t(T + pos)] : tail[size_t(pos - H)];
        e.written[k] = true;
      }
    }
  }
  return e;
}

// Empty string when `got` (outputs, [L, D] at stride out_stride) and `state_after` match `e`;
// otherwise the first mismatch. Rows the reference leaves NaN must still hold `out_before`.
inline std::string compare(const Case& c, const Expected& e, const Buffer& got,
                           const Buffer& out_before, const Buffer& state_before,
                           const Buffer& state_after) {
  for (int64_t l = 0; l < c.L; ++l)
    for (int64_t ch = 0; ch < c.cfg.D; ++ch) {
      const double want = e.out[size_t(l * c.cfg.D + ch)];
      const int64_t k = l * c.out_stride + ch;
      const double have = got.get(k);
      if (std::isnan(want)) {
        if (!got.same_bits(out_before, k, 1))
          return "out[" + std::to_string(l) + ", " + std::to_string(ch) +
                 "] of no request was written";
        continue;
      }
      if (!(std::fabs(have - want) <= out_tolerance(got.dtype, want)))
        return "out[" + std::to_string(l) + ", " + std::to_string(ch) +
               "] = " + std::to_string(have) + ", reference " + std::to_string(want);
    }
  for (int64_t k = 0; k < state_after.count; ++k) {
    if (!e.written[size_t(k)]) {
      if (!state_after.same_bits(state_before, k, 1))
        return "conv_state element " + std::to_string(k) +
               " is not the call's to write but changed";
    } else if (double(state_after.get(k)) != e.state[size_t(k)]) {
      return "conv_state element " + std::to_string(k) + " = " +
             std::to_string(state_after.get(k)) + ", reference " +
             std::to_string(e.state[size_t(k)]) + " (must be bit-exact)";
    }
  }
  return {};
}

// Runs one call on `c` (`run(Case&)` executes it in place on the case's host buffers and returns
// its Status) and compares the result with the reference taken before it. Empty string = match.
template <class Run>
std::string run_against_reference(Case& c, Run&& run) {
  const Expected e = reference(c);
  const Buffer out_before = c.out_buffer();
  const Buffer state_before = c.state;
  if (const Status s = run(c); !s.is_ok()) return "call failed: " + s.reason();
  return compare(c, e, c.out_buffer(), out_before, state_before, c.state);
}

// The request lengths every grid point covers: shorter than W - 1, around the 64-row tiles, long.
inline std::vector<int64_t> edge_lengths(int64_t long_length) {
  return {3, 0, 1, 2, 4, 63, 64, 65, long_length, 5};
}

// A causal_conv1d_update call (accepted counts all 1) over `pool` (a case's pool layout and dtype):
// requests with rows cu[i]..cu[i+1] of x (D columns, row stride x_stride) in slots `slots`.
struct UpdateCall {
  conv::Params p;
  std::vector<int32_t> slots, cu;
};
inline void make_update(UpdateCall& u, Case& c, Buffer& x, int64_t x_stride, Buffer& out,
                        std::vector<int32_t> slots, std::vector<int32_t> cu,
                        std::vector<int32_t>* acc = nullptr) {
  u.slots = std::move(slots);
  u.cu = std::move(cu);
  const int64_t rows = u.cu.back(), N = int64_t(u.slots.size());
  u.p = conv::Params{};
  u.p.x = TensorView::make(x.data(), x.dtype, {rows, c.cfg.D}, {x_stride, 1});
  u.p.out = TensorView::make(out.data(), out.dtype, {rows, c.cfg.D}, {c.cfg.D, 1});
  u.p.weight =
      TensorView::make(c.weight.data(), c.cfg.weight_dtype, {c.cfg.D, c.cfg.W}, {c.w_stride, 1});
  u.p.conv_state = c.state_view();
  u.p.conv_state_indices = TensorView::make(u.slots.data(), DType::kInt32, {N});
  u.p.cu_seqlens = TensorView::make(u.cu.data(), DType::kInt32, {N + 1});
  if (acc) u.p.num_accepted_tokens = TensorView::make(acc->data(), DType::kInt32, {N});
  u.p.layout = c.cfg.layout;
  u.p.activation = c.cfg.activation;
  u.p.first_valid_slot = c.cfg.first_valid_slot;
}

// The strongest check: a prefill, then causal_conv1d_update steps, against the same tokens going
// through causal_conv1d_update one at a time. `seq` is a copy of the case (before the prefill)
// whose pool starts with each request's final slot holding its initial slot's buffer (zeros for a
// null id); per request, one-token updates on the final slot must give the prefill's outputs and
// final buffer bit for bit, and then verify steps (num_spec + 1 tokens, random accepted counts) on
// both pools must agree bit for bit. `prefill(Case&)` and `update(Case&, conv::Params)` run one
// call each. Empty string = equal.
template <class Prefill, class Update>
std::string prefill_then_updates(Config g, Prefill&& prefill, Update&& update) {
  Case pre(g);
  Case seq = pre;
  for (int64_t i = 0; i < pre.N; ++i) {
    const int64_t init = pre.initial_[size_t(i)], fin = pre.final_[size_t(i)];
    if (fin < g.first_valid_slot || pre.cu[size_t(i + 1)] == pre.cu[size_t(i)]) continue;
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < pre.buffer_len; ++pos)
        seq.state.set(
            seq.state_index(fin, ch, pos),
            init < g.first_valid_slot ? 0.0f : pre.state.get(pre.state_index(init, ch, pos)));
  }
  const Buffer x_before = pre.x;  // in place, the prefill overwrites x
  if (const Status s = prefill(pre); !s.is_ok()) return "prefill failed: " + s.reason();
  const Buffer& pre_out = pre.out_buffer();
  Buffer one(g.x_dtype, g.D), one_out(g.out_dtype, g.D);
  for (int64_t i = 0; i < pre.N; ++i) {
    const int64_t fin = pre.final_[size_t(i)];
    if (fin < g.first_valid_slot) continue;
    for (int64_t l = pre.cu[size_t(i)]; l < pre.cu[size_t(i + 1)]; ++l) {
      for (int64_t ch = 0; ch < g.D; ++ch) one.set(ch, x_before.get(l * pre.x_stride + ch));
      UpdateCall u;
      make_update(u, seq, one, g.D, one_out, {int32_t(fin)}, {0, 1});
      if (const Status s = update(seq, u.p); !s.is_ok()) return "update failed: " + s.reason();
      for (int64_t ch = 0; ch < g.D; ++ch)
        if (!one_out.bits_equal(ch, pre_out, l * pre.out_stride + ch))
          return "request " + std::to_string(i) + " row " + std::to_string(l) + " channel " +
                 std::to_string(ch) + ": prefill output " +
                 std::to_string(pre_out.get(l * pre.out_stride + ch)) + " vs one-token update " +
                 std::to_string(one_out.get(ch));
    }
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < pre.buffer_len; ++pos)
        if (!pre.state.bits_equal(pre.state_index(fin, ch, pos), seq.state,
                                  seq.state_index(fin, ch, pos)))
          return "request " + std::to_string(i) + " channel " + std::to_string(ch) +
                 " buffer column " + std::to_string(pos) +
                 ": the final slot differs from one-token updates'";
  }
  // Verify steps on every final slot, in both pools.
  std::vector<int32_t> slots, cu{0}, acc;
  for (int64_t i = 0; i < pre.N; ++i)
    if (pre.final_[size_t(i)] >= g.first_valid_slot && pre.cu[size_t(i + 1)] > pre.cu[size_t(i)])
      slots.push_back(int32_t(pre.final_[size_t(i)]));
  const int64_t S = g.num_spec + 1, n = int64_t(slots.size());
  for (int64_t i = 0; i < n; ++i) cu.push_back(cu.back() + int32_t(S));
  acc.assign(size_t(n), 1);
  std::mt19937 rng(g.seed + 99);
  std::normal_distribution<float> n01;
  Buffer xs(g.x_dtype, n * S * g.D), out_a(g.out_dtype, n * S * g.D), out_b = out_a;
  for (int step = 0; step < 4; ++step) {
    for (int64_t e = 0; e < xs.count; ++e) xs.set(e, n01(rng));
    UpdateCall a, b;
    make_update(a, pre, xs, g.D, out_a, slots, cu, &acc);
    make_update(b, seq, xs, g.D, out_b, slots, cu, &acc);
    if (const Status s = update(pre, a.p); !s.is_ok()) return "verify failed: " + s.reason();
    if (const Status s = update(seq, b.p); !s.is_ok()) return "verify failed: " + s.reason();
    if (!out_a.same_bits(out_b, 0, out_a.count))
      return "verify step " + std::to_string(step) + ": outputs differ";
    if (!pre.state.same_bits(seq.state, 0, pre.state.count))
      return "verify step " + std::to_string(step) + ": pools differ";
    for (auto& a_i : acc) a_i = int32_t(1 + rng() % uint32_t(S));
  }
  return {};
}

// A point of the tests' grid: layout, state dtype, x and out dtype, width.
using GridParam = std::tuple<conv::StateLayout, DType /*state*/, DType /*x and out*/, int /*W*/>;
struct GridName {
  template <class ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    const auto& [layout, state, act, W] = info.param;
    return std::string(conv::to_string(layout)) + "_state_" + std::string(to_string(state)) +
           "_x_" + std::string(to_string(act)) + "_W" + std::to_string(W);
  }
};

// The case of a grid point: D channels, requests of edge_lengths(long_length) tokens.
inline Config grid_config(const GridParam& point, uint32_t seed, int64_t D, int64_t long_length) {
  const auto& [layout, state, act, W] = point;
  Config g;
  g.layout = layout;
  g.state_dtype = state;
  g.x_dtype = g.out_dtype = act;
  g.W = W;
  g.D = D;
  g.T = edge_lengths(long_length);
  g.seed = seed + uint32_t(W);
  return g;
}

}  // namespace gdn::testing::conv_prefill_test
