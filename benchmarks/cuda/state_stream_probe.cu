// Memory-pattern probe for the decode_mtp state stream (H200 tuning aid, not part of the library).
//
// Every variant does the T = 1 update of decode_mtp on a pool of heads x 128 x 128 states in place
// (decay, u = S k, delta rule, o = S q; the real per-group math, no norm) and differs only in how a
// head's rows reach the registers: plain loads into registers (FLA's way, small CTAs), or sm_90
// bulk copies into shared-memory chunk buffers (the library's kernel). Reports us and % of a
// device-to-device copy of the same bytes, median of 30 launches, alternating between two pools
// so that no launch finds its state in L2.
//
//   nvcc -std=c++20 -O3 -arch=sm_90a -Iinclude benchmarks/cuda/state_stream_probe.cu -o probe
//   ./probe [heads=4096]    (PROBE_OUT_OF_PLACE=1: every variant also writes to a second pool;
//                            PROBE_TOKENS=1: T = 4 and a cluster-free norm, tokens_kernel)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gdn/core/cuda/device.cuh"
#include "probe_util.cuh"

namespace dev = gdn::cuda;
constexpr int kD = 128;

struct Vecs {
  const float* k;  // [128] unit
  const float* q;  // [128]
  float* out;      // [heads][128]
};

// The T = 1 update of 8 rows held by a warp (lane: columns 4l..4l+3), o of row (lane>>2)&7.
__device__ __forceinline__ float update8(float4 (&s)[8], float4 kt, float4 qt, int lane) {
  const float alpha = 0.97f, beta = 0.6f, v = 0.1f;
  float p[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s[i].x *= alpha;
    s[i].y *= alpha;
    s[i].z *= alpha;
    s[i].w *= alpha;
    p[i] = s[i].x * kt.x + s[i].y * kt.y + s[i].z * kt.z + s[i].w * kt.w;
  }
  const float u = dev::transpose_reduce(p, lane);
  const float dm = beta * (v - u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float d = __shfl_sync(0xffffffffu, dm, 4 * i);
    s[i].x += kt.x * d;
    s[i].y += kt.y * d;
    s[i].z += kt.z * d;
    s[i].w += kt.w * d;
    p[i] = s[i].x * qt.x + s[i].y * qt.y + s[i].z * qt.z + s[i].w * qt.w;
  }
  return dev::transpose_reduce(p, lane);
}

// Plain loads: a CTA of kWarps warps owns kRows rows of one head; a warp walks groups of 8 rows,
// (kPrefetch: the next group's loads issued before the current group's math; kRotate: CTA i starts
// its walk at step i mod steps, so that CTAs running at once touch every offset in their rows).
template <class T, int kRows, int kWarps, bool kPrefetch, int kMinBlocks, int kHint = 1,
          bool kRotate = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    direct_kernel(const T* pool, T* dst_pool, Vecs vec) {
  using Bits = dev::StateBits<T>;
  using Raw = typename Bits::Raw;
  constexpr int kCtasPerHead = kD / kRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t head = blockIdx.x / kCtasPerHead;
  const int row0 = (blockIdx.x % kCtasPerHead) * kRows;
  const T* base = pool + head * kD * kD + 4 * lane;
  T* dbase = dst_pool + head * kD * kD + 4 * lane;
  const float4 kt = reinterpret_cast<const float4*>(vec.k)[lane];
  const float4 qt = reinterpret_cast<const float4*>(vec.q)[lane];
  constexpr int kGroups = kRows / 8;
  constexpr int kSteps = kGroups / kWarps > 0 ? kGroups / kWarps : 1;
  const int start = kRotate ? int(blockIdx.x % kSteps) : 0;
  auto at = [&](int g) {  // the group walked at this warp's step (g - warp) / kWarps
    return warp + ((g - warp) / kWarps + start) % kSteps * kWarps;
  };
  Raw next[8];
  auto load = [&](int g, Raw(&r)[8]) {
    g = at(g);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      r[i] = kHint ? __ldcs(reinterpret_cast<const Raw*>(base + (row0 + g * 8 + i) * kD))
                   : *reinterpret_cast<const Raw*>(base + (row0 + g * 8 + i) * kD);
  };
  if (kPrefetch && warp < kGroups) load(warp, next);
  for (int g = warp; g < kGroups; g += kWarps) {
    Raw cur[8];
    if (kPrefetch) {
#pragma unroll
      for (int i = 0; i < 8; ++i) cur[i] = next[i];
      if (g + kWarps < kGroups) load(g + kWarps, next);
    } else {
      load(g, cur);
    }
    float4 s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = Bits::to_f32(cur[i]);
    const float o = update8(s, kt, qt, lane);
    const int gw = at(g);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (kHint)
        Bits::store_streaming(dbase + (row0 + gw * 8 + i) * kD, Bits::from_f32(s[i]));
      else
        *reinterpret_cast<Raw*>(dbase + (row0 + gw * 8 + i) * kD) = Bits::from_f32(s[i]);
    if ((lane & 3) == 0) vec.out[head * kD + row0 + gw * 8 + ((lane >> 2) & 7)] = o;
  }
}

