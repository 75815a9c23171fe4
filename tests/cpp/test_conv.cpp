// CPU causal_conv1d_update against the tests' float64 reference over the parameter grid, plus the
// contract: speculative rollback == sequential updates bit for bit, invalid rows write nothing,
// skipped rows and other slots stay intact, errors name the argument / row.
#include <gtest/gtest.h>

#include <random>
#include <tuple>

#include "conv_case.hpp"
#include "gdn/conv/cpu.hpp"

namespace gdn::testing::conv_test {
namespace {

Status run_on_host(Case& c) { return conv::run_cpu(c.params()); }

// Runs the CPU op on `c` and compares with the reference (computed before the run).
void expect_matches_reference(Case& c) {
  const std::string diff = run_against_reference(c, run_on_host);
  EXPECT_TRUE(diff.empty()) << diff;
}

class ConvGrid : public ::testing::TestWithParam<GridParam> {};

TEST_P(ConvGrid, MatchesFloat64Reference) {
  for (int64_t num_spec : {0, 1, 3, 7}) {
    // D = 37: not a multiple of anything.
    Case c(grid_config(GetParam(), num_spec, /*D=*/37, /*N=*/6, /*seed_base=*/100));
    SCOPED_TRACE("num_spec " + std::to_string(num_spec));
    expect_matches_reference(c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Conv, ConvGrid,
    ::testing::Combine(::testing::Values(conv::StateLayout::kChannelsMajor,
                                         conv::StateLayout::kTokensMajor),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(2, 3, 4, 6)),
    GridName());

TEST(Conv, MixedDtypesStridesAndInt64Indices) {
  Config g;
  g.weight_dtype = DType::kBFloat16;
  g.x_dtype = DType::kFloat16;
  g.out_dtype = DType::kFloat32;
  g.state_dtype = DType::kBFloat16;
  g.index_dtype = DType::kInt64;
  g.x_row_pad = 5;
  g.out_row_pad = 3;
  g.weight_row_pad = 2;
  g.slot_pad = 7;
  g.index_stride = 4;  // column 0 of an [N, 4] index table, as vLLM passes state_indices[:, 0]
  g.activation = conv::Activation::kNone;
  Case c(random_rows(g, 5, 7));
  expect_matches_reference(c);
}

TEST(Conv, InPlaceOutputIsX) {
  for (auto layout : {conv::StateLayout::kChannelsMajor, conv::StateLayout::kTokensMajor}) {
    Config g;
    g.layout = layout;
    g.in_place = true;
    g.x_dtype = DType::kBFloat16;
    g.x_row_pad = 6;  // x is a strided view, as mixed_qkv inside a wider projection output
    Case c(random_rows(g, 4, 11));
    expect_matches_reference(c);
  }
}

TEST(Conv, PaddedAndNullSlotRowsAreSkipped) {
  Config g;
  g.first_valid_slot = 1;  // slot 0 is the null block
  g.T = {4, 0, 3, 2, 0};
  g.acc = {2, 9, 1, 3, 0};  // padded rows may carry any accepted count
  g.slot = {3, 5, 0, 7, 0};
  Case c(g);
  const Expected e = reference(c);
  // Rows 1 and 4 (T = 0) and row 2 (null slot) write nothing: their outputs stay NaN.
  for (int64_t l = c.cu[2]; l < c.cu[3]; ++l) EXPECT_TRUE(std::isnan(e.out[size_t(l * g.D)]));
  expect_matches_reference(c);
  for (int64_t l = c.cu[2]; l < c.cu[3]; ++l) EXPECT_TRUE(std::isnan(c.out.get(l * c.out_stride)));
}

TEST(ConvSpec, RollbackEqualsSequentialBitForBit) {
  for (auto layout : {conv::StateLayout::kChannelsMajor, conv::StateLayout::kTokensMajor})
    for (auto [state, act] : {std::pair{DType::kFloat32, DType::kFloat32},
                              std::pair{DType::kBFloat16, DType::kBFloat16},
                              std::pair{DType::kBFloat16, DType::kFloat32}})
      for (int64_t W : {2, 4, 5})
        for (int64_t num_spec : {1, 3}) {
          SCOPED_TRACE(std::string(conv::to_string(layout)) + " state " +
                       std::string(to_string(state)) + " x " + std::string(to_string(act)) + " W " +
                       std::to_string(W) + " num_spec " + std::to_string(num_spec));
          const std::string diff = spec_vs_sequential(layout, state, act, W, num_spec, run_on_host);
          ASSERT_TRUE(diff.empty()) << diff;
        }
}

// An invalid row fails the whole call with a reason naming it; nothing is written.
void expect_row_error(Case& c, const std::string& row, const std::string& what) {
  const Buffer out_before = c.out_buffer();
  const Buffer state_before = c.state;
  Status s = conv::run_cpu(c.params());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.reason().find(row), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find(what), std::string::npos) << s.reason();
  EXPECT_TRUE(c.out_buffer().same_bits(out_before, 0, out_before.count)) << "out was written";
  EXPECT_TRUE(c.state.same_bits(state_before, 0, state_before.count)) << "conv_state was written";
}

TEST(ConvErrors, InvalidRowsWriteNothing) {
  Config g;
  g.T = {2, 3, 4};
  g.acc = {1, 2, 4};
  {
    Case c(g);
    c.set_slot(2, g.slots);  // past the pool
    expect_row_error(c, "request row 2", "slot count");
  }
  {
    Case c(g);
    c.acc[1] = 0;
    expect_row_error(c, "request row 1", "num_accepted_tokens = 0");
  }
  {
    Case c(g);
    c.acc[0] = 5;
    expect_row_error(c, "request row 0", "num_accepted_tokens = 5");
  }
  {
    Config g2 = g;
    g2.T = {2, 5, 1};  // 5 > num_spec + 1
    Case c(g2);
    expect_row_error(c, "request row 1", "T = 5");
  }
  {
    Case c(g);
    c.cu[2] = 1;  // decreasing
    expect_row_error(c, "request row 1", "cu_seqlens");
  }
  {
    Case c(g);
    c.cu[3] = int32_t(c.L + 1);  // past L
    expect_row_error(c, "request row 2", "cu_seqlens");
  }
}

TEST(ConvErrors, ArgumentsAreNamed) {
  Config g;
  g.T = {2, 1};
  auto expect_arg_error = [&](auto mutate, const std::string& name) {
    Case c(g);
    conv::Params p = c.params();
    mutate(p);
    const Buffer state_before = c.state;
    Status s = conv::run_cpu(p);
    ASSERT_FALSE(s.is_ok()) << name;
    EXPECT_EQ(s.reason().rfind(name, 0), 0u)
        << "reason should start with '" << name << "': " << s.reason();
    EXPECT_TRUE(c.state.same_bits(state_before, 0, state_before.count));
  };
  expect_arg_error([](conv::Params& p) { p.weight.shape[1] = 1; }, "weight width W = 1");
  expect_arg_error([](conv::Params& p) { p.weight.shape[1] = kConvMaxWidth + 1; }, "weight width");
  expect_arg_error([](conv::Params& p) { p.conv_state.shape[1] -= 1; }, "conv_state has");
  expect_arg_error([](conv::Params& p) { p.conv_state.shape[2] = 2; }, "conv_state holds Lbuf = 2");
  expect_arg_error([](conv::Params& p) { p.conv_state.strides[0] = 5; }, "conv_state slot stride");
  expect_arg_error([](conv::Params& p) { p.x.dtype = DType::kInt32; }, "x has dtype int32");
  expect_arg_error([](conv::Params& p) { p.x.strides[1] = 2; }, "x must have unit stride");
  expect_arg_error([](conv::Params& p) { p.out.shape[0] += 1; }, "out dimension 0");
  expect_arg_error([](conv::Params& p) { p.cu_seqlens.shape[0] += 1; }, "cu_seqlens dimension 0");
  expect_arg_error(
      [](conv::Params& p) {
        p.num_accepted_tokens = TensorView::make(p.cu_seqlens.data, DType::kInt32, {5});
      },
      "num_accepted_tokens dimension 0");
  expect_arg_error([](conv::Params& p) { p.conv_state_indices.dtype = DType::kFloat32; },
                   "conv_state_indices has dtype float32");
  expect_arg_error([](conv::Params& p) { p.first_valid_slot = -1; }, "first_valid_slot");
  expect_arg_error([](conv::Params& p) { p.out.device = {DeviceType::kCUDA, 0}; },
                   "out is on cuda:0");
  expect_arg_error(
      [](conv::Params& p) {
        p.out = p.x;
        p.out.strides[0] = 100;
        p.out.dtype = DType::kBFloat16;
      },
      "out shares its data pointer");
  expect_arg_error(
      [](conv::Params& p) {
        p.error_count = TensorView::make(p.cu_seqlens.data, DType::kInt32, {2});
      },
      "error_count");
}

// Repeated calls on one pool with inputs, slots and accepted counts rewritten in between (what a
// graph replay sees): each call matches the reference of its own inputs.
TEST(Conv, RepeatedCallsWithRewrittenInputs) {
  Config g = random_rows(Config{}, 6, 41);
  g.T.assign(6, g.num_spec + 1);
  Case c(g);
  std::mt19937 rng(3);
  std::normal_distribution<float> n01;
  for (int call = 0; call < 4; ++call) {
    for (int64_t e = 0; e < c.x.count; ++e) c.x.set(e, n01(rng));
    for (int64_t i = 0; i < c.N; ++i)
      c.acc[size_t(i)] = int32_t(1 + rng() % uint32_t(g.num_spec + 1));
    std::vector<int64_t> perm(size_t(g.slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = 0; i < c.N; ++i) c.set_slot(i, perm[size_t(i)]);
    c.poison_out();
    SCOPED_TRACE("call " + std::to_string(call));
    expect_matches_reference(c);
  }
}

TEST(Conv, LayoutsAgreeBitForBit) {
  // The same buffers in both layouts give identical outputs and identical buffers.
  Config g = random_rows(Config{}, 5, 21);
  Case a(g);
  g.layout = conv::StateLayout::kTokensMajor;
  Case b(g);
  for (int64_t slot = 0; slot < g.slots; ++slot)
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < a.buffer_len; ++pos)
        b.state.set(b.state_index(slot, ch, pos), a.state.get(a.state_index(slot, ch, pos)));
  ASSERT_TRUE(conv::run_cpu(a.params()).is_ok());
  ASSERT_TRUE(conv::run_cpu(b.params()).is_ok());
  EXPECT_TRUE(a.out.same_bits(b.out, 0, a.out.count));
  for (int64_t slot = 0; slot < g.slots; ++slot)
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < a.buffer_len; ++pos)
        ASSERT_EQ(b.state.get(b.state_index(slot, ch, pos)),
                  a.state.get(a.state_index(slot, ch, pos)));
}

}  // namespace
}  // namespace gdn::testing::conv_test
