// Test helper for the metadata builder: one step's inputs and buffers in host vectors, the Params
// that point at them, and a random step generator.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gdn/metadata/builder.hpp"
#include "gdn/metadata/params.hpp"

namespace gdn::metadata::testing {

inline constexpr int32_t kPoison = -777777;

struct Step {
  // inputs
  std::vector<int32_t> query_start_loc, seq_lens, num_computed_tokens, num_draft_tokens,
      num_accepted_tokens;
  bool with_computed = true, with_drafts = true, with_accepted = true;
  std::vector<std::vector<int32_t>> tables;  // G tables, row-major with row stride `table_stride`
  std::vector<int64_t> table_rows, table_cols, table_stride;
  // scalars and capacity
  int64_t num_spec = 1, block_size = 16, padded_rows = -1, max_rows = 8, max_tokens = 64;
  CacheMode mode = CacheMode::kNone;
  int32_t pad_id = 0;
  bool replay = false;  // replay mode: num_accepted_tokens are replay counts, checkpoint_out used
  // buffers (poisoned)
  std::vector<int32_t> plan, spec_out, non_spec_out, non_spec_src_out, checkpoint_out;
  int32_t error_count = 0;
  bool with_source = true;  // pass non_spec_source_indices

  int64_t N() const { return int64_t(query_start_loc.size()) - 1; }
  int64_t S() const { return num_spec + 1; }
  int G() const { return int(tables.size()); }

  void allocate() {
    plan.assign(size_t(Layout::make(max_rows, max_tokens).total_words), kPoison);
    spec_out.assign(size_t(G() * max_rows * S()), kPoison);
    non_spec_out.assign(size_t(G() * max_rows), kPoison);
    non_spec_src_out.assign(size_t(G() * max_rows), kPoison);
    checkpoint_out.assign(size_t(G() * max_rows), kPoison);
    error_count = 0;
  }

  // A table for every group: rows x cols, stride >= cols, entries distinct per group.
  void make_tables(int G, int64_t rows, int64_t cols, int64_t extra_stride = 3) {
    tables.clear();
    table_rows.assign(size_t(G), rows);
    table_cols.assign(size_t(G), cols);
    table_stride.assign(size_t(G), cols + extra_stride);
    for (int g = 0; g < G; ++g) {
      std::vector<int32_t> t(size_t(rows * (cols + extra_stride)), kPoison);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          t[size_t(r * (cols + extra_stride) + c)] = int32_t(100000 * (g + 1) + 100 * r + c);
      tables.push_back(std::move(t));
    }
  }

  Params params() {
    Params p;
    auto vec = [](std::vector<int32_t>& v) {
      return TensorView::make(v.data(), DType::kInt32, {int64_t(v.size())});
    };
    p.query_start_loc = vec(query_start_loc);
    p.seq_lens = vec(seq_lens);
    if (with_computed) p.num_computed_tokens = vec(num_computed_tokens);
    if (with_drafts) p.num_draft_tokens = vec(num_draft_tokens);
    if (with_accepted) p.num_accepted_tokens = vec(num_accepted_tokens);
    p.num_spec = num_spec;
    p.mode = mode;
    p.block_size = block_size;
    p.padded_rows = padded_rows;
    p.pad_id = pad_id;
    p.replay = replay;
    p.plan = vec(plan);
    p.max_rows = max_rows;
    p.max_tokens = max_tokens;
    p.num_groups = G();
    for (int g = 0; g < G(); ++g)
      p.block_tables[g] = TensorView::make(tables[size_t(g)].data(), DType::kInt32,
                                           {table_rows[size_t(g)], table_cols[size_t(g)]},
                                           {table_stride[size_t(g)], 1});
    p.spec_state_indices =
        TensorView::make(spec_out.data(), DType::kInt32, {int64_t(G()), max_rows, S()});
    p.non_spec_state_indices =
        TensorView::make(non_spec_out.data(), DType::kInt32, {int64_t(G()), max_rows});
    if (with_source)
      p.non_spec_source_indices =
          TensorView::make(non_spec_src_out.data(), DType::kInt32, {int64_t(G()), max_rows});
    if (replay)
      p.checkpoint_indices =
          TensorView::make(checkpoint_out.data(), DType::kInt32, {int64_t(G()), max_rows});
    p.error_count = TensorView::make(&error_count, DType::kInt32, {1});
    return p;
  }

  // The step's host arrays as a builder takes them.
  StepInputs inputs() {
    const Params p = params();
    StepInputs in;
    in.query_start_loc = p.query_start_loc;
    in.seq_lens = p.seq_lens;
    in.num_draft_tokens = p.num_draft_tokens;
    in.num_accepted_tokens = p.num_accepted_tokens;
    in.num_computed_tokens = p.num_computed_tokens;
    in.padded_rows = padded_rows;
    return in;
  }

