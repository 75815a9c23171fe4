// metadata: the state rows of all G KV-cache groups in one pass. For group g and spec row j of
// request i: spec_state_indices[g, j, c] = block_table_g[i, start_j + c], c in [0, S); for
// non-spec row j: non_spec_state_indices[g, j] = block_table_g[i, start_j] (the destination) and
// non_spec_source_indices[g, j] = block_table_g[i, start_j + acc_i - 1] (where the previous step
// left the state), or the pad id when the row has no initial state (a fresh request: its slot may
// still hold a finished request's state, which it must never read). Request i, start_j, acc_i - 1
// and has_initial_state come from the plan buffer (or acc_i from the gathered accepted counts), so
// the pass never knows the cache mode.
//
// The pass is driven by a small table of (pointer, row stride, rows, columns) per group, shared by
// the CPU loop here and the CUDA kernel (state_rows.cuh). A row whose columns would fall outside
// its table (a spec row's S columns, a non-spec row's columns start..start + acc - 1, or only start
// without an initial state), or whose
// gathered accepted count is outside [1, S], is never read: it is filled with the pad id and
// counted. Rows in [live, written) are padding (pad id). Counts come from the plan header, so the
// same launch replays correctly inside a CUDA graph after the plan buffer is refreshed.
//
// Replay mode (replay.md §3): every row reads one column, start (its checkpoint slot):
// checkpoint_indices[g, j] = spec_state_indices[g, j, 0] = block_table_g[i, start_j] for spec
// row j (columns 1..S-1 get the pad id), and non-spec row j writes and reads that slot
// (non_spec_state_indices[g, j] = non_spec_source_indices[g, j]). Gathered counts are replay
// counts n in [0, S]. A plan made in the other mode (header word kReplay) is not read: every row
// written gets the pad id and the mismatch is counted once.
// Host-only (compiles with g++ alone); the shared helpers are also device functions under nvcc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "gdn/core/host_device.hpp"
#include "gdn/core/status.hpp"
#include "gdn/metadata/params.hpp"

