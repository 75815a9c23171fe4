// CPU causal_conv1d_prefill against the tests' float64 reference over layouts, dtypes, widths and
// request lengths around the tiles; null and in-place slots, in-place outputs, strided inputs; the
// continuation by causal_conv1d_update equal to token-by-token updates bit for bit; invalid rows
// and arguments refused by name before anything is written.
#include <gtest/gtest.h>

#include <tuple>

#include "conv_prefill_case.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/conv_prefill/cpu.hpp"

namespace gdn::testing::conv_prefill_test {
namespace {

Status run_on_host(Case& c) { return conv_prefill::run_cpu(c.params()); }
Status update_on_host(Case&, const conv::Params& p) { return conv::run_cpu(p); }

void expect_matches_reference(Case& c) {
  const std::string diff = run_against_reference(c, run_on_host);
  EXPECT_TRUE(diff.empty()) << diff;
}

// The grid: D = 37 channels (not a multiple of anything), requests up to 300 tokens.
constexpr int64_t kGridChannels = 37, kGridLongest = 300;

class ConvPrefillGrid : public ::testing::TestWithParam<GridParam> {};

TEST_P(ConvPrefillGrid, MatchesFloat64Reference) {
  Case c(grid_config(GetParam(), 10, kGridChannels, kGridLongest));
  expect_matches_reference(c);
}

TEST_P(ConvPrefillGrid, UpdatesContinueAsTokenByToken) {
  Config g = grid_config(GetParam(), 20, kGridChannels, kGridLongest);
  g.D = 19;
  g.num_spec = 3;
  g.T = {3, 0, 1, 2, 70, 5};
  // Row 1 (padded) and row 2 start from a null slot; row 3 runs in place on one slot.
  g.first_valid_slot = 1;
  g.initial = {4, 9, 0, 6, 7, 8};
  g.final_ = {10, 11, 12, 6, 13, 14};
  const std::string diff = prefill_then_updates(g, run_on_host, update_on_host);
  EXPECT_TRUE(diff.empty()) << diff;
}

INSTANTIATE_TEST_SUITE_P(
    ConvPrefill, ConvPrefillGrid,
    ::testing::Combine(::testing::Values(conv::StateLayout::kChannelsMajor,
                                         conv::StateLayout::kTokensMajor),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(2, 4, 6)),
    GridName());

TEST(ConvPrefill, NullAndInPlaceSlots) {
  Config g;
  g.first_valid_slot = 1;
  g.T = {2, 65, 1, 4, 3};
  // Null initial (zeros), in-place slot, null final (outputs only), negative null ids.
  g.initial = {0, 5, -3, 7, 0};
  g.final_ = {3, 5, 9, 0, -1};
  Case c(g);
  expect_matches_reference(c);
}

TEST(ConvPrefill, InPlaceOutputIsX) {
  for (auto layout : {conv::StateLayout::kChannelsMajor, conv::StateLayout::kTokensMajor}) {
    Config g;
    g.layout = layout;
    g.in_place = true;
    g.x_dtype = DType::kBFloat16;
    g.x_row_pad = 6;  // x is a strided view, as mixed_qkv inside a wider projection output
    g.T = edge_lengths(130);
    Case c(g);
    expect_matches_reference(c);
    Config gs = g;
    gs.T = {3, 1, 66, 0, 2};
    gs.initial = {4, 5, 6, 7, 8};
    gs.final_ = {4, 5, 6, 7, 8};  // in place on the slots too
    Case cs(gs);
    expect_matches_reference(cs);
  }
}

TEST(ConvPrefill, MixedDtypesStridesAndInt64Indices) {
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
  g.index_stride = 3;
  g.activation = conv::Activation::kNone;
  g.T = {5, 1, 64, 2};
  Case c(g);
  expect_matches_reference(c);
}

TEST(ConvPrefill, RowsNoRequestCoversAreUntouched) {
  Config g;
  g.T = {4, 3, 2};
  Case c(g);
  c.cu = {1, 4, 7, 7};  // rows 0, 7 and 8 of the L = 9 belong to no request
  expect_matches_reference(c);
}

// The whole call is refused before anything is written, and the reason names the row.
void expect_row_error(Case& c, const std::string& row, const std::string& what) {
  const Buffer out_before = c.out_buffer();
  const Buffer state_before = c.state;
  const Status s = conv_prefill::run_cpu(c.params());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.reason().find(row), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find(what), std::string::npos) << s.reason();
  EXPECT_TRUE(c.out_buffer().same_bits(out_before, 0, out_before.count)) << "out was written";
  EXPECT_TRUE(c.state.same_bits(state_before, 0, state_before.count)) << "conv_state was written";
}

TEST(ConvPrefillErrors, InvalidRowsWriteNothing) {
  Config g;
  g.T = {2, 70, 4};
  {
    Case c(g);
    c.set_initial(2, g.slots);
    expect_row_error(c, "request row 2", "initial_state_indices[2] = 24 is >= the pool's slot");
  }
  {
    Case c(g);
    c.set_final(1, g.slots + 5);
    expect_row_error(c, "request row 1", "final_state_indices[1] = 29");
  }
  {
    Case c(g);
    c.cu[2] = 1;  // decreasing
    expect_row_error(c, "request row 1", "cu_seqlens[1..] = (2, 1)");
  }
  {
    Case c(g);
    c.cu[3] = int32_t(c.L + 1);  // past L
    expect_row_error(c, "request row 2", "inside [0, L = 76]");
  }
  {
    // A padded row may carry any slot ids.
    Config gp = g;
    gp.T = {2, 0, 4};
    Case c(gp);
    c.set_initial(1, 1 << 20);
    c.set_final(1, -(1 << 20));
    expect_matches_reference(c);
  }
}

TEST(ConvPrefillErrors, ArgumentsAreNamed) {
  Config g;
  g.T = {2, 1};
  auto expect_arg_error = [&](auto mutate, const std::string& name) {
    Case c(g);
    conv_prefill::Params p = c.params();
    mutate(p);
    const Buffer state_before = c.state;
    const Buffer out_before = c.out;
    const Status s = conv_prefill::run_cpu(p);
    ASSERT_FALSE(s.is_ok()) << name;
    EXPECT_EQ(s.reason().rfind(name, 0), 0u)
        << "reason should start with '" << name << "': " << s.reason();
    EXPECT_TRUE(c.state.same_bits(state_before, 0, state_before.count));
    EXPECT_TRUE(c.out.same_bits(out_before, 0, out_before.count));
  };
  using P = conv_prefill::Params;
  expect_arg_error([](P& p) { p.weight.shape[1] = 1; }, "weight width W = 1");
  expect_arg_error([](P& p) { p.conv_state.shape[1] -= 1; }, "conv_state has");
  expect_arg_error([](P& p) { p.conv_state.shape[2] = 2; }, "conv_state holds Lbuf = 2");
  expect_arg_error([](P& p) { p.x.dtype = DType::kInt32; }, "x has dtype int32");
  expect_arg_error([](P& p) { p.out.shape[0] += 1; }, "out dimension 0");
  expect_arg_error([](P& p) { p.initial_state_indices.dtype = DType::kFloat32; },
                   "initial_state_indices has dtype float32");
  expect_arg_error([](P& p) { p.initial_state_indices = TensorView{}; },
                   "initial_state_indices is required");
  expect_arg_error([](P& p) { p.final_state_indices.shape[0] = 3; },
                   "final_state_indices dimension 0 must be N (entries of initial_state_indices)");
  expect_arg_error([](P& p) { p.final_state_indices = TensorView{}; },
                   "final_state_indices is required");
  expect_arg_error([](P& p) { p.cu_seqlens.shape[0] += 1; },
                   "cu_seqlens dimension 0 must be N + 1 (entries of initial_state_indices + 1)");
  expect_arg_error([](P& p) { p.first_valid_slot = -1; }, "first_valid_slot");
  expect_arg_error([](P& p) { p.final_state_indices.device = {DeviceType::kCUDA, 0}; },
                   "final_state_indices is on cuda:0");
  expect_arg_error(
      [](P& p) { p.error_count = TensorView::make(p.cu_seqlens.data, DType::kInt32, {2}); },
      "error_count");
}

TEST(ConvPrefill, LayoutsAgreeBitForBit) {
  Config g;
  g.T = {3, 66, 1};
  Case a(g);
  g.layout = conv::StateLayout::kTokensMajor;
  Case b(g);
  for (int64_t slot = 0; slot < g.slots; ++slot)
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < a.buffer_len; ++pos)
        b.state.set(b.state_index(slot, ch, pos), a.state.get(a.state_index(slot, ch, pos)));
  ASSERT_TRUE(conv_prefill::run_cpu(a.params()).is_ok());
  ASSERT_TRUE(conv_prefill::run_cpu(b.params()).is_ok());
  EXPECT_TRUE(a.out.same_bits(b.out, 0, a.out.count));
  for (int64_t slot = 0; slot < g.slots; ++slot)
    for (int64_t ch = 0; ch < g.D; ++ch)
      for (int64_t pos = 0; pos < a.buffer_len; ++pos)
        ASSERT_EQ(b.state.get(b.state_index(slot, ch, pos)),
                  a.state.get(a.state_index(slot, ch, pos)));
}

}  // namespace
}  // namespace gdn::testing::conv_prefill_test
