// prefill's CUDA kernels: the chunked (WY / UT) form of the gated delta rule on tensor cores.
//
// Per chunk of n <= 64 tokens of a request, with G_t the running sum of the log-decays g inside
// the chunk (gamma_t = exp(G_t)), k and q L2-normalised (q also scaled), beta_t the write strength
// and S the state (V x K) at the chunk's start (docs prefill.md §3 gives the derivation):
//
//   A[t][s] = beta_t exp(G_t - G_s) k_t . k_s       (s < t; strictly lower)
//   P[t][s] = exp(G_t - G_s) q_t . k_s               (s <= t)
//   W       = (I + A)^-1 diag(beta gamma) K          U = (I + A)^-1 diag(beta) V
//   Delta   = U - W S^T                              (the delta-rule writes of the chunk's tokens)
//   o_t     = S (gamma_t q_t) + sum_s P[t][s] Delta_s
//   S'      = gamma_end S + sum_s Delta_s (exp(G_end - G_s) k_s)^T
//
// Everything but the last three lines depends on the chunk's own tokens only. Each (request, value
// head) runs through its chunks in order, with the state in fp32 accumulator registers (a warp
// owns 16 state rows), in one of three forms (StatePass):
//   - fused: one CTA of eight warps per (request, value head) computes each chunk's tiles on chip
//     from its tokens (the next chunk's rows copied in meanwhile), then Delta, o with the gated
//     RMSNorm (which needs all 128 rows of a token's output) and S';
//   - chunk kernel, then one pass: the chunk kernel computes the tiles of every (chunk, value
//     head) of the call in parallel into a workspace (W, U^T, P, the decayed q and k, gamma_end),
//     and one CTA per (request, value head) copies them in a chunk ahead and does the rest;
//   - chunk kernel, recurrence, then outputs: without the norm the rows are independent, so four
//     CTAs of two warps share a head's rows and only compute Delta and S'. They store S and
//     Delta^T per chunk as the bf16 A fragments of the output products, and an output kernel then
//     computes o and the norm for every (chunk, value head) at once. Fewer, longer requests than
//     SMs keep the other forms' grids from filling the GPU; this form does.
// The one-pass and recurrence forms compute the same products from the same operands in the same
// order; the fused form applies the decay factors to fp32 accumulators and rounds other
// intermediates to bf16 (Y instead of W and U), within the same tolerance.
// Tokens past n are zero (k = q = v = 0, g = 0, beta = 0), so they change nothing.
// The products run as mma.sync m16n8k16 with bf16 operands and fp32 accumulation; (I + A)^-1 is
// computed in fp32 (16 x 16 diagonal blocks by substitution, then merged 16 -> 32 -> 64 on tensor
// cores with tf32 operands). The norms' reciprocal square roots and the decay factors come from
// the hardware's approximations (rsqrt, exp2). The state crosses chunks in fp32 and is rounded to
// the pool's dtype only where it is stored.
//
// Workspace slots: request i's j-th chunk goes to slot begin_i / 64 + i + j. For non-decreasing
// cu_seqlens these ranges never overlap, and there are at most L / 64 + N slots. The chunk kernel's
// CTA for a slot finds its request by binary search and records the owner of the slot; the state
// pass runs a request only if it owns all its slots, so broken cu_seqlens can never make one
// request read another's tiles. The output kernel runs a slot only if the recurrence marked it
// ready in this call. The fused form has no slots: it runs every request whose own range is sane,
// so with broken cu_seqlens the rows it writes and counts differ from the chunk forms'.
//
// Indices live in device memory and are never synchronised on: the kernels apply prefill's row
// rules themselves. A request whose token range is not sane writes nothing; one with a slot past
// the pool (initial, final or a checkpoint it reaches), more checkpoints than columns, or chunk
// slots it does not own, writes no state, zeroes its output rows and bumps error_count (once per
// request).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/mma.cuh"
#include "gdn/core/dtype.hpp"
#include "gdn/core/support.hpp"
#include "gdn/prefill/params.hpp"

