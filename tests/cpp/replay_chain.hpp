// Chains of replay steps and the worlds they are compared with (write-every-token decode_mtp,
// one-token-at-a-time decoding, the float64 reference), shared by the CPU and CUDA replay tests:
// a Runner says where replay and decode_mtp run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/replay/cpu.hpp"
#include "replay_case.hpp"

namespace gdn::testing {

// Where a chain runs its calls: on host arrays, by the CPU paths or by a device mirror.
struct Runner {
  Status (*replay)(const replay::Params&) = replay::run_cpu;
  Status (*decode)(const decode_mtp::Params&) = decode_mtp::run_cpu;
  // Replay and decode_mtp give the same bytes (the CPU). On CUDA the two kernels hold the state in
  // different lane layouts (gdn/decode_mtp/cuda_kernel.cuh), so their dot products add in other
  // orders: the same results to within `close`'s bars there.
  bool bitwise = true;
};

inline std::vector<double> out_rows(const Batch& b, int64_t begin, int64_t T, int64_t row) {
  std::vector<double> v(size_t(T * row));
  for (int64_t e = 0; e < T * row; ++e) v[size_t(e)] = b.out.get(begin * row + e);
  return v;
}

inline std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", x);
  return buf;
}

inline bool same_bytes(const uint8_t* a, const uint8_t* b, int64_t n) {
  return std::memcmp(a, b, size_t(n)) == 0;
}

// n elements of dtype t from replay (a) and decode_mtp (b): the same bytes when the runner is
// bitwise, else within relative L2 1e-5 (fp32) or 4e-3 (16-bit: a rounding step apart here and
// there).
inline bool same_result(const Runner& r, const uint8_t* a, const uint8_t* b, DType t, int64_t n) {
  if (r.bitwise) return same_bytes(a, b, n * dtype_size(t));
  std::vector<double> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[size_t(i)] = load_float(a, t, i);
    y[size_t(i)] = load_float(b, t, i);
    if (std::isnan(x[size_t(i)]) && std::isnan(y[size_t(i)])) x[size_t(i)] = y[size_t(i)] = 0.0;
  }
  return rel_l2(x, y) <= (t == DType::kFloat32 ? 1e-5 : 4e-3);
}

// A chain of replay steps over one ReplayCase. Each step draws per request T (0 now and then: a
// padded row) and the replay count n in [0, pending] (0 and pending often), fresh tokens, and
// runs replay. Requests remember the tokens of their last live step (their window).
struct Chain {
  ReplayCase rc;
  std::mt19937 sched;
  std::vector<int32_t> pending;            // window_len of each request's slot
  std::vector<std::vector<Token>> window;  // tokens of the last live step
  std::vector<std::vector<Token>> tokens;  // this step's tokens
  std::vector<int32_t> slot_ids, n;        // this step's replay arguments
  Batch batch;
  Runner runner;
  int n_zero = 0, n_full = 0, n_partial = 0, padded = 0;  // what the chain exercised

  explicit Chain(ReplayConfig cfg, Runner r = Runner{})
      : rc(cfg), sched(cfg.seed * 7919u + 17u), runner(r) {
    pending.assign(size_t(cfg.N), 0);
    window.assign(size_t(cfg.N), {});
    slot_ids = rc.owner_slot;
  }

  int64_t N() const { return rc.cfg.N; }

  void draw() {
    tokens.assign(size_t(N()), {});
    n.assign(size_t(N()), 0);
    for (int64_t i = 0; i < N(); ++i) {
      const bool pad = std::uniform_int_distribution<int>(0, 9)(sched) == 0;
      const int64_t T = pad ? 0 : std::uniform_int_distribution<int64_t>(1, rc.cfg.S)(sched);
      const int32_t p = pending[size_t(i)];
      const int kind = std::uniform_int_distribution<int>(0, 3)(sched);
      n[size_t(i)] = kind == 0   ? 0
                     : kind == 1 ? p
                                 : std::uniform_int_distribution<int32_t>(0, p)(sched);
      if (T == 0) {
        ++padded;
      } else {
        n_zero += n[size_t(i)] == 0;
        n_full += n[size_t(i)] == p && p > 0;
        n_partial += n[size_t(i)] > 0 && n[size_t(i)] < p;
      }
      for (int64_t t = 0; t < T; ++t) tokens[size_t(i)].push_back(rc.random_token());
    }
    batch = rc.batch(tokens);
  }

