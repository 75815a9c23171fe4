// Metadata builder on the host: classification (the cases of vLLM's GDN builder tests, vLLM's
// decode/prefill counts), every shared field on hand-checked steps, state rows (destination and
// source) in both cache modes, graph padding, bounds, argument errors, the shared + fused result
// against the tests' own vLLM-semantics reference and against independent per-group builds (the
// shadow check) on random steps, including an injected mismatch and poisoned unused rows.
#include <gtest/gtest.h>

#include <algorithm>
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
using testing::vllm_expected;

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

// Sets `word` to `bad`, expects the shadow check to name `what`, then puts the old value back (one
// injected mismatch at a time).
template <class T>
void expect_shadow_names(Step& s, T& word, T bad, const std::string& what) {
  const T good = word;
  word = bad;
  const ShadowReport r = shadow(s);
  EXPECT_NE(r.message.find(what), std::string::npos) << r.message;
  word = good;
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

TEST(MetadataClassification, ZeroLengthRowsWithSpecRowsAreInNeitherCount) {
  // With spec rows: the zero-length rows stay non-spec rows with 0 tokens.
  Step s = make_step({{3, 2}, {0, -1}, {3, 2}, {0, -1}}, 2);
  build(s);
  expect_counts(s, {0, 0, 0, 0, 2, 6, 2});
  EXPECT_EQ(s.header(kNumNonSpecRows), 2);
  EXPECT_EQ(words(s, &Layout::non_spec_query_start_loc, 3), (std::vector<int32_t>{0, 0, 0}));
  EXPECT_TRUE(shadow(s).ok());
}

// Without spec rows, vLLM's split_decodes_and_prefills(threshold 1, short extends as prefills):
// the decodes are the leading run of rows with <= 1 token and a computed prefix; the prefills run
// from the first other row to the last row with a token (trailing zero-length rows: neither).
TEST(MetadataClassification, WithoutSpecRowsDecodesAreTheLeadingRun) {
  // The example: a 1-token row after a 2-token row is a prefill.
  Step s = make_step({{2, -1}, {1, -1}}, 2);
  build(s);
  expect_counts(s, {2, 3, 0, 0, 0, 0, 0});
  // Zero-length rows inside the run count as decodes, between prefills as prefills, after the
  // last row with a token in neither count.
  s = make_step({{0, -1}, {1, -1}, {0, -1}, {4, -1}, {1, -1}, {0, -1}}, 2);
  build(s);
  expect_counts(s, {2, 5, 3, 1, 0, 0, 3});
  EXPECT_TRUE(shadow(s).ok());
  s = make_step({{1, -1}, {4, -1}, {0, -1}, {1, -1}, {0, -1}}, 2);
  build(s);
  expect_counts(s, {3, 5, 1, 1, 0, 0, 2});
  // Only rows of <= 1 token: all decodes, zero-length ones included.
  s = make_step({{1, -1}, {0, -1}, {1, -1}}, 2);
  build(s);
  expect_counts(s, {0, 0, 3, 2, 0, 0, 1});
  // A leading prefill: no decodes at all.
  s = make_step({{5, -1}, {1, -1}, {1, -1}}, 2);
  s.with_drafts = false;
  build(s);
  expect_counts(s, {3, 7, 0, 0, 0, 0, 0});
  // Zero-draft rows are spec rows: the other rows are prefills.
  s = make_step({{1, 0}, {3, -1}, {1, 0}}, 2);
  build(s);
  expect_counts(s, {1, 3, 0, 0, 2, 2, 0});
  EXPECT_TRUE(shadow(s).ok());
}

// vLLM 0.33.0: seq_lens [100, 1], query lengths [1, 1], request 1 new. A row without a computed
// prefix is a prefill (the leading run stops there), has no initial state and reads no slot: its
// source is the pad id, whatever a finished request left in its block.
TEST(MetadataClassification, AFreshOneTokenPromptIsAPrefillAndReadsNoSlot) {
  for (const int padding : {0, 2}) {
    std::vector<std::pair<int32_t, int32_t>> rows = {{1, -1}, {1, -1}};
    for (int k = 0; k < padding; ++k) rows.push_back({0, -1});
    Step s = make_step(rows, 2, /*G=*/2);
    s.num_computed_tokens = std::vector<int32_t>(rows.size(), 0);
    s.num_computed_tokens[0] = 99;
    for (size_t i = 0; i < rows.size(); ++i)
      s.seq_lens[i] = s.num_computed_tokens[i] + rows[i].first;
    s.num_accepted_tokens = std::vector<int32_t>(rows.size(), 1);
    s.num_accepted_tokens[0] = 2;
    s.num_accepted_tokens[1] = 3;  // what a previous occupant of the row accepted
    s.pad_id = -1;
    s.allocate();
    EXPECT_EQ(build(s), 0);
    expect_counts(s, {1, 1, 1, 1, 0, 0, padding});
    EXPECT_EQ(bytes(s, &Layout::has_initial_state, 2), (std::vector<int>{1, 0}));
    const int64_t R = s.max_rows;
    for (int g = 0; g < 2; ++g) {
      const int32_t base = 100000 * (g + 1);
      EXPECT_EQ(s.non_spec_src_out[size_t(g * R)], base + 1);    // request 0, column 1
      EXPECT_EQ(s.non_spec_out[size_t(g * R + 1)], base + 100);  // request 1 writes column 0
      EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 1)], -1);      // and reads no slot
    }
    EXPECT_TRUE(shadow(s).ok());
  }
}

// vLLM 0.33.0: seq_lens [10, 20, 0, 16], query lengths [1, 5, 0, 0]: the trailing zero-length
// rows are padding, in neither count; the token counts are unchanged.
TEST(MetadataClassification, TrailingPaddingRowsAreInNeitherCount) {
  Step s = make_step({{1, -1}, {5, -1}, {0, -1}, {0, -1}}, 2);
  s.with_computed = false;
  s.seq_lens = {10, 20, 0, 16};
  s.allocate();
  build(s);
  expect_counts(s, {1, 5, 1, 1, 0, 0, 2});
  EXPECT_EQ(s.header(kNumNonSpecRows), 4);
  EXPECT_TRUE(shadow(s).ok());
}

