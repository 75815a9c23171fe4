// The CUDA decode_mtp launcher's rules (gdn/decode_mtp/cuda_launch_rules.hpp) on an H200's
// numbers: which kernel form, head split, chunk buffers, L2 hints and shared memory a launch of a
// given shape gets. Host only: the rules are pure functions of the shapes and the device.
#include <gtest/gtest.h>

#include "gdn/decode_mtp/cuda_launch_rules.hpp"

namespace gdn::decode_mtp::cuda_detail {
namespace {

constexpr int kSms = 132;
constexpr size_t kSharedPerSm = 233472;  // 228 KB
constexpr size_t kReserved = 1024;

// Qwen3-Next TP1: 32 value heads per request.
constexpr int64_t heads_at(int64_t B) { return 32 * B; }

// Token-by-token replay and write-all (neither in closed form) with clusters available.
int split_of(int64_t heads, int S, bool replay = false, int state_bytes = 4) {
  return choose_split(heads, kSms, true, S, replay, false, state_bytes);
}

TEST(LaunchRules, SplitGivesEverySmACtaBelowOneHeadPerSm) {
  EXPECT_EQ(split_of(heads_at(1), 1), 8);  // 32 heads: 256 CTAs
  EXPECT_EQ(split_of(heads_at(1), 4), 8);
  EXPECT_EQ(split_of(33, 1), 4);  // 132 CTAs
  EXPECT_EQ(split_of(66, 1), 2);
  EXPECT_EQ(split_of(131, 1), 2);
  EXPECT_EQ(choose_split(32, kSms, false, 1, false, false, 4), 1);  // no clusters: never split
}

TEST(LaunchRules, SplitTwoBetweenOneAndTwoHeadsPerSm) {
  for (int S = 1; S <= kSplitTwoMaxS; ++S) {
    EXPECT_EQ(split_of(heads_at(8), S), 2) << "S = " << S;  // 256 heads on 132 SMs
    EXPECT_EQ(split_of(132, S), 2) << "S = " << S;
    EXPECT_EQ(split_of(263, S), 2) << "S = " << S;
    EXPECT_EQ(split_of(264, S, false, 2), 1) << "S = " << S;  // two heads per SM (16-bit)
  }
  for (int S : {6, 8}) {  // deeper windows too, either state dtype
    EXPECT_EQ(split_of(heads_at(8), S), 2) << "S = " << S;
    EXPECT_EQ(split_of(heads_at(8), S, false, 2), 2) << "S = " << S;
  }
  EXPECT_EQ(split_of(heads_at(8), 8, true), 2);  // token-by-token replay, any S
  EXPECT_EQ(choose_split(heads_at(8), kSms, true, 4, true, true, 4), 1);  // closed form: never
}

TEST(LaunchRules, SplitTwoForFp32DraftsFromTwoToFourHeadsPerSm) {
  for (int S : {2, 3, 4, 6, 8}) {
    EXPECT_EQ(split_of(heads_at(12), S), 2) << "S = " << S;  // 2.9 heads per SM
    EXPECT_EQ(split_of(heads_at(16), S), 2) << "S = " << S;  // 3.9
    EXPECT_EQ(split_of(2 * kSms, S), 2) << "S = " << S;
    EXPECT_EQ(split_of(heads_at(12), S, false, 2), 1) << "S = " << S;  // 16-bit: 1
  }
  EXPECT_EQ(split_of(heads_at(16), 1), 1);        // no drafts: 1
  EXPECT_EQ(split_of(heads_at(16), 2, true), 1);  // replay: 1
  EXPECT_EQ(split_of(heads_at(24), 2), 1);        // S = 2 from four heads per SM: 1
}

TEST(LaunchRules, SplitTwoForFp32DraftsJustBelowOneHeadPerSm) {
  for (int S : {2, 4, 8}) {
    EXPECT_EQ(split_of(heads_at(2), S), 2) << "S = " << S;  // 64 heads: 128 CTAs on 132 SMs
    EXPECT_EQ(split_of(62, S), 2) << "S = " << S;           // 124 CTAs: 15/16 of the SMs
    EXPECT_EQ(split_of(61, S), 4) << "S = " << S;
    EXPECT_EQ(split_of(heads_at(2), S, false, 2), 4) << "S = " << S;  // 16-bit: 4
    EXPECT_EQ(split_of(heads_at(2), S, true), 4) << "S = " << S;      // replay: 4
  }
  EXPECT_EQ(split_of(heads_at(2), 1), 4);  // no drafts: 4
  EXPECT_EQ(split_of(heads_at(1), 4), 8);  // B = 1: 8
}

TEST(LaunchRules, SplitTwoForDeepWindowsAtFourHeadsPerSm) {
  EXPECT_EQ(split_of(4 * kSms, 8), 2);
  EXPECT_EQ(split_of(heads_at(128), 9), 2);
  EXPECT_EQ(split_of(4 * kSms - 1, 8, false, 2), 1);
  EXPECT_EQ(split_of(heads_at(128), 7, false, 2), 1);
  EXPECT_EQ(split_of(heads_at(128), 7, true), 1);
  EXPECT_EQ(choose_split(heads_at(128), kSms, true, 9, true, true, 4), 1);  // closed form
}

TEST(LaunchRules, SplitTwoForWriteAllDraftsFromFourToSixteenHeadsPerSm) {
  for (int S = kSplitTwoMidMinS; S < 8; ++S) {
    EXPECT_EQ(split_of(heads_at(32), S), 2) << "S = " << S;  // 7.75 heads per SM
    EXPECT_EQ(split_of(4 * kSms, S), 2) << "S = " << S;
    EXPECT_EQ(split_of(16 * kSms - 1, S), 2) << "S = " << S;
    EXPECT_EQ(split_of(4 * kSms - 1, S, false, 2), 1) << "S = " << S;
    EXPECT_EQ(split_of(16 * kSms, S, false, 2), 1) << "S = " << S;      // 16-bit from 16 per SM
    EXPECT_EQ(split_of(heads_at(128), S, false, 2), 1) << "S = " << S;  // 31 heads per SM
    EXPECT_EQ(split_of(heads_at(32), S, true, 2), 1) << "S = " << S;    // bf16 replay: 1
  }
  EXPECT_EQ(split_of(heads_at(32), 8, false, 2), 1);   // 16-bit deep windows below 16 per SM
  EXPECT_EQ(split_of(heads_at(128), 8, false, 2), 2);  // ... and from 16 heads per SM
  EXPECT_EQ(split_of(heads_at(32), 8, false, 4), 2);   // fp32 deep windows
  for (int S = 2; S <= kSplitTwoMaxS; ++S) {           // fp32 token-by-token replay
    EXPECT_EQ(split_of(heads_at(32), S, true), 2) << "S = " << S;
    EXPECT_EQ(split_of(8 * kSms, S, true), 1) << "S = " << S;
  }
  EXPECT_EQ(split_of(heads_at(32), kSplitTwoMaxS + 1, true), 1);
  EXPECT_EQ(split_of(heads_at(32), kSplitTwoMidMinS - 1), 1);  // S = 2: slower with 2
}

TEST(LaunchRules, Fp32WriteAllDraftsSplitFromSixteenHeadsPerSm) {
  for (int64_t heads : {int64_t(16) * kSms, heads_at(128), heads_at(512)}) {
    for (int S = kSplitFourMinS; S <= kSplitFourMaxS; ++S)
      EXPECT_EQ(split_of(heads, S), 4) << "heads = " << heads << ", S = " << S;
    for (int S : {2, 6, 7, 8, 16})
      EXPECT_EQ(split_of(heads, S), 2) << "heads = " << heads << ", S = " << S;
    EXPECT_EQ(split_of(heads, 1), 1) << "heads = " << heads;  // no drafts
    for (int S : {2, 4, 6})
      EXPECT_EQ(split_of(heads, S, false, 2), 1) << "heads = " << heads << ", S = " << S;
    EXPECT_EQ(split_of(heads, 4, true), 1) << "heads = " << heads;  // token-by-token replay
  }
  EXPECT_EQ(split_of(16 * kSms - 1, 4), 2);  // below: four to sixteen heads per SM
  EXPECT_EQ(split_of(16 * kSms - 1, 2), 1);
}

TEST(LaunchRules, ClosedFormForDeepWindowsFromOneHeadPerSm) {
  for (int bytes : {2, 4}) {  // from four heads per SM every state dtype decides alike
    EXPECT_FALSE(use_closed_form(kClosedFormMinS, 4 * kSms - 1, kSms, bytes));  // S = 6, 7
    EXPECT_TRUE(use_closed_form(kClosedFormMinS, 4 * kSms, kSms, bytes));
    EXPECT_TRUE(use_closed_form(9, heads_at(128), kSms, bytes));
    EXPECT_FALSE(use_closed_form(kClosedFormMinS - 1, heads_at(128), kSms, bytes));
    EXPECT_FALSE(use_closed_form(9, kSms - 1, kSms, bytes));
    EXPECT_TRUE(use_closed_form(6, heads_at(32), kSms, bytes));  // T = 6, 7: faster in closed form
    EXPECT_FALSE(use_closed_form(5, heads_at(512), kSms, bytes));  // T = 5: slower
  }
  // Deep windows below two heads per SM: a 16-bit state in closed form, fp32 token by token.
  EXPECT_TRUE(use_closed_form(kClosedFormSmallBatchMinS, kSms, kSms, 2));
  EXPECT_TRUE(use_closed_form(kClosedFormSmallBatchMinS, heads_at(8), kSms, 2));
  EXPECT_FALSE(use_closed_form(kClosedFormSmallBatchMinS, heads_at(8), kSms, 4));  // 1.9 per SM
  EXPECT_FALSE(use_closed_form(kClosedFormSmallBatchMinS, 2 * kSms - 1, kSms, 4));
  EXPECT_TRUE(use_closed_form(kClosedFormSmallBatchMinS, 2 * kSms, kSms, 4));
}

TEST(LaunchRules, TensorCoreClosedFormFor16BitWindows) {
  EXPECT_TRUE(tensor_core_capable(2, kTensorCoreMaxS));       // bf16 and fp16 states
  EXPECT_FALSE(tensor_core_capable(2, kTensorCoreMaxS + 1));  // two mma tiles of tokens
  EXPECT_FALSE(tensor_core_capable(4, 4));                    // fp32 states
  const auto tc = [](int S, int64_t heads) { return use_closed_form(S, heads, kSms, 2, true); };
  EXPECT_FALSE(tc(kTensorCoreMinS - 1, heads_at(512)));  // S = 3: token by token everywhere
  EXPECT_FALSE(tc(kTensorCoreMinS, kTensorCoreMinSHeadsPerSm * kSms - 1));
  EXPECT_TRUE(tc(kTensorCoreMinS, kTensorCoreMinSHeadsPerSm * kSms));
  EXPECT_FALSE(tc(4, heads_at(8)));  // 1.9 heads per SM: as fast either way
  EXPECT_TRUE(tc(4, heads_at(12)));  // 2.9 heads per SM: 6 % faster
  EXPECT_TRUE(tc(5, heads_at(16)));  // 3.9 heads per SM: 10 % faster
  EXPECT_TRUE(tc(4, heads_at(32)));
  EXPECT_FALSE(tc(kTensorCoreAnyBatchMinS, kSms - 1));
  EXPECT_TRUE(tc(kTensorCoreAnyBatchMinS, kSms));
  EXPECT_TRUE(tc(kTensorCoreMaxS, heads_at(8)));
}

TEST(LaunchRules, TensorCoreFormAtEightPerSmWhereItSavesAWave) {
  const auto eight = [](int S, int64_t heads, bool fits = true) {
    return use_tensor_core_eight(S, heads, kSms, fits);
  };
  EXPECT_EQ(form_ctas_per_sm(false, true), kTensorCoreEightCtasPerSm);
  EXPECT_TRUE(eight(4, heads_at(32)));    // 7.75 heads per SM: one wave of 8 instead of two of 6
  EXPECT_TRUE(eight(5, heads_at(64)));    // 15.5 per SM: 2 waves instead of 3
  EXPECT_TRUE(eight(4, heads_at(128)));   // 31 per SM: 4 waves instead of 6
  EXPECT_FALSE(eight(4, 6 * kSms));       // 6 per SM: one wave either way
  EXPECT_FALSE(eight(4, heads_at(512)));  // 124 per SM: beyond kTensorCoreEightMaxHeadsPerSm
  EXPECT_FALSE(eight(kTensorCoreEightMaxS + 1, heads_at(32)));  // S >= 6: slower
  EXPECT_FALSE(eight(4, heads_at(32), false));                  // shared memory holds fewer
}

TEST(LaunchRules, SingleTokenFormWhereItSavesAWave) {
  const auto single = [](int64_t heads) {
    return use_single_token(2, false, 1, heads, kSms, true);
  };
  EXPECT_TRUE(single(heads_at(32)));    // 7.75 heads per SM: one wave of 8 instead of two of 6
  EXPECT_TRUE(single(heads_at(128)));   // 31 per SM: 4 waves instead of 6
  EXPECT_FALSE(single(heads_at(16)));   // 3.9 per SM: one wave either way
  EXPECT_FALSE(single(6 * kSms));       // 6 per SM: one wave either way
  EXPECT_FALSE(single(heads_at(256)));  // 62 per SM: beyond kSingleTokenMaxHeadsPerSm
  EXPECT_FALSE(use_single_token(4, false, 1, heads_at(32), kSms, true));   // fp32 state
  EXPECT_FALSE(use_single_token(2, true, 1, heads_at(32), kSms, true));    // replay
  EXPECT_FALSE(use_single_token(2, false, 2, heads_at(32), kSms, true));   // drafts
  EXPECT_FALSE(use_single_token(2, false, 1, heads_at(32), kSms, false));  // does not fit
}

TEST(LaunchRules, SixteenBitReplayStagesFirstFromOneToSixteenHeadsPerSm) {
  EXPECT_FALSE(use_replay_stage_first(2, false, heads_at(1), kSms));  // 0.24 per SM
  EXPECT_FALSE(use_replay_stage_first(2, false, kSms - 1, kSms));
  EXPECT_TRUE(use_replay_stage_first(2, false, kSms, kSms));
  EXPECT_TRUE(use_replay_stage_first(2, false, heads_at(8), kSms));   // 1.9 per SM
  EXPECT_TRUE(use_replay_stage_first(2, false, heads_at(32), kSms));  // 7.75 per SM
  EXPECT_TRUE(use_replay_stage_first(2, false, 16 * kSms - 1, kSms));
  EXPECT_FALSE(use_replay_stage_first(2, false, 16 * kSms, kSms));
  EXPECT_FALSE(use_replay_stage_first(2, false, heads_at(128), kSms));  // 31 per SM
  EXPECT_FALSE(use_replay_stage_first(2, true, heads_at(32), kSms));    // closed form
  EXPECT_FALSE(use_replay_stage_first(4, false, heads_at(32), kSms));   // fp32: always staged first
}

TEST(LaunchRules, TokenByTokenReplayHoldsFourRowsFromSixteenHeadsPerSm) {
  EXPECT_FALSE(use_replay_four_rows(false, heads_at(8), kSms));   // 1.9 per SM
  EXPECT_FALSE(use_replay_four_rows(false, heads_at(32), kSms));  // 7.75 per SM
  EXPECT_FALSE(use_replay_four_rows(false, 16 * kSms - 1, kSms));
  EXPECT_TRUE(use_replay_four_rows(false, 16 * kSms, kSms));
  EXPECT_TRUE(use_replay_four_rows(false, heads_at(128), kSms));  // 31 per SM
  EXPECT_TRUE(use_replay_four_rows(false, heads_at(512), kSms));  // 124 per SM
  EXPECT_FALSE(use_replay_four_rows(true, heads_at(128), kSms));  // closed form
}

// choose_form: one form per launch, with the closed form before the single-token form before the
// token-by-token variants.
TEST(LaunchRules, OneFormPerLaunch) {
  auto form = [](bool replay, int bytes, int S, int64_t B, bool tc_image = true,
                 bool single_fits = true) {
    return choose_form(replay, bytes, S, heads_at(B), kSms, tc_image, single_fits);
  };
  // Write-all: the standard form, or the single-token form of a 16-bit state without drafts.
  EXPECT_EQ(form(false, 4, 4, 128), kStandardForm);
  EXPECT_EQ(form(false, 4, 1, 32), kStandardForm);               // fp32: no single-token form
  EXPECT_EQ(form(false, 2, 1, 32), kSingleTokenForm);            // 7.75 heads per SM: a wave fewer
  EXPECT_EQ(form(false, 2, 1, 32, true, false), kStandardForm);  // eight do not fit
  EXPECT_EQ(form(false, 2, 2, 32), kStandardForm);               // drafts
  EXPECT_EQ(form(false, 2, 8, 512), kStandardForm);              // never a replay form
  // Replay: the closed form for deep windows, on tensor cores for a 16-bit state with an image.
  EXPECT_EQ(form(true, 4, 8, 32), kClosedFormRows);
  EXPECT_EQ(form(true, 2, 8, 32), kTensorCoreForm);
  EXPECT_EQ(form(true, 2, 8, 32, false), kClosedFormRows);  // no sm_80 image
  EXPECT_EQ(form(true, 2, 4, 32), kTensorCoreForm);         // S = 4 from two heads per SM
  EXPECT_EQ(form(true, 2, 4, 32, false), kStageFirstForm);  // ... else token by token
  EXPECT_EQ(form(true, 2, 9, 32), kClosedFormRows);         // past one mma tile
  // Token by token: tokens first (16-bit, one to sixteen heads per SM), four rows from sixteen.
  EXPECT_EQ(form(true, 2, 2, 8), kStageFirstForm);
  EXPECT_EQ(form(true, 2, 2, 1), kStandardForm);
  EXPECT_EQ(form(true, 2, 2, 128), kFourRowsForm);
  EXPECT_EQ(form(true, 4, 2, 128), kFourRowsForm);
  EXPECT_EQ(form(true, 4, 2, 8), kStandardForm);
  EXPECT_EQ(form(true, 4, 1, 32), kStandardForm);  // replay has no single-token form
  EXPECT_TRUE(is_closed_form(kTensorCoreEightForm) && is_tensor_core_form(kTensorCoreEightForm));
  EXPECT_FALSE(is_closed_form(kFourRowsForm) || is_tensor_core_form(kClosedFormRows));
}

TEST(LaunchRules, ChunkBuffers) {
  EXPECT_EQ(choose_buffers(2, heads_at(1), kSms, false, false, true),
            kMaxChunks);  // 16-bit: one per chunk
  EXPECT_EQ(choose_buffers(2, heads_at(128), kSms, false, false, true), kMaxChunks);
  EXPECT_EQ(choose_buffers(4, heads_at(8), kSms, false, false, true),
            2);  // fp32 below 4 heads per SM
  EXPECT_EQ(choose_buffers(4, heads_at(32), kSms, false, false, true), 3);
  EXPECT_EQ(choose_buffers(4, heads_at(8), kSms, true, false, true), 2);  // replay
  EXPECT_EQ(choose_buffers(4, heads_at(128), kSms, true, false, true), 1);
  EXPECT_EQ(choose_buffers(2, heads_at(128), kSms, true, false, true), 2);
  EXPECT_EQ(choose_buffers(2, heads_at(128), kSms, true, true, true), 1);  // closed form
  EXPECT_EQ(choose_buffers(2, heads_at(8), kSms, true, true, true), 2);
  // Plain loads never stream through one buffer (the refill would race the other warps' reads).
  for (const int state_bytes : {2, 4})
    for (const int64_t B : {1, 8, 32, 128, 512})
      for (const bool replay : {false, true})
        EXPECT_GE(choose_buffers(state_bytes, heads_at(B), kSms, replay, false, false), 2)
            << state_bytes << " " << B << " " << replay;
}

TEST(LaunchRules, ChunkRingIsRemainderAndPhase) {
  for (int chunks = 1; chunks <= kMaxChunks; ++chunks)
    for (int buffers = 1; buffers <= chunks; ++buffers)
      for (int c = 0; c < chunks; ++c) {
        const ChunkSlot ring = chunk_ring(c, buffers);
        EXPECT_EQ(ring.buffer, c % buffers) << "c " << c << " buffers " << buffers;
        EXPECT_EQ(ring.parity, uint32_t(c / buffers) & 1u) << "c " << c << " buffers " << buffers;
      }
}

TEST(LaunchRules, EvictHintsOffOnlyForLargeFp32Batches) {
  EXPECT_TRUE(use_evict_hints(2, false, heads_at(512), kSms));
  EXPECT_TRUE(use_evict_hints(4, false, 16 * kSms - 1, kSms));
  EXPECT_FALSE(use_evict_hints(4, false, 16 * kSms, kSms));
  EXPECT_FALSE(use_evict_hints(4, false, heads_at(128), kSms));
  EXPECT_TRUE(use_evict_hints(4, true, heads_at(128), kSms));  // replay in closed form keeps them
}

// CTAs of `dynamic` bytes each that fit an SM (128-byte allocation units plus the reserve).
int64_t resident(size_t dynamic) {
  const size_t unit = kSharedAllocationUnit;
  return int64_t(kSharedPerSm / ((dynamic + unit - 1) / unit * unit + kReserved));
}

TEST(LaunchRules, SharedMemorySpreadsEachWaveUpToClustersOfTwo) {
  const size_t needed = 30000;  // seven fit an SM; the register budget allows six
  const auto bytes = [&](int64_t heads, int split, bool single_token = false) {
    return launch_shared_bytes(needed, heads, split, form_ctas_per_sm(single_token), kSms,
                               kSharedPerSm, kReserved);
  };
  EXPECT_EQ(resident(bytes(heads_at(16), 1)), 4);  // 512 CTAs: at most 4 per SM
  EXPECT_EQ(resident(bytes(heads_at(8), 2)), 4);   // 512 CTAs in clusters of 2
  EXPECT_EQ(resident(bytes(100, 1)), 1);
  EXPECT_EQ(bytes(heads_at(1), 8), needed);        // clusters of 8: as requested
  EXPECT_EQ(bytes(heads_at(4), 4), needed);        // clusters of 4
  EXPECT_EQ(resident(bytes(heads_at(32), 1)), 4);  // 1024 CTAs: two waves of 4 per SM, not of 6
  EXPECT_EQ(bytes(6 * kSms, 1), needed);           // six per SM: full already
  EXPECT_EQ(bytes(12 * kSms, 1), needed);          // two full waves
  // The single-token form's budget is eight per SM: seven per SM are padded to seven.
  EXPECT_EQ(resident(launch_shared_bytes(20000, 7 * kSms, 1, kSingleTokenCtasPerSm, kSms,
                                         kSharedPerSm, kReserved)),
            7);
}

TEST(LaunchRules, ClosedFormKeepsItsWavesWithFewerCtasPerSm) {
  const size_t needed = 45184;  // closed form, S = 8, fp32: five fit an SM
  const auto closed = [&](int64_t heads) {
    return resident(
        launch_shared_bytes(needed, heads, 1, kMinCtasPerSm, kSms, kSharedPerSm, kReserved));
  };
  EXPECT_EQ(closed(heads_at(32)), 4);   // 1024 CTAs: two waves of 5 per SM or of 4
  EXPECT_EQ(closed(heads_at(64)), 4);   // 2048: four waves either way
  EXPECT_EQ(closed(heads_at(128)), 5);  // 4096: seven waves of 5, eight of 4
  EXPECT_EQ(closed(heads_at(512)), 5);  // 16384: 25 waves of 5
  EXPECT_EQ(closed(heads_at(8)), 2);    // 256: one wave, the even share
}

}  // namespace
}  // namespace gdn::decode_mtp::cuda_detail
