// A replay-verify test case: owning host buffers for the checkpoint pool and the windows, random
// tokens, batches built from per-request token lists, params for replay and for the decode_mtp
// worlds it is compared with, and a float64 reference of one replay step (through the decode_mtp
// tests' float64 reference).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "decode_mtp_case.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::testing {

struct ReplayConfig {
  int64_t H = 2, ratio = 2, K = 32, V = 24, S = 4, N = 3;
  int64_t spare_slots = 3;  // checkpoint slots no request owns: never touched
  DType state_dtype = DType::kFloat32, act_dtype = DType::kFloat32;
  StateLayout layout = StateLayout::kVK;
  GateActivation gate = GateActivation::kSiLU;
  bool fused_windows = true;  // window_k|v: one [slots, S, H*K + HV*V] buffer; window_a|b: halves
                              // of one [slots, S, 2*HV]; else four padded-slot arrays
  int64_t first_valid_slot = 0;
  uint32_t seed = 1;
};

// One token's raw inputs in the activation dtype: its mixed_qkv row, a | b and z.
struct Token {
  HostArray qkv, ab, z;  // [2*H*K + HV*V], [2*HV], [HV*V]
};

// One call's token inputs and output, rows grouped by request.
struct Batch {
  int64_t L = 0;
  HostArray qkv, ab, z, out;  // [L, row_stride] (pad columns NaN), [L, 2*HV], [L, HV*V], [L, HV*V]
  std::vector<int32_t> cu;
};

class ReplayCase {
 public:
  static constexpr int64_t kQkvRowPad = 3, kSlotPad = 5, kWindowSlotPad = 7;

  ReplayConfig cfg;
  int64_t HV, HK, HVV, width, row_stride, slot_stride, slots;
  std::mt19937 rng;
  HostArray A_log, dt_bias, w;
  HostArray state;                                   // the checkpoint pool
  HostArray window_kv, window_ab;                    // fused windows
  HostArray window_k, window_v, window_a, window_b;  // separate windows
  std::vector<int32_t> window_len;
  std::vector<int32_t> owner_slot;  // checkpoint slot of each request (distinct)

  explicit ReplayCase(ReplayConfig c) : cfg(c), rng(c.seed) {
    HV = cfg.H * cfg.ratio;
    HK = cfg.H * cfg.K;
    HVV = HV * cfg.V;
    width = 2 * HK + HVV;
    row_stride = width + kQkvRowPad;
    slot_stride = HV * cfg.K * cfg.V + kSlotPad;
    slots = cfg.first_valid_slot + cfg.N + cfg.spare_slots;
    A_log = random_array(DType::kFloat32, HV, 0.5f);
    dt_bias = random_array(DType::kFloat32, HV, 0.1f);
    w = random_array(DType::kFloat32, cfg.V, 1.0f);
    state = random_pool(slots);
    const DType act = cfg.act_dtype;
    if (cfg.fused_windows) {
      window_kv = nan_array(act, slots * cfg.S * (HK + HVV));
      window_ab = nan_array(act, slots * cfg.S * 2 * HV);
    } else {
      window_k = nan_array(act, slots * window_slot_stride(HK));
      window_v = nan_array(act, slots * window_slot_stride(HVV));
      window_a = nan_array(act, slots * window_slot_stride(HV));
      window_b = nan_array(act, slots * window_slot_stride(HV));
    }
    // Spare slots hold arbitrary counts; the requests' slots start with nothing pending.
    std::uniform_int_distribution<int32_t> count(0, int32_t(cfg.S));
    window_len.resize(size_t(slots));
    for (int32_t& x : window_len) x = count(rng);
    std::vector<int32_t> ids;
    for (int64_t s = cfg.first_valid_slot; s < slots; ++s) ids.push_back(int32_t(s));
    std::shuffle(ids.begin(), ids.end(), rng);
    owner_slot.assign(ids.begin(), ids.begin() + cfg.N);
    for (int32_t s : owner_slot) window_len[size_t(s)] = 0;
  }

  int64_t window_slot_stride(int64_t w_cols) const { return cfg.S * w_cols + kWindowSlotPad; }
  int64_t state_bytes() const { return HV * cfg.K * cfg.V * dtype_size(cfg.state_dtype); }

  HostArray random_array(DType t, int64_t n, float scale) {
    std::normal_distribution<float> n01;
    HostArray a(t, n);
    for (int64_t i = 0; i < n; ++i) a.set(i, scale * n01(rng));
    return a;
  }
  static HostArray nan_array(DType t, int64_t n) {
    HostArray a(t, n);
    for (int64_t i = 0; i < n; ++i) a.set(i, NAN);
    return a;
  }
  HostArray random_pool(int64_t n_slots) {
    return random_array(cfg.state_dtype, n_slots * slot_stride, 0.1f);
  }

  Token random_token() {
    return {random_array(cfg.act_dtype, width, 1.0f), random_array(cfg.act_dtype, 2 * HV, 1.0f),
            random_array(cfg.act_dtype, HVV, 1.0f)};
  }

