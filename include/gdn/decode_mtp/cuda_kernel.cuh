// decode_mtp on CUDA (K = V = 128): the kernels. The launcher is in gdn/decode_mtp/cuda.cuh.
//
// Forms. Each mode is a kernel of its own: write_all_kernel (decode and MTP verify, the state after
// every token to its slot), replay_tokens_kernel (replay verify token by token) and
// replay_closed_form_kernel (replay verify with the window's triangle solved once). Their template
// arguments name the form (WriteAllForm, ReplayTokensForm, ClosedFormMath) and the kernel image
// (KernelImage), which the launch rules choose (cuda_launch_rules.hpp, choose_form); BodyTraits
// derives the switches of the shared body from them, so a combination that does not exist cannot
// be instantiated.
//
// Mapping. One CTA of 128 threads per (request, value head, row block): the head's 128 V rows
// are split over `split` CTAs (1, 2, 4 or 8; a thread-block cluster when > 1), R = 128 / split
// rows each. The grid is not persistent: the hardware keeps every SM full of small independent
// CTAs, each with its whole state slice in flight at once.
//
// Streaming. Each V row of the state evolves on its own (u, delta, the update and o of row v only
// read row v), so the slice is streamed in chunks of 32 rows, 8 per warp. On sm_90 a chunk goes
// global -> shared memory as one bulk copy completing on its buffer's mbarrier, issued by one
// thread as soon as the source slot is known: no registers are held while the bytes are in
// flight, and the warps start on a chunk as soon as it lands. A buffer is refilled with a later
// chunk once every warp holds its rows in registers (KernelArgs::buffers; per-warp copies and
// refills without that CTA barrier are no faster).
// Elsewhere (a kernel image without sm_90, the "kv" layout, or a pool whose slot stride is not
// 16-byte aligned) the CTA loads each chunk into the same buffers with plain loads: the slow path.
//
// A warp owns 8 rows of a group at a time, kRows of them per lane (GroupRows: 8 / kRows float4
// chunks of K columns per row in registers, fp32 whatever the storage dtype). Dot products over K
// are lane-local products and a transposing reduction over the lanes sharing the rows. Write-all
// keeps 4 (fp32) or 8 (16-bit) rows per lane, which streams fastest; replay, bound by the
// instructions of its up to 2S tokens, keeps 2 (7 shuffles per output token instead of 26), except
// token-by-token replay at large batches (ReplayTokensForm::kFourRows: 4). The modes and forms
// therefore add their dot products in different orders (each deterministic). After every token the
// group's 8 rows are stored to that token's slot from registers (coalesced row segments, one
// 16-byte (fp32) or 8-byte chunk per lane).
//
// Gated RMSNorm. o of every (token, row) is kept in shared memory; after the rows are done, each
// group's sum of o^2 (a fixed pairwise tree) goes to a per-group partial, and the 16 partials of a
// head are added in group order. A split head's CTAs push their partials into each other's shared
// memory (st.async, counted by a transaction barrier) instead of reading them after a release
// cluster barrier, whose fence would wait for every state store of the CTA to drain. The result
// does not depend on the split.
//
// Replay verify (docs replay.md) runs on the same CTA mapping: the slice comes from the
// request's one checkpoint slot, the staged token list is the n accepted window tokens (raw k, v,
// a, b read from the slot's window; no q, no output) followed by the T new ones, the rows are
// stored once, to the checkpoint, after the n-th token (not at all for n = 0), and the new tokens
// produce outputs only. Replay runs up to 2S tokens per slice and is bound by their latency, so
// its token step keeps the decay as a scalar beside the rows (advance_rows_scaled: 2 or 3 FMAs per
// element and token instead of 3 or 4, one reduction phase per token) and its launches take the
// chunk buffers that let six CTAs fit an SM (choose_buffers). Deep windows at large batches take
// the closed form instead (replay_closed_form_kernel, prepare_replay): the CTA solves the window's
// triangular system once, and each row then needs n + T independent dot products and n rank-1
// updates. With a 16-bit state and S <= 8 those are two small matrix products per warp, which run
// on tensor cores (ClosedFormMath::kTensorCores, tensor_core_rows), and that form is taken from S =
// 4 (use_closed_form); at S <= 5 it has a second form at 64 registers, eight CTAs per SM, taken
// where that saves a wave (ClosedFormMath::kTensorCoresEightCtas, use_tensor_core_eight). This
// kernel only reads the window; a second launch saves the new tokens into it (gdn/replay/cuda.cuh),
// so no CTA can overwrite a window row another CTA still replays.
//
// Decode without drafts (S = 1) with a 16-bit state has a second write-all form
// (WriteAllForm::kSingleToken): T and S compile-time 1 and 64 registers, so that eight CTAs fit an
// SM instead of six. The launcher takes it where it saves a wave (use_single_token).
//
// Math and rounding follow gdn/decode_mtp/cpu.hpp (fp32 throughout, o kept fp32 into the norm,
// 16-bit state stored round-to-nearest-even). Invalid rows (device-side indices) write no state,
// zero-fill their output rows inside [0, L) and bump the optional error counter once. Every
// global access is bounded by the validated shapes, whatever the index values.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/mma.cuh"
#include "gdn/core/dispatch.hpp"
#include "gdn/core/support.hpp"
#include "gdn/decode_mtp/cuda_launch_rules.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::decode_mtp::cuda_detail {

namespace dev = gdn::cuda;
using dev::allow_dependent_launch;
using dev::bits4_to_f32;
using dev::bits_to_f32;
using dev::bulk_load;
using dev::cluster_arrive_relaxed;
using dev::cluster_shared_address;
using dev::cluster_wait;
using dev::fast_sigmoid;
using dev::l2_policy;
using dev::load_bits;
using dev::load_bits4;
using dev::load_value;
using dev::mbarrier_arrive_expect_tx;
using dev::mbarrier_init;
using dev::mbarrier_init_fence;
using dev::mbarrier_wait;
using dev::sigmoid;
using dev::softplus;
using dev::StateBits;
using dev::store_to_peer;
using dev::store_value;
using dev::transpose_reduce;
using dev::transpose_sum;
using dev::wait_for_prior_grids;
using dev::warp_sum;
using replay::classify_replay_row;  // the host's replay::check_row decides the same
using replay::ReplayRow;

static_assert(kCudaMaxSpecColumns <= 32, "slot ids of a row are read by the first lanes");
static_assert(2 * kCudaMaxSpecColumns <= 32, "stage_gates: one lane per staged replay token");

// The dtype of an activation array (mixed_qkv and the window's k and v, a, b, z, out) as a kernel
// image reads it: `t` from KernelArgs, or bf16 in the images for bf16 activations
// (KernelImage::kBf16Activations, the launcher's use_bf16_activations). Those know it at compile
// time, so their loads, conversions and stores carry no dtype branches: replay is bound by its
// instructions, of which a run-time dtype's branches are a measurable share.
template <bool kBf16Activations>
__device__ __forceinline__ DType activation_dtype(DType t) {
  return kBf16Activations ? DType::kBFloat16 : t;
}

// Plain-data copy of Params/Problem for the kernel (TensorView is host-side).
struct KernelArgs {
  const void* mixed_qkv;
  const void* a;
  const void* b;
  const void* A_log;
  const void* dt_bias;
  const void* z;            // null: no output gate
  const void* norm_weight;  // null: out = o
  void* state;
  const void* state_indices;
  int64_t index_stride;  // replay: element stride of state_indices
  const void* cu_seqlens;
  const void* num_accepted_tokens;  // null: all 1
  void* out;
  int* error_count;  // null: not counted
  int64_t qkv_row_stride, a_row_stride, b_row_stride, z_row_stride, z_head_stride;
  int64_t slot_stride, num_slots, first_valid_slot;
  int64_t L, N;
  int S, H, HV, ratio, split;
  DType qkv_dtype, a_dtype, b_dtype, A_log_dtype, dt_bias_dtype, z_dtype, norm_dtype, out_dtype;
  DType index_dtype, cu_dtype, acc_dtype;
  bool state_kv;      // "kv" layout: [K, V] per head
  bool state_vector;  // "vk" and 16-byte aligned rows: vector stores; bulk loads on sm_90
  bool kv_vector;     // "kv" and 16-byte aligned slots: 16-byte loads, one vector store a column
  bool bulk_load;     // the slice arrives by bulk copies (sm_90 image and state_vector)
  int buffers;        // chunk buffers in shared memory (1..kMaxChunks)
  bool evict_hints;  // evict-first bulk loads and streaming stores of the state (launcher's choice)
  bool qkv_vector;   // q/k chunks of 4 elements are naturally aligned
  bool gate_sigmoid;
  bool round_core_output;  // o rounded to out's dtype before the norm (vLLM's numerics)
  // StepArgs' input options, uniform over the grid: read where the gates (stage_gates) and the
  // q/k norms (stage_token) are computed, never in the token steps.
  bool a_is_log_decay;  // g = a; A_log and dt_bias are not read (may be null)
  bool b_is_beta;       // beta = b
  bool qk_l2_norm;      // false: q, k as given (q times scale)
  float scale, l2_eps, norm_eps;
  // Replay verify only: the window, [slot, token, column] views with unit column stride (k and v
  // in qkv_dtype, a in a_dtype, b in b_dtype) and window_len [slots] (read here, written by the
  // window-save launch that follows).
  const void* window_k;
  const void* window_v;
  const void* window_a;
  const void* window_b;
  const int* window_len;
  int64_t wk_slot_stride, wk_token_stride, wv_slot_stride, wv_token_stride;
  int64_t wa_slot_stride, wa_token_stride, wb_slot_stride, wb_token_stride;
  bool window_k_vector;  // k chunks of 4 elements of the window are naturally aligned
};

// The request row of a CTA, read once from device memory.
struct RowMeta {
  int64_t slot[kCudaMaxSpecColumns];
  int64_t c0, c1, acc;
  int64_t stored;  // replay: window_len[slot]
};

// alpha = exp(g) and beta of staged token t at gates[0], gates[1], by one thread: lane t of one
// warp stages every token's gates (at most 2S <= 32 tokens), which costs that warp one pass of
// the gate math instead of a pass per token in the token-staging warps. The loads (load_gates)
// go out before that warp stages its own tokens and the math (stage_gates) comes after them, so
// that the warp waits for one round trip, not two. Replay: tokens t < n_replay take a and b from
// the checkpoint slot's window, later ones from the call's rows.
struct GateBits {
  uint32_t a, b, A_log, dt_bias;
};
template <bool kReplay, bool kBf16Activations>
__device__ __forceinline__ GateBits load_gates(const KernelArgs& args, int t, int n_replay,
                                               int64_t c0, int64_t source, int hv) {
  const bool replayed = kReplay && t < n_replay;
  const void* a_src = replayed ? args.window_a : args.a;
  const void* b_src = replayed ? args.window_b : args.b;
  const int64_t l = c0 + (t - n_replay);
  const int64_t a_off = replayed ? source * args.wa_slot_stride + t * args.wa_token_stride + hv
                                 : l * args.a_row_stride + hv;
  const int64_t b_off = replayed ? source * args.wb_slot_stride + t * args.wb_token_stride + hv
                                 : l * args.b_row_stride + hv;
  const bool params = !args.a_is_log_decay;  // A_log and dt_bias are read only for the gate math
  return {load_bits(a_src, activation_dtype<kBf16Activations>(args.a_dtype), a_off),
          load_bits(b_src, activation_dtype<kBf16Activations>(args.b_dtype), b_off),
          params ? load_bits(args.A_log, args.A_log_dtype, hv) : 0u,
          params ? load_bits(args.dt_bias, args.dt_bias_dtype, hv) : 0u};
}
template <bool kBf16Activations>
__device__ __forceinline__ void stage_gates(const KernelArgs& args, const GateBits& bits,
                                            float* gates) {
  const float a = bits_to_f32(bits.a, activation_dtype<kBf16Activations>(args.a_dtype));
  const float b = bits_to_f32(bits.b, activation_dtype<kBf16Activations>(args.b_dtype));
  float g = a;
  if (!args.a_is_log_decay) {
    const float A = -expf(bits_to_f32(bits.A_log, args.A_log_dtype));
    g = A * softplus(a + bits_to_f32(bits.dt_bias, args.dt_bias_dtype));
  }
  gates[0] = expf(g);
  gates[1] = args.b_is_beta ? b : sigmoid(b);
}

