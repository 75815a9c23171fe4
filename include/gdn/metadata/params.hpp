// metadata: the params struct of the per-step GDN metadata builder, the layout of its plan buffer
// and the argument checks. Contract: docs metadata.md. Host-only (compiles with g++ alone).
//
// A step is built in two parts:
//   1. plan (host, once per step, no device access): classification and every field shared by the
//      KV-cache groups, written into one int32 "plan buffer" whose layout depends only on the
//      capacity (max_rows, max_tokens). One host-to-device copy moves it to a persistent device
//      buffer of the same layout.
//   2. state rows (one pass over all G groups: a CPU loop or one CUDA launch): reads the plan
//      buffer and every group's block table and writes each group's state-slot rows.
//
// Replay mode (`replay`, docs replay.md §3): a request owns one state slot per group, its
// checkpoint, at block table column `start`; `num_accepted_tokens` are the replay counts n
// (0..S, 0 for a row whose window is empty) and the step also yields, per group, the spec rows'
// checkpoint slots (`checkpoint_indices`) and, shared, every row's replay count.
#pragma once

#include <cstdint>
#include <string>

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::metadata {

// Most KV-cache groups one pass fills (Qwen hybrids use 3; decode context parallelism 6).
inline constexpr int kMaxGroups = 8;

enum class CacheMode : int {
  kNone,   // no prefix caching: state row = block table columns [0, S)
  kAlign,  // prefix caching: columns [start, start + S), start = max((seq_len - 1) / block_size, 0)
};

inline const char* to_string(CacheMode m) noexcept {
  return m == CacheMode::kNone ? "none" : "align";
}

// Header of the plan buffer (int32 words at offset 0): the step's counts.
enum HeaderField : int {
  kNumRequests,  // N
  // Decodes and prefills are vLLM's counts (metadata.md §2.2). Without spec rows: the decodes are
  // the leading run of rows with <= 1 token and a computed prefix (zero-length rows in it
  // included); the prefills run from the first other row to the last row with a token. With spec
  // rows: non-spec 1-token rows, reclassified as prefills; zero-length rows are in neither count.
  kNumPrefills,
  kNumPrefillTokens,
  kNumDecodes,
  kNumDecodeTokens,
  kNumSpecDecodes,  // spec (verify) rows
  kNumSpecDecodeTokens,
  kNumActualTokens,     // query_start_loc[N] (live tokens, not padded)
  kNumNonSpecRows,      // every live row that is not a spec row, in request order
  kNumZeroLengthRows,   // non-spec rows with no token (without spec rows, those before the last
                        // row with a token are also inside the counts above)
  kSpecRowsWritten,     // spec rows the step writes: padded_rows when padded, else live spec rows
  kNonSpecRowsWritten,  // non-spec rows the step writes: padded_rows when padded, else live
  kMaskRowsWritten,     // entries of spec_sequence_masks written: padded_rows or N
  kMaxColumnEnd,        // table width the live rows may read: max of start + S, over live rows
  kNumSpecColumns,      // S = num_spec + 1
  kPaddedRows,          // padded_rows, or -1 when the step is not padded
  kReplay,              // 1: planned in replay mode, 0: not (the state-row pass checks it)
  kHeaderWords = 17,
};

inline const char* header_field_name(int f) noexcept {
  static const char* const names[kHeaderWords] = {"num_requests",
                                                  "num_prefills",
                                                  "num_prefill_tokens",
                                                  "num_decodes",
                                                  "num_decode_tokens",
                                                  "num_spec_decodes",
                                                  "num_spec_decode_tokens",
                                                  "num_actual_tokens",
                                                  "num_non_spec_rows",
                                                  "num_zero_length_rows",
                                                  "spec_rows_written",
                                                  "non_spec_rows_written",
                                                  "mask_rows_written",
                                                  "max_column_end",
                                                  "num_spec_columns",
                                                  "padded_rows",
                                                  "replay"};
  return (f >= 0 && f < kHeaderWords) ? names[f] : "unknown";
}

// Word offsets of the fields inside the plan buffer. Depends only on the capacity, so host and
// device buffers allocated once for the largest batch share it. Every region starts on a 16-byte
// boundary; the two bool fields are packed one byte per row.
struct Layout {
  int64_t max_rows = 0;                  // R: most requests (and padded rows) a step may have
  int64_t max_tokens = 0;                // most token rows a step may have
  int64_t header = 0;                    // int32[kHeaderWords]
  int64_t spec_request = 0;              // int32[R]   request index of spec row j
  int64_t spec_start = 0;                // int32[R]   first block-table column of spec row j
  int64_t non_spec_request = 0;          // int32[R]
  int64_t non_spec_start = 0;            // int32[R]
  int64_t spec_query_start_loc = 0;      // int32[R+1]
  int64_t non_spec_query_start_loc = 0;  // int32[R+1]
  int64_t spec_num_accepted = 0;         // int32[R]
  int64_t spec_source_column = 0;        // int32[R]   column the spec row reads its state from
  int64_t non_spec_source_column = 0;    // int32[R]   acc - 1 of non-spec row j (from its start)
  int64_t replay_counts = 0;             // int32[R]   replay mode: n of spec row j (padded: 0)
  int64_t non_spec_replay_counts = 0;    // int32[R]   replay mode: n of non-spec row j
  int64_t token_split = 0;               // int32[max_tokens]: non-spec tokens, then spec tokens
  int64_t spec_sequence_masks = 0;       // bool[R] (bytes)
  int64_t has_initial_state = 0;         // bool[R] (bytes), per non-spec row
  int64_t total_words = 0;

  static constexpr int64_t align_words(int64_t w) noexcept { return (w + 3) / 4 * 4; }
  static constexpr int64_t bool_words(int64_t n) noexcept { return (n + 3) / 4; }

  static constexpr Layout make(int64_t max_rows, int64_t max_tokens) noexcept {
    Layout l;
    l.max_rows = max_rows;
    l.max_tokens = max_tokens;
    int64_t at = 0;
    auto take = [&at](int64_t words) {
      const int64_t offset = at;
      at += align_words(words);
      return offset;
    };
    l.header = take(kHeaderWords);
    l.spec_request = take(max_rows);
    l.spec_start = take(max_rows);
    l.non_spec_request = take(max_rows);
    l.non_spec_start = take(max_rows);
    l.spec_query_start_loc = take(max_rows + 1);
    l.non_spec_query_start_loc = take(max_rows + 1);
    l.spec_num_accepted = take(max_rows);
    l.spec_source_column = take(max_rows);
    l.non_spec_source_column = take(max_rows);
    l.replay_counts = take(max_rows);
    l.non_spec_replay_counts = take(max_rows);
    l.token_split = take(max_tokens);
    l.spec_sequence_masks = take(bool_words(max_rows));
    l.has_initial_state = take(bool_words(max_rows));
    l.total_words = at;
    return l;
  }
};

// One step's arguments: non-owning views and scalars. Optional views are left absent (ndim = -1).
// The plan reads the step inputs and writes `plan`; the state-row pass reads `plan`, the block
// tables and (optionally) `num_accepted_tokens`, and writes the state rows.
struct Params {
  // ---- step inputs (host arrays, int32, contiguous) ----
  TensorView query_start_loc;      // [N+1], starts at 0, non-decreasing
  TensorView seq_lens;             // [N] tokens of each request after this step (drafts included)
  TensorView num_computed_tokens;  // [N] or absent (then seq_lens - query length)
  TensorView num_draft_tokens;     // [N] or absent (no spec rows): -1 = not spec, >= 0 = verify row
  // [N] accepted counts of the previous step (1..S), for every row: a spec row reads its state
  // from column acc - 1 (decode_mtp does it), a non-spec row from column start + acc - 1
  // (non_spec_source_indices). On the host, the plan gathers and validates them; on the device,
  // the state-row pass gathers them (any length; checked per row). Absent: every row accepts 1.
  // Replay mode: the replay counts n (0..S; 0 when the row's window is empty, e.g. on its first
  // step after prefill; absent: all 0); the accepted counts of the plan are then max(n, 1).
  TensorView num_accepted_tokens;

  // ---- scalars ----
  int64_t num_spec = 0;  // drafts per verify row at most; S = num_spec + 1 columns
  CacheMode mode = CacheMode::kNone;
  int64_t block_size = 0;    // tokens per block; mode "align" only
  int64_t padded_rows = -1;  // CUDA-graph batch size the step replays (>= N), or -1
  int32_t pad_id = 0;        // state id of padded / unreadable rows (0: null block, or -1)
  // Replay mode (replay.md §3): one state slot per request and group, column start. The state
  // rows then read only that column: checkpoint_indices (spec rows) and column 0 of
  // spec_state_indices hold it (its other columns the pad id), and non-spec rows read and write
  // it (non_spec_state_indices = non_spec_source_indices). Mode "align" is refused.
  bool replay = false;

  // ---- the plan buffer: int32 [Layout::make(max_rows, max_tokens).total_words] ----
  TensorView plan;
  int64_t max_rows = 0;
  int64_t max_tokens = 0;

  // ---- state rows ----
  int num_groups = 0;                   // G, 1..kMaxGroups
  TensorView block_tables[kMaxGroups];  // int32 [rows_g, cols_g], unit column stride
  TensorView spec_state_indices;        // int32 [G, R', S], contiguous, R' >= launch rows
  TensorView non_spec_state_indices;    // int32 [G, R'], contiguous: destination, column start
  TensorView non_spec_source_indices;   // optional int32 [G, R']: source, column start + acc - 1
  TensorView checkpoint_indices;        // int32 [G, R'], contiguous, replay mode only (required
                                        // there): spec row j's checkpoint slot, column start
  TensorView error_count;               // optional int32 [1]: unreadable rows are added to it
  int64_t launch_rows = 0;              // rows the pass covers (0: max_rows); >= rows written

  int64_t num_state_columns() const noexcept { return num_spec + 1; }
  Layout layout() const noexcept { return Layout::make(max_rows, max_tokens); }
};

namespace detail {

inline Status int32_vector(const TensorView& t, const char* name) {
  GDN_RETURN_IF_ERROR(check::typed(t, name, 1, {DType::kInt32}));
  GDN_RETURN_IF_ERROR(check::contiguous_from(t, name, 0));
  return Status::ok();
}

inline Status host_int32_vector(const TensorView& t, const char* name, int64_t length,
                                const char* what) {
  GDN_RETURN_IF_ERROR(int32_vector(t, name));
  if (t.device.type != DeviceType::kCPU)
    return Status::invalid(std::string(name) + " must be a host array (the plan reads it on the " +
                           "host), got one on " + to_string(t.device));
  GDN_RETURN_IF_ERROR(check::dim(t, name, 0, length, what));
  return Status::ok();
}

// A per-group output of the state-row pass: int32 [num_groups, >= rows], contiguous, on `dev`.
inline Status group_rows(const TensorView& t, const char* name, int64_t num_groups, int64_t rows,
                         Device dev) {
  GDN_RETURN_IF_ERROR(check::typed(t, name, 2, {DType::kInt32}));
  GDN_RETURN_IF_ERROR(check::dim(t, name, 0, num_groups, "num_groups"));
  GDN_RETURN_IF_ERROR(check::contiguous_from(t, name, 0));
  if (t.shape[1] < rows)
    return Status::invalid(std::string(name) + " has " + std::to_string(t.shape[1]) +
                           " rows per group; the pass writes up to " + std::to_string(rows));
  return check::same_device(t, name, dev);
}

}  // namespace detail

// Scalars and capacity.
inline Status check_scalars(const Params& p) {
  if (p.num_spec < 0)
    return Status::invalid("num_spec must be >= 0, got " + std::to_string(p.num_spec));
  if (p.num_spec + 1 > (int64_t(1) << 20))
    return Status::invalid("num_spec = " + std::to_string(p.num_spec) + " is unreasonably large");
  if (p.max_rows < 1)
    return Status::invalid("max_rows must be >= 1, got " + std::to_string(p.max_rows));
  if (p.max_tokens < 0)
    return Status::invalid("max_tokens must be >= 0, got " + std::to_string(p.max_tokens));
  if (p.max_rows > INT32_MAX / 2 || p.max_tokens > INT32_MAX / 2)
    return Status::invalid("max_rows and max_tokens must fit comfortably in int32");
  if (p.mode == CacheMode::kAlign && p.block_size < 1)
    return Status::invalid("block_size must be >= 1 in mode 'align', got " +
                           std::to_string(p.block_size));
  if (p.replay && p.mode == CacheMode::kAlign)
    return Status::unsupported(
        "mode 'align' (prefix caching) cannot be combined with replay = true yet: replay verify "
        "reads and stores a request's checkpoint in one slot, but in mode 'align' the slot moves "
        "to a new block when the sequence crosses a block boundary; use mode 'none'");
  return Status::ok();
}

// Scalars and the plan buffer, shared by both parts.
inline Status check_common(const Params& p) {
  GDN_RETURN_IF_ERROR(check_scalars(p));
  GDN_RETURN_IF_ERROR(detail::int32_vector(p.plan, "plan"));
  const Layout l = p.layout();
  if (p.plan.shape[0] < l.total_words)
    return Status::invalid("plan holds " + std::to_string(p.plan.shape[0]) +
                           " int32 words but max_rows = " + std::to_string(p.max_rows) +
                           ", max_tokens = " + std::to_string(p.max_tokens) + " need " +
                           std::to_string(l.total_words) + " (gdn.metadata.plan_words)");
  return Status::ok();
}

// Everything the state-row pass reads or writes, on `device`.
inline Status check_state_rows_arguments(const Params& p, DeviceType device) {
  GDN_RETURN_IF_ERROR(check_common(p));
  const Device dev = p.plan.device;
  if (dev.type != device)
    return Status::invalid(std::string("plan is on ") + to_string(dev) + " but this state-row " +
                           "pass runs on " + (device == DeviceType::kCPU ? "the CPU" : "CUDA"));
  if (p.num_groups < 1 || p.num_groups > kMaxGroups)
    return Status::invalid("num_groups must be in [1, " + std::to_string(kMaxGroups) + "], got " +
                           std::to_string(p.num_groups));
  const int64_t S = p.num_state_columns();
  const int64_t rows = p.launch_rows > 0 ? p.launch_rows : p.max_rows;
  if (rows > p.max_rows)
    return Status::invalid("launch_rows = " + std::to_string(p.launch_rows) +
                           " exceeds max_rows = " + std::to_string(p.max_rows));
  for (int g = 0; g < p.num_groups; ++g) {
    const std::string name = "block_tables[" + std::to_string(g) + "]";
    const TensorView& t = p.block_tables[g];
    GDN_RETURN_IF_ERROR(check::typed(t, name.c_str(), 2, {DType::kInt32}));
    GDN_RETURN_IF_ERROR(check::same_device(t, name.c_str(), dev));
    if (t.numel() == 0) continue;  // an empty table: every row is unreadable (strides are moot)
    GDN_RETURN_IF_ERROR(check::unit_stride(t, name.c_str(), 1));
    GDN_RETURN_IF_ERROR(check::nonnegative_strides(t, name.c_str()));
    GDN_RETURN_IF_ERROR(check::row_stride_at_least(t, name.c_str(), t.shape[1]));
  }
  const TensorView& spec = p.spec_state_indices;
  GDN_RETURN_IF_ERROR(check::typed(spec, "spec_state_indices", 3, {DType::kInt32}));
  GDN_RETURN_IF_ERROR(check::dim(spec, "spec_state_indices", 0, p.num_groups, "num_groups"));
  GDN_RETURN_IF_ERROR(check::dim(spec, "spec_state_indices", 2, S, "S = num_spec + 1"));
  GDN_RETURN_IF_ERROR(check::contiguous_from(spec, "spec_state_indices", 0));
  if (spec.shape[1] < rows)
    return Status::invalid("spec_state_indices has " + std::to_string(spec.shape[1]) +
                           " rows per group; the pass writes up to " + std::to_string(rows));
  GDN_RETURN_IF_ERROR(check::same_device(spec, "spec_state_indices", dev));
  GDN_RETURN_IF_ERROR(detail::group_rows(p.non_spec_state_indices, "non_spec_state_indices",
                                         p.num_groups, rows, dev));
  if (p.non_spec_source_indices.present())
    GDN_RETURN_IF_ERROR(detail::group_rows(p.non_spec_source_indices, "non_spec_source_indices",
                                           p.num_groups, rows, dev));
  const TensorView& ck = p.checkpoint_indices;
  if (p.replay) {
    if (!ck.present())
      return Status::invalid(
          "checkpoint_indices is required in replay mode (each spec row's checkpoint slot, "
          "int32 [G, rows])");
    GDN_RETURN_IF_ERROR(detail::group_rows(ck, "checkpoint_indices", p.num_groups, rows, dev));
  } else if (ck.present()) {
    return Status::invalid(
        "checkpoint_indices is written only in replay mode: pass replay = true or leave it out");
  }
  GDN_RETURN_IF_ERROR(check::optional_counter(p.error_count, "error_count"));
  GDN_RETURN_IF_ERROR(check::same_device(p.error_count, "error_count", dev));
  if (p.num_accepted_tokens.present() && p.num_accepted_tokens.device == dev)
    GDN_RETURN_IF_ERROR(detail::int32_vector(p.num_accepted_tokens, "num_accepted_tokens"));
  return Status::ok();
}

}  // namespace gdn::metadata
