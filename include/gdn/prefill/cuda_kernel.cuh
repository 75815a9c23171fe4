// prefill's CUDA kernel: the chunked (WY / UT) form of the gated delta rule on tensor cores.
//
// One CTA runs one (request, value head) through all its tokens, 64 at a time, with the state (V x
// K, fp32) in the accumulator registers of its eight warps for the whole request. Per chunk of n
// <= 64 tokens, with G_t the running sum of the log-decays g inside the chunk (gamma_t = exp(G_t)),
// k and q L2-normalised (q also scaled), beta_t the write strength and S the state at the chunk's
// start (docs prefill.md §3 gives the derivation):
//
//   A[t][s]  = beta_t exp(G_t - G_s) k_t . k_s      (s < t; strictly lower)
//   P[t][s]  = exp(G_t - G_s) q_t . k_s              (s <= t)
//   R[t]     = beta_t (v_t - gamma_t S k_t)
//   Delta    = (I + A)^-1 R                          (the delta-rule writes of the chunk's tokens)
//   o_t      = gamma_t S q_t + sum_s P[t][s] Delta_s
//   S'       = gamma_end S + sum_s exp(G_end - G_s) Delta_s k_s^T
//
// Tokens past n are zero (k = q = v = 0, g = 0, beta = 0), so they change nothing. The products run
// as mma.sync m16n8k16 with bf16 operands and fp32 accumulation; (I + A)^-1 is computed in fp32
// (16 x 16 diagonal blocks by substitution, then merged 16 -> 32 -> 64), then used in bf16. The
// state crosses chunks in fp32 and is rounded to the pool's dtype only where it is stored.
//
// Indices live in device memory and are never synchronised on: the kernel applies prefill's row
// rules itself. A request whose token range is not sane writes nothing; one with a slot past the
// pool (initial, final or a checkpoint it reaches), or more checkpoints than columns, writes no
// state, zeroes its output rows and bumps error_count (once per request).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/mma.cuh"
#include "gdn/core/dtype.hpp"
#include "gdn/core/support.hpp"

namespace gdn::prefill::cuda_detail {

// Plain-data copy of Params / Problem for the kernel (TensorView is host-side).
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
  DType qkv_dtype, a_dtype, b_dtype, A_log_dtype, dt_bias_dtype, z_dtype, norm_weight_dtype,
      state_dtype, out_dtype, cu_dtype, initial_dtype, final_dtype, checkpoint_dtype;
  int64_t qkv_row_stride, a_row_stride, b_row_stride, z_row_stride, z_head_stride;
  int64_t initial_stride, final_stride, checkpoint_row_stride, checkpoint_col_stride;
  int64_t L, N, H, HV, ratio, num_slots, slot_stride, first_valid_slot;
  int64_t checkpoint_every, checkpoint_columns;
  float scale, l2_eps, norm_eps;
  GateActivation gate;
  StateLayout layout;
  bool round_core_output;
};

inline constexpr int kHeadDim = 128;  // K = V on CUDA
inline constexpr int kChunk = 64;     // tokens per chunk (a divisor of kCheckpointGranule)
inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
// Row strides of the bf16 tiles, in elements: 16 bytes times an odd number (conflict-free
// ldmatrix rows).
inline constexpr int kLdWide = kHeadDim + 8;  // 128-wide tiles
inline constexpr int kLdNarrow = kChunk + 8;  // 64-wide tiles
inline constexpr int kLdF32 = kChunk + 4;     // fp32 64 x 64 tiles

using bf16 = __nv_bfloat16;