namespace gdn::prefill::cuda_detail {

// Plain-data copy of Params / Problem for the kernels (TensorView is host-side).
struct KernelArgs {
  const void* mixed_qkv;
  const void* a;
  const void* b;
  const void* A_log;
  const void* dt_bias;
  const void* z;            // null: no gate
  const void* norm_weight;  // null: no norm (out = o)
  void* state;
  const void* cu_seqlens;
  const void* initial_state_indices;
  const void* final_state_indices;
  const void* checkpoint_indices;  // null: no checkpoints
  void* out;
  int* error_count;  // null: not counted
  void* workspace;   // cuda_workspace_bytes(L, N, HV) bytes, 16-byte aligned
  DType a_dtype, b_dtype, A_log_dtype, dt_bias_dtype, norm_weight_dtype, state_dtype, out_dtype,
      cu_dtype, initial_dtype, final_dtype, checkpoint_dtype;
  int64_t qkv_row_stride, a_row_stride, b_row_stride, z_row_stride, z_head_stride;
  int64_t initial_stride, final_stride, checkpoint_row_stride, checkpoint_col_stride;
  int64_t L, N, H, HV, ratio, num_slots, slot_stride, first_valid_slot;
  int64_t checkpoint_every, checkpoint_columns, chunk_slots;
  float scale, l2_eps, norm_eps;
  GateActivation gate;
  StateLayout layout;
  bool round_core_output;
  bool a_is_log_decay;    // g = a (A_log, dt_bias not read)
  bool b_is_beta;         // beta = b
  bool qk_l2_norm;        // false: q, k used as given
  bool qkv_vector;        // mixed_qkv's rows start aligned to four elements (vector loads)
  bool qkv_rows_aligned;  // mixed_qkv's rows start 16-byte aligned (copied with cp.async)
  bool z_rows_aligned;    // z's rows start 16-byte aligned (copied with cp.async)
  bool out_aligned;       // out's data pointer is 16-byte aligned (vector stores)
};

inline constexpr int kHeadDim = 128;  // K = V on CUDA
inline constexpr int kChunk = 64;     // tokens per chunk
static_assert(kChunk == kCheckpointGranule, "checkpoints fall on chunk boundaries");
inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
// Row strides of the bf16 tiles, in elements: 16 bytes times an odd number (conflict-free
// ldmatrix rows).
inline constexpr int kLdWide = kHeadDim + 8;  // 128-wide tiles
inline constexpr int kLdNarrow = kChunk + 8;  // 64-wide tiles
inline constexpr int kLdF32 = kChunk + 4;     // fp32 64 x 64 tiles
inline constexpr int kLdOut = kHeadDim + 4;   // fp32 64 x 128 output tile
inline constexpr int kLdMerge = 32 + 4;       // fp32 32 x 32 merge products

using bf16 = __nv_bfloat16;

// What the chunk kernel leaves for one (chunk slot, value head): W[t][k], the decayed q
// (gamma_t q_t), the decayed k (exp(G_end - G_t) k_t), U^T[v][t] and P[t][s], all bf16, with the
// padded rows of the state kernel's shared tiles, so that they are copied as one flat run.
struct ChunkTiles {
  bf16 w[kChunk][kLdWide];
  bf16 q[kChunk][kLdWide];
  bf16 k[kChunk][kLdWide];
  bf16 ut[kHeadDim][kLdNarrow];
  bf16 p[kChunk][kLdNarrow];
};
static_assert(sizeof(ChunkTiles) % 16 == 0, "copied in 16-byte pieces");

// What the recurrence kernel leaves for the output kernel, per (chunk slot, value head): the state
// at the chunk's start and the chunk's writes Delta^T, as the bf16 A fragments of the products
// that read them, indexed [16-row block of the state][k-step][lane] (one 512-byte run per
// fragment of a warp). The output kernel multiplies exactly the operands the one-pass kernel
// would have, in the same order.
struct ChunkFragments {
  uint4 s[kHeadDim / 16][kHeadDim / 16][32];
  uint4 delta[kHeadDim / 16][kChunk / 16][32];
};

static_assert(cuda_workspace_bytes(kChunk, 0, 1) ==
                  int64_t(sizeof(ChunkTiles) + sizeof(ChunkFragments)) + 4 + 4 + 4,
              "cuda_workspace_bytes matches the workspace's layout");

// The workspace: ChunkTiles[chunk_slots][HV], ChunkFragments[chunk_slots][HV], then gamma_end as
// float[chunk_slots][HV], a ready mark int[chunk_slots][HV] (1: the recurrence stored the slot's
// fragments in this call; the chunk kernel clears it) and the owning request of each slot as
// int[chunk_slots] (-1: none).
struct Workspace {
  ChunkTiles* tiles;
  ChunkFragments* fragments;
  float* gamma_end;
  int* ready;
  int* owner;
};

__host__ __device__ inline Workspace workspace_of(void* base, int64_t chunk_slots, int64_t HV) {
  Workspace w;
  w.tiles = static_cast<ChunkTiles*>(base);
  w.fragments = reinterpret_cast<ChunkFragments*>(w.tiles + chunk_slots * HV);
  w.gamma_end = reinterpret_cast<float*>(w.fragments + chunk_slots * HV);
  w.ready = reinterpret_cast<int*>(w.gamma_end + chunk_slots * HV);
  w.owner = w.ready + chunk_slots * HV;
  return w;
}

// The first chunk slot of request i, whose tokens start at row `begin`.
__device__ __forceinline__ int64_t first_chunk_slot(int64_t begin, int64_t i) {
  return begin / kChunk + i;
}

namespace dev = gdn::cuda;
namespace mma = gdn::cuda::mma;
using Bf16 = dev::StateBits<bf16>;  // packs two fp32 values as a bf16 pair

// ---- shared building blocks ---------------------------------------------------------------------

// Calls f with a value of the C++ type of dtype t (float, bf16 or half). Hoisting the dtype test
// out of a batch of loads lets the compiler issue the whole batch before it waits for any of it.
template <class F>
__device__ __forceinline__ void with_element_type(DType t, F&& f) {
  if (t == DType::kBFloat16)
    f(__nv_bfloat16{});
  else if (t == DType::kFloat16)
    f(__half{});
  else
    f(float{});
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(x);
  else
    return x;
}

// Eight bf16 values (16 bytes) times f.
__device__ __forceinline__ uint4 scale_bf16x8(uint4 x, float f) {
  uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
    w[e] = Bf16::pack(v.x * f, v.y * f);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Slot id of a request from a 1-D index array of any stride (-1: null).
__device__ __forceinline__ int64_t slot_or_null(const KernelArgs& args, const void* p, DType dtype,
                                                int64_t offset) {
  const int64_t id = gdn::load_index(p, dtype, offset);
  return id < args.first_valid_slot ? -1 : id;
}

__device__ __forceinline__ int64_t checkpoint_slot(const KernelArgs& args, int64_t i, int64_t j) {
  return slot_or_null(args, args.checkpoint_indices, args.checkpoint_dtype,
                      i * args.checkpoint_row_stride + j * args.checkpoint_col_stride);
}

// ---- the chunk kernel ---------------------------------------------------------------------------

// Shared memory of a chunk CTA. The fp32 triangle (A and its inverse) is dead once the inverse's
// two scaled bf16 copies are made; they reuse its bytes.
struct ChunkShared {
  bf16 q[kChunk][kLdWide];  // normalised, scaled q of the chunk's tokens
  bf16 k[kChunk][kLdWide];  // normalised k
  bf16 v[kChunk][kLdWide];
  union {
    struct {
      float a[kChunk][kLdF32];    // A
      float inv[kChunk][kLdF32];  // (I + A)^-1
    } tri;
    struct {
      bf16 times_beta[kChunk][kLdNarrow];        // (I + A)^-1 diag(beta)
      bf16 times_beta_gamma[kChunk][kLdNarrow];  // (I + A)^-1 diag(beta gamma)
    } inv;
  } u;
  bf16 p[kChunk][kLdNarrow];  // P
  float merge[32][kLdMerge];  // products of the inverse's block merges
  float cum[kChunk];          // G_t log2(e): every decay factor is one exp2
  float beta[kChunk];
  float log_decay[kChunk];  // g_t
  int64_t request;          // the request whose chunk this CTA runs (-1: none)
  int64_t first_row;        // its first token row
  int n;                    // its tokens
};
static_assert(sizeof(ChunkShared::u.inv) <= sizeof(ChunkShared::u.tri), "copies fit the triangle");

inline constexpr int kChunkSharedBytes = int(sizeof(ChunkShared));

// Finds the request and chunk of workspace slot `slot` (thread 0): the last request i whose first
// chunk slot is <= slot, if slot lies within its chunks and its token range is sane. Records the
// slot's owner (value head 0's CTA of the chunk kernel) if `record`. Sh: a CTA's shared memory
// with fields request, first_row and n.
template <class Sh>
__device__ __forceinline__ void find_chunk(const KernelArgs& args, const Workspace& ws, Sh& sh,
                                           int64_t slot, bool record) {
  const auto cu = [&](int64_t e) { return gdn::load_index(args.cu_seqlens, args.cu_dtype, e); };
  int64_t lo = 0, hi = args.N - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_chunk_slot(cu(mid), mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t begin = cu(lo), end = cu(lo + 1);
  int64_t request = -1;
  if (begin >= 0 && end >= begin && end <= args.L) {
    const int64_t j = slot - first_chunk_slot(begin, lo);
    if (j >= 0 && j * kChunk < end - begin) {
      request = lo;
      sh.first_row = begin + j * kChunk;
      sh.n = int(end - sh.first_row < kChunk ? end - sh.first_row : kChunk);
    }
  }
  sh.request = request;
  if (record) ws.owner[slot] = int(request);
}

// Four consecutive elements of p (aligned to four elements) as raw bits: 8 or 16 bytes.
template <class T>
using Bits4 = std::conditional_t<sizeof(T) == 4, uint4, uint2>;

template <class T>
__device__ __forceinline__ void bits_to_f32(const Bits4<T>& r, float (&out)[4]) {
  const T* h = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = to_f32(h[e]);
}

// Where the q, k and v rows of token row `first_row` of key head h and value head hv start in
// mixed_qkv; a token's next row is qkv_row_stride elements on.
template <class T>
struct TokenRows {
  const T *q, *k, *v;
};
template <class T>
__device__ __forceinline__ TokenRows<T> token_rows(const KernelArgs& args, int64_t first_row,
                                                   int64_t h, int64_t hv) {
  const T* x = static_cast<const T*>(args.mixed_qkv) + first_row * args.qkv_row_stride;
  return {x + h * kHeadDim, x + (args.H + h) * kHeadDim, x + (2 * args.H + hv) * kHeadDim};
}

// Loads the chunk's tokens: q, k L2-normalised into bf16 tiles, v, g and beta; zeros past n. Token
// t's q, k and v rows start at q0, k0 and v0 plus t * row_stride elements (global memory, or a
// staged copy of the rows); `vector`: every row is aligned to four elements. Warp w takes tokens
// w, w + 8, ...: all their loads are issued before the first is used.
template <class T>
__device__ __forceinline__ void load_chunk(const KernelArgs& args, ChunkShared& sh, const T* q0,
                                           const T* k0, const T* v0, int64_t row_stride,
                                           bool vector, int64_t first_row, int n, int64_t hv,
                                           float A, float dt_bias, int warp, int lane) {
  constexpr int kPerWarp = kChunk / kWarps;
  // Lane j < 8 of warp w: token w + 8 j's gates.
  if (lane < kPerWarp) {
    const int t = warp + kWarps * lane;
    float g = 0.0f, beta = 0.0f;
    if (t < n) {
      const int64_t l = first_row + t;
      const float a = dev::load_value(args.a, args.a_dtype, l * args.a_row_stride + hv);
      const float b = dev::load_value(args.b, args.b_dtype, l * args.b_row_stride + hv);
      g = args.a_is_log_decay ? a : A * dev::softplus(a + dt_bias);
      beta = args.b_is_beta ? b : dev::sigmoid(b);
    }
    sh.log_decay[t] = g;
    sh.beta[t] = beta;
  }
  float q[kPerWarp][4], k[kPerWarp][4], v[kPerWarp][4];
  if (vector) {  // every load in flight before the first conversion
    Bits4<T> rq[kPerWarp], rk[kPerWarp], rv[kPerWarp];
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int t = warp + kWarps * j;
      const int64_t row = (t < n ? t : 0) * row_stride + 4 * lane;
      rq[j] = *reinterpret_cast<const Bits4<T>*>(q0 + row);
      rk[j] = *reinterpret_cast<const Bits4<T>*>(k0 + row);
      rv[j] = *reinterpret_cast<const Bits4<T>*>(v0 + row);
    }
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      bits_to_f32<T>(rq[j], q[j]);
      bits_to_f32<T>(rk[j], k[j]);
      bits_to_f32<T>(rv[j], v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int t = warp + kWarps * j;
      const int64_t row = (t < n ? t : 0) * row_stride + 4 * lane;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        q[j][e] = to_f32(q0[row + e]);
        k[j][e] = to_f32(k0[row + e]);
        v[j][e] = to_f32(v0[row + e]);
      }
    }
  }
  // Tokens past n read the chunk's first row (always in range) and are zeroed here.
#pragma unroll
  for (int j = 0; j < kPerWarp; ++j)
    if (warp + kWarps * j >= n)
#pragma unroll
      for (int e = 0; e < 4; ++e) q[j][e] = k[j][e] = v[j][e] = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerWarp; ++j) {
    const int t = warp + kWarps * j;
    float qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qq += q[j][e] * q[j][e];
      kk += k[j][e] * k[j][e];
    }
    qq = dev::warp_sum(qq);
    kk = dev::warp_sum(kk);
    // The hardware's reciprocal square root (2 ulp): these scale bf16 tiles; an IEEE square root
    // and division cost about thirty instructions each on the chunk's serial path.
    const float q_scale = args.qk_l2_norm ? args.scale * rsqrtf(qq + args.l2_eps) : args.scale;
    const float k_scale = args.qk_l2_norm ? rsqrtf(kk + args.l2_eps) : 1.0f;
    uint2 qp, kp, vp;
    qp.x = Bf16::pack(q[j][0] * q_scale, q[j][1] * q_scale);
    qp.y = Bf16::pack(q[j][2] * q_scale, q[j][3] * q_scale);
    kp.x = Bf16::pack(k[j][0] * k_scale, k[j][1] * k_scale);
    kp.y = Bf16::pack(k[j][2] * k_scale, k[j][3] * k_scale);
    vp.x = Bf16::pack(v[j][0], v[j][1]);
    vp.y = Bf16::pack(v[j][2], v[j][3]);
    *reinterpret_cast<uint2*>(&sh.q[t][4 * lane]) = qp;
    *reinterpret_cast<uint2*>(&sh.k[t][4 * lane]) = kp;
    *reinterpret_cast<uint2*>(&sh.v[t][4 * lane]) = vp;
  }
}

// G_t = g_0 + ... + g_t, stored as G_t log2(e) so that every decay factor exp(G_t - G_s) is the
// hardware's exp2 of a difference (warp 0; two tokens per lane).
__device__ __forceinline__ void cumulative_decay(ChunkShared& sh, int lane) {
  const float g0 = sh.log_decay[2 * lane], g1 = sh.log_decay[2 * lane + 1];
  float incl = g0 + g1;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, incl, m);
    if (lane >= m) incl += up;
  }
  const float before = incl - (g0 + g1);
  constexpr float kLog2e = 1.4426950408889634f;
  sh.cum[2 * lane] = (before + g0) * kLog2e;
  sh.cum[2 * lane + 1] = incl * kLog2e;
}

