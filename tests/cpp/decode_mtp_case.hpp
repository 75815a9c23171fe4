// A decode_mtp test case with owning host buffers, a float64 reference of the tests' own, and
// comparison helpers. Shared by the CPU tests and the GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gdn/core/dtype.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::testing {

// Host storage of a floating tensor in any of fp32 / bf16 / fp16, kept as raw bytes.
struct HostArray {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;
  int64_t count = 0;

  HostArray() = default;
  HostArray(DType t, int64_t n) : dtype(t), bytes(size_t(n * dtype_size(t))), count(n) {}
  void set(int64_t i, float v) { store_float(bytes.data(), dtype, i, v); }
  float get(int64_t i) const { return load_float(bytes.data(), dtype, i); }
  void* data() { return bytes.data(); }
};

struct CaseConfig {
  int64_t H = 2, ratio = 2, K = 16, V = 16, S = 4, slots = 24;
  std::vector<int64_t> T;    // tokens per request (0 = padded row)
  std::vector<int64_t> acc;  // accepted counts (1..S)
  DType state_dtype = DType::kFloat32, act_dtype = DType::kFloat32, out_dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kVK;
  GateActivation gate = GateActivation::kSiLU;
  bool norm = true, gated = true;
  int64_t qkv_row_pad = 0;  // extra columns per mixed_qkv row (strided rows)
  int64_t slot_pad = 0;     // extra elements per state slot (paged pool)
  int64_t first_valid_slot = 0;
  bool round_core_output = false;          // the reference rounds o to out_dtype before the norm
  std::vector<int64_t> null_destinations;  // (request * S + column) entries set to a null slot
  // StepArgs' input options. With a_is_log_decay `a` holds log-decays (<= 0) and A_log, dt_bias
  // are left absent; with b_is_beta `b` holds betas in (0, 1).
  bool a_is_log_decay = false, b_is_beta = false, qk_l2_norm = true;
  uint32_t seed = 1;
};

struct DecodeCase {
  CaseConfig cfg;
  int64_t HV, N, L, width, row_stride, slot_stride;
  HostArray qkv, ab, A_log, dt_bias, z, w, state, out;
  std::vector<int32_t> indices, cu, acc;

