// Replay verify: the params struct, argument validation, row validation and the guard.
// Contract: docs replay.md (decode-mtp.md for everything it shares). Host-only (compiles with g++
// alone).
//
// One checkpoint slot per request. For request i (slot s = state_indices[i], n =
// num_accepted_tokens[i], T = T_i tokens) one call:
//   1. reads the checkpoint state[s] once,
//   2. replays tokens 0..n-1 of slot s's window (state only, no output),
//   3. stores that state as the new checkpoint (the only full-state store; skipped when n = 0,
//      where it would store what was read),
//   4. runs the T new tokens from it (outputs exactly as decode_mtp; no state store),
//   5. saves the T new tokens' raw k, v, a, b rows into slot s's window, window_len[s] = T.
//
// Window format: four views indexed [slot, token, column], each with unit column stride and any
// slot / token strides, in the dtype of the input it copies (so nothing is rounded twice):
//   window_k [slots, S, H*K]   the k part of mixed_qkv rows     (dtype of mixed_qkv)
//   window_v [slots, S, HV*V]  the v part of mixed_qkv rows     (dtype of mixed_qkv)
//   window_a [slots, S, HV]    rows of a                        (dtype of a)
//   window_b [slots, S, HV]    rows of b                        (dtype of b)
// window_k and window_v may be views of one [slots, S, H*K + HV*V] buffer, window_a and window_b
// the two halves of one [slots, S, 2*HV] buffer, as a and b usually are of one `ba` tensor. The
// window stores raw inputs: replay recomputes the L2 norm of k, g and beta exactly as the first
// pass did. S, the window capacity, is the windows' dimension 1; T_i <= S.
//
// Rows: T = 0 or a null slot (below first_valid_slot) is a padded row: nothing is read or written
// for it, out rows included, whatever its replay count. A row is invalid when T > S, slot >=
// slots, n < 0, n > S or n > window_len[s], or when two live rows share a checkpoint slot. With
// host-visible indices the call raises before anything is written; a device path must store
// nothing for such a row (no checkpoint, window or window_len), zero its outputs and count it in
// error_count.
//
// Order within a call: every replay read of a window precedes every window save. The CPU path
// runs all (request, value head) tasks, then all saves. A CUDA kernel whose value heads of one
// request run in different CTAs must keep that order too: with HV > H the r value heads of a key
// head all read that key head's stored k, so a CTA that saves k early can clobber a row another
// CTA still replays (store k per value head, alternate two windows by a per-slot parity, or finish
// all replays before any save; racecheck does not see cross-CTA global-memory races).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gdn/decode_mtp/params.hpp"

