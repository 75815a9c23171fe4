// prefill on the CPU against the tests' own float64 token-by-token reference, on fresh random
// inputs with poisoned outputs: block edges (1, 63, 64, 65, 127, 128, 129 tokens and longer), null
// initial and final slots, in place, checkpoints, every head ratio and state dtype, both layouts,
// padded rows, strided inputs, and refused inputs that write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "decode_mtp_case.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/prefill/cpu.hpp"

namespace gdn::prefill {
namespace {

using testing::CaseConfig;
using testing::DecodeCase;
using testing::HostArray;

// A prefill case: DecodeCase's inputs, pool and outputs (S = 1, its slot table unused), plus the
// prefill slots: request i reads initial[i], writes final[i] and its checkpoints.
struct PrefillCase {
  DecodeCase c;
  std::vector<int64_t> initial, final_slot;
  std::vector<int32_t> checkpoints;  // [N, C]
  int64_t C = 0, every = 0;

  PrefillCase(CaseConfig cfg, std::vector<int64_t> init, std::vector<int64_t> fin,
              int64_t checkpoint_every = 0, int64_t columns = 0)
      : c(std::move(cfg)),
        initial(std::move(init)),
        final_slot(std::move(fin)),
        C(columns),
        every(checkpoint_every) {
    checkpoints.assign(size_t(std::max<int64_t>(c.N * C, 1)), -1);
  }

  Params params() {
    const decode_mtp::Params d = c.params();
    Params p;
    static_cast<decode_mtp::StepArgs&>(p) = d;
    // int64 indices with a stride of 2 (any stride is accepted).
    wide_initial.assign(size_t(2 * std::max<int64_t>(c.N, 1)), 0);
    wide_final.assign(size_t(2 * std::max<int64_t>(c.N, 1)), 0);
    for (int64_t i = 0; i < c.N; ++i) {
      wide_initial[size_t(2 * i)] = initial[size_t(i)];
      wide_final[size_t(2 * i)] = final_slot[size_t(i)];
    }
    p.initial_state_indices = TensorView::make(wide_initial.data(), DType::kInt64, {c.N}, {2});
    p.final_state_indices = TensorView::make(wide_final.data(), DType::kInt64, {c.N}, {2});
    if (C > 0) p.checkpoint_indices = TensorView::make(checkpoints.data(), DType::kInt32, {c.N, C});
    p.checkpoint_every = every;
    return p;
  }

  std::vector<int64_t> wide_initial, wide_final;
};

// Float64 reference, token by token: the state of request i after each of its tokens, and the
// outputs [L, HV, V].
struct Reference {
  std::vector<double> out;
  std::vector<std::vector<std::vector<double>>> states;  // [request][token] -> [HV, V, K]
};

Reference reference(const PrefillCase& pc) {
  const DecodeCase& c = pc.c;
  const CaseConfig& g = c.cfg;
  const int64_t H = g.H, HV = c.HV, K = g.K, V = g.V, r = g.ratio;
  Reference ref;
  ref.out.assign(size_t(std::max<int64_t>(c.L, 1) * HV * V), 0.0);
  ref.states.resize(size_t(c.N));
  const double scale = 1.0 / std::sqrt(double(K));
  for (int64_t i = 0; i < c.N; ++i) {
    std::vector<double> M(size_t(HV * V * K), 0.0);
    if (pc.initial[size_t(i)] >= g.first_valid_slot)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t v = 0; v < V; ++v)
          for (int64_t k = 0; k < K; ++k)
            M[size_t((hv * V + v) * K + k)] =
                c.state.get(c.state_index(pc.initial[size_t(i)], hv, v, k));
    for (int64_t l = c.cu[size_t(i)]; l < c.cu[size_t(i + 1)]; ++l) {
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t h = hv / r, row = l * c.row_stride;
        std::vector<double> q(static_cast<size_t>(K)), k(static_cast<size_t>(K)),
            v(static_cast<size_t>(V)), o(static_cast<size_t>(V));
        double qq = 0, kk = 0;
        for (int64_t j = 0; j < K; ++j) {
          q[size_t(j)] = c.qkv.get(row + h * K + j);
          k[size_t(j)] = c.qkv.get(row + H * K + h * K + j);
          qq += q[size_t(j)] * q[size_t(j)];
          kk += k[size_t(j)] * k[size_t(j)];
        }
        for (int64_t j = 0; j < K; ++j) {
          q[size_t(j)] *= scale / std::sqrt(qq + 1e-6);
          k[size_t(j)] /= std::sqrt(kk + 1e-6);
        }
        for (int64_t j = 0; j < V; ++j) v[size_t(j)] = c.qkv.get(row + 2 * H * K + hv * V + j);
        const double x = double(c.ab.get(l * 2 * HV + hv)) + c.dt_bias.get(hv);
        const double alpha =
            std::exp(-std::exp(double(c.A_log.get(hv))) * (x > 20 ? x : std::log1p(std::exp(x))));
        const double beta = 1.0 / (1.0 + std::exp(-double(c.ab.get(l * 2 * HV + HV + hv))));
        double* Mh = M.data() + hv * V * K;
        for (int64_t rr = 0; rr < V; ++rr) {
          double* Sr = Mh + rr * K;
          double u = 0;
          for (int64_t j = 0; j < K; ++j) u += (Sr[j] *= alpha) * k[size_t(j)];
          const double delta = beta * (v[size_t(rr)] - u);
          double acc = 0;
          for (int64_t j = 0; j < K; ++j) acc += (Sr[j] += k[size_t(j)] * delta) * q[size_t(j)];
          o[size_t(rr)] = acc;
        }
        double ms = 0;
        for (double e : o) ms += e * e;
        const double rstd = 1.0 / std::sqrt(ms / double(V) + 1e-6);
        for (int64_t rr = 0; rr < V; ++rr) {
          const double zz = c.z.get((l * HV + hv) * V + rr);
          ref.out[size_t((l * HV + hv) * V + rr)] =
              o[size_t(rr)] * rstd * c.w.get(rr) * zz / (1.0 + std::exp(-zz));
        }
      }
      ref.states[size_t(i)].push_back(M);
    }
  }
  return ref;
}