// T tokens and the gated RMSNorm's reduction (plain loads, no prefetch): a CTA of kWarps warps owns
// kRows rows of one head and walks its groups; after each of kTokens updates a group's rows go to
// that token's destination pool (dst + t * pool_elems; T = 1 writes in place). kTicketNorm (one
// token, kRows < 128): the head's CTAs add sum(o^2) through a workspace without a cluster: each
// writes its partial and its unnormalised o, takes a ticket, and the head's last CTA scales the
// head's 128 outputs by the rstd of the sum.
struct NormWork {
  float* partial;  // [heads][CTAs per head]
  int* ticket;     // [heads], zero between launches
};
template <class T, int kRows, int kWarps, int kMinBlocks, int kTokens, bool kTicketNorm,
          bool kGridStride = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    tokens_kernel(const T* pool, T* dst, int64_t pool_elems, Vecs vec, NormWork work) {
  using Bits = dev::StateBits<T>;
  using Raw = typename Bits::Raw;
  constexpr int kCtasPerHead = kD / kRows;
  static_assert(!kTicketNorm || (kTokens == 1 && kCtasPerHead > 1), "one token, a split head");
  __shared__ float group_sq[kRows / 8];
  __shared__ float rstd_s;
  __shared__ bool last_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t head = blockIdx.x / kCtasPerHead;
  const int rank = blockIdx.x % kCtasPerHead, row0 = rank * kRows;
  const float4 kt = reinterpret_cast<const float4*>(vec.k)[lane];
  const float4 qt = reinterpret_cast<const float4*>(vec.q)[lane];
  for (int g = warp; g < kRows / 8; g += kWarps) {
    // kGridStride: the warp's walk steps through the whole pool by the grid's width, so that the
    // warps running at once read one dense stretch of it (the rows and outputs it updates are
    // then not the CTA's head; only the bytes are timed).
    const int64_t flat = kGridStride ? (int64_t(blockIdx.x) * kWarps + warp) +
                                           int64_t(g / kWarps) * gridDim.x * kWarps
                                     : 0;
    const int64_t at = kGridStride ? flat * 8 * kD + 4 * lane
                                   : head * kD * kD + int64_t(row0 + g * 8) * kD + 4 * lane;
    float4 s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      s[i] = Bits::to_f32(*reinterpret_cast<const Raw*>(pool + at + i * kD));
    for (int t = 0; t < kTokens; ++t) {
      const float o = update8(s, kt, qt, lane);
      T* out_rows = kTokens == 1 ? const_cast<T*>(pool) + at : dst + t * pool_elems + at;
#pragma unroll
      for (int i = 0; i < 8; ++i) *reinterpret_cast<Raw*>(out_rows + i * kD) = Bits::from_f32(s[i]);
      const int row = row0 + g * 8 + ((lane >> 2) & 7);
      if ((lane & 3) == 0)
        vec.out[kGridStride ? flat * 8 + ((lane >> 2) & 7) : head * kD + row] = o;
      if (kTicketNorm) {
        float sq = (lane & 3) == 0 ? o * o : 0.0f;
        sq += __shfl_xor_sync(0xffffffffu, sq, 4);
        sq += __shfl_xor_sync(0xffffffffu, sq, 8);
        sq += __shfl_xor_sync(0xffffffffu, sq, 16);
        if (lane == 0) group_sq[g] = sq;
      }
    }
  }
  if constexpr (kTicketNorm) {
    __syncthreads();  // every group's partial and o written
    if (threadIdx.x == 0) {
      float part = 0.0f;
      for (int g = 0; g < kRows / 8; ++g) part += group_sq[g];
      work.partial[head * kCtasPerHead + rank] = part;
      __threadfence();  // this CTA's o and partial before its ticket
      last_s = atomicAdd(work.ticket + head, 1) == kCtasPerHead - 1;
      if (last_s) {
        __threadfence();
        float total = 0.0f;
        for (int c = 0; c < kCtasPerHead; ++c)
          total += __ldcg(work.partial + head * kCtasPerHead + c);
        rstd_s = rsqrtf(total / kD + 1e-6f);
        work.ticket[head] = 0;
      }
    }
    __syncthreads();
    if (last_s)
      for (int r = threadIdx.x; r < kD; r += kWarps * 32)
        vec.out[head * kD + r] = __ldcg(vec.out + head * kD + r) * rstd_s;
  }
}