// vLLM 0.33.0: drafts [0, 0], accepted [3, 1], num_spec 3: both rows stay spec rows (the only
// path that reads column acc - 1).
TEST(MetadataClassification, AllZeroDraftsKeepTheirSpecRows) {
  Step s = make_step({{1, 0}, {1, 0}}, 3);
  s.num_accepted_tokens = {3, 1};
  s.allocate();
  build(s);
  expect_counts(s, {0, 0, 0, 0, 2, 2, 0});
  EXPECT_EQ(s.header(kNumNonSpecRows), 0);
  EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 2), (std::vector<int>{1, 1}));
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 2), (std::vector<int32_t>{3, 1}));
  EXPECT_TRUE(shadow(s).ok());
  s = make_step({{1, 0}, {1, 0}, {1, -1}}, 2);
  build(s);
  expect_counts(s, {1, 1, 0, 0, 2, 2, 0});
  EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 3), (std::vector<int>{1, 1, 0}));
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

// metadata.md §2.1: a non-spec row reads its state from column start + acc - 1 and writes column
// start. Table [[11, 12, 13]], num_spec 2, no drafts, accepted [3].
TEST(MetadataFields, NonSpecRowReadsWhereThePreviousStepLeftTheState) {
  Step s = make_step({{1, -1}}, 2);
  s.num_accepted_tokens = {3};
  s.tables = {{11, 12, 13}};
  s.table_rows = {1};
  s.table_cols = {3};
  s.table_stride = {3};
  s.allocate();
  EXPECT_EQ(build(s), 0);
  EXPECT_EQ(s.header(kNumSpecDecodes), 0);
  EXPECT_EQ(s.non_spec_out[0], 11);      // destination
  EXPECT_EQ(s.non_spec_src_out[0], 13);  // source
  EXPECT_EQ(words(s, &Layout::non_spec_source_column, 1), (std::vector<int32_t>{2}));
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataFields, SourceColumnsOfMixedStepsAndAlignMode) {
  // Spec rows, a zero-draft spec row, a decode, a prefill and a zero-length row; G = 2.
  Step s = make_step({{3, 2}, {1, -1}, {1, 0}, {6, -1}, {0, -1}}, 2, /*G=*/2);
  s.num_accepted_tokens = {2, 3, 2, 1, 2};
  s.allocate();
  EXPECT_EQ(build(s), 0);
  const int64_t R = s.max_rows;
  // Non-spec rows: requests 1, 3, 4 (the zero-draft row 2 is a spec row in this step).
  EXPECT_EQ(words(s, &Layout::non_spec_request, 3), (std::vector<int32_t>{1, 3, 4}));
  EXPECT_EQ(words(s, &Layout::non_spec_source_column, 3), (std::vector<int32_t>{2, 0, 1}));
  for (int g = 0; g < 2; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 0)], base + 100);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 0)], base + 102);
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 1)], base + 300);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 1)], base + 300);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 2)], base + 401);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 3)], kPoison);  // past the rows written
  }
  EXPECT_TRUE(shadow(s).ok());
  // Align mode: both columns are offset by the row's start block.
  s = make_step({{1, -1}, {2, 1}, {4, -1}}, 1, /*G=*/1);
  s.mode = CacheMode::kAlign;
  s.block_size = 4;
  s.seq_lens = {9, 6, 13};  // starts 2, 1, 3
  s.num_accepted_tokens = {2, 1, 2};
  s.make_tables(1, s.max_rows, 6);
  s.allocate();
  EXPECT_EQ(build(s), 0);
  EXPECT_EQ(s.non_spec_out[0], 100000 + 2);
  EXPECT_EQ(s.non_spec_src_out[0], 100000 + 3);
  EXPECT_EQ(s.non_spec_out[1], 100000 + 203);
  EXPECT_EQ(s.non_spec_src_out[1], 100000 + 204);
  EXPECT_TRUE(shadow(s).ok());
  // Without the source output the destinations are the same.
  Step t = s;
  t.with_source = false;
  t.allocate();
  EXPECT_EQ(build(t), 0);
  EXPECT_EQ(t.non_spec_out, s.non_spec_out);
  EXPECT_EQ(t.non_spec_src_out[0], kPoison);
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
    EXPECT_EQ(words(s, &Layout::non_spec_source_column, 6), (std::vector<int32_t>(6, 0)));
    EXPECT_EQ(bytes(s, &Layout::spec_sequence_masks, 6), (std::vector<int>{1, 1, 1, 0, 0, 0}));
    for (int g = 0; g < 2; ++g) {
      for (int64_t j = 3; j < 6; ++j) {
        for (int64_t c = 0; c < S; ++c) EXPECT_EQ(s.spec_out[size_t((g * R + j) * S + c)], pad_id);
        EXPECT_EQ(s.non_spec_out[size_t(g * R + j)], pad_id);
        EXPECT_EQ(s.non_spec_src_out[size_t(g * R + j)], pad_id);
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
  EXPECT_EQ(s.header(kMaxColumnEnd), 12);  // the non-spec row at start 9 may read S columns
  EXPECT_TRUE(shadow(s).ok());
}

TEST(MetadataBounds, SourceColumnPastTheTablePadsTheWholeRow) {
  // A 2-column table: acc 3 puts the source at column 2, which does not exist. The row gets the
  // pad id for both fields (the guard columns past cols hold poison: never read) and is counted
  // once per group; acc 2 still fits.
  Step s = make_step({{1, -1}, {1, -1}}, 2, /*G=*/2);
  s.num_accepted_tokens = {3, 2};
  s.pad_id = -1;
  s.make_tables(2, s.max_rows, 2, /*extra_stride=*/4);
  s.allocate();
  EXPECT_EQ(build(s), 2);
  const int64_t R = s.max_rows;
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(s.non_spec_out[size_t(g * R)], -1);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R)], -1);
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 1)], 100000 * (g + 1) + 100);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 1)], 100000 * (g + 1) + 101);
  }
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

TEST(MetadataBounds, GatheredCountsOfNonSpecRowsPadBadRows) {
  // Non-spec rows gather their counts too: a bad one pads the row in every group and is counted.
  Step s = make_step({{1, -1}, {4, -1}, {1, -1}}, 2, /*G=*/2);
  s.with_accepted = false;
  s.allocate();
  Params p = s.params();
  ASSERT_TRUE(plan(p).is_ok());
  std::vector<int32_t> acc = {3, 4, 2};  // 4 > S
  p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {3});
  int64_t errors = 0;
  ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
  EXPECT_EQ(errors, 2);
  EXPECT_EQ(words(s, &Layout::non_spec_source_column, 3), (std::vector<int32_t>{2, 3, 1}));
  const int64_t R = s.max_rows;
  for (int g = 0; g < 2; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 0)], base + 2);
    EXPECT_EQ(s.non_spec_out[size_t(g * R + 1)], 0);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 1)], 0);
    EXPECT_EQ(s.non_spec_src_out[size_t(g * R + 2)], base + 201);
  }
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
  s = make_step({{3, 2}, {1, -1}}, 2);
  s.num_accepted_tokens[1] = 4;  // every row's count is checked, not only spec rows'
  expect_plan_error(s, "num_accepted_tokens[1] = 4 is outside [1, S = 3]");
  s = make_step({{1, -1}, {2, -1}}, 1);
  s.num_accepted_tokens[1] = 0;
  expect_plan_error(s, "num_accepted_tokens[1]");
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
  p.non_spec_source_indices.shape[1] = 1;  // a contiguous [G, 1]: fewer rows than the pass writes
  p.non_spec_source_indices.strides[0] = 1;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("non_spec_source_indices has 1 rows"),
            std::string::npos);
  p = s.params();
  p.non_spec_source_indices.dtype = DType::kInt64;
  EXPECT_NE(run_state_rows_cpu(p).reason().find("non_spec_source_indices"), std::string::npos);
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
          {l.non_spec_source_column, R},
          {l.replay_counts, R},
          {l.non_spec_replay_counts, R},
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