// Shared memory of one CTA. The fp32 triangle (A and its inverse) is dead once the inverse is in
// bf16; R and the scaled writes then reuse its bytes.
struct Shared {
  bf16 q[kChunk][kLdWide];      // normalised, scaled q of the chunk's tokens
  bf16 k[kChunk][kLdWide];      // normalised k
  bf16 s[kHeadDim][kLdWide];    // the state at the chunk's start, S[v][k]
  bf16 delta[kChunk][kLdWide];  // Delta[t][v]
  union {
    struct {
      float a[kChunk][kLdF32];    // A
      float inv[kChunk][kLdF32];  // (I + A)^-1
    } tri;
    struct {
      bf16 r[kChunk][kLdWide];             // R[t][v]
      bf16 delta_to_end[kChunk][kLdWide];  // exp(G_end - G_t) Delta[t][v]
    } rhs;
  } u;
  bf16 p[kChunk][kLdNarrow];    // P
  bf16 inv[kChunk][kLdNarrow];  // (I + A)^-1 in bf16
  float merge[32][33];          // products of the inverse's block merges
  float cum[kChunk];            // G_t
  float beta[kChunk];
  float log_decay[kChunk];  // g_t
  float norm_weight[kHeadDim];
};
static_assert(sizeof(Shared::u.rhs) <= sizeof(Shared::u.tri), "R and the writes fit the triangle");

inline constexpr int kSharedBytes = int(sizeof(Shared));

namespace dev = gdn::cuda;
namespace mma = gdn::cuda::mma;
using Bf16 = dev::StateBits<bf16>;  // packs two fp32 values as a bf16 pair

// Element offset of state element (v, k) of head hv in slot `slot`.
__device__ __forceinline__ int64_t state_offset(const KernelArgs& args, int64_t slot, int64_t hv,
                                                int v, int k) {
  const int64_t head = slot * args.slot_stride + hv * kHeadDim * kHeadDim;
  return head + (args.layout == StateLayout::kVK ? v * kHeadDim + k : k * kHeadDim + v);
}

// The state accumulators of a warp: rows v = 16 w + lane / 4 (+ 8), columns k = 8 j + 2 (lane % 4)
// (+ 1), for the 16 column tiles j.
struct StateTile {
  float d[16][4];
};

__device__ __forceinline__ void store_state(const KernelArgs& args, int64_t slot, int64_t hv,
                                            int warp, int lane, const StateTile& s) {
  const int v0 = 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k0 = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dev::store_value(args.state, args.state_dtype,
                       state_offset(args, slot, hv, v0 + 8 * (e / 2), k0 + e % 2), s.d[j][e]);
  }
}

// The state's bf16 copy for the chunk's products, each warp its 16 rows.
__device__ __forceinline__ void stage_state(Shared& sh, int warp, int lane, const StateTile& s) {
  const int v0 = 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k0 = 8 * j + 2 * (lane % 4);
    *reinterpret_cast<uint32_t*>(&sh.s[v0][k0]) = Bf16::pack(s.d[j][0], s.d[j][1]);
    *reinterpret_cast<uint32_t*>(&sh.s[v0 + 8][k0]) = Bf16::pack(s.d[j][2], s.d[j][3]);
  }
}

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