// Rows 16 w.. of [Q; K] (warps 0-3: Q, 4-7: K) times K^T: P (warps 0-3) and A (warps 4-7). Rows
// and columns of tokens past n are zero: their products are skipped (blocks16 = ceil(n / 16)).
__device__ __forceinline__ void chunk_scores(ChunkShared& sh, int warp, int lane, int blocks16) {
  const bool is_q = warp < 4;
  const int t0 = 16 * (warp & 3);
  const bf16* rows = is_q ? &sh.q[0][0] : &sh.k[0][0];
  float acc[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    if (t0 / 16 >= blocks16) break;
    uint32_t a[4];
    mma::load_a(a, rows, kLdWide, t0, kk, lane);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      if (j / 2 >= blocks16) break;
      uint32_t b[4];
      mma::load_b_pair(b, &sh.k[0][0], kLdWide, 8 * j, kk, lane);
      mma::mma_16bit<bf16>(acc[j], a, b[0], b[1]);
      mma::mma_16bit<bf16>(acc[j + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = t0 + lane / 4 + 8 * (e / 2), s = 8 * j + 2 * (lane % 4) + e % 2;
      const float ratio = s <= t ? dev::fast_exp2(sh.cum[t] - sh.cum[s]) : 0.0f;
      if (is_q)
        sh.p[t][s] = __float2bfloat16_rn(acc[j][e] * ratio);
      else
        sh.u.tri.a[t][s] = s < t ? sh.beta[t] * ratio * acc[j][e] : 0.0f;
    }
  }
}

// inv = (I + A)^-1, A strictly lower (fp32), then its bf16 copies scaled by beta_s and by beta_s
// gamma_s along columns. Phases with a barrier each: the 16 x 16 diagonal blocks by forward
// substitution (one thread per column), then merges 16 -> 32 and 32 -> 64 with X = A_lo,hi-off
// inv_diag and inv_off = -inv_lower_diag X. Only the leading 16 blocks16 rows and columns are
// complete (merges past them are skipped) and copied: the products read no others.
template <bool kGammaCopy = true>
__device__ __forceinline__ void invert_triangle(ChunkShared& sh, int tid, int blocks16) {
  float (&a)[kChunk][kLdF32] = sh.u.tri.a;
  float (&inv)[kChunk][kLdF32] = sh.u.tri.inv;
  if (tid < kChunk) {
    const int j = tid, base = j & ~15, jl = j & 15;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      float v = t == jl ? 1.0f : 0.0f;
#pragma unroll
      for (int s = 0; s < t; ++s)
        if (s >= jl) v -= a[base + t][base + s] * x[s];
      x[t] = v;
      inv[base + t][j] = v;
    }
  } else {
    // Zero the blocks above the diagonal (six 16 x 16 blocks), 192 threads.
    for (int e = tid - kChunk; e < 6 * 256; e += kThreads - kChunk) {
      const int blk = e / 256, r = (e / 16) % 16, c = e % 16;
      // Upper blocks (row block, column block): (0,1) (0,2) (0,3) (1,2) (1,3) (2,3).
      const int rb = blk < 3 ? 0 : (blk < 5 ? 1 : 2);
      const int cb = blk < 3 ? blk + 1 : (blk < 5 ? blk - 1 : 3);
      inv[16 * rb + r][16 * cb + c] = 0.0f;
    }
  }
  __syncthreads();
  // The merges' products run on tensor cores with tf32 operands (fp32 accumulation): the inverse
  // is rounded to bf16 for its own products afterwards, so tf32's 10-bit mantissas add little.
  // The sums run over whole blocks: A and inv hold explicit zeros above their diagonals.
  if (blocks16 > 1) {
    // 16 -> 32: blocks (1, 0) and (3, 2), warps 0 and 1: X = A_10 inv_00 into sh.merge, then
    // inv_10 = -inv_11 X.
    const int warp = tid / 32, lane = tid % 32;
    if (warp < 2) {
      const int lo = 32 * warp, hi = lo + 16;
      float x[2][4] = {}, y[2][4] = {};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma::product_tf32<2>(x[nt], &a[0][0], kLdF32, hi, lo, &inv[0][0], kLdF32, lo, lo + 8 * nt,
                             lane);
        mma::store_accumulators(x[nt], &sh.merge[0][0], kLdMerge, 16 * warp, 8 * nt, 1.0f, lane);
      }
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma::product_tf32<2>(y[nt], &inv[0][0], kLdF32, hi, hi, &sh.merge[0][0], kLdMerge,
                             16 * warp, 8 * nt, lane);
        mma::store_accumulators(y[nt], &inv[0][0], kLdF32, hi, lo + 8 * nt, -1.0f, lane);
      }
    }
    __syncthreads();
  }
  if (blocks16 > 2) {
    // 32 -> 64: block (rows 32.., columns ..32), warp w the 16 x 8 tile (w / 4, w % 4):
    // X = A_10 inv_00 into sh.merge, then inv_10 = -inv_11 X.
    const int warp = tid / 32, lane = tid % 32, m0 = 16 * (warp / 4), n0 = 8 * (warp % 4);
    static_assert(kThreads == 8 * 32, "a warp per 16 x 8 tile of a 32 x 32 block");
    float x[4] = {}, y[4] = {};
    mma::product_tf32<4>(x, &a[0][0], kLdF32, 32 + m0, 0, &inv[0][0], kLdF32, 0, n0, lane);
    mma::store_accumulators(x, &sh.merge[0][0], kLdMerge, m0, n0, 1.0f, lane);
    __syncthreads();
    mma::product_tf32<4>(y, &inv[0][0], kLdF32, 32 + m0, 32, &sh.merge[0][0], kLdMerge, 0, n0,
                         lane);
    mma::store_accumulators(y, &inv[0][0], kLdF32, 32 + m0, n0, -1.0f, lane);
    __syncthreads();
  }
  // The scaled copies overlay the fp32 triangle: read all of this thread's entries first.
  constexpr int kPerThread = kChunk * kChunk / kThreads;
  const int used = 16 * blocks16;
  float x[kPerThread];
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int e = tid + kThreads * r;
    x[r] = e / kChunk < used && e % kChunk < used ? inv[e / kChunk][e % kChunk] : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int e = tid + kThreads * r, t = e / kChunk, s = e % kChunk;
    if (t >= used || s >= used) continue;
    const float xb = x[r] * sh.beta[s];
    sh.u.inv.times_beta[t][s] = __float2bfloat16_rn(xb);
    if constexpr (kGammaCopy)
      sh.u.inv.times_beta_gamma[t][s] = __float2bfloat16_rn(xb * dev::fast_exp2(sh.cum[s]));
  }
}

// Staging of U^T (128 x 64 bf16) in the bytes of the triangle past the inverse's copies: rows of
// 128 bytes whose 16-byte pieces are XOR-swizzled by the row, so that the accumulator stores and
// the 16-byte reads are both free of bank conflicts.
__device__ __forceinline__ bf16* ut_staging(ChunkShared& sh) {
  static_assert(
      sizeof(ChunkShared::u.inv) + kHeadDim * kChunk * sizeof(bf16) <= sizeof(ChunkShared::u.tri),
      "U^T fits the triangle's bytes past the inverse's copies");
  return reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(&sh.u) + sizeof(sh.u.inv));
}
__device__ __forceinline__ int ut_index(int v, int t) {
  return v * kChunk + (((t / 8) ^ (v & 7)) * 8) + t % 8;
}

// U^T = V^T (inv diag(beta))^T (warp w: state rows 16 w..) and W = inv diag(beta gamma) K (warp w:
// rows 16 (w & 3).., columns 64 (w / 4)..), staged in shared memory (U^T in ut_staging, W over v,
// dead once U^T is done) and then stored 16 bytes at a time.
__device__ __forceinline__ void store_writes(ChunkShared& sh, ChunkTiles& out, int warp, int lane,
                                             int tid, int blocks16) {
  bf16* ut = ut_staging(sh);
  {
    float acc[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kChunk; kk += 16) {
      if (kk / 16 >= blocks16) break;  // v rows and inverse columns past n are zero
      uint32_t a[4];
      mma::load_a_transposed(a, &sh.v[0][0], kLdWide, 16 * warp, kk, lane);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        if (j / 2 >= blocks16) break;  // token columns past the used blocks stay zero
        uint32_t b[4];
        mma::load_b_pair(b, &sh.u.inv.times_beta[0][0], kLdNarrow, 8 * j, kk, lane);
        mma::mma_16bit<bf16>(acc[j], a, b[0], b[1]);
        mma::mma_16bit<bf16>(acc[j + 1], a, b[2], b[3]);
      }
    }
    const int v = 16 * warp + lane / 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int t = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(&ut[ut_index(v, t)]) = Bf16::pack(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(&ut[ut_index(v + 8, t)]) = Bf16::pack(acc[j][2], acc[j][3]);
    }
  }
  __syncthreads();  // v is dead: W goes there
  {
    const int t0 = 16 * (warp & 3), k0 = 64 * (warp / 4);
    float acc[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kChunk; kk += 16) {
      if (kk / 16 >= blocks16 || t0 / 16 >= blocks16) break;  // zero rows and columns past n
      uint32_t a[4];
      mma::load_a(a, &sh.u.inv.times_beta_gamma[0][0], kLdNarrow, t0, kk, lane);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        uint32_t b[4];
        mma::load_b_pair_transposed(b, &sh.k[0][0], kLdWide, k0 + 8 * j, kk, lane);
        mma::mma_16bit<bf16>(acc[j], a, b[0], b[1]);
        mma::mma_16bit<bf16>(acc[j + 1], a, b[2], b[3]);
      }
    }
    const int t = t0 + lane / 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = k0 + 8 * j + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(&sh.v[t][k]) = Bf16::pack(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(&sh.v[t + 8][k]) = Bf16::pack(acc[j][2], acc[j][3]);
    }
  }
  __syncthreads();
  // The used token rows of W and columns of U^T only (16-byte pieces).
  constexpr int kWide = kHeadDim / 8;
  const int used = 16 * blocks16, narrow = used / 8;
  for (int e = tid; e < used * kWide; e += kThreads) {
    const int r = e / kWide, c = 8 * (e % kWide);
    *reinterpret_cast<uint4*>(&out.w[r][c]) = *reinterpret_cast<const uint4*>(&sh.v[r][c]);
  }
  for (int e = tid; e < kHeadDim * narrow; e += kThreads) {
    const int r = e / narrow, c = 8 * (e % narrow);
    *reinterpret_cast<uint4*>(&out.ut[r][c]) = *reinterpret_cast<const uint4*>(&ut[ut_index(r, c)]);
  }
}