// The tests' own reference of vLLM's semantics (metadata_case.hpp) on fresh random steps with
// poisoned outputs: counts, every non-spec row's destination and source, every spec row, and
// nothing written past the rows of the step.
TEST(MetadataVllm, RandomStepsMatchTheVllmReference) {
  std::mt19937_64 rng(4321);
  int with_spec = 0, without_spec = 0, sources_differ = 0, fresh = 0;
  for (int rep = 0; rep < 600; ++rep) {
    const int G = 1 + rep % 4;
    const int64_t S = 1 + (rep / 4) % 6;
    Step s = random_step(rng, G, S, rep % 3 ? CacheMode::kNone : CacheMode::kAlign, rep % 2);
    s.with_accepted = rep % 7 != 0;
    s.allocate();  // every output poisoned
    const testing::VllmExpected e = vllm_expected(s);
    const int64_t errors = build(s);
    ASSERT_EQ(s.header(kNumDecodes), e.num_decodes) << rep;
    ASSERT_EQ(s.header(kNumDecodeTokens), e.num_decode_tokens) << rep;
    ASSERT_EQ(s.header(kNumPrefills), e.num_prefills) << rep;
    ASSERT_EQ(s.header(kNumPrefillTokens), e.num_prefill_tokens) << rep;
    ASSERT_EQ(s.header(kNumSpecDecodes), e.num_spec_decodes) << rep;
    ASSERT_EQ(s.header(kNumSpecDecodeTokens), e.num_spec_decode_tokens) << rep;
    ASSERT_EQ(errors, e.unreadable) << rep;
    const int64_t R = s.max_rows;
    for (int g = 0; g < G; ++g) {
      for (int64_t j = 0; j < R; ++j) {
        const size_t k = size_t(g * R + j);
        const bool written = j < e.rows_written;
        ASSERT_EQ(s.non_spec_out[k], written ? e.destination[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
        ASSERT_EQ(s.non_spec_src_out[k], written ? e.source[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
        if (written) sources_differ += s.non_spec_out[k] != s.non_spec_src_out[k];
      }
      for (int64_t k = 0; k < R * S; ++k)
        ASSERT_EQ(s.spec_out[size_t(g * R * S + k)],
                  k < e.spec_rows_written * S ? e.spec[size_t(g)][size_t(k)] : kPoison)
            << rep << " group " << g << " element " << k;
    }
    (e.num_spec_decodes ? with_spec : without_spec) += 1;
    for (int v : bytes(s, &Layout::has_initial_state, s.header(kNumNonSpecRows))) fresh += v == 0;
  }
  // The random steps cover both count rules, rows whose source is not their destination and
  // fresh rows (no initial state, no source).
  EXPECT_GT(with_spec, 100);
  EXPECT_GT(without_spec, 100);
  EXPECT_GT(sources_differ, 100);
  EXPECT_GT(fresh, 100);
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
  for (auto off : {l.non_spec_request, l.non_spec_start, l.non_spec_source_column}) mark(off, ns_w);
  if (s.replay) {
    mark(l.replay_counts, spec_w);
    mark(l.non_spec_replay_counts, ns_w);
  }
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
    for (int64_t j = ns_w; j < s.max_rows; ++j) {
      s.non_spec_out[size_t(g * s.max_rows + j)] = any(rng);
      s.non_spec_src_out[size_t(g * s.max_rows + j)] = any(rng);
    }
    for (int64_t j = spec_w; j < s.max_rows; ++j)
      s.checkpoint_out[size_t(g * s.max_rows + j)] = any(rng);
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
  expect_shadow_names(s, s.non_spec_out[size_t(1 * R + 3)], 42,
                      "group 1, field non_spec_state_indices, row 3");

  // A source id (the field the issue added), and a padded row of it.
  int32_t& src0 = s.non_spec_src_out[size_t(2 * R + 0)];
  expect_shadow_names(s, src0, src0 + 5, "group 2, field non_spec_source_indices, row 0");
  expect_shadow_names(s, s.non_spec_src_out[size_t(0 * R + 4)], 9,
                      "group 0, field non_spec_source_indices, row 4");
  expect_shadow_names(s, s.plan[size_t(l.non_spec_source_column + 0)], 1,
                      "field non_spec_source_column, row 0: shared/fused = 1, per-group = 0");

  // Shared fields.
  expect_shadow_names(s, s.plan[size_t(l.spec_query_start_loc + 4)], 1,
                      "field spec_query_start_loc, row 4: shared/fused = 1, per-group = 5");
  expect_shadow_names(s, s.plan[size_t(l.header + kNumDecodes)], 1, "field header.num_decodes");
  expect_shadow_names(s, reinterpret_cast<uint8_t*>(s.plan.data() + l.spec_sequence_masks)[4],
                      uint8_t(1), "field spec_sequence_masks, row 4");
  // Token split: non-spec tokens 3..7, then spec tokens 0, 1, 2, 8, 9.
  expect_shadow_names(s, s.plan[size_t(l.token_split + 5)], 7,
                      "field spec_token_indx, row 0: shared/fused = 7, per-group = 0");
  ASSERT_TRUE(shadow(s).ok()) << shadow(s).message;
}

// ---- the C++ builder (builder.hpp) on the CPU -------------------------------------------------

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::gdn::Status st_ = (expr);                          \
    ASSERT_TRUE(st_.is_ok()) << #expr << ": " << st_.reason(); \
  } while (0)

// The builder's buffers after a step against the tests' own vLLM reference of `s`.
void expect_builder_matches(const Builder& b, Step& s, const std::string& where) {
  const testing::VllmExpected e = vllm_expected(s);
  const int32_t* h = b.host_plan(b.last_slot()) + b.layout().header;
  EXPECT_EQ(h[kNumDecodes], e.num_decodes) << where;
  EXPECT_EQ(h[kNumDecodeTokens], e.num_decode_tokens) << where;
  EXPECT_EQ(h[kNumPrefills], e.num_prefills) << where;
  EXPECT_EQ(h[kNumPrefillTokens], e.num_prefill_tokens) << where;
  EXPECT_EQ(h[kNumSpecDecodes], e.num_spec_decodes) << where;
  EXPECT_EQ(b.last_errors(), e.unreadable) << where;
  const BuilderBuffers& buf = b.buffers();
  const int64_t R = s.max_rows, S = s.S();
  for (int g = 0; g < s.G(); ++g) {
    const int32_t* dst = buf.non_spec_state_indices.ptr<const int32_t>() + g * R;
    const int32_t* src = buf.non_spec_source_indices.ptr<const int32_t>() + g * R;
    for (int64_t j = 0; j < e.rows_written; ++j) {
      ASSERT_EQ(dst[j], e.destination[size_t(g)][size_t(j)])
          << where << " group " << g << " row " << j;
      ASSERT_EQ(src[j], e.source[size_t(g)][size_t(j)]) << where << " group " << g << " row " << j;
    }
    const int32_t* spec = buf.spec_state_indices.ptr<const int32_t>() + g * R * S;
    for (int64_t k = 0; k < e.spec_rows_written * S; ++k)
      ASSERT_EQ(spec[k], e.spec[size_t(g)][size_t(k)])
          << where << " group " << g << " element " << k;
    if (!s.replay) continue;
    const int32_t* ck = buf.checkpoint_indices.ptr<const int32_t>() + g * R;
    for (int64_t j = 0; j < e.spec_rows_written; ++j)
      ASSERT_EQ(ck[j], e.checkpoint[size_t(g)][size_t(j)])
          << where << " group " << g << " row " << j;
  }
  const int32_t* plan = b.host_plan(b.last_slot());
  const Layout& l = b.layout();
  auto plan_rows = [&](int64_t at, int64_t rows) {  // `rows` words of the plan from offset `at`
    return std::vector<int32_t>(plan + at, plan + at + rows);
  };
  if (s.replay) {
    EXPECT_EQ(plan_rows(l.replay_counts, e.spec_rows_written), e.replay_counts) << where;
    EXPECT_EQ(plan_rows(l.non_spec_replay_counts, e.rows_written), e.non_spec_replay_counts)
        << where;
  }
  EXPECT_EQ(plan_rows(l.spec_num_accepted, e.spec_rows_written), e.spec_accepted) << where;
  EXPECT_EQ(plan_rows(l.non_spec_source_column, e.rows_written), e.non_spec_source_column) << where;
}

// A base step whose tables and capacity a builder keeps for many steps.
Step builder_base(std::mt19937_64& rng, int G, int64_t S, CacheMode mode) {
  Step base = random_step(rng, G, S, mode, false);
  base.max_rows = 40;
  base.max_tokens = 40 * (S + 12);
  base.make_tables(G, 40, mode == CacheMode::kNone ? S + 1 : S + 6);
  base.allocate();
  return base;
}

TEST(MetadataBuilderCpu, StepsOnOneBuilderMatchTheReference) {
  std::mt19937_64 rng(31);
  int steps = 0;
  for (bool owned : {true, false})
    for (CacheMode mode : {CacheMode::kNone, CacheMode::kAlign}) {
      Step base = builder_base(rng, 1 + steps % 5, 2 + steps % 4, mode);
      BuilderConfig c = base.config();
      c.shadow = true;  // every step is also checked against per-group builds
      BuilderBuffers buffers;
      std::vector<int32_t> plan;
      if (!owned) buffers = base.caller_buffers(plan);
      Builder b;
      ASSERT_OK(owned ? b.initialize(c) : b.initialize(c, buffers));
      for (int k = 0; k < 30; ++k, ++steps) {
        Step s = random_step_on(rng, base, k % 2);
        ASSERT_OK(b.step(s.inputs()));
        expect_builder_matches(b, s, "step " + std::to_string(steps));
      }
      if (!owned) {
        EXPECT_EQ(b.buffers().spec_state_indices.data, base.spec_out.data());
      }
    }
  EXPECT_EQ(steps, 120);
}

TEST(MetadataBuilderCpu, PrepareThenLaunchEqualsStep) {
  std::mt19937_64 rng(32);
  Step base = builder_base(rng, 3, 4, CacheMode::kAlign);
  Builder a, b;
  ASSERT_OK(a.initialize(base.config()));
  ASSERT_OK(b.initialize(base.config()));
  for (int k = 0; k < 20; ++k) {
    Step s = random_step_on(rng, base, true);
    ASSERT_OK(a.step(s.inputs()));
    ASSERT_OK(b.prepare(s.inputs()));
    ASSERT_OK(b.launch(s.padded_rows));
    const int64_t n = base.G() * base.max_rows;
    auto same = [&](const TensorView& x, const TensorView& y, int64_t count) {
      const int32_t* p = x.ptr<const int32_t>();
      const int32_t* q = y.ptr<const int32_t>();
      return std::equal(p, p + count, q);
    };
    EXPECT_TRUE(same(a.buffers().non_spec_state_indices, b.buffers().non_spec_state_indices, n));
    EXPECT_TRUE(same(a.buffers().non_spec_source_indices, b.buffers().non_spec_source_indices, n));
    EXPECT_TRUE(same(a.buffers().spec_state_indices, b.buffers().spec_state_indices, n * s.S()));
    EXPECT_TRUE(same(a.buffers().host_plans[0], b.buffers().host_plans[0], a.layout().total_words));
    EXPECT_EQ(a.last_errors(), b.last_errors());
  }
}

TEST(MetadataBuilderCpu, ShadowSwitchFailsTheStepOnAMismatch) {
  // Source and destination buffers aliased by mistake: the pass writes each row's source over its
  // destination, which the shadow check (config.shadow) reports as the step's failure.
  Step s = make_step({{1, -1}, {3, 2}}, 2, /*G=*/2);
  s.num_accepted_tokens = {3, 1};
  s.allocate();
  std::vector<int32_t> plan;
  BuilderBuffers buffers = s.caller_buffers(plan);
  buffers.non_spec_source_indices = buffers.non_spec_state_indices;  // aliased
  BuilderConfig c = s.config();
  c.shadow = true;
  Builder b;
  ASSERT_OK(b.initialize(c, buffers));
  const Status st = b.step(s.inputs());
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.reason().find("group 0, field non_spec_state_indices, row 0: shared/fused = "
                             "100002, per-group = 100000"),
            std::string::npos)
      << st.reason();
  // The same check on demand, with the switch off.
  c.shadow = false;
  ASSERT_OK(b.initialize(c, buffers));
  ASSERT_OK(b.step(s.inputs()));
  ShadowReport r;
  ASSERT_OK(b.check(s.inputs(), nullptr, &r));
  EXPECT_FALSE(r.ok());
  // Separate buffers: no mismatch.
  Step t = s;
  t.allocate();
  Builder ok;
  c.shadow = true;
  ASSERT_OK(ok.initialize(c));
  ASSERT_OK(ok.step(t.inputs()));
}

TEST(MetadataBuilderCpu, BadInputsNameTheArgumentAndWriteNothing) {
  Step s = make_step({{3, 2}, {1, -1}}, 2, /*G=*/2);
  Builder b;
  ASSERT_OK(b.initialize(s.config()));
  ASSERT_OK(b.step(s.inputs()));
  const BuilderBuffers& buf = b.buffers();
  auto snapshot = [&] {
    std::vector<int32_t> all;
    for (const TensorView* v : {&buf.host_plans[0], &buf.spec_state_indices,
                                &buf.non_spec_state_indices, &buf.non_spec_source_indices})
      all.insert(all.end(), v->ptr<const int32_t>(), v->ptr<const int32_t>() + v->numel());
    return all;
  };
  const std::vector<int32_t> before = snapshot();
  s.num_accepted_tokens[1] = 4;
  Status st = b.step(s.inputs());
  EXPECT_NE(st.reason().find("num_accepted_tokens[1] = 4 is outside [1, S = 3]"), std::string::npos)
      << st.reason();
  s.num_accepted_tokens[1] = 1;
  s.query_start_loc[1] = 5;  // decreasing afterwards
  st = b.step(s.inputs());
  EXPECT_NE(st.reason().find("query_start_loc decreases at request 1"), std::string::npos)
      << st.reason();
  s.query_start_loc[1] = 3;
  StepInputs in = s.inputs();
  in.num_accepted_tokens.device = {DeviceType::kCUDA, 0};
  st = b.step(in);
  EXPECT_NE(st.reason().find("num_accepted_tokens must be a host array or live on the builder's "
                             "device, got one on cuda:0"),
            std::string::npos)
      << st.reason();
  in = s.inputs();
  in.padded_rows = s.max_rows + 1;
  EXPECT_NE(b.step(in).reason().find("padded_rows"), std::string::npos);
  EXPECT_NE(b.launch(s.max_rows + 1).reason().find("launch_rows"), std::string::npos);
  EXPECT_EQ(snapshot(), before);
}

TEST(MetadataBuilderCpu, ConfigurationAndBuffersAreChecked) {
  Step s = make_step({{3, 2}}, 2, /*G=*/2);
  auto reason = [](Builder& b, const BuilderConfig& c) { return b.initialize(c).reason(); };
  Builder b;
  BuilderConfig c = s.config();
  c.num_groups = 0;
  EXPECT_NE(reason(b, c).find("num_groups"), std::string::npos);
  c = s.config();
  c.block_tables[1].device = {DeviceType::kCUDA, 0};
  EXPECT_NE(reason(b, c).find("block_tables[1] is on cuda:0"), std::string::npos) << reason(b, c);
  c = s.config();
  c.block_tables[0].device = c.block_tables[1].device = {DeviceType::kCUDA, 0};
  EXPECT_NE(reason(b, c).find("needs the CUDA operations"), std::string::npos) << reason(b, c);
  c = s.config();
  c.mode = CacheMode::kAlign;
  c.block_size = 0;
  EXPECT_NE(reason(b, c).find("block_size"), std::string::npos);
  c = s.config();
  c.block_tables[0].dtype = DType::kInt64;
  EXPECT_NE(reason(b, c).find("block_tables[0]"), std::string::npos);
  // Caller-provided buffers.
  std::vector<int32_t> plan;
  const BuilderBuffers good = s.caller_buffers(plan);
  ASSERT_OK(b.initialize(s.config(), good));
  BuilderBuffers bad = good;
  bad.spec_state_indices.shape[2] = 2;
  EXPECT_NE(b.initialize(s.config(), bad).reason().find("spec_state_indices"), std::string::npos);
  EXPECT_FALSE(b.initialized());
  EXPECT_NE(b.step(s.inputs()).reason().find("not initialized"), std::string::npos);
  bad = good;
  bad.non_spec_source_indices = TensorView{};
  EXPECT_NE(b.initialize(s.config(), bad).reason().find("non_spec_source_indices is required"),
            std::string::npos);
  bad = good;
  bad.host_plans[0].shape[0] -= 1;
  EXPECT_NE(b.initialize(s.config(), bad).reason().find("host_plans[0] holds"), std::string::npos);
  bad = good;
  bad.num_host_plans = 2;
  bad.host_plans[1] = bad.host_plans[0];
  EXPECT_NE(b.initialize(s.config(), bad).reason().find("host_plans"), std::string::npos);
  bad = good;
  bad.error_count = TensorView{};
  EXPECT_NE(b.initialize(s.config(), bad).reason().find("error_count is required"),
            std::string::npos);
}

TEST(MetadataBuilderCpu, WorkspaceSizeCoversTheOwnedBuffers) {
  Step s = make_step({{3, 2}, {1, -1}}, 3, /*G=*/3);
  BuilderConfig c = s.config();
  const int64_t G = 3, R = s.max_rows, S = 4;
  const int64_t words = Layout::make(s.max_rows, s.max_tokens).total_words;
  BuilderWorkspace ws = Builder::workspace_size(c);
  EXPECT_EQ(ws.device_bytes, 0);
  EXPECT_GE(ws.host_bytes, 4 * (G * R * S + 2 * G * R + 1 + words));
  EXPECT_EQ(ws.host_bytes % 16, 0);
  for (int g = 0; g < 3; ++g) c.block_tables[g].device = {DeviceType::kCUDA, 0};
  c.staging_slots = 3;
  ws = Builder::workspace_size(c);
  EXPECT_GE(ws.device_bytes, 4 * (G * R * S + 2 * G * R + 1 + words));
  EXPECT_GE(ws.host_bytes, 4 * 3 * words);
  c.pinned_staging = false;  // one pageable plan buffer
  EXPECT_LT(Builder::workspace_size(c).host_bytes, 4 * 2 * words);
}

// ---- replay mode (replay.md §3): one checkpoint slot per request -----------------------------

std::vector<int32_t> group_row(const std::vector<int32_t>& v, int g, int64_t rows, int64_t n) {
  return {v.begin() + g * rows, v.begin() + g * rows + n};
}

TEST(MetadataReplay, HandCheckedStep) {
  // Spec rows: request 0 (first step after prefill: n = 0) and request 2 (n = 3); non-spec rows:
  // request 1 (a decode without drafts, n = 2) and request 3 (zero-length, n = 1). Padded to 5.
  Step s = make_step({{3, 2}, {1, -1}, {2, 1}, {0, -1}}, 2, /*G=*/2);
  s.replay = true;
  s.num_accepted_tokens = {0, 2, 3, 1};
  s.padded_rows = 5;
  s.pad_id = -1;
  s.allocate();
  EXPECT_EQ(build(s), 0);
  EXPECT_EQ(s.header(kReplay), 1);
  const int64_t R = s.max_rows, S = 3;
  EXPECT_EQ(words(s, &Layout::replay_counts, 5), (std::vector<int32_t>{0, 3, 0, 0, 0}));
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 5), (std::vector<int32_t>{1, 3, 1, 1, 1}));
  EXPECT_EQ(words(s, &Layout::spec_source_column, 5), (std::vector<int32_t>{0, 2, 0, 0, 0}));
  EXPECT_EQ(words(s, &Layout::non_spec_replay_counts, 5), (std::vector<int32_t>{2, 1, 0, 0, 0}));
  EXPECT_EQ(words(s, &Layout::non_spec_source_column, 5), (std::vector<int32_t>{1, 0, 0, 0, 0}));
  for (int g = 0; g < 2; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(group_row(s.checkpoint_out, g, R, 6),
              (std::vector<int32_t>{base + 0, base + 200, -1, -1, -1, kPoison}));
    // Column 0 of each spec row is its checkpoint; no other column names a slot.
    for (int64_t j = 0; j < 5; ++j)
      for (int64_t c = 0; c < S; ++c)
        EXPECT_EQ(s.spec_out[size_t((g * R + j) * S + c)],
                  c == 0 ? s.checkpoint_out[size_t(g * R + j)] : -1);
    // Non-spec rows read and write their checkpoint (column 0), whatever n is.
    EXPECT_EQ(group_row(s.non_spec_out, g, R, 6),
              (std::vector<int32_t>{base + 100, base + 300, -1, -1, -1, kPoison}));
    EXPECT_EQ(group_row(s.non_spec_src_out, g, R, 6), group_row(s.non_spec_out, g, R, 6));
  }
  EXPECT_TRUE(shadow(s).ok()) << shadow(s).message;
  // Absent counts: nothing to replay anywhere, every row accepts 1.
  s.with_accepted = false;
  s.allocate();
  EXPECT_EQ(build(s), 0);
  EXPECT_EQ(words(s, &Layout::replay_counts, 2), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(words(s, &Layout::non_spec_replay_counts, 2), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 2), (std::vector<int32_t>{1, 1}));
  EXPECT_TRUE(shadow(s).ok()) << shadow(s).message;
}

