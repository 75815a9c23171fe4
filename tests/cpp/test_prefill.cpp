// prefill on the CPU against the tests' own float64 token-by-token reference, on fresh random
// inputs with poisoned outputs: block edges (1, 63, 64, 65, 127, 128, 129 tokens and longer), null
// initial and final slots, in place, checkpoints, every head ratio and state dtype, both layouts,
// padded rows, strided inputs, and refused inputs that write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/prefill/cpu.hpp"
#include "prefill_case.hpp"

namespace gdn::prefill {
namespace {

using namespace testing;

const Runner kCpu = [](const Params& p) { return run_cpu(p); };

TEST(Prefill, BlockEdgesRatiosDtypesAndLayoutsMatchTheReference) {
  uint32_t seed = 1;
  for (const int64_t ratio : {1, 2, 3, 4, 8, 5})
    for (const DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
        // Block edges, a padded row and a longer request; initial slots 0..5, in place for the
        // first request, a null initial slot (a new request) for the third.
        PrefillCase pc(config({1, 63, 0, 64, 65, 129}, ratio, state, layout, seed++),
                       {0, 1, 2, -1, 4, 5}, {0, 11, 12, 13, 14, 15});
        const double tol = state == DType::kFloat32 ? 1e-4 : 2e-2;
        SCOPED_TRACE(::testing::Message() << "ratio " << ratio << " state " << to_string(state));
        expect_matches_reference(pc, tol, kCpu);
      }
}

// The CPU path takes any K and V: unequal and odd head dims, both layouts, across block edges and
// with checkpoints.
TEST(Prefill, UnequalHeadDimsMatchTheReference) {
  uint32_t seed = 60;
  for (const auto [K, V] : {std::pair<int64_t, int64_t>{8, 24}, {36, 12}, {5, 7}})
    for (const DType state : {DType::kFloat32, DType::kBFloat16})
      for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
        CaseConfig g = config({1, 64, 65, 200}, 2, state, layout, seed++);
        g.K = K;
        g.V = V;
        PrefillCase pc(g, {0, -1, 2, 3}, {10, 11, 12, 3}, 64, 3);
        pc.checkpoints = {-1, -1, -1, 13, -1, -1, 14, -1, -1, 15, 16, 17};
        const double tol = state == DType::kFloat32 ? 1e-4 : 2e-2;
        SCOPED_TRACE(::testing::Message()
                     << "K " << K << " V " << V << " state " << to_string(state));
        expect_matches_reference(pc, tol, kCpu);
      }
}

// StepArgs' input options (a_is_log_decay with A_log and dt_bias absent, b_is_beta, qk_l2_norm
// off), alone and together, across a block edge, a null initial slot and both layouts.
TEST(Prefill, InputOptionsMatchTheReference) {
  for (int options = 1; options < 8; ++options)
    for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
      CaseConfig cfg = config({70, 0, 5}, options % 2 == 0 ? 3 : 2, DType::kFloat32, layout,
                              uint32_t(40 + options));
      cfg.a_is_log_decay = options & 1;
      cfg.b_is_beta = options & 2;
      cfg.qk_l2_norm = !(options & 4);
      PrefillCase pc(cfg, {1, 2, -1}, {1, 12, 13});
      SCOPED_TRACE(::testing::Message() << "options " << options);
      expect_matches_reference(pc, 1e-4, kCpu);
    }
}

TEST(Prefill, CheckpointsEveryETokensAndNullSlots) {
  // E = 64: a 200-token request takes checkpoints after tokens 63, 127 and 191; a 128-token one
  // after 63 and 127 (the last equals its final state); a 40-token one none. A null final slot and
  // a null checkpoint slot are skipped.
  PrefillCase pc(config({200, 128, 40, 64}), {3, -1, 5, 6}, {20, 21, -1, 23}, 64, 3);
  pc.checkpoints = {7, 8, 9, 10, -1, -1, -1, -1, -1, 17, -1, -1};
  expect_matches_reference(pc, 1e-4, kCpu);
}

TEST(Prefill, LongRequestInPlace) {
  PrefillCase pc(config({1000}), {4}, {4});
  expect_matches_reference(pc, 1e-4, kCpu);
}

// The per-token math is decode_mtp's: with an fp32 pool, a request's prefill equals its tokens
// run one call at a time through decode_mtp, bit for bit (outputs and final state).
TEST(Prefill, EqualsOneTokenDecodeCallsBitForBit) {
  PrefillCase pc(config({130}), {2}, {9});
  pc.c.poison_out();
  ASSERT_TRUE(run_cpu(pc.params()).is_ok());
  const HostArray prefill_out = pc.c.out, prefill_state = pc.c.state;

  DecodeCase d(config({130}));  // the same seed: the same inputs and pool
  for (int64_t l = 0; l < d.L; ++l) {
    // One token (row l): written to slot 9, read from column acc - 1 = 1 of the table: slot 2
    // for the first token, then slot 9.
    std::vector<int32_t> table = {9, l == 0 ? 2 : 9}, cu = {int32_t(l), int32_t(l + 1)}, acc = {2};
    decode_mtp::Params p = d.params();
    p.state_indices = TensorView::make(table.data(), DType::kInt32, {1, 2});
    p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {2});
    p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {1});
    ASSERT_TRUE(decode_mtp::run_cpu(p).is_ok()) << "token " << l;
  }
  for (int64_t e = 0; e < d.out.count; ++e) ASSERT_EQ(d.out.get(e), prefill_out.get(e)) << e;
  for (int64_t e = 0; e < d.state.count; ++e) ASSERT_EQ(d.state.get(e), prefill_state.get(e)) << e;
}

TEST(Prefill, BadInputsAreNamedAndNothingIsWritten) {
  const auto refused = [](PrefillCase& pc, const char* needle) {
    const HostArray state = pc.c.state;
    pc.c.poison_out();
    const Status s = run_cpu(pc.params());
    EXPECT_FALSE(s.is_ok()) << needle;
    EXPECT_NE(s.reason().find(needle), std::string::npos) << s.reason();
    for (int64_t e = 0; e < state.count; ++e) ASSERT_EQ(pc.c.state.get(e), state.get(e));
    for (int64_t e = 0; e < pc.c.out.count; ++e) ASSERT_TRUE(std::isnan(pc.c.out.get(e)));
  };
  {
    PrefillCase pc(config({3, 4}), {1, 24}, {1, 2});
    refused(pc, "initial_state_indices[1] = 24");
  }
  {
    PrefillCase pc(config({3, 4}), {1, 2}, {1, 99});
    refused(pc, "final_state_indices[1] = 99");
  }
  {
    PrefillCase pc(config({130}), {1}, {2}, 64, 1);  // two boundaries, one column
    pc.checkpoints = {5};
    refused(pc, "cross 2 checkpoint boundaries");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 64, 1);
    pc.checkpoints = {30};
    refused(pc, "checkpoint_indices[0, 0] = 30");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 32, 1);
    refused(pc, "checkpoint_every = 32");
  }
  {
    PrefillCase pc(config({64}), {1}, {2}, 64, 0);  // an interval without checkpoint slots
    refused(pc, "needs checkpoint_indices");
  }
  {
    PrefillCase pc(config({3}), {1}, {2});
    Params p = pc.params();
    p.final_state_indices = TensorView::make(pc.wide_final.data(), DType::kFloat32, {1});
    const Status s = run_cpu(p);
    EXPECT_NE(s.reason().find("final_state_indices has dtype float32"), std::string::npos)
        << s.reason();
  }
}

}  // namespace
}  // namespace gdn::prefill