// The raw bits of staged token t that a lane of the staging warp loads (load_token): q and k, four
// elements each, and up to four of the CTA's v values. Replay: tokens t < n_replay are the
// checkpoint slot's window tokens (raw k and v; no q), later ones the call's rows.
struct TokenBits {
  uint4 q, k;
  uint32_t v[kHeadDim / 32];
};
template <bool kReplay, bool kBf16Activations>
__device__ __forceinline__ TokenBits load_token(const KernelArgs& args, int t, int n_replay,
                                                int64_t c0, int64_t source, int h, int hv, int row0,
                                                int R, int lane) {
  const bool replayed = kReplay && t < n_replay;
  const void *k_src, *v_src;  // this token's k and v: window or call rows
  int64_t k_off, v_off;
  bool k_vector;
  uint4 qb = make_uint4(0u, 0u, 0u, 0u);
  if (replayed) {
    k_src = args.window_k;
    v_src = args.window_v;
    k_off = source * args.wk_slot_stride + t * args.wk_token_stride + int64_t(h) * kHeadDim;
    v_off = source * args.wv_slot_stride + t * args.wv_token_stride + int64_t(hv) * kHeadDim;
    k_vector = args.window_k_vector;
  } else {
    const int64_t l = c0 + (t - n_replay);
    const int64_t base = l * args.qkv_row_stride;
    qb = load_bits4(args.mixed_qkv, activation_dtype<kBf16Activations>(args.qkv_dtype),
                    base + int64_t(h) * kHeadDim + 4 * lane, args.qkv_vector);
    k_src = v_src = args.mixed_qkv;
    k_off = base + int64_t(args.H + h) * kHeadDim;
    v_off = base + int64_t(2 * args.H + hv) * kHeadDim;
    k_vector = args.qkv_vector;
  }
  const uint4 kb = load_bits4(k_src, activation_dtype<kBf16Activations>(args.qkv_dtype),
                              k_off + 4 * lane, k_vector);
  const int64_t vbase = v_off + row0;
  uint32_t vb[kHeadDim / 32];
#pragma unroll
  for (int i = 0; i < kHeadDim / 32; ++i)
    vb[i] = lane + 32 * i < R ? load_bits(v_src, activation_dtype<kBf16Activations>(args.qkv_dtype),
                                          vbase + lane + 32 * i)
                              : 0u;
  return TokenBits{qb, kb, {vb[0], vb[1], vb[2], vb[3]}};
}

// Stages a token loaded by load_token into shared memory with one warp: q and k L2-normalised (q
// times scale) as fp32 [128] at q_row (output tokens) and k_row, the R values of the CTA's rows at
// v_row, and (kWithKq, lane 0) k . q at gates[2], for the token-by-token replay step (the gates
// themselves: stage_gates). A replayed token produces no output: no q.
template <bool kWithKq, bool kBf16Activations>
__device__ __forceinline__ void stage_token(const KernelArgs& args, const TokenBits& bits,
                                            bool replayed, int R, int lane, float* q_row,
                                            float* k_row, float* v_row, float* gates) {
  const float4 k = bits4_to_f32(bits.k, activation_dtype<kBf16Activations>(args.qkv_dtype));
  // qk_l2_norm is uniform over the grid, so the warp sums stay convergent.
  const float kinv =
      args.qk_l2_norm
          ? 1.0f / sqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + args.l2_eps)
          : 1.0f;
  const float4 kn = make_float4(k.x * kinv, k.y * kinv, k.z * kinv, k.w * kinv);
  float kq = 0.0f;
  if (!replayed) {
    const float4 q = bits4_to_f32(bits.q, activation_dtype<kBf16Activations>(args.qkv_dtype));
    const float qinv =
        args.qk_l2_norm
            ? args.scale /
                  sqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + args.l2_eps)
            : args.scale;
    const float4 qn = make_float4(q.x * qinv, q.y * qinv, q.z * qinv, q.w * qinv);
    *reinterpret_cast<float4*>(q_row + 4 * lane) = qn;
    if (kWithKq) kq = warp_sum(qn.x * kn.x + qn.y * kn.y + qn.z * kn.z + qn.w * kn.w);
  }
  *reinterpret_cast<float4*>(k_row + 4 * lane) = kn;
#pragma unroll
  for (int i = 0; i < kHeadDim / 32; ++i)
    if (lane + 32 * i < R)
      v_row[lane + 32 * i] =
          bits_to_f32(bits.v[i], activation_dtype<kBf16Activations>(args.qkv_dtype));
  if (kWithKq && lane == 0) gates[2] = kq;
}

// load_token then stage_token, for a warp that stages its tokens one at a time. The kernels that
// issue their chunks first (16-bit and closed-form replay, the single-token form) stage through
// this function: it compiles them to the code they were measured with, where the same calls
// through the kernel's `stage` lambda change their register allocation
// (benchmarks/compare_ptx.py).
template <bool kReplay, bool kWithKq, bool kBf16Activations>
__device__ __forceinline__ void load_and_stage_token(const KernelArgs& args, int t, int n_replay,
                                                     int64_t c0, int64_t source, int h, int hv,
                                                     int row0, int R, int lane, float* q_row,
                                                     float* k_row, float* v_row, float* gates) {
  stage_token<kWithKq, kBf16Activations>(
      args,
      load_token<kReplay, kBf16Activations>(args, t, n_replay, c0, source, h, hv, row0, R, lane),
      kReplay && t < n_replay, R, lane, q_row, k_row, v_row, gates);
}

// The 8 rows of a group in a warp's registers, kRows (8, 4 or 2) rows per lane. The 4 kRows lanes
// of a row set hold rows first_row(lane) .. + kRows - 1, each as 8 / kRows float4 chunks: lane l
// holds columns col(l, j) .. col(l, j) + 3, j < kChunks. Fewer rows per lane mean fewer shuffles
// per output token (2 (kRows + 1) for u and o, plus kRows, or 1 for kRows = 2, to share the
// deltas: 26, 14 or 7) but more shared-memory reads of k and q; the state dtype picks
// (kRowsPerLane).
template <int kRows>
struct GroupRows {
  static_assert(kRows == 2 || kRows == 4 || kRows == 8, "8, 4 or 2 rows per lane");
  static constexpr int kChunks = kRowsPerGroup / kRows;  // float4 chunks of a row per lane
  static constexpr int kSetLanes = 4 * kRows;            // lanes sharing a row set
  float4 x[kRows][kChunks];
  static __device__ __forceinline__ int first_row(int lane) { return kRows * (lane / kSetLanes); }
  static __device__ __forceinline__ int col(int lane, int j) {
    return 4 * (lane % kSetLanes + kSetLanes * j);
  }
};

// The "kv" layout keeps a head as [K, V]: element (row v, column k) at k * 128 + v, so the rows of
// a column are adjacent. These two helpers move a "kv" slice as vectors along v where KernelArgs::
// kv_vector holds (elsewhere the kernel moves it element by element, several times slower). The
// layout stays slower than "vk", whose rows arrive by bulk copies.
//
// Rows r0 .. r0 + rows - 1 of a "kv" slice into a chunk buffer in the layout the bulk copies leave
// ([row][128]), by the whole CTA: 16-byte loads, each of adjacent rows at one column (a warp reads
// whole 128-byte row segments of several columns).
template <class StateT>
__device__ __forceinline__ void load_chunk_kv(StateT* buf, const StateT* src, int r0, int rows,
                                              int tid) {
  constexpr int kPerVector = 16 / int(sizeof(StateT));
  const int per_column = rows / kPerVector;  // a power of 2
  const int log2_per_column = __ffs(per_column) - 1;
  for (int e = tid; e < per_column * kHeadDim; e += kThreads) {
    const int k = e >> log2_per_column, r = (e & (per_column - 1)) * kPerVector;
    const uint4 bits = *reinterpret_cast<const uint4*>(src + int64_t(k) * kHeadDim + r0 + r);
    StateT v[kPerVector];
    memcpy(v, &bits, 16);
#pragma unroll
    for (int q = 0; q < kPerVector; ++q) buf[(r + q) * kHeadDim + k] = v[q];
  }
}

