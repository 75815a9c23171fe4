// The CUDA decode_mtp launcher's rules (gdn/decode_mtp/cuda.cuh): the kernel's CTA shape and
// occupancy budget, and the pure functions of the shapes and the device that pick a launch's kernel
// form, head split, chunk buffers, L2 hints and shared memory. Host only and free of CUDA headers,
// so that the CPU tests pin every rule (tests/cpp/test_launch_rules.cpp). Each threshold is where
// the choice measured faster on an H200; docs/cuda-kernels.md ("Launch rules") gives the figures.
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
// advance_rows_scaled) is bound by latency and issue more than by bytes, so its launcher picks the
// chunk buffers that let as many CTAs fit (choose_buffers): six at S <= 5.
inline constexpr int kMinCtasPerSm = 6;
// Decode without drafts (S = 1) with a 16-bit state (WriteAllForm::kSingleToken): T and S are
// compile-time 1 and the register budget 64, so that eight CTAs fit an SM with three chunk buffers
// (use_single_token says when).
inline constexpr int kSingleTokenCtasPerSm = 8;
inline constexpr int kSingleTokenBuffers = 3;

// The closed form on tensor cores with windows of up to kTensorCoreEightMaxS columns, whose shared
// memory fits eight CTAs per SM, has a form at a register budget of 64 for eight
// (ClosedFormMath::kTensorCoresEightCtas; use_tensor_core_eight says when).
inline constexpr int kTensorCoreEightCtasPerSm = 8;

// ---- kernel forms ----------------------------------------------------------------------------
// A launch runs one kernel form: a mode (write-all, token-by-token replay, closed-form replay,
// each its own __global__ function) and the mode's variant, chosen by the rules below. Each form
// is compiled per state dtype, head ratio and kernel image; an enum, not a flag, names each
// choice, so a combination that does not exist cannot be written.
enum class WriteAllForm : int {
  kStandard,
  kSingleToken,  // a 16-bit state without drafts: T = S = 1 compiled in (use_single_token)
};
enum class ReplayTokensForm : int {
  kStandard,     // the slice's first chunks go out first, then the tokens are staged
  kTokensFirst,  // a 16-bit state: the tokens are staged first (use_replay_stage_first)
  kFourRows,     // 4 rows per lane: half the k and q loads per token (use_replay_four_rows)
};
enum class ClosedFormMath : int {
  kCudaCores,
  kTensorCores,           // a 16-bit state, S <= kTensorCoreMaxS (use_closed_form)
  kTensorCoresEightCtas,  // the same at eight CTAs per SM (use_tensor_core_eight)
};
// What an image of a form knows at compile time besides the form.
enum class KernelImage : int {
  kRuntimeDtypes,    // activation dtypes and the pool layout come from KernelArgs
  kBf16Activations,  // replay with bf16 activations (use_bf16_activations)
  kAlignedKv,        // a 16-byte aligned "kv" pool, run-time head ratio (KernelArgs::kv_vector)
};

// CTAs per SM that a kernel form's register budget allows (its __launch_bounds__). The closed
// form on tensor cores otherwise keeps six: seven gains nothing, and eight spill at S >= 6.
GDN_HOST_DEVICE constexpr int form_ctas_per_sm(bool single_token, bool tensor_core_eight = false) {
  return single_token        ? kSingleTokenCtasPerSm
         : tensor_core_eight ? kTensorCoreEightCtasPerSm
                             : kMinCtasPerSm;
}

// Chunk buffers per CTA. Write-all: a 16-bit slice keeps one per chunk. An fp32 slice streams its
// 4 chunks through 3 (4 CTAs fit an SM instead of 3), except for small batches (fewer than 4 heads
// per SM), where 2 buffers are faster at T > 1. Replay, whose CTAs also stage up to 2S tokens and
// are bound by latency and issue more than by bytes, wants as many CTAs per SM as its registers
// allow (kMinCtasPerSm; shared memory allows them at S <= 5): 2 buffers, and 1 from 4 heads per SM
// for an fp32 slice and for the closed form of any state, so that one more CTA fits. Plain loads
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
// an fp32 state at batches of at least 16 heads per SM, written all or replayed token by token,
// which streams faster without them; smaller batches, 16-bit states and the closed form are as
// fast or faster with them.
inline bool use_evict_hints(int state_bytes, bool closed_form, int64_t heads, int sm_count) {
  return state_bytes != 4 || closed_form || heads < 16 * int64_t(sm_count);
}