namespace gdn::replay {

using decode_mtp::NamedView;
using decode_mtp::Path;
using decode_mtp::Problem;  // S = window capacity (dimension 1 of the window arrays)
using decode_mtp::Support;

// One call's arguments: decode_mtp's shared ones (mixed_qkv, a, b, A_log, dt_bias, z, norm_weight,
// state, cu_seqlens, out, error_count and the scalars) plus the checkpoint table and the window.
struct Params : decode_mtp::StepArgs {
  // state is the checkpoint pool [slots, HV, V, K] ("vk") or [slots, HV, K, V] ("kv").
  TensorView state_indices;       // [N] int32/int64, any stride (e.g. column 0 of a block table):
                                  // checkpoint slot of each request (null: padded)
  TensorView window_k;            // [slots, S, H*K], dtype of mixed_qkv   (read, then written)
  TensorView window_v;            // [slots, S, HV*V], dtype of mixed_qkv  (read, then written)
  TensorView window_a, window_b;  // [slots, S, HV], dtypes of a and b     (read, then written)
  TensorView window_len;  // [slots] int32: tokens in each slot's window (read, then written)
  TensorView num_accepted_tokens;  // [N] int32/int64: window tokens to replay, 0..window_len[s]
};

namespace detail {

// A written [slots, S, width] window view: exactly that shape, one dtype, unit column stride and
// no two elements at one address (any slot and token strides otherwise).
inline Status check_window(const TensorView& t, const char* name, DType dtype, const char* dtype_of,
                           int64_t slots, int64_t S, int64_t width, const char* width_what) {
  using namespace check;
  GDN_RETURN_IF_ERROR(present(t, name));
  GDN_RETURN_IF_ERROR(ndim(t, name, 3));
  if (t.dtype != dtype)
    return Status::invalid(std::string(name) + " has dtype " + std::string(to_string(t.dtype)) +
                           " but must have " + dtype_of + "'s dtype " +
                           std::string(to_string(dtype)) +
                           ": the window keeps the raw inputs unrounded");
  GDN_RETURN_IF_ERROR(dim(t, name, 0, slots, "slots (dim 0 of state)"));
  GDN_RETURN_IF_ERROR(dim(t, name, 1, S, "S (dim 1 of window_k)"));
  GDN_RETURN_IF_ERROR(dim(t, name, 2, width, width_what));
  GDN_RETURN_IF_ERROR(unit_stride(t, name, 2));
  GDN_RETURN_IF_ERROR(nonnegative_strides(t, name));
  // Dimensions with more than one element, by increasing stride: each stride must step past the
  // whole span of the smaller ones.
  int order[3] = {0, 1, 2};
  std::sort(order, order + 3, [&t](int x, int y) { return t.strides[x] < t.strides[y]; });
  int64_t span = 1;
  for (int d : order) {
    if (t.shape[d] <= 1) continue;
    if (t.strides[d] < span)
      return Status::invalid(std::string(name) + " strides (" + std::to_string(t.strides[0]) +
                             ", " + std::to_string(t.strides[1]) + ", " +
                             std::to_string(t.strides[2]) + ") for shape " + shape_string(t) +
                             " put two elements at one address");
    span = t.strides[d] * (t.shape[d] - 1) + span;
  }
  return Status::ok();
}

}  // namespace detail

// Validates every shape, dtype, stride and device and derives the problem sizes. Reads no data.
inline Status check_arguments(const Params& p, Problem* out_problem) {
  using namespace check;
  const auto check_sizes = [&p](Problem& pr) -> Status {
    GDN_RETURN_IF_ERROR(typed(p.state_indices, "state_indices", 1, IndexDTypes{}));
    GDN_RETURN_IF_ERROR(nonnegative_strides(p.state_indices, "state_indices"));
    pr.N = p.state_indices.shape[0];
    GDN_RETURN_IF_ERROR(present(p.window_k, "window_k"));
    GDN_RETURN_IF_ERROR(ndim(p.window_k, "window_k", 3));
    pr.S = p.window_k.shape[1];
    if (pr.S < 1)
      return Status::invalid(
          "window_k must hold at least one token per slot (dim 1 = S >= 1), "
          "got shape " +
          shape_string(p.window_k));
    return Status::ok();
  };
  const auto check_rest = [&p](Problem& pr) -> Status {
    GDN_RETURN_IF_ERROR(contiguous_vector(p.num_accepted_tokens, "num_accepted_tokens",
                                          IndexDTypes{}, pr.N, "N (length of state_indices)"));
    const struct {
      const TensorView& view;
      const char* name;
      DType dtype;
      const char* dtype_of;
      int64_t width;
      const char* width_what;
    } windows[] = {
        {p.window_k, "window_k", p.mixed_qkv.dtype, "mixed_qkv", pr.H * pr.K, "H*K"},
        {p.window_v, "window_v", p.mixed_qkv.dtype, "mixed_qkv", pr.HV * pr.V, "HV*V"},
        {p.window_a, "window_a", p.a.dtype, "a", pr.HV, "HV"},
        {p.window_b, "window_b", p.b.dtype, "b", pr.HV, "HV"},
    };
    for (const auto& w : windows)
      GDN_RETURN_IF_ERROR(detail::check_window(w.view, w.name, w.dtype, w.dtype_of, pr.num_slots,
                                               pr.S, w.width, w.width_what));
    return contiguous_vector(p.window_len, "window_len", {DType::kInt32}, pr.num_slots,
                             "slots (dim 0 of state)");
  };
  return decode_mtp::check_step_arguments(
      p, out_problem, check_sizes, check_rest,
      {NamedView{&p.state_indices, "state_indices"},
       NamedView{&p.num_accepted_tokens, "num_accepted_tokens"}, NamedView{&p.window_k, "window_k"},
       NamedView{&p.window_v, "window_v"}, NamedView{&p.window_a, "window_a"},
       NamedView{&p.window_b, "window_b"}, NamedView{&p.window_len, "window_len"}});
}

// Per-row facts, resolved from host-visible cu_seqlens / state_indices / num_accepted_tokens /
// window_len.
struct RowInfo {
  int64_t begin = 0;   // first token row
  int64_t T = 0;       // tokens
  int64_t slot = -1;   // checkpoint slot
  int64_t replay = 0;  // window tokens replayed (n)
  bool live = false;   // false: padded row (T = 0 or a null slot), nothing read or written
};

// Element offset of window row (slot, token) of a [slots, S, width] window view.
inline int64_t window_offset(const TensorView& w, int64_t slot, int64_t token) {
  return slot * w.strides[0] + token * w.strides[1];
}

// The one classification of a replay request row, on the host (check_row, which then names what
// is wrong) and in the CUDA kernel: padded when it has no tokens or a null checkpoint slot (nothing
// read or written); invalid when its token range leaves [0, L) or holds more than S tokens, its
// slot is past the pool, or its replay count n is outside [0, S] or past the `stored` tokens of the
// slot's window (the kernel passes INT64_MAX before it has read them).
enum class ReplayRow { kPadded, kInvalid, kLive };
GDN_HOST_DEVICE GDN_FORCE_INLINE ReplayRow classify_replay_row(int64_t c0, int64_t c1, int64_t L,
                                                               int64_t S, int64_t slot,
                                                               int64_t num_slots,
                                                               int64_t first_valid, int64_t n,
                                                               int64_t stored) {
  if (c0 < 0 || c1 < c0 || c1 > L) return ReplayRow::kInvalid;
  if (c1 == c0) return ReplayRow::kPadded;
  if (c1 - c0 > S || slot >= num_slots) return ReplayRow::kInvalid;
  if (slot < first_valid || slot < 0) return ReplayRow::kPadded;  // null checkpoint slot
  if (n < 0 || n > S || n > stored) return ReplayRow::kInvalid;
  return ReplayRow::kLive;
}

// Validates one request row (classify_replay_row); an invalid row's reason names the row, the
// argument and the first condition it fails.
inline Status check_row(const Params& p, const Problem& pr, int64_t i, RowInfo* info) {
  using decode_mtp::row_prefix;
  *info = RowInfo{};
  const int64_t c0 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i);
  const int64_t c1 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i + 1);
  const int64_t slot =
      load_index(p.state_indices.data, p.state_indices.dtype, i * p.state_indices.strides[0]);
  const int64_t n = load_index(p.num_accepted_tokens.data, p.num_accepted_tokens.dtype, i);
  // The window is read only for a slot inside the pool.
  const int64_t stored = slot >= 0 && slot < pr.num_slots
                             ? load_index(p.window_len.data, DType::kInt32, slot)
                             : INT64_MAX;
  info->begin = c0;
  info->T = c1 - c0;
  const ReplayRow row =
      classify_replay_row(c0, c1, pr.L, pr.S, slot, pr.num_slots, p.first_valid_slot, n, stored);
  if (row == ReplayRow::kLive) {
    info->slot = slot;
    info->replay = n;
    info->live = true;
  }
  if (row != ReplayRow::kInvalid) return Status::ok();
  const std::string at = "state_indices[" + std::to_string(i) + "] = " + std::to_string(slot);
  const std::string accepted =
      "num_accepted_tokens[" + std::to_string(i) + "] = " + std::to_string(n);
  if (c0 < 0 || c1 < c0 || c1 > pr.L) return decode_mtp::token_range_error(i, c0, c1, pr.L);
  if (c1 - c0 > pr.S)
    return Status::invalid(row_prefix(i) + "has T = " + std::to_string(c1 - c0) +
                           " tokens but the window holds only S = " + std::to_string(pr.S) +
                           " (dim 1 of window_k)");
  if (slot >= pr.num_slots)
    return Status::invalid(row_prefix(i) + at + " is >= the pool's slot count " +
                           std::to_string(pr.num_slots));
  if (n < 0 || n > pr.S)
    return Status::invalid(row_prefix(i) + accepted +
                           " is outside [0, S = " + std::to_string(pr.S) + "]");
  return Status::invalid(row_prefix(i) + accepted + " exceeds window_len[" + std::to_string(slot) +
                         "] = " + std::to_string(stored) +
                         ", the tokens stored in the window of checkpoint slot " +
                         std::to_string(slot) + " (" + at + ")");
}