// A lane's rows of a group to a "kv" slot: its kRows rows are adjacent in v, so each of its
// columns is one vector of kRows elements. `first`: the lane's first row at column 0.
template <class StateT, int kRows>
__device__ __forceinline__ void store_rows_kv(StateT* first, const float4 (&x)[kRows][8 / kRows],
                                              int col0, int set_lanes) {
#pragma unroll
  for (int j = 0; j < 8 / kRows; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        v[r] = e == 0 ? x[r][j].x : e == 1 ? x[r][j].y : e == 2 ? x[r][j].z : x[r][j].w;
      StateT* at = first + int64_t(col0 + 4 * set_lanes * j + e) * kHeadDim;
      if constexpr (sizeof(StateT) == 4) {
        if constexpr (kRows == 2) {
          *reinterpret_cast<float2*>(at) = make_float2(v[0], v[1]);
        } else {
#pragma unroll
          for (int h = 0; h < kRows / 4; ++h)
            reinterpret_cast<float4*>(at)[h] =
                make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
        }
      } else {
        uint32_t w[kRows / 2];
#pragma unroll
        for (int h = 0; h < kRows / 2; ++h) w[h] = StateBits<StateT>::pack(v[2 * h], v[2 * h + 1]);
        if constexpr (kRows == 2) {
          *reinterpret_cast<uint32_t*>(at) = w[0];
        } else if constexpr (kRows == 4) {
          *reinterpret_cast<uint2*>(at) = make_uint2(w[0], w[1]);
        } else {
          *reinterpret_cast<uint4*>(at) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
}

// Rows per lane by mode, state dtype and form. Replay runs up to 2S tokens per slice and is bound
// by their instructions: 2 rows (fewer shuffles per token than 8 at the same registers), and 4 in
// ReplayTokensForm::kFourRows from sixteen heads per SM (use_replay_four_rows). Write-all streams
// fastest with 4 rows for fp32 and 8 for 16-bit states.
template <class StateT, bool kReplay, bool kFourRows = false>
inline constexpr int kRowsPerLane = kReplay               ? (kFourRows ? 4 : 2)
                                    : sizeof(StateT) == 4 ? 4
                                                          : 8;

// The row of its group a lane holds a row sum of after transpose_reduce (the same row in the 4
// lanes of a quad, whatever kRows).
__device__ __forceinline__ int lane_row(int lane) { return (lane >> 2) & 7; }

// x . w of one float4 chunk.
__device__ __forceinline__ float dot4(float4 x, float4 w) {
  return x.x * w.x + x.y * w.y + x.z * w.z + x.w * w.w;
}
// p + x . w as one chain of FMAs (replay: one instruction per element, where write-all adds the
// chunks' products separately).
__device__ __forceinline__ float dot4_acc(float4 x, float4 w, float p) {
  return fmaf(x.w, w.w, fmaf(x.z, w.z, fmaf(x.y, w.y, fmaf(x.x, w.x, p))));
}

// p[r] = the lane's part of row r . w (its columns of a staged [128] vector), one FMA chain per
// row.
template <int kRows>
__device__ __forceinline__ void lane_row_dots(const GroupRows<kRows>& s, const float* w, int lane,
                                              float (&p)[kRows]) {
#pragma unroll
  for (int j = 0; j < GroupRows<kRows>::kChunks; ++j) {
    const float4 wj = *reinterpret_cast<const float4*>(w + GroupRows<kRows>::col(lane, j));
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      p[r] = j == 0 ? dot4(s.x[r][j], wj) : dot4_acc(s.x[r][j], wj, p[r]);
  }
}

// After a reduction each lane holds the value of row lane_row(lane); d[r] = the value of the lane's
// own row first_row + r (it sits in quad r of the row set).
template <int kRows>
__device__ __forceinline__ void spread_row_values(float mine, int lane, float (&d)[kRows]) {
  if constexpr (kRows == 2) {
    const float other = __shfl_xor_sync(0xffffffffu, mine, 4);
    d[0] = lane & 4 ? other : mine;
    d[1] = lane & 4 ? mine : other;
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      d[r] = __shfl_sync(0xffffffffu, mine, (lane & ~(4 * kRows - 4)) | (4 * r));
  }
}

// x += k d (one float4 chunk of a row).
__device__ __forceinline__ void add_scaled(float4& x, float4 k, float d) {
  x.x += k.x * d;
  x.y += k.y * d;
  x.z += k.z * d;
  x.w += k.w * d;
}

// One token of the delta rule on the 8 rows a warp holds (write-all): decay, u = S k, S += beta
// (v - u) k^T, and o = S q of the updated state, returned for row lane_row(lane) in every lane of
// its quad. k and q are the token's staged vectors (shared memory), read chunk by chunk (k twice:
// not held across the reduction); v is the value of row lane_row(lane).
template <int kRows>
__device__ __forceinline__ float advance_rows(GroupRows<kRows>& s, const float* k, const float* q,
                                              float alpha, float beta, float v, int lane) {
  using G = GroupRows<kRows>;
  float p[kRows];
#pragma unroll
  for (int j = 0; j < G::kChunks; ++j) {
    const float4 kj = *reinterpret_cast<const float4*>(k + G::col(lane, j));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float4& x = s.x[r][j];
      x.x *= alpha;
      x.y *= alpha;
      x.z *= alpha;
      x.w *= alpha;
      p[r] = j == 0 ? dot4(x, kj) : p[r] + dot4(x, kj);
    }
  }
  float d[kRows];  // delta of each of this lane's rows
  spread_row_values(beta * (v - transpose_reduce(p, lane)), lane, d);
#pragma unroll
  for (int j = 0; j < G::kChunks; ++j) {
    const float4 kj = *reinterpret_cast<const float4*>(k + G::col(lane, j));
    const float4 qj = *reinterpret_cast<const float4*>(q + G::col(lane, j));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      add_scaled(s.x[r][j], kj, d[r]);
      p[r] = j == 0 ? dot4(s.x[r][j], qj) : p[r] + dot4(s.x[r][j], qj);
    }
  }
  return transpose_reduce(p, lane);
}

// Replay's token step: the same math as advance_rows with the decay kept out of the rows. They hold
// S / c, c the product of the alphas since the last fold (a scalar, the same in every CTA of the
// head), so a token costs 2 (replayed) or 3 (kOutput) FMAs per element instead of 3 or 4. Both
// dot products read the rows before the update: with u = S~ k of the lane's row,
//   step = delta / c = beta v / c - beta u  (added to S~ along k),
//   o = S q = c (S~ q + step (k . q)),
// so the chain from the rows to the next token is one reduction and one FMA. The update is
// skipped when `update` is false (the last token, stored nowhere). c is folded back into the rows
// before it could leave the normal range (fold_scale; the caller also folds before it stores).
// kq = k . q of the token.
inline constexpr float kFoldBelow = 0x1p-30f;
template <int kRows>
__device__ __forceinline__ void fold_scale(GroupRows<kRows>& s, float& c) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < GroupRows<kRows>::kChunks; ++j) {
      float4& x = s.x[r][j];
      x.x *= c;
      x.y *= c;
      x.z *= c;
      x.w *= c;
    }
  c = 1.0f;
}
template <bool kOutput, int kRows>
__device__ __forceinline__ float advance_rows_scaled(GroupRows<kRows>& s, float& c, const float* k,
                                                     const float* q, float kq, float alpha,
                                                     float beta, float v, bool update, int lane) {
  using G = GroupRows<kRows>;
  c *= alpha;
  if (!(c >= kFoldBelow)) fold_scale(s, c);  // uniform over the CTA; also catches alpha = 0
  // Off the chain (it depends on the gates only); c is normal (kFoldBelow <= c <= 1), so the
  // hardware reciprocal (1 ulp) needs no range handling.
  const float beta_v_over_c = beta * v * dev::fast_rcp(c);
  float pk[kRows], pq[kRows];
  lane_row_dots(s, k, lane, pk);
  if constexpr (kOutput) lane_row_dots(s, q, lane, pq);
  const float step = fmaf(-beta, transpose_reduce(pk, lane), beta_v_over_c);
  float o = 0.0f;
  if constexpr (kOutput) o = c * fmaf(step, kq, transpose_reduce(pq, lane));
  if (!update) return o;
  float d[kRows];  // step of each of this lane's rows
  spread_row_values(step, lane, d);
#pragma unroll
  for (int j = 0; j < G::kChunks; ++j) {
    const float4 kj = *reinterpret_cast<const float4*>(k + G::col(lane, j));
#pragma unroll
    for (int r = 0; r < kRows; ++r) add_scaled(s.x[r][j], kj, d[r]);
  }
  return o;
}

// Replay in closed form (chunked delta rule, WY form). With m = n + T staged tokens j (alpha_j,
// beta_j, unit k_j, v_j of a row; q_j for the new ones), g_j = alpha_0 .. alpha_j and
// R(j, i) = alpha_(i+1) .. alpha_j (products only: no division, alpha = 0 is exact), a row s of the
// checkpoint evolves as x_j = g_j s + sum_(i<=j) R(j, i) w_i k_i with
//   w_j = beta_j (v_j - g_j s . k_j - sum_(i<j) L'_ji w_i / beta_j),  L'_ji = beta_j R(j, i) k_i .
//   k_j.
// The triangular system is the same for every row, so it is solved once per CTA, on the vectors
// (prepare_replay): w_j = vt_j - s . kt_j, and o_j = x_j . q_j = s . qt_j + ot_j, where
//   kt_j = beta_j g_j k_j - sum_(i<j) L'_ji kt_i          (per column, [m][128])
//   vt_j = beta_j v_j - sum_(i<j) L'_ji vt_i              (per row, [m][R])
//   qt_j = g_j q_j - sum_(i<=j) Q_ij kt_i,  ot_j = sum_(i<=j) Q_ij vt_i,  Q_ij = R(j, i) k_i . q_j.
// A row then costs n + T independent dot products with the staged kt (replayed) and qt (new)
// vectors and, for the checkpoint x_(n-1) = g_(n-1) s + sum_(i<n) R(n-1, i) w_i k_i, n rank-1
// updates: 2n + T + 1 FMAs per element instead of 2n + 3T - 1 token by token, with no chain of
// reductions between tokens.
//
// Shared arrays (SmemPlan, replay): k_s [m][128] k, then kt; q_s [m][128] q_j at the rows j >= n
// of the new tokens (then qt_j) and the replayed tokens' raw k_i at rows i < n; v_s [m][R] v, then
// vt, then for i < n the checkpoint coefficient R(n-1, i) w_i and for j >= n ot_j, then o_j (o_s
// = v_s + n R: no array of its own); gates_s [m][4] alpha, beta, g_j, R(n-1, j); mat_s [m][m] L'
// below the diagonal, Q on and above it ([i][j]); z_s z's raw bits (act(z) at the output).
inline constexpr int kClosedGateFloats = 4;
inline constexpr int kGateAlpha = 0, kGateBeta = 1, kGateDecay = 2, kGateCheckpoint = 3;

// Index of a lower-triangle pair (i <= j) numbered row by row: e = j (j + 1) / 2 + i.
__device__ __forceinline__ void triangle_pair(int e, int& j, int& i) {
  j = int((sqrtf(8.0f * float(e) + 1.0f) - 1.0f) * 0.5f);
  while (j * (j + 1) / 2 > e) --j;  // the float root can be one off either way
  while ((j + 1) * (j + 2) / 2 <= e) ++j;
  i = e - j * (j + 1) / 2;
}

// x . y of two staged [128] vectors by one thread, starting at a column that depends on `start`
// (threads of a warp reading different rows then hit different banks).
__device__ __forceinline__ float dot_staged(const float* x, const float* y, int start) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int step = 0; step < kHeadDim / 4; ++step) {
    const int c = 4 * ((step + start) & (kHeadDim / 4 - 1));
    const float4 a = *reinterpret_cast<const float4*>(x + c);
    const float4 b = *reinterpret_cast<const float4*>(y + c);
    acc[step & 3] = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc[step & 3]))));
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// prepare_replay's step 2 for any window (m <= 2S tokens): kt and vt through shared memory.
__device__ __forceinline__ void solve_in_shared(int n, int m, int R, int vs, int tid, float* k_s,
                                                float* q_s, const float* gates, const float* mat_s,
                                                float* v_s, float* o_s) {
  auto gate = [&](int j, int which) { return gates[kClosedGateFloats * j + which]; };
  const bool row = tid < R;
  float* const kt_col = k_s + tid;
  float* const q_col = q_s + tid;
  float* const v_col = v_s + tid;
  // Two loops rather than one with `row` as a predicate, which needs more registers than the
  // kernel's 80 (ptxas spills).
  if (row) {
    for (int j = 0; j < m; ++j) {
      const float* lj = mat_s + j * m;
      const float beta = gate(j, kGateBeta), k = kt_col[j * kHeadDim];
      float kt = beta * gate(j, kGateDecay) * k, vt = beta * v_col[j * vs];
      for (int i = 0; i < j; ++i) {
        kt = fmaf(-lj[i], kt_col[i * kHeadDim], kt);
        vt = fmaf(-lj[i], v_col[i * vs], vt);
      }
      kt_col[j * kHeadDim] = kt;
      v_col[j * vs] = vt;
      if (j < n) q_col[j * kHeadDim] = k;
    }
  } else {  // columns only
    for (int j = 0; j < m; ++j) {
      const float* lj = mat_s + j * m;
      const float k = kt_col[j * kHeadDim];
      float kt = gate(j, kGateBeta) * gate(j, kGateDecay) * k;
      for (int i = 0; i < j; ++i) kt = fmaf(-lj[i], kt_col[i * kHeadDim], kt);
      kt_col[j * kHeadDim] = kt;
      if (j < n) q_col[j * kHeadDim] = k;
    }
  }
  // Every kt and vt is known: the new tokens' qt and ot, from the last token down, because ot_j
  // may replace vt_j in v_s (the closed form's o lives in v's rows n ..) and reads vt_i, i <= j.
  for (int j = m - 1; j >= n; --j) {
    float qt = gate(j, kGateDecay) * q_col[j * kHeadDim], ot = 0.0f;
    for (int i = 0; i <= j; ++i) {
      const float qij = mat_s[i * m + j];
      qt = fmaf(-qij, kt_col[i * kHeadDim], qt);
      if (row) ot = fmaf(qij, v_col[i * vs], ot);
    }
    q_col[j * kHeadDim] = qt;
    if (row) o_s[(j - n) * vs + tid] = ot;
  }
}

