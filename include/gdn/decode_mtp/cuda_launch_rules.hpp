// The CUDA decode_mtp launcher's rules (gdn/decode_mtp/cuda.cuh): the kernel's CTA shape and
// occupancy budget, and the pure functions of the shapes and the device that pick a launch's kernel
// form, head split, chunk buffers, L2 hints and shared memory. Host only and free of CUDA headers,
// so that the CPU tests pin every rule (tests/cpp/test_launch_rules.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gdn/core/host_device.hpp"
#include "gdn/core/occupancy.hpp"

namespace gdn::decode_mtp::cuda_detail {

inline constexpr int kHeadDim = 128;                             // K = V of this kernel
inline constexpr int kRowsPerGroup = 8;                          // V rows a warp holds at a time
inline constexpr int kGroupsPerHead = kHeadDim / kRowsPerGroup;  // 16
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kChunkRows =
    kWarps * kRowsPerGroup;  // rows per bulk copy (one pass of the warps)
inline constexpr int kMaxChunks = kHeadDim / kChunkRows;  // 4
inline constexpr int kMaxSplit = 8;                       // CTAs per head (portable cluster size)
// Register budget: six CTAs per SM (80 registers, no spills) in both modes. Write-all: a 16-bit
// slice at T = 1 fits six by shared memory. Replay (2 rows per lane, the decay as a scalar:
// advance_rows_scaled) is bound by latency and issue more than by bytes, and its launcher picks
// the chunk buffers that let as many CTAs fit (choose_buffers): six at S <= 5 (B = 128, T = 4: fp32
// 5 %, bf16 4 % faster than five at 96 registers; T = 8, where shared memory allows five, 1-3 %
// slower; benchmarks/results/replay_v2_h200.json).
inline constexpr int kMinCtasPerSm = 6;
// Decode without drafts (S = 1) with a 16-bit state (the kernel's kSingleToken form): T and S are
// compile-time 1 and the register budget 64, so that eight CTAs fit an SM with three chunk buffers
// (the launcher's use_single_token says when).
inline constexpr int kSingleTokenCtasPerSm = 8;
inline constexpr int kSingleTokenBuffers = 3;

// The closed form on tensor cores with windows of up to kTensorCoreEightMaxS columns, whose shared
// memory fits eight CTAs per SM, has an image at a register budget of 64 for eight (the kernel's
// kEightCtasPerSm; use_tensor_core_eight says when).
inline constexpr int kTensorCoreEightCtasPerSm = 8;

// CTAs per SM that a kernel form's register budget allows (its __launch_bounds__). The closed
// form on tensor cores otherwise keeps six: seven gained nothing, eight (spilling) was 2-12 %
// slower at S >= 6 (benchmarks/results/replay_tensor_cores_h200.json, run 3).
GDN_HOST_DEVICE constexpr int form_ctas_per_sm(bool single_token, bool tensor_core_eight = false) {
  return single_token        ? kSingleTokenCtasPerSm
         : tensor_core_eight ? kTensorCoreEightCtasPerSm
                             : kMinCtasPerSm;
}

// Chunk buffers per CTA. Write-all: a 16-bit slice keeps one per chunk. An fp32 slice streams its
// 4 chunks through 3 (4 CTAs fit an SM instead of 3), except for small batches (fewer than 4 heads
// per SM), where 2 buffers measured faster at T > 1 (H200, benchmarks/results/tuning_v2.json:
// T = 4, B = 8: 28.6 us with 2, 32.5 us with 3; B = 32: 104 us with 2, 97 us with 3). Replay, whose
// CTAs also stage up to 2S tokens and are bound by latency and issue more than by bytes, wants as
// many CTAs per SM as its registers allow (kMinCtasPerSm; shared memory allows them at S <= 5): 2
// buffers, and 1 for an fp32 slice from 4 heads per SM (fp32, B = 128: T = 4 6 % and T = 8 21 %
// faster than 2 buffers at 4 CTAs per SM; benchmarks/results/replay_v2_h200.json) and for the
// closed form of any state from 4 heads per SM (bf16 T = 8: six CTAs per SM instead of five, B =
// 128 3.2 % and B = 512 2.1 % faster; benchmarks/results/closed_form_smem_h200.json). Plain loads
// (bulk = false: the "kv" layout, unaligned pools, no sm_90 image) take at least 2: their CTA
// refills a buffer right after the barrier of the previous chunk, which ensures that every warp has
// read the chunk the buffer held only when that chunk is not the previous one.
inline int choose_buffers(int state_bytes, int64_t heads, int sm_count, bool replay,
                          bool closed_form, bool bulk) {
  const bool small_batch = heads < 4 * int64_t(sm_count);
  if (replay) return (state_bytes == 4 || closed_form) && !small_batch && bulk ? 1 : 2;
  if (state_bytes != 4) return kMaxChunks;
  return small_batch ? 2 : 3;
}

// Chunk c's buffer, c % buffers, and the phase of that buffer's barrier, (c / buffers) & 1, in the
// kernel's chunk loop, without a division by the runtime buffer count (a signed division per
// chunk and warp) or counters carried through the loop (which the 80-register kernels spill): a
// CTA has at most kMaxChunks = 4 chunks, so c < 2 buffers whenever buffers >= 2.
struct ChunkSlot {
  int buffer;
  uint32_t parity;
};
static_assert(kMaxChunks <= 4, "chunk_ring: c < 2 buffers unless buffers == 1");
GDN_HOST_DEVICE constexpr ChunkSlot chunk_ring(int c, int buffers) {
  const bool wrapped = c >= buffers;
  return {buffers == 1 ? 0
          : wrapped    ? c - buffers
                       : c,
          buffers == 1 ? uint32_t(c) & 1u : uint32_t(wrapped)};
}

// L2 eviction hints on the state stream (evict-first bulk loads, streaming stores): on, except for
// an fp32 state at batches of at least 16 heads per SM, which stream faster without them (H200,
// write-all fp32 T = 1: B = 128 143 vs 146 us, B = 512 548 vs 572 us; smaller batches and 16-bit
// states are as fast or faster with them; benchmarks/results/tuning_v3_hints.json). The same holds
// for token-by-token replay (fp32, B = 128 and 512, T = 2 and 4: 2.0-2.7 % faster without them);
// replay in closed form keeps them (T = 8: 1.5-1.9 % slower without; replay_hints_h200.json).
inline bool use_evict_hints(int state_bytes, bool closed_form, int64_t heads, int sm_count) {
  return state_bytes != 4 || closed_form || heads < 16 * int64_t(sm_count);
}

// Replay's form (the kernel's kClosedForm): the closed form for deep windows once every SM has a
// head, token by token otherwise. The closed form's per-CTA solve costs latency that small
// batches cannot hide, and at S < 6 its shorter token loop does not pay for it (H200, one head per
// CTA, against token by token: T = 8, B = 32 to 512 10-13 % faster, B = 8 4 %; T = 4, B = 128
// fp32 7 % slower, B = 1 25-40 % slower; benchmarks/results/replay_closed_form_h200.json). S = 6
// and 7 take it from four heads per SM, where it was measured (TP1, B = 32 to 512, fp32 and bf16:
// T = 6 2.3-5.9 % and T = 7 2.1-5.0 % faster; T = 5 up to 6.6 % slower); below that they stay
// token by token (closed form at 1.2-1.9 heads per SM 5-23 % slower, at 2.9-3.9 -5..+4 %;
// benchmarks/results/closed_form_min_s_h200.json). An fp32 state takes it from two heads per SM:
// its token-by-token kernel stages the activations before the slice's bytes (the kernel's
// kActivationsFirst) and below two heads per SM, where it splits every head over 2 CTAs, is the
// faster form at S = 8 as well (T = 8, B = 8: 34.2 -> 31.6 us; at B = 32 the closed form stays
// 13 % faster; benchmarks/results/replay_closed_form_fp32_h200.json).
inline constexpr int kClosedFormMinS = 6;
inline constexpr int kClosedFormMinSHeadsPerSm = 4;  // S = 6, 7 take it from this many heads per SM
inline constexpr int kClosedFormSmallBatchMinS = 8;  // one (fp32: two) to four heads per SM
inline constexpr int kClosedFormFp32MinHeadsPerSm = 2;
// A 16-bit state with windows of up to kTensorCoreMaxS columns (tensor_cores: the kernel's rows
// phase on tensor cores, tensor_core_capable) takes the closed form from S = 6 at one head per SM
// and from S = 4 at two, where it was measured faster than token by token (H200, B = 8 to 512,
// TP1, TP4 and ratio 3 and 8 shapes, against the FMA closed form at S = 8 and token by token
// below: S = 7 and 8 14-20 % faster from two heads per SM and 2.5-5 % at two, S = 6 12-17 % from
// four and 1-3 % at two, S = 5 10-18 % from four, S = 4 5-10 % from eight and 3-6 % slower at
// two; S = 3 from -2 to +4 % and S = 2 13-27 % slower from four heads per SM;
// benchmarks/results/replay_tensor_cores_h200.json). S = 4 and 5 take it from two heads per SM
// (TP1 B = 12 and 16, 2.9 and 3.9 heads per SM: S = 4 6.0-6.3 %, S = 5 10.4-11.5 % faster; from
// four heads per SM as before; run4_min_heads of the same file).
inline constexpr int kTensorCoreMaxS = 8;  // n <= 8 replayed, m <= 16 staged: one mma tile
inline constexpr int kTensorCoreMinS = 4;
inline constexpr int kTensorCoreAnyBatchMinS = 6;    // from one head per SM
inline constexpr int kTensorCoreMinSHeadsPerSm = 2;  // S = 4, 5 from this many heads per SM
inline bool use_closed_form(int S, int64_t heads, int sm_count, int state_bytes,
                            bool tensor_cores = false) {
  const int64_t sms = sm_count;
  if (tensor_cores)
    return S >= kTensorCoreMinS &&
           heads >= (S >= kTensorCoreAnyBatchMinS ? 1 : kTensorCoreMinSHeadsPerSm) * sms;
  if (heads < (state_bytes == 4 ? kClosedFormFp32MinHeadsPerSm : 1) * sms) return false;
  return S >= kClosedFormSmallBatchMinS ||
         (S >= kClosedFormMinS && heads >= kClosedFormMinSHeadsPerSm * sms);
}

// The closed form's rows phase on tensor cores (the kernel's kTensorCores): a 16-bit state (bf16 or
// fp16, exact in the mma's inputs of its dtype) with windows of up to kTensorCoreMaxS columns.
inline bool tensor_core_capable(int state_bytes, int S) {
  return state_bytes == 2 && S <= kTensorCoreMaxS;
}

// The single-token form (the kernel's kSingleToken): decode without drafts (S = 1) with a 16-bit
// state, where eight of its CTAs fit an SM (`fits`: shared memory; the regular kernel holds six,
// at 80 registers) and they take fewer waves than the regular kernel's, up to
// kSingleTokenMaxHeadsPerSm heads per SM. The last wave of a launch is latency-bound, so one wave
// fewer pays for the form's slower CTAs (three chunk buffers, local-memory spills at 64 registers);
// with as many waves it is slower (H200, bf16, T = 1, against the regular kernel: 7.75 heads per
// SM 18-19 % faster, 15.5 6-8 %, 23 3 %, 31 0-1 %, 62 1.4 % slower; at 5.8, one wave either way,
// 14-15 % slower, from where the hardware placed the CTAs:
// benchmarks/results/single_token_h200.json, cta_spread_h200.json).
inline constexpr int kSingleTokenMaxHeadsPerSm = 32;
inline bool use_single_token(int state_bytes, bool replay, int S, int64_t heads, int sm_count,
                             bool fits) {
  if (replay || state_bytes != 2 || S != 1 || !fits ||
      heads > kSingleTokenMaxHeadsPerSm * int64_t(sm_count))
    return false;
  return launch_waves(heads, sm_count, kSingleTokenCtasPerSm) <
         launch_waves(heads, sm_count, kMinCtasPerSm);
}

// The tensor-core closed form's image at eight CTAs per SM (kTensorCoreEightCtasPerSm; its 64
// registers spill a few bytes) for windows of up to kTensorCoreEightMaxS columns, where shared
// memory fits eight (`fits`) and they take fewer waves than six, up to
// kTensorCoreEightMaxHeadsPerSm heads per SM (H200, bf16, against six per SM: TP1 S = 4 and 5,
// B = 32 (7.75 heads per SM) 7-8 %, B = 64 3-4 %, B = 128 1.6-2.1 % faster; TP4 B = 128 (7.75)
// 9-11 %, B = 512 (31) 1.4-4.2 %; at 124 heads per SM -0.4..+1.8 %; S >= 6 2-12 % slower;
// benchmarks/results/replay_tensor_cores_h200.json, run 3).
inline constexpr int kTensorCoreEightMaxS = 5;
inline constexpr int kTensorCoreEightMaxHeadsPerSm = 32;
inline bool use_tensor_core_eight(int S, int64_t heads, int sm_count, bool fits) {
  if (S > kTensorCoreEightMaxS || !fits ||
      heads > kTensorCoreEightMaxHeadsPerSm * int64_t(sm_count))
    return false;
  return launch_waves(heads, sm_count, kTensorCoreEightCtasPerSm) <
         launch_waves(heads, sm_count, kMinCtasPerSm);
}

// Token-by-token replay of a 16-bit state stages its tokens before the slice's first chunks (the
// kernel's kStageFirst image; an fp32 state always does) from one to sixteen heads per SM, where
// its CTAs otherwise wait for their few activation bytes behind the slices' bulk copies (H200,
// T = 2 and 4, B = 8 to 64: bf16 1.5-6.1 %, fp16 3.2-6.1 % faster;
// benchmarks/results/replay_stage_first_h200.json). Elsewhere it keeps the chunks first: staged
// first, B = 1 was 1-4 % and B = 512 1-6 % slower, B = 128 within 2 %
// (benchmarks/results/activations_first_h200.json, runs af and af2).
inline constexpr int kReplayStageFirstMaxHeadsPerSm = 16;
inline bool use_replay_stage_first(int state_bytes, bool closed_form, int64_t heads, int sm_count) {
  return state_bytes == 2 && !closed_form && heads >= sm_count &&
         heads < kReplayStageFirstMaxHeadsPerSm * int64_t(sm_count);
}

// Token-by-token replay keeps 4 rows per lane instead of 2 (the kernel's kFourRows image) from
// kReplayFourRowsMinHeadsPerSm heads per SM: each token's k and q then take half the shared-memory
// loads (their 16-byte loads carried 55 % of the fp32 kernel's shared-memory wavefronts,
// benchmarks/results/profile_b629ae4_h200.json) for twice the shuffles. H200, TP1, against 2 rows,
// two passes each: fp32 B = 128 and 512, T = 2 1.3-2.4 % and T = 4 0.9-1.9 % faster; bf16 T = 2
// B = 128 3.3-4.1 % and B = 512 2.7 % faster (T >= 4 there runs the closed form); below sixteen
// heads per SM mixed (B = 32 -1.8..+0.7 %) or slower (B = 8 fp32 up to 2.8 %);
// benchmarks/results/replay_rows4_fp32_h200.json, replay_rows4_h200.json.
inline constexpr int kReplayFourRowsMinHeadsPerSm = 16;
inline bool use_replay_four_rows(bool closed_form, int64_t heads, int sm_count) {
  return !closed_form && heads >= kReplayFourRowsMinHeadsPerSm * int64_t(sm_count);
}

// CTAs per head: 1 once every SM has a head, else the smallest split that gives every SM a CTA.
// Deep windows (S >= 8) at four or more heads per SM take 2 (not replay in closed form, whose
// per-CTA solve a split would repeat): a CTA stages the same S tokens (2S in replay) for half the
// rows, so twice as many CTAs fit an SM's shared memory (H200, T = 8 with an fp32 state: write-all
// B = 32 5 % faster, token-by-token replay B = 128 and 512 7 %; 16-bit states within 1 % or
// faster; benchmarks/results/split_sweep_h200.json). Between one and two heads per SM, where the
// launch is latency-bound, every launch but the closed form takes 2, spread evenly over the SMs
// (H200, B = 8: replay T = 4 fp32 31.2 -> 28.6 us, bf16 31.8 -> 26.0,
// benchmarks/results/replay_split_h200.json; write-all bf16 T = 1 10.7 -> 9.9, T = 4 19.0 -> 16.9,
// fp32 T = 4 27.7 -> 26.0, fp32 T = 1 13.0 -> 13.2, benchmarks/results/split_b8_h200.json;
// write-all T = 6 and 8: fp32 7.6-7.9 %, bf16 8.4-11.4 % faster than 1,
// benchmarks/results/split_sweep_af_h200.json, a sweep of every split at B = 1 to 32 after the
// kernels began loading activations before the slice; replay from two heads per SM is slower).
// Write-all with S >= 3 from four to sixteen heads per SM also takes 2 (H200, B = 32: fp32 T =
// 4 98.9 -> 92.9 us, T = 3 78.9 -> 75.6, bf16 T = 4 53.0 -> 51.9; B = 64 within 1 %:
// benchmarks/results/split_sweep_s34_h200.json; S = 5..7, not measured, are taken with S = 4 and S
// >= 8; S = 2 at B = 32 and S = 4 at 31 heads per SM measured slower with 2,
// split_sweep_h200.json). Write-all of an fp32 state with drafts (S >= 2) takes 2 from two to four
// heads per SM as well (B = 12 and 16: 1.9-5.6 % faster than 1), and just below one head per SM,
// where 2 CTAs per head leave at most a sixteenth of the SMs without a CTA, 2 rather than 4 (B = 2,
// 64 heads on 132 SMs: T = 2..8 7-14 % faster; 16-bit states are faster with 4;
// split_sweep_af_h200.json). Two exceptions from four heads per SM
// (benchmarks/results/split_sweep_mid_b_h200.json): a 16-bit state with deep windows (S >= 8) below
// sixteen heads per SM keeps 1 (bf16 T = 8: B = 32 93.2 -> 90.9 us, B = 64 179.4 -> 174.6), and
// token-by-token replay of an fp32 state at S <= 4 below eight heads per SM takes 2 (B = 32: T =
// 2 50.7 -> 46.0 us, T = 4 63.4 -> 58.0; at B = 64 T = 4 was 4 % slower with 2; bf16 replay as fast
// or slower).
// From sixteen heads per SM, write-all of an fp32 state with drafts splits too, where the kernels
// that stage their tokens before the slice's bytes measured faster split than whole (H200,
// TP1, B = 128 and 512 in one run, against 1: S = 3..5 take 4, 1.5-2.2 % faster (T = 4, B = 128
// 366.9 -> 361.5 us, B = 512 1459 -> 1430); S = 2 and 6 take 2, 0.8-1.8 % faster; S >= 8 takes 2
// by the deep-window rule; benchmarks/results/split_fp32_drafts_h200.json). Each CTA of a
// four-way split holds one 8-row group per warp, the shape that streams densest
// (state_stream_shapes_h200.json); a 16-bit state gains less than 1 % and keeps 1.
inline constexpr int kSplitFourMinS = 3;  // fp32 write-all from sixteen heads per SM
inline constexpr int kSplitFourMaxS = 5;
inline constexpr int kSplitTwoMaxS = 4;     // fp32 token-by-token replay, four to eight per SM
inline constexpr int kSplitTwoMidMinS = 3;  // write-all, four to sixteen heads per SM
inline constexpr int kSplitTwoMidMaxHeadsPerSm = 16;
inline constexpr int kReplaySplitTwoMaxHeadsPerSm = 8;  // fp32 replay, S <= kSplitTwoMaxS
inline int choose_split(int64_t heads, int sm_count, bool clusters, int S, bool replay,
                        bool closed_form, int state_bytes) {
  if (!clusters) return 1;
  const int64_t sms = sm_count;
  const bool mid = heads >= 4 * sms && heads < kSplitTwoMidMaxHeadsPerSm * sms;
  const bool fp32_drafts = !replay && state_bytes == 4 && S >= 2;  // write-all
  if (S >= 8 && heads >= 4 * sms && !closed_form && !(mid && state_bytes != 4)) return 2;
  if (fp32_drafts && heads >= kSplitTwoMidMaxHeadsPerSm * sms)
    return S >= kSplitFourMinS && S <= kSplitFourMaxS ? 4 : 2;
  if (!replay && S >= kSplitTwoMidMinS && S < 8 && mid) return 2;
  if (replay && !closed_form && state_bytes == 4 && S <= kSplitTwoMaxS && heads >= 4 * sms &&
      heads < kReplaySplitTwoMaxHeadsPerSm * sms)
    return 2;
  if (!closed_form && heads >= sms && heads < 2 * sms) return 2;
  if (fp32_drafts && heads >= 2 * sms && heads < 4 * sms) return 2;
  if (fp32_drafts && heads < sms && 32 * heads >= 15 * sms) return 2;  // 2 CTAs a head fill 15/16
  int split = 1;
  while (split < kMaxSplit && heads * split < sm_count) split *= 2;
  return split;
}

// The largest cluster whose launches are spread evenly over the SMs (launch_kernel). H200, against
// the hardware's placement, same run: B = 16 (512 CTAs) T = 1 bf16 18.4 -> 14.7 us, fp32 25.6 ->
// 21.2, T = 4 10-11 % faster; replay T = 4 and 8, B = 8 (clusters of 2) 7-13 % faster with the
// leaner replay token step; B >= 32 unchanged (+-1.4 %). B = 1 (256 CTAs in clusters of 8, two per
// SM when padded) measured 60-80 % slower, presumably because the clusters no longer all fit at
// once (benchmarks/results/cta_spread_replay_step_h200.json, cta_spread_h200.json).
inline constexpr int kMaxSpreadCluster = 2;

// Dynamic shared memory of a launch of `heads` heads split over `split` CTAs each, whose CTAs need
// `needed` bytes: padded to the even share of the launch's waves (even_share_shared_bytes), except
// for clusters of more than kMaxSpreadCluster CTAs. ctas_per_sm: the form's register budget
// (form_ctas_per_sm).
inline size_t launch_shared_bytes(size_t needed, int64_t heads, int split, int ctas_per_sm,
                                  int sm_count, size_t shared_per_sm, size_t reserved_per_cta) {
  if (split > kMaxSpreadCluster) return needed;
  return even_share_shared_bytes(needed, heads * split, sm_count, shared_per_sm, reserved_per_cta,
                                 ctas_per_sm);
}

}  // namespace gdn::decode_mtp::cuda_detail