// Bulk copies: one 128-thread CTA per head, 4 chunks of 32 rows through kBuf shared buffers
// (kRotate: CTA i takes the chunks from chunk i mod 4 on). kStore (kBuf = 4): the updated rows go
// back to their buffer and leave by bulk stores instead of each lane's stores: 1 = one per chunk
// as soon as its 4 warps are done, 2 = the whole head at once after the last chunk.
template <class T, int kBuf, int kMinBlocks, bool kRotate = false, int kStore = 0>
__global__ void __launch_bounds__(128, kMinBlocks)
    bulk_kernel(const T* pool, T* dst_pool, Vecs vec) {
  using Bits = dev::StateBits<T>;
  using Raw = typename Bits::Raw;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
  T* tile = reinterpret_cast<T*>(smem + 128);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head = blockIdx.x;
  const T* src = pool + head * kD * kD;
  constexpr int kChunk = 32 * kD;
  if (tid == 0) {
    for (int c = 0; c < kBuf; ++c) dev::mbarrier_init(&bars[c], 1);
    dev::mbarrier_init_fence();
  }
  __syncthreads();
  const uint64_t policy = tid == 0 ? dev::l2_evict_first_policy() : 0;
  const int start = kRotate ? int(blockIdx.x % 4) : 0;
  auto issue = [&](int c) {
    dev::bulk_load(tile + (c % kBuf) * kChunk, src + (c + start) % 4 * kChunk, kChunk * sizeof(T),
                   &bars[c % kBuf], policy);
  };
  if (tid == 0)
    for (int c = 0; c < kBuf; ++c) issue(c);
  const float4 kt = reinterpret_cast<const float4*>(vec.k)[lane];
  const float4 qt = reinterpret_cast<const float4*>(vec.q)[lane];
  for (int c = 0; c < 4; ++c) {
    dev::mbarrier_wait(&bars[c % kBuf], uint32_t(c / kBuf) & 1u);
    float4 s[8];
    const T* rows = tile + (c % kBuf) * kChunk + warp * 8 * kD + 4 * lane;
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = Bits::to_f32(*reinterpret_cast<const Raw*>(rows + i * kD));
    if (c + kBuf < 4) {
      __syncthreads();
      if (tid == 0) {
        dev::fence_proxy_async();
        issue(c + kBuf);
      }
    }
    const float o = update8(s, kt, qt, lane);
    const int cw = (c + start) % 4;
    if constexpr (kStore == 0) {
      T* dst = dst_pool + head * kD * kD + cw * kChunk + warp * 8 * kD + 4 * lane;
#pragma unroll
      for (int i = 0; i < 8; ++i) Bits::store_streaming(dst + i * kD, Bits::from_f32(s[i]));
    } else {
      static_assert(kStore == 0 || kBuf == 4, "bulk stores keep every chunk in its buffer");
      T* back = const_cast<T*>(rows);
#pragma unroll
      for (int i = 0; i < 8; ++i) *reinterpret_cast<Raw*>(back + i * kD) = Bits::from_f32(s[i]);
      dev::fence_proxy_async();  // these writes before the bulk store reads them
      if (kStore == 1) {
        __syncthreads();
        if (tid == 0)
          bulk_store(dst_pool + head * kD * kD + cw * kChunk, tile + c * kChunk,
                     kChunk * sizeof(T));
      }
    }
    if ((lane & 3) == 0) vec.out[head * kD + cw * 32 + warp * 8 + ((lane >> 2) & 7)] = o;
  }
  if constexpr (kStore != 0) {
    static_assert(kStore != 2 || !kRotate, "the whole head leaves in chunk order");
    if (kStore == 2) {
      __syncthreads();
      if (tid == 0) bulk_store(dst_pool + head * kD * kD, tile, 4 * kChunk * sizeof(T));
    }
    if (tid == 0) bulk_store_wait_read();
  }
}