// prepare_replay's step 2 for windows of up to kSolveInRegisters tokens (S <= 8): the thread's
// column of kt and row of vt stay in registers, so token j's sums over the earlier tokens are
// unrolled FMAs on registers (one shared load of L' or Q each) instead of a loop of shared-memory
// round trips. Same operations in the same order as solve_in_shared (the same bits).
inline constexpr int kSolveInRegisters = 16;
__device__ __forceinline__ void solve_in_registers(int n, int m, int R, int vs, int tid, float* k_s,
                                                   float* q_s, const float* gates,
                                                   const float* mat_s, float* v_s, float* o_s) {
  auto gate = [&](int j, int which) { return gates[kClosedGateFloats * j + which]; };
  const bool row = tid < R;
  float* const kt_col = k_s + tid;
  float* const q_col = q_s + tid;
  float* const v_col = v_s + tid;
  float kt[kSolveInRegisters], vt[kSolveInRegisters];
#pragma unroll
  for (int j = 0; j < kSolveInRegisters; ++j) {
    if (j >= m) break;  // uniform over the CTA
    const float* lj = mat_s + j * m;
    const float beta = gate(j, kGateBeta), k = kt_col[j * kHeadDim];
    float a = beta * gate(j, kGateDecay) * k, b = row ? beta * v_col[j * vs] : 0.0f;
#pragma unroll
    for (int i = 0; i < j; ++i) {
      const float l = lj[i];
      a = fmaf(-l, kt[i], a);
      b = fmaf(-l, vt[i], b);
    }
    kt[j] = a;
    vt[j] = b;
    kt_col[j * kHeadDim] = a;
    if (row) v_col[j * vs] = b;
    if (j < n) q_col[j * kHeadDim] = k;
  }
#pragma unroll
  for (int j = 0; j < kSolveInRegisters; ++j) {  // the new tokens' qt and ot
    if (j >= m) break;
    if (j < n) continue;
    float qt = gate(j, kGateDecay) * q_col[j * kHeadDim], ot = 0.0f;
#pragma unroll
    for (int i = 0; i <= j; ++i) {
      const float qij = mat_s[i * m + j];
      qt = fmaf(-qij, kt[i], qt);
      ot = fmaf(qij, vt[i], ot);
    }
    q_col[j * kHeadDim] = qt;
    if (row) o_s[(j - n) * vs + tid] = ot;
  }
}

// R(j, i) = alpha_(i+1) .. alpha_j (i = -1: g_j), multiplied in token order, from the staged
// gates: windows of any length.
__device__ __forceinline__ float window_decay(const float* gates, int j, int i) {
  float r = 1.0f;
  for (int l = i + 1; l <= j; ++l) r *= gates[kClosedGateFloats * l + kGateAlpha];
  return r;
}

// The same products for windows of up to kMax <= kSolveInRegisters tokens, from the alphas held in
// every thread's registers: unrolled multiplications (by 1 outside the range: the same bits)
// instead of a loop whose shared-memory loads each wait for the last. kMax is the kernel image's
// longest window, so that a product costs kMax steps, not kSolveInRegisters.
template <int kMax>
struct WindowAlphas {
  static_assert(kMax <= kSolveInRegisters, "held in registers");
  float a[kMax];
  __device__ __forceinline__ WindowAlphas(const float* gates, int m) {
#pragma unroll
    for (int l = 0; l < kMax; ++l) a[l] = l < m ? gates[kClosedGateFloats * l + kGateAlpha] : 1.0f;
  }
  __device__ __forceinline__ float operator()(int j, int i) const {
    float r = 1.0f;
#pragma unroll
    for (int l = 0; l < kMax; ++l)
      if (l > i && l <= j) r *= a[l];
    return r;
  }
};

// The per-CTA solve of the closed form (whole CTA, between two barriers; see above). Step 2 keeps
// a thread's column and row in registers for windows of up to kSolveInRegisters tokens, and step 1
// the window's alphas (WindowAlphas; the tensor-core form's windows always fit, and kMaxWindow
// bounds them where the image bounds S).
template <bool kTensorCores, int kMaxWindow = kSolveInRegisters>
__device__ __forceinline__ void prepare_replay(int n, int m, int R, int vs, int tid, float* k_s,
                                               float* q_s, float* gates, float* mat_s, float* v_s,
                                               float* o_s, const KernelArgs& args) {
  auto gate = [&](int j, int which) -> float& { return gates[kClosedGateFloats * j + which]; };
  // 1. Decays and the token pair products.
  const auto decays_and_pairs = [&](const auto& decay) {
    for (int j = tid; j < m; j += kThreads) {
      gate(j, kGateDecay) = decay(j, -1);
      gate(j, kGateCheckpoint) = j < n ? decay(n - 1, j) : 0.0f;
    }
    for (int e = tid; e < m * (m + 1) / 2; e += kThreads) {
      int j, i;
      triangle_pair(e, j, i);
      const float r = decay(j, i);
      const float* ki = k_s + i * kHeadDim;
      if (i < j)
        mat_s[j * m + i] = gate(j, kGateBeta) * r * dot_staged(ki, k_s + j * kHeadDim, tid);
      if (j >= n) mat_s[i * m + j] = r * dot_staged(ki, q_s + j * kHeadDim, tid);
    }
  };
  static_assert(2 * kTensorCoreMaxS <= kSolveInRegisters, "tensor cores: m <= 2 kTensorCoreMaxS");
  static_assert(kMaxWindow == kSolveInRegisters || kTensorCores, "a bound of the tensor-core form");
  if (kTensorCores || m <= kSolveInRegisters)
    decays_and_pairs(WindowAlphas<kMaxWindow>(gates, m));
  else
    decays_and_pairs([&](int j, int i) { return window_decay(gates, j, i); });
  __syncthreads();
  // 2. kt and qt of column tid, vt and ot of row tid (< R: a split head's CTA has fewer rows),
  //    token by token. Every thread reads and writes only its own column and row. kt_j replaces
  //    k_j in k_s; a replayed token's raw k_j moves to its unused q_s row for the checkpoint.
  static_assert(kThreads == kHeadDim, "one thread per column");
  if (m <= kSolveInRegisters)
    solve_in_registers(n, m, R, vs, tid, k_s, q_s, gates, mat_s, v_s, o_s);
  else
    solve_in_shared(n, m, R, vs, tid, k_s, q_s, gates, mat_s, v_s, o_s);
  __syncthreads();
}

// Closed form on tensor cores (kTensorCores: a 16-bit state, windows of up to kTensorCoreMaxS
// columns, so n <= 8 and m <= 16). The rows phase's two products with the checkpoint, P = S A1^T
// (A1: kt_j for j < n, qt_j after) and S' = g S + W K2 (W: the coefficients, K2: the replayed
// tokens' raw k), run as mma.sync m16n8k16 on the warp's 8 rows in the state's dtype: S exact, and
// A1, W and K2 split into hi + lo parts of that dtype (fp32 accumulators; products to about 2^-16
// with bf16, and with fp16 to 2^-22 relative or 2^-25 absolute, whichever is larger: its lo part
// may be subnormal, and every part must lie in fp16's range, as the state does). A lane holds row
// lane / 4 of its group, physical columns 32 b + 8 t .. + 7 (t = lane % 4, b = 0..3) as four
// 16-byte words; the K columns are permuted the same way in both products, so that these words are
// at once GEMM1's B fragments (k-tile 2 b + h: registers 2h, 2h + 1 of word b), GEMM2's
// accumulators (n-tile pair 2 b + h: the same registers) and whole 16-byte loads and stores of the
// row. GEMM2 takes M = 16 as the warp's 8 rows twice, A = diag(W, W), so that one mma advances 16
// columns of them. A window of at most 8 tokens (m <= kTensorCorePackedTokens, every S = 4 launch)
// packs GEMM1's A as [hi; lo] of its tokens, M = 16 = 8 tokens x 2 parts, so that one mma chain
// (and one fragment load per k-tile) makes both parts' sums, which otherwise take two chains half
// of whose rows are padding (tensor_core_packed).
inline constexpr int kTensorCorePackedTokens = 8;
__device__ __forceinline__ bool tensor_core_packed(int m) { return m <= kTensorCorePackedTokens; }
struct TensorCoreFrags {     // in shared memory, built once per CTA after the solve
  uint32_t a1[2][8][32][4];  // GEMM1 A (tokens x K): hi, lo (packed: [hi; lo] in a1[0]); [kt][lane]
  uint32_t b2[2][8][32][2];  // GEMM2 B (2 x 8 tokens x 8 columns): hi, lo; [n-tile pair][lane]
};

// x = hi + lo for a pair of floats (hi = Half(x), lo = Half(x - hi)), packed as Half x 2.
template <class Half>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = StateBits<Half>::pack(x0, x1);
  const float2 h = StateBits<Half>::unpack(hi);
  lo = StateBits<Half>::pack(x0 - h.x, x1 - h.y);
}

// The launcher takes the tensor-core form only where the kernel image has it (tensor_core_image).
using cuda::mma::mma_16bit;

// Physical column of GEMM1's k-tile kt, lane column set t, pair 0 (logical k 2t, 2t + 1) or 1
// (2t + 8, 2t + 9): the first of two adjacent columns.
__device__ __forceinline__ int tc_gemm1_col(int kt, int t, int pair) {
  return 32 * (kt >> 1) + 8 * t + 4 * (kt & 1) + 2 * pair;
}

// The fragments from the solved vectors (whole CTA; k_s, q_s and gates as prepare_replay leaves
// them), in the state's dtype Half. They take the place of k_s, q_s and what follows up to v_s
// (SmemPlan), so every thread reads its values before the first write.
template <class Half>
__device__ __forceinline__ void build_tensor_core_frags(int n, int m, int tid, const float* k_s,
                                                        const float* q_s, TensorCoreFrags* frags) {
  static_assert(8 * 32 == 2 * kThreads, "two fragment entries per thread");
  const bool packed = tensor_core_packed(m);
  float2 a1[2][4];  // [entry][register]
  float b2[2][2][2];
#pragma unroll
  for (int it = 0; it < 2; ++it) {  // 8 k-tiles x 32 lanes = 2 entries per thread
    const int e = tid + kThreads * it, kt = e >> 5, g = (e >> 2) & 7, t = e & 3;
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0: (g, pair 0), a1: (g + 8, 0), a2: (g, 1), a3: (g + 8, 1)
      const int tok = g + 8 * (r & 1);  // packed (m <= 8): a1 and a3 are padding
      const float* vec = (tok < n ? k_s : q_s) + tok * kHeadDim;  // kt_j or qt_j
      a1[it][r] = tok < m ? *reinterpret_cast<const float2*>(vec + tc_gemm1_col(kt, t, r >> 1))
                          : make_float2(0.0f, 0.0f);
    }
  }
#pragma unroll
  for (int it = 0; it < 2; ++it) {  // 8 n-tile pairs x 32 lanes
    const int e = tid + kThreads * it, j = e >> 5, g = (e >> 2) & 7, t = e & 3;
    // Output column g of n-tile pair j: block a (B rows 0..7) and block b (rows 8..15).
    const int col = 32 * (j >> 1) + 8 * (g >> 1) + 4 * (j & 1) + (g & 1);
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
#pragma unroll
      for (int x = 0; x < 2; ++x) {  // tokens 2t, 2t + 1: raw k_i (q_s row i < n)
        const int tok = 2 * t + x;
        b2[it][blk][x] = tok < n ? q_s[tok * kHeadDim + col + 2 * blk] : 0.0f;
      }
  }
  __syncthreads();  // every read above before the fragments overwrite k_s and q_s
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int e = tid + kThreads * it;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) split_pair<Half>(a1[it][r].x, a1[it][r].y, hi[r], lo[r]);
    if (packed) {  // rows g (hi) and g + 8 (lo) of token g: registers a0, a1 pair 0, a2, a3 pair 1
      *reinterpret_cast<uint4*>(frags->a1[0][e >> 5][e & 31]) =
          make_uint4(hi[0], lo[0], hi[2], lo[2]);
    } else {
      *reinterpret_cast<uint4*>(frags->a1[0][e >> 5][e & 31]) =
          make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(frags->a1[1][e >> 5][e & 31]) =
          make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int e = tid + kThreads * it;
    uint32_t hi[2], lo[2];
#pragma unroll
    for (int blk = 0; blk < 2; ++blk)
      split_pair<Half>(b2[it][blk][0], b2[it][blk][1], hi[blk], lo[blk]);
    *reinterpret_cast<uint2*>(frags->b2[0][e >> 5][e & 31]) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(frags->b2[1][e >> 5][e & 31]) = make_uint2(lo[0], lo[1]);
  }
  __syncthreads();
}

