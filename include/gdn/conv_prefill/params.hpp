// causal_conv1d_prefill: the params struct, argument validation and row validation. Contract: docs
// prefill.md §2; the conv and its buffer: gdn-math.md §2.2 and §3.3. Host-only (compiles with g++
// alone; the row classifier is shared with the CUDA kernel).
//
// One call, for every request i with T_i tokens (rows cu_seqlens[i]..cu_seqlens[i+1] of x, any
// T_i >= 0) and every channel c of D, with W - 1 = H:
//
//   hist = buf_init[c, 0 .. H - 1]       the initial slot's history, where causal_conv1d_update
//                                        reads it with an accepted count of 1 (zeros for a null id)
//   F    = [hist | s(x[0, c]) .. s(x[T-1, c])]      s(v): v as the pool stores it (its dtype)
//   out[t, c] = act( sum_{j=0}^{H-1} weight[c, j] * F[t + j] + weight[c, H] * x[t, c] )
//                                                    (fp32, j ascending)
//   buf_final[c, 0 .. H - 1] = F[T .. T + H - 1]    the last H inputs (history included when T < H)
//   buf_final[c, H .. Lbuf - 1] = buf_init[c, H .. Lbuf - 1]   (zeros for a null initial id)
//
// So the call equals T one-token causal_conv1d_update calls (accepted count 1) on a buffer that
// starts as the initial slot's (zeros for a null id) and ends in the final slot, bit for bit:
// outputs, the window the next update reads, and the columns past it, which one-token updates never
// touch. With the final slot equal to the initial one the call runs in place on that slot. A null
// final id writes no state; the outputs are still produced.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gdn/conv/params.hpp"
#include "gdn/core/dtype.hpp"
#include "gdn/core/host_device.hpp"
#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::conv_prefill {

using conv::Activation;
using conv::Problem;
using conv::StateLayout;

// One call's arguments: the arrays and scalars every conv operation shares, plus each request's
// initial and final slot.
struct Params : conv::ConvArgs {
  TensorView
      initial_state_indices;       // [N] int32/int64, any stride: the slot the history is read from
  TensorView final_state_indices;  // [N] int32/int64, any stride: the slot the history goes to
};

// Validates every shape, dtype, stride and device and derives the problem sizes. Reads no data.
inline Status check_arguments(const Params& p, Problem* out_problem) {
  return conv::check_conv_arguments(
      p,
      {conv::NamedView{&p.initial_state_indices, "initial_state_indices"},
       conv::NamedView{&p.final_state_indices, "final_state_indices"}},
      [](const Problem&) { return Status::ok(); }, {}, out_problem);
}

// The one classification of a request row, on the host (check_row, which then names what is wrong)
// and in the CUDA kernel: padded when its token range [c0, c1) is empty (nothing is read or
// written, whatever its slot ids); live when the range lies inside [0, L) and both slot ids are
// below the pool's slot count (an id below first_valid_slot is null, not an error).
enum class RowClass { kPadded, kInvalid, kLive };
GDN_HOST_DEVICE GDN_FORCE_INLINE RowClass classify_row(int64_t c0, int64_t c1, int64_t L,
                                                       int64_t initial, int64_t final_slot,
                                                       int64_t num_slots) {
  const bool range_ok = c0 >= 0 && c1 >= c0 && c1 <= L;
  if (range_ok && c1 == c0) return RowClass::kPadded;
  return range_ok && initial < num_slots && final_slot < num_slots ? RowClass::kLive
                                                                   : RowClass::kInvalid;
}

// Per-row facts, resolved from host-visible indices.
struct RowInfo {
  int64_t begin = 0;        // first token row
  int64_t T = 0;            // tokens (0: a padded row, nothing read or written)
  int64_t initial = -1;     // slot the history is read from; -1: zeros
  int64_t final_slot = -1;  // slot the last inputs are written to; -1: not written
};

// Slot id of entry `e` of a 1-D index array of any stride.
inline int64_t index_at(const TensorView& t, int64_t e) {
  return load_index(t.data, t.dtype, e * t.strides[0]);
}

// Validates one request row (classify_row); an invalid row's reason names the row, the argument
// and what is wrong.
inline Status check_row(const Params& p, const Problem& pr, int64_t i, RowInfo* info) {
  *info = RowInfo{};
  const int64_t c0 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i);
  const int64_t c1 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i + 1);
  const int64_t initial = index_at(p.initial_state_indices, i);
  const int64_t final_slot = index_at(p.final_state_indices, i);
  const RowClass row = classify_row(c0, c1, pr.L, initial, final_slot, pr.num_slots);
  info->begin = c0;
  info->T = c1 - c0;
  if (row == RowClass::kLive) {
    info->initial = initial < p.first_valid_slot ? -1 : initial;
    info->final_slot = final_slot < p.first_valid_slot ? -1 : final_slot;
  }
  if (row != RowClass::kInvalid) return Status::ok();
  const std::string prefix = "request row " + std::to_string(i) + ": ";
  if (c0 < 0 || c1 < c0 || c1 > pr.L)
    return Status::invalid(
        prefix + "cu_seqlens[" + std::to_string(i) + "..] = (" + std::to_string(c0) + ", " +
        std::to_string(c1) +
        ") is not a non-decreasing range inside [0, L = " + std::to_string(pr.L) + "]");
  const bool initial_past = initial >= pr.num_slots;
  const std::string name = initial_past ? "initial_state_indices" : "final_state_indices";
  return Status::invalid(prefix + name + "[" + std::to_string(i) +
                         "] = " + std::to_string(initial_past ? initial : final_slot) +
                         " is >= the pool's slot count " + std::to_string(pr.num_slots));
}

// Validates every row of a call whose indices are host-visible, filling `rows` (if given) with the
// rows that run (not padded), in order. Nothing may be written before this succeeds.
inline Status check_rows(const Params& p, const Problem& pr, std::vector<RowInfo>* rows = nullptr) {
  for (const TensorView* v : {&p.cu_seqlens, &p.initial_state_indices, &p.final_state_indices})
    if (v->device.type != DeviceType::kCPU)
      return Status::invalid("check_rows needs host-visible index arrays");
  if (rows) rows->clear();
  RowInfo info;
  for (int64_t i = 0; i < pr.N; ++i) {
    GDN_RETURN_IF_ERROR(check_row(p, pr, i, &info));
    if (rows && info.T > 0) rows->push_back(info);
  }
  return Status::ok();
}

}  // namespace gdn::conv_prefill