  std::vector<Token> replayed(int64_t i) const {
    const auto& w = window[size_t(i)];
    return {w.begin(), w.begin() + n[size_t(i)]};
  }
  int64_t begin(int64_t i) const { return batch.cu[size_t(i)]; }
  int64_t T(int64_t i) const { return int64_t(tokens[size_t(i)].size()); }

  Status run_replay() { return runner.replay(rc.replay_params(batch, slot_ids, n)); }

  // The window of request i's slot holds this step's raw rows, bytes as given, and its count.
  void expect_window_saved(int64_t i) const {
    const int64_t s = slot_ids[size_t(i)], esz = dtype_size(rc.cfg.act_dtype), S = rc.cfg.S;
    EXPECT_EQ(rc.window_len[size_t(s)], T(i)) << "window_len of slot " << s;
    for (int64_t t = 0; t < T(i); ++t) {
      const Token& tok = tokens[size_t(i)][size_t(t)];
      const uint8_t *k, *v, *a, *b;
      if (rc.cfg.fused_windows) {
        const int64_t kv = rc.HK + rc.HVV;
        k = rc.window_kv.bytes.data() + ((s * S + t) * kv) * esz;
        v = k + rc.HK * esz;
        a = rc.window_ab.bytes.data() + ((s * S + t) * 2 * rc.HV) * esz;
        b = a + rc.HV * esz;
      } else {
        const auto at = [&](const HostArray& w, int64_t cols) {
          return w.bytes.data() + (s * rc.window_slot_stride(cols) + t * cols) * esz;
        };
        k = at(rc.window_k, rc.HK);
        v = at(rc.window_v, rc.HVV);
        a = at(rc.window_a, rc.HV);
        b = at(rc.window_b, rc.HV);
      }
      EXPECT_TRUE(same_bytes(k, tok.qkv.bytes.data() + rc.HK * esz, rc.HK * esz))
          << "k, token " << t;
      EXPECT_TRUE(same_bytes(v, tok.qkv.bytes.data() + 2 * rc.HK * esz, rc.HVV * esz))
          << "v, token " << t;
      EXPECT_TRUE(same_bytes(a, tok.ab.bytes.data(), rc.HV * esz)) << "a, token " << t;
      EXPECT_TRUE(same_bytes(b, tok.ab.bytes.data() + rc.HV * esz, rc.HV * esz))
          << "b, token " << t;
    }
  }

  void commit() {
    for (int64_t i = 0; i < N(); ++i) {
      if (T(i) == 0) continue;
      pending[size_t(i)] = int32_t(T(i));
      window[size_t(i)] = tokens[size_t(i)];
    }
  }
};

// Write-every-token decode_mtp on its own pool: request i owns a row of S slots. Its source is the
// state after n tokens of its last live step (column n - 1); n = 0 (decode_mtp has no such count)
// is emulated by putting back the state its previous call started from, with acc = 1.
struct WriteEveryToken {
  int64_t S, first, n_slots;
  HostArray pool;
  std::vector<int32_t> indices, acc;
  std::vector<std::vector<uint8_t>> source;  // per request: the state its last call started from