// The rows phase of a warp's group of 8 rows on tensor cores. p: the lane's words of row lane / 4
// (Half, the state's dtype); v_g: v_s at the group's first row (row stride 1, token stride vs).
// Leaves in v_s what the FMA form leaves: w_i = c_i (vt_i - P_i) for i < n, o_j = ot_j + P_j
// (rounded as the output when round_output) for n <= j < m; then p = the advanced checkpoint rows
// (n > 0).
template <class Half, bool kBf16Activations>
__device__ __forceinline__ void tensor_core_rows(uint4 (&p)[4], const TensorCoreFrags* frags,
                                                 float* v_g, int vs, int n, int m, float coef,
                                                 float decay, const KernelArgs& args, int lane) {
  const int g = lane >> 2, t = lane & 3;
  // GEMM1: D [token][row] (tokens g, g + 8; rows 2t, 2t + 1 of the group), hi and lo chains;
  // packed: one chain, D [part][row] (hi of token g, then its lo), and dot[r] of r < 2 only.
  float dot[4];
  if (tensor_core_packed(m)) {
    float d[4] = {};
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const uint4 a = *reinterpret_cast<const uint4*>(frags->a1[0][kt][lane]);
      const uint32_t af[4] = {a.x, a.y, a.z, a.w};
      const uint4 s = p[kt >> 1];
      mma_16bit<Half>(d, af, (kt & 1) ? s.z : s.x, (kt & 1) ? s.w : s.y);
    }
    dot[0] = d[0] + d[2];
    dot[1] = d[1] + d[3];
    dot[2] = dot[3] = 0.0f;  // token g + 8 >= m
  } else {
    float d[2][4] = {};
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const uint4 ah = *reinterpret_cast<const uint4*>(frags->a1[0][kt][lane]);
      const uint4 al = *reinterpret_cast<const uint4*>(frags->a1[1][kt][lane]);
      const uint32_t afh[4] = {ah.x, ah.y, ah.z, ah.w}, afl[4] = {al.x, al.y, al.z, al.w};
      const uint4 s = p[kt >> 1];
      const uint32_t b0 = (kt & 1) ? s.z : s.x, b1 = (kt & 1) ? s.w : s.y;
      mma_16bit<Half>(d[0], afh, b0, b1);
      mma_16bit<Half>(d[1], afl, b0, b1);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) dot[r] = d[0][r] + d[1][r];
  }
  // Epilogue: token g's coefficient (g < n; coef = its c_g) or output (g >= n), and token g + 8's
  // output.
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int tok = g + 8 * (r >> 1), row = 2 * t + (r & 1);
    if (tok >= m) continue;
    float& x = v_g[tok * vs + row];
    if (tok < n) {
      x = coef * (x - dot[r]);
    } else {
      float o = x + dot[r];
      if (args.round_core_output)
        o = dev::round_to(activation_dtype<kBf16Activations>(args.out_dtype), o);
      x = o;
    }
  }
  if (n == 0) return;  // nothing replayed: the checkpoint is not stored
  __syncwarp();        // every lane's coefficients of the group's rows
  // GEMM2 A = diag(W, W): W [row g][tokens 2t, 2t + 1], hi and lo.
  const float w0 = 2 * t < n ? v_g[2 * t * vs + g] : 0.0f;
  const float w1 = 2 * t + 1 < n ? v_g[(2 * t + 1) * vs + g] : 0.0f;
  uint32_t wh, wl;
  split_pair<Half>(w0, w1, wh, wl);
  const uint32_t awh[4] = {wh, 0u, 0u, wh}, awl[4] = {wl, 0u, 0u, wl};
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // n-tile pair j: words 2 (j & 1), + 1 of p[j >> 1]
    uint32_t* word = reinterpret_cast<uint32_t*>(&p[j >> 1]) + 2 * (j & 1);
    const float2 x0 = StateBits<Half>::unpack(word[0]);
    const float2 x1 = StateBits<Half>::unpack(word[1]);
    float acc[4] = {decay * x0.x, decay * x0.y, decay * x1.x, decay * x1.y};
    const uint2 bh = *reinterpret_cast<const uint2*>(frags->b2[0][j][lane]);
    const uint2 bl = *reinterpret_cast<const uint2*>(frags->b2[1][j][lane]);
    mma_16bit<Half>(acc, awh, bh.x, bh.y);
    mma_16bit<Half>(acc, awh, bl.x, bl.y);
    mma_16bit<Half>(acc, awl, bh.x, bh.y);
    word[0] = StateBits<Half>::pack(acc[0], acc[1]);
    word[1] = StateBits<Half>::pack(acc[2], acc[3]);
  }
}

// A group's share of sum(o^2): its 8 rows' squares added as a pairwise tree, in one fixed order
// (every split and kernel adds the same way, so the norm does not depend on the mapping). The
// intrinsics keep the squares from being fused into the additions.
__device__ __forceinline__ float group_sum_sq(const float* o) {
  float sq[kRowsPerGroup];
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) sq[r] = __fmul_rn(o[r], o[r]);
#pragma unroll
  for (int width = 1; width < kRowsPerGroup; width *= 2)
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; r += 2 * width) sq[r] = __fadd_rn(sq[r], sq[r + width]);
  return sq[0];
}

// act(z) of the output gate (fast_sigmoid: act(z) of every output element costs a fifth of the
// instructions of the exact sigmoid).
__device__ __forceinline__ float gate_act(const KernelArgs& args, float zv) {
  const float s = fast_sigmoid(zv);
  return args.gate_sigmoid ? s : zv * s;
}

// Values of act(z) a thread loads at once (all of them for T <= the batch at R = 128): 4, or 2 in
// the fp32 write-all kernel, which spills with 4 (at 80 registers ptxas still keeps a few values
// of some kernels in local memory, one or two L1 loads per chunk: fp32 write-all 4 bytes, bf16
// closed-form replay 12). The first batch goes out with the token staging's loads, so that z
// costs no second round trip before the first chunk.
__host__ __device__ constexpr int z_batch(int state_bytes, bool replay) {
  return state_bytes == 4 && !replay ? 2 : 4;
}

// Floats staged per token besides q, k and v: alpha, beta (replay token by token: and k . q;
// closed form: and g_j, R(n-1, j)).
__host__ __device__ constexpr int gate_floats(bool replay, bool closed_form) {
  return closed_form ? kClosedGateFloats : replay ? 3 : 2;
}

// Bytes of a staged z value (SmemPlan): act(z) as fp32, except in the closed form, which stages
// z's raw bits, 2 for a 16-bit z (and 2 without z, whose array then holds nothing). The other
// forms never read `args` here (reading it moved the write-all kernels' register assignment).
__host__ __device__ constexpr int staged_z_bytes(bool closed_form, const KernelArgs& args) {
  if (!closed_form) return 4;
  return args.z != nullptr && args.z_dtype == DType::kFloat32 ? 4 : 2;
}

// Byte offsets of a CTA's shared arrays. S = state columns (T <= S), R = rows of the CTA; a
// replay CTA stages up to 2S tokens (n <= S replayed, T <= S new; q of the new ones), and in
// closed form q at each new token's row of 2S and the [2S][2S] matrix of its solve. The
// per-token arrays come first, at offsets of S and R alone, and the state tile last: the token
// loop recomputes these addresses rather than hold them in registers, and then they cost a few
// integer instructions instead of the tile's size.
inline constexpr int kClosedFormVPad = 4;  // 2-way at most (v_s's epilogue, W loads: none)
struct SmemPlan {
  int rows_per_chunk, chunks, buffers;
  int bars, meta, k, q, gates, mat, v, o, z, ss, rstd, w, tile, total;
  // Token stride of v_s (floats). The closed form pads its rows by kClosedFormVPad: its rows
  // phase reads and writes v_s by (token, row) across a warp (tokens lane / 4 or lane % 4), which
  // at a stride of R = 128 all fall in the same banks.
  int v_stride;
  // z_bytes: the size of a staged z value. The closed form stages z's raw bits (2 bytes for a
  // 16-bit z) and applies act(z) at the output; the other forms stage act(z) as fp32 (4).
  __host__ __device__ SmemPlan(int S, int R, int state_bytes, int max_buffers, bool replay,
                               bool closed_form, int z_bytes = 4, bool tensor_cores = false) {
    const int staged = replay ? 2 * S : S;        // token slots of k, v and gates
    const int q_rows = closed_form ? staged : S;  // ... and of q
    rows_per_chunk = R < kChunkRows ? R : kChunkRows;
    chunks = R / rows_per_chunk;
    buffers = chunks < max_buffers ? chunks : max_buffers;
    bars = 0;                           // uint64_t[kMaxChunks + 1]: chunks, norm
    meta = 64;                          // RowMeta
    k = 256;                            // float [staged][128]
    q = k + staged * kHeadDim * 4;      // float [q_rows][128]
    gates = q + q_rows * kHeadDim * 4;  // float [staged][gate_floats(replay, closed_form)]
    mat = gates + staged * gate_floats(replay, closed_form) * 4;  // float [m][m], m <= staged
    v = mat + (closed_form ? staged * staged * 4 : 0);            // float [staged][v_stride]
    // On tensor cores the fragments replace k, q, gates and mat once the solve is done.
    const int frags_end = k + int(sizeof(TensorCoreFrags));
    if (tensor_cores && v < frags_end) v = frags_end;
    // Core output o [S][R]. The closed form keeps it in v's rows n .. n + T - 1 instead (the new
    // tokens' vt are dead once the solve has turned them into ot): no array of its own.
    v_stride = closed_form ? R + kClosedFormVPad : R;
    o = v + staged * v_stride * 4;
    z = o + (closed_form ? 0 : S * R * 4);  // [S][R] act(z) (fp32), or z's raw bits (closed form)
    ss = z + S * R * z_bytes;               // float [S][16] group partials of o^2
    rstd = ss + S * kGroupsPerHead * 4;     // float [S]
    w = rstd + S * 4;  // float [R] norm weight (closed form at R = 128: reloaded at the output)
    tile = (w + (reloads_norm_weight(closed_form, R) ? 0 : R * 4) + 127) / 128 *
           128;  // [buffers][rows_per_chunk][128] state (bulk copies)
    total = tile + buffers * rows_per_chunk * kHeadDim * state_bytes;
  }
  // The closed form with a whole head per CTA keeps no w_s: the norm weight is loaded again at
  // the output (the kernel's w_reloaded).
  __host__ __device__ static constexpr bool reloads_norm_weight(bool closed_form, int R) {
    return closed_form && R == kHeadDim;
  }
};
static_assert(sizeof(RowMeta) <= 256 - 64, "RowMeta fits between the barriers and the tile");
static_assert((kMaxChunks + 1) * 8 <= 64, "the chunk and norm barriers fit before RowMeta");

// A staged token as the token steps read it (shared memory), and the value of the lane's row.
struct TokenArgs {
  const float* k;
  const float* q;
  const float* gates;  // alpha, beta (replay: k . q)
  float v;
};

// The switches of the kernel body, derived from a form (the only place that spells them out).
// replay: the slice comes from a checkpoint and the window is replayed first; closed_form: the
// window's triangle is solved once per CTA (prepare_replay); single_token: T = S = 1 compiled in;
// tokens_first: tokens staged before the slice's first chunks; tensor_cores / eight_ctas: the
// closed form's rows on tensor cores, at six or eight CTAs per SM; bf16_activations: activation
// dtypes known at compile time (activation_dtype); four_rows: 4 rows per lane in token-by-token
// replay; kv_layout: 16-byte loads and stores of an aligned "kv" pool (load_chunk_kv,
// store_rows_kv), the other images keep the element-by-element "kv" path, which then costs them no
// registers.
struct BodyTraits {
  bool replay = false, closed_form = false, single_token = false, tokens_first = false,
       tensor_cores = false, eight_ctas = false, bf16_activations = false, four_rows = false,
       kv_layout = false;
};
GDN_HOST_DEVICE constexpr BodyTraits with_image(BodyTraits t, KernelImage image) {
  t.bf16_activations = image == KernelImage::kBf16Activations;
  t.kv_layout = image == KernelImage::kAlignedKv;
  return t;
}
GDN_HOST_DEVICE constexpr BodyTraits body_traits(WriteAllForm form, KernelImage image) {
  BodyTraits t;
  t.single_token = form == WriteAllForm::kSingleToken;
  return with_image(t, image);
}
GDN_HOST_DEVICE constexpr BodyTraits body_traits(ReplayTokensForm form, KernelImage image) {
  BodyTraits t;
  t.replay = true;
  t.tokens_first = form == ReplayTokensForm::kTokensFirst;
  t.four_rows = form == ReplayTokensForm::kFourRows;
  return with_image(t, image);
}
GDN_HOST_DEVICE constexpr BodyTraits body_traits(ClosedFormMath math, KernelImage image) {
  BodyTraits t;
  t.replay = t.closed_form = true;
  t.tensor_cores = math != ClosedFormMath::kCudaCores;
  t.eight_ctas = math == ClosedFormMath::kTensorCoresEightCtas;
  return with_image(t, image);
}