// Plain loads, one warp per 8 rows, and a cluster of 16 / kWarps CTAs per head for the norm: every
// CTA sends its rows' o and its share of sum(o^2) into the leader CTA's shared memory and arrives
// on the leader's mbarrier; only the leader waits, then writes the normalised head.
template <class T, int kWarps, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    cluster_kernel(const T* pool, T* dst_pool, Vecs vec) {
  using Bits = dev::StateBits<T>;
  using Raw = typename Bits::Raw;
  __shared__ __align__(16) float o_s[kD];
  __shared__ float ss_s[16];
  __shared__ __align__(8) uint64_t bar;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = blockIdx.x * kWarps + warp;  // group of 8 rows in the grid
  const int64_t head = gid / 16;
  const int g = gid % 16;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (rank == 0 && threadIdx.x == 0) {
    dev::mbarrier_init(&bar, 16 / kWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  dev::cluster_arrive_relaxed();
  const T* base = pool + head * kD * kD + g * 8 * kD + 4 * lane;
  T* dbase = dst_pool + head * kD * kD + g * 8 * kD + 4 * lane;
  Raw cur[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) cur[i] = *reinterpret_cast<const Raw*>(base + i * kD);
  const float4 kt = reinterpret_cast<const float4*>(vec.k)[lane];
  const float4 qt = reinterpret_cast<const float4*>(vec.q)[lane];
  float4 s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = Bits::to_f32(cur[i]);
  const float o = update8(s, kt, qt, lane);
#pragma unroll
  for (int i = 0; i < 8; ++i) *reinterpret_cast<Raw*>(dbase + i * kD) = Bits::from_f32(s[i]);
  float sq = o * o;
  sq += __shfl_xor_sync(0xffffffffu, sq, 4);
  sq += __shfl_xor_sync(0xffffffffu, sq, 8);
  sq += __shfl_xor_sync(0xffffffffu, sq, 16);
  dev::cluster_wait();
  float* o_leader = const_cast<float*>(dev::cluster_peer(o_s, 0));
  float* ss_leader = const_cast<float*>(dev::cluster_peer(ss_s, 0));
  if ((lane & 3) == 0) o_leader[g * 8 + (lane >> 2)] = o;
  if (lane == 0) ss_leader[g] = sq;
  if (kWarps > 1) __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t remote = dev::cluster_shared_address(&bar, 0);
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote)
                 : "memory");
  }
  if (rank != 0) return;
  asm volatile(
      "{\n.reg .pred done;\nWAITC:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAITC;\n}\n" ::"r"(dev::shared_address(&bar))
      : "memory");
  float total = 0.0f;
  for (int i = 0; i < 16; ++i) total += ss_s[i];
  const float rstd = rsqrtf(total / kD + 1e-6f);
  for (int r = threadIdx.x; r < kD; r += kWarps * 32) vec.out[head * kD + r] = o_s[r] * rstd;
}

template <class F>
float median_us(F&& launch, void* pools[2]) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 6; ++i) launch(pools[i & 1]);
  std::vector<float> t;
  for (int i = 0; i < 30; ++i) {
    CHECK(cudaEventRecord(a));
    launch(pools[i & 1]);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0f);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class T>
