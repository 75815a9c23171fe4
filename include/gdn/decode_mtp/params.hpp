// decode_mtp: the params struct, argument validation, row validation and the guard.
// Contract: docs decode-mtp.md. Host-only (compiles with g++ alone).
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "gdn/core/host_device.hpp"
#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::decode_mtp {

// The arguments every GDN step operation shares (decode_mtp and replay, docs replay.md): the
// token inputs, the parameters, the state pool, the token offsets, the output and the scalars.
// Optional views are left absent (ndim = -1).
struct StepArgs {
  TensorView mixed_qkv;    // [L, 2*H*K + HV*V], unit column stride, any row stride
  TensorView a, b;         // [L, HV], unit column stride, any row stride
  TensorView A_log;        // [HV]; may be absent when a_is_log_decay
  TensorView dt_bias;      // [HV]; may be absent when a_is_log_decay
  TensorView z;            // [L, HV, V] or absent
  TensorView norm_weight;  // [V] or absent (then out = o, no norm, no gate)
  TensorView state;        // [slots, HV, V, K] ("vk") or [slots, HV, K, V] ("kv")
  TensorView cu_seqlens;   // [N+1]
  TensorView out;          // [L, HV, V], contiguous, written only
  TensorView error_count;  // optional int32 [1] (device path: invalid rows bump it)

  int64_t num_k_heads = 0;  // H; 0 = derive from the mixed_qkv width
  float scale = NAN;        // NaN = K^-1/2
  float l2_eps = 1e-6f;
  float norm_eps = 1e-6f;
  GateActivation gate = GateActivation::kSiLU;
  StateLayout layout = StateLayout::kVK;
  int64_t first_valid_slot = 0;  // slot ids below this are null
  // Round the core output o to out's dtype before the gated RMSNorm, as vLLM's kernels do (its
  // tests compare at that rounding). Off by default: o stays fp32, which is more exact.
  bool round_core_output = false;
  // How the kernels read their inputs (the defaults are the Qwen3-Next layer's; the others take
  // inputs prepared as FLA's kernels take them). a_is_log_decay: `a` holds the log-decay g itself
  // (alpha = exp(a)); A_log and dt_bias are not read and may be absent. b_is_beta: `b` holds beta
  // itself (no sigmoid). qk_l2_norm = false: q and k are used as given (q still times scale).
  bool a_is_log_decay = false;
  bool b_is_beta = false;
  bool qk_l2_norm = true;
};

// One decode_mtp call's arguments: the shared ones plus the per-token slot table.
struct Params : StepArgs {
  TensorView state_indices;        // [N, S] int32/int64, contiguous rows
  TensorView num_accepted_tokens;  // [N] or absent (all 1)
};

// Sizes derived from (and checked against) the arguments.
struct Problem {
  int64_t L = 0, N = 0, S = 0, H = 0, HV = 0, K = 0, V = 0, num_slots = 0;
  int64_t ratio = 0;  // HV / H, exact
  float scale = 0.0f;
  Device device{};
};

// A view and the argument name its errors carry.
using NamedView = std::pair<const TensorView*, const char*>;

