// prefill: the params struct and the validation of its arguments and request rows. Contract: docs
// prefill.md §1. Each request runs its tokens from the state in its initial slot (a null id: a
// zero state), its final state goes to its final slot (a null id: not written), and with
// checkpoint_every = E > 0 the state after every E-th token of the request goes to the request's
// next checkpoint slot. Host-only (compiles with g++ alone).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::prefill {

// checkpoint_every must be a positive multiple of this many tokens (the chunk of the chunked form,
// so that a checkpoint falls on a chunk boundary).
inline constexpr int64_t kCheckpointGranule = 64;

// One prefill call's arguments: the step arguments every GDN operation shares, plus the slots.
struct Params : decode_mtp::StepArgs {
  TensorView initial_state_indices;  // [N] int32/int64, any stride: the slot each request reads
  TensorView final_state_indices;    // [N] int32/int64, any stride: the slot it writes (may equal)
  TensorView checkpoint_indices;     // [N, C] int32/int64 or absent: its checkpoint slots
  int64_t checkpoint_every = 0;      // E: a checkpoint after every E tokens (0: none)
  // CUDA only, optional: scratch device memory (any dtype) of at least cuda_workspace_bytes(L, N,
  // HV) bytes, 16-byte aligned, on the arrays' device, whatever form the launch takes. Absent: a
  // form that needs one allocates it stream-ordered (cudaMallocAsync) and frees it after the call.
  TensorView workspace;
};

// Chunk slots of the CUDA path for L token rows and N requests: request i's j-th 64-token chunk
// takes slot begin_i / 64 + i + j, so a call never needs more than L / 64 + N.
constexpr int64_t cuda_chunk_slots(int64_t L, int64_t N) { return L / kCheckpointGranule + N; }

// Bytes of the CUDA path's workspace for L token rows, N requests and HV value heads (K = V =
// 128): per chunk slot and value head, three 64 x 128 bf16 tiles, a 128 x 64 and a 64 x 64 one
// (rows padded by 16 bytes), the chunk's starting state (128 x 128) and writes (128 x 64) in bf16,
// one float and one int; per slot one int.
constexpr int64_t cuda_workspace_bytes(int64_t L, int64_t N, int64_t HV) {
  const int64_t slots = cuda_chunk_slots(L, N);
  constexpr int64_t kPerSlotAndHead =
      (3 * 64 * 136 + 128 * 72 + 64 * 72) * 2 + (128 * 128 + 128 * 64) * 2 + 4 + 4;
  return slots * HV * kPerSlotAndHead + slots * 4;
}

// How the CUDA path runs each request's chunks in order. After a chunk kernel that computes every
// chunk's products into the workspace: one kernel per (request, value head) that also computes
// the outputs and their norm (kOnePass), or a recurrence kernel over four CTAs per head (32 state
// rows each) followed by one output kernel over every chunk of the call at once (kRecurrence).
// Or one kernel per (request, value head) that computes each chunk's products on chip as well and
// reads no workspace (kFused). kAuto: the launcher chooses by occupancy and request length. The
// one-pass and recurrence forms compute the same state bits (the outputs may differ in the last bit
// of the norm); the fused form rounds other intermediates to bf16, within the same error of the
// exact result. Tests and benchmarks pin one.
enum class StatePass { kAuto, kOnePass, kRecurrence, kFused };

// The mean request length (token budget / requests, eight chunks) from which kAuto takes kFused.
inline constexpr int64_t kFusedMinMeanTokens = 8 * kCheckpointGranule;

// Sizes derived from (and checked against) the arguments: decode_mtp's (S = 1, unused), plus the
// checkpoint columns C.
struct Problem : decode_mtp::Problem {
  int64_t C = 0;
};

// Validates every shape, dtype, stride and device and derives the problem sizes. Reads no data.
inline Status check_arguments(const Params& p, Problem* out_problem) {
  using namespace check;
  int64_t C = 0;
  const auto index_vector = [](const TensorView& t, const char* name, int64_t N) -> Status {
    GDN_RETURN_IF_ERROR(shaped(t, name, IndexDTypes{}, {{N, "N (rows of initial_state_indices)"}}));
    return nonnegative_strides(t, name);
  };
  const auto check_sizes = [&p](decode_mtp::Problem& pr) -> Status {
    GDN_RETURN_IF_ERROR(present(p.initial_state_indices, "initial_state_indices"));
    GDN_RETURN_IF_ERROR(ndim(p.initial_state_indices, "initial_state_indices", 1));
    pr.N = p.initial_state_indices.shape[0];
    pr.S = 1;
    return Status::ok();
  };
  const auto check_rest = [&](decode_mtp::Problem& pr) -> Status {
    GDN_RETURN_IF_ERROR(index_vector(p.initial_state_indices, "initial_state_indices", pr.N));
    GDN_RETURN_IF_ERROR(index_vector(p.final_state_indices, "final_state_indices", pr.N));
    if (p.checkpoint_indices.present()) {
      GDN_RETURN_IF_ERROR(ndim(p.checkpoint_indices, "checkpoint_indices", 2));
      C = p.checkpoint_indices.shape[1];
      GDN_RETURN_IF_ERROR(shaped(p.checkpoint_indices, "checkpoint_indices", IndexDTypes{},
                                 {{pr.N, "N (rows of initial_state_indices)"}, {C, "C"}}));
      GDN_RETURN_IF_ERROR(nonnegative_strides(p.checkpoint_indices, "checkpoint_indices"));
      if (p.checkpoint_every <= 0 || p.checkpoint_every % kCheckpointGranule != 0)
        return Status::invalid("checkpoint_every = " + std::to_string(p.checkpoint_every) +
                               " must be a positive multiple of " +
                               std::to_string(kCheckpointGranule) +
                               " when checkpoint_indices is given");
    } else if (p.checkpoint_every != 0) {
      return Status::invalid("checkpoint_every = " + std::to_string(p.checkpoint_every) +
                             " needs checkpoint_indices (the slots the checkpoints go to)");
    }
    return Status::ok();
  };
  decode_mtp::Problem base;
  GDN_RETURN_IF_ERROR(decode_mtp::check_step_arguments(
      p, &base, check_sizes, check_rest,
      {decode_mtp::NamedView{&p.initial_state_indices, "initial_state_indices"},
       decode_mtp::NamedView{&p.final_state_indices, "final_state_indices"},
       decode_mtp::NamedView{&p.checkpoint_indices, "checkpoint_indices"}}));
  if (out_problem) {
    static_cast<decode_mtp::Problem&>(*out_problem) = base;
    out_problem->C = C;
  }
  return Status::ok();
}

