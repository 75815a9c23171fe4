// A causal_conv1d_update test case with owning host buffers, a float64 reference of the tests'
// own (gdn-math.md §3.3 / §7 conv pre-step), and comparison helpers. Shared by the CPU and GPU
// tests.
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

#include "gdn/conv/params.hpp"
#include "gdn/core/dtype.hpp"

namespace gdn::testing::conv_test {

// Host storage of a floating tensor in fp32 / bf16 / fp16, kept as raw bytes.
struct Buffer {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;
  int64_t count = 0;

  Buffer() = default;
  Buffer(DType t, int64_t n)
      : dtype(t), bytes(size_t(std::max<int64_t>(n, 1) * dtype_size(t))), count(n) {}
  void set(int64_t i, float v) { store_float(bytes.data(), dtype, i, v); }
  float get(int64_t i) const { return load_float(bytes.data(), dtype, i); }
  void* data() { return bytes.data(); }
  // Element i of this and element j of `o` (same dtype) hold the same bits.
  bool bits_equal(int64_t i, const Buffer& o, int64_t j) const {
    const int64_t e = dtype_size(dtype);
    return dtype == o.dtype &&
           std::memcmp(bytes.data() + i * e, o.bytes.data() + j * e, size_t(e)) == 0;
  }
  bool same_bits(const Buffer& o, int64_t begin, int64_t n) const {
    const int64_t e = dtype_size(dtype);
    return std::memcmp(bytes.data() + begin * e, o.bytes.data() + begin * e, size_t(n * e)) == 0;
  }
};

struct Config {
  int64_t D = 40, W = 4, num_spec = 3, slots = 12;
  std::vector<int64_t> T;     // tokens per request (0 = padded row)
  std::vector<int64_t> acc;   // accepted counts; empty = argument absent (all 1)
  std::vector<int64_t> slot;  // conv slot per request; empty = distinct random valid slots
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
  int64_t N = 0, L = 0, buffer_len = 0, S = 0, x_stride = 0, out_stride = 0, w_stride = 0,
          slot_stride = 0;
  Buffer x, out, weight, state;
  std::vector<int64_t> slots_;   // resolved slot per request
  std::vector<uint8_t> indices;  // index_dtype storage, [N, index_stride]
  std::vector<int32_t> cu, acc;

  explicit Case(Config c) : cfg(std::move(c)) {
    N = int64_t(cfg.T.size());
    buffer_len = cfg.W - 1 + cfg.num_spec;
    S = cfg.num_spec + 1;
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
    slots_ = cfg.slot;
    if (slots_.empty()) {
      std::vector<int64_t> perm(size_t(cfg.slots - cfg.first_valid_slot));
      std::iota(perm.begin(), perm.end(), cfg.first_valid_slot);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t i = 0; i < N; ++i) slots_.push_back(perm[size_t(i) % perm.size()]);
    }
    const int64_t isz = dtype_size(cfg.index_dtype);
    indices.assign(size_t(std::max<int64_t>(N * cfg.index_stride, 1) * isz), 0xEE);
    for (int64_t i = 0; i < N; ++i) set_slot(i, slots_[size_t(i)]);
    for (int64_t a : cfg.acc) acc.push_back(int32_t(a));
  }

  void set_slot(int64_t i, int64_t s) {
    slots_[size_t(i)] = s;
    uint8_t* p = indices.data() + i * cfg.index_stride * dtype_size(cfg.index_dtype);
    if (cfg.index_dtype == DType::kInt64) {
      std::memcpy(p, &s, 8);
    } else {
      const int32_t v = int32_t(s);
      std::memcpy(p, &v, 4);
    }
  }

  void poison_out() {
    for (int64_t e = 0; e < out.count; ++e) out.set(e, NAN);
  }

  Buffer& out_buffer() { return cfg.in_place ? x : out; }
  int64_t out_row_stride() const { return out_stride; }

  int64_t state_index(int64_t slot, int64_t c, int64_t pos) const {
    return conv::state_offset(cfg.layout, slot_stride, cfg.D, buffer_len, slot, c, pos);
  }

  // Views over host memory; the GPU tests swap in device pointers.
  conv::Params params() {
    conv::Params p;
    p.x = TensorView::make(x.data(), cfg.x_dtype, {L, cfg.D}, {x_stride, 1});
    Buffer& o = out_buffer();
    p.out = TensorView::make(o.data(), o.dtype, {L, cfg.D}, {out_stride, 1});
    p.weight = TensorView::make(weight.data(), cfg.weight_dtype, {cfg.D, cfg.W}, {w_stride, 1});
    if (cfg.layout == conv::StateLayout::kChannelsMajor)
      p.conv_state = TensorView::make(state.data(), cfg.state_dtype, {cfg.slots, cfg.D, buffer_len},
                                      {slot_stride, buffer_len, 1});
    else
      p.conv_state = TensorView::make(state.data(), cfg.state_dtype, {cfg.slots, buffer_len, cfg.D},
                                      {slot_stride, cfg.D, 1});
    p.conv_state_indices =
        TensorView::make(indices.data(), cfg.index_dtype, {N}, {cfg.index_stride});
    p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {N + 1});
    if (!cfg.acc.empty()) p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {N});
    p.layout = cfg.layout;
    p.activation = cfg.activation;
    p.first_valid_slot = cfg.first_valid_slot;
    return p;
  }
};

