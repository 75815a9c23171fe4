// Tensor-core probe for replay verify in closed form (H200 design aid, not part of the library).
//
// Replay in closed form (gdn/decode_mtp/cuda_kernel.cuh, prepare_replay) reduces a head's work,
// once the CTA has solved the window's triangular system, to two products with the checkpoint S
// (bf16, 128 x 128 per head) and m = n + T staged vectors:
//   P = S A1^T                  A1 [m][128]: kt_j (replayed, j < n), qt_j (new, j >= n)
//   w_j = c_j (vt_j - P_j)      j < n: the checkpoint coefficients (vt: [m][128 rows])
//   o_j = P_j + ot_j            j >= n: the new tokens' outputs (before the norm)
//   S' = g S + W K2             W [128 rows][n], K2 [n][128]: the replayed tokens' raw k
// The library does both products with FMAs on rows held in registers (bf16 T = 4, B = 128:
// 144.8 us, about twice the state floor). This probe does them on tensor cores (mma.sync
// m16n8k16, bf16 inputs split hi + lo, fp32 accumulators) with the state streamed straight into
// registers, to measure how close that row phase comes to the memory floor. A warp owns 16 rows
// at a time; the K columns are permuted (the same way in both products) so that a lane's state
// registers are at once GEMM1's B fragment, GEMM2's accumulator and a 16-byte global load or
// store: no shuffles and no shared-memory round trip for the state.
//
// Three families of kernels:
//  - the rows phase alone (replay_mma_kernel and its bulk-copy, persistent and 8-warp shapes),
//    reading the solved vectors from a small, L2-resident set of per-head inputs and checked
//    against a float64 evaluation of the formulas above;
//  - the whole closed form (replay_mma_solve_kernel): a raw window (unit k, q, v, alpha, beta)
//    staged and solved by the library's prepare_replay, or with its pair products spread over
//    the CTA, then the rows;
//  - the same with the solve on tensor cores (replay_mma_tc_solve_kernel).
// The last two are checked against a float64 token-by-token replay of the raw window. Not
// measured anywhere here: metadata, activation dtype conversion, the gated RMSNorm (o is stored
// as is) and the window save. The pool is dense (head h at h * 128 * 128); the copy kernels move
// the same bytes in place with each access pattern and no math.
//
//   nvcc -std=c++20 -O3 -arch=sm_90a -Iinclude -DGDN_HAS_CUDA --expt-relaxed-constexpr \
//       benchmarks/cuda/replay_mma_probe.cu -o probe
//   ./probe [heads=4096]    (PROBE_ONLY=NAME: that variant at T = 4, n = 2 only;
//                            PROBE_SOLVE_ONLY=1: the whole closed form's variants only)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gdn/core/cuda/device.cuh"
#include "gdn/decode_mtp/cuda_kernel.cuh"  // prepare_replay: the closed form's per-CTA solve
#include "probe_util.cuh"

namespace dev = gdn::cuda;
constexpr int kD = 128;          // K = V
constexpr int kTok = 16;         // staged tokens, padded (m <= 16)
constexpr int kInputSets = 256;  // distinct per-head inputs (L2-resident, 6 MB)

// Per-head solved inputs, fp32: A1 [16][128] (rows >= m zero), VO [16][128] (vt_j of row r for
// j < n, ot_j for j >= n), K2 [16][128] (raw k_i for i < n, zero after), coef [16] (c_j, j < n),
// decay g.
struct Inputs {
  const float* a1;
  const float* vo;
  const float* k2;
  const float* coef;
  const float* decay;
};

// The library's tensor-core helpers (gdn/decode_mtp/cuda_kernel.cuh): mma.sync m16n8k16 on bf16,
// x = hi + lo splits of a pair of floats into bf16x2 words, and bf16x2 packing. The probe keeps
// its own unpacking (a conversion, where the library shifts bits), the code it was measured with.
using gdn::decode_mtp::cuda_detail::mma_bf16;
using gdn::decode_mtp::cuda_detail::split_bf16_pair;
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return dev::StateBits<__nv_bfloat16>::pack(lo, hi);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// 16-byte state accesses: plain, or (kHints) loads that bypass L1 and are marked evict-first in
// L2 and streaming (evict-first) stores.
template <bool kHints>
__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p) {
  if constexpr (!kHints) return *reinterpret_cast<const uint4*>(p);
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(dev::l2_evict_first_policy()));
  return v;
}
template <bool kHints>
__device__ __forceinline__ void store16(__nv_bfloat16* p, uint4 v) {
  if constexpr (!kHints) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
  }
}

// Column permutation. A lane (g = lane / 4, t = lane % 4) holds, of each row it owns, the
// physical columns 32 b + 8 t .. + 7 (b = 0..3) as 4 bf16 pairs p[b][0..3]:
//  - GEMM1 k-tile kt = 2 b + h: logical k 2t, 2t+1 -> 32 b + 8 t + 4 h + {0, 1}, 2t+8, 2t+9 -> +{2,
//  3}
//    (B fragment = p[b][2h], p[b][2h+1]);
//  - GEMM2 n-tile j = 4 b + q: logical n 2t + e -> 32 b + 8 t + 2 q + e (accumulator = p[b][q]).
__device__ __forceinline__ int gemm1_col(int kt, int t, int pair) {  // pair 0: k 2t, 1: k 2t+8
  return 32 * (kt >> 1) + 8 * t + 4 * (kt & 1) + 2 * pair;
}
__device__ __forceinline__ int gemm2_col(int j, int n) {  // logical n = 0..7 of n-tile j
  return 32 * (j >> 2) + 8 * (n >> 1) + 2 * (j & 3) + (n & 1);
}

template <int kWarps>
struct Smem {
  uint32_t a1[2][8][32][4];   // GEMM1 A fragments, hi / lo, [k-tile][lane]
  uint32_t b2[2][16][32][2];  // GEMM2 B fragments, hi / lo, [n-tile][lane]
  float vo[kTok][kD];
  float coef[kTok];
  float decay;
  float w[kWarps][16][kTok + 1];  // per warp: W [row][token] of its current 16 rows
};

// A head's solved inputs as the kWarps * 32 threads of a CTA load them (all loads of a head at
// once), and as they store them into the shared fragments.
template <int kWarps>
struct InputRegs {
  static constexpr int kThreads = 32 * kWarps, kA1 = 256 / kThreads, kB2 = 512 / kThreads,
                       kVo = kTok * kD / 4 / kThreads;
  float2 a1[kA1][4];    // [iteration][fragment register]: a pair of columns
  float b2[kB2][2][2];  // [iteration][register][token of the pair]
  float4 vo[kVo];
  float coef, decay;
};
template <int kWarps>
__device__ __forceinline__ InputRegs<kWarps> load_inputs(const Inputs& in, int set, int tid) {
  using R = InputRegs<kWarps>;
  R r;
  const float* a1 = in.a1 + int64_t(set) * kTok * kD;
  const float* k2 = in.k2 + int64_t(set) * kTok * kD;
#pragma unroll
  for (int it = 0; it < R::kA1; ++it) {
    const int e = tid + R::kThreads * it, kt = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // a0: (g, pair 0), a1: (g + 8, pair 0), a2: (g, 1), a3: (g+8, 1)
      const int tok = lg + 8 * (q & 1), c = gemm1_col(kt, lt, q >> 1);
      r.a1[it][q] = *reinterpret_cast<const float2*>(a1 + tok * kD + c);
    }
  }
