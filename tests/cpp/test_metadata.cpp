// Metadata builder on the host: classification (the cases of vLLM's GDN builder tests), every
// shared field on hand-checked steps, state rows in both cache modes, graph padding, bounds,
// argument errors, and the shared + fused result against independent per-group builds (the shadow
// check) on random steps, including an injected mismatch and poisoned unused rows.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "gdn/gdn.hpp"
#include "metadata_case.hpp"

namespace gdn::metadata {
namespace {

using testing::kPoison;
using testing::make_step;
using testing::random_step;
using testing::Step;

// Plans `s`, runs the CPU pass, and returns its error count.
int64_t build(Step& s) {
  Params p = s.params();
  Status st = plan(p);
  EXPECT_TRUE(st.is_ok()) << st.reason();
  int64_t errors = -1;
  st = run_state_rows_cpu(p, &errors);
  EXPECT_TRUE(st.is_ok()) << st.reason();
  return errors;
}

ShadowReport shadow(Step& s) {
  ShadowReport r;
  Params p = s.params();
  Status st = shadow_check(p, &r);
  EXPECT_TRUE(st.is_ok()) << st.reason();
  return r;
}

struct Counts {
  int prefills, prefill_tokens, decodes, decode_tokens, spec, spec_tokens, zero;
};

void expect_counts(const Step& s, Counts c) {
  EXPECT_EQ(s.header(kNumPrefills), c.prefills);
  EXPECT_EQ(s.header(kNumPrefillTokens), c.prefill_tokens);
  EXPECT_EQ(s.header(kNumDecodes), c.decodes);
  EXPECT_EQ(s.header(kNumDecodeTokens), c.decode_tokens);
  EXPECT_EQ(s.header(kNumSpecDecodes), c.spec);
  EXPECT_EQ(s.header(kNumSpecDecodeTokens), c.spec_tokens);
  EXPECT_EQ(s.header(kNumZeroLengthRows), c.zero);
}

std::vector<int32_t> words(const Step& s, int64_t Layout::* field, int64_t n) {
  const Layout l = Layout::make(s.max_rows, s.max_tokens);
  return {s.plan.begin() + l.*field, s.plan.begin() + l.*field + n};
}

std::vector<int> bytes(const Step& s, int64_t Layout::* field, int64_t n) {
  const Layout l = Layout::make(s.max_rows, s.max_tokens);
  const auto* b = reinterpret_cast<const uint8_t*>(s.plan.data() + l.*field);
  return {b, b + n};
}

// ---- classification: the cases of vLLM's builder tests ----------------------------------------
// (tokens, drafts) per request; drafts -1 = not a spec row.

TEST(MetadataClassification, MixedDecodeAndSpecReclassifiesTheDecode) {
  Step s = make_step({{3, 2}, {1, -1}, {3, 2}}, 2);
  build(s);
  expect_counts(s, {1, 1, 0, 0, 2, 6, 0});
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataClassification, PureSpec) {
  Step s = make_step({{3, 2}, {2, 1}, {3, 2}}, 2);
  build(s);
  expect_counts(s, {0, 0, 0, 0, 3, 8, 0});
  EXPECT_EQ(words(s, &Layout::token_split, 8), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(words(s, &Layout::spec_query_start_loc, 4), (std::vector<int32_t>{0, 3, 5, 8}));
}

TEST(MetadataClassification, PureDecode) {
  Step s = make_step({{1, -1}, {1, -1}, {1, -1}, {1, -1}}, 3);
  build(s);
  expect_counts(s, {0, 0, 4, 4, 0, 0, 0});
  s = make_step({{1, -1}, {1, -1}}, 3);
  s.with_drafts = false;  // no draft counts at all: the same
  build(s);
  expect_counts(s, {0, 0, 2, 2, 0, 0, 0});
}

TEST(MetadataClassification, SpecAndPrefill) {
  Step s = make_step({{2, 1}, {7, -1}, {2, 1}}, 1);
  build(s);
  expect_counts(s, {1, 7, 0, 0, 2, 4, 0});
  // Stable split: non-spec tokens in order, then spec tokens in order.
  EXPECT_EQ(words(s, &Layout::token_split, 11),
            (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 0, 1, 9, 10}));
  EXPECT_EQ(words(s, &Layout::non_spec_query_start_loc, 2), (std::vector<int32_t>{0, 7}));
  EXPECT_EQ(words(s, &Layout::spec_query_start_loc, 3), (std::vector<int32_t>{0, 2, 4}));
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataClassification, PrefillDecodeAndSpec) {
  Step s = make_step({{5, -1}, {1, -1}, {4, 3}, {2, 1}}, 3);
  build(s);
  expect_counts(s, {2, 6, 0, 0, 2, 6, 0});
  EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 4), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataClassification, SeveralDecodesReclassified) {
  Step s = make_step({{1, -1}, {2, 1}, {1, -1}, {1, -1}, {2, 1}}, 1);
  build(s);
  expect_counts(s, {3, 3, 0, 0, 2, 4, 0});
  EXPECT_EQ(words(s, &Layout::non_spec_query_start_loc, 4), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataClassification, ZeroLengthPaddingCountedInNeither) {
  // With spec rows: the zero-length rows stay non-spec rows with 0 tokens.
  Step s = make_step({{3, 2}, {0, -1}, {3, 2}, {0, -1}}, 2);
  build(s);
  expect_counts(s, {0, 0, 0, 0, 2, 6, 2});
  EXPECT_EQ(s.header(kNumNonSpecRows), 2);
  EXPECT_EQ(words(s, &Layout::non_spec_query_start_loc, 3), (std::vector<int32_t>{0, 0, 0}));
  // Without spec rows: decodes and a prefill, the padding counted in neither.
  s = make_step({{1, -1}, {4, -1}, {0, -1}, {1, -1}, {0, -1}}, 2);
  build(s);
  expect_counts(s, {1, 4, 2, 2, 0, 0, 2});
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataClassification, AllZeroDraftsIsNotASpecStep) {
  Step s = make_step({{1, 0}, {1, 0}, {1, -1}}, 2);
  build(s);
  expect_counts(s, {0, 0, 3, 3, 0, 0, 0});
  EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 3), (std::vector<int>{0, 0, 0}));
  // A zero-draft row in a step where another row has drafts is a spec row.
  s = make_step({{1, 0}, {3, 2}}, 2);
  build(s);
  expect_counts(s, {0, 0, 0, 0, 2, 4, 0});
}

