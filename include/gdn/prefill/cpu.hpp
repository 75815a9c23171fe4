// prefill on the CPU: the whole call is validated first, then every (request, value head) runs the
// gated delta rule over its tokens in fp32, one block of tokens at a time, with the state in fp32
// for the whole request (rounded to the pool's dtype only where it is stored: the checkpoints and
// the final slot). The per-token math is decode_mtp's (gdn/decode_mtp/cpu.hpp): a request's
// outputs and final state equal running its tokens one call at a time through decode_mtp with an
// fp32 pool, bit for bit. Host-only; parallel with OpenMP when enabled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gdn/core/cpu_call.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/prefill/params.hpp"

namespace gdn::prefill {
namespace cpu_detail {

// decode_mtp's per-token building blocks (loaders, delta rule, gated RMSNorm, state rows).
namespace step = decode_mtp::cpu_detail;

// Tokens loaded and advanced at a time; a divisor of kCheckpointGranule, so that every checkpoint
// falls on the end of a block.
inline constexpr int64_t kBlock = 64;
static_assert(kCheckpointGranule % kBlock == 0, "a checkpoint ends a block");

// The fp32 state of one head ([V, K]) and its stores.
template <class StateT>
void store_state(const Params& p, const Problem& pr, int64_t slot, int64_t hv,
                 const std::vector<float>& state) {
  const auto dst = step::StateRow<StateT>::at(p, pr, slot, hv);
  for (int64_t r = 0; r < pr.V; ++r) dst.store(r, pr.K, state.data() + r * pr.K);
}

// One (request, value head): the state is read completely before anything is written, so the
// final slot may be the initial one.
template <class StateT, int kRatio>
void run_head(const Params& p, const Problem& pr, const RowInfo& row, int64_t i, int64_t hv,
              step::Scratch& sc, std::vector<float>& state) {
  const int64_t ratio = kRatio == kRuntimeValue ? pr.ratio : kRatio;
  const step::HeadInputs inputs(p, pr, hv / ratio, hv);
  const int64_t K = pr.K, V = pr.V;
  state.assign(size_t(V * K), 0.0f);
  if (row.initial >= 0) {
    const auto src = step::StateRow<StateT>::at(p, pr, row.initial, hv);
    for (int64_t r = 0; r < V; ++r) src.load(r, K, state.data() + r * K);
  }
  const int64_t E = p.checkpoint_indices.present() ? p.checkpoint_every : 0;
  for (int64_t first = 0; first < row.T; first += kBlock) {
    const int64_t n = std::min(kBlock, row.T - first);
    for (int64_t t = 0; t < n; ++t) inputs.load_call_token(row.begin + first + t, t, sc);
    for (int64_t r = 0; r < V; ++r) {
      float* Sr = state.data() + r * K;
      for (int64_t t = 0; t < n; ++t) {
        step::delta_rule_row(Sr, sc, t, r, K, V);
        sc.o[size_t(t * V + r)] = step::dot(Sr, sc.q.data() + t * K, K);
      }
    }
    step::store_outputs(p, pr, row.begin + first, n, hv, 0, sc);
    const int64_t done = first + n;
    if (E > 0 && done % E == 0) {  // checkpoint j = done / E - 1 (validated to exist)
      const TensorView& t = p.checkpoint_indices;
      const int64_t slot =
          load_index(t.data, t.dtype, i * t.strides[0] + (done / E - 1) * t.strides[1]);
      if (slot >= p.first_valid_slot) store_state<StateT>(p, pr, slot, hv, state);
    }
  }
  if (row.final_slot >= 0) store_state<StateT>(p, pr, row.final_slot, hv, state);
}

// run_cpu_call's run: the validated call, for its state dtype and head ratio.
struct RunAll {
  template <class StateT, int kRatio>
  void operator()(const Params& p, const Problem& pr, const std::vector<RowInfo>& rows) const {
    int64_t tokens = 0;
    for (const RowInfo& r : rows) tokens += r.T;
    const int64_t tasks = pr.N * pr.HV;
    const bool parallel = step::use_threads(pr, tokens);
    (void)parallel;
#if defined(_OPENMP)
#pragma omp parallel if (parallel)
#endif
    {
      step::Scratch sc;
      sc.reserve(pr, kBlock);
      std::vector<float> state;
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (int64_t task = 0; task < tasks; ++task) {
        const RowInfo& row = rows[size_t(task / pr.HV)];
        if (row.T > 0) run_head<StateT, kRatio>(p, pr, row, task / pr.HV, task % pr.HV, sc, state);
      }
    }
  }
};

}  // namespace cpu_detail

// Runs prefill on host memory. Validates everything first: on error nothing is written. Two
// requests writing one slot, or a request's final slot being another's initial slot, is the
// caller's bug: the order of the requests is not defined.
inline Status run_cpu(const Params& p) {
  return run_cpu_call<Problem, RowInfo>(p, cpu_detail::RunAll{});
}

}  // namespace gdn::prefill