// The used token rows of the decayed q and k (gamma_t q_t, exp(G_end - G_t) k_t) and of P,
// copied 16 bytes at a time.
__device__ __forceinline__ void store_decayed(const ChunkShared& sh, ChunkTiles& out, int tid,
                                              int blocks16) {
  const float end = sh.cum[kChunk - 1];
  const int used = 16 * blocks16;
  constexpr int kRowChunks = kHeadDim / 8;
  for (int e = tid; e < used * kRowChunks; e += kThreads) {
    const int t = e / kRowChunks, c = 8 * (e % kRowChunks);
    *reinterpret_cast<uint4*>(&out.q[t][c]) =
        scale_bf16x8(*reinterpret_cast<const uint4*>(&sh.q[t][c]), dev::fast_exp2(sh.cum[t]));
    *reinterpret_cast<uint4*>(&out.k[t][c]) =
        scale_bf16x8(*reinterpret_cast<const uint4*>(&sh.k[t][c]), dev::fast_exp2(end - sh.cum[t]));
  }
  constexpr int kPRowChunks = kChunk / 8;
  for (int e = tid; e < used * kPRowChunks; e += kThreads) {
    const int t = e / kPRowChunks, c = 8 * (e % kPRowChunks);
    *reinterpret_cast<uint4*>(&out.p[t][c]) = *reinterpret_cast<const uint4*>(&sh.p[t][c]);
  }
}

// Everything after the cumulative decay, for the first blocks16 blocks of 16 tokens.
__device__ __forceinline__ void chunk_products(ChunkShared& sh, ChunkTiles& out, int warp, int lane,
                                               int tid, int blocks16) {
  chunk_scores(sh, warp, lane, blocks16);
  __syncthreads();
  invert_triangle(sh, tid, blocks16);
  __syncthreads();
  store_writes(sh, out, warp, lane, tid, blocks16);
  store_decayed(sh, out, tid, blocks16);
}

// Grid chunk_slots * HV: one CTA per (workspace slot, value head), the heads of a slot adjacent
// (value heads that share a key head read its q and k rows while they are in L2). Act: the
// element type of mixed_qkv.
template <class Act>
__global__ void __launch_bounds__(kThreads, 2) prefill_chunk_kernel(const KernelArgs args) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  ChunkShared& sh = *reinterpret_cast<ChunkShared*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t slot = int64_t(blockIdx.x) / args.HV, hv = int64_t(blockIdx.x) % args.HV;
  const Workspace ws = workspace_of(args.workspace, args.chunk_slots, args.HV);
  if (tid == 0) {
    find_chunk(args, ws, sh, slot, hv == 0);
    ws.ready[slot * args.HV + hv] = 0;
  }
  __syncthreads();
  if (sh.request < 0) return;
  const int64_t first_row = sh.first_row;
  const int n = sh.n;
  const int64_t h = hv / args.ratio;
  const float A =
      args.a_is_log_decay ? 0.0f : -expf(dev::load_value(args.A_log, args.A_log_dtype, hv));
  const float dt_bias =
      args.a_is_log_decay ? 0.0f : dev::load_value(args.dt_bias, args.dt_bias_dtype, hv);

  const TokenRows<Act> x = token_rows<Act>(args, first_row, h, hv);
  load_chunk<Act>(args, sh, x.q, x.k, x.v, args.qkv_row_stride, args.qkv_vector, first_row, n, hv,
                  A, dt_bias, warp, lane);
  __syncthreads();
  if (warp == 0) cumulative_decay(sh, lane);
  __syncthreads();
  ChunkTiles& out = ws.tiles[slot * args.HV + hv];
  // A full chunk's copy has a constant block count: no branches between its products.
  if (n == kChunk)
    chunk_products(sh, out, warp, lane, tid, kChunk / 16);
  else
    chunk_products(sh, out, warp, lane, tid, (n + 15) / 16);
  if (tid == 0) ws.gamma_end[slot * args.HV + hv] = dev::fast_exp2(sh.cum[kChunk - 1]);
}

// ---- the state pass: shared pieces --------------------------------------------------------------

// Row stride of a z tile in elements (16-byte padded rows).
template <class Act>
inline constexpr int kLdZ = kHeadDim + 16 / int(sizeof(Act));

// Element offset of state element (v, k) of head hv in slot `slot`.
__device__ __forceinline__ int64_t state_offset(const KernelArgs& args, int64_t slot, int64_t hv,
                                                int v, int k) {
  const int64_t head = slot * args.slot_stride + hv * kHeadDim * kHeadDim;
  return head + (args.layout == StateLayout::kVK ? v * kHeadDim + k : k * kHeadDim + v);
}

// The state accumulators of a warp that owns state rows 16 r.. (its row block r): rows
// v = 16 r + lane / 4 (+ 8), columns k = 8 j + 2 (lane % 4) (+ 1), for the 16 column tiles j.
struct StateTile {
  float d[16][4];
};

__device__ __forceinline__ void store_state(const KernelArgs& args, int64_t slot, int64_t hv,
                                            int row_block, int lane, const StateTile& s) {
  const int v0 = 16 * row_block + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k0 = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dev::store_value(args.state, args.state_dtype,
                       state_offset(args, slot, hv, v0 + 8 * (e / 2), k0 + e % 2), s.d[j][e]);
  }
}

// The warp's state accumulators from the slot (zeros for a null slot); all 64 loads in flight.
__device__ __forceinline__ void load_state(const KernelArgs& args, int64_t slot, int64_t hv,
                                           int row_block, int lane, StateTile& s) {
  const int v0 = 16 * row_block + lane / 4;
  if (slot < 0) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s.d[j][e] = 0.0f;
    return;
  }
  with_element_type(args.state_dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pool = static_cast<const T*>(args.state);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int k0 = 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s.d[j][e] = to_f32(pool[state_offset(args, slot, hv, v0 + 8 * (e / 2), k0 + e % 2)]);
    }
  });
}

// Copies of a chunk's workspace tiles into shared memory, as cp.async by the `threads` threads of
// a CTA (the caller commits the group). The chunk kernel writes the first ceil(n / 16) blocks of
// 16 token rows (U^T: columns) only, zero past n; only they are copied, as the products read no
// others.
inline constexpr int kWideRowPieces = kLdWide * 2 / 16;
inline constexpr int kNarrowRowPieces = kLdNarrow * 2 / 16;

// The first `count` 16-byte pieces of a flat run.
__device__ __forceinline__ void copy_pieces(void* to, const void* from, int count, int tid,
                                            int threads) {
  for (int e = tid; e < count; e += threads)
    mma::cp_async_16(static_cast<uint4*>(to) + e, static_cast<const uint4*>(from) + e);
}

// U^T rows r0 .. r0 + rows, the columns of the `used` token rows, to rows 0 .. rows of `to`.
__device__ __forceinline__ void copy_ut_rows(bf16 (*to)[kLdNarrow], const ChunkTiles& src, int r0,
                                             int rows, int used, int tid, int threads) {
  const int pieces = used / 8;
  for (int e = tid; e < rows * pieces; e += threads) {
    const int r = e / pieces, c = 8 * (e % pieces);
    mma::cp_async_16(&to[r][c], &src.ut[r0 + r][c]);
  }
}

// The z rows of the chunk's n tokens of value head hv.
template <class Act>
__device__ __forceinline__ void copy_z_rows(const KernelArgs& args, Act (*to)[kLdZ<Act>],
                                            int64_t first_row, int n, int64_t hv, int tid,
                                            int threads) {
  const Act* z =
      static_cast<const Act*>(args.z) + first_row * args.z_row_stride + hv * args.z_head_stride;
  constexpr int kPer16 = 16 / int(sizeof(Act)), kZPieces = kHeadDim / kPer16;
  for (int e = tid; e < n * kZPieces; e += threads) {
    const int r = e / kZPieces, c = kPer16 * (e % kZPieces);
    const Act* from = z + r * args.z_row_stride + c;
    if (args.z_rows_aligned) {
      mma::cp_async_16(&to[r][c], from);
    } else {
#pragma unroll
      for (int x = 0; x < kPer16; ++x) to[r][c + x] = from[x];
    }
  }
}

// A-operand fragments (16 x 16, k-step kk) of the fp32 accumulator tiles 2 kk and 2 kk + 1, in
// bf16: an accumulator tile's layout is the A fragment's half.
template <int kSteps>
__device__ __forceinline__ void accumulators_as_a(const float (*d)[4], uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    a[kk][0] = Bf16::pack(d[2 * kk][0], d[2 * kk][1]);
    a[kk][1] = Bf16::pack(d[2 * kk][2], d[2 * kk][3]);
    a[kk][2] = Bf16::pack(d[2 * kk + 1][0], d[2 * kk + 1][1]);
    a[kk][3] = Bf16::pack(d[2 * kk + 1][2], d[2 * kk + 1][3]);
  }
}

__device__ __forceinline__ uint4 fragment_bits(const uint32_t (&a)[4]) {
  return make_uint4(a[0], a[1], a[2], a[3]);
}
__device__ __forceinline__ void fragment_from_bits(uint4 x, uint32_t (&a)[4]) {
  a[0] = x.x;
  a[1] = x.y;
  a[2] = x.z;
  a[3] = x.w;
}