  // Caller-provided builder buffers: this step's output arrays and one host plan buffer (sized
  // here).
  BuilderBuffers caller_buffers(std::vector<int32_t>& host_plan) {
    const Params p = params();
    host_plan.assign(size_t(Layout::make(max_rows, max_tokens).total_words), 0);
    BuilderBuffers b;
    b.spec_state_indices = p.spec_state_indices;
    b.non_spec_state_indices = p.non_spec_state_indices;
    b.non_spec_source_indices = p.non_spec_source_indices;
    b.checkpoint_indices = p.checkpoint_indices;  // absent outside replay mode
    b.error_count = p.error_count;
    b.num_host_plans = 1;
    b.host_plans[0] =
        TensorView::make(host_plan.data(), DType::kInt32, {int64_t(host_plan.size())});
    return b;
  }

  // A builder configuration over this step's (host) tables and scalars.
  BuilderConfig config() {
    const Params p = params();
    BuilderConfig c;
    c.num_groups = G();
    for (int g = 0; g < G(); ++g) c.block_tables[g] = p.block_tables[g];
    c.num_spec = num_spec;
    c.max_rows = max_rows;
    c.max_tokens = max_tokens;
    c.mode = mode;
    c.block_size = block_size;
    c.pad_id = pad_id;
    c.replay = replay;
    return c;
  }

  // Reads the header / a word of the plan buffer.
  int32_t header(int f) const {
    return plan[size_t(Layout::make(max_rows, max_tokens).header + f)];
  }
};

// Builds a step from per-request (tokens, drafts) pairs; seq_lens = context + tokens.
inline Step make_step(const std::vector<std::pair<int32_t, int32_t>>& rows, int64_t num_spec,
                      int G = 1, int64_t context = 5) {
  Step s;
  s.num_spec = num_spec;
  s.query_start_loc = {0};
  for (auto [T, d] : rows) {
    s.query_start_loc.push_back(s.query_start_loc.back() + T);
    s.num_draft_tokens.push_back(d);
    s.num_computed_tokens.push_back(int32_t(context));
    s.seq_lens.push_back(int32_t(context) + T);
    s.num_accepted_tokens.push_back(1);
  }
  s.max_rows = std::max<int64_t>(8, int64_t(rows.size()));
  s.max_tokens = std::max<int64_t>(64, s.query_start_loc.back());
  s.make_tables(G, s.max_rows, s.S() + 2);
  s.allocate();
  return s;
}

// A random step: a mix of spec rows, decodes, prefills and zero-length rows (each kind optional),
// align-mode sequence lengths that sometimes run past the table, random accepted counts. With
// `replay`: replay mode (mode "none"), replay counts 0..S, tables from 1 column (one checkpoint
// slot per request) up to S + 2, sometimes with fewer rows than requests.
inline Step random_step(std::mt19937_64& rng, int G, int64_t S, CacheMode mode, bool padded,
                        bool replay = false) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Step s;
  s.num_spec = S - 1;
  s.replay = replay;
  if (replay) mode = CacheMode::kNone;
  s.mode = mode;
  s.block_size = uni(1, 8);
  s.pad_id = uni(0, 1) ? 0 : -1;
  const int64_t N = uni(0, 24);
  const bool spec_allowed = uni(0, 3) != 0;
  const bool zero_drafts = uni(0, 5) == 0;  // verify rows that all drafted nothing (spec rows)
  s.query_start_loc = {0};
  for (int64_t i = 0; i < N; ++i) {
    int32_t T, d;
    const int64_t kind = uni(0, 9);
    if (spec_allowed && kind < 5) {
      d = zero_drafts ? 0 : int32_t(uni(0, S - 1));
      T = uni(0, 9) == 0 ? int32_t(uni(0, S)) : d + 1;  // mostly 1 + drafts
    } else {
      d = -1;
      T = kind < 7 ? 1 : (kind < 9 ? int32_t(uni(2, 12)) : 0);
    }
    const int32_t context = int32_t(uni(0, 3) == 0 ? 0 : uni(1, 40));
    s.query_start_loc.push_back(s.query_start_loc.back() + T);
    s.num_draft_tokens.push_back(d);
    s.num_computed_tokens.push_back(context);
    s.seq_lens.push_back(context + T);
    s.num_accepted_tokens.push_back(int32_t(uni(replay ? 0 : 1, S)));
  }
  s.with_computed = uni(0, 1);
  s.max_rows = N + uni(1, 6);
  s.padded_rows = padded ? uni(N, s.max_rows) : -1;
  s.max_tokens = s.query_start_loc.back() + uni(0, 5);
  // Tables: every request has a row; align mode sometimes runs past the last column.
  s.tables.clear();
  for (int g = 0; g < G; ++g) {
    const int64_t rows = replay ? std::max<int64_t>(N - uni(0, 2), 0) + uni(0, 2) : N + uni(0, 3);
    const int64_t cols =
        replay ? uni(1, S + 2) : (mode == CacheMode::kNone ? S + uni(0, 2) : uni(S, S + 8));
    const int64_t stride = cols + uni(0, 4);
    std::vector<int32_t> t(size_t(std::max<int64_t>(rows * stride, 1)));
    for (auto& v : t) v = int32_t(uni(1, 1 << 20));
    s.tables.push_back(std::move(t));
    s.table_rows.push_back(rows);
    s.table_cols.push_back(cols);
    s.table_stride.push_back(stride);
  }
  s.allocate();
  return s;
}

