// decode_mtp on the CPU: the whole call is validated first, then every (request, value head) runs
// the gated delta rule over its tokens in fp32, writing the state after every token into that
// token's slot and the gated-RMSNorm'd output. Host-only; parallel with OpenMP when enabled.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/core/cpu_call.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::decode_mtp {
namespace cpu_detail {

// Fixed-order dot product over n floats: 8 independent partial sums (the compiler turns them into
// vector lanes on baseline x86-64), then a fixed tree. The order never depends on the call, so a
// T-token call and T one-token calls agree bit for bit.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  for (int j = 0; k < n; ++k, ++j) acc[j] += a[k] * b[k];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Loads n elements of a run-time-typed floating array into fp32.
inline void load_row(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = load_float(base, dtype, offset + j);
}

// q/k L2 normalisation, x * rsqrt(sum(x^2) + eps) * scale, in place; without `l2`, x * scale.
inline void l2_normalize(float* x, int64_t n, float eps, float scale, bool l2 = true) {
  if (!l2 && scale == 1.0f) return;  // used as given
  const float inv = l2 ? scale / std::sqrt(dot(x, x, n) + eps) : scale;
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// Row r of head hv in slot `slot`: K elements, contiguous in "vk", strided by V in "kv".
template <class StateT>
struct StateRow {
  StateT* base;      // element (r = 0, k = 0) of this head
  int64_t row_step;  // distance between rows r and r + 1
  int64_t k_step;    // distance between k and k + 1

  static StateRow at(const StepArgs& p, const Problem& pr, int64_t slot, int64_t hv) {
    StateT* head = p.state.ptr<StateT>() + slot * p.state.strides[0] + hv * pr.K * pr.V;
    return p.layout == StateLayout::kVK ? StateRow{head, pr.K, 1} : StateRow{head, 1, pr.V};
  }
  void load(int64_t r, int64_t K, float* dst) const {
    const StateT* src = base + r * row_step;
    if (k_step == 1) {  // "vk": contiguous, vectorisable
      for (int64_t k = 0; k < K; ++k) dst[k] = to_float(src[k]);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k] = to_float(src[k * k_step]);
    }
  }
  void store(int64_t r, int64_t K, const float* src) const {
    StateT* dst = base + r * row_step;
    if (k_step == 1) {
      for (int64_t k = 0; k < K; ++k) dst[k] = from_float<StateT>(src[k]);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k * k_step] = from_float<StateT>(src[k]);
    }
  }
};

// Per-thread buffers, sized for the most tokens one (request, value head) task handles.
struct Scratch {
  std::vector<float> row, q, k, v, o, z, alpha, beta;
  std::vector<int64_t> dest;
  void reserve(const Problem& pr, int64_t max_T) {
    dest.resize(size_t(std::max<int64_t>(max_T, 1)));
    const auto n = [](int64_t x) { return size_t(std::max<int64_t>(x, 1)); };
    row.resize(n(pr.K));
    q.resize(n(max_T * pr.K));
    k.resize(n(max_T * pr.K));
    v.resize(n(max_T * pr.V));
    o.resize(n(max_T * pr.V));
    z.resize(n(pr.V));
    alpha.resize(n(max_T));
    beta.resize(n(max_T));
  }
};

// The fp32 per-token inputs of value head hv (key head h = hv / r), written to token position t
// of the scratch arrays. Every operation goes through these loaders, so a token's normalised k,
// decay and beta are the same bits whether it is run, replayed or run one call at a time.
struct HeadInputs {
  const StepArgs& p;
  const Problem& pr;
  int64_t h, hv;
  float A = 0.0f, dt_bias = 0.0f;  // A = -exp(A_log[hv]); not read with a_is_log_decay

  HeadInputs(const StepArgs& args, const Problem& problem, int64_t key_head, int64_t value_head)
      : p(args), pr(problem), h(key_head), hv(value_head) {
    if (args.a_is_log_decay) return;
    A = -std::exp(load_float(args.A_log.data, args.A_log.dtype, value_head));
    dt_bias = load_float(args.dt_bias.data, args.dt_bias.dtype, value_head);
  }