TEST(MetadataReplay, OneSlotPerRequestIsEnough) {
  // Tables of one column (the pool holds one checkpoint slot per request): replay mode reads
  // nothing else, while the same step in the other mode cannot find its S columns.
  Step s = make_step({{3, 2}, {1, -1}, {3, 2}}, 2, /*G=*/3);
  s.num_accepted_tokens = {3, 2, 1};
  s.make_tables(3, s.max_rows, 1, /*extra_stride=*/2);  // poison past column 0
  s.replay = true;
  s.allocate();
  EXPECT_EQ(build(s), 0);
  for (int g = 0; g < 3; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(group_row(s.checkpoint_out, g, s.max_rows, 2),
              (std::vector<int32_t>{base, base + 200}));
    EXPECT_EQ(s.non_spec_src_out[size_t(g * s.max_rows)], base + 100);
  }
  EXPECT_TRUE(shadow(s).ok());
  s.replay = false;
  s.allocate();
  EXPECT_EQ(build(s), 3 * 3);  // two spec rows and the non-spec row (acc 2) in every group
}

TEST(MetadataReplay, RandomStepsMatchTheReference) {
  // Fresh random steps, every output poisoned: checkpoints, spec rows, non-spec rows, the replay
  // and accepted counts, the error count, nothing written past the step's rows, and the shadow
  // check, for G = 1..6, with and without padding, counts given or absent.
  std::mt19937_64 rng(2718);
  int nothing_pending = 0, narrow = 0, unreadable = 0, with_spec = 0;
  for (int rep = 0; rep < 600; ++rep) {
    const int G = 1 + rep % 6;
    const int64_t S = 1 + (rep / 6) % 9;
    Step s = random_step(rng, G, S, CacheMode::kNone, rep % 2, /*replay=*/true);
    s.with_accepted = rep % 7 != 0;
    s.allocate();
    const testing::VllmExpected e = vllm_expected(s);
    const int64_t errors = build(s);
    ASSERT_EQ(errors, e.unreadable) << rep;
    ASSERT_EQ(s.header(kReplay), 1) << rep;
    ASSERT_EQ(words(s, &Layout::replay_counts, e.spec_rows_written), e.replay_counts) << rep;
    ASSERT_EQ(words(s, &Layout::non_spec_replay_counts, e.rows_written), e.non_spec_replay_counts)
        << rep;
    ASSERT_EQ(words(s, &Layout::spec_num_accepted, e.spec_rows_written), e.spec_accepted) << rep;
    ASSERT_EQ(words(s, &Layout::non_spec_source_column, e.rows_written), e.non_spec_source_column)
        << rep;
    const int64_t R = s.max_rows;
    for (int g = 0; g < G; ++g) {
      for (int64_t j = 0; j < R; ++j) {
        const size_t k = size_t(g * R + j);
        const bool spec_written = j < e.spec_rows_written, written = j < e.rows_written;
        ASSERT_EQ(s.checkpoint_out[k], spec_written ? e.checkpoint[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
        ASSERT_EQ(s.non_spec_out[k], written ? e.destination[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
        ASSERT_EQ(s.non_spec_src_out[k], written ? e.source[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
      }
      for (int64_t k = 0; k < R * S; ++k)
        ASSERT_EQ(s.spec_out[size_t(g * R * S + k)],
                  k < e.spec_rows_written * S ? e.spec[size_t(g)][size_t(k)] : kPoison)
            << rep << " group " << g << " element " << k;
      narrow += s.table_cols[size_t(g)] < S;
    }
    const ShadowReport r = shadow(s);
    ASSERT_TRUE(r.ok()) << rep << ": " << r.message;
    for (int64_t j = 0; s.with_accepted && j < e.num_spec_decodes; ++j)
      nothing_pending += e.replay_counts[size_t(j)] == 0;
    unreadable += e.unreadable > 0;
    with_spec += e.num_spec_decodes > 0;
  }
  // The steps cover empty windows, tables narrower than S columns and unreadable rows.
  EXPECT_GT(nothing_pending, 100);
  EXPECT_GT(narrow, 100);
  EXPECT_GT(unreadable, 50);
  EXPECT_GT(with_spec, 200);
}

TEST(MetadataReplay, PrefixCachingIsRefused) {
  Step s = make_step({{3, 2}, {1, -1}}, 2);
  s.replay = true;
  s.mode = CacheMode::kAlign;
  s.block_size = 4;
  s.allocate();
  Params p = s.params();
  const Status st = plan(p);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.reason().find("mode 'align' (prefix caching) cannot be combined with replay"),
            std::string::npos)
      << st.reason();
  for (int32_t w : s.plan) ASSERT_EQ(w, kPoison);
  EXPECT_NE(Builder::can_implement(s.config()).reason().find("mode 'align'"), std::string::npos);
  Builder b;
  EXPECT_FALSE(b.initialize(s.config()).is_ok());
}

TEST(MetadataReplay, BadCountsAndArgumentsAreNamedAndNothingIsWritten) {
  Step s = make_step({{3, 2}, {1, -1}}, 2);
  s.replay = true;
  s.num_accepted_tokens = {0, 4};
  expect_plan_error(s, "num_accepted_tokens[1] = 4 is outside [0, S = 3] (replay mode");
  s.num_accepted_tokens = {-1, 0};
  expect_plan_error(s, "num_accepted_tokens[0] = -1 is outside [0, S = 3]");
  // The state-row pass: checkpoint_indices required in replay mode, refused otherwise.
  s = make_step({{3, 2}, {1, -1}}, 2, /*G=*/2);
  s.replay = true;
  s.allocate();
  Params p = s.params();
  ASSERT_TRUE(plan(p).is_ok());
  auto pass_error = [&](const Params& q, const std::string& needle) {
    const Status st = run_state_rows_cpu(q);
    EXPECT_FALSE(st.is_ok()) << needle;
    EXPECT_NE(st.reason().find(needle), std::string::npos) << st.reason();
    for (const auto* v : {&s.spec_out, &s.non_spec_out, &s.non_spec_src_out, &s.checkpoint_out})
      for (int32_t w : *v) ASSERT_EQ(w, kPoison) << "the pass wrote before failing: " << needle;
  };
  Params q = p;
  q.checkpoint_indices = TensorView{};
  pass_error(q, "checkpoint_indices is required in replay mode");
  q = p;
  q.checkpoint_indices.dtype = DType::kInt64;
  pass_error(q, "checkpoint_indices");
  q = p;
  q.checkpoint_indices.shape[0] = 1;
  pass_error(q, "checkpoint_indices");
  q = p;
  q.checkpoint_indices.shape[1] = 1;
  q.checkpoint_indices.strides[0] = 1;
  pass_error(q, "checkpoint_indices has 1 rows per group");
  q = p;
  q.checkpoint_indices.device = {DeviceType::kCUDA, 0};
  pass_error(q, "checkpoint_indices is on cuda:0");
  // A pass without replay mode: the checkpoint output is refused, and so is a replay plan.
  q = p;
  q.replay = false;
  pass_error(q, "checkpoint_indices is written only in replay mode");
  q.checkpoint_indices = TensorView{};
  pass_error(q,
             "plan holds a plan made with header word replay = 1 but the state-row pass has "
             "replay = false");
}

TEST(MetadataReplay, APlanOfTheOtherModeIsPaddedAndCountedByThePass) {
  // What a device pass does (it cannot raise): every row written gets the pad id, the mismatch is
  // counted once, and the accepted counts gathered into the plan are the padding values.
  for (bool plan_replay : {false, true}) {
    Step s = make_step({{3, 2}, {1, -1}, {3, 2}}, 2, /*G=*/2);
    s.replay = plan_replay;
    s.padded_rows = 4;
    s.pad_id = -1;
    s.allocate();
    Params p = s.params();
    ASSERT_TRUE(plan(p).is_ok());
    Step t = s;
    t.replay = !plan_replay;
    Params q = t.params();
    q.plan = p.plan;
    q.spec_state_indices = p.spec_state_indices;
    q.non_spec_state_indices = p.non_spec_state_indices;
    q.non_spec_source_indices = p.non_spec_source_indices;
    q.checkpoint_indices =
        t.replay ? TensorView::make(s.checkpoint_out.data(), DType::kInt32, {2, s.max_rows})
                 : TensorView{};
    EXPECT_EQ(run_state_rows_cpu(make_state_rows_args(q)), 1) << plan_replay;
    const int64_t R = s.max_rows, S = 3;
    for (int g = 0; g < 2; ++g)
      for (int64_t j = 0; j < 4; ++j) {
        for (int64_t c = 0; c < S; ++c) EXPECT_EQ(s.spec_out[size_t((g * R + j) * S + c)], -1);
        EXPECT_EQ(s.non_spec_out[size_t(g * R + j)], -1);
        EXPECT_EQ(s.non_spec_src_out[size_t(g * R + j)], -1);
        if (t.replay) {
          EXPECT_EQ(s.checkpoint_out[size_t(g * R + j)], -1);
        }
      }
  }
}

TEST(MetadataReplay, GatheredReplayCountsAreCheckedPerRow) {
  // The pass (as on the device) gathers the replay counts: 0..S is valid (n = 0: nothing to
  // replay); a bad spec-row count is copied and counted once, a bad non-spec count pads the row
  // in every group; a request past the counts gets n = -1 (which replay verify refuses).
  Step s = make_step({{3, 2}, {1, -1}, {2, 1}, {1, -1}, {3, 2}}, 2, /*G=*/2);
  s.replay = true;
  s.with_accepted = false;
  s.padded_rows = 6;
  s.allocate();
  Params p = s.params();
  ASSERT_TRUE(plan(p).is_ok());
  std::vector<int32_t> n = {0, 3, 4, -2};  // request 4 is past the array
  p.num_accepted_tokens = TensorView::make(n.data(), DType::kInt32, {4});
  int64_t errors = 0;
  ASSERT_TRUE(run_state_rows_cpu(p, &errors).is_ok());
  // Spec rows: requests 0, 2 (bad), 4 (past the counts); non-spec: 1, 3 (bad) in both groups.
  EXPECT_EQ(errors, 2 + 2 * 1);
  EXPECT_EQ(words(s, &Layout::replay_counts, 6), (std::vector<int32_t>{0, 4, -1, 0, 0, 0}));
  EXPECT_EQ(words(s, &Layout::spec_num_accepted, 6), (std::vector<int32_t>{1, 4, 1, 1, 1, 1}));
  EXPECT_EQ(words(s, &Layout::non_spec_replay_counts, 6),
            (std::vector<int32_t>{3, -2, 0, 0, 0, 0}));
  EXPECT_EQ(words(s, &Layout::non_spec_source_column, 6), (std::vector<int32_t>{2, 0, 0, 0, 0, 0}));
  const int64_t R = s.max_rows;
  for (int g = 0; g < 2; ++g) {
    const int32_t base = 100000 * (g + 1);
    EXPECT_EQ(group_row(s.checkpoint_out, g, R, 3),
              (std::vector<int32_t>{base, base + 200, base + 400}));
    EXPECT_EQ(group_row(s.non_spec_out, g, R, 2), (std::vector<int32_t>{base + 100, 0}));
    EXPECT_EQ(group_row(s.non_spec_src_out, g, R, 2), (std::vector<int32_t>{base + 100, 0}));
  }
}

TEST(MetadataReplay, ShadowNamesAnInjectedMismatch) {
  Step s = make_step({{3, 2}, {1, -1}, {2, 1}}, 2, /*G=*/3);
  s.replay = true;
  s.num_accepted_tokens = {2, 3, 0};
  s.padded_rows = 4;
  s.allocate();
  build(s);
  ASSERT_TRUE(shadow(s).ok());
  std::mt19937_64 rng(17);
  poison_unused(s, rng);
  ASSERT_TRUE(shadow(s).ok()) << shadow(s).message;
  const int64_t R = s.max_rows;
  const Layout l = Layout::make(s.max_rows, s.max_tokens);
  int32_t& ck = s.checkpoint_out[size_t(1 * R + 1)];  // group 1, spec row 1 (request 2)
  expect_shadow_names(s, ck, ck + 1,
                      "group 1, field checkpoint_indices, row 1: shared/fused = 200201, "
                      "per-group = 200200");
  expect_shadow_names(s, s.checkpoint_out[size_t(2 * R + 3)], 5,  // a padded row a replay reads
                      "group 2, field checkpoint_indices, row 3");
  expect_shadow_names(s, s.plan[size_t(l.replay_counts + 1)], 1,
                      "field replay_counts, row 1: shared/fused = 1, per-group = 0");
  expect_shadow_names(s, s.plan[size_t(l.non_spec_replay_counts + 0)], 2,
                      "field non_spec_replay_counts, row 0: shared/fused = 2, per-group = 3");
  // A column that names no slot in replay mode.
  expect_shadow_names(s, s.spec_out[size_t((0 * R + 0) * 3 + 1)], 7,
                      "group 0, field spec_state_indices, row 0, column 1");
  expect_shadow_names(s, s.plan[size_t(l.header + kReplay)], 0, "field header.replay");
  ASSERT_TRUE(shadow(s).ok()) << shadow(s).message;
}

TEST(MetadataReplay, BuilderStepsMatchTheReference) {
  std::mt19937_64 rng(33);
  int steps = 0;
  for (bool owned : {true, false})
    for (int64_t cols : {1, 3, 9}) {
      const int G = 1 + steps % 6;
      const int64_t S = 2 + steps % 4;
      Step base = random_step(rng, G, S, CacheMode::kNone, false, /*replay=*/true);
      base.max_rows = 40;
      base.max_tokens = 40 * (S + 12);
      base.make_tables(G, 40, cols);
      base.allocate();
      BuilderConfig c = base.config();
      ASSERT_TRUE(c.replay);
      c.shadow = true;
      BuilderBuffers buffers;
      std::vector<int32_t> plan_buffer;
      if (!owned) {
        buffers = base.caller_buffers(plan_buffer);
        // Without the checkpoint buffer a replay builder is refused, naming it.
        BuilderBuffers missing = buffers;
        missing.checkpoint_indices = TensorView{};
        Builder refused;
        EXPECT_NE(refused.initialize(c, missing).reason().find("checkpoint_indices is required"),
                  std::string::npos);
      }
      Builder b;
      ASSERT_OK(owned ? b.initialize(c) : b.initialize(c, buffers));
      for (int k = 0; k < 25; ++k, ++steps) {
        Step s = random_step_on(rng, base, k % 2);
        s.with_accepted = k % 5 != 0;
        ASSERT_OK(b.step(s.inputs()));
        expect_builder_matches(b, s, "replay step " + std::to_string(steps));
      }
      if (!owned) {
        EXPECT_EQ(b.buffers().checkpoint_indices.data, base.checkpoint_out.data());
      }
    }
  EXPECT_EQ(steps, 150);
  // A builder without replay takes no checkpoint buffer; the owned workspace holds one only in
  // replay mode.
  Step s = make_step({{3, 2}}, 2, /*G=*/2);
  s.replay = true;
  s.allocate();
  std::vector<int32_t> plan_buffer;
  const BuilderBuffers buffers = s.caller_buffers(plan_buffer);
  BuilderConfig c = s.config();
  c.replay = false;
  Builder b;
  EXPECT_NE(b.initialize(c, buffers).reason().find("checkpoint_indices is written only in replay"),
            std::string::npos);
  const int64_t with = Builder::workspace_size(s.config()).host_bytes;
  EXPECT_GE(with - Builder::workspace_size(c).host_bytes, 4 * 2 * s.max_rows);
}

TEST(MetadataReplay, BuilderRefusesBadCountsBeforeWriting) {
  Step s = make_step({{3, 2}, {1, -1}}, 2, /*G=*/2);
  s.replay = true;
  s.num_accepted_tokens = {0, 3};
  s.allocate();
  Builder b;
  ASSERT_OK(b.initialize(s.config()));
  ASSERT_OK(b.step(s.inputs()));
  const BuilderBuffers& buf = b.buffers();
  auto snapshot = [&] {
    std::vector<int32_t> all;
    for (const TensorView* v :
         {&buf.host_plans[0], &buf.spec_state_indices, &buf.non_spec_state_indices,
          &buf.non_spec_source_indices, &buf.checkpoint_indices})
      all.insert(all.end(), v->ptr<const int32_t>(), v->ptr<const int32_t>() + v->numel());
    return all;
  };
  const std::vector<int32_t> before = snapshot();
  s.num_accepted_tokens = {4, 0};
  const Status st = b.step(s.inputs());
  EXPECT_NE(st.reason().find("num_accepted_tokens[0] = 4 is outside [0, S = 3]"), std::string::npos)
      << st.reason();
  EXPECT_EQ(snapshot(), before);
}

}  // namespace
}  // namespace gdn::metadata