  // The batch of per-request token lists (an empty list: the request has no tokens).
  Batch batch(const std::vector<std::vector<Token>>& tokens) const {
    Batch b;
    b.cu.assign(1, 0);
    for (const auto& list : tokens) b.cu.push_back(b.cu.back() + int32_t(list.size()));
    b.L = b.cu.back();
    const int64_t rows = std::max<int64_t>(b.L, 1);
    const DType act = cfg.act_dtype;
    b.qkv = nan_array(act, rows * row_stride);
    b.ab = HostArray(act, rows * 2 * HV);
    b.z = HostArray(act, rows * HVV);
    b.out = nan_array(act, rows * HVV);
    const int64_t esz = dtype_size(act);
    int64_t l = 0;
    for (const auto& list : tokens)
      for (const Token& t : list) {
        std::memcpy(b.qkv.bytes.data() + l * row_stride * esz, t.qkv.bytes.data(),
                    t.qkv.bytes.size());
        std::memcpy(b.ab.bytes.data() + l * 2 * HV * esz, t.ab.bytes.data(), t.ab.bytes.size());
        std::memcpy(b.z.bytes.data() + l * HVV * esz, t.z.bytes.data(), t.z.bytes.size());
        ++l;
      }
    return b;
  }

  // The arguments every step operation shares, over batch b and the pool of n_slots slots.
  decode_mtp::StepArgs step_args(Batch& b, HostArray& pool, int64_t n_slots) {
    using TV = TensorView;
    const DType act = cfg.act_dtype;
    decode_mtp::StepArgs p;
    p.mixed_qkv = TV::make(b.qkv.data(), act, {b.L, width}, {row_stride, 1});
    p.a = TV::make(b.ab.data(), act, {b.L, HV}, {2 * HV, 1});
    p.b = TV::make(b.ab.bytes.data() + HV * dtype_size(act), act, {b.L, HV}, {2 * HV, 1});
    p.A_log = TV::make(A_log.data(), DType::kFloat32, {HV});
    p.dt_bias = TV::make(dt_bias.data(), DType::kFloat32, {HV});
    p.norm_weight = TV::make(w.data(), DType::kFloat32, {cfg.V});
    p.z = TV::make(b.z.data(), act, {b.L, HV, cfg.V});
    p.out = TV::make(b.out.data(), act, {b.L, HV, cfg.V});
    const bool vk = cfg.layout == StateLayout::kVK;
    p.state = TV::make(pool.data(), cfg.state_dtype,
                       {n_slots, HV, vk ? cfg.V : cfg.K, vk ? cfg.K : cfg.V},
                       {slot_stride, cfg.K * cfg.V, vk ? cfg.K : cfg.V, 1});
    p.cu_seqlens = TV::make(b.cu.data(), DType::kInt32, {int64_t(b.cu.size())});
    p.gate = cfg.gate;
    p.layout = cfg.layout;
    p.first_valid_slot = cfg.first_valid_slot;
    return p;
  }

  // Replay over batch b: request i uses checkpoint slot slot_ids[i] and replays n[i] tokens.
  replay::Params replay_params(Batch& b, std::vector<int32_t>& slot_ids, std::vector<int32_t>& n) {
    using TV = TensorView;
    replay::Params p;
    static_cast<decode_mtp::StepArgs&>(p) = step_args(b, state, slots);
    p.state_indices = TV::make(slot_ids.data(), DType::kInt32, {int64_t(slot_ids.size())});
    p.num_accepted_tokens = TV::make(n.data(), DType::kInt32, {int64_t(n.size())});
    p.window_len = TV::make(window_len.data(), DType::kInt32, {slots});
    const DType act = cfg.act_dtype;
    const int64_t esz = dtype_size(act), S = cfg.S;
    if (cfg.fused_windows) {
      const int64_t kv = HK + HVV;
      p.window_k = TV::make(window_kv.data(), act, {slots, S, HK}, {S * kv, kv, 1});
      p.window_v =
          TV::make(window_kv.bytes.data() + HK * esz, act, {slots, S, HVV}, {S * kv, kv, 1});
      p.window_a = TV::make(window_ab.data(), act, {slots, S, HV}, {S * 2 * HV, 2 * HV, 1});
      p.window_b =
          TV::make(window_ab.bytes.data() + HV * esz, act, {slots, S, HV}, {S * 2 * HV, 2 * HV, 1});
    } else {
      const auto view = [&](HostArray& a, int64_t cols) {
        return TV::make(a.data(), act, {slots, S, cols}, {window_slot_stride(cols), cols, 1});
      };
      p.window_k = view(window_k, HK);
      p.window_v = view(window_v, HVV);
      p.window_a = view(window_a, HV);
      p.window_b = view(window_b, HV);
    }
    return p;
  }