// ---- fields -----------------------------------------------------------------------------------

TEST(MetadataFields, AcceptedSourceColumnAndInitialState) {
  Step s = make_step({{3, 2}, {6, -1}, {2, 1}, {1, -1}}, 2);
  s.num_accepted_tokens = {3, 1, 2, 1};
  s.num_computed_tokens = {4, 0, 9, 7};
  build(s);
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 2), (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(words(s, &Layout::spec_source_column, 2), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(bytes(s, &Layout::has_initial_state, 2), (std::vector<int>{0, 1}));
  // Without num_computed_tokens the context is seq_lens - query length.
  s.with_computed = false;
  s.seq_lens = {7, 6, 11, 8};
  s.allocate();
  build(s);
  EXPECT_EQ(bytes(s, &Layout::has_initial_state, 2), (std::vector<int>{0, 1}));
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataFields, StateRowsModeNone) {
  Step s = make_step({{2, 1}, {5, -1}, {2, 1}}, 2, /*G=*/3);
  EXPECT_EQ(build(s), 0);
  const int64_t S = 3, R = s.max_rows;
  for (int g = 0; g < 3; ++g) {
    const int32_t base = 100000 * (g + 1);
    for (int c = 0; c < S; ++c) {
      EXPECT_EQ(s.spec_out[size_t(g * R * S + 0 * S + c)], base + 0 + c);    // request 0
      EXPECT_EQ(s.spec_out[size_t(g * R * S + 1 * S + c)], base + 200 + c);  // request 2
    }
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 0)], base + 100);  // request 1, column 0
    // Rows past those written are untouched.
    EXPECT_EQ(s.spec_out[size_t(g * R * S + 2 * S)], kPoison);
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 1)], kPoison);
  }
}