  explicit WriteEveryToken(ReplayCase& rc) : S(rc.cfg.S), first(rc.cfg.first_valid_slot) {
    const int64_t N = rc.cfg.N;
    n_slots = first + N * S;
    pool = rc.random_pool(n_slots);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < S; ++c) indices.push_back(int32_t(first + i * S + (S - 1 - c)));
    for (int64_t i = 0; i < N; ++i) {
      const uint8_t* x = rc.slot_ptr(rc.state, rc.owner_slot[size_t(i)]);
      source.emplace_back(x, x + rc.state_bytes());
    }
  }

  void step(Chain& ch) {
    ReplayCase& rc = ch.rc;
    acc.assign(size_t(rc.cfg.N), 1);
    for (int64_t i = 0; i < rc.cfg.N; ++i) {
      if (ch.T(i) == 0) continue;
      const int32_t n = ch.n[size_t(i)];
      acc[size_t(i)] = std::max(n, 1);
      uint8_t* src = rc.slot_ptr(pool, indices[size_t(i * S + acc[size_t(i)] - 1)]);
      if (n == 0) std::memcpy(src, source[size_t(i)].data(), source[size_t(i)].size());
      std::memcpy(source[size_t(i)].data(), src, source[size_t(i)].size());
    }
    Batch b = rc.batch(ch.tokens);
    Status s = ch.runner.decode(rc.mtp_params(b, pool, n_slots, indices, S, acc));
    ASSERT_TRUE(s.is_ok()) << s.reason();
    EXPECT_TRUE(same_result(ch.runner, ch.batch.out.bytes.data(), b.out.bytes.data(), b.out.dtype,
                            b.out.count))
        << "outputs differ from write-every-token decode_mtp";
    for (int64_t i = 0; i < rc.cfg.N; ++i) {
      if (ch.T(i) == 0) continue;
      EXPECT_TRUE(same_result(ch.runner, rc.slot_ptr(rc.state, ch.slot_ids[size_t(i)]),
                              source[size_t(i)].data(), rc.cfg.state_dtype,
                              rc.state_bytes() / dtype_size(rc.cfg.state_dtype)))
          << "request " << i << ": checkpoint differs from decode_mtp's state at column acc - 1";
    }
  }
};

// One-token-at-a-time decoding: request i keeps its accepted state in slot first + 2i and runs the
// step's tokens from a copy in slot first + 2i + 1, one decode_mtp call (T = 1, in place) each.
struct Sequential {
  int64_t first, n_slots;
  HostArray pool;

  explicit Sequential(ReplayCase& rc) : first(rc.cfg.first_valid_slot) {
    n_slots = first + 2 * rc.cfg.N;
    pool = rc.random_pool(n_slots);
    for (int64_t i = 0; i < rc.cfg.N; ++i)
      std::memcpy(rc.slot_ptr(pool, first + 2 * i), rc.slot_ptr(rc.state, rc.owner_slot[size_t(i)]),
                  size_t(rc.state_bytes()));
  }

  // Decodes one token in place in `slot`; returns its output row.
  Batch decode(const Chain& ch, ReplayCase& rc, const Token& tok, int64_t slot) {
    Batch b = rc.batch({{tok}});
    std::vector<int32_t> index = {int32_t(slot)}, acc = {1};
    Status s = ch.runner.decode(rc.mtp_params(b, pool, n_slots, index, 1, acc));
    EXPECT_TRUE(s.is_ok()) << s.reason();
    return b;
  }

  void step(Chain& ch) {
    ReplayCase& rc = ch.rc;
    const int64_t esz = dtype_size(rc.cfg.act_dtype);
    for (int64_t i = 0; i < rc.cfg.N; ++i) {
      if (ch.T(i) == 0) continue;
      const int64_t accepted = first + 2 * i, scratch = accepted + 1;
      for (const Token& tok : ch.replayed(i)) decode(ch, rc, tok, accepted);
      EXPECT_TRUE(same_result(ch.runner, rc.slot_ptr(rc.state, ch.slot_ids[size_t(i)]),
                              rc.slot_ptr(pool, accepted), rc.cfg.state_dtype,
                              rc.state_bytes() / dtype_size(rc.cfg.state_dtype)))
          << "request " << i << ": checkpoint differs from one-token-at-a-time decoding";
      std::memcpy(rc.slot_ptr(pool, scratch), rc.slot_ptr(pool, accepted),
                  size_t(rc.state_bytes()));
      for (int64_t t = 0; t < ch.T(i); ++t) {
        const Batch one = decode(ch, rc, ch.tokens[size_t(i)][size_t(t)], scratch);
        EXPECT_TRUE(same_result(ch.runner,
                                ch.batch.out.bytes.data() + (ch.begin(i) + t) * rc.HVV * esz,
                                one.out.bytes.data(), one.out.dtype, rc.HVV))
            << "request " << i << " token " << t
            << ": output differs from one-token-at-a-time decoding";
      }
    }
  }
};