// The warp's state accumulators from the slot (zeros for a null slot); all 64 loads in flight.
__device__ __forceinline__ void load_state(const KernelArgs& args, int64_t slot, int64_t hv,
                                           int warp, int lane, StateTile& s) {
  const int v0 = 16 * warp + lane / 4;
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

// Loads the chunk's tokens: q, k L2-normalised into bf16 tiles, v into the Delta tile (its bf16
// operand, dead until the writes are solved), g and beta; zeros past n. Warp w takes tokens w,
// w + 8, ...: all their loads are issued before the first is used.
template <class T>
__device__ __forceinline__ void load_chunk(const KernelArgs& args, Shared& sh, int64_t first_row,
                                           int n, int64_t h, int64_t hv, float A, float dt_bias,
                                           int warp, int lane) {
  constexpr int kPerWarp = kChunk / kWarps;
  // Lane j < 8 of warp w: token w + 8 j's gates.
  if (lane < kPerWarp) {
    const int t = warp + kWarps * lane;
    float g = 0.0f, beta = 0.0f;
    if (t < n) {
      const int64_t l = first_row + t;
      const float a = dev::load_value(args.a, args.a_dtype, l * args.a_row_stride + hv);
      const float b = dev::load_value(args.b, args.b_dtype, l * args.b_row_stride + hv);
      g = A * dev::softplus(a + dt_bias);
      beta = dev::sigmoid(b);
    }
    sh.log_decay[t] = g;
    sh.beta[t] = beta;
  }
  {
    const T* x = static_cast<const T*>(args.mixed_qkv);
    float q[kPerWarp][4], k[kPerWarp][4], v[kPerWarp][4];
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int t = warp + kWarps * j;
      const int64_t row = (first_row + t) * args.qkv_row_stride;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * lane + e;
        const bool live = t < n;
        q[j][e] = live ? to_f32(x[row + h * kHeadDim + c]) : 0.0f;
        k[j][e] = live ? to_f32(x[row + (args.H + h) * kHeadDim + c]) : 0.0f;
        v[j][e] = live ? to_f32(x[row + (2 * args.H + hv) * kHeadDim + c]) : 0.0f;
      }
    }
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
      const float q_scale = args.scale / sqrtf(qq + args.l2_eps);
      const float k_scale = 1.0f / sqrtf(kk + args.l2_eps);
      uint2 qp, kp, vp;
      qp.x = Bf16::pack(q[j][0] * q_scale, q[j][1] * q_scale);
      qp.y = Bf16::pack(q[j][2] * q_scale, q[j][3] * q_scale);
      kp.x = Bf16::pack(k[j][0] * k_scale, k[j][1] * k_scale);
      kp.y = Bf16::pack(k[j][2] * k_scale, k[j][3] * k_scale);
      vp.x = Bf16::pack(v[j][0], v[j][1]);
      vp.y = Bf16::pack(v[j][2], v[j][3]);
      *reinterpret_cast<uint2*>(&sh.q[t][4 * lane]) = qp;
      *reinterpret_cast<uint2*>(&sh.k[t][4 * lane]) = kp;
      *reinterpret_cast<uint2*>(&sh.delta[t][4 * lane]) = vp;
    }
  }
}

// G_t = g_0 + ... + g_t (warp 0; two tokens per lane).
__device__ __forceinline__ void cumulative_decay(Shared& sh, int lane) {
  const float g0 = sh.log_decay[2 * lane], g1 = sh.log_decay[2 * lane + 1];
  float incl = g0 + g1;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, incl, m);
    if (lane >= m) incl += up;
  }
  const float before = incl - (g0 + g1);
  sh.cum[2 * lane] = before + g0;
  sh.cum[2 * lane + 1] = incl;
}

// Rows 16 w.. of [Q; K] (warps 0-3: Q, 4-7: K) times K^T: P (warps 0-3) and A (warps 4-7).
__device__ __forceinline__ void chunk_scores(Shared& sh, int warp, int lane) {
  const bool is_q = warp < 4;
  const int t0 = 16 * (warp & 3);
  const bf16* rows = is_q ? &sh.q[0][0] : &sh.k[0][0];
  float acc[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    uint32_t a[4];
    mma::load_a(a, rows, kLdWide, t0, kk, lane);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
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
      const float ratio = s <= t ? expf(sh.cum[t] - sh.cum[s]) : 0.0f;
      if (is_q)
        sh.p[t][s] = __float2bfloat16_rn(acc[j][e] * ratio);
      else
        sh.u.tri.a[t][s] = s < t ? sh.beta[t] * ratio * acc[j][e] : 0.0f;
    }
  }
}

// inv = (I + A)^-1, A strictly lower (fp32), then its bf16 copy. Three phases with a barrier each:
// the 16 x 16 diagonal blocks by forward substitution (one thread per column), then merges
// 16 -> 32 and 32 -> 64 with X = A_lo,hi-off inv_diag and inv_off = -inv_lower_diag X.
__device__ __forceinline__ void invert_triangle(Shared& sh, int tid) {
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
  // 16 -> 32: blocks (1, 0) and (3, 2). The sums run over whole blocks: A and inv hold explicit
  // zeros above their diagonals, so fixed-length unrolled loops need no bounds.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = tid + kThreads * i;
    const int pair = e / 256, r = (e / 16) % 16, c = e % 16, lo = 32 * pair, hi = lo + 16;
    float x = 0.0f;
#pragma unroll
    for (int m = 0; m < 16; ++m) x += a[hi + r][lo + m] * inv[lo + m][lo + c];
    sh.merge[16 * pair + r][c] = x;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = tid + kThreads * i;
    const int pair = e / 256, r = (e / 16) % 16, c = e % 16, lo = 32 * pair, hi = lo + 16;
    float x = 0.0f;
#pragma unroll
    for (int m = 0; m < 16; ++m) x += inv[hi + r][hi + m] * sh.merge[16 * pair + m][c];
    inv[hi + r][lo + c] = -x;
  }
  __syncthreads();
  // 32 -> 64: block (rows 32.., columns ..32).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + kThreads * i, r = e / 32, c = e % 32;
    float x = 0.0f;