#pragma unroll
  for (int it = 0; it < R::kB2; ++it) {
    const int e = tid + R::kThreads * it, j = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
    const int c = gemm2_col(j, lg);
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // b0: tokens 2t, 2t+1; b1: 2t+8, 2t+9
      const int tok = 2 * lt + 8 * q;
      r.b2[it][q][0] = k2[tok * kD + c];
      r.b2[it][q][1] = k2[(tok + 1) * kD + c];
    }
  }
#pragma unroll
  for (int it = 0; it < R::kVo; ++it)
    r.vo[it] =
        reinterpret_cast<const float4*>(in.vo + int64_t(set) * kTok * kD)[tid + R::kThreads * it];
  r.coef = tid < kTok ? in.coef[set * kTok + tid] : 0.0f;
  r.decay = in.decay[set];
  return r;
}
template <int kWarps>
__device__ __forceinline__ void store_inputs(Smem<kWarps>& sm, const InputRegs<kWarps>& r,
                                             int tid) {
  using R = InputRegs<kWarps>;
#pragma unroll
  for (int it = 0; it < R::kA1; ++it) {
    const int e = tid + R::kThreads * it, kt = e >> 5, l = e & 31;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) split_bf16_pair(r.a1[it][q].x, r.a1[it][q].y, hi[q], lo[q]);
    *reinterpret_cast<uint4*>(sm.a1[0][kt][l]) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(sm.a1[1][kt][l]) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
#pragma unroll
  for (int it = 0; it < R::kB2; ++it) {
    const int e = tid + R::kThreads * it, j = e >> 5, l = e & 31;
    uint32_t hi[2], lo[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) split_bf16_pair(r.b2[it][q][0], r.b2[it][q][1], hi[q], lo[q]);
    *reinterpret_cast<uint2*>(sm.b2[0][j][l]) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(sm.b2[1][j][l]) = make_uint2(lo[0], lo[1]);
  }
#pragma unroll
  for (int it = 0; it < R::kVo; ++it)
    reinterpret_cast<float4*>(&sm.vo[0][0])[tid + R::kThreads * it] = r.vo[it];
  if (tid < kTok) sm.coef[tid] = r.coef;
  if (tid == 0) sm.decay = r.decay;
}

// A warp's kTiles tiles of 16 rows (row 16 tile + 8 half + g of `rows`, columns 32 b + 8 t .. + 7)
// into registers with 16-byte loads, from global memory or from the warp's bulk-copied buffer.
template <int kTiles, bool kHints = false>
__device__ __forceinline__ void load_rows(const __nv_bfloat16* rows, uint4 (&p)[kTiles][2][4],
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        p[tile][half][b] = load16<kHints>(rows + (16 * tile + 8 * half + g) * kD + 32 * b + 8 * t);
}

// The rows phase of one head for a warp's rows first_row .. + 16 kTiles - 1, held in p
// (fragments in shared memory): o of the new tokens to out, the checkpoint in place.
// `staged` (the bulk form): the warp's rows come from and go back to its shared buffer (rows
// first_row.. at staged[0..]), which one bulk copy then stores. `vo_regs` (the tensor-core solve):
// the lane's values of vo in registers, [tile][half][r] as the epilogue reads them.
template <int kWarps, int kTiles, bool kHints = false>
__device__ __forceinline__ void head_rows(Smem<kWarps>& sm, uint4 (&p)[kTiles][2][4],
                                          __nv_bfloat16* state, float* out, int64_t head,
                                          int first_row, int warp, int lane, int n, int m,
                                          __nv_bfloat16* staged = nullptr,
                                          const float (*vo_regs)[2][4] = nullptr) {
  const int g = lane >> 2, t = lane & 3;
  float (*w)[kTok + 1] = sm.w[warp];
  const float decay = sm.decay;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    const int row0 = first_row + 16 * tile;
    // GEMM1: D1 [token][row] over the two 8-row halves (n-tiles), hi and lo in separate chains.
    float d1[2][2][4] = {};  // [half][hi / lo]
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const uint4 ah = *reinterpret_cast<const uint4*>(sm.a1[0][kt][lane]);
      const uint4 al = *reinterpret_cast<const uint4*>(sm.a1[1][kt][lane]);
      const uint32_t afh[4] = {ah.x, ah.y, ah.z, ah.w}, afl[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint4 s = p[tile][half][kt >> 1];
        const uint32_t b0 = (kt & 1) ? s.z : s.x, b1 = (kt & 1) ? s.w : s.y;
        mma_bf16(d1[half][0], afh, b0, b1);
        mma_bf16(d1[half][1], afl, b0, b1);
      }
    }
    // Epilogue: lane holds tokens g, g + 8 of rows 8 half + 2t + {0, 1}.
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tok = g + 8 * (r >> 1), row = 8 * half + 2 * t + (r & 1);
        const float vo = vo_regs ? vo_regs[tile][half][r] : sm.vo[tok][row0 + row];
        const float d = d1[half][0][r] + d1[half][1][r];
        float wv = 0.0f;
        if (tok < n) {
          wv = sm.coef[tok] * (vo - d);
        } else if (tok < m) {
          out[(head * kTok + tok) * kD + row0 + row] = d + vo;
        }
        w[row][tok] = wv;
      }
    if (n == 0) continue;  // nothing replayed: the checkpoint is not stored
    __syncwarp();
    uint32_t awh[4], awl[4];  // GEMM2 A = W [row][token]
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // a0: (g, 2t), a1: (g + 8, 2t), a2: (g, 2t + 8), a3: (g+8, 2t+8)
      const int row = g + 8 * (r & 1), tok = 2 * t + 8 * (r >> 1);
      split_bf16_pair(w[row][tok], w[row][tok + 1], awh[r], awl[r]);
    }
    __syncwarp();  // w is rewritten by the next tile
    // GEMM2, one n-tile at a time: acc = g S, += W K2 (hi hi + hi lo + lo hi), back into p.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int b = j >> 2, q = j & 3;
      uint32_t* s0 = reinterpret_cast<uint32_t*>(&p[tile][0][b]) + q;
      uint32_t* s1 = reinterpret_cast<uint32_t*>(&p[tile][1][b]) + q;
      const float2 x0 = unpack_bf16(*s0), x1 = unpack_bf16(*s1);
      float acc[4] = {decay * x0.x, decay * x0.y, decay * x1.x, decay * x1.y};
      const uint2 bh = *reinterpret_cast<const uint2*>(sm.b2[0][j][lane]);
      const uint2 bl = *reinterpret_cast<const uint2*>(sm.b2[1][j][lane]);
      mma_bf16(acc, awh, bh.x, bh.y);
      mma_bf16(acc, awh, bl.x, bl.y);
      mma_bf16(acc, awl, bh.x, bh.y);
      *s0 = pack_bf16(acc[0], acc[1]);
      *s1 = pack_bf16(acc[2], acc[3]);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int at = (row0 + 8 * half + g) * kD + 32 * b + 8 * t;
        if (staged)
          *reinterpret_cast<uint4*>(staged + at - first_row * kD) = p[tile][half][b];
        else
          store16<kHints>(state + at, p[tile][half][b]);
      }
  }
  if (staged && n > 0) {  // the warp's rows, by one bulk copy
    dev::fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      bulk_store(state + first_row * kD, staged, 16 * kTiles * kD * 2);
      bulk_store_wait_read();
    }
  }
}