// Validates the shared arguments (StepArgs) of a step operation and derives the problem sizes.
// Reads no data. The operation's own arrays are checked by two callbacks taking the Problem, run
// once the head counts and dims are known: `check_own_sizes` validates the arrays that give
// pr.N and pr.S and sets them (cu_seqlens, [N+1], is checked right after), `check_own_rest` the
// others. `own_views` are the operation's own arrays, which must be on the call's device too.
template <class CheckOwnSizes, class CheckOwnRest>
Status check_step_arguments(const StepArgs& p, Problem* out_problem,
                            CheckOwnSizes&& check_own_sizes, CheckOwnRest&& check_own_rest,
                            std::initializer_list<NamedView> own_views) {
  using namespace check;
  Problem pr;
  GDN_RETURN_IF_ERROR(typed(p.state, "state", 4, StateDTypes{}));
  pr.device = p.state.device;
  pr.num_slots = p.state.shape[0];
  pr.HV = p.state.shape[1];
  const bool vk = p.layout == StateLayout::kVK;
  pr.V = vk ? p.state.shape[2] : p.state.shape[3];
  pr.K = vk ? p.state.shape[3] : p.state.shape[2];
  if (pr.HV <= 0 || pr.K <= 0 || pr.V <= 0)
    return Status::invalid("state has an empty head or head-dim dimension (shape " +
                           shape_string(p.state) + ")");
  GDN_RETURN_IF_ERROR(contiguous_from(p.state, "state", 1));
  if (p.state.strides[0] < pr.HV * pr.K * pr.V && pr.num_slots > 1)
    return Status::invalid("state slot stride " + std::to_string(p.state.strides[0]) +
                           " is smaller than one slot (HV*K*V = " +
                           std::to_string(pr.HV * pr.K * pr.V) + "): slots would overlap");

  GDN_RETURN_IF_ERROR(unit_stride_rows(p.mixed_qkv, "mixed_qkv", ActivationDTypes{}));
  pr.L = p.mixed_qkv.shape[0];
  const int64_t width = p.mixed_qkv.shape[1];
  const int64_t key_width = width - pr.HV * pr.V;
  if (key_width <= 0 || key_width % (2 * pr.K) != 0) {
    // Name the dimension most likely wrong: with q|k columns left, a K dim that no key head count
    // fits (while another K would) is the state's K; otherwise the head count, V or the width.
    const std::string dims = std::string(vk ? "dims 1, 2 and 3" : "dims 1, 3 and 2") +
                             " of state " + shape_string(p.state) + ", layout \"" +
                             (vk ? "vk" : "kv") + "\"";
    const std::string left = "mixed_qkv width " + std::to_string(width) +
                             " = 2*H*K + HV*V leaves " + std::to_string(width) + " - " +
                             std::to_string(pr.HV) + "*" + std::to_string(pr.V) + " = " +
                             std::to_string(key_width) + " columns for q|k";
    if (key_width <= 0)
      return Status::invalid("state has HV = " + std::to_string(pr.HV) +
                             " value heads (dim 1 of state " + shape_string(p.state) +
                             "; V = " + std::to_string(pr.V) + " from dim " + (vk ? "2" : "3") +
                             ", layout \"" + (vk ? "vk" : "kv") + "\"), but " + left +
                             ": check state's head count (dim 1) and V, or mixed_qkv's width");
    std::string fits;  // the K each key head count H dividing HV would give this width
    for (int64_t h = 1; h <= pr.HV; ++h)
      if (pr.HV % h == 0 && key_width % (2 * h) == 0)
        fits += std::string(fits.empty() ? "" : ", ") +
                "K = " + std::to_string(key_width / (2 * h)) + " with H = " + std::to_string(h);
    if (fits.empty())
      return Status::invalid(
          left + ", not a multiple of 2*K = " + std::to_string(2 * pr.K) +
          " for any key head count H dividing HV (HV = " + std::to_string(pr.HV) +
          ", V = " + std::to_string(pr.V) + ", K = " + std::to_string(pr.K) + " from " + dims +
          "): check mixed_qkv's width and state's dims");
    return Status::invalid("state's key head dim K = " + std::to_string(pr.K) + " (dim " +
                           (vk ? "3" : "2") + " of state " + shape_string(p.state) + ", layout \"" +
                           (vk ? "vk" : "kv") + "\") does not fit mixed_qkv: " + left +
                           " (HV = " + std::to_string(pr.HV) + ", V = " + std::to_string(pr.V) +
                           "), not a multiple of 2*K = " + std::to_string(2 * pr.K) +
                           "; that width fits " + fits);
  }
  pr.H = key_width / (2 * pr.K);
  if (p.num_k_heads != 0 && p.num_k_heads != pr.H)
    return Status::invalid(
        "num_k_heads = " + std::to_string(p.num_k_heads) +
        " disagrees with the mixed_qkv width, which gives H = " + std::to_string(pr.H));
  GDN_RETURN_IF_ERROR(row_stride_at_least(p.mixed_qkv, "mixed_qkv", width));
  // The ratio must divide exactly: checked before the quotient is used.
  if (pr.HV % pr.H != 0)
    return Status::invalid("value heads HV = " + std::to_string(pr.HV) +
                           " are not a multiple of key heads H = " + std::to_string(pr.H) +
                           " (HV / H must be an integer)");
  pr.ratio = pr.HV / pr.H;

  const Extent token_rows{pr.L, "L (rows of mixed_qkv)"}, value_heads{pr.HV, "HV"},
      value_dim{pr.V, "V"};
  for (auto [view, name] : {NamedView{&p.a, "a"}, NamedView{&p.b, "b"}}) {
    GDN_RETURN_IF_ERROR(shaped(*view, name, ActivationDTypes{}, {token_rows, value_heads}));
    GDN_RETURN_IF_ERROR(unit_stride(*view, name, 1));
    GDN_RETURN_IF_ERROR(nonnegative_strides(*view, name));
  }
  for (auto [view, name] : {NamedView{&p.A_log, "A_log"}, NamedView{&p.dt_bias, "dt_bias"}}) {
    // With a_is_log_decay the gate parameters are not read: absent is fine, given is checked.
    if (p.a_is_log_decay && !view->present()) continue;
    if (!view->present())
      return Status::invalid(std::string(name) +
                             " is required unless a_is_log_decay is set (then `a` holds the "
                             "log-decay g itself and A_log, dt_bias are not read)");
    GDN_RETURN_IF_ERROR(contiguous_vector(*view, name, ParameterDTypes{}, pr.HV, "HV"));
  }
  if (p.z.present()) {
    GDN_RETURN_IF_ERROR(shaped(p.z, "z", ActivationDTypes{}, {token_rows, value_heads, value_dim}));
    GDN_RETURN_IF_ERROR(unit_stride(p.z, "z", 2));
    GDN_RETURN_IF_ERROR(nonnegative_strides(p.z, "z"));
  }
  if (p.norm_weight.present())
    GDN_RETURN_IF_ERROR(
        contiguous_vector(p.norm_weight, "norm_weight", ParameterDTypes{}, pr.V, "V"));
  if (p.z.present() && !p.norm_weight.present())
    return Status::invalid(
        "z (the output gate) was given without norm_weight; the gate is applied "
        "inside the gated RMSNorm, so pass norm_weight too or drop z");

  GDN_RETURN_IF_ERROR(check_own_sizes(pr));
  GDN_RETURN_IF_ERROR(contiguous_vector(p.cu_seqlens, "cu_seqlens", IndexDTypes{}, pr.N + 1,
                                        "N + 1 (rows of state_indices + 1)"));
  GDN_RETURN_IF_ERROR(check_own_rest(pr));

  GDN_RETURN_IF_ERROR(
      shaped(p.out, "out", ActivationDTypes{}, {token_rows, value_heads, value_dim}));
  GDN_RETURN_IF_ERROR(contiguous_from(p.out, "out", 0));

  GDN_RETURN_IF_ERROR(optional_counter(p.error_count, "error_count"));

  for (auto [view, name] :
       {NamedView{&p.mixed_qkv, "mixed_qkv"}, NamedView{&p.a, "a"}, NamedView{&p.b, "b"},
        NamedView{&p.A_log, "A_log"}, NamedView{&p.dt_bias, "dt_bias"}, NamedView{&p.z, "z"},
        NamedView{&p.norm_weight, "norm_weight"}, NamedView{&p.cu_seqlens, "cu_seqlens"},
        NamedView{&p.out, "out"}, NamedView{&p.error_count, "error_count"}})
    GDN_RETURN_IF_ERROR(same_device(*view, name, pr.device));
  for (auto [view, name] : own_views) GDN_RETURN_IF_ERROR(same_device(*view, name, pr.device));

  // Negative ids are how callers mark null slots; a negative first valid slot would let them index
  // before the pool.
  if (p.first_valid_slot < 0)
    return Status::invalid("first_valid_slot = " + std::to_string(p.first_valid_slot) +
                           " must be >= 0 (slot ids below it are null)");
  if (!(p.l2_eps >= 0.0f) || !(p.norm_eps >= 0.0f))
    return Status::invalid("l2_eps and norm_eps must be finite and >= 0");
  pr.scale = std::isnan(p.scale) ? 1.0f / std::sqrt(float(pr.K)) : p.scale;
  if (!std::isfinite(pr.scale)) return Status::invalid("scale must be finite");
  if (out_problem) *out_problem = pr;
  return Status::ok();
}