void run(const char* dtype, int64_t heads, Vecs vec) {
  const size_t bytes = size_t(heads) * kD * kD * sizeof(T);
  void* pools[2];
  void* copy_dst;
  for (auto& p : pools) {
    CHECK(cudaMalloc(&p, bytes));
    CHECK(cudaMemset(p, 0x3c, bytes));  // finite, nonzero
  }
  CHECK(cudaMalloc(&copy_dst, bytes));
  CHECK(cudaMalloc(&vec.out, size_t(heads) * kD * 4));
  const float copy = median_us(
      [&](void* p) { CHECK(cudaMemcpyAsync(copy_dst, p, bytes, cudaMemcpyDeviceToDevice)); },
      pools);
  std::printf("%s heads=%lld bytes r+w=%.1f MB copy %.2f us (%.2f TB/s)\n", dtype, (long long)heads,
              2.0 * bytes / 1e6, copy, 2.0 * bytes / copy / 1e6);
  bool out_of_place = false;
  auto report = [&](const char* name, float us) {
    std::printf("  %s %-34s %8.2f us  %5.1f %% copy\n",
                out_of_place ? "out-of-place" : "in-place   ", name, us, 100.0f * copy / us);
  };
#define DIRECT_R(R, W, P, M, H, ROT)                                                         \
  report("direct rows=" #R " warps=" #W " pf=" #P " minb=" #M " hint=" #H " rotate=" #ROT,   \
         median_us(                                                                          \
             [&](void* p) {                                                                  \
               direct_kernel<T, R, W, P, M, H, ROT><<<unsigned(heads * (kD / R)), W * 32>>>( \
                   static_cast<T*>(p),                                                       \
                   out_of_place ? static_cast<T*>(copy_dst) : static_cast<T*>(p), vec);      \
             },                                                                              \
             pools));
#define DIRECT(R, W, P, M, H) DIRECT_R(R, W, P, M, H, false)
  for (int mode = 0; mode < (std::getenv("PROBE_OUT_OF_PLACE") ? 2 : 1); ++mode) {
    out_of_place = mode == 1;
    DIRECT(8, 1, false, 32, 0)
    // Warps per SM against CTA size: one-warp CTAs at 24 and 16 warps per SM, four-warp CTAs at
    // 32, a warp walking four groups alone or in a CTA of two.
    DIRECT(8, 1, false, 24, 0)
    DIRECT(8, 1, false, 16, 0)
    DIRECT(32, 1, false, 32, 0)
    DIRECT(64, 2, false, 16, 0)
    DIRECT(32, 4, false, 8, 0)
    DIRECT(128, 4, false, 8, 0)
    DIRECT(32, 4, false, 6, 0)
    // A head per 4-warp CTA, each warp walking 4 groups with the next group's loads in flight.
    DIRECT(128, 4, true, 4, 0)
    DIRECT(128, 4, true, 4, 1)
    DIRECT(128, 4, true, 6, 0)
    DIRECT(128, 4, false, 6, 0)
#define BULK_S(NB, M, ROT, ST)                                                            \
  {                                                                                       \
    const int smem = 128 + NB * 32 * kD * int(sizeof(T));                                 \
    CHECK(cudaFuncSetAttribute(bulk_kernel<T, NB, M, ROT, ST>,                            \
                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem));       \
    report("bulk buffers=" #NB " minb=" #M " rotate=" #ROT " store=" #ST,                 \
           median_us(                                                                     \
               [&](void* p) {                                                             \
                 bulk_kernel<T, NB, M, ROT, ST><<<unsigned(heads), 128, smem>>>(          \
                     static_cast<T*>(p),                                                  \
                     out_of_place ? static_cast<T*>(copy_dst) : static_cast<T*>(p), vec); \
               },                                                                         \
               pools));                                                                   \
  }
#define BULK_R(NB, M, ROT) BULK_S(NB, M, ROT, 0)
#define BULK(NB, M) BULK_R(NB, M, false)
    BULK(3, 4)
    BULK(2, 6)
    // Walks that start at a different step in every CTA.
    DIRECT_R(32, 1, false, 32, 0, true)
    DIRECT_R(128, 4, false, 8, 0, true)
    DIRECT_R(128, 4, true, 4, 0, true)
    BULK_R(3, 4, true)
    BULK_R(4, 3, true)
    // The state leaving by bulk stores: chunk by chunk, or the whole head at once.
    BULK_S(4, 3, false, 1)
    BULK_S(4, 3, false, 2)

#define CLUSTER(W, M)                                                                     \
  {                                                                                       \
    auto kern = cluster_kernel<T, W, M>;                                                  \
    CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1)); \
    report("cluster warps=" #W " minb=" #M,                                               \
           median_us(                                                                     \
               [&](void* p) {                                                             \
                 cudaLaunchConfig_t cfg{};                                                \
                 cfg.gridDim = dim3(unsigned(heads * 16 / W));                            \
                 cfg.blockDim = dim3(W * 32);                                             \
                 cudaLaunchAttribute at[1];                                               \
                 at[0].id = cudaLaunchAttributeClusterDimension;                          \
                 at[0].val.clusterDim.x = 16 / W;                                         \
                 at[0].val.clusterDim.y = 1;                                              \
                 at[0].val.clusterDim.z = 1;                                              \
                 cfg.attrs = at;                                                          \
                 cfg.numAttrs = 1;                                                        \
                 CHECK(cudaLaunchKernelEx(&cfg, kern, static_cast<const T*>(p),           \
                                          static_cast<T*>(p), vec));                      \
               },                                                                         \
               pools));                                                                   \
  }
    BULK(4, 3)
  }
  // Tokens and the ticket norm (PROBE_TOKENS=1): T = 4 writes four destination pools, against a
  // copy of the same bytes (copy time x (1 + T) / 2).
  if (std::getenv("PROBE_TOKENS")) {
    void* dsts;
    CHECK(cudaMalloc(&dsts, 4 * bytes));
    NormWork work{};
    CHECK(cudaMalloc(&work.partial, size_t(heads) * 16 * 4));
    CHECK(cudaMalloc(&work.ticket, size_t(heads) * 4));
    CHECK(cudaMemset(work.ticket, 0, size_t(heads) * 4));
    const int64_t elems = heads * kD * kD;
#define TOKENS_G(R, W, M, TT, NORM, GS)                                                    \
  {                                                                                        \
    const float us = median_us(                                                            \
        [&](void* p) {                                                                     \
          tokens_kernel<T, R, W, M, TT, NORM, GS><<<unsigned(heads * (kD / R)), W * 32>>>( \
              static_cast<const T*>(p), static_cast<T*>(dsts), elems, vec, work);          \
        },                                                                                 \
        pools);                                                                            \
    std::printf(                                                                           \
        "  T=%d rows=%-3d warps=%d minb=%-2d ticket-norm=%d grid-stride=%d %8.2f us"       \
        "  %5.1f %% copy\n",                                                               \
        TT, R, W, M, int(NORM), int(GS), us, 100.0f * copy * (1 + TT) / 2 / us);           \
  }
#define TOKENS(R, W, M, TT, NORM) TOKENS_G(R, W, M, TT, NORM, false)
    TOKENS(8, 1, 32, 1, false)
    TOKENS(32, 1, 32, 1, false)
    TOKENS_G(32, 1, 32, 1, false, true)
    TOKENS_G(128, 4, 6, 1, false, true)
    TOKENS(32, 4, 8, 1, false)
    TOKENS(32, 4, 8, 1, true)
    TOKENS(64, 4, 8, 1, true)
    TOKENS(128, 4, 6, 1, false)
    TOKENS(8, 1, 32, 4, false)
    TOKENS(32, 4, 8, 4, false)
    TOKENS(128, 4, 6, 4, false)
    CHECK(cudaFree(dsts));
    CHECK(cudaFree(work.partial));
    CHECK(cudaFree(work.ticket));
  }
  for (auto& p : pools) CHECK(cudaFree(p));
  CHECK(cudaFree(copy_dst));
  CHECK(cudaFree(vec.out));
}

int main(int argc, char** argv) {
  const int64_t heads = argc > 1 ? std::atoll(argv[1]) : 4096;
  std::vector<float> hk(kD), hq(kD);
  for (int i = 0; i < kD; ++i) {
    hk[i] = 0.0883883f * ((i % 3) ? 1.0f : -1.0f);
    hq[i] = 0.05f * float((i % 7) - 3);
  }
  float *k, *q;
  CHECK(cudaMalloc(&k, kD * 4));
  CHECK(cudaMalloc(&q, kD * 4));
  CHECK(cudaMemcpy(k, hk.data(), kD * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(q, hq.data(), kD * 4, cudaMemcpyHostToDevice));
  Vecs vec{k, q, nullptr};
  run<float>("fp32", heads, vec);
  run<__nv_bfloat16>("bf16", heads, vec);
  return 0;
}