  explicit DecodeCase(CaseConfig c) : cfg(std::move(c)) {
    HV = cfg.H * cfg.ratio;
    N = int64_t(cfg.T.size());
    cu.assign(size_t(N + 1), 0);
    for (int64_t i = 0; i < N; ++i) cu[size_t(i + 1)] = cu[size_t(i)] + int32_t(cfg.T[size_t(i)]);
    L = cu.back();
    width = 2 * cfg.H * cfg.K + HV * cfg.V;
    row_stride = width + cfg.qkv_row_pad;
    slot_stride = HV * cfg.K * cfg.V + cfg.slot_pad;
    std::mt19937 rng(cfg.seed);
    std::normal_distribution<float> n01;
    auto fill = [&](HostArray& a, float scale) {
      for (int64_t i = 0; i < a.count; ++i) a.set(i, scale * n01(rng));
    };
    qkv = HostArray(cfg.act_dtype, std::max<int64_t>(L, 1) * row_stride);
    ab = HostArray(cfg.act_dtype, std::max<int64_t>(L, 1) * 2 * HV);  // a and b interleaved halves
    A_log = HostArray(DType::kFloat32, HV);
    dt_bias = HostArray(DType::kFloat32, HV);
    z = HostArray(cfg.act_dtype, std::max<int64_t>(L, 1) * HV * cfg.V);
    w = HostArray(DType::kFloat32, cfg.V);
    state = HostArray(cfg.state_dtype, cfg.slots * slot_stride);
    out = HostArray(cfg.out_dtype, std::max<int64_t>(L, 1) * HV * cfg.V);
    fill(qkv, 1.0f);
    fill(ab, 1.0f);
    fill(A_log, 0.5f);
    fill(dt_bias, 0.1f);
    fill(z, 1.0f);
    fill(w, 1.0f);
    fill(state, 0.1f);
    if (!cfg.qk_l2_norm)  // q and k used as given: rows of norm near 1 keep the recurrence stable
      for (int64_t l = 0; l < L; ++l)
        for (int64_t e = 0; e < 2 * cfg.H * cfg.K; ++e)
          qkv.set(l * row_stride + e, qkv.get(l * row_stride + e) / std::sqrt(float(cfg.K)));
    for (int64_t l = 0; l < L; ++l)
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t ia = l * 2 * HV + hv, ib = ia + HV;
        if (cfg.a_is_log_decay) ab.set(ia, -0.5f * std::fabs(ab.get(ia)));
        if (cfg.b_is_beta) ab.set(ib, 1.0f / (1.0f + std::exp(-ab.get(ib))));
      }
    poison_out();
    // Distinct slots per request, drawn from a shuffled pool of the valid slot ids.
    std::vector<int32_t> ids;
    for (int64_t s = cfg.first_valid_slot; s < cfg.slots; ++s) ids.push_back(int32_t(s));
    std::shuffle(ids.begin(), ids.end(), rng);
    indices.assign(size_t(N * cfg.S), 0);
    for (int64_t e = 0; e < N * cfg.S; ++e) indices[size_t(e)] = ids[size_t(e) % ids.size()];
    for (int64_t e : cfg.null_destinations) indices[size_t(e)] = int32_t(cfg.first_valid_slot - 1);
    acc.assign(size_t(N), 1);
    for (int64_t i = 0; i < N && i < int64_t(cfg.acc.size()); ++i)
      acc[size_t(i)] = int32_t(cfg.acc[size_t(i)]);
  }

  void poison_out() {
    for (int64_t i = 0; i < out.count; ++i) out.set(i, NAN);
  }

  decode_mtp::Params params() {
    using TV = TensorView;
    decode_mtp::Params p;
    const int64_t Lr = std::max<int64_t>(L, 0);
    p.mixed_qkv = TV::make(qkv.data(), cfg.act_dtype, {Lr, width}, {row_stride, 1});
    p.a = TV::make(ab.data(), cfg.act_dtype, {Lr, HV}, {2 * HV, 1});
    p.b = TV::make(static_cast<uint8_t*>(ab.data()) + HV * dtype_size(cfg.act_dtype), cfg.act_dtype,
                   {Lr, HV}, {2 * HV, 1});
    if (!cfg.a_is_log_decay) {
      p.A_log = TV::make(A_log.data(), DType::kFloat32, {HV});
      p.dt_bias = TV::make(dt_bias.data(), DType::kFloat32, {HV});
    }
    p.a_is_log_decay = cfg.a_is_log_decay;
    p.b_is_beta = cfg.b_is_beta;
    p.qk_l2_norm = cfg.qk_l2_norm;
    if (cfg.norm) p.norm_weight = TV::make(w.data(), DType::kFloat32, {cfg.V});
    if (cfg.norm && cfg.gated) p.z = TV::make(z.data(), cfg.act_dtype, {Lr, HV, cfg.V});
    const bool vk = cfg.layout == StateLayout::kVK;
    p.state = TV::make(state.data(), cfg.state_dtype,
                       {cfg.slots, HV, vk ? cfg.V : cfg.K, vk ? cfg.K : cfg.V},
                       {slot_stride, cfg.K * cfg.V, vk ? cfg.K : cfg.V, 1});
    p.state_indices = TV::make(indices.data(), DType::kInt32, {N, cfg.S});
    p.cu_seqlens = TV::make(cu.data(), DType::kInt32, {N + 1});
    p.num_accepted_tokens = TV::make(acc.data(), DType::kInt32, {N});
    p.out = TV::make(out.data(), cfg.out_dtype, {Lr, HV, cfg.V});
    p.gate = cfg.gate;
    p.layout = cfg.layout;
    p.first_valid_slot = cfg.first_valid_slot;
    p.round_core_output = cfg.round_core_output;
    return p;
  }

  // Index of element (v, k) of head hv in slot s of the pool, honouring the layout.
  int64_t state_index(int64_t s, int64_t hv, int64_t v, int64_t k) const {
    const int64_t base = s * slot_stride + hv * cfg.K * cfg.V;
    return cfg.layout == StateLayout::kVK ? base + v * cfg.K + k : base + k * cfg.V + v;
  }
};

// The reference's per-token inputs of value head hv at token row l, in float64: q (times the
// default scale) and k, L2-normalised unless qk_l2_norm is off, v, and the gates alpha, beta.
struct TokenInputs {
  std::vector<double> q, k, v;
  double alpha = 0, beta = 0;
};

inline TokenInputs token_inputs(const DecodeCase& c, int64_t l, int64_t hv) {
  const CaseConfig& g = c.cfg;
  const int64_t HV = c.HV, K = g.K, V = g.V, H = g.H, h = hv / g.ratio, row = l * c.row_stride;
  TokenInputs in;
  in.q.resize(size_t(K));
  in.k.resize(size_t(K));
  in.v.resize(size_t(V));
  double qq = 0, kk = 0;
  for (int64_t d = 0; d < K; ++d) {
    in.q[size_t(d)] = c.qkv.get(row + h * K + d);
    in.k[size_t(d)] = c.qkv.get(row + H * K + h * K + d);
    qq += in.q[size_t(d)] * in.q[size_t(d)];
    kk += in.k[size_t(d)] * in.k[size_t(d)];
  }
  const double scale = 1.0 / std::sqrt(double(K));
  const double qf = g.qk_l2_norm ? scale / std::sqrt(qq + 1e-6) : scale;
  const double kf = g.qk_l2_norm ? 1.0 / std::sqrt(kk + 1e-6) : 1.0;
  for (int64_t d = 0; d < K; ++d) {
    in.q[size_t(d)] *= qf;
    in.k[size_t(d)] *= kf;
  }
  for (int64_t d = 0; d < V; ++d) in.v[size_t(d)] = c.qkv.get(row + 2 * H * K + hv * V + d);
  const double a = c.ab.get(l * 2 * HV + hv), b = c.ab.get(l * 2 * HV + HV + hv);
  if (g.a_is_log_decay) {
    in.alpha = std::exp(a);
  } else {
    const double x = a + c.dt_bias.get(hv);
    in.alpha =
        std::exp(-std::exp(double(c.A_log.get(hv))) * (x > 20 ? x : std::log1p(std::exp(x))));
  }
  in.beta = g.b_is_beta ? b : 1.0 / (1.0 + std::exp(-b));
  return in;
}