  // Token t from raw inputs already in place (k at sc.k + t*K, v at sc.v + t*V) and raw a, b:
  // k L2-normalised (unless qk_l2_norm is off), alpha = exp(g) with g = A * softplus(a + dt_bias)
  // (g = a with a_is_log_decay), beta = sigmoid(b) (b with b_is_beta).
  void finish_token(float a, float b, int64_t t, Scratch& sc) const {
    l2_normalize(sc.k.data() + t * pr.K, pr.K, p.l2_eps, 1.0f, p.qk_l2_norm);
    sc.alpha[size_t(t)] = std::exp(p.a_is_log_decay ? a : A * softplus(a + dt_bias));
    sc.beta[size_t(t)] = p.b_is_beta ? b : sigmoid(b);
  }

  // Token t from row l of the call's inputs (mixed_qkv, a, b), q included.
  void load_call_token(int64_t l, int64_t t, Scratch& sc) const {
    const int64_t K = pr.K, V = pr.V;
    const int64_t qkv_row = l * p.mixed_qkv.strides[0];
    float* q = sc.q.data() + t * K;
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + h * K, K, q);
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + pr.H * K + h * K, K,
             sc.k.data() + t * K);
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + 2 * pr.H * K + hv * V, V,
             sc.v.data() + t * V);
    l2_normalize(q, K, p.l2_eps, pr.scale, p.qk_l2_norm);
    finish_token(load_float(p.a.data, p.a.dtype, l * p.a.strides[0] + hv),
                 load_float(p.b.data, p.b.dtype, l * p.b.strides[0] + hv), t, sc);
  }
};

// Token t of the delta rule on state row r (Sr, K elements): decay, u = Sr . k,
// delta = beta (v_r - u), Sr += k delta.
inline void delta_rule_row(float* Sr, const Scratch& sc, int64_t t, int64_t r, int64_t K,
                           int64_t V) {
  const float* k = sc.k.data() + t * K;
  const float alpha = sc.alpha[size_t(t)];
  for (int64_t c = 0; c < K; ++c) Sr[c] *= alpha;                                      // 1 decay
  const float delta = sc.beta[size_t(t)] * (sc.v[size_t(t * V + r)] - dot(Sr, k, K));  // 2, 3
  for (int64_t c = 0; c < K; ++c) Sr[c] += k[c] * delta;                               // 4 write
}

// Gated RMSNorm of T tokens of head hv (core outputs at sc.o + t*V, starting at scratch token
// `first`), stored to rows begin.. of out (or the raw o without a norm weight).
inline void store_outputs(const StepArgs& p, const Problem& pr, int64_t begin, int64_t T,
                          int64_t hv, int64_t first, Scratch& sc) {
  const int64_t V = pr.V;
  const bool norm = p.norm_weight.present(), gated = p.z.present();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t l = begin + t;
    float* o = sc.o.data() + (first + t) * V;
    const int64_t out_row = (l * pr.HV + hv) * V;
    if (p.round_core_output)
      for (int64_t r = 0; r < V; ++r) o[r] = round_to(p.out.dtype, o[r]);
    if (!norm) {
      for (int64_t r = 0; r < V; ++r) store_float(p.out.data, p.out.dtype, out_row + r, o[r]);
      continue;
    }
    const float rstd = 1.0f / std::sqrt(dot(o, o, V) / float(V) + p.norm_eps);
    float* z = sc.z.data();
    if (gated) load_row(p.z.data, p.z.dtype, l * p.z.strides[0] + hv * p.z.strides[1], V, z);
    for (int64_t r = 0; r < V; ++r) {
      float y = o[r] * rstd * load_float(p.norm_weight.data, p.norm_weight.dtype, r);
      if (gated) y *= p.gate == GateActivation::kSiLU ? z[r] * sigmoid(z[r]) : sigmoid(z[r]);
      store_float(p.out.data, p.out.dtype, out_row + r, y);
    }
  }
}

