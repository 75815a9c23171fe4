// causal_conv1d_update for decode and speculative verify: the params struct, argument validation
// and row validation. Math and the buffer rule: docs gdn-math.md §2.2 and §3.3.
// Host-only (compiles with g++ alone).
//
// One call, for every request i with T_i tokens (rows cu_seqlens[i]..cu_seqlens[i+1] of x) and
// every channel c of D:
//
//   acc  = num_accepted_tokens[i] (1 when absent), off = acc - 1
//   hist = buf[c, off .. off + W - 2]                  the last W - 1 accepted raw inputs
//   F    = [hist | x[0, c] .. x[T-1, c]]
//   out[t, c] = act( sum_{j=0}^{W-1} weight[c, j] * F[t + j] )      (fp32, j ascending)
//   buf[c, 0 .. W - 3]         = hist[1 .. W - 2]
//   buf[c, W - 2 + t]          = x[t, c]                          (t = 0 .. T-1)
//
// where buf is the request's conv state, slot conv_state_indices[i] of the pool, holding
// Lbuf = W - 1 + num_spec raw inputs per channel. The next call's window at offset acc' - 1
// (acc' <= T) is then exactly the last W - 1 accepted inputs. Columns past W - 2 + T keep their
// old contents (never read by a valid next step).
//
// The taps over earlier tokens of the same call read those tokens as the buffer stores them
// (rounded to the state dtype), so one T-token call equals T one-token calls bit for bit for any
// combination of dtypes.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::conv {

// Per-slot order of the conv state buffer.
enum class StateLayout : int {
  kChannelsMajor,  // [slots, D, Lbuf] (vLLM "DS"): one channel's history is contiguous
  kTokensMajor,    // [slots, Lbuf, D] (vLLM "SD"): one position of all channels is contiguous
};

enum class Activation : int { kSiLU, kNone };

inline const char* to_string(StateLayout layout) noexcept {
  return layout == StateLayout::kChannelsMajor ? "channels_major" : "tokens_major";
}

// The arguments every conv operation shares (causal_conv1d_update and causal_conv1d_prefill,
// gdn/conv_prefill/params.hpp): non-owning views and scalars. Optional views are left absent
// (ndim = -1).
struct ConvArgs {
  TensorView x;            // [L, D] raw (pre-conv) inputs, unit column stride, any row stride
  TensorView weight;       // [D, W], unit column stride, any row stride >= W
  TensorView conv_state;   // [slots, D, Lbuf] or [slots, Lbuf, D]; inner dims contiguous
  TensorView cu_seqlens;   // [N+1] int32/int64, contiguous
  TensorView out;          // [L, D], unit column stride, any row stride; may be x itself
  TensorView error_count;  // optional int32 [1] (device path: invalid rows bump it)

  StateLayout layout = StateLayout::kChannelsMajor;
  Activation activation = Activation::kSiLU;
  int64_t first_valid_slot = 0;  // slot ids below this are null
};

// One causal_conv1d_update call's arguments: the shared ones plus the slot and accepted count of
// each request.
struct Params : ConvArgs {
  TensorView conv_state_indices;   // [N] int32/int64, any stride (e.g. column 0 of [N, S] indices)
  TensorView num_accepted_tokens;  // [N] int32/int64 or absent (all 1)
};

// Sizes derived from (and checked against) the arguments.
struct Problem {
  int64_t L = 0, N = 0, D = 0, W = 0;
  int64_t buffer_len = 0;  // Lbuf = W - 1 + num_spec
  int64_t S = 0;           // verify columns num_spec + 1 = Lbuf - W + 2: max T and max acc
  int64_t num_slots = 0;
  int64_t slot_stride = 0;
  Device device{};
};

// Element offset of (slot, channel c, buffer position pos) in the conv state pool.
constexpr int64_t state_offset(StateLayout layout, int64_t slot_stride, int64_t D,
                               int64_t buffer_len, int64_t slot, int64_t c, int64_t pos) noexcept {
  return slot * slot_stride +
         (layout == StateLayout::kChannelsMajor ? c * buffer_len + pos : pos * D + c);
}

// A view and the argument name its errors carry.
using NamedView = std::pair<const TensorView*, const char*>;