#pragma unroll
    for (int m = 0; m < 32; ++m) x += a[32 + r][m] * inv[m][c];
    sh.merge[r][c] = x;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + kThreads * i, r = e / 32, c = e % 32;
    float x = 0.0f;
#pragma unroll
    for (int m = 0; m < 32; ++m) x += inv[32 + r][32 + m] * sh.merge[m][c];
    inv[32 + r][c] = -x;
  }
  __syncthreads();
  for (int e = tid; e < kChunk * kChunk; e += kThreads)
    sh.inv[e / kChunk][e % kChunk] = __float2bfloat16_rn(inv[e / kChunk][e % kChunk]);
}

// Rows 16 (w & 3).. of [Q; K] (warps 0-3: Q, 4-7: K) times S^T: 16 tiles of V columns.
__device__ __forceinline__ void state_products(Shared& sh, int warp, int lane,
                                               float (&acc)[16][4]) {
  const int t0 = 16 * (warp & 3);
  const bf16* rows = warp < 4 ? &sh.q[0][0] : &sh.k[0][0];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim; kk += 16) {
    uint32_t a[4];
    mma::load_a(a, rows, kLdWide, t0, kk, lane);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      uint32_t b[4];
      mma::load_b_pair(b, &sh.s[0][0], kLdWide, 8 * j, kk, lane);
      mma::mma_16bit<bf16>(acc[j], a, b[0], b[1]);
      mma::mma_16bit<bf16>(acc[j + 1], a, b[2], b[3]);
    }
  }
}

// Delta = inv R: warp w computes rows 16 (w & 3).., columns 64 (w / 4)..; stores Delta and the
// decayed-to-end copy.
__device__ __forceinline__ void solve_writes(Shared& sh, int warp, int lane) {
  const int t0 = 16 * (warp & 3), v0 = 64 * (warp / 4);
  float acc[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kChunk; kk += 16) {
    uint32_t a[4];
    mma::load_a(a, &sh.inv[0][0], kLdNarrow, t0, kk, lane);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t b[4];
      mma::load_b_pair_transposed(b, &sh.u.rhs.r[0][0], kLdWide, v0 + 8 * j, kk, lane);
      mma::mma_16bit<bf16>(acc[j], a, b[0], b[1]);
      mma::mma_16bit<bf16>(acc[j + 1], a, b[2], b[3]);
    }
  }
  const float end = sh.cum[kChunk - 1];
  const int ta = t0 + lane / 4, tb = ta + 8;
  const float fa = expf(end - sh.cum[ta]), fb = expf(end - sh.cum[tb]);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int v = v0 + 8 * j + 2 * (lane % 4);
    *reinterpret_cast<uint32_t*>(&sh.delta[ta][v]) = Bf16::pack(acc[j][0], acc[j][1]);
    *reinterpret_cast<uint32_t*>(&sh.delta[tb][v]) = Bf16::pack(acc[j][2], acc[j][3]);
    *reinterpret_cast<uint32_t*>(&sh.u.rhs.delta_to_end[ta][v]) =
        Bf16::pack(acc[j][0] * fa, acc[j][1] * fa);
    *reinterpret_cast<uint32_t*>(&sh.u.rhs.delta_to_end[tb][v]) =
        Bf16::pack(acc[j][2] * fb, acc[j][3] * fb);
  }
}

// act(z): silu(z) = z sigmoid(z), or sigmoid(z); one expression for both keeps the code small.
__device__ __forceinline__ float gate_value(const KernelArgs& args, float z) {
  return (args.gate == GateActivation::kSiLU ? z : 1.0f) * dev::fast_sigmoid(z);
}