TEST(MetadataFields, StateRowsModeAlign) {
  Step s = make_step({{2, 1}, {1, -1}, {2, 1}}, 1, /*G=*/2);
  s.mode = CacheMode::kAlign;
  s.block_size = 4;
  s.seq_lens = {1, 9, 13};  // starts 0, 2, 3
  s.with_computed = true;
  s.make_tables(2, s.max_rows, 6);
  s.allocate();
  EXPECT_EQ(build(s), 0);
  const int64_t S = 2, R = s.max_rows;
  for (int g = 0; g < 2; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(s.spec_out[size_t(g * R * S + 0)], base + 0);
    EXPECT_EQ(s.spec_out[size_t(g * R * S + 1)], base + 1);
    EXPECT_EQ(s.spec_out[size_t(g * R * S + 2)], base + 203);
    EXPECT_EQ(s.spec_out[size_t(g * R * S + 3)], base + 204);
    EXPECT_EQ(s.non_spec_out[size_t(g * R)], base + 102);
  }
  EXPECT_EQ(s.header(kMaxColumnEnd), 5);
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataFields, SeqLenZeroStartsAtColumnZero) {
  Step s = make_step({{0, -1}}, 1);
  s.mode = CacheMode::kAlign;
  s.block_size = 4;
  s.seq_lens = {0};
  s.num_computed_tokens = {0};
  EXPECT_EQ(build(s), 0);
  EXPECT_EQ(s.non_spec_out[0], 100000);
}

// ---- graph padding ----------------------------------------------------------------------------

TEST(MetadataPadding, PaddedRowsFollowTheContract) {
  for (int32_t pad_id : {0, -1}) {
    Step s = make_step({{3, 2}, {2, 1}, {3, 2}}, 2, /*G=*/2);
    s.num_accepted_tokens = {2, 3, 1};
    s.padded_rows = 6;
    s.pad_id = pad_id;
    s.allocate();
    EXPECT_EQ(build(s), 0);
    const int64_t S = 3, R = s.max_rows;
    EXPECT_EQ(s.header(kSpecRowsWritten), 6);
    EXPECT_EQ(s.header(kMaskRowsWritten), 6);
    EXPECT_EQ(words(s, &Layout::spec_query_start_loc, 7),
              (std::vector<int32_t>{0, 3, 5, 8, 8, 8, 8}));
    EXPECT_EQ(words(s, &Layout::spec_num_accepted, 6), (std::vector<int32_t>{2, 3, 1, 1, 1, 1}));
    EXPECT_EQ(words(s, &Layout::spec_source_column, 6), (std::vector<int32_t>{1, 2, 0, 0, 0, 0}));
    EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 6), (std::vector<int>{1, 1, 1, 0, 0, 0}));
    for (int g = 0; g < 2; ++g) {
      for (int64_t j = 3; j < 6; ++j) {
        for (int64_t c = 0; c < S; ++c) EXPECT_EQ(s.spec_out[size_t((g * R + j) * S + c)], pad_id);
        EXPECT_EQ(s.non_spec_out[size_t(g * R + j)], pad_id);
      }
      EXPECT_EQ(s.spec_out[size_t((g * R + 6) * S)], kPoison);  // beyond padded_rows: untouched
    }
    EXPECT_TRUE(shadow(s).ok());
  }
}

TEST(MetadataPadding, ReplayWithNewInputsGivesTheNewRows) {
  // The same buffers and launch_rows serve two steps with different live counts (graph replay).
  Step s = make_step({{3, 2}, {3, 2}, {3, 2}, {3, 2}}, 2, /*G=*/3);
  s.padded_rows = 6;
  s.allocate();
  Params p = s.params();
  p.launch_rows = 6;
  ASSERT_TRUE(plan(p).is_ok());
  ASSERT_TRUE(run_state_rows_cpu(p).is_ok());
  EXPECT_TRUE(shadow(s).ok());
  // Second step: two requests, others padded.
  Step t = make_step({{2, 1}, {3, 2}}, 2, /*G=*/3);
  t.padded_rows = 6;
  t.max_rows = s.max_rows;
  t.max_tokens = s.max_tokens;
  t.tables = s.tables;
  t.plan = s.plan;
  t.spec_out = s.spec_out;
  t.non_spec_out = s.non_spec_out;
  Params q = t.params();
  q.launch_rows = 6;
  ASSERT_TRUE(plan(q).is_ok());
  ASSERT_TRUE(run_state_rows_cpu(q).is_ok());
  const ShadowReport r = shadow(t);
  EXPECT_TRUE(r.ok()) << r.message;
}