// Validates every shape, dtype, stride and device and derives the problem sizes. Reads no data.
inline Status check_arguments(const Params& p, Problem* out_problem) {
  using namespace check;
  const auto check_sizes = [&p](Problem& pr) -> Status {
    GDN_RETURN_IF_ERROR(typed(p.state_indices, "state_indices", 2, IndexDTypes{}));
    pr.N = p.state_indices.shape[0];
    pr.S = p.state_indices.shape[1];
    // Before the layout check, which cannot judge an array without columns.
    if (pr.S < 1) return Status::invalid("state_indices must have at least one column (S >= 1)");
    return contiguous_from(p.state_indices, "state_indices", 0);
  };
  const auto check_rest = [&p](Problem& pr) -> Status {
    if (!p.num_accepted_tokens.present()) return Status::ok();
    return contiguous_vector(p.num_accepted_tokens, "num_accepted_tokens", IndexDTypes{}, pr.N,
                             "N (rows of state_indices)");
  };
  return check_step_arguments(p, out_problem, check_sizes, check_rest,
                              {NamedView{&p.state_indices, "state_indices"},
                               NamedView{&p.num_accepted_tokens, "num_accepted_tokens"}});
}

// Per-row facts, resolved from host-visible cu_seqlens / num_accepted_tokens / state_indices.
struct RowInfo {
  int64_t begin = 0;   // first token row
  int64_t T = 0;       // tokens
  int64_t source = 0;  // slot the initial state is read from
};