// Outputs of rows 16 w.. (warps 0-3): o += P Delta, then the gated RMSNorm, stored for t < n.
template <class T>
__device__ __forceinline__ void finish_outputs(const KernelArgs& args, Shared& sh,
                                               int64_t first_row, int n, int64_t hv, int warp,
                                               int lane, float (&o)[16][4]) {
  const int t0 = 16 * warp;
#pragma unroll
  for (int kk = 0; kk < kChunk; kk += 16) {
    uint32_t a[4];
    mma::load_a(a, &sh.p[0][0], kLdNarrow, t0, kk, lane);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      uint32_t b[4];
      mma::load_b_pair_transposed(b, &sh.delta[0][0], kLdWide, 8 * j, kk, lane);
      mma::mma_16bit<bf16>(o[j], a, b[0], b[1]);
      mma::mma_16bit<bf16>(o[j + 1], a, b[2], b[3]);
    }
  }
  // One row at a time (its 32 gate values in flight together): rows t0 + lane / 4 and + 8.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = t0 + lane / 4 + 8 * half;
    const int64_t l = first_row + t;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = o[j][2 * half + e];
        if (args.round_core_output) x = to_f32(from_f32<T>(x));
        ss += x * x;
      }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if (t >= n) continue;
    const float rstd = 1.0f / sqrtf(ss / float(kHeadDim) + args.norm_eps);
    float y[16][2];
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int v = 8 * j + 2 * (lane % 4) + e;
        y[j][e] =
            args.norm_weight ? o[j][2 * half + e] * rstd * sh.norm_weight[v] : o[j][2 * half + e];
      }
    if (args.z) {
      {
        const T* zrow =
            static_cast<const T*>(args.z) + l * args.z_row_stride + hv * args.z_head_stride;
        float z[16][2];
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) z[j][e] = to_f32(zrow[8 * j + 2 * (lane % 4) + e]);
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) y[j][e] *= gate_value(args, z[j][e]);
      }
    }
    const int64_t out_row = (l * args.HV + hv) * kHeadDim;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        static_cast<T*>(args.out)[out_row + 8 * j + 2 * (lane % 4) + e] = from_f32<T>(y[j][e]);
  }
}

// S = gamma_end S + (decayed Delta)^T K: warp w updates its 16 state rows.
__device__ __forceinline__ void advance_state(Shared& sh, int warp, int lane, StateTile& s) {
  const float decay = expf(sh.cum[kChunk - 1]);
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s.d[j][e] *= decay;
#pragma unroll
  for (int kk = 0; kk < kChunk; kk += 16) {
    uint32_t a[4];
    mma::load_a_transposed(a, &sh.u.rhs.delta_to_end[0][0], kLdWide, 16 * warp, kk, lane);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      uint32_t b[4];
      mma::load_b_pair_transposed(b, &sh.k[0][0], kLdWide, 8 * j, kk, lane);
      mma::mma_16bit<bf16>(s.d[j], a, b[0], b[1]);
      mma::mma_16bit<bf16>(s.d[j + 1], a, b[2], b[3]);
    }
  }
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