// acc[v][t] += sum_k S[v][k] x[t][k] for the warp's 16 state rows (sa: S as A fragments) and the
// chunk's token rows of a 128-wide tile x, in the first blocks16 blocks of 16. A full chunk
// (kFull) has no branches between its products and loads each fragment a k-step ahead of its
// products: ldmatrix and mma are volatile asm, so the order written here is the order issued.
template <bool kFull>
__device__ __forceinline__ void state_times_tokens(const uint32_t (&sa)[8][4], const bf16* x,
                                                   int lane, int blocks16, float (&acc)[8][4]) {
  if constexpr (kFull) {
    uint32_t b[4][4];  // rolling: a pair's next k-step is loaded as soon as its products issue
#pragma unroll
    for (int m = 0; m < 4; ++m) mma::load_b_pair(b[m], x, kLdWide, 16 * m, 0, lane);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        mma::mma_16bit<bf16>(acc[2 * m], sa[kk], b[m][0], b[m][1]);
        mma::mma_16bit<bf16>(acc[2 * m + 1], sa[kk], b[m][2], b[m][3]);
        if (kk + 1 < 8) mma::load_b_pair(b[m], x, kLdWide, 16 * m, 16 * (kk + 1), lane);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        if (j / 2 >= blocks16) break;
        uint32_t b[4];
        mma::load_b_pair(b, x, kLdWide, 8 * j, 16 * kk, lane);
        mma::mma_16bit<bf16>(acc[j], sa[kk], b[0], b[1]);
        mma::mma_16bit<bf16>(acc[j + 1], sa[kk], b[2], b[3]);
      }
    }
  }
}

// The chunk's writes for the warp's 16 state rows: Delta^T = U^T - S W^T (ut: the warp's first
// U^T row in shared memory).
template <bool kFull>
__device__ __forceinline__ void chunk_writes(const uint32_t (&sa)[8][4], const bf16* w,
                                             const bf16 (*ut)[kLdNarrow], int lane, int blocks16,
                                             float (&delta)[8][4]) {
  state_times_tokens<kFull>(sa, w, lane, blocks16, delta);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int t = 8 * j + 2 * (lane % 4);
    const float2 ua =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ut[lane / 4][t]));
    const float2 ub =
        __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ut[lane / 4 + 8][t]));
    delta[j][0] = ua.x - delta[j][0];
    delta[j][1] = ua.y - delta[j][1];
    delta[j][2] = ub.x - delta[j][2];
    delta[j][3] = ub.y - delta[j][3];
  }
}

// acc[v][t] += sum_s a[v][s] l[t][s] for the warp's 16 rows of a (A fragments, 64 deep) and a
// 64 x 64 tile l (row stride kLdNarrow) that is lower triangular in blocks of 16: token tiles
// 2 m, 2 m + 1 need source blocks kk <= m only.
template <bool kFull>
__device__ __forceinline__ void times_lower(const uint32_t (&a)[4][4], const bf16* l, int lane,
                                            int blocks16, float (&acc)[8][4]) {
  if constexpr (kFull) {
    uint32_t bl[4][4][4];  // [m][kk], kk <= m: all ten loads issued before the first product
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int kk = 0; kk <= m; ++kk)
        mma::load_b_pair(bl[m][kk], l, kLdNarrow, 16 * m, 16 * kk, lane);
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int kk = 0; kk <= m; ++kk) {
        mma::mma_16bit<bf16>(acc[2 * m], a[kk], bl[m][kk][0], bl[m][kk][1]);
        mma::mma_16bit<bf16>(acc[2 * m + 1], a[kk], bl[m][kk][2], bl[m][kk][3]);
      }
  } else {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m >= blocks16) break;
#pragma unroll
      for (int kk = 0; kk <= m; ++kk) {
        uint32_t bl[4];
        mma::load_b_pair(bl, l, kLdNarrow, 16 * m, 16 * kk, lane);
        mma::mma_16bit<bf16>(acc[2 * m], a[kk], bl[0], bl[1]);
        mma::mma_16bit<bf16>(acc[2 * m + 1], a[kk], bl[2], bl[3]);
      }
    }
  }
}

// The chunk's outputs for the warp's 16 state rows: o^T = S q~^T + Delta^T P^T (da: Delta^T as A
// fragments; P is lower triangular).
template <bool kFull>
__device__ __forceinline__ void chunk_output(const uint32_t (&sa)[8][4], const uint32_t (&da)[4][4],
                                             const bf16* q, const bf16* p, int lane, int blocks16,
                                             float (&o)[8][4]) {
  state_times_tokens<kFull>(sa, q, lane, blocks16, o);
  times_lower<kFull>(da, p, lane, blocks16, o);
}

// The state update for the warp's 16 rows: S = gamma_end S + Delta^T k~.
template <bool kFull>
__device__ __forceinline__ void chunk_update(const uint32_t (&da)[4][4], const bf16* k,
                                             float gamma_end, int lane, int blocks16,
                                             StateTile& s) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s.d[j][e] *= gamma_end;
  if constexpr (kFull) {
    uint32_t bk[8][4];  // rolling, as in state_times_tokens
#pragma unroll
    for (int m = 0; m < 8; ++m) mma::load_b_pair_transposed(bk[m], k, kLdWide, 16 * m, 0, lane);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        mma::mma_16bit<bf16>(s.d[2 * m], da[kk], bk[m][0], bk[m][1]);
        mma::mma_16bit<bf16>(s.d[2 * m + 1], da[kk], bk[m][2], bk[m][3]);
        if (kk + 1 < 4) mma::load_b_pair_transposed(bk[m], k, kLdWide, 16 * m, 16 * (kk + 1), lane);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk >= blocks16) break;
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        uint32_t bk[4];
        mma::load_b_pair_transposed(bk, k, kLdWide, 8 * j, 16 * kk, lane);
        mma::mma_16bit<bf16>(s.d[j], da[kk], bk[0], bk[1]);
        mma::mma_16bit<bf16>(s.d[j + 1], da[kk], bk[2], bk[3]);
      }
    }
  }
}

// act(z): silu(z) = z sigmoid(z), or sigmoid(z); one expression for both keeps the code small.
__device__ __forceinline__ float gate_value(const KernelArgs& args, float z) {
  return (args.gate == GateActivation::kSiLU ? z : 1.0f) * dev::fast_sigmoid(z);
}

// Warp w's outputs o^T (state rows 16 w..) into the fp32 output tile o[t][v] (rounded to Act if
// asked), and its partial sums of squares per token into partial[w].
template <class Act>
__device__ __forceinline__ void stage_output(const KernelArgs& args, float (&o)[8][4],
                                             float (*tile)[kLdOut], float (*partial)[kChunk],
                                             int warp, int lane) {
  const int v0 = 16 * warp;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float ss[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = 8 * j + 2 * (lane % 4) + e;
      float& x0 = o[j][e];
      float& x1 = o[j][e + 2];
      if (args.round_core_output) {
        x0 = to_f32(from_f32<Act>(x0));
        x1 = to_f32(from_f32<Act>(x1));
      }
      tile[t][v0 + lane / 4] = x0;
      tile[t][v0 + lane / 4 + 8] = x1;
      float x = x0 * x0 + x1 * x1;
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      ss[e] = x;
    }
    if (lane < 4) {
      partial[warp][8 * j + 2 * lane] = ss[0];
      partial[warp][8 * j + 2 * lane + 1] = ss[1];
    }
  }
}

// The gated RMSNorm of the chunk's n output rows from the output tile, stored to out: warp w
// takes tokens w, w + 8, ..., lane l values 4 l.. of each; all eight tokens' reads are issued
// before the first result is used.
template <class Act>
__device__ __forceinline__ void store_outputs(const KernelArgs& args, const float (*tile)[kLdOut],
                                              const float (*partial)[kChunk],
                                              const float* norm_weight, const Act (*zt)[kLdZ<Act>],
                                              int64_t first_row, int n, int64_t hv, int warp,
                                              int lane) {
  constexpr int kPerWarp = kChunk / kWarps;
  const int v = 4 * lane;
  float y[kPerWarp][4], z[kPerWarp][4], ss[kPerWarp];
#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int t = warp + kWarps * r;
    const float4 o4 = *reinterpret_cast<const float4*>(&tile[t][v]);
    y[r][0] = o4.x;
    y[r][1] = o4.y;
    y[r][2] = o4.z;
    y[r][3] = o4.w;
    ss[r] = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) ss[r] += partial[w][t];
    if (args.z && t < n) {  // four elements in one 8- or 16-byte read
      const Bits4<Act> bits = *reinterpret_cast<const Bits4<Act>*>(&zt[t][v]);
      bits_to_f32<Act>(bits, z[r]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) z[r][e] = 0.0f;
    }
  }
  float weight[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) weight[e] = norm_weight[v + e];