// ---- bounds -----------------------------------------------------------------------------------

TEST(MetadataBounds, ColumnsPastTheTableArePaddedAndCounted) {
  Step s = make_step({{3, 2}, {3, 2}, {1, -1}}, 2, /*G=*/2);
  s.mode = CacheMode::kAlign;
  s.block_size = 2;
  s.seq_lens = {3, 9, 20};  // starts 1, 4 and 9
  s.pad_id = -1;
  s.make_tables(2, s.max_rows, 6);
  // Group 1's table is narrower: request 0 still fits, request 1 does not.
  s.table_cols[1] = 4;
  s.allocate();
  const int64_t errors = build(s);
  // Group 0: request 1 needs columns 4..6 (width 6) -> padded; the non-spec row needs column 9.
  // Group 1: the same two rows.
  EXPECT_EQ(errors, 4);
  EXPECT_EQ(s.error_count, 4);
  const int64_t S = 3, R = s.max_rows;
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(s.spec_out[size_t((g * R + 0) * S)], 100000 * (g + 1) + 1);
    for (int c = 0; c < S; ++c) EXPECT_EQ(s.spec_out[size_t((g * R + 1) * S + c)], -1);
    EXPECT_EQ(s.non_spec_out[size_t(g * R)], -1);
  }
  EXPECT_EQ(s.header(kMaxColumnEnd), 10);
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataBounds, ManySpecColumnsNeverReadPastTheTable) {
  // vLLM #42084: align mode with num_spec >= 10 read past the table. S = 16, a table one column
  // short for every row: everything is padded, nothing outside the table is touched (the guard
  // columns past cols hold poison and would show up in the output if read).
  Step s = make_step({{16, 15}, {16, 15}}, 15, /*G=*/1);
  s.mode = CacheMode::kAlign;
  s.block_size = 64;
  s.seq_lens = {100, 40};  // starts 1 and 0
  s.make_tables(1, s.max_rows, 16, /*extra_stride=*/8);
  s.allocate();
  EXPECT_EQ(build(s), 1);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(s.spec_out[size_t(c)], 0);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(s.spec_out[size_t(16 + c)], 100100 + c);
}

TEST(MetadataBounds, TableWithFewerRowsThanRequests) {
  Step s = make_step({{1, -1}, {1, -1}, {1, -1}}, 1);
  s.table_rows[0] = 2;
  s.allocate();
  EXPECT_EQ(build(s), 1);
  EXPECT_EQ(s.non_spec_out[2], 0);
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataBounds, LaunchRowsSmallerThanThePlanIsReported) {
  Step s = make_step({{2, 1}, {2, 1}, {2, 1}}, 1);
  s.padded_rows = 5;
  s.allocate();
  Params p = s.params();
  ASSERT_TRUE(plan(p).is_ok());
  p.launch_rows = 4;  // the plan writes 5 spec and 5 non-spec rows
  int64_t errors = 0;
  ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
  EXPECT_EQ(errors, 2);
  EXPECT_EQ(s.spec_out[size_t(4 * 2)], kPoison);
}