// Per-row facts, resolved from host-visible indices.
struct RowInfo {
  int64_t begin = 0;        // first token row
  int64_t T = 0;            // tokens (0: a padded row, nothing read or written)
  int64_t initial = -1;     // slot the state is read from; -1: a zero state
  int64_t final_slot = -1;  // slot the final state is written to; -1: not written
};

// Slot id of entry `e` of a 1-D index array of any stride.
inline int64_t index_at(const TensorView& t, int64_t e) {
  return load_index(t.data, t.dtype, e * t.strides[0]);
}

// Validates one request row; the reason names the row, the argument and what is wrong. A request
// crossing more checkpoint boundaries than checkpoint_indices has columns is refused, so that no
// requested checkpoint is silently lost.
inline Status check_row(const Params& p, const Problem& pr, int64_t i, RowInfo* info) {
  using decode_mtp::row_prefix;
  *info = RowInfo{};
  const int64_t c0 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i);
  const int64_t c1 = load_index(p.cu_seqlens.data, p.cu_seqlens.dtype, i + 1);
  if (c0 < 0 || c1 < c0 || c1 > pr.L) return decode_mtp::token_range_error(i, c0, c1, pr.L);
  info->begin = c0;
  info->T = c1 - c0;
  if (info->T == 0) return Status::ok();  // padded row
  // A slot id past the pool is refused (its argument's name is only built then); one below
  // first_valid_slot is null (-1).
  const auto past_pool = [&](const std::string& name, int64_t id) {
    return Status::invalid(row_prefix(i) + name + " = " + std::to_string(id) +
                           " is >= the pool's slot count " + std::to_string(pr.num_slots));
  };
  const int64_t initial = index_at(p.initial_state_indices, i);
  const int64_t final_slot = index_at(p.final_state_indices, i);
  if (initial >= pr.num_slots)
    return past_pool("initial_state_indices[" + std::to_string(i) + "]", initial);
  if (final_slot >= pr.num_slots)
    return past_pool("final_state_indices[" + std::to_string(i) + "]", final_slot);
  info->initial = initial < p.first_valid_slot ? -1 : initial;
  info->final_slot = final_slot < p.first_valid_slot ? -1 : final_slot;
  if (!p.checkpoint_indices.present()) return Status::ok();
  const int64_t checkpoints = info->T / p.checkpoint_every;
  if (checkpoints > pr.C)
    return Status::invalid(
        row_prefix(i) + "its " + std::to_string(info->T) + " tokens cross " +
        std::to_string(checkpoints) +
        " checkpoint boundaries (checkpoint_every = " + std::to_string(p.checkpoint_every) +
        ") but checkpoint_indices has " + std::to_string(pr.C) + " columns");
  const TensorView& t = p.checkpoint_indices;
  for (int64_t j = 0; j < checkpoints; ++j) {
    const int64_t id = load_index(t.data, t.dtype, i * t.strides[0] + j * t.strides[1]);
    if (id >= pr.num_slots)
      return past_pool("checkpoint_indices[" + std::to_string(i) + ", " + std::to_string(j) + "]",
                       id);
  }
  return Status::ok();
}

// Validates every row of a call whose indices are host-visible, filling `rows` (if given) with
// each row's facts. Nothing may be written before this succeeds.
inline Status check_rows(const Params& p, const Problem& pr, std::vector<RowInfo>* rows = nullptr) {
  GDN_RETURN_IF_ERROR(decode_mtp::check_rows_readable(
      p, pr, {&p.initial_state_indices, &p.final_state_indices, &p.checkpoint_indices}));
  if (rows) rows->assign(size_t(pr.N), RowInfo{});
  for (int64_t i = 0; i < pr.N; ++i) {
    RowInfo info;
    GDN_RETURN_IF_ERROR(check_row(p, pr, i, &info));
    if (rows) (*rows)[size_t(i)] = info;
  }
  return Status::ok();
}

}  // namespace gdn::prefill