namespace gdn::metadata {

struct GroupTable {
  const int32_t* data = nullptr;
  int64_t row_stride = 0;  // in elements
  int32_t num_rows = 0;
  int32_t num_cols = 0;
};

// Everything one state-row pass needs, passed by value (it is also the CUDA kernel argument).
struct StateRowsArgs {
  GroupTable tables[kMaxGroups];
  int32_t* plan = nullptr;  // plan buffer (accepted counts are written into it when gathered)
  int64_t spec_request = 0, spec_start = 0, non_spec_request = 0, non_spec_start = 0;
  int64_t spec_num_accepted = 0, spec_source_column = 0;  // word offsets (Layout)
  int64_t non_spec_source_column = 0;
  int64_t has_initial_state = 0;  // word offset of the per-non-spec-row bytes
  int64_t replay_counts = 0, non_spec_replay_counts = 0;  // replay mode
  int32_t* spec_out = nullptr;                            // [G, spec_group_stride / S, S]
  int64_t spec_group_stride = 0;
  int32_t* non_spec_out = nullptr;  // [G, non_spec_group_stride]
  int64_t non_spec_group_stride = 0;
  int32_t* non_spec_source_out = nullptr;  // [G, non_spec_source_group_stride], or null
  int64_t non_spec_source_group_stride = 0;
  int32_t* checkpoint_out = nullptr;  // replay mode: [G, checkpoint_group_stride]
  int64_t checkpoint_group_stride = 0;
  const int32_t* accepted = nullptr;  // per-request accepted counts to gather, or null
  int64_t accepted_len = 0;
  int32_t* error_count = nullptr;
  int32_t num_groups = 0;
  int32_t S = 1;
  int32_t pad_id = 0;
  int32_t launch_rows = 0;
  int32_t replay = 0;  // 1: replay mode
};

// Rows the step writes (from the plan header), clamped to what the pass covers.
struct RowCounts {
  int32_t spec_live, spec_written, non_spec_live, non_spec_written;
  // Reported once per pass: rows the plan asks for beyond launch_rows (never written), plus 1
  // when the plan was made in the other state mode (then no row is live).
  int32_t plan_errors;
};

GDN_HOST_DEVICE inline int32_t clamp_rows(int32_t v, int32_t hi) {
  return v < 0 ? 0 : (v > hi ? hi : v);
}

GDN_HOST_DEVICE inline RowCounts read_row_counts(const StateRowsArgs& a) {
  const int32_t* h = a.plan;
  RowCounts r;
  const int32_t spec_req = h[kSpecRowsWritten] < 0 ? 0 : h[kSpecRowsWritten];
  const int32_t ns_req = h[kNonSpecRowsWritten] < 0 ? 0 : h[kNonSpecRowsWritten];
  r.spec_written = clamp_rows(spec_req, a.launch_rows);
  r.non_spec_written = clamp_rows(ns_req, a.launch_rows);
  r.spec_live = clamp_rows(h[kNumSpecDecodes], r.spec_written);
  r.non_spec_live = clamp_rows(h[kNumNonSpecRows], r.non_spec_written);
  r.plan_errors = (spec_req - r.spec_written) + (ns_req - r.non_spec_written);
  if (h[kReplay] != a.replay) {
    r.spec_live = r.non_spec_live = 0;
    r.plan_errors += 1;
  }
  return r;
}

// Whether columns [start, start + width) of row `request` lie inside the table.
GDN_HOST_DEVICE inline bool row_readable(const GroupTable& t, int32_t request, int32_t start,
                                         int32_t width) {
  return request >= 0 && request < t.num_rows && start >= 0 && start <= t.num_cols - width;
}

// The source column of live non-spec row j of `request`, counted from its start: acc - 1 (from
// the accepted counts being gathered, else from the plan), or 0 in replay mode (the checkpoint).
// Out of range (request past the counts, a count outside [1, S], replay: [0, S]): -1.
GDN_HOST_DEVICE inline int32_t non_spec_source(const StateRowsArgs& a, int32_t j, int32_t request) {
  if (a.accepted) {
    if (request < 0 || request >= a.accepted_len) return -1;
    const int32_t count = a.accepted[request];
    if (count < (a.replay ? 0 : 1) || count > a.S) return -1;
    return a.replay ? 0 : count - 1;
  }
  if (a.replay) return 0;  // the plan's replay counts were validated on the host
  const int32_t src = a.plan[a.non_spec_source_column + j];
  return (src < 0 || src >= a.S) ? -1 : src;
}

// The value (table entry) of non-spec row j's destination and source, or false when the row's
// columns start..start + acc - 1 (replay: start) are not all inside the table (or its count is
// out of range). A row without an initial state reads no slot: its source is the pad id and only
// its destination column must exist.
GDN_HOST_DEVICE inline bool non_spec_entries(const StateRowsArgs& a, const GroupTable& t, int32_t j,
                                             int32_t* dst, int32_t* src) {
  const int32_t request = a.plan[a.non_spec_request + j];
  const int32_t start = a.plan[a.non_spec_start + j];
  const int32_t s = non_spec_source(a, j, request);
  const bool initial = reinterpret_cast<const uint8_t*>(a.plan + a.has_initial_state)[j] != 0;
  if (s < 0 || !row_readable(t, request, start, initial ? s + 1 : 1)) return false;
  const int32_t* row = t.data + request * t.row_stride + start;
  *dst = row[0];
  *src = initial ? row[s] : a.pad_id;
  return true;
}

// Writes the gathered acc - 1 of non-spec row j into the plan (live rows; padded rows keep 0),
// and in replay mode its replay count n (padded rows 0) with acc = max(n, 1). A request past the
// counts gets acc - 1 = -1 (replay: n = -1, a count replay verify refuses).
GDN_HOST_DEVICE inline void gather_non_spec_accepted(const StateRowsArgs& a, int32_t j, bool live) {
  int32_t count = a.replay ? 0 : 1;
  if (live) {
    const int32_t request = a.plan[a.non_spec_request + j];
    count = (request >= 0 && request < a.accepted_len) ? a.accepted[request] : (a.replay ? -1 : 0);
  }
  if (a.replay) {
    a.plan[a.non_spec_replay_counts + j] = count;
    count = count > 1 ? count : 1;
  }
  a.plan[a.non_spec_source_column + j] = count - 1;
}

// Gathers the accepted count of spec row j (live rows) or writes the padding values (acc = 1,
// replay count 0); in replay mode the gathered count is n and acc = max(n, 1). Returns 1 when the
// row's request or count is out of range (the count is copied as is; a request past the counts
// gets acc = 1 and, in replay mode, n = -1, which replay verify refuses).
GDN_HOST_DEVICE inline int32_t gather_accepted(const StateRowsArgs& a, int32_t j, bool live) {
  int32_t acc = 1, n = 0, bad = 0;
  if (live) {
    const int32_t request = a.plan[a.spec_request + j];
    if (request >= 0 && request < a.accepted_len) {
      n = a.accepted[request];
      bad = (n < (a.replay ? 0 : 1) || n > a.S);
      acc = a.replay && n < 1 ? 1 : n;
    } else {
      bad = 1;
      n = -1;
    }
  }
  a.plan[a.spec_num_accepted + j] = acc;
  a.plan[a.spec_source_column + j] = acc - 1;
  if (a.replay) a.plan[a.replay_counts + j] = n;
  return bad;
}

// Builds the argument table from validated params (`plan` is the buffer the pass reads).
inline StateRowsArgs make_state_rows_args(const Params& p) {
  StateRowsArgs a;
  const Layout l = p.layout();
  for (int g = 0; g < p.num_groups; ++g) {
    const TensorView& t = p.block_tables[g];
    a.tables[g].data = t.ptr<const int32_t>();
    a.tables[g].row_stride = t.shape[0] > 1 ? t.strides[0] : t.shape[1];
    a.tables[g].num_rows = int32_t(std::min<int64_t>(t.shape[0], INT32_MAX));
    a.tables[g].num_cols = int32_t(std::min<int64_t>(t.shape[1], INT32_MAX));
  }
  a.plan = p.plan.ptr<int32_t>();
  a.spec_request = l.spec_request;
  a.spec_start = l.spec_start;
  a.non_spec_request = l.non_spec_request;
  a.non_spec_start = l.non_spec_start;
  a.spec_num_accepted = l.spec_num_accepted;
  a.spec_source_column = l.spec_source_column;
  a.non_spec_source_column = l.non_spec_source_column;
  a.has_initial_state = l.has_initial_state;
  a.replay_counts = l.replay_counts;
  a.non_spec_replay_counts = l.non_spec_replay_counts;
  a.spec_out = p.spec_state_indices.ptr<int32_t>();
  a.spec_group_stride = p.spec_state_indices.shape[0] > 1
                            ? p.spec_state_indices.strides[0]
                            : p.spec_state_indices.shape[1] * p.spec_state_indices.shape[2];
  a.non_spec_out = p.non_spec_state_indices.ptr<int32_t>();
  a.non_spec_group_stride = p.non_spec_state_indices.shape[0] > 1
                                ? p.non_spec_state_indices.strides[0]
                                : p.non_spec_state_indices.shape[1];
  if (p.non_spec_source_indices.present()) {
    a.non_spec_source_out = p.non_spec_source_indices.ptr<int32_t>();
    a.non_spec_source_group_stride = p.non_spec_source_indices.shape[0] > 1
                                         ? p.non_spec_source_indices.strides[0]
                                         : p.non_spec_source_indices.shape[1];
  }
  if (p.replay) {
    a.replay = 1;
    a.checkpoint_out = p.checkpoint_indices.ptr<int32_t>();
    a.checkpoint_group_stride = p.checkpoint_indices.shape[0] > 1 ? p.checkpoint_indices.strides[0]
                                                                  : p.checkpoint_indices.shape[1];
  }
  if (p.num_accepted_tokens.present() && p.num_accepted_tokens.device == p.plan.device) {
    a.accepted = p.num_accepted_tokens.ptr<const int32_t>();
    a.accepted_len = int32_t(std::min<int64_t>(p.num_accepted_tokens.shape[0], INT32_MAX));
  }
  a.error_count = p.error_count.present() ? p.error_count.ptr<int32_t>() : nullptr;
  a.num_groups = p.num_groups;
  a.S = int32_t(p.num_state_columns());
  a.pad_id = p.pad_id;
  a.launch_rows = int32_t(p.launch_rows > 0 ? p.launch_rows : p.max_rows);
  return a;
}

// The CPU pass over validated arguments: one loop over the group table. Returns the number of
// unreadable rows (group x row pairs filled with the pad id, spec rows whose gathered accepted
// count is out of range, rows the plan asks for beyond launch_rows, a plan of the other state
// mode); also added to error_count.
inline int64_t run_state_rows_cpu(const StateRowsArgs& a) {
  const RowCounts rc = read_row_counts(a);
  const int32_t S = a.S;
  int64_t errors = rc.plan_errors;
  if (a.accepted) {
    for (int32_t j = 0; j < rc.spec_written; ++j) errors += gather_accepted(a, j, j < rc.spec_live);
    for (int32_t j = 0; j < rc.non_spec_written; ++j)
      gather_non_spec_accepted(a, j, j < rc.non_spec_live);
  }
  const int32_t* spec_request = a.plan + a.spec_request;
  const int32_t* spec_start = a.plan + a.spec_start;
  for (int32_t g = 0; g < a.num_groups; ++g) {
    const GroupTable& t = a.tables[g];
    // Plain element loops: S is small, and a library copy per row costs more than the row.
    int32_t* out = a.spec_out + g * a.spec_group_stride;
    int32_t j = 0;
    if (a.replay) {  // one column: the checkpoint, also in column 0 of the spec row
      int32_t* checkpoint = a.checkpoint_out + g * a.checkpoint_group_stride;
      for (; j < rc.spec_written; ++j, out += S) {
        int32_t v = a.pad_id;
        if (j < rc.spec_live) {
          if (row_readable(t, spec_request[j], spec_start[j], 1))
            v = t.data[spec_request[j] * t.row_stride + spec_start[j]];
          else
            ++errors;
        }
        checkpoint[j] = v;
        out[0] = v;
        for (int32_t c = 1; c < S; ++c) out[c] = a.pad_id;
      }
    }
    for (; j < rc.spec_live; ++j, out += S) {
      if (row_readable(t, spec_request[j], spec_start[j], S)) {
        const int32_t* src = t.data + spec_request[j] * t.row_stride + spec_start[j];
        for (int32_t c = 0; c < S; ++c) out[c] = src[c];
      } else {
        ++errors;
        for (int32_t c = 0; c < S; ++c) out[c] = a.pad_id;
      }
    }
    for (int64_t k = 0; k < int64_t(rc.spec_written - j) * S; ++k) out[k] = a.pad_id;
    int32_t* ns_out = a.non_spec_out + g * a.non_spec_group_stride;
    int32_t* src_out = a.non_spec_source_out
                           ? a.non_spec_source_out + g * a.non_spec_source_group_stride
                           : nullptr;
    for (j = 0; j < rc.non_spec_written; ++j) {
      int32_t dst = a.pad_id, src = a.pad_id;
      if (j < rc.non_spec_live && !non_spec_entries(a, t, j, &dst, &src)) {
        ++errors;
        dst = src = a.pad_id;
      }
      ns_out[j] = dst;
      if (src_out) src_out[j] = src;
    }
  }
  if (a.error_count) *a.error_count += int32_t(errors);
  return errors;
}

// The CPU pass from params (validated first, the plan's state mode included). `num_errors`: as
// above.
inline Status run_state_rows_cpu(const Params& p, int64_t* num_errors = nullptr) {
  GDN_RETURN_IF_ERROR(check_state_rows_arguments(p, DeviceType::kCPU));
  const int32_t planned = p.plan.ptr<const int32_t>()[p.layout().header + kReplay];
  if (planned != (p.replay ? 1 : 0))
    return Status::invalid(std::string("plan holds a plan made with header word replay = ") +
                           std::to_string(planned) +
                           " but the state-row pass has replay = " + (p.replay ? "true" : "false") +
                           ": plan and state rows must use the same mode");
  const int64_t errors = run_state_rows_cpu(make_state_rows_args(p));
  if (num_errors) *num_errors = errors;
  return Status::ok();
}

}  // namespace gdn::metadata