// Validates every row of a call whose indices are host-visible, filling `rows` (if given) with
// each row's facts. Two live rows may not share a checkpoint slot (each would replay and overwrite
// the other's window). Nothing may be written before this succeeds.
inline Status check_rows(const Params& p, const Problem& pr, std::vector<RowInfo>* rows = nullptr) {
  GDN_RETURN_IF_ERROR(decode_mtp::check_rows_readable(
      p, pr, {&p.state_indices, &p.num_accepted_tokens, &p.window_len}));
  std::vector<RowInfo> local;
  std::vector<RowInfo>& out = rows ? *rows : local;
  out.assign(size_t(pr.N), RowInfo{});
  std::vector<std::pair<int64_t, int64_t>> owners;  // (slot, row) of the live rows
  for (int64_t i = 0; i < pr.N; ++i) {
    GDN_RETURN_IF_ERROR(check_row(p, pr, i, &out[size_t(i)]));
    if (out[size_t(i)].live) owners.emplace_back(out[size_t(i)].slot, i);
  }
  std::sort(owners.begin(), owners.end());
  for (size_t j = 1; j < owners.size(); ++j)
    if (owners[j].first == owners[j - 1].first)
      return Status::invalid(
          decode_mtp::row_prefix(owners[j].second) + "state_indices[" +
          std::to_string(owners[j].second) + "] = " + std::to_string(owners[j].first) +
          " is also the checkpoint slot of request row " + std::to_string(owners[j - 1].second) +
          " (each request needs its own checkpoint slot)");
  return Status::ok();
}

// ---- Guard
// ---------------------------------------------------------------------------------------

// "Can this configuration run replay verify on this device, and if not, why?" The supported set
// is decode_mtp's (gdn/core/support.hpp): S is the window capacity. `cuda_available` is whether
// this build holds a CUDA replay kernel image for the target device (the caller probes it).
inline Support can_use(DeviceType device, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t S,
                       DType state_dtype, bool cuda_available = false,
                       StateLayout layout = StateLayout::kVK) {
  return decode_mtp::can_use(device, H, HV, K, V, S, state_dtype, cuda_available, layout);
}

}  // namespace gdn::replay