// What the reference expects: outputs (NaN where no valid request writes) and the pool afterwards,
// plus which state elements a call may write.
struct Expected {
  std::vector<double> out;    // [L, D], NaN = not written
  std::vector<double> state;  // pool element values (as the state dtype stores them)
  std::vector<bool> written;  // pool elements the call writes
};

inline double stored_as(DType t, double v) {
  uint8_t tmp[8];
  store_float(tmp, t, 0, float(v));
  return load_float(tmp, t, 0);
}

// Float64 reference: F = [window at offset acc-1 | new inputs], taps over earlier tokens use the
// values as the pool stores them, the current token's tap its raw input.
inline Expected reference(const Case& c) {
  const Config& g = c.cfg;
  Expected e;
  e.out.assign(size_t(c.L * g.D), NAN);
  e.state.resize(size_t(c.state.count));
  e.written.assign(size_t(c.state.count), false);
  for (int64_t k = 0; k < c.state.count; ++k) e.state[size_t(k)] = c.state.get(k);
  for (int64_t i = 0; i < c.N; ++i) {
    const int64_t T = c.cu[size_t(i + 1)] - c.cu[size_t(i)];
    const int64_t slot = c.slots_[size_t(i)];
    if (T == 0 || slot < g.first_valid_slot) continue;
    const int64_t off = (c.acc.empty() ? 1 : c.acc[size_t(i)]) - 1;  // the arrays the call reads
    for (int64_t ch = 0; ch < g.D; ++ch) {
      std::vector<double> frame;  // stored values, oldest first
      std::vector<double> raw;    // raw inputs of this call
      for (int64_t j = 0; j < g.W - 1; ++j)
        frame.push_back(e.state[size_t(c.state_index(slot, ch, off + j))]);
      for (int64_t t = 0; t < T; ++t) {
        const double v = c.x.get((c.cu[size_t(i)] + t) * c.x_stride + ch);
        raw.push_back(v);
        frame.push_back(stored_as(g.state_dtype, v));
      }
      for (int64_t t = 0; t < T; ++t) {
        double s = 0.0;
        for (int64_t j = 0; j < g.W - 1; ++j)
          s += double(c.weight.get(ch * c.w_stride + j)) * frame[size_t(t + j)];
        s += double(c.weight.get(ch * c.w_stride + g.W - 1)) * raw[size_t(t)];
        e.out[size_t((c.cu[size_t(i)] + t) * g.D + ch)] =
            g.activation == conv::Activation::kSiLU ? s / (1.0 + std::exp(-s)) : s;
      }
      // New buffer: [window[1..W-2] | stored new inputs].
      for (int64_t pos = 0; pos < g.W - 2 + T; ++pos) {
        const size_t k = size_t(c.state_index(slot, ch, pos));
        e.state[k] = frame[size_t(pos + 1)];
        e.written[k] = true;
      }
    }
  }
  return e;
}

// Tolerance of one output element: compute error of an fp32 W-tap sum plus one rounding to `out`.
inline double out_tolerance(DType out, double ref) {
  const double unit = out == DType::kBFloat16  ? 1.0 / 256
                      : out == DType::kFloat16 ? 1.0 / 2048
                                               : 4e-7;
  return unit * std::fabs(ref) + 2e-6;
}

// Empty string when `got` (outputs of a run, [L, D] at stride out_stride) and `state_after`
// match `e`; otherwise the first mismatch. `untouched_out` says whether rows the reference
// leaves NaN must still hold their previous value (`out_before`).
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
                 "] of a skipped row was written";
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

// `g` with N requests of random T in [0, S] (row 0 full length) and accepted counts in [1, S].
inline Config random_rows(Config g, int64_t N, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t S = g.num_spec + 1;
  g.T.clear();
  g.acc.clear();
  for (int64_t i = 0; i < N; ++i) {
    g.T.push_back(i == 0 ? S : int64_t(rng() % uint32_t(S + 1)));
    g.acc.push_back(1 + int64_t(rng() % uint32_t(S)));
  }
  g.seed = seed;
  return g;
}

// A point of the reference grid and its test name (a callable for INSTANTIATE_TEST_SUITE_P).
using GridParam = std::tuple<conv::StateLayout, DType /*state*/, DType /*x and out*/, int /*W*/>;
struct GridName {
  template <class ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    const auto& [layout, state, act, W] = info.param;
    return std::string(conv::to_string(layout)) + "_state_" + std::string(to_string(state)) +
           "_x_" + std::string(to_string(act)) + "_W" + std::to_string(W);
  }
};