// One CTA of kWarps warps per head, warp w owning 128 / kWarps rows as tiles of 16, its rows
// loaded straight into registers (plain 16-byte loads, issued before the inputs); at least
// kMinCtas CTAs per SM (the register budget).
template <int kWarps, int kMinCtas, bool kHints = false>
__global__ void __launch_bounds__(32 * kWarps, kMinCtas)
    replay_mma_kernel(__nv_bfloat16* pool, Inputs in, float* out, int n, int m, int heads) {
  constexpr int kTiles = 8 / kWarps;
  __shared__ __align__(16) Smem<kWarps> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head = blockIdx.x;
  __nv_bfloat16* state = pool + head * kD * kD;
  const int first_row = 16 * kTiles * warp;
  uint4 p[kTiles][2][4];  // [tile][half][b]
  load_rows<kTiles, kHints>(state + first_row * kD, p, lane);
  store_inputs(sm, load_inputs<kWarps>(in, int(head % kInputSets), tid), tid);
  __syncthreads();
  head_rows<kWarps, kTiles, kHints>(sm, p, state, out, head, first_row, warp, lane, n, m);
}

// The bulk form of replay_mma_kernel<8, 1>: a warp's 16 rows come by one sm_90 bulk copy into its
// shared buffer (4 KB, issued first) and go back by one bulk copy, so that the memory system sees
// whole rows both ways.
constexpr int kBulkRowsSmem = 128 + 128 * kD * 2;
template <int kMinCtas>
__global__ void __launch_bounds__(256, kMinCtas)
    replay_mma_bulk_kernel(__nv_bfloat16* pool, Inputs in, float* out, int n, int m, int heads) {
  __shared__ __align__(16) Smem<8> sm;
  extern __shared__ __align__(128) unsigned char dyn[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, first_row = 16 * warp;
  const int64_t head = blockIdx.x;
  __nv_bfloat16* state = pool + head * kD * kD;
  uint64_t* bar = reinterpret_cast<uint64_t*>(dyn) + warp;
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(dyn + 128) + first_row * kD;
  if (lane == 0) {
    dev::mbarrier_init(bar, 1);
    dev::mbarrier_init_fence();
    dev::bulk_load(staged, state + first_row * kD, 16 * kD * 2, bar, dev::l2_evict_first_policy());
  }
  store_inputs(sm, load_inputs<8>(in, int(head % kInputSets), tid), tid);
  __syncthreads();
  dev::mbarrier_wait(bar, 0u);
  uint4 p[1][2][4];
  load_rows(staged, p, lane);
  head_rows(sm, p, state, out, head, first_row, warp, lane, n, m, staged);
}

// The closed form whole, minus metadata, activation loads and the norm: the CTA stages a head's
// raw window (k unit, q scaled, v, alpha, beta: RawInputs), solves it with the library's
// prepare_replay, turns the solved vectors into the fragments, and runs the rows phase of
// replay_mma_kernel<4, kMinCtas>. Checked against a float64 token-by-token replay.
struct RawInputs {
  const float* k;  // [set][16][128]
  const float* q;
  const float* v;
  const float* alpha;  // [set][16]
  const float* beta;
};
// Stages a head's raw window for the solve, thread tid holding column (k, q) and row (v) tid of
// every token: all loads issued before the first store, as the library's token staging does; the
// rows of tokens from m, and q's rows below n, are zero.
__device__ __forceinline__ void stage_raw_window(const RawInputs& raw, int set, int n, int m,
                                                 int tid, float (*k)[kD], float (*q)[kD],
                                                 float (*v)[kD]) {
  const int64_t base = int64_t(set) * kTok * kD;
  float kv[kTok], vv[kTok], qv[kTok];
#pragma unroll
  for (int j = 0; j < kTok; ++j) {
    kv[j] = j < m ? raw.k[base + j * kD + tid] : 0.0f;
    vv[j] = j < m ? raw.v[base + j * kD + tid] : 0.0f;
    qv[j] = j >= n && j < m ? raw.q[base + j * kD + tid] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kTok; ++j) {
    k[j][tid] = kv[j];
    q[j][tid] = qv[j];
    v[j][tid] = vv[j];
  }
}
struct SolveSmem {  // v lives in the rows phase's vo (the solve leaves vt_j, then ot_j there)
  float k[kTok][kD], q[kTok][kD], gates[kTok][4], mat[kTok * kTok];
};
// The closed form's per-CTA solve with its pair products spread over the CTA: the library's
// prepare_replay has one thread compute each pair's two 128-long dot products (a dependent chain of
// shared loads per thread), which the rows phase on tensor cores no longer hides. Here a warp
// takes four pairs at a time, its lanes 4 columns each, and the sums go through warp shuffles;
// the decays, the matrix layout and step 2 (solve_in_registers) are the library's.
__device__ __forceinline__ void prepare_replay_parallel(int n, int m, int tid, float* k_s,
                                                        float* q_s, float* gates, float* mat_s,
                                                        float* v_s, float* o_s) {
  namespace cd = gdn::decode_mtp::cuda_detail;
  auto gate = [&](int j, int which) -> float& { return gates[cd::kClosedGateFloats * j + which]; };
  if (tid < m) {
    const int j = tid;
    float g = 1.0f, cf = j < n ? 1.0f : 0.0f;
    for (int l = 0; l <= j; ++l) g *= gate(l, cd::kGateAlpha);
    for (int l = j + 1; l < n; ++l) cf *= gate(l, cd::kGateAlpha);
    gate(j, cd::kGateDecay) = g;
    gate(j, cd::kGateCheckpoint) = cf;
  }
  const int lane = tid & 31, warp = tid >> 5, pairs = m * (m + 1) / 2;
  for (int e0 = 4 * warp; e0 < pairs; e0 += 16) {
    float kk[4], kq[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int e = e0 + u < pairs ? e0 + u : pairs - 1;
      int j, i;
      cd::triangle_pair(e, j, i);
      const float4 ki = reinterpret_cast<const float4*>(k_s + i * kD)[lane];
      const float4 kj = reinterpret_cast<const float4*>(k_s + j * kD)[lane];
      const float4 qj = reinterpret_cast<const float4*>(q_s + j * kD)[lane];
      kk[u] = ki.x * kj.x + ki.y * kj.y + ki.z * kj.z + ki.w * kj.w;
      kq[u] = j >= n ? ki.x * qj.x + ki.y * qj.y + ki.z * qj.z + ki.w * qj.w : 0.0f;
    }
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1)
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        kk[u] += __shfl_xor_sync(0xffffffffu, kk[u], w);
        kq[u] += __shfl_xor_sync(0xffffffffu, kq[u], w);
      }
    if (lane < 4 && e0 + lane < pairs) {
      int j, i;
      cd::triangle_pair(e0 + lane, j, i);
      float r = 1.0f;
      for (int l = i + 1; l <= j; ++l) r *= gate(l, cd::kGateAlpha);
      const float dkk = lane == 0 ? kk[0] : lane == 1 ? kk[1] : lane == 2 ? kk[2] : kk[3];
      const float dkq = lane == 0 ? kq[0] : lane == 1 ? kq[1] : lane == 2 ? kq[2] : kq[3];
      if (i < j) mat_s[j * m + i] = gate(j, cd::kGateBeta) * r * dkk;
      if (j >= n) mat_s[i * m + j] = r * dkq;
    }
  }
  __syncthreads();
  cd::solve_in_registers(n, m, kD, tid, k_s, q_s, gates, mat_s, v_s, o_s);
  __syncthreads();
}