// Relative L2 difference of the slot's head states against a reference state [HV, V, K].
double state_error(const PrefillCase& pc, int64_t slot, const std::vector<double>& want) {
  const DecodeCase& c = pc.c;
  double num = 0, den = 0;
  for (int64_t hv = 0; hv < c.HV; ++hv)
    for (int64_t v = 0; v < c.cfg.V; ++v)
      for (int64_t k = 0; k < c.cfg.K; ++k) {
        const double w = want[size_t((hv * c.cfg.V + v) * c.cfg.K + k)];
        const double d = c.state.get(c.state_index(slot, hv, v, k)) - w;
        num += d * d;
        den += w * w;
      }
  return std::sqrt(num / std::max(den, 1e-30));
}

double out_error(const PrefillCase& pc, const Reference& ref, int64_t i) {
  const DecodeCase& c = pc.c;
  double num = 0, den = 0;
  for (int64_t e = c.cu[size_t(i)] * c.HV * c.cfg.V; e < c.cu[size_t(i + 1)] * c.HV * c.cfg.V;
       ++e) {
    const double d = double(c.out.get(e)) - ref.out[size_t(e)];
    num += d * d;
    den += ref.out[size_t(e)] * ref.out[size_t(e)];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Runs the case and checks every request's outputs, final state and checkpoints against the
// reference, and that no other slot changed.
void expect_matches_reference(PrefillCase& pc, double tol) {
  const Reference ref = reference(pc);
  const HostArray before = pc.c.state;
  pc.c.poison_out();
  ASSERT_TRUE(run_cpu(pc.params()).is_ok());
  std::vector<bool> written(size_t(pc.c.cfg.slots), false);
  for (int64_t i = 0; i < pc.c.N; ++i) {
    const int64_t T = pc.c.cu[size_t(i + 1)] - pc.c.cu[size_t(i)];
    if (T == 0) continue;
    EXPECT_LT(out_error(pc, ref, i), tol) << "request " << i << " (T = " << T << ")";
    const int64_t fin = pc.final_slot[size_t(i)];
    if (fin >= pc.c.cfg.first_valid_slot) {
      written[size_t(fin)] = true;
      EXPECT_LT(state_error(pc, fin, ref.states[size_t(i)][size_t(T - 1)]), tol) << "request " << i;
    }
    for (int64_t j = 0; pc.every > 0 && (j + 1) * pc.every <= T; ++j) {
      const int64_t slot = pc.checkpoints[size_t(i * pc.C + j)];
      if (slot < pc.c.cfg.first_valid_slot) continue;
      written[size_t(slot)] = true;
      EXPECT_LT(state_error(pc, slot, ref.states[size_t(i)][size_t((j + 1) * pc.every - 1)]), tol)
          << "request " << i << " checkpoint " << j;
    }
  }
  for (int64_t s = 0; s < pc.c.cfg.slots; ++s) {
    if (written[size_t(s)]) continue;
    for (int64_t e = s * pc.c.slot_stride; e < (s + 1) * pc.c.slot_stride; ++e) {
      ASSERT_EQ(pc.c.state.get(e), before.get(e)) << "slot " << s << " changed";
    }
  }
}

CaseConfig config(std::vector<int64_t> T, int64_t ratio = 2, DType state = DType::kFloat32,
                  StateLayout layout = StateLayout::kVK, uint32_t seed = 1) {
  CaseConfig g;
  g.H = 2;
  g.ratio = ratio;
  g.K = 16;
  g.V = 16;
  g.S = 1;
  g.slots = 24;
  g.T = std::move(T);
  g.state_dtype = state;
  g.layout = layout;
  g.qkv_row_pad = 5;  // strided mixed_qkv rows
  g.slot_pad = 7;     // a paged pool
  g.seed = seed;
  return g;
}

TEST(Prefill, BlockEdgesRatiosDtypesAndLayoutsMatchTheReference) {
  uint32_t seed = 1;
  for (const int64_t ratio : {1, 2, 3, 4, 8, 5})
    for (const DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
        // Block edges, a padded row and a longer request; initial slots 0..5, in place for the
        // first request, a null initial slot (a new request) for the third.
        PrefillCase pc(config({1, 63, 0, 64, 65, 129}, ratio, state, layout, seed++),
                       {0, 1, 2, -1, 4, 5}, {0, 11, 12, 13, 14, 15});
        const double tol = state == DType::kFloat32 ? 1e-4 : 2e-2;
        SCOPED_TRACE(::testing::Message() << "ratio " << ratio << " state " << to_string(state));
        expect_matches_reference(pc, tol);
      }
}

TEST(Prefill, CheckpointsEveryETokensAndNullSlots) {
  // E = 64: a 200-token request takes checkpoints after tokens 63, 127 and 191; a 128-token one
  // after 63 and 127 (the last equals its final state); a 40-token one none. A null final slot and
  // a null checkpoint slot are skipped.
  PrefillCase pc(config({200, 128, 40, 64}), {3, -1, 5, 6}, {20, 21, -1, 23}, 64, 3);
  pc.checkpoints = {7, 8, 9, 10, -1, -1, -1, -1, -1, 17, -1, -1};
  expect_matches_reference(pc, 1e-4);
}

TEST(Prefill, LongRequestInPlace) {
  PrefillCase pc(config({1000}), {4}, {4});
  expect_matches_reference(pc, 1e-4);
}

// The per-token math is decode_mtp's: with an fp32 pool, a request's prefill equals its tokens
// run one call at a time through decode_mtp, bit for bit (outputs and final state).
TEST(Prefill, EqualsOneTokenDecodeCallsBitForBit) {
  PrefillCase pc(config({130}), {2}, {9});
  pc.c.poison_out();
  ASSERT_TRUE(run_cpu(pc.params()).is_ok());
  const HostArray prefill_out = pc.c.out, prefill_state = pc.c.state;

  DecodeCase d(config({130}));  // the same seed: the same inputs and pool
  for (int64_t l = 0; l < d.L; ++l) {
    // One token (row l): written to slot 9, read from column acc - 1 = 1 of the table: slot 2
    // for the first token, then slot 9.
    std::vector<int32_t> table = {9, l == 0 ? 2 : 9}, cu = {int32_t(l), int32_t(l + 1)}, acc = {2};
    decode_mtp::Params p = d.params();
    p.state_indices = TensorView::make(table.data(), DType::kInt32, {1, 2});
    p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {2});
    p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {1});
    ASSERT_TRUE(decode_mtp::run_cpu(p).is_ok()) << "token " << l;
  }
  for (int64_t e = 0; e < d.out.count; ++e) ASSERT_EQ(d.out.get(e), prefill_out.get(e)) << e;
  for (int64_t e = 0; e < d.state.count; ++e) ASSERT_EQ(d.state.get(e), prefill_state.get(e)) << e;
}