template <class StateT, int kRatio, BodyTraits kTraits>
__device__ __forceinline__ void decode_mtp_body(const KernelArgs& args) {
  constexpr bool kReplay = kTraits.replay, kClosedForm = kTraits.closed_form;
  constexpr bool kSingleToken = kTraits.single_token, kStageFirst = kTraits.tokens_first;
  constexpr bool kTensorCores = kTraits.tensor_cores, kEightCtasPerSm = kTraits.eight_ctas;
  constexpr bool kBf16Activations = kTraits.bf16_activations, kFourRows = kTraits.four_rows;
  constexpr bool kKvLayout = kTraits.kv_layout;
  extern __shared__ __align__(128) unsigned char smem[];
  using Bits = StateBits<StateT>;
  using Raw = typename Bits::Raw;
  constexpr int kRows = kRowsPerLane<StateT, kReplay, kFourRows>;
  using Rows = GroupRows<kRows>;
  const int split = args.split;
  const int log2_R = 7 - (split == 1 ? 0 : split == 2 ? 1 : split == 4 ? 2 : 3);
  const int R = 1 << log2_R;  // rows of this CTA
  const int groups = R / kRowsPerGroup;
  const int S = kSingleToken ? 1 : args.S;
  const int HV = args.HV;
  constexpr bool closed_form = kReplay && kClosedForm;
  constexpr int kGateFloats = gate_floats(kReplay, closed_form);
  constexpr bool kPartialsPerGroup = sizeof(StateT) == 4 && !kReplay;  // see push_partial
  const SmemPlan plan(S, R, int(sizeof(StateT)), args.buffers, kReplay, closed_form,
                      staged_z_bytes(closed_form, args), kTensorCores);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + plan.bars);
  RowMeta& meta = *reinterpret_cast<RowMeta*>(smem + plan.meta);
  StateT* tile = reinterpret_cast<StateT*>(smem + plan.tile);
  float* k_s = reinterpret_cast<float*>(smem + plan.k);
  float* q_s = reinterpret_cast<float*>(smem + plan.q);
  float* v_s = reinterpret_cast<float*>(smem + plan.v);
  float* gates_s = reinterpret_cast<float*>(smem + plan.gates);
  float* mat_s = reinterpret_cast<float*>(smem + plan.mat);
  float* o_s = reinterpret_cast<float*>(smem + plan.o);
  float* z_s = reinterpret_cast<float*>(smem + plan.z);
  float* ss_s = reinterpret_cast<float*>(smem + plan.ss);
  float* rstd_s = reinterpret_cast<float*>(smem + plan.rstd);
  float* w_s = reinterpret_cast<float*>(smem + plan.w);
  const int v_stride = plan.v_stride;               // token stride of v_s
  const int o_stride = closed_form ? v_stride : R;  // ... and of o_s (the closed form's is in v_s)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = int(blockIdx.x & unsigned(split - 1));
  const unsigned head = blockIdx.x >> (7 - log2_R);  // heads * split <= INT_MAX (host check)
  const int64_t n = head / unsigned(HV);
  const int hv = int(head - unsigned(n) * unsigned(HV));
  const int h = hv / (kRatio == kRuntimeValue ? args.ratio : kRatio);  // key head of hv
  const int row0 = rank * R;  // first row of this CTA in the head
  const bool norm = args.norm_weight != nullptr;
  const bool gated = args.z != nullptr;
  const bool clustered = norm && split > 1;
#if GDN_CUDA_SM90
  const bool bulk = args.bulk_load;
#else
  const bool bulk = false;
#endif
  const int chunks = plan.chunks, buffers = plan.buffers, rows_per_chunk = plan.rows_per_chunk;
  // A split head's norm partials arrive from the peers on norm_bar (one arrival: this CTA's
  // thread 0, which expects their bytes).
  uint64_t* norm_bar = bars + kMaxChunks;
  if (tid == 0 && (bulk || clustered)) {
    if (bulk)
      for (int c = 0; c < buffers; ++c) mbarrier_init(&bars[c], 1);
    if (clustered) mbarrier_init(norm_bar, 1);
    mbarrier_init_fence();
  }
  // Peers may signal norm_bar once they have waited for this arrival (before their first push).
  if (clustered) cluster_arrive_relaxed();
  // Every exit: a clustered CTA first waits for its peers' arrival (they take the same exit).
  auto leave = [&]() {
    if (clustered) cluster_wait();
  };

  wait_for_prior_grids();  // nothing below may read what earlier launches write before this
  allow_dependent_launch();

  // 1. The request's slot ids (replay: its checkpoint slot), token range and accepted count (one
  //    round trip).
  if (kReplay ? tid == 0 : tid < S) {
    meta.slot[tid] = gdn::load_index(args.state_indices, args.index_dtype,
                                     kReplay ? n * args.index_stride : n * S + tid);
  } else if (tid == 32) {
    meta.c0 = gdn::load_index(args.cu_seqlens, args.cu_dtype, n);
  } else if (tid == 33) {
    meta.c1 = gdn::load_index(args.cu_seqlens, args.cu_dtype, n + 1);
  } else if (tid == 34) {
    meta.acc = args.num_accepted_tokens
                   ? gdn::load_index(args.num_accepted_tokens, args.acc_dtype, n)
                   : int64_t(1);
  }
  const uint32_t w_bits =
      norm && tid < R ? load_bits(args.norm_weight, args.norm_dtype, row0 + tid) : 0u;
  __syncthreads();

  // 2. Validity (every thread decides the same, from shared memory). A replay row's window_len is
  //    read only in step 3 (it depends on the slot); the rest is decided here.
  const int64_t c0 = meta.c0, c1 = meta.c1, acc = meta.acc;
  bool valid;
  int64_t source;
  if constexpr (kReplay) {
    source = meta.slot[0];
    const ReplayRow row = classify_replay_row(c0, c1, args.L, S, source, args.num_slots,
                                              args.first_valid_slot, acc, INT64_MAX);
    if (row == ReplayRow::kPadded) return leave();  // nothing to read or write, out rows included
    valid = row == ReplayRow::kLive;
  } else {
    bool slots_in_pool = true;
    for (int c = 0; c < S; ++c) slots_in_pool = slots_in_pool && meta.slot[c] < args.num_slots;
    source = acc >= 1 && acc <= S ? meta.slot[acc - 1] : -1;
    // classify_row (params.hpp): the host's check_row decides the same.
    const RowClass row =
        classify_row(c0, c1, args.L, S, acc, slots_in_pool, source, args.first_valid_slot);
    if (row == RowClass::kPadded) return leave();  // nothing to read or write
    valid = row == RowClass::kLive;
  }
  // The share of sum(o^2) of group g for output token t (from o_s), written as this CTA's partial
  // and pushed to every peer CTA of a split head (st.async, counted by their norm_bar). Taken from
  // o_s once a group's rows are done rather than per token in the token loop, which then spends no
  // shuffles on the norm: after the loop by the whole CTA, or in the fp32 write-all kernel by each
  // warp as it finishes a group (kPartialsPerGroup: that CTA streams its bytes and a phase after
  // the loop lengthens its tail).
  auto push_partial = [&](int t, int g) {
    float* part = ss_s + t * kGroupsPerHead + rank * groups + g;
    const float sq = group_sum_sq(o_s + t * o_stride + g * kRowsPerGroup);
    *part = sq;
    if (clustered)
      for (int copy = 1; copy < split; ++copy) {
        const int peer = (rank + copy) & (split - 1);
        store_to_peer(cluster_shared_address(part, peer), sq,
                      cluster_shared_address(norm_bar, peer));
      }
  };
  // An invalid row stores nothing, zero-fills its output rows inside [0, L) and is counted once.
  auto reject_row = [&]() {
    const int64_t lo = c0 < 0 ? 0 : c0, hi = c1 > args.L ? args.L : c1;
    const int64_t count = hi > lo ? (hi - lo) * R : 0;
    for (int64_t e = tid; e < count; e += kThreads) {
      const int64_t l = lo + (e >> log2_R);
      store_value(args.out, activation_dtype<kBf16Activations>(args.out_dtype),
                  (l * HV + hv) * kHeadDim + row0 + (e & (R - 1)), 0.0f);
    }
    if (args.error_count && hv == 0 && rank == 0 && tid == 0) atomicAdd(args.error_count, 1);
    leave();
  };
  if (!valid) {
    reject_row();
    return;
  }
  const int T = kSingleToken ? 1 : int(c1 - c0);  // a valid row has 1 <= T <= S
  const int n_replay = kReplay ? int(acc) : 0;    // window tokens replayed before the new ones
  const int tokens = n_replay + T;                // staged tokens
  const int64_t head_elems = int64_t(kHeadDim) * kHeadDim;
  const int64_t head_offset = int64_t(hv) * head_elems;

  // 3. The source slice, by chunks (issued in step 4). Every row is read before it is written (rows
  //    evolve independently, so a chunk may be refilled while earlier rows are being stored).
  const StateT* src =
      static_cast<const StateT*>(args.state) + source * args.slot_stride + head_offset;
  const int chunk_elems = rows_per_chunk * kHeadDim;
  const uint32_t chunk_bytes = uint32_t(chunk_elems * int(sizeof(StateT)));
  const bool hints = args.evict_hints;
  const uint64_t policy = bulk && tid == 0 ? l2_policy(hints) : 0;
  // Chunk c goes to buffer b = c % buffers (chunk_ring).
  auto issue_chunk = [&](int c, int b) {  // one thread
    bulk_load(tile + b * chunk_elems, src + int64_t(row0 + c * rows_per_chunk) * kHeadDim,
              chunk_bytes, &bars[b], policy);
  };
  auto plain_load_chunk = [&](int c, int b) {  // the whole CTA
    StateT* buf = tile + b * chunk_elems;
    const int r0 = row0 + c * rows_per_chunk;
    if constexpr (kKvLayout) {
      if (args.kv_vector) return load_chunk_kv(buf, src, r0, rows_per_chunk, tid);
    }
    if (args.state_kv) {  // element (row v, column k) at k * 128 + v: rows fastest
      for (int e = tid; e < chunk_elems; e += kThreads) {
        const int r = e % rows_per_chunk, k = e / rows_per_chunk;
        buf[r * kHeadDim + k] = src[int64_t(k) * kHeadDim + r0 + r];
      }
    } else {
      for (int e = tid; e < chunk_elems; e += kThreads) buf[e] = src[int64_t(r0) * kHeadDim + e];
    }
  };
  auto issue_first_chunks = [&]() {
    if (bulk && tid == 0)
      for (int c = 0; c < buffers; ++c) issue_chunk(c, c);
    if (kReplay && tid == 0) meta.stored = *(args.window_len + source);  // overlaps the copies
  };
  // Write-all: the slice's first chunks go out once every warp has issued the loads of its first
  // two tokens (and the first z and gate loads), so that a loaded memory system serves these small
  // loads before the slice's bytes instead of after them and the CTA starts on chunk 0 as soon as
  // it lands. Token-by-token replay of an fp32 state does the same, and so does 16-bit
  // token-by-token replay in ReplayTokensForm::kTokensFirst, which the launcher takes from one to
  // sixteen heads per SM (use_replay_stage_first). The other replay kernels and the single-token
  // form issue the chunks first and stage token by token, which is faster for them.
  constexpr bool kActivationsFirst =
      !kSingleToken && (!kReplay || (sizeof(StateT) == 4 && !closed_form) || kStageFirst);
  if constexpr (!kActivationsFirst) issue_first_chunks();

  // 4. Activations of every staged token (warp w stages tokens w, w + 4, ...), act(z), norm
  //    weight. Replay: tokens 0..n-1 come from the checkpoint slot's window (raw k, v, a, b; the
  //    same math as their first pass), tokens n.. from this call's rows.
  //    act(z) is staged in batches of kZBatch values per thread (tid + kThreads i), all loads of
  //    a batch issued before any is used, the first batch before the token staging.
  constexpr int kZBatch = z_batch(int(sizeof(StateT)), kReplay);
  const int z_count = gated ? T << log2_R : 0;  // z values of the CTA: [T][R]
  // Value e = t R + r of the CTA is at z_base + t z_row_stride + r; e steps by kThreads, a
  // multiple of R, so a thread's values share r and their offsets step by kThreads / R rows
  // (computed once: the 64-bit index math per value cost about 30 instructions).
  const int64_t z_base = c0 * args.z_row_stride + hv * args.z_head_stride + row0;
  const int64_t z_step = int64_t(kThreads >> log2_R) * args.z_row_stride;
  auto load_z = [&](int first, uint32_t (&bits)[kZBatch]) {
    int64_t at = z_base + int64_t(first >> log2_R) * args.z_row_stride + (first & (R - 1));
#pragma unroll
    for (int i = 0; i < kZBatch; ++i, at += z_step)
      bits[i] = first + i * kThreads < z_count
                    ? load_bits(args.z, activation_dtype<kBf16Activations>(args.z_dtype), at)
                    : 0u;
  };
  auto stage_z = [&](int first, const uint32_t (&bits)[kZBatch]) {
#pragma unroll
    for (int i = 0; i < kZBatch; ++i) {
      const int e = first + i * kThreads;
      if (e >= z_count) continue;
      if constexpr (closed_form) {  // raw bits; act(z) at the output
        if (activation_dtype<kBf16Activations>(args.z_dtype) != DType::kFloat32)
          reinterpret_cast<uint16_t*>(z_s)[e] = uint16_t(bits[i]);
        else
          reinterpret_cast<uint32_t*>(z_s)[e] = bits[i];
      } else {
        z_s[e] =
            gate_act(args, bits_to_f32(bits[i], activation_dtype<kBf16Activations>(args.z_dtype)));
      }
    }
  };
  uint32_t z_bits[kZBatch];
  load_z(tid, z_bits);
  const bool gate_lane = warp == kWarps - 1 && lane < tokens;  // the warp with the fewest tokens
  GateBits gate_bits{};
  if (gate_lane)
    gate_bits = load_gates<kReplay, kBf16Activations>(args, lane, n_replay, c0, source, hv);
  auto stage = [&](int t, const TokenBits& bits) {
    stage_token<kReplay && !closed_form, kBf16Activations>(
        args, bits, t < n_replay, R, lane,
        t < n_replay ? nullptr : q_s + (closed_form ? t : t - n_replay) * kHeadDim,
        k_s + t * kHeadDim, v_s + t * v_stride, gates_s + kGateFloats * t);
  };
  if constexpr (kActivationsFirst) {
    constexpr int kAhead = 2;  // tokens per warp loaded before the chunks go out
    TokenBits ahead[kAhead];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int t = warp + i * kWarps;
      if (t < tokens)
        ahead[i] = load_token<kReplay, kBf16Activations>(args, t, n_replay, c0, source, h, hv, row0,
                                                         R, lane);
    }
    __syncthreads();  // every warp's loads above are issued
    issue_first_chunks();