#pragma unroll
  for (int r = 0; r < kPerWarp; ++r) {
    const int t = warp + kWarps * r;
    if (t >= n) break;
    if (args.norm_weight) {
      const float rstd = rsqrtf(ss[r] / float(kHeadDim) + args.norm_eps);
#pragma unroll
      for (int e = 0; e < 4; ++e) y[r][e] *= rstd * weight[e];
    }
    if (args.z) {
#pragma unroll
      for (int e = 0; e < 4; ++e) y[r][e] *= gate_value(args, z[r][e]);
    }
    Act* dst = static_cast<Act*>(args.out) + ((first_row + t) * args.HV + hv) * kHeadDim + v;
    if (args.out_aligned) {
      if constexpr (sizeof(Act) == 2) {
        uint2 packed;
        Act* p = reinterpret_cast<Act*>(&packed);
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = from_f32<Act>(y[r][e]);
        *reinterpret_cast<uint2*>(dst) = packed;
      } else {
        *reinterpret_cast<float4*>(dst) = make_float4(y[r][0], y[r][1], y[r][2], y[r][3]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[e] = from_f32<Act>(y[r][e]);
    }
  }
}

// A request's rows and slots, once prefill's row rules accept it.
struct RequestPlan {
  int64_t begin, T, chunks, first_slot;
  int64_t initial, final_slot;  // -1: null
};

// prefill's row rules for request i, applied by all `threads` threads of a CTA for value head hv.
// False if the request runs no chunk: its token range is not sane (nothing written) or empty, or
// it is refused (a slot past the pool, more checkpoints than columns, or, with `owner` (the chunk
// slots' owners; null: the kernel reads no workspace), chunk slots it does not own): then CTAs
// with `zero_outputs` zero its output rows of head hv. `reporter` counts a request that is not run
// and not empty.
__device__ __forceinline__ bool plan_request(const KernelArgs& args, const int* owner, int64_t i,
                                             int64_t hv, int tid, int threads, bool reporter,
                                             bool zero_outputs, RequestPlan& r) {
  r.begin = gdn::load_index(args.cu_seqlens, args.cu_dtype, i);
  const int64_t end = gdn::load_index(args.cu_seqlens, args.cu_dtype, i + 1);
  if (r.begin < 0 || end < r.begin || end > args.L) {  // rows unknown: write nothing
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    return false;
  }
  r.T = end - r.begin;
  if (r.T == 0) return false;
  const int64_t initial_id =
      gdn::load_index(args.initial_state_indices, args.initial_dtype, i * args.initial_stride);
  const int64_t final_id =
      gdn::load_index(args.final_state_indices, args.final_dtype, i * args.final_stride);
  bool bad = initial_id >= args.num_slots || final_id >= args.num_slots;
  const int64_t checkpoints = args.checkpoint_indices ? r.T / args.checkpoint_every : 0;
  if (checkpoints > args.checkpoint_columns) bad = true;
  for (int64_t j = 0; j < checkpoints && !bad; ++j)
    if (checkpoint_slot(args, i, j) >= args.num_slots) bad = true;
  r.chunks = (r.T + kChunk - 1) / kChunk;
  r.first_slot = first_chunk_slot(r.begin, i);
  if (owner) {
    bool owned = true;
    for (int64_t j = tid; j < r.chunks; j += threads) owned &= owner[r.first_slot + j] == int(i);
    if (!__syncthreads_and(owned)) bad = true;
  }
  if (bad) {
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    if (zero_outputs)
      for (int64_t e = tid; e < r.T * kHeadDim; e += threads)
        dev::store_value(args.out, args.out_dtype,
                         ((r.begin + e / kHeadDim) * args.HV + hv) * kHeadDim + e % kHeadDim, 0.0f);
    return false;
  }
  r.initial = initial_id < args.first_valid_slot ? -1 : initial_id;
  r.final_slot = final_id < args.first_valid_slot ? -1 : final_id;
  return true;
}

// Tokens of the request's chunk c.
__device__ __forceinline__ int chunk_tokens(const RequestPlan& r, int64_t c) {
  return int(r.T - kChunk * c < kChunk ? r.T - kChunk * c : kChunk);
}

// Stores the state to the checkpoint slot that ends after `done` tokens, if there is one.
__device__ __forceinline__ void store_checkpoint(const KernelArgs& args, int64_t i, int64_t hv,
                                                 int64_t done, int row_block, int lane,
                                                 const StateTile& s) {
  if (args.checkpoint_indices && done % args.checkpoint_every == 0) {
    const int64_t slot = checkpoint_slot(args, i, done / args.checkpoint_every - 1);
    if (slot >= 0) store_state(args, slot, hv, row_block, lane, s);
  }
}

// ---- the one-pass state kernel: recurrence and outputs
// --------------------------------------------

// One chunk's tiles in shared memory, and its z rows.
template <class Act>
struct StateBuffer : ChunkTiles {
  Act z[kChunk][kLdZ<Act>];
};

// kStages buffers: with two, the next chunk's tiles are copied in while the current one runs.
template <class Act, int kStages>
struct StateShared {
  StateBuffer<Act> buf[kStages];
  float partial[kWarps][kChunk];  // each warp's sum of o^2 over its 16 state rows, per token
  float norm_weight[kHeadDim];
};

// The fp32 output tile o[t][v] overlays w and q of the chunk's buffer, which are dead by then.
template <class Act>
__device__ __forceinline__ float (*output_tile(StateBuffer<Act>& b)) [kLdOut] {
  static_assert(offsetof(ChunkTiles, q) == sizeof(ChunkTiles::w) &&
                    2 * sizeof(ChunkTiles::w) >= sizeof(float) * kChunk * kLdOut,
                "the output tile fits w and q");
  return reinterpret_cast<float (*)[kLdOut]>(&b.w[0][0]);
}

template <class Act, int kStages>
inline constexpr int kStateSharedBytes = int(sizeof(StateShared<Act, kStages>));

// Starts copying chunk slot `slot`'s tiles and the z rows of its n tokens into `b`, as one
// cp.async group of this thread.
template <class Act>
__device__ __forceinline__ void start_chunk_copy(const KernelArgs& args, const Workspace& ws,
                                                 int64_t slot, int64_t hv, int64_t first_row, int n,
                                                 StateBuffer<Act>& b, int tid) {
  const ChunkTiles& src = ws.tiles[slot * args.HV + hv];
  const int used = 16 * ((n + 15) / 16);
  copy_pieces(&b.w[0][0], &src.w[0][0], used * kWideRowPieces, tid, kThreads);
  copy_pieces(&b.q[0][0], &src.q[0][0], used * kWideRowPieces, tid, kThreads);
  copy_pieces(&b.k[0][0], &src.k[0][0], used * kWideRowPieces, tid, kThreads);
  copy_ut_rows(b.ut, src, 0, kHeadDim, used, tid, kThreads);
  copy_pieces(&b.p[0][0], &src.p[0][0], used * kNarrowRowPieces, tid, kThreads);
  if (args.z) copy_z_rows<Act>(args, b.z, first_row, n, hv, tid, kThreads);
  mma::cp_async_commit();
}

// One chunk of one (request, value head), the warp's 16 state rows: the writes, the outputs (to
// the output tile and sh.partial) and the state update. kFull: n is kChunk, every block is used
// and the fragments are loaded ahead of their products.
template <bool kFull, class Act, int kStages>
__device__ __forceinline__ void run_chunk(const KernelArgs& args, StateShared<Act, kStages>& sh,
                                          StateBuffer<Act>& b, float gamma_end, int n, int warp,
                                          int lane, StateTile& s) {
  const int blocks16 = kFull ? 4 : (n + 15) / 16;  // blocks of 16 token rows the n tokens reach
  uint32_t sa[8][4];
  accumulators_as_a<8>(s.d, sa);
  float delta[8][4] = {};
  chunk_writes<kFull>(sa, &b.w[0][0], &b.ut[16 * warp], lane, blocks16, delta);
  uint32_t da[4][4];
  accumulators_as_a<4>(delta, da);
  float o[8][4] = {};
  chunk_output<kFull>(sa, da, &b.q[0][0], &b.p[0][0], lane, blocks16, o);
  chunk_update<kFull>(da, &b.k[0][0], gamma_end, lane, blocks16, s);
  // Every warp is done with w and q before the output tile overwrites them.
  __syncthreads();
  stage_output<Act>(args, o, output_tile(b), sh.partial, warp, lane);
}

// Grid N * HV: one CTA per (request, value head), its chunks in order, the state in the eight
// warps' accumulators (warp w: rows 16 w..). Act: the element type of z and out.
template <class Act, int kStages>
__global__ void __launch_bounds__(kThreads, 1) prefill_state_kernel(const KernelArgs args) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  StateShared<Act, kStages>& sh = *reinterpret_cast<StateShared<Act, kStages>*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t i = int64_t(blockIdx.x) / args.HV, hv = int64_t(blockIdx.x) % args.HV;
  const Workspace ws = workspace_of(args.workspace, args.chunk_slots, args.HV);
  RequestPlan r;
  if (!plan_request(args, ws.owner, i, hv, tid, kThreads, hv == 0 && tid == 0, true, r)) return;

  if (args.norm_weight && tid < kHeadDim)
    sh.norm_weight[tid] = dev::load_value(args.norm_weight, args.norm_weight_dtype, tid);
  const auto copy = [&](int64_t c) {
    start_chunk_copy(args, ws, r.first_slot + c, hv, r.begin + kChunk * c, chunk_tokens(r, c),
                     sh.buf[kStages == 2 ? c & 1 : 0], tid);
  };
  copy(0);
  StateTile state;
  load_state(args, r.initial, hv, warp, lane, state);
  for (int64_t c = 0; c < r.chunks; ++c) {
    StateBuffer<Act>& b = sh.buf[kStages == 2 ? c & 1 : 0];
    // With two buffers the next chunk's copies run during this one; the other buffer was
    // released by the barrier that ended the previous chunk.
    if (kStages == 2 && c + 1 < r.chunks) {
      copy(c + 1);
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const float gamma_end = ws.gamma_end[(r.first_slot + c) * args.HV + hv];
    const int n = chunk_tokens(r, c);
    if (n == kChunk)
      run_chunk<true>(args, sh, b, gamma_end, n, warp, lane, state);
    else
      run_chunk<false>(args, sh, b, gamma_end, n, warp, lane, state);
    __syncthreads();
    store_outputs<Act>(args, output_tile(b), sh.partial, sh.norm_weight, b.z, r.begin + kChunk * c,
                       n, hv, warp, lane);
    store_checkpoint(args, i, hv, kChunk * c + n, warp, lane, state);
    __syncthreads();  // every warp is done with this buffer before it is refilled
    if (kStages == 1 && c + 1 < r.chunks) copy(c + 1);
  }
  if (r.final_slot >= 0) store_state(args, r.final_slot, hv, warp, lane, state);
}

// ---- the fused kernel: a chunk's products and its state step in one CTA --------------------

// A chunk's q, k and v rows as they stand in mixed_qkv: the next chunk's are copied in while the
// current one runs (2-byte activations; 4-byte ones would not leave room, and are read directly).
template <class Act>
struct StagedRows {
  Act q[kChunk][kHeadDim];
  Act k[kChunk][kHeadDim];
  Act v[kChunk][kHeadDim];
};
struct NoStagedRows {};
template <class Act>
inline constexpr bool kStagesRows = sizeof(Act) == 2;

// z and staged are written by 16-byte cp.async and read 16 bytes at a time: aligned to 16 bytes
// whatever ChunkShared's size.
template <class Act>
struct FusedShared {
  ChunkShared c;  // the chunk's tiles; the fp32 output tile overlays the triangle's bytes (c.u)
  alignas(16) Act z[kChunk][kLdZ<Act>];
  float partial[kWarps][kChunk];
  float norm_weight[kHeadDim];
  float gamma[kChunk];  // gamma_t = exp(G_t)
  float tail[kChunk];   // exp(G_end - G_t)
  alignas(16) std::conditional_t<kStagesRows<Act>, StagedRows<Act>, NoStagedRows> staged;
};
static_assert(sizeof(float) * kChunk * kLdOut <= sizeof(ChunkShared::u),
              "the output tile fits the triangle's bytes");
static_assert(offsetof(FusedShared<__nv_bfloat16>, z) % 16 == 0 &&
                  offsetof(FusedShared<__nv_bfloat16>, staged) % 16 == 0 &&
                  offsetof(FusedShared<float>, z) % 16 == 0 &&
                  (kLdZ<__nv_bfloat16> * sizeof(__nv_bfloat16)) % 16 == 0 &&
                  (kLdZ<float> * sizeof(float)) % 16 == 0 &&
                  (kHeadDim * sizeof(__nv_bfloat16)) % 16 == 0,
              "rows of z and of the staged tokens start on 16 bytes");

template <class Act>
inline constexpr int kFusedSharedBytes = int(sizeof(FusedShared<Act>));

template <class Act>
__device__ __forceinline__ float (*fused_output_tile(FusedShared<Act>& sh))
    [kLdOut] { return reinterpret_cast<float (*)[kLdOut]>(&sh.c.u); }

// Starts copying the n token rows at x (16-byte aligned) into `to`.
template <class Act>
__device__ __forceinline__ void copy_token_rows(const TokenRows<Act>& x, int64_t row_stride, int n,
                                                StagedRows<Act>& to, int tid) {
  constexpr int kPer16 = 16 / int(sizeof(Act)), kPieces = kHeadDim / kPer16;
  for (int e = tid; e < n * kPieces; e += kThreads) {
    const int t = e / kPieces, c = kPer16 * (e % kPieces);
    mma::cp_async_16(&to.q[t][c], x.q + t * row_stride + c);
    mma::cp_async_16(&to.k[t][c], x.k + t * row_stride + c);
    mma::cp_async_16(&to.v[t][c], x.v + t * row_stride + c);
  }
}

// Two bf16 values (low half first) as floats.
__device__ __forceinline__ float2 unpack_bf16x2(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}

// acc (the accumulator tiles of 64 token columns) times a factor per column: f[j] holds those of
// tile j's columns 2 (lane % 4) and the next.
__device__ __forceinline__ void scale_columns(float (&acc)[8][4], const float2 (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    acc[j][0] *= f[j].x;
    acc[j][1] *= f[j].y;
    acc[j][2] *= f[j].x;
    acc[j][3] *= f[j].y;
  }
}

// The fused kernel's state step for the warp's 16 state rows (v0 = 16 warp), from the chunk's q,
// k, v (as loaded, not decayed), P and T diag(beta) with T = (I + A)^-1:
//   X^T = S K^T, Y^T = V^T - X^T diag(gamma)      (each token's value minus what S predicts)
//   Delta^T = Y^T (T diag(beta))^T                (= U^T - S W^T)
//   o^T = S Q^T diag(gamma) + Delta^T P^T
//   S' = gamma_end S + (Delta^T diag(tail)) K     (tail_t = exp(G_end - G_t))
// The decay factors act on fp32 accumulators, so no decayed copy of q or k and no W or U^T is
// made. Writes the outputs to the output tile and partial after a barrier.
template <bool kFull, class Act>
__device__ __forceinline__ void fused_step(const KernelArgs& args, FusedShared<Act>& sh, int n,
                                           int warp, int lane, StateTile& s) {
  const int blocks16 = kFull ? 4 : (n + 15) / 16;
  uint32_t sa[8][4];
  accumulators_as_a<8>(s.d, sa);
  float x[8][4] = {}, o[8][4] = {};
  state_times_tokens<kFull>(sa, &sh.c.k[0][0], lane, blocks16, x);
  state_times_tokens<kFull>(sa, &sh.c.q[0][0], lane, blocks16, o);
  // Column pairs t, t + 1 of token tile j: t = 8 j + 2 (lane % 4).
  float2 gamma[8], tail[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int t = 8 * j + 2 * (lane % 4);
    gamma[j] = *reinterpret_cast<const float2*>(&sh.gamma[t]);
    tail[j] = *reinterpret_cast<const float2*>(&sh.tail[t]);
  }
  uint32_t ya[4][4] = {};
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if (!kFull && kk >= blocks16) break;  // v and x are zero past n
    uint32_t va[4];
    mma::load_a_transposed(va, &sh.c.v[0][0], kLdWide, 16 * warp, 16 * kk, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // token tile j = 2 kk + h: rows lane / 4 and lane / 4 + 8
      const int j = 2 * kk + h;
      const float2 top = unpack_bf16x2(va[2 * h]), bottom = unpack_bf16x2(va[2 * h + 1]);
      ya[kk][2 * h] = Bf16::pack(top.x - gamma[j].x * x[j][0], top.y - gamma[j].y * x[j][1]);
      ya[kk][2 * h + 1] =
          Bf16::pack(bottom.x - gamma[j].x * x[j][2], bottom.y - gamma[j].y * x[j][3]);
    }
  }
  scale_columns(o, gamma);
  float delta[8][4] = {};
  times_lower<kFull>(ya, &sh.c.u.inv.times_beta[0][0], lane, blocks16, delta);
  uint32_t da[4][4];
  accumulators_as_a<4>(delta, da);
  times_lower<kFull>(da, &sh.c.p[0][0], lane, blocks16, o);
  scale_columns(delta, tail);
  accumulators_as_a<4>(delta, da);
  chunk_update<kFull>(da, &sh.c.k[0][0], sh.gamma[kChunk - 1], lane, blocks16, s);
  __syncthreads();  // every warp is done with the triangle's bytes before the output tile
  stage_output<Act>(args, o, fused_output_tile(sh), sh.partial, warp, lane);
}