TEST(Prefill, BadInputsAreNamedAndNothingIsWritten) {
  const auto refused = [](PrefillCase& pc, const char* needle) {
    const HostArray state = pc.c.state;
    pc.c.poison_out();
    const Status s = run_cpu(pc.params());
    EXPECT_FALSE(s.is_ok()) << needle;
    EXPECT_NE(s.reason().find(needle), std::string::npos) << s.reason();
    for (int64_t e = 0; e < state.count; ++e) ASSERT_EQ(pc.c.state.get(e), state.get(e));
    for (int64_t e = 0; e < pc.c.out.count; ++e) ASSERT_TRUE(std::isnan(pc.c.out.get(e)));
  };
  {
    PrefillCase pc(config({3, 4}), {1, 24}, {1, 2});
    refused(pc, "initial_state_indices[1] = 24");
  }
  {
    PrefillCase pc(config({3, 4}), {1, 2}, {1, 99});
    refused(pc, "final_state_indices[1] = 99");
  }
  {
    PrefillCase pc(config({130}), {1}, {2}, 64, 1);  // two boundaries, one column
    pc.checkpoints = {5};
    refused(pc, "cross 2 checkpoint boundaries");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 64, 1);
    pc.checkpoints = {30};
    refused(pc, "checkpoint_indices[0, 0] = 30");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 32, 1);
    refused(pc, "checkpoint_every = 32");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 64, 0);  // an interval without checkpoint slots
    refused(pc, "needs checkpoint_indices");
  }
  {
    PrefillCase pc(config({3}), {1}, {2});
    Params p = pc.params();
    p.final_state_indices = TensorView::make(pc.wide_final.data(), DType::kFloat32, {1});
    const Status s = run_cpu(p);
    EXPECT_NE(s.reason().find("final_state_indices has dtype float32"), std::string::npos)
        << s.reason();
  }
}

}  // namespace
}  // namespace gdn::prefill