// Validates the shared arguments (ConvArgs) and the operation's per-request index vectors
// `indices` (each [N], int32/int64, any stride; the first gives N) and derives the problem sizes.
// Reads no data. `check_own(problem)` validates the operation's other arrays once the sizes are
// known; `own_views` are those arrays, which must be on the call's device too.
template <class CheckOwn>
Status check_conv_arguments(const ConvArgs& p, std::initializer_list<NamedView> indices,
                            CheckOwn&& check_own, std::initializer_list<NamedView> own_views,
                            Problem* out_problem) {
  using namespace check;
  Problem pr;

  GDN_RETURN_IF_ERROR(unit_stride_rows(p.weight, "weight", ActivationDTypes{}));
  pr.D = p.weight.shape[0];
  pr.W = p.weight.shape[1];
  if (pr.D < 1)
    return Status::invalid("weight has no channels (shape " + shape_string(p.weight) + ")");
  if (pr.W < 2 || pr.W > kConvMaxWidth)
    return Status::invalid("weight width W = " + std::to_string(pr.W) + " is outside [2, " +
                           std::to_string(kConvMaxWidth) + "] (weight is [D, W])");
  GDN_RETURN_IF_ERROR(row_stride_at_least(p.weight, "weight", pr.W));
  pr.device = p.weight.device;

  GDN_RETURN_IF_ERROR(typed(p.conv_state, "conv_state", 3, ActivationDTypes{}));
  const bool channels_major = p.layout == StateLayout::kChannelsMajor;
  const char* layout_shape =
      channels_major ? "[slots, D, Lbuf] (channels_major)" : "[slots, Lbuf, D] (tokens_major)";
  pr.num_slots = p.conv_state.shape[0];
  const int64_t state_D = channels_major ? p.conv_state.shape[1] : p.conv_state.shape[2];
  pr.buffer_len = channels_major ? p.conv_state.shape[2] : p.conv_state.shape[1];
  if (state_D != pr.D)
    return Status::invalid("conv_state has " + std::to_string(state_D) +
                           " channels but weight has D = " + std::to_string(pr.D) +
                           " (conv_state is " + layout_shape + ", shape " +
                           shape_string(p.conv_state) + ")");
  if (pr.buffer_len < pr.W - 1)
    return Status::invalid(
        "conv_state holds Lbuf = " + std::to_string(pr.buffer_len) +
        " positions per channel, fewer than W - 1 = " + std::to_string(pr.W - 1) +
        " (conv_state is " + layout_shape + ", Lbuf = W - 1 + num_spec)");
  pr.S = pr.buffer_len - pr.W + 2;
  GDN_RETURN_IF_ERROR(contiguous_from(p.conv_state, "conv_state", 1));
  GDN_RETURN_IF_ERROR(nonnegative_strides(p.conv_state, "conv_state"));
  pr.slot_stride = p.conv_state.strides[0];
  if (pr.num_slots > 1 && pr.slot_stride < pr.D * pr.buffer_len)
    return Status::invalid("conv_state slot stride " + std::to_string(pr.slot_stride) +
                           " is smaller than one slot (D * Lbuf = " +
                           std::to_string(pr.D * pr.buffer_len) + "): slots would overlap");

  GDN_RETURN_IF_ERROR(typed(p.x, "x", 2, ActivationDTypes{}));
  GDN_RETURN_IF_ERROR(dim(p.x, "x", 1, pr.D, "D (rows of weight)"));
  GDN_RETURN_IF_ERROR(unit_stride(p.x, "x", 1));
  GDN_RETURN_IF_ERROR(nonnegative_strides(p.x, "x"));
  GDN_RETURN_IF_ERROR(row_stride_at_least(p.x, "x", pr.D));
  pr.L = p.x.shape[0];

  GDN_RETURN_IF_ERROR(shaped(p.out, "out", ActivationDTypes{},
                             {{pr.L, "L (rows of x)"}, {pr.D, "D (rows of weight)"}}));
  GDN_RETURN_IF_ERROR(unit_stride(p.out, "out", 1));
  GDN_RETURN_IF_ERROR(nonnegative_strides(p.out, "out"));
  GDN_RETURN_IF_ERROR(row_stride_at_least(p.out, "out", pr.D));
  // In place is x itself (same memory, same strides, same dtype); any other overlap is undefined.
  if (p.out.data == p.x.data && pr.L > 0 &&
      (p.out.dtype != p.x.dtype || (pr.L > 1 && p.out.strides[0] != p.x.strides[0])))
    return Status::invalid(
        "out shares its data pointer with x but not its dtype and row stride; "
        "in-place use needs out to be x itself");

  const char* first_index = indices.begin()->second;
  for (auto [view, name] : indices) {
    if (view == indices.begin()->first) {
      GDN_RETURN_IF_ERROR(typed(*view, name, 1, IndexDTypes{}));
      pr.N = view->shape[0];
    } else {
      const std::string what = "N (entries of " + std::string(first_index) + ")";
      GDN_RETURN_IF_ERROR(shaped(*view, name, IndexDTypes{}, {{pr.N, what.c_str()}}));
    }
    GDN_RETURN_IF_ERROR(nonnegative_strides(*view, name));
  }

  const std::string cu_what = "N + 1 (entries of " + std::string(first_index) + " + 1)";
  GDN_RETURN_IF_ERROR(
      contiguous_vector(p.cu_seqlens, "cu_seqlens", IndexDTypes{}, pr.N + 1, cu_what.c_str()));
  GDN_RETURN_IF_ERROR(check_own(static_cast<const Problem&>(pr)));
  GDN_RETURN_IF_ERROR(optional_counter(p.error_count, "error_count"));

  if (p.first_valid_slot < 0)
    return Status::invalid("first_valid_slot must be >= 0, got " +
                           std::to_string(p.first_valid_slot));

  for (auto [view, name] : {NamedView{&p.x, "x"}, NamedView{&p.conv_state, "conv_state"},
                            NamedView{&p.cu_seqlens, "cu_seqlens"}, NamedView{&p.out, "out"},
                            NamedView{&p.error_count, "error_count"}})
    GDN_RETURN_IF_ERROR(same_device(*view, name, pr.device));
  for (auto [view, name] : indices) GDN_RETURN_IF_ERROR(same_device(*view, name, pr.device));
  for (auto [view, name] : own_views) GDN_RETURN_IF_ERROR(same_device(*view, name, pr.device));

  if (out_problem) *out_problem = pr;
  return Status::ok();
}