template <int kMinCtas, bool kParallelPairs = false>
__global__ void __launch_bounds__(128, kMinCtas)
    replay_mma_solve_kernel(__nv_bfloat16* pool, RawInputs raw, float* out, int n, int m,
                            int heads) {
  namespace cd = gdn::decode_mtp::cuda_detail;
  __shared__ __align__(16) Smem<4> sm;
  __shared__ __align__(16) SolveSmem ss;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head = blockIdx.x;
  const int set = int(head % kInputSets);
  __nv_bfloat16* state = pool + head * kD * kD;
  const int first_row = 32 * warp;
  uint4 p[2][2][4];
  load_rows(state + first_row * kD, p, lane);
  stage_raw_window(raw, set, n, m, tid, ss.k, ss.q, sm.vo);
  if (tid < m) {
    ss.gates[tid][cd::kGateAlpha] = raw.alpha[set * kTok + tid];
    ss.gates[tid][cd::kGateBeta] = raw.beta[set * kTok + tid];
  }
  __syncthreads();
  if constexpr (kParallelPairs)
    prepare_replay_parallel(n, m, tid, &ss.k[0][0], &ss.q[0][0], &ss.gates[0][0], ss.mat,
                            &sm.vo[0][0], &sm.vo[n][0]);
  else
    cd::prepare_replay(n, m, kD, tid, &ss.k[0][0], &ss.q[0][0], &ss.gates[0][0], ss.mat,
                       &sm.vo[0][0], &sm.vo[n][0]);
  // Fragments from the solve: A1 row j = kt_j (j < n, in k) or qt_j (in q), zero from m; K2 row
  // i = raw k_i (q's rows i < n), zero from n; VO = v's rows (vt_j, then ot_j).
  auto a1 = [&](int j, int c) { return j >= m ? 0.0f : j < n ? ss.k[j][c] : ss.q[j][c]; };
  auto k2 = [&](int i, int c) { return i < n ? ss.q[i][c] : 0.0f; };
  for (int e = tid; e < 8 * 32; e += 128) {
    const int kt = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int tok = lg + 8 * (q & 1), c = gemm1_col(kt, lt, q >> 1);
      split_bf16_pair(a1(tok, c), a1(tok, c + 1), hi[q], lo[q]);
    }
    *reinterpret_cast<uint4*>(sm.a1[0][kt][l]) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(sm.a1[1][kt][l]) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  for (int e = tid; e < 16 * 32; e += 128) {
    const int j = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
    const int c = gemm2_col(j, lg);
    uint32_t hi[2], lo[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int tok = 2 * lt + 8 * q;
      split_bf16_pair(k2(tok, c), k2(tok + 1, c), hi[q], lo[q]);
    }
    *reinterpret_cast<uint2*>(sm.b2[0][j][l]) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(sm.b2[1][j][l]) = make_uint2(lo[0], lo[1]);
  }
  if (tid < kTok) sm.coef[tid] = tid < n ? ss.gates[tid][cd::kGateCheckpoint] : 0.0f;
  if (tid == 0) sm.decay = n > 0 ? ss.gates[n - 1][cd::kGateDecay] : 1.0f;
  __syncthreads();
  head_rows(sm, p, state, out, head, first_row, warp, lane, n, m);
}