// Replay's form: the closed form (replay_closed_form_kernel) for deep windows once every SM has a
// head, token by token otherwise. The closed form's per-CTA solve costs latency that small batches
// cannot hide, and below S = 6 its shorter token loop does not pay for it. S = 6 and 7 take it from
// four heads per SM, S >= 8 from one. An fp32 state takes it from two heads per SM: below that its
// token-by-token kernel, which stages the activations before the slice's bytes and splits every
// head over 2 CTAs, is faster at S = 8 as well.
inline constexpr int kClosedFormMinS = 6;
inline constexpr int kClosedFormMinSHeadsPerSm = 4;  // S = 6, 7 take it from this many heads per SM
inline constexpr int kClosedFormSmallBatchMinS = 8;  // one (fp32: two) to four heads per SM
inline constexpr int kClosedFormFp32MinHeadsPerSm = 2;
// A 16-bit state with windows of up to kTensorCoreMaxS columns (tensor_cores: the rows phase on
// tensor cores, tensor_core_capable) takes the closed form from S = 6 at one head per SM and from
// S = 4 at two, where it is faster than token by token; at S <= 3 the solve does not pay for
// itself.
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

// The closed form's rows phase on tensor cores (ClosedFormMath::kTensorCores): a 16-bit state (bf16
// or fp16, exact in the mma's inputs of its dtype) with windows of up to kTensorCoreMaxS columns.
inline bool tensor_core_capable(int state_bytes, int S) {
  return state_bytes == 2 && S <= kTensorCoreMaxS;
}

// The single-token form: decode without drafts (S = 1) with a 16-bit state, where eight of its CTAs
// fit an SM (`fits`: shared memory; the standard form holds six, at 80 registers) and they take
// fewer waves than the standard form's, up to kSingleTokenMaxHeadsPerSm heads per SM. The last
// wave of a launch is latency-bound, so one wave fewer pays for the form's slower CTAs (three chunk
// buffers, local-memory spills at 64 registers); with as many waves it is slower.
inline constexpr int kSingleTokenMaxHeadsPerSm = 32;
inline bool use_single_token(int state_bytes, bool replay, int S, int64_t heads, int sm_count,
                             bool fits) {
  if (replay || state_bytes != 2 || S != 1 || !fits ||
      heads > kSingleTokenMaxHeadsPerSm * int64_t(sm_count))
    return false;
  return launch_waves(heads, sm_count, kSingleTokenCtasPerSm) <
         launch_waves(heads, sm_count, kMinCtasPerSm);
}

// The tensor-core closed form at eight CTAs per SM (kTensorCoreEightCtasPerSm; its 64 registers
// spill a few bytes) for windows of up to kTensorCoreEightMaxS columns, where shared memory fits
// eight (`fits`) and they take fewer waves than six, up to kTensorCoreEightMaxHeadsPerSm heads per
// SM; deeper windows spill more and are slower.
inline constexpr int kTensorCoreEightMaxS = 5;
inline constexpr int kTensorCoreEightMaxHeadsPerSm = 32;
inline bool use_tensor_core_eight(int S, int64_t heads, int sm_count, bool fits) {
  if (S > kTensorCoreEightMaxS || !fits ||
      heads > kTensorCoreEightMaxHeadsPerSm * int64_t(sm_count))
    return false;
  return launch_waves(heads, sm_count, kTensorCoreEightCtasPerSm) <
         launch_waves(heads, sm_count, kMinCtasPerSm);
}

// Token-by-token replay of a 16-bit state stages its tokens before the slice's first chunks
// (ReplayTokensForm::kTokensFirst; an fp32 state always does) from one to sixteen heads per SM,
// where its CTAs otherwise wait for their few activation bytes behind the slices' bulk copies.
// Below one head per SM and from sixteen it keeps the chunks first, which is faster there.
inline constexpr int kReplayStageFirstMaxHeadsPerSm = 16;
inline bool use_replay_stage_first(int state_bytes, bool closed_form, int64_t heads, int sm_count) {
  return state_bytes == 2 && !closed_form && heads >= sm_count &&
         heads < kReplayStageFirstMaxHeadsPerSm * int64_t(sm_count);
}