// A random step over the builder-lifetime parts of `base`: its tables, capacity, S, mode, block
// size and pad id (what a builder keeps from one step to the next).
inline Step random_step_on(std::mt19937_64& rng, const Step& base, bool padded) {
  for (;;) {
    Step s = random_step(rng, base.G(), base.S(), base.mode, padded, base.replay);
    if (s.N() > base.max_rows || s.query_start_loc.back() > base.max_tokens) continue;
    s.max_rows = base.max_rows;
    s.max_tokens = base.max_tokens;
    if (s.padded_rows > s.max_rows) s.padded_rows = s.max_rows;
    s.block_size = base.block_size;
    s.pad_id = base.pad_id;
    s.replay = base.replay;
    s.tables = base.tables;
    s.table_rows = base.table_rows;
    s.table_cols = base.table_cols;
    s.table_stride = base.table_stride;
    s.allocate();
    return s;
  }
}

// ---- the tests' own per-group reference of vLLM's semantics ----------------------------------
// Written from vLLM's GDN builder (split_decodes_and_prefills with threshold 1 and short extends
// as prefills, the trailing padding excluded, the spec-row reclassification,
// spec_decode_src_indices) and metadata.md §2.1-2.2; shares no code with the library or its shadow
// check. Expects a step the plan accepts.

struct VllmExpected {
  int64_t num_decodes = 0, num_decode_tokens = 0, num_prefills = 0, num_prefill_tokens = 0;
  int64_t num_spec_decodes = 0, num_spec_decode_tokens = 0;
  int64_t rows_written = 0;  // per kind: padded_rows, or the live rows of that kind
  int64_t spec_rows_written = 0;
  // [G][row]: non-spec destination / source ids, spec rows [G][row * S + c]
  std::vector<std::vector<int32_t>> destination, source, spec;
  int64_t unreadable = 0;  // (group, row) pairs padded because a column is missing
  // Replay mode (replay.md §3): [G][spec row] checkpoint slots; per row the replay counts and
  // the accepted counts max(n, 1), spec rows then non-spec rows.
  std::vector<std::vector<int32_t>> checkpoint;
  std::vector<int32_t> replay_counts, non_spec_replay_counts, spec_accepted, non_spec_source_column;
};