// Float64 check of one step, from the checkpoint as stored before the call (`before`).
inline void expect_step_matches_reference(const Chain& ch, const HostArray& before, double out_tol,
                                          double state_tol, double* worst_out,
                                          double* worst_state) {
  const ReplayCase& rc = ch.rc;
  for (int64_t i = 0; i < rc.cfg.N; ++i) {
    if (ch.T(i) == 0) continue;
    const int64_t s = ch.slot_ids[size_t(i)];
    const StepReference ref = reference_step(rc, before, s, ch.replayed(i), ch.tokens[size_t(i)]);
    const double e_out = rel_l2(out_rows(ch.batch, ch.begin(i), ch.T(i), rc.HVV), ref.out);
    const double e_state = rel_l2(rc.slot_values(rc.state, s), ref.checkpoint);
    EXPECT_LE(e_out, out_tol) << "request " << i;
    EXPECT_LE(e_state, state_tol) << "request " << i;
    *worst_out = std::max(*worst_out, e_out);
    *worst_state = std::max(*worst_state, e_state);
  }
}

// What no request owns keeps its bytes: spare checkpoint slots, their windows and counts.
inline void expect_spares_untouched(const ReplayCase& rc, const ReplayCase& initial) {
  for (int64_t s = 0; s < rc.slots; ++s) {
    if (std::find(rc.owner_slot.begin(), rc.owner_slot.end(), int32_t(s)) != rc.owner_slot.end())
      continue;
    EXPECT_TRUE(same_bytes(rc.slot_ptr(rc.state, s), rc.slot_ptr(initial.state, s),
                           rc.slot_stride * dtype_size(rc.cfg.state_dtype)))
        << "spare slot " << s << " changed";
    EXPECT_EQ(rc.window_len[size_t(s)], initial.window_len[size_t(s)]) << "spare slot " << s;
    EXPECT_TRUE(rc.window_bytes(s) == initial.window_bytes(s))
        << "window of spare slot " << s << " changed";
  }
}

struct ChainParam {
  const char* name;
  ReplayConfig cfg;
  int steps;
};

// A chain of param.steps steps: every step's window save, the float64 reference, write-every-token
// decode_mtp and one-token-at-a-time decoding (bit for bit where the runner is bitwise), all run
// by `runner`; then the spare
// slots and what the chain exercised (each kind of row at least steps / 40 times).
inline void run_chain_bit_for_bit(const ChainParam& param, Runner runner) {
  Chain ch(param.cfg, runner);
  const ReplayCase initial = ch.rc;
  WriteEveryToken mtp(ch.rc);
  Sequential seq(ch.rc);
  const bool fp32_act = param.cfg.act_dtype == DType::kFloat32;
  double worst_out = 0, worst_state = 0;
  for (int step = 0; step < param.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ch.draw();
    const HostArray before = ch.rc.state;
    const Status s = ch.run_replay();
    ASSERT_TRUE(s.is_ok()) << s.reason();
    for (int64_t i = 0; i < ch.N(); ++i)
      if (ch.T(i) > 0) ch.expect_window_saved(i);
    expect_step_matches_reference(ch, before, fp32_act ? 1e-5 : 4e-3, 1e-5, &worst_out,
                                  &worst_state);
    mtp.step(ch);
    seq.step(ch);
    ch.commit();
    if (::testing::Test::HasFailure()) break;
  }
  expect_spares_untouched(ch.rc, initial);
  // The chain exercised every kind of row.
  const int least = std::max(1, param.steps / 40);
  EXPECT_GE(ch.n_zero, least);
  EXPECT_GE(ch.n_full, least);
  EXPECT_GE(ch.n_partial, least);
  EXPECT_GE(ch.padded, least);
  ::testing::Test::RecordProperty("worst_out_rel_l2", sci(worst_out));
  ::testing::Test::RecordProperty("worst_checkpoint_rel_l2", sci(worst_state));
}

}  // namespace gdn::testing