// The prefix of every row error ("request row i: "); only built for a row that fails.
inline std::string row_prefix(int64_t i) { return "request row " + std::to_string(i) + ": "; }

// What every host-side row check needs first: index arrays (cu_seqlens and `indices`) in host
// memory, and cu_seqlens[N] within the L rows.
inline Status check_rows_readable(const StepArgs& p, const Problem& pr,
                                  std::initializer_list<const TensorView*> indices) {
  bool host = p.cu_seqlens.device.type == DeviceType::kCPU;
  for (const TensorView* v : indices)
    host = host && (!v->present() || v->device.type == DeviceType::kCPU);
  if (!host) return Status::invalid("check_rows needs host-visible index arrays");
  const int64_t total = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, pr.N);
  if (total > pr.L)
    return Status::invalid("cu_seqlens[N] = " + std::to_string(total) +
                           " exceeds L = " + std::to_string(pr.L) + " rows of mixed_qkv");
  return Status::ok();
}

// The error of request row i whose token range [c0, c1) is not inside [0, L).
inline Status token_range_error(int64_t i, int64_t c0, int64_t c1, int64_t L) {
  return Status::invalid(row_prefix(i) + "cu_seqlens[" + std::to_string(i) + "..] = (" +
                         std::to_string(c0) + ", " + std::to_string(c1) +
                         ") is not a non-decreasing range inside [0, L = " + std::to_string(L) +
                         "]");
}

// The one classification of a request row, on the host (check_row, which then names what is wrong)
// and in the CUDA kernel (which pads a padded row and rejects an invalid one): live when its token
// range [c0, c1) lies inside [0, L) with 1..S tokens, its accepted count is in [1, S], every slot
// id of the row is inside the pool and its source slot is not null; padded when the range is empty.
enum class RowClass { kPadded, kInvalid, kLive };
GDN_HOST_DEVICE GDN_FORCE_INLINE RowClass classify_row(int64_t c0, int64_t c1, int64_t L, int64_t S,
                                                       int64_t acc, bool slots_in_pool,
                                                       int64_t source, int64_t first_valid) {
  const bool range_ok = c0 >= 0 && c1 >= c0 && c1 <= L;
  if (range_ok && c1 == c0) return RowClass::kPadded;
  const bool valid = range_ok && c1 - c0 <= S && acc >= 1 && acc <= S && slots_in_pool &&
                     source >= first_valid && source >= 0;
  return valid ? RowClass::kLive : RowClass::kInvalid;
}

// Validates one request row (classify_row); an invalid row's reason names the row and the first
// condition it fails.
inline Status check_row(const Params& p, const Problem& pr, int64_t i, RowInfo* info) {
  const auto at = [&](int64_t c) {
    return load_index(p.state_indices.data, p.state_indices.dtype, i * pr.S + c);
  };
  const int64_t c0 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i);
  const int64_t c1 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i + 1);
  const int64_t acc = p.num_accepted_tokens.present()
                          ? load_index(p.num_accepted_tokens.data, p.num_accepted_tokens.dtype, i)
                          : 1;
  int64_t past_pool = -1;  // the first column whose slot id is past the pool
  for (int64_t c = 0; c < pr.S && past_pool < 0; ++c)
    if (at(c) >= pr.num_slots) past_pool = c;
  const int64_t source = acc >= 1 && acc <= pr.S ? at(acc - 1) : -1;
  info->begin = c0;
  info->T = c1 - c0;
  const RowClass row =
      classify_row(c0, c1, pr.L, pr.S, acc, past_pool < 0, source, p.first_valid_slot);
  if (row == RowClass::kLive) info->source = source;
  if (row != RowClass::kInvalid) return Status::ok();
  if (c0 < 0 || c1 < c0 || c1 > pr.L) return token_range_error(i, c0, c1, pr.L);
  if (c1 - c0 > pr.S)
    return Status::invalid(row_prefix(i) + "has T = " + std::to_string(c1 - c0) +
                           " tokens but state_indices has only S = " + std::to_string(pr.S) +
                           " columns");
  if (acc < 1 || acc > pr.S)
    return Status::invalid(row_prefix(i) + "num_accepted_tokens = " + std::to_string(acc) +
                           " is outside [1, S = " + std::to_string(pr.S) + "]");
  if (past_pool >= 0)
    return Status::invalid(row_prefix(i) + "state_indices[" + std::to_string(i) + ", " +
                           std::to_string(past_pool) + "] = " + std::to_string(at(past_pool)) +
                           " is >= the pool's slot count " + std::to_string(pr.num_slots));
  return Status::invalid(
      row_prefix(i) + "source slot state_indices[" + std::to_string(i) + ", " +
      std::to_string(acc - 1) + "] = " + std::to_string(source) +
      " is null (below first_valid_slot = " + std::to_string(p.first_valid_slot) + ")");
}