// The closed form with its solve on tensor cores as well (the chunked WY form): the Gram matrices
// K K^T and Q K^T as mma (hi + lo), the 16 x 16 algebra on CUDA cores (the unit-triangular inverse
// of I + L' by one warp's forward substitution, lane c holding column c), then GEMM1's A operand
// (kt_j, qt_j) = [P_k | P_q] [K; Q] and the epilogue's (vt_j, ot_j) = P_v V as mma, straight into
// the fragments and registers the rows phase reads.
struct TcSolveSmem {
  float k[kTok][kD], q[kTok][kD];              // raw k (zero from m), q (zero below n and from m)
  float g[kTok][kTok + 1], h[kTok][kTok + 1];  // k_j . k_i, q_j . k_i
  float lp[kTok][kTok + 1], qmt[kTok][kTok + 1], ainv[kTok][kTok + 1];
  float bk[kTok][kTok + 1], bv[kTok][kTok + 1], pk[kTok][2 * kTok + 1], pv[kTok][kTok + 1];
  float decay[kTok], alpha[kTok], beta[kTok];
};
// A fragment (hi + lo) of the 16 x 16 block at column k0 of a row-major fp32 matrix.
__device__ __forceinline__ void a_frag(const float* M, int ld, int k0, int lane, uint32_t (&hi)[4],
                                       uint32_t (&lo)[4]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float* x = M + (g + 8 * (q & 1)) * ld + k0 + 2 * t + 8 * (q >> 1);
    split_bf16_pair(x[0], x[1], hi[q], lo[q]);
  }
}
// B fragment (hi + lo) with B[k][n] = X[n0 + n][k0 + k] (a Gram matrix's second factor).
__device__ __forceinline__ void bt_frag(const float* X, int ld, int n0, int k0, int lane,
                                        uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const float* x = X + (n0 + (lane >> 2)) * ld + k0 + 2 * (lane & 3);
  split_bf16_pair(x[0], x[1], hi[0], lo[0]);
  split_bf16_pair(x[8], x[9], hi[1], lo[1]);
}
// B fragment (hi + lo) with B[k][n] = Y[k][c], c the lane's column (n = lane / 4).
__device__ __forceinline__ void b_frag_col(const float* Y, int ld, int c, int lane,
                                           uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const int t = lane & 3;
  split_bf16_pair(Y[2 * t * ld + c], Y[(2 * t + 1) * ld + c], hi[0], lo[0]);
  split_bf16_pair(Y[(2 * t + 8) * ld + c], Y[(2 * t + 9) * ld + c], hi[1], lo[1]);
}
// acc += a b to about fp32 accuracy: hi hi + hi lo + lo hi.
__device__ __forceinline__ void mma3(float (&acc)[4], const uint32_t (&ahi)[4],
                                     const uint32_t (&alo)[4], const uint32_t (&bhi)[2],
                                     const uint32_t (&blo)[2]) {
  mma_bf16(acc, ahi, bhi[0], bhi[1]);
  mma_bf16(acc, ahi, blo[0], blo[1]);
  mma_bf16(acc, alo, bhi[0], bhi[1]);
}
template <int kMinCtas>
__global__ void __launch_bounds__(128, kMinCtas)
    replay_mma_tc_solve_kernel(__nv_bfloat16* pool, RawInputs raw, float* out, int n, int m,
                               int heads) {
  __shared__ __align__(16) Smem<4> sm;  // its vo holds the raw v ([token][row])
  extern __shared__ __align__(128) unsigned char dyn[];
  TcSolveSmem& ts = *reinterpret_cast<TcSolveSmem*>(dyn);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int64_t head = blockIdx.x;
  const int set = int(head % kInputSets);
  __nv_bfloat16* state = pool + head * kD * kD;
  const int first_row = 32 * warp;
  uint4 p[2][2][4];
  load_rows(state + first_row * kD, p, lane);
  stage_raw_window(raw, set, n, m, tid, ts.k, ts.q, sm.vo);
  if (tid < kTok) {
    ts.alpha[tid] = tid < m ? raw.alpha[set * kTok + tid] : 1.0f;
    ts.beta[tid] = tid < m ? raw.beta[set * kTok + tid] : 0.0f;
  }
  __syncthreads();
  {  // Gram matrices: warps 0, 1 K K^T, warps 2, 3 Q K^T, one 8-column half each
    const float* X = warp < 2 ? &ts.k[0][0] : &ts.q[0][0];
    const int n0 = 8 * (warp & 1);
    float acc[4] = {};
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      uint32_t ahi[4], alo[4], bhi[2], blo[2];
      a_frag(X, kD, 16 * kt, lane, ahi, alo);
      bt_frag(&ts.k[0][0], kD, n0, 16 * kt, lane, bhi, blo);
      mma3(acc, ahi, alo, bhi, blo);
    }
    float (*dst)[kTok + 1] = warp < 2 ? ts.g : ts.h;
    dst[g][n0 + 2 * t] = acc[0];
    dst[g][n0 + 2 * t + 1] = acc[1];
    dst[g + 8][n0 + 2 * t] = acc[2];
    dst[g + 8][n0 + 2 * t + 1] = acc[3];
  }
  if (tid < kTok) {
    float gg = 1.0f;
    for (int l = 0; l <= tid; ++l) gg *= ts.alpha[l];
    ts.decay[tid] = gg;
  }
  __syncthreads();
  for (int e = tid; e < kTok * kTok; e += 128) {  // L' and Q^T (rows: the new tokens j)
    const int j = e >> 4, i = e & 15;
    float r = 1.0f;
    for (int l = i + 1; l <= j; ++l) r *= ts.alpha[l];
    ts.lp[j][i] = i < j && j < m ? ts.beta[j] * r * ts.g[j][i] : 0.0f;
    ts.qmt[j][i] = j >= n && j < m && i <= j ? r * ts.h[j][i] : 0.0f;
  }
  __syncthreads();
  if (warp == 0) {  // (I + L')^-1, lane c: column c
    float a[kTok];
#pragma unroll
    for (int j = 0; j < kTok; ++j) {
      float x = j == lane ? 1.0f : 0.0f;
#pragma unroll
      for (int i = 0; i < j; ++i) x = fmaf(-ts.lp[j][i], a[i], x);
      a[j] = x;
      if (lane < kTok) ts.ainv[j][lane] = x;
    }
  }
  __syncthreads();
  for (int e = tid; e < kTok * kTok; e += 128) {
    const int j = e >> 4, i = e & 15;
    ts.bk[j][i] = ts.ainv[j][i] * ts.beta[i] * ts.decay[i];  // kt = bk K
    ts.bv[j][i] = ts.ainv[j][i] * ts.beta[i];                // vt = bv V
  }
  __syncthreads();
  for (int e = tid; e < kTok * kTok; e += 128) {
    const int j = e >> 4, i = e & 15;
    float pk = 0.0f, pv = 0.0f;
    if (j < n) {
      pk = ts.bk[j][i];
      pv = ts.bv[j][i];
    } else if (j < m) {  // qt_j = g_j q_j - sum Q_lj kt_l, ot_j = sum Q_lj vt_l
#pragma unroll
      for (int l = 0; l < kTok; ++l) {
        pk = fmaf(-ts.qmt[j][l], ts.bk[l][i], pk);
        pv = fmaf(ts.qmt[j][l], ts.bv[l][i], pv);
      }
    }
    ts.pk[j][i] = pk;
    ts.pk[j][kTok + i] = j >= n && j < m && i == j ? ts.decay[j] : 0.0f;
    ts.pv[j][i] = pv;
  }
  __syncthreads();
  // GEMM1's A fragments, A1 = [P_k | P_q] [K; Q]: warp w, k-tiles 2w and 2w + 1.
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int kt1 = 2 * warp + u;
    float c[2][4] = {};
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const int col = gemm1_col(kt1, g >> 1, pair) + (g & 1);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t ahi[4], alo[4], bhi[2], blo[2];
        a_frag(&ts.pk[0][0], 2 * kTok + 1, 16 * kk, lane, ahi, alo);
        b_frag_col(kk == 0 ? &ts.k[0][0] : &ts.q[0][0], kD, col, lane, bhi, blo);
        mma3(c[pair], ahi, alo, bhi, blo);
      }
    }
    uint32_t hi[4], lo[4];
    split_bf16_pair(c[0][0], c[0][1], hi[0], lo[0]);
    split_bf16_pair(c[0][2], c[0][3], hi[1], lo[1]);
    split_bf16_pair(c[1][0], c[1][1], hi[2], lo[2]);
    split_bf16_pair(c[1][2], c[1][3], hi[3], lo[3]);
    *reinterpret_cast<uint4*>(sm.a1[0][kt1][lane]) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(sm.a1[1][kt1][lane]) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  float vo[2][2][4];  // (vt_j, ot_j) = P_v V of the warp's rows
  {
    uint32_t ahi[4], alo[4];
    a_frag(&ts.pv[0][0], kTok + 1, 0, lane, ahi, alo);
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t bhi[2], blo[2];
        b_frag_col(&sm.vo[0][0], kD, first_row + 16 * tile + 8 * half + g, lane, bhi, blo);
        float acc[4] = {};
        mma3(acc, ahi, alo, bhi, blo);
#pragma unroll
        for (int r = 0; r < 4; ++r) vo[tile][half][r] = acc[r];
      }
  }
  for (int e = tid; e < 16 * 32; e += 128) {  // GEMM2's B: the replayed tokens' raw k
    const int j = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
    const int c = gemm2_col(j, lg);
    uint32_t hi[2], lo[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int tok = 2 * lt + 8 * q;
      split_bf16_pair(tok < n ? ts.k[tok][c] : 0.0f, tok + 1 < n ? ts.k[tok + 1][c] : 0.0f, hi[q],
                      lo[q]);
    }
    *reinterpret_cast<uint2*>(sm.b2[0][j][l]) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(sm.b2[1][j][l]) = make_uint2(lo[0], lo[1]);
  }
  if (tid < kTok) {  // checkpoint coefficients R(n - 1, i)
    float r = tid < n ? 1.0f : 0.0f;
    for (int l = tid + 1; l < n; ++l) r *= ts.alpha[l];
    sm.coef[tid] = r;
  }
  if (tid == 0) sm.decay = n > 0 ? ts.decay[n - 1] : 1.0f;
  __syncthreads();
  head_rows(sm, p, state, out, head, first_row, warp, lane, n, m, nullptr, vo);
}