// Token-by-token replay keeps 4 rows per lane instead of 2 (ReplayTokensForm::kFourRows) from
// kReplayFourRowsMinHeadsPerSm heads per SM: each token's k and q then take half the shared-memory
// loads (the largest share of the kernel's shared-memory traffic) for twice the shuffles, which
// pays where the launch is bound by throughput rather than latency.
inline constexpr int kReplayFourRowsMinHeadsPerSm = 16;
inline bool use_replay_four_rows(bool closed_form, int64_t heads, int sm_count) {
  return !closed_form && heads >= kReplayFourRowsMinHeadsPerSm * int64_t(sm_count);
}

// The kernel forms a launch may take, numbered for the launcher's per-form caches: write-all's in a
// write-all launch, the replay forms (token by token or closed form) in a replay launch.
enum KernelForm : int {
  kStandardForm = 0,  // WriteAllForm::kStandard or ReplayTokensForm::kStandard
  kClosedFormRows = 1,
  kSingleTokenForm = 2,
  kStageFirstForm = 3,
  kTensorCoreForm = 4,
  kTensorCoreEightForm = 5,
  kFourRowsForm = 6,
  kKernelForms = 7
};
GDN_HOST_DEVICE constexpr bool is_closed_form(int form) {
  return form == kClosedFormRows || form == kTensorCoreForm || form == kTensorCoreEightForm;
}
GDN_HOST_DEVICE constexpr bool is_tensor_core_form(int form) {
  return form == kTensorCoreForm || form == kTensorCoreEightForm;
}

// The kernel form of a launch, in one place. tensor_core_image: the device runs the tensor-core
// closed form's image (an sm_80 or later image); single_token_fits: eight single-token CTAs fit an
// SM's shared memory. The eight-CTA tensor-core form needs the launch's shared memory, so the
// launcher upgrades kTensorCoreForm to it afterwards (use_tensor_core_eight).
inline KernelForm choose_form(bool replay, int state_bytes, int S, int64_t heads, int sm_count,
                              bool tensor_core_image, bool single_token_fits) {
  const bool tensor_core_state = tensor_core_capable(state_bytes, S) && tensor_core_image;
  if (replay && use_closed_form(S, heads, sm_count, state_bytes, tensor_core_state))
    return tensor_core_state ? kTensorCoreForm : kClosedFormRows;
  if (use_single_token(state_bytes, replay, S, heads, sm_count, single_token_fits))
    return kSingleTokenForm;
  if (replay && use_replay_stage_first(state_bytes, false, heads, sm_count)) return kStageFirstForm;
  if (replay && use_replay_four_rows(false, heads, sm_count)) return kFourRowsForm;
  return kStandardForm;
}

// CTAs per head: 1 once every SM has a head, else the smallest split that gives every SM a CTA
// (small batches are latency-bound: more, smaller CTAs pull their bytes in parallel). The measured
// exceptions, in the order the function tests them:
// - deep windows (S >= 8) from four heads per SM take 2 (not the closed form, whose per-CTA solve a
//   split would repeat, nor a 16-bit state below sixteen heads per SM): a CTA stages the same
//   tokens for half the rows, so twice as many CTAs fit an SM's shared memory;
// - write-all of an fp32 state with drafts from sixteen heads per SM takes 4 at S = 3..5 (each
//   CTA then holds one 8-row group per warp, the shape that streams densest) and 2 otherwise;
// - write-all with S = 3..7 from four to sixteen heads per SM takes 2;
// - token-by-token replay of an fp32 state at S <= 4 from four to eight heads per SM takes 2;
// - between one and two heads per SM, where the launch is latency-bound, every launch but the
//   closed form takes 2, spread evenly over the SMs;
// - write-all of an fp32 state with drafts takes 2 from two to four heads per SM, and just below
//   one head per SM, where 2 CTAs a head leave at most a sixteenth of the SMs without a CTA.
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

// The largest cluster whose launches are spread evenly over the SMs (launch_kernel). Larger
// clusters keep the hardware's placement: padded to spread, clusters of 8 no longer all fit at
// once.
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