// Validates every row of a call whose indices are host-visible, filling `rows` (if given) with
// each row's facts. Nothing may be written before this succeeds.
inline Status check_rows(const Params& p, const Problem& pr, std::vector<RowInfo>* rows = nullptr) {
  GDN_RETURN_IF_ERROR(check_rows_readable(p, pr, {&p.state_indices, &p.num_accepted_tokens}));
  if (rows) rows->assign(size_t(pr.N), RowInfo{});
  RowInfo info;
  for (int64_t i = 0; i < pr.N; ++i)
    GDN_RETURN_IF_ERROR(check_row(p, pr, i, rows ? &(*rows)[size_t(i)] : &info));
  return Status::ok();
}

// ---- Guard
// ---------------------------------------------------------------------------------------

enum class Path : int { kFast, kGeneric, kUnsupported };

inline const char* to_string(Path path) noexcept {
  constexpr const char* kNames[] = {"fast", "generic", "unsupported"};  // Path's order
  return table_entry(path, kNames, "unknown");
}

struct Support {
  Path path = Path::kUnsupported;
  std::string reason;
};

// "Can this configuration use the fused kernel on this device, and if not, why?" Answers from the
// supported-set lists only; `cuda_available` is whether this build holds a CUDA kernel image that
// runs on the target device (the caller probes it).
inline Support can_use(DeviceType device, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t S,
                       DType state_dtype, bool cuda_available = false,
                       StateLayout layout = StateLayout::kVK) {
  if (H <= 0 || HV <= 0 || K <= 0 || V <= 0 || S <= 0)
    return {Path::kUnsupported, "H, HV, K, V and S must all be positive"};
  if (HV % H != 0)
    return {Path::kUnsupported, "HV = " + std::to_string(HV) + " is not a multiple of H = " +
                                    std::to_string(H) + " (non-integral head ratio)"};
  if (!StateDTypes::contains(state_dtype))
    return {Path::kUnsupported,
            "state dtype " + std::string(gdn::to_string(state_dtype)) + " is not supported"};
  const int64_t ratio = HV / H;
  const bool listed = ratio <= 8 && HeadRatios::contains(int(ratio));
  if (device == DeviceType::kCPU) {
    if (listed)
      return {Path::kFast, "CPU kernel specialised for head ratio " + std::to_string(ratio)};
    return {Path::kGeneric,
            "head ratio " + std::to_string(ratio) +
                " is not compiled in; the CPU kernel runs it with a run-time ratio"};
  }
  if (!cuda_available)
    return {Path::kUnsupported, "this build has no CUDA kernel image for the device"};
  if (K != V || !CudaHeadDims::contains(int(K)))
    return {Path::kUnsupported, "CUDA kernel needs K = V = 128, got K = " + std::to_string(K) +
                                    ", V = " + std::to_string(V)};
  if (S > kCudaMaxSpecColumns)
    return {Path::kUnsupported, "CUDA kernel supports S <= " + std::to_string(kCudaMaxSpecColumns) +
                                    " state columns, got " + std::to_string(S)};
  // The "kv" pool cannot be bulk-copied row by row: 16-byte plain loads, one vector store per
  // column of a lane's rows (element by element where its slots are not 16-byte aligned).
  if (layout == StateLayout::kKV)
    return {Path::kGeneric,
            "state layout \"kv\" runs the CUDA kernel's slow path (plain loads instead of bulk "
            "copies, column stores, the run-time head ratio); use \"vk\" for full speed"};
  if (listed)
    return {Path::kFast, "CUDA kernel specialised for head ratio " + std::to_string(ratio)};
  return {Path::kGeneric, "head ratio " + std::to_string(ratio) +
                              " is not compiled in; the CUDA kernel runs it with a run-time ratio"};
}

}  // namespace gdn::decode_mtp