TEST(MetadataBounds, GatheredAcceptedCountsAreCheckedPerRow) {
  // The pass (as on the device) gathers accepted counts; bad ones are copied and counted.
  Step s = make_step({{2, 1}, {2, 1}, {2, 1}}, 1);
  s.with_accepted = false;
  s.padded_rows = 4;
  s.allocate();
  Params p = s.params();
  ASSERT_TRUE(plan(p).is_ok());
  std::vector<int32_t> acc = {2, 0, 1};
  p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {3});
  int64_t errors = 0;
  ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
  EXPECT_EQ(errors, 1);
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 4), (std::vector<int32_t>{2, 0, 1, 1}));
  EXPECT_EQ(words(s, &Layout::spec_source_column, 4), (std::vector<int32_t>{1, -1, 0, 0}));
  acc.pop_back();  // request 2 outside the array: counted, accepted 1
  p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {2});
  ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
  EXPECT_EQ(errors, 2);
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 3), (std::vector<int32_t>{2, 0, 1}));
}

// ---- argument errors: named, and nothing written ----------------------------------------------

void expect_plan_error(Step& s, const std::string& needle) {
  s.allocate();
  Params p = s.params();
  const Status st = plan(p);
  ASSERT_FALSE(st.is_ok()) << "expected an error mentioning " << needle;
  EXPECT_NE(st.reason().find(needle), std::string::npos) << st.reason();
  for (int32_t w : s.plan) ASSERT_EQ(w, kPoison) << "the plan wrote before failing";
}