inline VllmExpected vllm_expected(const Step& s) {
  VllmExpected e;
  const int64_t N = s.N(), S = s.S();
  std::vector<int64_t> len(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    len[size_t(i)] = s.query_start_loc[size_t(i + 1)] - s.query_start_loc[size_t(i)];
  // A spec row has a draft count >= 0, zero included; a row without context is prefilling.
  auto is_spec = [&](int64_t i) { return s.with_drafts && s.num_draft_tokens[size_t(i)] >= 0; };
  auto context = [&](int64_t i) -> int64_t {
    return s.with_computed ? s.num_computed_tokens[size_t(i)]
                           : int64_t(s.seq_lens[size_t(i)]) - len[size_t(i)];
  };
  std::vector<int64_t> spec_rows, non_spec_rows;
  for (int64_t i = 0; i < N; ++i) (is_spec(i) ? spec_rows : non_spec_rows).push_back(i);
  const int64_t total = N ? s.query_start_loc[size_t(N)] : 0;
  if (spec_rows.empty()) {
    // No prefilling row: all decodes; else split at the first one (more than 1 token, or tokens
    // without context), and the zero-length rows after the last token leave the prefills.
    int64_t first_prefill = N;
    for (int64_t i = 0; i < N && first_prefill == N; ++i)
      if (len[size_t(i)] > 1 || (len[size_t(i)] > 0 && context(i) == 0)) first_prefill = i;
    e.num_decodes = first_prefill;
    e.num_prefills = N - first_prefill;
    for (int64_t i = N - 1; e.num_prefills > 0 && len[size_t(i)] == 0; --i) --e.num_prefills;
    e.num_decode_tokens = s.query_start_loc[size_t(first_prefill)];
    e.num_prefill_tokens = total - e.num_decode_tokens;
  } else {
    int64_t zeros = 0, non_spec_tokens = 0;
    for (int64_t i : non_spec_rows) {
      zeros += len[size_t(i)] == 0;
      non_spec_tokens += len[size_t(i)];
    }
    e.num_decodes = 0;  // 1-token rows are reclassified as prefills; zero-length rows in neither
    e.num_prefills = int64_t(non_spec_rows.size()) - zeros;
    e.num_prefill_tokens = non_spec_tokens;
    for (int64_t i : spec_rows) e.num_spec_decode_tokens += len[size_t(i)];
  }
  e.num_spec_decodes = int64_t(spec_rows.size());
  e.rows_written = s.padded_rows >= 0 ? s.padded_rows : int64_t(non_spec_rows.size());
  e.spec_rows_written = s.padded_rows >= 0 ? s.padded_rows : int64_t(spec_rows.size());
  // The count given for request i: an accepted count (absent: 1) or, in replay mode, the number
  // of window tokens to replay (absent: 0, nothing pending). Padded rows: 1 / replay 0.
  auto given = [&](const std::vector<int64_t>& rows, int64_t j) -> int32_t {
    if (j >= int64_t(rows.size()) || !s.with_accepted) return s.replay ? 0 : 1;
    return s.num_accepted_tokens[size_t(rows[size_t(j)])];
  };
  for (int64_t j = 0; j < e.spec_rows_written; ++j) {
    e.spec_accepted.push_back(std::max(given(spec_rows, j), 1));
    if (s.replay) e.replay_counts.push_back(given(spec_rows, j));
  }
  for (int64_t j = 0; j < e.rows_written; ++j) {
    e.non_spec_source_column.push_back(std::max(given(non_spec_rows, j), 1) - 1);
    if (s.replay) e.non_spec_replay_counts.push_back(given(non_spec_rows, j));
  }
  for (int g = 0; g < s.G(); ++g) {
    const auto& t = s.tables[size_t(g)];
    const int64_t rows = s.table_rows[size_t(g)], cols = s.table_cols[size_t(g)];
    const int64_t stride = s.table_stride[size_t(g)];
    auto start_of = [&](int64_t i) -> int64_t {
      if (s.mode == CacheMode::kNone) return 0;
      const int64_t last = int64_t(s.seq_lens[size_t(i)]) - 1;
      return last > 0 ? last / s.block_size : 0;
    };
    std::vector<int32_t> dst(size_t(e.rows_written), s.pad_id), src = dst;
    for (size_t j = 0; j < non_spec_rows.size(); ++j) {
      const int64_t i = non_spec_rows[j];
      // Replay mode: one slot per request, read and written (the checkpoint at column start).
      // A row without context reads nothing (source: pad id); only its destination must exist.
      const bool fresh = context(i) <= 0;
      const int64_t acc =
          s.replay || fresh ? 1 : (s.with_accepted ? s.num_accepted_tokens[size_t(i)] : 1);
      const int64_t c0 = start_of(i), c1 = c0 + acc - 1;
      if (i < rows && c1 < cols) {
        dst[j] = t[size_t(i * stride + c0)];
        src[j] = fresh ? s.pad_id : t[size_t(i * stride + c1)];
      } else {
        ++e.unreadable;
      }
    }
    std::vector<int32_t> spec(size_t(e.spec_rows_written * S), s.pad_id);
    std::vector<int32_t> checkpoint(size_t(e.spec_rows_written), s.pad_id);
    for (size_t j = 0; j < spec_rows.size(); ++j) {
      const int64_t i = spec_rows[j], c0 = start_of(i);
      // Replay mode: only the checkpoint column exists for the request (the rest is pad).
      const int64_t width = s.replay ? 1 : S;
      if (i < rows && c0 + width <= cols) {
        for (int64_t c = 0; c < width; ++c)
          spec[j * size_t(S) + size_t(c)] = t[size_t(i * stride + c0 + c)];
        checkpoint[j] = t[size_t(i * stride + c0)];
      } else {
        ++e.unreadable;
      }
    }
    e.destination.push_back(std::move(dst));
    e.source.push_back(std::move(src));
    e.spec.push_back(std::move(spec));
    e.checkpoint.push_back(std::move(checkpoint));
  }
  return e;
}

}  // namespace gdn::metadata::testing