// Whether a call is worth an OpenMP team: threads pay off beyond ~64K state element-updates
// (~0.1 ms of work); below that, waking a team costs more than it saves (and a lot more on an
// oversubscribed machine). `tokens` counts every token any task runs or replays.
inline bool use_threads(const Problem& pr, int64_t tokens) {
  return tokens * pr.HV * pr.K * pr.V >= (int64_t(1) << 16) && pr.N * pr.HV > 1;
}

// Runs body(i, hv, scratch) for every (request i, value head hv), in parallel when `parallel`,
// each thread with its own scratch sized for `max_tokens` tokens.
template <class Body>
void for_each_head(const Problem& pr, bool parallel, int64_t max_tokens, Body&& body) {
  const int64_t tasks = pr.N * pr.HV;
  (void)parallel;
#if defined(_OPENMP)
#pragma omp parallel if (parallel)
#endif
  {
    Scratch sc;
    sc.reserve(pr, max_tokens);
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t task = 0; task < tasks; ++task) body(task / pr.HV, task % pr.HV, sc);
  }
}

// One (request, value head). Rows of the state are independent under the delta rule, so each row
// is read once from the source slot, advanced through all T tokens and written to every token's
// slot before the next row is touched: the source row is always read before anything overwrites
// it, even when the source slot is also a destination. kRatio = 0: run-time ratio.
template <class StateT, int kRatio>
void run_head(const Params& p, const Problem& pr, const RowInfo& row_info, int64_t i, int64_t hv,
              Scratch& sc) {
  const int64_t ratio = kRatio == kRuntimeValue ? pr.ratio : kRatio;
  // Grouped GVA: value head hv reads key head hv / r.
  const HeadInputs inputs(p, pr, hv / ratio, hv);
  const int64_t K = pr.K, V = pr.V, T = row_info.T;
  for (int64_t t = 0; t < T; ++t) inputs.load_call_token(row_info.begin + t, t, sc);

  // Destination rows per token; a null slot id skips that token's write.
  for (int64_t t = 0; t < T; ++t)
    sc.dest[size_t(t)] = load_index(p.state_indices.data, p.state_indices.dtype, i * pr.S + t);
  const auto source = StateRow<StateT>::at(p, pr, row_info.source, hv);
  float* Sr = sc.row.data();
  for (int64_t r = 0; r < V; ++r) {
    source.load(r, K, Sr);
    for (int64_t t = 0; t < T; ++t) {
      delta_rule_row(Sr, sc, t, r, K, V);
      sc.o[size_t(t * V + r)] = dot(Sr, sc.q.data() + t * K, K);  // 5 output
      const int64_t slot = sc.dest[size_t(t)];
      if (slot >= p.first_valid_slot) StateRow<StateT>::at(p, pr, slot, hv).store(r, K, Sr);
    }
  }
  store_outputs(p, pr, row_info.begin, T, hv, 0, sc);
}

// run_cpu_call's run: the validated call, for its state dtype and head ratio.
struct RunAll {
  template <class StateT, int kRatio>
  void operator()(const Params& p, const Problem& pr, const std::vector<RowInfo>& rows) const {
    int64_t max_T = 0, tokens = 0;
    for (const RowInfo& r : rows) {
      max_T = std::max(max_T, r.T);
      tokens += r.T;
    }
    for_each_head(pr, use_threads(pr, tokens), max_T, [&](int64_t i, int64_t hv, Scratch& sc) {
      if (rows[size_t(i)].T > 0) run_head<StateT, kRatio>(p, pr, rows[size_t(i)], i, hv, sc);
    });
  }
};

}  // namespace cpu_detail

// Runs decode_mtp on host memory. Validates everything first: on error nothing is written.
inline Status run_cpu(const Params& p) {
  return run_cpu_call<Problem, RowInfo>(p, cpu_detail::RunAll{});
}

}  // namespace gdn::decode_mtp