TEST(MetadataErrors, BadInputsAreNamedAndNothingIsWritten) {
  Step s = make_step({{3, 2}, {1, -1}}, 2);
  s.query_start_loc[0] = 1;
  expect_plan_error(s, "query_start_loc[0]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.query_start_loc = {0, 3, 2};
  expect_plan_error(s, "decreases at request 1");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_draft_tokens[0] = 3;
  expect_plan_error(s, "num_draft_tokens[0]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_draft_tokens[1] = -2;
  expect_plan_error(s, "num_draft_tokens[1]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_accepted_tokens[0] = 4;
  expect_plan_error(s, "num_accepted_tokens[0]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_accepted_tokens[0] = 0;
  expect_plan_error(s, "num_accepted_tokens[0]");
  s = make_step({{4, 2}, {1, -1}}, 2);
  expect_plan_error(s, "has 4 tokens but S");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.seq_lens[1] = -1;
  expect_plan_error(s, "seq_lens[1]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.with_computed = false;
  s.seq_lens[0] = 2;
  expect_plan_error(s, "seq_lens[0]");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.padded_rows = 1;
  expect_plan_error(s, "padded_rows");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.max_tokens = 3;
  expect_plan_error(s, "max_tokens");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_draft_tokens.pop_back();
  expect_plan_error(s, "num_draft_tokens");
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.mode = CacheMode::kAlign;
  s.block_size = 0;
  expect_plan_error(s, "block_size");
}

TEST(MetadataErrors, BuffersAndTablesAreChecked) {
  Step s = make_step({{3, 2}, {1, -1}}, 2, 2);
  Params p = s.params();
  p.plan.shape[0] -= 1;
  EXPECT_NE(plan(p).reason().find("plan holds"), std::string::npos);
  p = s.params();
  p.max_rows = 1;
  EXPECT_NE(plan(p).reason().find("max_rows"), std::string::npos);
  p = s.params();
  p.block_tables[1].dtype = DType::kInt64;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("block_tables[1]"), std::string::npos);
  p = s.params();
  p.block_tables[0].strides[1] = 2;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("block_tables[0]"), std::string::npos);
  p = s.params();
  p.spec_state_indices.shape[2] = 2;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("spec_state_indices"), std::string::npos);
  p = s.params();
  p.num_groups = 9;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("num_groups"), std::string::npos);
  p = s.params();
  p.block_tables[0].device = {DeviceType::kCUDA, 0};
  EXPECT_NE(run_state_rows_cpu(p).reason().find("block_tables[0] is on cuda:0"), std::string::npos);
  p = s.params();
  p.seq_lens.device = {DeviceType::kCUDA, 0};
  EXPECT_NE(plan(p).reason().find("seq_lens must be a host array"), std::string::npos);
}

TEST(MetadataLayout, RegionsAreAlignedAndDisjoint) {
  for (int64_t R : {1, 3, 8, 1000})
    for (int64_t T : {0, 5, 4096}) {
      const Layout l = Layout::make(R, T);
      const std::vector<std::pair<int64_t, int64_t>> regions = {
          {l.header, kHeaderWords},
          {l.spec_request, R},
          {l.spec_start, R},
          {l.non_spec_request, R},
          {l.non_spec_start, R},
          {l.spec_query_start_loc, R + 1},
          {l.non_spec_query_start_loc, R + 1},
          {l.spec_num_accepted, R},
          {l.spec_source_column, R},
          {l.token_split, T},
          {l.spec_sequence_masks, (R + 3) / 4},
          {l.has_initial_state, (R + 3) / 4}};
      int64_t end = 0;
      for (auto [offset, words] : regions) {
        EXPECT_EQ(offset % 4, 0);
        EXPECT_GE(offset, end);
        end = offset + words;
      }
      EXPECT_LE(end, l.total_words);
    }
}

// ---- shared + fused against per-group builds --------------------------------------------------

TEST(MetadataShadow, RandomStepsMatchPerGroupBuilds) {
  std::mt19937_64 rng(1234);
  int checked = 0;
  for (int G = 1; G <= 6; ++G)
    for (int64_t S : {1, 2, 3, 5, 9, 16})
      for (CacheMode mode : {CacheMode::kNone, CacheMode::kAlign})
        for (bool padded : {false, true})
          for (int rep = 0; rep < 3; ++rep) {
            Step s = random_step(rng, G, S, mode, padded);
            Params p = s.params();
            const Status st = plan(p);
            ASSERT_TRUE(st.is_ok()) << st.reason();
            int64_t errors = 0;
            ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
            const ShadowReport r = shadow(s);
            ASSERT_TRUE(r.ok()) << "G=" << G << " S=" << S << ": " << r.message;
            // The error count equals the per-group builds' unreadable rows.
            int64_t unreadable = 0;
            for (int g = 0; g < G; ++g) {
              GroupMetadata m;
              ASSERT_TRUE(build_group_reference(p, g, &m).is_ok());
              unreadable += m.unreadable_rows;
            }
            EXPECT_EQ(errors, unreadable);
            ++checked;
          }
  EXPECT_EQ(checked, 6 * 6 * 2 * 2 * 3);
}

// Poisons every word the step does not write (per the per-group build's ranges).
void poison_unused(Step& s, std::mt19937_64& rng) {
  Params p = s.params();
  GroupMetadata m;
  ASSERT_TRUE(build_group_reference(p, 0, &m).is_ok());
  const Layout l = Layout::make(s.max_rows, s.max_tokens);
  const int64_t spec_w = m.header[kSpecRowsWritten], ns_w = m.header[kNonSpecRowsWritten];
  const int64_t tokens = m.header[kNumActualTokens], S = s.S();
  std::vector<bool> used(s.plan.size(), false);
  auto mark = [&](int64_t at, int64_t n) {
    for (int64_t k = 0; k < n; ++k) used[size_t(at + k)] = true;
  };
  mark(l.header, kHeaderWords);
  for (auto off : {l.spec_request, l.spec_start, l.spec_num_accepted, l.spec_source_column})
    mark(off, spec_w);
  for (auto off : {l.non_spec_request, l.non_spec_start}) mark(off, ns_w);
  mark(l.spec_query_start_loc, spec_w + 1);
  mark(l.non_spec_query_start_loc, ns_w + 1);
  mark(l.token_split, tokens);
  auto* plan_bytes = reinterpret_cast<uint8_t*>(s.plan.data());
  std::uniform_int_distribution<int32_t> any(INT32_MIN, INT32_MAX);
  for (size_t k = 0; k < s.plan.size(); ++k)
    if (!used[k] && (int64_t(k) < l.spec_sequence_masks)) s.plan[k] = any(rng);
  // Bool regions: poison bytes past the written rows.
  for (int64_t b = m.header[kMaskRowsWritten]; b < 4 * Layout::bool_words(s.max_rows); ++b)
    plan_bytes[l.spec_sequence_masks * 4 + b] = uint8_t(any(rng));
  for (int64_t b = ns_w; b < 4 * Layout::bool_words(s.max_rows); ++b)
    plan_bytes[l.has_initial_state * 4 + b] = uint8_t(any(rng));
  for (int g = 0; g < s.G(); ++g) {
    for (int64_t j = spec_w; j < s.max_rows; ++j)
      for (int64_t c = 0; c < S; ++c) s.spec_out[size_t((g * s.max_rows + j) * S + c)] = any(rng);
    for (int64_t j = ns_w; j < s.max_rows; ++j)
      s.non_spec_out[size_t(g * s.max_rows + j)] = any(rng);
  }
}

TEST(MetadataShadow, PoisonedUnusedRowsDoNotChangeTheVerdict) {
  std::mt19937_64 rng(99);
  for (int rep = 0; rep < 40; ++rep) {
    Step s = random_step(rng, 1 + rep % 6, 1 + rep % 9,
                         rep % 2 ? CacheMode::kAlign : CacheMode::kNone, rep % 3 != 0);
    build(s);
    ASSERT_TRUE(shadow(s).ok());
    poison_unused(s, rng);
    const ShadowReport r = shadow(s);
    ASSERT_TRUE(r.ok()) << r.message;
  }
}

TEST(MetadataShadow, InjectedMismatchIsNamed) {
  Step s = make_step({{3, 2}, {5, -1}, {2, 1}}, 2, /*G=*/3);
  s.padded_rows = 5;
  s.allocate();
  build(s);
  ASSERT_TRUE(shadow(s).ok());
  const int64_t S = 3, R = s.max_rows;
  const Layout l = Layout::make(s.max_rows, s.max_tokens);
  std::mt19937_64 rng(5);

  // A state id of group 2, row 1, column 2.
  s.spec_out[size_t((2 * R + 1) * S + 2)] += 1;
  ShadowReport r = shadow(s);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.message.find("group 2, field spec_state_indices, row 1, column 2"), std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("shared/fused = 300203, per-group = 300202"), std::string::npos)
      << r.message;
  // The same verdict with the unused rows poisoned.
  poison_unused(s, rng);
  ShadowReport r2 = shadow(s);
  EXPECT_EQ(r2.message, r.message);
  s.spec_out[size_t((2 * R + 1) * S + 2)] -= 1;
  ASSERT_TRUE(shadow(s).ok());

  // A padded row (inside padded_rows) must hold the pad id.
  s.non_spec_out[size_t(1 * R + 3)] = 42;
  r = shadow(s);
  EXPECT_NE(r.message.find("group 1, field non_spec_state_indices, row 3"), std::string::npos)
      << r.message;
  s.non_spec_out[size_t(1 * R + 3)] = 0;

  // Shared fields.
  s.plan[size_t(l.spec_query_start_loc + 4)] = 1;
  r = shadow(s);
  EXPECT_NE(r.message.find("field spec_query_start_loc, row 4: shared/fused = 1, per-group = 5"),
            std::string::npos)
      << r.message;
  s.plan[size_t(l.spec_query_start_loc + 4)] = 5;
  s.plan[size_t(l.header + kNumDecodes)] = 1;
  r = shadow(s);
  EXPECT_NE(r.message.find("field header.num_decodes"), std::string::npos) << r.message;
  s.plan[size_t(l.header + kNumDecodes)] = 0;
  reinterpret_cast<uint8_t*>(s.plan.data() + l.spec_sequence_masks)[4] = 1;
  r = shadow(s);
  EXPECT_NE(r.message.find("field spec_sequence_masks, row 4"), std::string::npos) << r.message;
  reinterpret_cast<uint8_t*>(s.plan.data() + l.spec_sequence_masks)[4] = 0;
  // Token split: non-spec tokens 3..7, then spec tokens 0, 1, 2, 8, 9.
  s.plan[size_t(l.token_split + 5)] = 7;
  r = shadow(s);
  EXPECT_NE(r.message.find("field spec_token_indx, row 0: shared/fused = 7, per-group = 0"),
            std::string::npos)
      << r.message;
  s.plan[size_t(l.token_split + 5)] = 0;
  ASSERT_TRUE(shadow(s).ok()) << shadow(s).message;
}

}  // namespace
}  // namespace gdn::metadata
