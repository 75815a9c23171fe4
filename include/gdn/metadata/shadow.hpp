// metadata: the shadow check. A plain per-group builder (one group at a time, every field rebuilt
// from the step inputs, the way a builder without shared metadata does it) and an exact comparison
// of its result against the shared plan + fused state rows.
//
// The comparison covers exactly the rows the step writes and a graph replay reads: live rows plus
// padded rows up to padded_rows. The ranges come from the per-group build, never from the buffers
// under test, so whatever sits in rows outside them cannot change the verdict.
//
// This file deliberately shares no code with plan.hpp / state_rows.hpp: it is the independent
// oracle they are checked against. Host-only (compiles with g++ alone); all arrays host-visible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "gdn/core/status.hpp"
#include "gdn/metadata/params.hpp"

namespace gdn::metadata {

// Everything one group's builder produces, over the rows the step writes.
struct GroupMetadata {
  int64_t header[kHeaderWords] = {};
  std::vector<uint8_t> spec_sequence_masks;   // [mask rows written]
  std::vector<int32_t> non_spec_token_indx;   // [non-spec tokens]
  std::vector<int32_t> spec_token_indx;       // [spec tokens]
  std::vector<int32_t> spec_query_start_loc;  // [spec rows written + 1]
  std::vector<int32_t> non_spec_query_start_loc;
  std::vector<int32_t> spec_num_accepted;  // [spec rows written]
  std::vector<int32_t> spec_source_column;
  std::vector<int32_t> non_spec_source_column;   // [non-spec rows written]
  std::vector<uint8_t> has_initial_state;        // [non-spec rows written]
  std::vector<int32_t> replay_counts;            // replay mode: [spec rows written]
  std::vector<int32_t> non_spec_replay_counts;   // replay mode: [non-spec rows written]
  std::vector<int32_t> spec_state_indices;       // [spec rows written * S]
  std::vector<int32_t> checkpoint_indices;       // replay mode: [spec rows written]
  std::vector<int32_t> non_spec_state_indices;   // [non-spec rows written]
  std::vector<int32_t> non_spec_source_indices;  // [non-spec rows written]
  int64_t unreadable_rows = 0;                   // live rows filled with the pad id
};

namespace shadow_detail {

inline int32_t at(const TensorView& t, int64_t i) { return t.ptr<const int32_t>()[i]; }

// Block-table entry (request, column) of a host table, or nothing when outside it.
inline bool table_entry(const TensorView& t, int64_t request, int64_t column, int32_t* value) {
  if (request < 0 || request >= t.shape[0] || column < 0 || column >= t.shape[1]) return false;
  *value = t.ptr<const int32_t>()[request * t.strides[0] + column * t.strides[1]];
  return true;
}

}  // namespace shadow_detail

// Builds group g's metadata from the step inputs and its (host) block table, independently.
// Expects inputs the plan accepted; reports only what it cannot read.
inline Status build_group_reference(const Params& p, int g, GroupMetadata* out) {
  using shadow_detail::at;
  if (g < 0 || g >= p.num_groups)
    return Status::invalid("group " + std::to_string(g) + " is outside [0, num_groups)");
  const TensorView& table = p.block_tables[g];
  if (!table.present() || table.ndim != 2 || table.dtype != DType::kInt32 ||
      table.device.type != DeviceType::kCPU)
    return Status::invalid("the per-group build needs block_tables[" + std::to_string(g) +
                           "] as a host int32 [rows, cols] array");
  for (const TensorView* v : {&p.query_start_loc, &p.seq_lens, &p.num_computed_tokens,
                              &p.num_draft_tokens, &p.num_accepted_tokens})
    if (v->present() && v->device.type != DeviceType::kCPU)
      return Status::invalid("the per-group build needs host copies of the step inputs");
  GroupMetadata m;
  const int64_t N = p.query_start_loc.shape[0] - 1;
  const int64_t S = p.num_spec + 1;

  // Rows: lengths and which ones are verify rows.
  std::vector<int64_t> len(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    len[size_t(i)] = at(p.query_start_loc, i + 1) - at(p.query_start_loc, i);
  // Verify rows: every row with a draft count >= 0 (zero drafts included).
  std::vector<bool> spec(static_cast<size_t>(N), false);
  if (p.num_draft_tokens.present())
    for (int64_t i = 0; i < N; ++i) spec[size_t(i)] = at(p.num_draft_tokens, i) >= 0;
  // Context before the step; a row with tokens and no context is a fresh request.
  std::vector<int64_t> context(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    context[size_t(i)] = p.num_computed_tokens.present() ? at(p.num_computed_tokens, i)
                                                         : at(p.seq_lens, i) - len[size_t(i)];
  std::vector<int64_t> spec_rows, non_spec_rows;
  for (int64_t i = 0; i < N; ++i) (spec[size_t(i)] ? spec_rows : non_spec_rows).push_back(i);

  // Counts, as vLLM's builder makes them.
  auto count_len = [&](int64_t want) {
    return std::count_if(non_spec_rows.begin(), non_spec_rows.end(),
                         [&](int64_t i) { return len[size_t(i)] == want; });
  };
  const int64_t zero = count_len(0);
  int64_t spec_tokens = 0, non_spec_tokens = 0;
  for (int64_t i : spec_rows) spec_tokens += len[size_t(i)];
  for (int64_t i : non_spec_rows) non_spec_tokens += len[size_t(i)];
  int64_t decodes = 0, decode_tokens = 0, prefills = 0;
  if (spec_rows.empty()) {
    // split_decodes_and_prefills(threshold 1), short extends as prefills: decodes up to the first
    // row longer than 1 token or without context; the prefills end at the last row with a token.
    std::vector<bool> is_prefill(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i)
      is_prefill[size_t(i)] = len[size_t(i)] > 1 || (len[size_t(i)] > 0 && context[size_t(i)] <= 0);
    const auto first = std::find(is_prefill.begin(), is_prefill.end(), true);
    decodes = first - is_prefill.begin();
    for (int64_t i = 0; i < decodes; ++i) decode_tokens += len[size_t(i)];
    int64_t end = N;
    while (end > decodes && len[size_t(end - 1)] == 0) --end;
    prefills = end - decodes;
  } else {
    // 1-token rows are decodes, reclassified as prefills; zero-length rows are in neither.
    prefills = int64_t(non_spec_rows.size()) - zero;
  }

  // Token split: expand the row mask to tokens, then a stable partition (non-spec first).
  std::vector<bool> token_is_spec;
  for (size_t i = 0; i < len.size(); ++i)
    token_is_spec.insert(token_is_spec.end(), size_t(len[i]), spec[i]);
  std::vector<int32_t> order(token_is_spec.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_partition(order.begin(), order.end(),
                        [&](int32_t t) { return !token_is_spec[size_t(t)]; });
  m.non_spec_token_indx.assign(order.begin(), order.begin() + non_spec_tokens);
  m.spec_token_indx.assign(order.begin() + non_spec_tokens, order.end());

  const bool padded = p.padded_rows >= 0;
  const int64_t spec_written = padded ? p.padded_rows : int64_t(spec_rows.size());
  const int64_t ns_written = padded ? p.padded_rows : int64_t(non_spec_rows.size());
  const int64_t mask_written = padded ? p.padded_rows : N;

  // Query starts of each kind: running sums of the row lengths, padded rows with 0 tokens.
  m.spec_query_start_loc.assign(1, 0);
  for (int64_t j = 0; j < spec_written; ++j)
    m.spec_query_start_loc.push_back(
        m.spec_query_start_loc.back() +
        int32_t(j < int64_t(spec_rows.size()) ? len[size_t(spec_rows[size_t(j)])] : 0));
  m.non_spec_query_start_loc.assign(1, 0);
  for (int64_t j = 0; j < ns_written; ++j)
    m.non_spec_query_start_loc.push_back(
        m.non_spec_query_start_loc.back() +
        int32_t(j < int64_t(non_spec_rows.size()) ? len[size_t(non_spec_rows[size_t(j)])] : 0));

  for (int64_t i = 0; i < mask_written; ++i)
    m.spec_sequence_masks.push_back(i < N && spec[size_t(i)]);

  // Accepted counts and source columns (padded rows accept 1). In replay mode the given counts
  // are the replay counts n (absent: 0; padded rows: 0) and a row accepts max(n, 1).
  auto given_count = [&](const std::vector<int64_t>& rows, int64_t j) -> int32_t {
    if (j >= int64_t(rows.size())) return p.replay ? 0 : 1;
    if (!p.num_accepted_tokens.present()) return p.replay ? 0 : 1;
    return at(p.num_accepted_tokens, rows[size_t(j)]);
  };
  for (int64_t j = 0; j < spec_written; ++j) {
    const int32_t count = given_count(spec_rows, j), acc = std::max(count, 1);
    m.spec_num_accepted.push_back(acc);
    m.spec_source_column.push_back(acc - 1);
    if (p.replay) m.replay_counts.push_back(count);
  }
  for (int64_t j = 0; j < ns_written; ++j) {
    const int32_t count = given_count(non_spec_rows, j);
    m.non_spec_source_column.push_back(std::max(count, 1) - 1);
    if (p.replay) m.non_spec_replay_counts.push_back(count);
  }
  for (int64_t j = 0; j < ns_written; ++j)
    m.has_initial_state.push_back(j < int64_t(non_spec_rows.size()) &&
                                  context[size_t(non_spec_rows[size_t(j)])] > 0);

  // This group's state rows: first column 0, or the block holding the last token (align).
  auto first_column = [&](int64_t i) -> int64_t {
    if (p.mode == CacheMode::kNone) return 0;
    const int64_t last_token = int64_t(at(p.seq_lens, i)) - 1;
    return last_token <= 0 ? 0 : last_token / p.block_size;
  };
  int64_t max_column_end = 0;
  for (int64_t i = 0; i < N; ++i) max_column_end = std::max(max_column_end, first_column(i) + S);
  // Replay mode: a spec row's one slot is column start (its checkpoint), column 0 of its row.
  const int64_t spec_width = p.replay ? 1 : S;
  for (int64_t j = 0; j < spec_written; ++j) {
    std::vector<int32_t> row(size_t(S), p.pad_id);
    if (j < int64_t(spec_rows.size())) {
      const int64_t i = spec_rows[size_t(j)];
      const int64_t c0 = first_column(i);
      bool readable = true;
      for (int64_t c = 0; c < spec_width; ++c)
        readable = readable && shadow_detail::table_entry(table, i, c0 + c, &row[size_t(c)]);
      if (!readable) {
        std::fill(row.begin(), row.end(), p.pad_id);
        ++m.unreadable_rows;
      }
    }
    m.spec_state_indices.insert(m.spec_state_indices.end(), row.begin(), row.end());
    if (p.replay) m.checkpoint_indices.push_back(row[0]);
  }
  // Non-spec rows: destination column start, source column start + acc - 1 (replay mode: start,
  // the checkpoint); padded unless both (and so every column between them) lie inside the table.
  // A row without an initial state reads nothing: source = pad id, only its destination needed.
  for (int64_t j = 0; j < ns_written; ++j) {
    int32_t dst = p.pad_id, src = p.pad_id;
    if (j < int64_t(non_spec_rows.size())) {
      const int64_t i = non_spec_rows[size_t(j)];
      const int64_t c0 = first_column(i);
      const bool initial = m.has_initial_state[size_t(j)] != 0;
      const int64_t last = !initial || p.replay ? c0 : c0 + m.non_spec_source_column[size_t(j)];
      if (last < c0 || !shadow_detail::table_entry(table, i, c0, &dst) ||
          !shadow_detail::table_entry(table, i, last, &src)) {
        dst = src = p.pad_id;
        ++m.unreadable_rows;
      }
      if (!initial) src = p.pad_id;
    }
    m.non_spec_state_indices.push_back(dst);
    m.non_spec_source_indices.push_back(src);
  }

  int64_t* h = m.header;
  h[kNumRequests] = N;
  h[kNumPrefills] = prefills;
  h[kNumPrefillTokens] = non_spec_tokens - decode_tokens;
  h[kNumDecodes] = decodes;
  h[kNumDecodeTokens] = decode_tokens;
  h[kNumSpecDecodes] = int64_t(spec_rows.size());
  h[kNumSpecDecodeTokens] = spec_tokens;
  h[kNumActualTokens] = N > 0 ? at(p.query_start_loc, N) : 0;
  h[kNumNonSpecRows] = int64_t(non_spec_rows.size());
  h[kNumZeroLengthRows] = zero;
  h[kSpecRowsWritten] = spec_written;
  h[kNonSpecRowsWritten] = ns_written;
  h[kMaskRowsWritten] = mask_written;
  h[kMaxColumnEnd] = max_column_end;
  h[kNumSpecColumns] = S;
  h[kPaddedRows] = padded ? p.padded_rows : -1;
  h[kReplay] = p.replay ? 1 : 0;
  *out = std::move(m);
  return Status::ok();
}

// Result of a shadow check: `mismatches` values differ; `message` names the first one.
struct ShadowReport {
  int64_t mismatches = 0;
  std::string message;
  bool ok() const noexcept { return mismatches == 0; }
};

namespace shadow_detail {

struct Comparer {
  ShadowReport* report;
  int group;
  void value(const char* field, int64_t row, int64_t column, int64_t fused, int64_t expected) {
    if (fused == expected) return;
    if (report->mismatches++ > 0) return;
    report->message =
        "group " + std::to_string(group) + ", field " + field + ", row " + std::to_string(row) +
        (column >= 0 ? ", column " + std::to_string(column) : std::string()) +
        ": shared/fused = " + std::to_string(fused) + ", per-group = " + std::to_string(expected);
  }
  template <class T, class U>
  void vector(const char* field, const T* fused, const std::vector<U>& expected) {
    for (size_t r = 0; r < expected.size(); ++r)
      value(field, int64_t(r), -1, int64_t(fused[r]), int64_t(expected[r]));
  }
};

}  // namespace shadow_detail

// Compares the shared plan (p.plan, host) and the fused state rows (p.spec_state_indices,
// p.non_spec_state_indices, p.checkpoint_indices in replay mode and, when given,
// p.non_spec_source_indices, host) against a per-group
// build of every group, exactly, on the rows the step writes. `p` holds host views of the step
// inputs and block tables (device arrays must be copied first; device-gathered accepted counts need
// a host copy of num_accepted_tokens).
inline Status shadow_check(const Params& p, ShadowReport* report) {
  GDN_RETURN_IF_ERROR(check_state_rows_arguments(p, DeviceType::kCPU));
  *report = ShadowReport{};
  const Layout l = p.layout();
  const int32_t* w = p.plan.ptr<const int32_t>();
  const int64_t S = p.num_spec + 1;
  for (int g = 0; g < p.num_groups; ++g) {
    GroupMetadata m;
    GDN_RETURN_IF_ERROR(build_group_reference(p, g, &m));
    const int64_t spec_written = m.header[kSpecRowsWritten];
    const int64_t ns_written = m.header[kNonSpecRowsWritten];
    if (spec_written > p.spec_state_indices.shape[1] ||
        ns_written > p.non_spec_state_indices.shape[1] ||
        (p.non_spec_source_indices.present() && ns_written > p.non_spec_source_indices.shape[1]) ||
        (p.replay && spec_written > p.checkpoint_indices.shape[1]) || spec_written > p.max_rows ||
        ns_written > p.max_rows ||
        int64_t(m.spec_token_indx.size() + m.non_spec_token_indx.size()) > p.max_tokens)
      return Status::invalid(
          "the step writes more rows or tokens than the buffers under check hold");
    shadow_detail::Comparer cmp{report, g};
    for (int f = 0; f < kHeaderWords; ++f)
      cmp.value((std::string("header.") + header_field_name(f)).c_str(), 0, -1, w[l.header + f],
                m.header[f]);
    cmp.vector("spec_sequence_masks", reinterpret_cast<const uint8_t*>(w + l.spec_sequence_masks),
               m.spec_sequence_masks);
    cmp.vector("non_spec_token_indx", w + l.token_split, m.non_spec_token_indx);
    cmp.vector("spec_token_indx", w + l.token_split + m.non_spec_token_indx.size(),
               m.spec_token_indx);
    cmp.vector("spec_query_start_loc", w + l.spec_query_start_loc, m.spec_query_start_loc);
    cmp.vector("non_spec_query_start_loc", w + l.non_spec_query_start_loc,
               m.non_spec_query_start_loc);
    cmp.vector("spec_num_accepted", w + l.spec_num_accepted, m.spec_num_accepted);
    cmp.vector("spec_source_column", w + l.spec_source_column, m.spec_source_column);
    cmp.vector("non_spec_source_column", w + l.non_spec_source_column, m.non_spec_source_column);
    cmp.vector("has_initial_state", reinterpret_cast<const uint8_t*>(w + l.has_initial_state),
               m.has_initial_state);
    cmp.vector("replay_counts", w + l.replay_counts, m.replay_counts);  // empty unless replay
    cmp.vector("non_spec_replay_counts", w + l.non_spec_replay_counts, m.non_spec_replay_counts);
    const int32_t* spec =
        p.spec_state_indices.ptr<const int32_t>() + g * p.spec_state_indices.strides[0];
    for (int64_t j = 0; j < spec_written; ++j)
      for (int64_t c = 0; c < S; ++c)
        cmp.value("spec_state_indices", j, c, spec[j * S + c],
                  m.spec_state_indices[size_t(j * S + c)]);
    if (p.replay) {
      const int32_t* ck =
          p.checkpoint_indices.ptr<const int32_t>() + g * p.checkpoint_indices.strides[0];
      cmp.vector("checkpoint_indices", ck, m.checkpoint_indices);
    }
    const int32_t* ns =
        p.non_spec_state_indices.ptr<const int32_t>() + g * p.non_spec_state_indices.strides[0];
    cmp.vector("non_spec_state_indices", ns, m.non_spec_state_indices);
    if (p.non_spec_source_indices.present()) {
      const int32_t* src =
          p.non_spec_source_indices.ptr<const int32_t>() + g * p.non_spec_source_indices.strides[0];
      cmp.vector("non_spec_source_indices", src, m.non_spec_source_indices);
    }
  }
  if (!report->ok())
    report->message = "shadow check: " + report->message + " (" +
                      std::to_string(report->mismatches) + " mismatching values in total)";
  return Status::ok();
}

}  // namespace gdn::metadata