// One chunk after its tokens are loaded (sh.c.q, k, v, beta, log decay): the cumulative decay and
// its factors, the scores (P, A), T diag(beta) and the state step.
template <bool kFull, class Act>
__device__ __forceinline__ void fused_chunk(const KernelArgs& args, FusedShared<Act>& sh, int n,
                                            int tid, int warp, int lane, StateTile& s) {
  const int blocks16 = kFull ? 4 : (n + 15) / 16;
  if (warp == 0) {
    cumulative_decay(sh.c, lane);
    __syncwarp();
    const float end = sh.c.cum[kChunk - 1];
#pragma unroll
    for (int t = 2 * lane; t < 2 * lane + 2; ++t) {
      sh.gamma[t] = dev::fast_exp2(sh.c.cum[t]);
      sh.tail[t] = dev::fast_exp2(end - sh.c.cum[t]);
    }
  }
  __syncthreads();
  chunk_scores(sh.c, warp, lane, blocks16);
  __syncthreads();
  invert_triangle<false>(sh.c, tid, blocks16);
  __syncthreads();
  fused_step<kFull, Act>(args, sh, n, warp, lane, s);
}

// Grid N * HV: one CTA per (request, value head), its chunks in order, each chunk's products
// computed on chip from its tokens (no workspace) and the state in the eight warps' accumulators
// (warp w: rows 16 w..). Act: the element type of mixed_qkv, z and out.
template <class Act>
__global__ void __launch_bounds__(kThreads, 1) prefill_fused_kernel(const KernelArgs args) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  FusedShared<Act>& sh = *reinterpret_cast<FusedShared<Act>*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t i = int64_t(blockIdx.x) / args.HV, hv = int64_t(blockIdx.x) % args.HV;
  RequestPlan r;
  if (!plan_request(args, nullptr, i, hv, tid, kThreads, hv == 0 && tid == 0, true, r)) return;
  const int64_t h = hv / args.ratio;
  const float A =
      args.a_is_log_decay ? 0.0f : -expf(dev::load_value(args.A_log, args.A_log_dtype, hv));
  const float dt_bias =
      args.a_is_log_decay ? 0.0f : dev::load_value(args.dt_bias, args.dt_bias_dtype, hv);
  if (args.norm_weight && tid < kHeadDim)
    sh.norm_weight[tid] = dev::load_value(args.norm_weight, args.norm_weight_dtype, tid);
  bool staged = false;
  if constexpr (kStagesRows<Act>) staged = args.qkv_rows_aligned;
  // Chunk c's rows into sh.staged, as one cp.async group (empty when not staged or past the last
  // chunk), so that the wait counts below are fixed.
  const auto stage = [&](int64_t c) {
    if constexpr (kStagesRows<Act>)
      if (staged && c < r.chunks)
        copy_token_rows<Act>(token_rows<Act>(args, r.begin + kChunk * c, h, hv),
                             args.qkv_row_stride, chunk_tokens(r, c), sh.staged, tid);
    mma::cp_async_commit();
  };
  stage(0);
  StateTile state;
  load_state(args, r.initial, hv, warp, lane, state);
  for (int64_t c = 0; c < r.chunks; ++c) {
    const int n = chunk_tokens(r, c);
    const int64_t first_row = r.begin + kChunk * c;
    mma::cp_async_wait<0>();
    __syncthreads();  // chunk c's rows have landed; every warp is done with chunk c - 1
    if constexpr (kStagesRows<Act>) {
      if (staged)
        load_chunk<Act>(args, sh.c, &sh.staged.q[0][0], &sh.staged.k[0][0], &sh.staged.v[0][0],
                        kHeadDim, true, first_row, n, hv, A, dt_bias, warp, lane);
    }
    if (!staged) {
      const TokenRows<Act> x = token_rows<Act>(args, first_row, h, hv);
      load_chunk<Act>(args, sh.c, x.q, x.k, x.v, args.qkv_row_stride, args.qkv_vector, first_row, n,
                      hv, A, dt_bias, warp, lane);
    }
    __syncthreads();  // the staged rows are free for the next chunk's
    if (args.z) copy_z_rows<Act>(args, sh.z, first_row, n, hv, tid, kThreads);
    mma::cp_async_commit();
    stage(c + 1);
    if (n == kChunk)
      fused_chunk<true, Act>(args, sh, n, tid, warp, lane, state);
    else
      fused_chunk<false, Act>(args, sh, n, tid, warp, lane, state);
    mma::cp_async_wait<1>();  // the z rows (the next chunk's rows may still be in flight)
    __syncthreads();
    store_outputs<Act>(args, fused_output_tile(sh), sh.partial, sh.norm_weight, sh.z, first_row, n,
                       hv, warp, lane);
    store_checkpoint(args, i, hv, kChunk * c + n, warp, lane, state);
  }
  if (r.final_slot >= 0) store_state(args, r.final_slot, hv, warp, lane, state);
}