#pragma unroll
    for (int i = 0; i < kAhead; ++i)
      if (warp + i * kWarps < tokens) stage(warp + i * kWarps, ahead[i]);
    for (int t = warp + kAhead * kWarps; t < tokens; t += kWarps)
      stage(t, load_token<kReplay, kBf16Activations>(args, t, n_replay, c0, source, h, hv, row0, R,
                                                     lane));
  } else {
    for (int t = warp; t < tokens; t += kWarps)
      load_and_stage_token<kReplay, kReplay && !closed_form, kBf16Activations>(
          args, t, n_replay, c0, source, h, hv, row0, R, lane,
          t < n_replay ? nullptr : q_s + (closed_form ? t : t - n_replay) * kHeadDim,
          k_s + t * kHeadDim, v_s + t * v_stride, gates_s + kGateFloats * t);
  }
  if (gate_lane) stage_gates<kBf16Activations>(args, gate_bits, gates_s + kGateFloats * lane);
  stage_z(tid, z_bits);
  for (int first = tid + kZBatch * kThreads; first < z_count; first += kZBatch * kThreads) {
    load_z(first, z_bits);
    stage_z(first, z_bits);
  }
  // The closed form at R = 128 has no w_s (SmemPlan): each thread loads the norm weight of the row
  // it outputs again at the end (a held w_bits would cost the token loop a register).
  const bool w_reloaded = SmemPlan::reloads_norm_weight(closed_form, R);
  if (norm && tid < R && !w_reloaded) w_s[tid] = bits_to_f32(w_bits, args.norm_dtype);
  __syncthreads();  // staged tokens (and a replay row's window_len) visible

  if constexpr (kReplay) {  // the replay count against the tokens the window holds
    if (acc > meta.stored) {
      if (bulk)  // no bulk copy may still be writing this CTA's shared memory when it exits
        for (int c = 0; c < buffers; ++c) mbarrier_wait(&bars[c], 0u);
      reject_row();
      return;
    }
    if constexpr (closed_form)
      prepare_replay<kTensorCores, kEightCtasPerSm ? 2 * kTensorCoreEightMaxS : kSolveInRegisters>(
          n_replay, tokens, R, v_stride, tid, k_s, q_s, gates_s, mat_s, v_s,
          v_s + n_replay * v_stride, args);  // ot (then o) in the new tokens' rows of v (SmemPlan)
  }
  // Tensor cores: the lane's checkpoint coefficient c_g (token lane / 4 < n) and the checkpoint's
  // decay, read before the fragments overwrite the gates.
  float tc_coef = 0.0f, tc_decay = 0.0f;
  if constexpr (kTensorCores) {
    const int tok = lane >> 2;
    if (tok < n_replay) tc_coef = gates_s[kClosedGateFloats * tok + kGateCheckpoint];
    if (n_replay > 0) tc_decay = gates_s[kClosedGateFloats * (n_replay - 1) + kGateDecay];
    build_tensor_core_frags<StateT>(n_replay, tokens, tid, k_s, q_s,
                                    reinterpret_cast<TensorCoreFrags*>(k_s));
  }
  if (clustered) cluster_wait();  // every peer's norm_bar is initialised: partials may be pushed

  // 5. Chunks of 32 rows (4 groups of 8, one per warp) in order; a buffer is refilled with chunk
  //    c + buffers once every warp holds its rows of chunk c in registers.
  const int64_t my_slot = kReplay ? source : lane < S ? meta.slot[lane] : 0;
  const int64_t row_step = args.state_kv ? 1 : kHeadDim;  // element distance between rows
  const int64_t col_step = args.state_kv ? kHeadDim : 1;  // ... and between K columns
  StateT* const pool = static_cast<StateT*>(args.state);
  for (int c = 0; c < chunks; ++c) {
    const int g = c * kWarps + warp;  // this warp's group (R = 16: warps 2, 3 have none)
    const auto [buf, parity] = chunk_ring(c, buffers);
    if (bulk) {
      mbarrier_wait(&bars[buf], parity);
    } else {  // at least 2 buffers (choose_buffers): the barrier of chunk c - 1 orders this refill
      plain_load_chunk(c, buf);  // after every warp's reads of chunk c - buffers
      __syncthreads();
    }
    GroupRows<kRows> s;
    uint4 tc_words[4];  // kTensorCores: row lane / 4, columns 32 b + 8 (lane % 4) .. + 7
    if (g < groups) {
      if constexpr (kTensorCores) {
        const StateT* row =
            tile + buf * chunk_elems + (warp * kRowsPerGroup + lane_row(lane)) * kHeadDim;
        // The 8 rows of a load are 256 bytes apart (same banks): odd rows read their words in the
        // order 1, 0, 3, 2, so that each load covers all 32 banks (no 2-way conflict).
        const bool odd = lane_row(lane) & 1;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // words 2h and 2h + 1
          const StateT* at = row + 64 * h + 8 * (lane & 3);
          const uint4 first = *reinterpret_cast<const uint4*>(at + (odd ? 32 : 0));
          const uint4 second = *reinterpret_cast<const uint4*>(at + (odd ? 0 : 32));
          tc_words[2 * h] = odd ? second : first;
          tc_words[2 * h + 1] = odd ? first : second;
        }
      } else {
        const StateT* rows =
            tile + buf * chunk_elems + (warp * kRowsPerGroup + Rows::first_row(lane)) * kHeadDim;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < Rows::kChunks; ++j)
            s.x[r][j] = Bits::to_f32(
                *reinterpret_cast<const Raw*>(rows + r * kHeadDim + Rows::col(lane, j)));
      }
    }
    if (bulk && c + buffers < chunks) {
      __syncthreads();  // every warp's rows of chunk c are in registers: refill its buffer
      if (tid == 0) {
        dev::fence_proxy_async();  // the reads above before the bulk copy's writes
        issue_chunk(c + buffers, buf);
      }
    }
    if (g >= groups) continue;
    const int grow = g * kRowsPerGroup;        // first row of the group in this CTA
    const int my_row = grow + lane_row(lane);  // row this lane holds after a reduction
    // Element offset of this lane's first row in a slot.
    const int64_t row_offset = head_offset + (row0 + grow + Rows::first_row(lane)) * row_step;

    // The group's rows to slot `dest` of the pool, from registers.
    auto store_rows = [&](int64_t dest) {
      StateT* dst = pool + dest * args.slot_stride + row_offset;
      if constexpr (kKvLayout) {
        if (args.kv_vector)
          return store_rows_kv<StateT, kRows>(dst, s.x, Rows::col(lane, 0), Rows::kSetLanes);
      }
      if (args.state_vector) {  // chunk (r, j) at a constant offset from the lane's first one
        dst += Rows::col(lane, 0);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < Rows::kChunks; ++j) {
            const int at = r * kHeadDim + Rows::col(0, j);
            if (hints)
              Bits::store_streaming(dst + at, Bits::from_f32(s.x[r][j]));
            else
              Bits::store_plain(dst + at, Bits::from_f32(s.x[r][j]));
          }
      } else {  // "kv": the slow path
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < Rows::kChunks; ++j)
            Bits::store_scalar(dst + r * row_step + Rows::col(lane, j) * col_step, col_step,
                               Bits::from_f32(s.x[r][j]));
      }
    };

    // The core output o of output token `to` (row my_row) to shared memory, by the lane that
    // owns it.
    auto emit_output = [&](int to, float o, bool owner) {
      if (args.round_core_output)
        o = dev::round_to(activation_dtype<kBf16Activations>(args.out_dtype), o);
      if (owner) o_s[to * R + my_row] = o;
    };
    // Staged token t as the token steps read it; q_row: its q (output tokens; replayed ones have
    // none).
    auto token_args = [&](int t, const float* q_row) {
      return TokenArgs{k_s + t * kHeadDim, q_row, gates_s + kGateFloats * t, v_s[t * R + my_row]};
    };

    if constexpr (kReplay) {
      if constexpr (!closed_form) {
        // Token by token: the n accepted window tokens advance the state only; it goes to the
        // checkpoint once, after the last of them. Then the new tokens, outputs only.
        float scale_c = 1.0f;  // the rows hold S / scale_c (advance_rows_scaled)
        // Token t's staged k, gates and v of row my_row, as running pointers (recomputing them
        // from S and t cost about 20 instructions per token).
        const float* k_t = k_s;
        const float* gates_t = gates_s;
        const float* v_t = v_s + my_row;
        for (int t = 0; t < n_replay; ++t) {
          advance_rows_scaled<false>(s, scale_c, k_t, nullptr, 0.0f, gates_t[0], gates_t[1], *v_t,
                                     true, lane);
          k_t += kHeadDim;
          gates_t += kGateFloats;
          v_t += R;
        }
        if (n_replay > 0) {
          fold_scale(s, scale_c);
          store_rows(source);
        }
        const float* q_t = q_s;
        float* o_t = o_s + my_row;  // output token t - n of row my_row
        const bool round_output = args.round_core_output;
        for (int t = n_replay; t < tokens; ++t) {
          float o = advance_rows_scaled<true>(s, scale_c, k_t, q_t, gates_t[2], gates_t[0],
                                              gates_t[1], *v_t, t + 1 < tokens, lane);
          if (round_output)
            o = dev::round_to(activation_dtype<kBf16Activations>(args.out_dtype), o);
          if ((lane & 3) == 0) *o_t = o;
          k_t += kHeadDim;
          q_t += kHeadDim;
          gates_t += kGateFloats;
          v_t += R;
          o_t += R;
        }
      } else if constexpr (kTensorCores) {
        tensor_core_rows<StateT, kBf16Activations>(
            tc_words, reinterpret_cast<const TensorCoreFrags*>(k_s), v_s + grow, v_stride, n_replay,
            tokens, tc_coef, tc_decay, args, lane);
        if (n_replay > 0 && args.state_vector) {
          // The group's rows to the checkpoint. Quads g and g ^ 1 swap a word per half row, so
          // that each warp store covers 128 bytes of each of 4 rows rather than 64 of 8.
          // The even quad of a pair stores columns 64 h + 8 t of both rows, the odd quad 64 h + 32
          // + 8 t: one address per lane, the columns' offsets constants.
          const bool odd = lane & 4;
          StateT* const first = pool + source * args.slot_stride + head_offset +
                                (row0 + grow + (lane_row(lane) & ~1)) * row_step + 8 * (lane & 3) +
                                (odd ? 32 : 0);  // the even row; the odd row follows
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // columns 64 h .. + 63: words 2h (even), 2h + 1 (odd)
            const uint4 send = odd ? tc_words[2 * h] : tc_words[2 * h + 1];
            uint4 recv;
            recv.x = __shfl_xor_sync(0xffffffffu, send.x, 4);
            recv.y = __shfl_xor_sync(0xffffffffu, send.y, 4);
            recv.z = __shfl_xor_sync(0xffffffffu, send.z, 4);
            recv.w = __shfl_xor_sync(0xffffffffu, send.w, 4);
            // First store: the even row's 128 bytes; second: the odd row's.
            const uint4 first_v = odd ? recv : tc_words[2 * h];
            const uint4 second_v = odd ? tc_words[2 * h + 1] : recv;
            uint4* const even_at = reinterpret_cast<uint4*>(first + 64 * h);
            uint4* const odd_at = reinterpret_cast<uint4*>(first + kHeadDim + 64 * h);
            if (hints) {
              __stcs(even_at, first_v);
              __stcs(odd_at, second_v);
            } else {
              *even_at = first_v;
              *odd_at = second_v;
            }
          }
        } else if (n_replay > 0) {  // "kv": the slow path
          StateT* dst = pool + source * args.slot_stride + head_offset +
                        (row0 + grow + lane_row(lane)) * row_step;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int col = 32 * b + 8 * (lane & 3);
            Bits::store_scalar(dst + col * col_step, col_step,
                               make_uint2(tc_words[b].x, tc_words[b].y));
            Bits::store_scalar(dst + (col + 4) * col_step, col_step,
                               make_uint2(tc_words[b].z, tc_words[b].w));
          }
        }
      } else {
        // Closed form: every dot product with the checkpoint rows first (batches of 4: lane holds
        // dot b + (lane & 3) of row my_row after the reduction): w of the replayed tokens -> their
        // checkpoint coefficients, o of the new ones. Then the checkpoint, once, after the n-th.
        static_assert(kRows == 2, "replay reduces 2 rows x 4 dots over 8 lanes");
        const int dots = n_replay + T;
        for (int b = 0; b < dots; b += 4) {
          float p[2 * 4];  // p[r * 4 + e]: row r of the lane's set, dot b + e
#pragma unroll
          for (int j = 0; j < Rows::kChunks; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int d = b + e < dots ? b + e : dots - 1;  // past the end: a repeat, unused
              const float* vec = (d < n_replay ? k_s : q_s) + d * kHeadDim;  // kt_d or qt_d
              const float4 wj = *reinterpret_cast<const float4*>(vec + Rows::col(lane, j));
#pragma unroll
              for (int r = 0; r < kRows; ++r)
                p[r * 4 + e] = j == 0 ? dot4(s.x[r][j], wj) : dot4_acc(s.x[r][j], wj, p[r * 4 + e]);
            }
          const float dot = transpose_sum(p, lane);
          const int d = b + (lane & 3);
          if (d < n_replay) {  // w = vt - s . kt, times R(n-1, d): the checkpoint coefficient
            float& vt = v_s[d * v_stride + my_row];
            vt = gates_s[kClosedGateFloats * d + kGateCheckpoint] * (vt - dot);
          }
          if (d >= n_replay && d < dots) {  // token d: lanes d & 3 + 4p; o_d replaces ot_d in
                                            // v's row d (SmemPlan)
            float& o_d = v_s[d * v_stride + my_row];
            float o = o_d + dot;
            if (args.round_core_output)
              o = dev::round_to(activation_dtype<kBf16Activations>(args.out_dtype), o);
            o_d = o;
          }
        }
        if (n_replay > 0) {
          __syncwarp();  // every lane's coefficients of the group's rows
          const float g = gates_s[kClosedGateFloats * (n_replay - 1) + kGateDecay];
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < Rows::kChunks; ++j) {
              float4& x = s.x[r][j];
              x.x *= g;
              x.y *= g;
              x.z *= g;
              x.w *= g;
            }
          const int first = grow + Rows::first_row(lane);
          for (int i = 0; i < n_replay; ++i) {
            float coef[kRows];
#pragma unroll
            for (int r = 0; r < kRows; ++r) coef[r] = v_s[i * v_stride + first + r];
#pragma unroll
            for (int j = 0; j < Rows::kChunks; ++j) {
              const float4 kj = *reinterpret_cast<const float4*>(q_s + i * kHeadDim +
                                                                 Rows::col(lane, j));  // raw k_i
#pragma unroll
              for (int r = 0; r < kRows; ++r) add_scaled(s.x[r][j], kj, coef[r]);
            }
          }
          store_rows(source);
        }
      }
    } else {
      for (int t = 0; t < tokens; ++t) {
        const TokenArgs x = token_args(t, q_s + t * kHeadDim);
        const float o = advance_rows(s, x.k, x.q, x.gates[0], x.gates[1], x.v, lane);
        // The state after token t -> slot state_indices[n, t] (null: skipped).
        const int64_t dest = __shfl_sync(0xffffffffu, my_slot, t);
        if (dest >= args.first_valid_slot && dest >= 0) store_rows(dest);
        emit_output(t, o, (lane & 3) == 0);  // every lane holds token t
      }
    }
    if (kPartialsPerGroup && norm) {  // the group's outputs are in o_s: lane t takes token t
      __syncwarp();
      for (int t = lane; t < T; t += 32) push_partial(t, g);
    }
  }

  if constexpr (closed_form) o_s = v_s + n_replay * v_stride;  // o in the new tokens' rows of v

  // 6. Gated RMSNorm over all 128 rows (the partials of every CTA of the cluster), in one fixed
  //    order whatever the split, then the outputs.
  __syncthreads();  // o (and with kPartialsPerGroup this CTA's partials) visible
  if (norm) {
    if constexpr (!kPartialsPerGroup) {
      for (int e = tid; e < T * groups; e += kThreads)
        push_partial(e >> (log2_R - 3), e & (groups - 1));  // groups = R / 8
      __syncthreads();                                      // this CTA's partials visible
    }
    if (tid < T) {
      if (clustered) {  // the peers' partials: (split - 1) CTAs x groups x T floats
        if (tid == 0) mbarrier_arrive_expect_tx(norm_bar, uint32_t((split - 1) * groups * T * 4));
        mbarrier_wait(norm_bar, 0u);
      }
      float total = 0.0f;
#pragma unroll
      for (int gg = 0; gg < kGroupsPerHead; ++gg)  // the 16 group partials of the head, in order
        total += ss_s[tid * kGroupsPerHead + gg];
      rstd_s[tid] = 1.0f / sqrtf(total / float(kHeadDim) + args.norm_eps);
    }
    // Every CTA has every peer's partials (no push is still in flight) before any exits.
    if (clustered) cluster_arrive_relaxed();
    __syncthreads();
  }
  // The outputs of this thread: rows r = tid % R of tokens tid / R + i kThreads / R (as z above).
  const int r_out = tid & (R - 1);
  const int64_t out_step = int64_t(kThreads >> log2_R) * HV * kHeadDim;
  int64_t out_at = ((c0 + (tid >> log2_R)) * HV + hv) * kHeadDim + row0 + r_out;
  const float w_out = !norm        ? 1.0f
                      : w_reloaded ? load_value(args.norm_weight, args.norm_dtype, row0 + r_out)
                                   : w_s[r_out];
  for (int e = tid; e < (T << log2_R); e += kThreads, out_at += out_step) {
    const int t = e >> log2_R;
    float y = closed_form ? o_s[t * o_stride + (e & (R - 1))] : o_s[e];
    if (norm) {
      y = y * rstd_s[t] * w_out;
      if (gated) {
        if constexpr (closed_form) {
          const uint32_t bits = activation_dtype<kBf16Activations>(args.z_dtype) != DType::kFloat32
                                    ? uint32_t(reinterpret_cast<const uint16_t*>(z_s)[e])
                                    : reinterpret_cast<const uint32_t*>(z_s)[e];
          y *= gate_act(args, bits_to_f32(bits, activation_dtype<kBf16Activations>(args.z_dtype)));
        } else {
          y *= z_s[e];
        }
      }
    }
    store_value(args.out, activation_dtype<kBf16Activations>(args.out_dtype), out_at, y);
  }
  if (clustered) cluster_wait();
}