// Float64 reference: states after every token of every request and the outputs.
struct Reference {
  std::vector<double> out;                           // [L, HV, V]
  std::vector<std::vector<double>> states;           // per (request, t): [HV, V, K]
  std::vector<std::pair<int64_t, int64_t>> written;  // (slot, state id) in write order
};

inline Reference reference(const DecodeCase& c) {
  const auto& g = c.cfg;
  const int64_t HV = c.HV, K = g.K, V = g.V;
  Reference ref;
  ref.out.assign(size_t(std::max<int64_t>(c.L, 1) * HV * V), NAN);
  for (int64_t i = 0; i < c.N; ++i) {
    const int64_t T = c.cu[size_t(i + 1)] - c.cu[size_t(i)];
    if (T == 0) continue;
    const int64_t src = c.indices[size_t(i * g.S + c.acc[size_t(i)] - 1)];
    std::vector<double> M(static_cast<size_t>(HV * V * K));
    for (int64_t hv = 0; hv < HV; ++hv)
      for (int64_t v = 0; v < V; ++v)
        for (int64_t k = 0; k < K; ++k)
          M[size_t((hv * V + v) * K + k)] = c.state.get(c.state_index(src, hv, v, k));
    for (int64_t t = 0; t < T; ++t) {
      const int64_t l = c.cu[size_t(i)] + t;
      for (int64_t hv = 0; hv < HV; ++hv) {
        const auto [q, k, v, alpha, beta] = token_inputs(c, l, hv);
        std::vector<double> o(static_cast<size_t>(V));
        double* Mh = M.data() + hv * V * K;
        for (int64_t r = 0; r < V; ++r) {
          double u = 0;
          for (int64_t d = 0; d < K; ++d) u += alpha * Mh[r * K + d] * k[size_t(d)];
          const double delta = beta * (v[size_t(r)] - u);
          double acc_o = 0;
          for (int64_t d = 0; d < K; ++d) {
            Mh[r * K + d] = alpha * Mh[r * K + d] + k[size_t(d)] * delta;
            acc_o += Mh[r * K + d] * q[size_t(d)];
          }
          o[size_t(r)] = g.round_core_output ? double(round_to(g.out_dtype, float(acc_o))) : acc_o;
        }
        double ms = 0;
        for (double e : o) ms += e * e;
        const double rstd = 1.0 / std::sqrt(ms / double(V) + 1e-6);
        for (int64_t r = 0; r < V; ++r) {
          double y = o[size_t(r)];
          if (g.norm) {
            y *= rstd * c.w.get(r);
            if (g.gated) {
              const double zz = c.z.get((l * HV + hv) * V + r);
              const double sig = 1.0 / (1.0 + std::exp(-zz));
              y *= g.gate == GateActivation::kSiLU ? zz * sig : sig;
            }
          }
          ref.out[size_t((l * HV + hv) * V + r)] = y;
        }
      }
      ref.states.push_back(M);
      const int64_t dest = c.indices[size_t(i * g.S + t)];
      if (dest >= g.first_valid_slot)
        ref.written.emplace_back(dest, int64_t(ref.states.size() - 1));
    }
  }
  return ref;
}

inline double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The pool as written by the kernel for one slot, as [HV, V, K] doubles.
inline std::vector<double> slot_values(const DecodeCase& c, const HostArray& pool, int64_t slot) {
  std::vector<double> s(static_cast<size_t>(c.HV * c.cfg.V * c.cfg.K));
  for (int64_t hv = 0; hv < c.HV; ++hv)
    for (int64_t v = 0; v < c.cfg.V; ++v)
      for (int64_t k = 0; k < c.cfg.K; ++k)
        s[size_t((hv * c.cfg.V + v) * c.cfg.K + k)] = pool.get(c.state_index(slot, hv, v, k));
  return s;
}

}  // namespace gdn::testing