// Persistent form with the rows in registers: kWarps = 8 warps walk the heads (h = blockIdx.x +
// i gridDim.x), each warp loading its 16 rows and the CTA the inputs of head i + 1 before working
// on head i.
template <int kMinCtas>
__global__ void __launch_bounds__(256, kMinCtas)
    replay_mma_walk(__nv_bfloat16* pool, Inputs in, float* out, int n, int m, int heads) {
  __shared__ __align__(16) Smem<8> sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, first_row = 16 * warp;
  int64_t head = blockIdx.x;
  uint4 next[1][2][4];
  load_rows(pool + head * kD * kD + first_row * kD, next, lane);
  InputRegs<8> next_in = load_inputs<8>(in, int(head % kInputSets), tid);
  for (; head < heads; head += gridDim.x) {
    uint4 p[1][2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int b = 0; b < 4; ++b) p[0][half][b] = next[0][half][b];
    __syncthreads();  // every warp is done with the previous head's fragments
    store_inputs(sm, next_in, tid);
    const int64_t after = head + gridDim.x;
    if (after < heads) {
      load_rows(pool + after * kD * kD + first_row * kD, next, lane);
      next_in = load_inputs<8>(in, int(after % kInputSets), tid);
    }
    __syncthreads();
    head_rows(sm, p, pool + head * kD * kD, out, head, first_row, warp, lane, n, m);
  }
}

// Persistent form: a grid of CTAs walks the heads (h = blockIdx.x + i gridDim.x). A warp's 8 KB
// of a head come by one sm_90 bulk copy into the warp's part of a ring of kBufs buffers, issued by
// its lane 0 kBufs - 1 heads ahead, and the next head's inputs are loaded into registers before
// the current head's rows phase.
template <int kBufs>
constexpr int persistent_smem() {
  return 128 + kBufs * 128 * kD * 2;
}
template <int kBufs>
__global__ void __launch_bounds__(128, 1)
    replay_mma_persistent(__nv_bfloat16* pool, Inputs in, float* out, int n, int m, int heads) {
  __shared__ __align__(16) Smem<4> sm;
  extern __shared__ __align__(128) unsigned char dyn[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint64_t* bars = reinterpret_cast<uint64_t*>(dyn);  // [buffer][warp]
  auto buffer = [&](int b) {
    return reinterpret_cast<__nv_bfloat16*>(dyn + 128) + (b * 128 + 32 * warp) * kD;
  };
  auto issue = [&](int64_t head, int b) {  // lane 0: the warp's rows of `head` into buffer b
    if (head < heads)
      dev::bulk_load(buffer(b), pool + head * kD * kD + 32 * warp * kD, 32 * kD * 2,
                     &bars[b * 4 + warp], dev::l2_evict_first_policy());
  };
  const int64_t first = blockIdx.x, step = gridDim.x;
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < kBufs; ++b) dev::mbarrier_init(&bars[b * 4 + warp], 1);
    dev::mbarrier_init_fence();
#pragma unroll
    for (int b = 0; b + 1 < kBufs; ++b) issue(first + b * step, b);
  }
  InputRegs<4> next = load_inputs<4>(in, int(first % kInputSets), tid);
  int64_t head = first;
  for (int i = 0; head < heads; ++i, head += step) {
    const int b = i % kBufs;
    __syncthreads();  // every warp is done with the previous head's fragments
    store_inputs(sm, next, tid);
    // The buffer of head i - 1, whose rows that warp holds in registers, takes head i + kBufs - 1.
    if (lane == 0) issue(head + (kBufs - 1) * step, (i + kBufs - 1) % kBufs);
    if (head + step < heads) next = load_inputs<4>(in, int((head + step) % kInputSets), tid);
    __syncthreads();
    dev::mbarrier_wait(&bars[b * 4 + warp], uint32_t(i / kBufs) & 1u);
    uint4 p[2][2][4];
    load_rows(buffer(b), p, lane);
    __syncwarp();
    dev::fence_proxy_async();  // the reads above before the next bulk copy into this buffer
    head_rows(sm, p, pool + head * kD * kD, out, head, 32 * warp, warp, lane, n, m);
  }
}

// The same bytes in place, no math: kPattern 0 with the MMA kernel's plain loads (a warp
// instruction reads 64 bytes of each of 8 rows), 1 with each warp instruction reading 512
// contiguous bytes, 2 through a bulk-copied buffer (the persistent MMA kernel's way), 3 loads as 0
// and stores as 1, 4 loads as 1 and stores as 0 (each thread then stores other bytes than it
// loaded: a copy within the head).
template <int kPattern>
__global__ void __launch_bounds__(128) copy_kernel(__nv_bfloat16* pool) {
  extern __shared__ __align__(128) unsigned char dyn[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  __nv_bfloat16* state = pool + int64_t(blockIdx.x) * kD * kD;
  auto at = [&](int i, bool linear) {  // element offset of the thread's i-th 16 bytes
    if (linear) return (i * 128 + tid) * 8;
    const int tile = i >> 3, half = (i >> 2) & 1, b = i & 3;
    return (32 * warp + 16 * tile + 8 * half + g) * kD + 32 * b + 8 * t;
  };
  constexpr bool kLinearLoads = kPattern == 1 || kPattern == 4;
  constexpr bool kLinearStores = kPattern == 1 || kPattern == 3;
  const __nv_bfloat16* src = state;
  if constexpr (kPattern == 2) {
    uint64_t* bar = reinterpret_cast<uint64_t*>(dyn) + warp;
    if (lane == 0) {
      dev::mbarrier_init(bar, 1);
      dev::mbarrier_init_fence();
      dev::bulk_load(dyn + 64 + 32 * warp * kD * 2, state + 32 * warp * kD, 32 * kD * 2, bar,
                     dev::l2_evict_first_policy());
    }
    __syncwarp();
    dev::mbarrier_wait(bar, 0u);
    src = reinterpret_cast<const __nv_bfloat16*>(dyn + 64);
  }
  uint4 p[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) p[i] = *reinterpret_cast<const uint4*>(src + at(i, kLinearLoads));
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    uint4 v = p[i];
    v.x ^= 0x00010001u;  // keep the stores from being elided
    *reinterpret_cast<uint4*>(state + at(i, kLinearStores)) = v;
  }
}