// The three modes, each its own kernel over the body above; a form that needs a 16-bit state
// exists only for one, and write-all has no bf16-activation image.
template <class StateT, int kRatio, WriteAllForm kForm, KernelImage kImage>
  requires(kForm != WriteAllForm::kSingleToken || sizeof(StateT) == 2) &&
          (kImage != KernelImage::kBf16Activations)
__global__ void __launch_bounds__(kThreads, form_ctas_per_sm(kForm == WriteAllForm::kSingleToken))
    write_all_kernel(const __grid_constant__ KernelArgs args) {
  decode_mtp_body<StateT, kRatio, body_traits(kForm, kImage)>(args);
}

template <class StateT, int kRatio, ReplayTokensForm kForm, KernelImage kImage>
  requires(kForm != ReplayTokensForm::kTokensFirst || sizeof(StateT) == 2)
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    replay_tokens_kernel(const __grid_constant__ KernelArgs args) {
  decode_mtp_body<StateT, kRatio, body_traits(kForm, kImage)>(args);
}

template <class StateT, int kRatio, ClosedFormMath kMath, KernelImage kImage>
  requires(kMath == ClosedFormMath::kCudaCores || sizeof(StateT) == 2)
__global__ void __launch_bounds__(kThreads,
                                  form_ctas_per_sm(false,
                                                   kMath == ClosedFormMath::kTensorCoresEightCtas))
    replay_closed_form_kernel(const __grid_constant__ KernelArgs args) {
  decode_mtp_body<StateT, kRatio, body_traits(kMath, kImage)>(args);
}

}  // namespace gdn::decode_mtp::cuda_detail