// ---- the recurrence kernel and the output kernel -----------------------------------------------

// A recurrence CTA's copy of one chunk: W, the decayed k and its own U^T rows.
template <int kRowWarps>
struct RecurrenceBuffer {
  bf16 w[kChunk][kLdWide];
  bf16 k[kChunk][kLdWide];
  bf16 ut[16 * kRowWarps][kLdNarrow];
};

// The recurrence's CTA as launched: two warps (32 state rows, four CTAs per head), two buffers
// (more did not make a single request faster, and two let two CTAs share an SM).
inline constexpr int kRecurrenceWarps = 2;
inline constexpr int kRecurrenceStages = 2;
inline constexpr int kRecurrenceCtasPerHead = kWarps / kRecurrenceWarps;

template <int kRowWarps, int kStages>
inline constexpr int kRecurrenceSharedBytes = int(kStages * sizeof(RecurrenceBuffer<kRowWarps>));

// One chunk of the warp's 16 state rows (row block `row_block`): stores S and Delta^T as A
// fragments for the output kernel and updates S.
template <bool kFull, int kRowWarps>
__device__ __forceinline__ void advance_chunk(const RecurrenceBuffer<kRowWarps>& b,
                                              ChunkFragments& f, float gamma_end, int n, int warp,
                                              int row_block, int lane, StateTile& s) {
  const int blocks16 = kFull ? 4 : (n + 15) / 16;
  uint32_t sa[8][4];
  accumulators_as_a<8>(s.d, sa);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) f.s[row_block][kk][lane] = fragment_bits(sa[kk]);
  float delta[8][4] = {};
  chunk_writes<kFull>(sa, &b.w[0][0], &b.ut[16 * warp], lane, blocks16, delta);
  uint32_t da[4][4];
  accumulators_as_a<4>(delta, da);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    if (kFull || kk < blocks16) f.delta[row_block][kk][lane] = fragment_bits(da[kk]);
  chunk_update<kFull>(da, &b.k[0][0], gamma_end, lane, blocks16, s);
}

// Grid N * HV * parts: one CTA per (request, value head, 16 kRowWarps state rows), its chunks in
// order. Without the norm a state row never needs another, so a head's rows split freely over
// CTAs; each CTA copies the whole W and k~ of every chunk and its own rows of U^T, kStages - 1
// chunks ahead.
template <int kRowWarps, int kStages>
__global__ void __launch_bounds__(32 * kRowWarps, 1)
    prefill_recurrence_kernel(const KernelArgs args) {
  constexpr int kParts = kHeadDim / (16 * kRowWarps), kCtaThreads = 32 * kRowWarps;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  RecurrenceBuffer<kRowWarps>* buf = reinterpret_cast<RecurrenceBuffer<kRowWarps>*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int part = int(blockIdx.x % kParts);
  const int64_t head = int64_t(blockIdx.x) / kParts;
  const int64_t i = head / args.HV, hv = head % args.HV;
  const int row0 = 16 * kRowWarps * part, row_block = row0 / 16 + warp;
  const Workspace ws = workspace_of(args.workspace, args.chunk_slots, args.HV);
  RequestPlan r;
  if (!plan_request(args, ws.owner, i, hv, tid, kCtaThreads, hv == 0 && part == 0 && tid == 0,
                    part == 0, r))
    return;
  // One cp.async group per chunk, empty past the last, so that a fixed wait count always means
  // "chunk c has landed".
  const auto copy = [&](int64_t c) {
    if (c < r.chunks) {
      const ChunkTiles& src = ws.tiles[(r.first_slot + c) * args.HV + hv];
      RecurrenceBuffer<kRowWarps>& b = buf[c % kStages];
      const int used = 16 * ((chunk_tokens(r, c) + 15) / 16);
      copy_pieces(&b.w[0][0], &src.w[0][0], used * kWideRowPieces, tid, kCtaThreads);
      copy_pieces(&b.k[0][0], &src.k[0][0], used * kWideRowPieces, tid, kCtaThreads);
      copy_ut_rows(b.ut, src, row0, 16 * kRowWarps, used, tid, kCtaThreads);
    }
    mma::cp_async_commit();
  };
  for (int c = 0; c < kStages - 1; ++c) copy(c);
  StateTile state;
  load_state(args, r.initial, hv, row_block, lane, state);
  for (int64_t c = 0; c < r.chunks; ++c) {
    // Chunk c + kStages - 1 goes to the buffer chunk c - 1 used, released by the barrier that
    // ended the previous chunk.
    copy(c + kStages - 1);
    mma::cp_async_wait<kStages - 1>();
    __syncthreads();
    const int64_t slot_head = (r.first_slot + c) * args.HV + hv;
    if (part == 0 && tid == 0) ws.ready[slot_head] = 1;
    const float gamma_end = ws.gamma_end[slot_head];
    const int n = chunk_tokens(r, c);
    const RecurrenceBuffer<kRowWarps>& b = buf[c % kStages];
    if (n == kChunk)
      advance_chunk<true>(b, ws.fragments[slot_head], gamma_end, n, warp, row_block, lane, state);
    else
      advance_chunk<false>(b, ws.fragments[slot_head], gamma_end, n, warp, row_block, lane, state);
    store_checkpoint(args, i, hv, kChunk * c + n, row_block, lane, state);
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  if (r.final_slot >= 0) store_state(args, r.final_slot, hv, row_block, lane, state);
}

// Shared memory of an output CTA: the decayed q and P of its chunk, then (over them) the output
// tile; the z rows, the partial sums of squares and the norm weight.
template <class Act>
struct OutputShared {
  union {
    struct {
      bf16 q[kChunk][kLdWide];
      bf16 p[kChunk][kLdNarrow];
    } in;
    float o[kChunk][kLdOut];
  } u;
  Act z[kChunk][kLdZ<Act>];
  float partial[kWarps][kChunk];
  float norm_weight[kHeadDim];
  int64_t request;  // the request whose chunk this CTA runs (-1: none)
  int64_t first_row;
  int n;
};

template <class Act>
inline constexpr int kOutputSharedBytes = int(sizeof(OutputShared<Act>));

// Grid chunk_slots * HV: one CTA per (chunk slot, value head) the recurrence ran in this call, warp
// w the state rows 16 w..: o^T = S q~^T + Delta^T P^T from the stored fragments, then the gated
// RMSNorm. Every chunk of the call at once.
template <class Act>
__global__ void __launch_bounds__(kThreads, 2) prefill_output_kernel(const KernelArgs args) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  OutputShared<Act>& sh = *reinterpret_cast<OutputShared<Act>*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t slot = int64_t(blockIdx.x) / args.HV, hv = int64_t(blockIdx.x) % args.HV;
  const int64_t slot_head = slot * args.HV + hv;
  const Workspace ws = workspace_of(args.workspace, args.chunk_slots, args.HV);
  if (tid == 0) {
    find_chunk(args, ws, sh, slot, false);
    if (ws.ready[slot_head] != 1) sh.request = -1;
  }
  __syncthreads();
  if (sh.request < 0) return;
  const int n = sh.n;
  const int64_t first_row = sh.first_row;
  const int blocks16 = (n + 15) / 16;
  const ChunkTiles& src = ws.tiles[slot_head];
  copy_pieces(&sh.u.in.q[0][0], &src.q[0][0], 16 * blocks16 * kWideRowPieces, tid, kThreads);
  copy_pieces(&sh.u.in.p[0][0], &src.p[0][0], 16 * blocks16 * kNarrowRowPieces, tid, kThreads);
  if (args.z) copy_z_rows<Act>(args, sh.z, first_row, n, hv, tid, kThreads);
  mma::cp_async_commit();
  if (args.norm_weight && tid < kHeadDim)
    sh.norm_weight[tid] = dev::load_value(args.norm_weight, args.norm_weight_dtype, tid);
  const ChunkFragments& f = ws.fragments[slot_head];
  uint32_t sa[8][4], da[4][4] = {};
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) fragment_from_bits(f.s[warp][kk][lane], sa[kk]);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    if (kk < blocks16) fragment_from_bits(f.delta[warp][kk][lane], da[kk]);
  mma::cp_async_wait<0>();
  __syncthreads();
  float o[8][4] = {};
  if (n == kChunk)
    chunk_output<true>(sa, da, &sh.u.in.q[0][0], &sh.u.in.p[0][0], lane, 4, o);
  else
    chunk_output<false>(sa, da, &sh.u.in.q[0][0], &sh.u.in.p[0][0], lane, blocks16, o);
  __syncthreads();  // q and P are dead before the output tile overlays them
  stage_output<Act>(args, o, sh.u.o, sh.partial, warp, lane);
  __syncthreads();
  store_outputs<Act>(args, sh.u.o, sh.partial, sh.norm_weight, sh.z, first_row, n, hv, warp, lane);
}

}  // namespace gdn::prefill::cuda_detail
