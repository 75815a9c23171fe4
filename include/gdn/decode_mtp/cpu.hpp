// decode_mtp on the CPU: the whole call is validated first, then every (request, value head) runs
// the gated delta rule over its tokens in fp32, writing the state after every token into that
// token's slot and the gated-RMSNorm'd output. Host-only; parallel with OpenMP when enabled.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn/core/dispatch.hpp"
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

// q/k L2 normalisation, x * rsqrt(sum(x^2) + eps) * scale, in place.
inline void l2_normalize(float* x, int64_t n, float eps, float scale) {
  const float inv = scale / std::sqrt(dot(x, x, n) + eps);
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// Slot `slot`, head hv of the pool <-> a V x K fp32 matrix (row v holds S[v][:], K contiguous).
template <class StateT>
void load_state(const Params& p, const Problem& pr, int64_t slot, int64_t hv, float* S) {
  const StateT* src = p.state.ptr<const StateT>() + slot * p.state.strides[0] + hv * pr.K * pr.V;
  if (p.layout == StateLayout::kVK) {
    for (int64_t e = 0; e < pr.V * pr.K; ++e) S[e] = to_float(src[e]);
  } else {
    for (int64_t k = 0; k < pr.K; ++k)
      for (int64_t v = 0; v < pr.V; ++v) S[v * pr.K + k] = to_float(src[k * pr.V + v]);
  }
}

template <class StateT>
void store_state(const Params& p, const Problem& pr, int64_t slot, int64_t hv, const float* S) {
  StateT* dst = p.state.ptr<StateT>() + slot * p.state.strides[0] + hv * pr.K * pr.V;
  if (p.layout == StateLayout::kVK) {
    for (int64_t e = 0; e < pr.V * pr.K; ++e) dst[e] = from_float<StateT>(S[e]);
  } else {
    for (int64_t k = 0; k < pr.K; ++k)
      for (int64_t v = 0; v < pr.V; ++v) dst[k * pr.V + v] = from_float<StateT>(S[v * pr.K + k]);
  }
}

struct Scratch {
  std::vector<float> state, q, k, v, o, z;
  void reserve(const Problem& pr) {
    state.resize(size_t(pr.V * pr.K));
    q.resize(size_t(pr.K));
    k.resize(size_t(pr.K));
    v.resize(size_t(pr.V));
    o.resize(size_t(pr.V));
    z.resize(size_t(pr.V));
  }
};

// One (request, value head): the recurrence over the request's tokens. kRatio = 0: run-time ratio.
template <class StateT, int kRatio>
void run_head(const Params& p, const Problem& pr, const RowInfo& row, int64_t i, int64_t hv,
              Scratch& sc) {
  const int64_t ratio = kRatio == kRuntimeValue ? pr.ratio : kRatio;
  const int64_t h = hv / ratio;  // grouped GVA: value head hv reads key head hv / r
  const int64_t K = pr.K, V = pr.V;
  float* S = sc.state.data();
  float *q = sc.q.data(), *k = sc.k.data(), *vv = sc.v.data(), *o = sc.o.data(), *z = sc.z.data();

  load_state<StateT>(p, pr, row.source, hv, S);  // read completely before any write

  const float A = -std::exp(load_float(p.A_log.data, p.A_log.dtype, hv));
  const float dt_bias = load_float(p.dt_bias.data, p.dt_bias.dtype, hv);
  const bool norm = p.norm_weight.present();
  for (int64_t t = 0; t < row.T; ++t) {
    const int64_t l = row.begin + t;
    const int64_t qkv_row = l * p.mixed_qkv.strides[0];
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + h * K, K, q);
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + pr.H * K + h * K, K, k);
    load_row(p.mixed_qkv.data, p.mixed_qkv.dtype, qkv_row + 2 * pr.H * K + hv * V, V, vv);
    l2_normalize(q, K, p.l2_eps, pr.scale);
    l2_normalize(k, K, p.l2_eps, 1.0f);
    const float a = load_float(p.a.data, p.a.dtype, l * p.a.strides[0] + hv);
    const float b = load_float(p.b.data, p.b.dtype, l * p.b.strides[0] + hv);
    const float alpha = std::exp(A * softplus(a + dt_bias));
    const float beta = sigmoid(b);

    for (int64_t r = 0; r < V; ++r) {
      float* Sr = S + r * K;
      for (int64_t c = 0; c < K; ++c) Sr[c] *= alpha;         // 1 decay
      const float delta = beta * (vv[r] - dot(Sr, k, K));     // 2 read, 3 delta
      for (int64_t c = 0; c < K; ++c) Sr[c] += k[c] * delta;  // 4 rank-1 write
      o[r] = dot(Sr, q, K);                                   // 5 output, updated state
    }

    const int64_t dest = load_index(p.state_indices.data, p.state_indices.dtype, i * pr.S + t);
    if (dest >= p.first_valid_slot) store_state<StateT>(p, pr, dest, hv, S);

    const int64_t out_row = (l * pr.HV + hv) * V;
    if (!norm) {
      for (int64_t r = 0; r < V; ++r) store_float(p.out.data, p.out.dtype, out_row + r, o[r]);
      continue;
    }
    const float rstd = 1.0f / std::sqrt(dot(o, o, V) / float(V) + p.norm_eps);
    const bool gated = p.z.present();
    if (gated) load_row(p.z.data, p.z.dtype, l * p.z.strides[0] + hv * p.z.strides[1], V, z);
    for (int64_t r = 0; r < V; ++r) {
      float y = o[r] * rstd * load_float(p.norm_weight.data, p.norm_weight.dtype, r);
      if (gated) y *= p.gate == GateActivation::kSiLU ? z[r] * sigmoid(z[r]) : sigmoid(z[r]);
      store_float(p.out.data, p.out.dtype, out_row + r, y);
    }
  }
}

template <class StateT, int kRatio>
void run_all(const Params& p, const Problem& pr, const std::vector<RowInfo>& rows) {
  const int64_t tasks = pr.N * pr.HV;
#if defined(_OPENMP)
#pragma omp parallel
#endif
  {
    Scratch sc;
    sc.reserve(pr);
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t i = task / pr.HV, hv = task % pr.HV;
      if (rows[size_t(i)].T > 0) run_head<StateT, kRatio>(p, pr, rows[size_t(i)], i, hv, sc);
    }
  }
}

}  // namespace cpu_detail

// Runs decode_mtp on host memory. Validates everything first: on error nothing is written.
inline Status run_cpu(const Params& p) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  if (pr.device.type != DeviceType::kCPU)
    return Status::invalid("run_cpu was given tensors on " + to_string(pr.device));
  GDN_RETURN_IF_ERROR(check_rows(p, pr));
  std::vector<RowInfo> rows(size_t(pr.N));
  for (int64_t i = 0; i < pr.N; ++i) (void)check_row(p, pr, i, &rows[size_t(i)]);

  StateDTypes::dispatch(p.state.dtype, [&]<DType kState>() {
    dispatch_or_runtime<HeadRatios>(int(pr.ratio), [&]<int kRatio>() {
      cpu_detail::run_all<host_type_t<kState>, kRatio>(p, pr, rows);
    });
  });
  return Status::ok();
}

}  // namespace gdn::decode_mtp