  // Write-every-token decode_mtp over batch b on `pool` (n_slots slots), [N, S_cols] slot table.
  decode_mtp::Params mtp_params(Batch& b, HostArray& pool, int64_t n_slots,
                                std::vector<int32_t>& indices, int64_t S_cols,
                                std::vector<int32_t>& acc) {
    using TV = TensorView;
    decode_mtp::Params p;
    static_cast<decode_mtp::StepArgs&>(p) = step_args(b, pool, n_slots);
    p.state_indices = TV::make(indices.data(), DType::kInt32, {int64_t(acc.size()), S_cols});
    p.num_accepted_tokens = TV::make(acc.data(), DType::kInt32, {int64_t(acc.size())});
    return p;
  }

  // Every window byte of a slot (all four windows), for before/after comparisons.
  std::vector<uint8_t> window_bytes(int64_t slot) const {
    std::vector<uint8_t> out;
    const auto append = [&](const HostArray& a) {
      if (a.count == 0) return;
      const auto per_slot = a.bytes.size() / size_t(slots);
      out.insert(out.end(), a.bytes.begin() + ptrdiff_t(size_t(slot) * per_slot),
                 a.bytes.begin() + ptrdiff_t(size_t(slot + 1) * per_slot));
    };
    for (const HostArray* a : {&window_kv, &window_ab, &window_k, &window_v, &window_a, &window_b})
      append(*a);
    return out;
  }

  uint8_t* slot_ptr(HostArray& pool, int64_t slot) const {
    return pool.bytes.data() + slot * slot_stride * dtype_size(cfg.state_dtype);
  }
  const uint8_t* slot_ptr(const HostArray& pool, int64_t slot) const {
    return pool.bytes.data() + slot * slot_stride * dtype_size(cfg.state_dtype);
  }

  // Element (v, k) of head hv in a slot, honouring the layout.
  int64_t state_index(int64_t slot, int64_t hv, int64_t v, int64_t k) const {
    const int64_t base = slot * slot_stride + hv * cfg.K * cfg.V;
    return cfg.layout == StateLayout::kVK ? base + v * cfg.K + k : base + k * cfg.V + v;
  }
  // A pool slot as [HV, V, K] doubles.
  std::vector<double> slot_values(const HostArray& pool, int64_t slot) const {
    std::vector<double> s(size_t(HV * cfg.V * cfg.K));
    for (int64_t hv = 0; hv < HV; ++hv)
      for (int64_t v = 0; v < cfg.V; ++v)
        for (int64_t k = 0; k < cfg.K; ++k)
          s[size_t((hv * cfg.V + v) * cfg.K + k)] = pool.get(state_index(slot, hv, v, k));
    return s;
  }
};

// Float64 reference of one replay step of one request: from the checkpoint in `slot` of `pool`
// (as stored, already rounded), the `replayed` tokens then the `fresh` ones.
struct StepReference {
  std::vector<double> checkpoint;  // [HV, V, K] after the replayed tokens
  std::vector<double> out;         // [T, HV, V] of the fresh tokens
};

inline StepReference reference_step(const ReplayCase& rc, const HostArray& pool, int64_t slot,
                                    const std::vector<Token>& replayed,
                                    const std::vector<Token>& fresh) {
  const auto n = int64_t(replayed.size()), T = int64_t(fresh.size());
  CaseConfig cfg;
  cfg.H = rc.cfg.H;
  cfg.ratio = rc.cfg.ratio;
  cfg.K = rc.cfg.K;
  cfg.V = rc.cfg.V;
  cfg.S = std::max<int64_t>(n + T, 1);
  cfg.slots = 1;
  cfg.T = {n + T};
  cfg.acc = {1};
  cfg.state_dtype = rc.cfg.state_dtype;
  cfg.act_dtype = rc.cfg.act_dtype;
  cfg.out_dtype = rc.cfg.act_dtype;
  cfg.layout = rc.cfg.layout;
  cfg.gate = rc.cfg.gate;
  cfg.qkv_row_pad = ReplayCase::kQkvRowPad;
  cfg.slot_pad = ReplayCase::kSlotPad;
  DecodeCase c(cfg);  // its own random data, replaced below by the step's
  std::vector<Token> all = replayed;
  all.insert(all.end(), fresh.begin(), fresh.end());
  const Batch b = rc.batch({all});
  c.qkv.bytes = b.qkv.bytes;
  c.ab.bytes = b.ab.bytes;
  c.z.bytes = b.z.bytes;
  c.A_log.bytes = rc.A_log.bytes;
  c.dt_bias.bytes = rc.dt_bias.bytes;
  c.w.bytes = rc.w.bytes;
  std::memcpy(c.state.bytes.data(), rc.slot_ptr(pool, slot), size_t(rc.state_bytes()));
  const Reference ref = reference(c);
  StepReference r;
  r.checkpoint = n > 0 ? ref.states[size_t(n - 1)] : slot_values(c, c.state, 0);
  const auto row = size_t(rc.HVV);
  r.out.assign(ref.out.begin() + ptrdiff_t(size_t(n) * row),
               ref.out.begin() + ptrdiff_t(size_t(n + T) * row));
  return r;
}

}  // namespace gdn::testing