// Validates every shape, dtype, stride and device and derives the problem sizes. Reads no data.
inline Status check_arguments(const Params& p, Problem* out_problem) {
  const auto check_own = [&p](const Problem& pr) -> Status {
    if (!p.num_accepted_tokens.present()) return Status::ok();
    return check::contiguous_vector(p.num_accepted_tokens, "num_accepted_tokens", IndexDTypes{},
                                    pr.N, "N (entries of conv_state_indices)");
  };
  return check_conv_arguments(p, {NamedView{&p.conv_state_indices, "conv_state_indices"}},
                              check_own, {NamedView{&p.num_accepted_tokens, "num_accepted_tokens"}},
                              out_problem);
}

// What one request row does.
enum class RowAction : int {
  kRun,      // valid: compute outputs, rewrite the buffer
  kSkipped,  // T = 0 (padding) or a null conv slot: nothing is read or written
  kInvalid,  // an error (host: the call fails; device: zero outputs, bump error_count)
};

// Per-row facts resolved from host-visible cu_seqlens / num_accepted_tokens / conv_state_indices.
struct RowInfo {
  int64_t begin = 0;   // first token row
  int64_t T = 0;       // tokens
  int64_t slot = 0;    // conv state slot
  int64_t offset = 0;  // window offset acc - 1
};

// Classifies one request row; for an invalid row the reason names the row and what is wrong.
// The same rules run inside the CUDA kernel (without the messages).
inline Status check_row(const Params& p, const Problem& pr, int64_t i, RowInfo* info,
                        RowAction* action) {
  const int64_t begin = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i);
  const int64_t end = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i + 1);
  // The message prefix is only built for a row that fails.
  const auto row = [i] { return "request row " + std::to_string(i) + ": "; };
  *action = RowAction::kInvalid;
  if (begin < 0 || end < begin || end > pr.L)
    return Status::invalid(
        row() + "cu_seqlens[" + std::to_string(i) + "..] = (" + std::to_string(begin) + ", " +
        std::to_string(end) +
        ") is not a non-decreasing range inside [0, L = " + std::to_string(pr.L) + "]");
  info->begin = begin;
  info->T = end - begin;
  if (info->T == 0) {
    *action = RowAction::kSkipped;
    return Status::ok();
  }
  const int64_t slot = load_index(p.conv_state_indices.data, p.conv_state_indices.dtype,
                                  i * p.conv_state_indices.strides[0]);
  info->slot = slot;
  if (slot < p.first_valid_slot) {
    *action = RowAction::kSkipped;
    return Status::ok();
  }
  if (slot >= pr.num_slots)
    return Status::invalid(row() + "conv_state_indices[" + std::to_string(i) +
                           "] = " + std::to_string(slot) + " is >= the pool's slot count " +
                           std::to_string(pr.num_slots));
  if (info->T > pr.S)
    return Status::invalid(
        row() + "has T = " + std::to_string(info->T) +
        " tokens but conv_state holds only num_spec + 1 = " + std::to_string(pr.S) +
        " (Lbuf = " + std::to_string(pr.buffer_len) + ", W = " + std::to_string(pr.W) + ")");
  const int64_t acc = p.num_accepted_tokens.present()
                          ? load_index(p.num_accepted_tokens.data, p.num_accepted_tokens.dtype, i)
                          : 1;
  if (acc < 1 || acc > pr.S)
    return Status::invalid(row() + "num_accepted_tokens = " + std::to_string(acc) +
                           " is outside [1, num_spec + 1 = " + std::to_string(pr.S) + "]");
  info->offset = acc - 1;
  *action = RowAction::kRun;
  return Status::ok();
}

// Validates every row of a call whose indices are host-visible. Nothing may be written before this
// succeeds.
inline Status check_rows(const Params& p, const Problem& pr,
                         std::vector<RowInfo>* runnable = nullptr) {
  if (p.conv_state_indices.device.type != DeviceType::kCPU ||
      p.cu_seqlens.device.type != DeviceType::kCPU ||
      (p.num_accepted_tokens.present() && p.num_accepted_tokens.device.type != DeviceType::kCPU))
    return Status::invalid("check_rows needs host-visible index arrays");
  // `runnable` (if given) receives the rows that run (not padded, not null), in order.
  if (runnable) runnable->clear();
  RowInfo info;
  RowAction action;
  for (int64_t i = 0; i < pr.N; ++i) {
    GDN_RETURN_IF_ERROR(check_row(p, pr, i, &info, &action));
    if (runnable && action == RowAction::kRun) runnable->push_back(info);
  }
  return Status::ok();
}

}  // namespace gdn::conv