// The case of grid point `point` with `num_spec` drafts: D channels, 16 slots, N random rows drawn
// with seed seed_base + num_spec + 10 * W.
inline Config grid_config(const GridParam& point, int64_t num_spec, int64_t D, int64_t N,
                          uint32_t seed_base) {
  const auto& [layout, state, act, W] = point;
  Config g;
  g.layout = layout;
  g.state_dtype = state;
  g.x_dtype = g.out_dtype = act;
  g.W = W;
  g.num_spec = num_spec;
  g.D = D;
  g.slots = 16;
  return random_rows(g, N, uint32_t(seed_base + num_spec + 10 * W));
}

// The speculative scheme against plain decoding: random verify steps with random acceptance and
// rejected drafts; after each step the accepted tokens' outputs and the window the next step reads
// must equal a T = 1 decode over the accepted stream, bit for bit. `run(Case&)` executes one call
// (in place on the case's host buffers) and returns its Status. Empty string = equal.
template <class Run>
std::string spec_vs_sequential(conv::StateLayout layout, DType state_dtype, DType act, int64_t W,
                               int64_t num_spec, Run&& run) {
  const int64_t D = 29, N = 3, S = num_spec + 1, steps = 12;
  std::mt19937 rng(uint32_t(1234 + W + 7 * num_spec));
  std::normal_distribution<float> n01;
  // Spec pool: one Lbuf = W-1+num_spec buffer per request. Plain pool: Lbuf = W-1.
  Config gs;
  gs.D = D;
  gs.W = W;
  gs.num_spec = num_spec;
  gs.slots = N + 2;
  gs.layout = layout;
  gs.state_dtype = state_dtype;
  gs.x_dtype = gs.out_dtype = act;
  gs.T.assign(size_t(N), S);
  gs.acc.assign(size_t(N), 1);
  gs.slot = {3, 1, 4};
  Case spec(gs);
  Config gp = gs;
  gp.num_spec = 0;
  gp.T.assign(size_t(N), 1);
  gp.acc.clear();
  gp.slot = {0, 2, 1};
  Case plain(gp);
  plain.weight = spec.weight;
  // Same starting history: the plain buffer = the spec buffer's window at offset 0.
  for (int64_t i = 0; i < N; ++i)
    for (int64_t ch = 0; ch < D; ++ch)
      for (int64_t j = 0; j < W - 1; ++j)
        plain.state.set(plain.state_index(plain.slots_[size_t(i)], ch, j),
                        spec.state.get(spec.state_index(spec.slots_[size_t(i)], ch, j)));

  std::vector<int64_t> acc(size_t(N), 1);
  for (int64_t step = 0; step < steps; ++step) {
    // Fresh verify inputs; drafts past the accepted ones are the rejected ones and must leave no
    // trace in what the next step reads.
    for (int64_t i = 0; i < N; ++i) spec.acc[size_t(i)] = int32_t(acc[size_t(i)]);
    for (int64_t e = 0; e < spec.x.count; ++e) spec.x.set(e, n01(rng));
    spec.poison_out();
    if (const Status vs = run(spec); !vs.is_ok()) return "verify call failed: " + vs.reason();
    for (int64_t i = 0; i < N; ++i) {
      const int64_t n_acc = 1 + int64_t(rng() % uint32_t(S));  // accepted drafts + 1
      for (int64_t t = 0; t < n_acc; ++t) {
        // Plain decode of accepted token t of request i (the other requests' rows have T = 0).
        const int64_t l = spec.cu[size_t(i)] + t;
        for (int64_t r = 0; r < N; ++r) plain.cu[size_t(r + 1)] = int32_t(r >= i ? 1 : 0);
        for (int64_t ch = 0; ch < D; ++ch) plain.x.set(ch, spec.x.get(l * spec.x_stride + ch));
        plain.poison_out();
        if (const Status ps = run(plain); !ps.is_ok()) return "plain call failed: " + ps.reason();
        for (int64_t ch = 0; ch < D; ++ch)
          if (!spec.out.bits_equal(l * spec.out_stride + ch, plain.out, ch))
            return "step " + std::to_string(step) + " request " + std::to_string(i) + " token " +
                   std::to_string(t) + " channel " + std::to_string(ch) + ": spec output " +
                   std::to_string(spec.out.get(l * spec.out_stride + ch)) + " vs plain " +
                   std::to_string(plain.out.get(ch));
      }
      acc[size_t(i)] = n_acc;
      for (int64_t ch = 0; ch < D; ++ch)
        for (int64_t j = 0; j < W - 1; ++j)
          if (!spec.state.bits_equal(spec.state_index(spec.slots_[size_t(i)], ch, n_acc - 1 + j),
                                     plain.state,
                                     plain.state_index(plain.slots_[size_t(i)], ch, j)))
            return "step " + std::to_string(step) + " request " + std::to_string(i) + " channel " +
                   std::to_string(ch) + " tap " + std::to_string(j) +
                   ": the next window differs from the plain history";
    }
  }
  return {};
}

}  // namespace gdn::testing::conv_test