static float bf16_to_f(uint16_t v) {
  uint32_t x = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

template <class F>
float median_us(F&& launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int i = 0; i < 33; ++i) {
    CHECK(cudaEventRecord(a));
    launch(i);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) ts.push_back(ms * 1e3f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  const int heads = argc > 1 ? std::atoi(argv[1]) : 4096;
  const size_t state_elems = size_t(heads) * kD * kD;
  // Two pools, alternated, so that no launch finds its state in L2.
  __nv_bfloat16* pools[2];
  for (auto& p : pools) CHECK(cudaMalloc(&p, state_elems * 2));
  std::vector<uint16_t> h_state(state_elems);
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  auto uni = [&]() {  // [-1, 1)
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return float((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
  };
  for (auto& v : h_state) {
    const float f = 0.05f * uni();
    uint32_t x;
    std::memcpy(&x, &f, 4);
    v = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
  for (auto& p : pools)
    CHECK(cudaMemcpy(p, h_state.data(), state_elems * 2, cudaMemcpyHostToDevice));

  std::vector<float> a1(size_t(kInputSets) * kTok * kD), vo(a1.size()), k2(a1.size()),
      coef(kInputSets * kTok), decay(kInputSets);
  for (auto& x : a1) x = 0.15f * uni();
  for (auto& x : vo) x = uni();
  for (auto& x : k2) x = 0.15f * uni();
  for (auto& x : coef) x = 0.5f + 0.5f * uni() * uni();
  for (auto& x : decay) x = 0.75f + 0.25f * uni() * uni();
  auto upload = [](const std::vector<float>& h) {
    float* d;
    CHECK(cudaMalloc(&d, h.size() * 4));
    CHECK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
  };
  float *d_a1 = upload(a1), *d_vo = upload(vo), *d_k2 = upload(k2), *d_coef = upload(coef),
        *d_decay = upload(decay);
  float* d_out;
  CHECK(cudaMalloc(&d_out, size_t(heads) * kTok * kD * 4));
  const Inputs in{d_a1, d_vo, d_k2, d_coef, d_decay};

  // Copy bandwidth of the device (read + write of one pool's bytes).
  const float memcpy_us = median_us([&](int i) {
    CHECK(cudaMemcpyAsync(pools[i & 1], pools[(i + 1) & 1], state_elems * 2,
                          cudaMemcpyDeviceToDevice));
  });
  const double bytes = 2.0 * state_elems * 2;  // read + write
  constexpr int kBulkSmem = 64 + 128 * kD * 2;
  CHECK(
      cudaFuncSetAttribute(copy_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Variant {
    const char* name;
    void (*kernel)(__nv_bfloat16*, Inputs, float*, int, int, int);
    int ctas_per_sm, smem;  // 0: one CTA per head
    int threads;
    bool bulk;  // the state comes by bulk copies (else plain loads)
  };
  const Variant variants[] = {
      {"plain", replay_mma_kernel<4, 1>, 0, 0, 128, false},
      {"plain x4", replay_mma_kernel<4, 4>, 0, 0, 128, false},
      {"plain x5", replay_mma_kernel<4, 5>, 0, 0, 128, false},
      {"w8", replay_mma_kernel<8, 1>, 0, 0, 256, false},
      {"w8 x3", replay_mma_kernel<8, 3>, 0, 0, 256, false},
      {"w8 x4", replay_mma_kernel<8, 4>, 0, 0, 256, false},
      {"w8 hints", replay_mma_kernel<8, 1, true>, 0, 0, 256, false},
      {"w8 bulk", replay_mma_bulk_kernel<1>, 0, kBulkRowsSmem, 256, true},
      {"w8 bulk x3", replay_mma_bulk_kernel<3>, 0, kBulkRowsSmem, 256, true},
      {"w8 walk x1", replay_mma_walk<1>, 1, 0, 256, false},
      {"w8 walk x2", replay_mma_walk<2>, 2, 0, 256, false},
      {"ring2 x2", replay_mma_persistent<2>, 2, persistent_smem<2>(), 128, true},
      {"ring5 x1", replay_mma_persistent<5>, 1, persistent_smem<5>(), 128, true},
  };
  for (const auto& v : variants)
    CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
  auto launch = [&](const Variant& v, __nv_bfloat16* pool, int n, int m) {
    const int grid = v.ctas_per_sm ? std::min(heads, v.ctas_per_sm * sms) : heads;
    v.kernel<<<grid, v.threads, v.smem>>>(pool, in, d_out, n, m, heads);
  };
  const float copy_us = median_us([&](int i) { copy_kernel<0><<<heads, 128>>>(pools[i & 1]); });
  const float linear_us = median_us([&](int i) { copy_kernel<1><<<heads, 128>>>(pools[i & 1]); });
  const float bulk_us =
      median_us([&](int i) { copy_kernel<2><<<heads, 128, kBulkSmem>>>(pools[i & 1]); });
  const float rl_us = median_us([&](int i) { copy_kernel<3><<<heads, 128>>>(pools[i & 1]); });
  const float lr_us = median_us([&](int i) { copy_kernel<4><<<heads, 128>>>(pools[i & 1]); });
  std::printf(
      "heads %d, bf16 state: memcpy %.1f us (%.2f TB/s); in-place copy kernels: row "
      "pattern %.1f us (%.1f %% of memcpy), linear %.1f us (%.1f %%), bulk %.1f us (%.1f %%), "
      "row loads + linear stores %.1f us (%.1f %%), linear loads + row stores %.1f us "
      "(%.1f %%)\n",
      heads, memcpy_us, bytes / memcpy_us * 1e-6, copy_us, 100.0 * memcpy_us / copy_us, linear_us,
      100.0 * memcpy_us / linear_us, bulk_us, 100.0 * memcpy_us / bulk_us, rl_us,
      100.0 * memcpy_us / rl_us, lr_us, 100.0 * memcpy_us / lr_us);

  const int cases[][2] = {{4, 1}, {4, 2}, {4, 4}, {2, 2}, {8, 4}, {8, 8}};  // T, n
  bool all_ok = true;
  // One launch on a fresh pool with a poisoned output, then check(head, set, new state, o) on
  // `sampled` heads spread over the pool.
  auto launch_and_fetch = [&](auto&& launch_once, int sampled, auto&& check) {
    CHECK(cudaMemcpy(pools[0], h_state.data(), state_elems * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(d_out, 0xff, size_t(heads) * kTok * kD * 4));
    launch_once();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> s_new(kD * kD);
    std::vector<float> o(kTok * kD);
    for (int hh = 0; hh < sampled; ++hh) {
      const int64_t head = (int64_t(hh) * 2654435761u) % heads;
      CHECK(
          cudaMemcpy(s_new.data(), pools[0] + head * kD * kD, kD * kD * 2, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(o.data(), d_out + head * kTok * kD, kTok * kD * 4, cudaMemcpyDeviceToHost));
      check(head, int(head % kInputSets), s_new, o);
    }
  };
  const char* only = std::getenv("PROBE_ONLY");  // one variant, T = 4, n = 2 (for a profiler)
  const bool solve_only = std::getenv("PROBE_SOLVE_ONLY") != nullptr;  // the whole closed form only
  for (const auto& c : cases)
    for (const auto& v : variants) {
      const int T = c[0], n = c[1], m = n + T;
      if (solve_only || (only && (std::strcmp(only, v.name) != 0 || T != 4 || n != 2))) continue;
      // Correctness: a float64 evaluation of the same formulas on 16 heads.
      double worst_s = 0, worst_o = 0;
      launch_and_fetch(
          [&] { launch(v, pools[0], n, m); }, 16,
          [&](int64_t head, int set, const std::vector<uint16_t>& s_new,
              const std::vector<float>& o) {
            const uint16_t* s0 = h_state.data() + head * kD * kD;
            const float* A = a1.data() + size_t(set) * kTok * kD;
            const float* V = vo.data() + size_t(set) * kTok * kD;
            const float* K = k2.data() + size_t(set) * kTok * kD;
            for (int r = 0; r < kD; ++r) {
              double wv[kTok] = {};
              for (int j = 0; j < m; ++j) {
                double d = 0;
                for (int col = 0; col < kD; ++col)
                  d += double(bf16_to_f(s0[r * kD + col])) * A[j * kD + col];
                if (j < n) {
                  wv[j] = coef[set * kTok + j] * (V[j * kD + r] - d);
                } else {
                  const double ref = d + V[j * kD + r];
                  worst_o =
                      std::max(worst_o, std::fabs(o[j * kD + r] - ref) / (std::fabs(ref) + 1e-3));
                }
              }
              if (n == 0) continue;
              for (int col = 0; col < kD; ++col) {
                double x = decay[set] * double(bf16_to_f(s0[r * kD + col]));
                for (int i = 0; i < n; ++i) x += wv[i] * K[i * kD + col];
                const double got = bf16_to_f(s_new[r * kD + col]);
                worst_s = std::max(worst_s, std::fabs(got - x) / (std::fabs(x) + 1e-2));
              }
            }
          });
      // bf16 checkpoint: one rounding (2^-9 relative) plus the split products' 2^-16.
      const bool ok = worst_s < 6e-3 && worst_o < 5e-4;
      all_ok = all_ok && ok;
      const float us = median_us([&](int i) { launch(v, pools[i & 1], n, m); });
      CHECK(cudaGetLastError());
      std::printf(
          "T %d n %d %-10s: %.1f us = %.1f %% of memcpy, %.1f %% of its copy kernel "
          "(checkpoint rel err %.2e, o rel err %.2e: %s)\n",
          T, n, v.name, us, 100.0 * memcpy_us / us, 100.0 * (v.bulk ? bulk_us : copy_us) / us,
          worst_s, worst_o, ok ? "ok" : "FAIL");
    }

  // The closed form whole (staging, prepare_replay, fragments, rows) against a float64
  // token-by-token replay of the raw window.
  std::vector<float> rk(a1.size()), rq(a1.size()), rv(a1.size()), ralpha(coef.size()),
      rbeta(coef.size());
  auto unit = [&](float* x, float norm) {
    double ss = 0;
    for (int c = 0; c < kD; ++c) ss += double(x[c]) * x[c];
    for (int c = 0; c < kD; ++c) x[c] = float(x[c] * norm / std::sqrt(ss));
  };
  for (size_t r = 0; r < size_t(kInputSets) * kTok; ++r) {
    for (int c = 0; c < kD; ++c) {
      rk[r * kD + c] = uni();
      rq[r * kD + c] = uni();
      rv[r * kD + c] = uni();
    }
    unit(&rk[r * kD], 1.0f);
    unit(&rq[r * kD], 1.0f / std::sqrt(float(kD)));
    ralpha[r] = 0.9f + 0.1f * uni();
    rbeta[r] = 0.55f + 0.35f * uni();
  }
  const RawInputs raw{upload(rk), upload(rq), upload(rv), upload(ralpha), upload(rbeta)};
  struct SolveVariant {
    const char* name;
    void (*kernel)(__nv_bfloat16*, RawInputs, float*, int, int, int);
    int smem;
  };
  const SolveVariant solve_variants[] = {
      {"solve", replay_mma_solve_kernel<1>, 0},
      {"solve x4", replay_mma_solve_kernel<4>, 0},
      {"solve4 par", replay_mma_solve_kernel<4, true>, 0},
      {"tc solve", replay_mma_tc_solve_kernel<1>, int(sizeof(TcSolveSmem))},
      {"tc solve x3", replay_mma_tc_solve_kernel<3>, int(sizeof(TcSolveSmem))},
      {"tc solve x4", replay_mma_tc_solve_kernel<4>, int(sizeof(TcSolveSmem))}};
  for (const auto& v : solve_variants)
    CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
  for (const auto& c : cases)
    for (const auto& v : solve_variants) {
      const int T = c[0], n = c[1], m = n + T;
      if (only && (std::strcmp(only, v.name) != 0 || T != 4 || n != 2)) continue;
      double worst_s = 0, worst_o = 0;
      auto launch_once = [&] {
        v.kernel<<<heads, 128, v.smem>>>(pools[0], raw, d_out, n, m, heads);
      };
      launch_and_fetch(launch_once, 8,
                       [&](int64_t head, int set, const std::vector<uint16_t>& s_new,
                           const std::vector<float>& o) {
                         std::vector<double> S(kD * kD), ck;
                         for (int e = 0; e < kD * kD; ++e)
                           S[e] = bf16_to_f(h_state[head * kD * kD + e]);
                         const size_t b = size_t(set) * kTok;
                         for (int j = 0; j < m; ++j) {
                           const float* k = &rk[(b + j) * kD];
                           for (int r = 0; r < kD; ++r) {
                             double* row = &S[r * kD];
                             double u = 0;
                             for (int col = 0; col < kD; ++col)
                               u += (row[col] *= ralpha[b + j]) * k[col];
                             const double d = rbeta[b + j] * (rv[(b + j) * kD + r] - u);
                             for (int col = 0; col < kD; ++col) row[col] += d * k[col];
                             if (j >= n) {
                               double ov = 0;
                               for (int col = 0; col < kD; ++col)
                                 ov += row[col] * rq[(b + j) * kD + col];
                               worst_o = std::max(
                                   worst_o, std::fabs(o[j * kD + r] - ov) / (std::fabs(ov) + 1e-3));
                             }
                           }
                           if (j == n - 1) ck = S;
                         }
                         for (int e = 0; e < kD * kD; ++e)
                           worst_s = std::max(worst_s, std::fabs(bf16_to_f(s_new[e]) - ck[e]) /
                                                           (std::fabs(ck[e]) + 1e-2));
                       });
      const bool ok = worst_s < 6e-3 && worst_o < 1e-3;
      all_ok = all_ok && ok;
      const float us = median_us(
          [&](int i) { v.kernel<<<heads, 128, v.smem>>>(pools[i & 1], raw, d_out, n, m, heads); });
      CHECK(cudaGetLastError());
      std::printf(
          "T %d n %d %-10s: %.1f us = %.1f %% of memcpy, %.1f %% of its copy kernel "
          "(checkpoint rel err %.2e, o rel err %.2e against float64 token by token: %s)\n",
          T, n, v.name, us, 100.0 * memcpy_us / us, 100.0 * copy_us / us, worst_s, worst_o,
          ok ? "ok" : "FAIL");
    }
  return all_ok ? 0 : 1;
}