// Act: the element type of mixed_qkv, z and out (one dtype on CUDA).
template <class Act>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const KernelArgs args) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  Shared& sh = *reinterpret_cast<Shared*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t i = int64_t(blockIdx.x) / args.HV, hv = int64_t(blockIdx.x) % args.HV;
  const bool reporter = hv == 0 && tid == 0;  // counts the request's error once

  const int64_t begin = gdn::load_index(args.cu_seqlens, args.cu_dtype, i);
  const int64_t end = gdn::load_index(args.cu_seqlens, args.cu_dtype, i + 1);
  if (begin < 0 || end < begin || end > args.L) {  // rows unknown: write nothing
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    return;
  }
  const int64_t T = end - begin;
  if (T == 0) return;
  const int64_t initial_id =
      gdn::load_index(args.initial_state_indices, args.initial_dtype, i * args.initial_stride);
  const int64_t final_id =
      gdn::load_index(args.final_state_indices, args.final_dtype, i * args.final_stride);
  bool bad = initial_id >= args.num_slots || final_id >= args.num_slots;
  const int64_t checkpoints = args.checkpoint_indices ? T / args.checkpoint_every : 0;
  if (checkpoints > args.checkpoint_columns) bad = true;
  for (int64_t j = 0; j < checkpoints && !bad; ++j)
    if (checkpoint_slot(args, i, j) >= args.num_slots) bad = true;
  if (bad) {
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    for (int64_t e = tid; e < T * kHeadDim; e += kThreads)
      dev::store_value(args.out, args.out_dtype,
                       ((begin + e / kHeadDim) * args.HV + hv) * kHeadDim + e % kHeadDim, 0.0f);
    return;
  }
  const int64_t initial = initial_id < args.first_valid_slot ? -1 : initial_id;
  const int64_t final_slot = final_id < args.first_valid_slot ? -1 : final_id;

  const int64_t h = hv / args.ratio;
  const float A = -expf(dev::load_value(args.A_log, args.A_log_dtype, hv));
  const float dt_bias = dev::load_value(args.dt_bias, args.dt_bias_dtype, hv);

  if (args.norm_weight && tid < kHeadDim)
    sh.norm_weight[tid] = dev::load_value(args.norm_weight, args.norm_weight_dtype, tid);
  StateTile state;
  load_state(args, initial, hv, warp, lane, state);
  stage_state(sh, warp, lane, state);
  for (int64_t c0 = 0; c0 < T; c0 += kChunk) {
    const int n = int(T - c0 < kChunk ? T - c0 : kChunk);
    const int64_t first_row = begin + c0;
    load_chunk<Act>(args, sh, first_row, n, h, hv, A, dt_bias, warp, lane);
    __syncthreads();
    if (warp == 0) cumulative_decay(sh, lane);
    __syncthreads();
    chunk_scores(sh, warp, lane);
    __syncthreads();
    invert_triangle(sh, tid);
    __syncthreads();
    float acc[16][4];
    state_products(sh, warp, lane, acc);
    {
      const int ta = 16 * (warp & 3) + lane / 4, tb = ta + 8;
      const float ga = expf(sh.cum[ta]), gb = expf(sh.cum[tb]);
      if (warp < 4) {  // o starts as gamma_t S q_t
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[j][0] *= ga;
          acc[j][1] *= ga;
          acc[j][2] *= gb;
          acc[j][3] *= gb;
        }
      } else {  // R = beta_t (v_t - gamma_t S k_t), v from the Delta tile
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int v = 8 * j + 2 * (lane % 4);
          const float2 xa =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sh.delta[ta][v]));
          const float2 xb =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sh.delta[tb][v]));
          const float ba = sh.beta[ta], bb = sh.beta[tb];
          *reinterpret_cast<uint32_t*>(&sh.u.rhs.r[ta][v]) =
              Bf16::pack(ba * (xa.x - ga * acc[j][0]), ba * (xa.y - ga * acc[j][1]));
          *reinterpret_cast<uint32_t*>(&sh.u.rhs.r[tb][v]) =
              Bf16::pack(bb * (xb.x - gb * acc[j][2]), bb * (xb.y - gb * acc[j][3]));
        }
      }
    }
    __syncthreads();
    solve_writes(sh, warp, lane);
    __syncthreads();
    if (warp < 4) finish_outputs<Act>(args, sh, first_row, n, hv, warp, lane, acc);
    advance_state(sh, warp, lane, state);
    const int64_t done = c0 + n;
    if (args.checkpoint_indices && done % args.checkpoint_every == 0) {
      const int64_t slot = checkpoint_slot(args, i, done / args.checkpoint_every - 1);
      if (slot >= 0) store_state(args, slot, hv, warp, lane, state);
    }
    __syncthreads();  // every warp is done with this chunk's tiles
    stage_state(sh, warp, lane, state);
  }
  if (final_slot >= 0) store_state(args, final_slot, hv, warp, lane, state);
}

}  // namespace gdn::prefill::cuda_detail
