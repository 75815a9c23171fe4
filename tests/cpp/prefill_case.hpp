// A prefill test case (DecodeCase's inputs plus prefill's slots), the tests' own float64
// token-by-token reference, and the check of a run against it: every request's outputs, final
// state and checkpoints, and no other slot touched. Shared by the CPU and the CUDA tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "decode_mtp_case.hpp"
#include "gdn/prefill/params.hpp"

namespace gdn::prefill::testing {

using gdn::testing::CaseConfig;
using gdn::testing::DecodeCase;
using gdn::testing::HostArray;

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

inline Reference reference(const PrefillCase& pc) {
  const DecodeCase& c = pc.c;
  const CaseConfig& g = c.cfg;
  const int64_t HV = c.HV, K = g.K, V = g.V;
  Reference ref;
  ref.out.assign(size_t(std::max<int64_t>(c.L, 1) * HV * V), 0.0);
  ref.states.resize(size_t(c.N));
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
        const auto [q, k, v, alpha, beta] = token_inputs(c, l, hv);
        std::vector<double> o(static_cast<size_t>(V));
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
inline double state_error(const PrefillCase& pc, int64_t slot, const std::vector<double>& want) {
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

inline double out_error(const PrefillCase& pc, const Reference& ref, int64_t i) {
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
// How a test runs a call: the CPU path or the CUDA launch on mirrored arrays.
using Runner = std::function<Status(const Params&)>;

inline void expect_matches_reference(PrefillCase& pc, double tol, const Runner& run) {
  const Reference ref = reference(pc);
  const HostArray before = pc.c.state;
  pc.c.poison_out();
  const Status s = run(pc.params());
  ASSERT_TRUE(s.is_ok()) << s.reason();
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

inline CaseConfig config(std::vector<int64_t> T, int64_t ratio = 2, DType state = DType::kFloat32,
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

}  // namespace gdn::prefill::testing
