// Test helper for the metadata builder: one step's inputs and buffers in host vectors, the Params
// that point at them, and a random step generator.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

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
  // buffers (poisoned)
  std::vector<int32_t> plan, spec_out, non_spec_out;
  int32_t error_count = 0;

  int64_t N() const { return int64_t(query_start_loc.size()) - 1; }
  int64_t S() const { return num_spec + 1; }
  int G() const { return int(tables.size()); }

  void allocate() {
    plan.assign(size_t(Layout::make(max_rows, max_tokens).total_words), kPoison);
    spec_out.assign(size_t(G() * max_rows * S()), kPoison);
    non_spec_out.assign(size_t(G() * max_rows), kPoison);
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
    p.error_count = TensorView::make(&error_count, DType::kInt32, {1});
    return p;
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
// align-mode sequence lengths that sometimes run past the table, random accepted counts.
inline Step random_step(std::mt19937_64& rng, int G, int64_t S, CacheMode mode, bool padded) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Step s;
  s.num_spec = S - 1;
  s.mode = mode;
  s.block_size = uni(1, 8);
  s.pad_id = uni(0, 1) ? 0 : -1;
  const int64_t N = uni(0, 24);
  const bool spec_allowed = uni(0, 3) != 0;
  s.query_start_loc = {0};
  for (int64_t i = 0; i < N; ++i) {
    int32_t T, d;
    const int64_t kind = uni(0, 9);
    if (spec_allowed && kind < 5) {
      d = int32_t(uni(0, S - 1));
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
    s.num_accepted_tokens.push_back(int32_t(uni(1, S)));
  }
  s.with_computed = uni(0, 1);
  s.max_rows = N + uni(1, 6);
  s.padded_rows = padded ? uni(N, s.max_rows) : -1;
  s.max_tokens = s.query_start_loc.back() + uni(0, 5);
  // Tables: every request has a row; align mode sometimes runs past the last column.
  s.tables.clear();
  for (int g = 0; g < G; ++g) {
    const int64_t rows = N + uni(0, 3);
    const int64_t cols = mode == CacheMode::kNone ? S + uni(0, 2) : uni(S, S + 8);
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

}  // namespace gdn::metadata::testing
