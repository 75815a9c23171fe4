// Device-side building blocks shared by the CUDA kernels: dtype conversions and loads of
// run-time-dtype arrays, warp reductions, and thin wrappers over the sm_90 instructions the
// kernels use (thread-block clusters, programmatic dependent launch, mbarriers and bulk copies).
// The sm_90 wrappers compile to nothing on older architectures (hence their [[maybe_unused]]
// parameters); callers decide at run time (host side) whether a kernel image has them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gdn/core/dtype.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GDN_CUDA_SM90 1
#else
#define GDN_CUDA_SM90 0
#endif

namespace gdn::cuda {

// ---- dtypes -------------------------------------------------------------------------------------

// Device storage type of a floating DType.
template <DType D>
struct device_type : float_storage<D, float, __nv_bfloat16, __half> {};

// Four consecutive elements of a state row as raw bits: a float4 for fp32, two packed 16-bit
// pairs for bf16/fp16 (kept packed until used, so data in flight costs half the registers).
// Conversions to 16 bits round to nearest even. Stores are explicit vector stores (__stcs,
// __stwb), because through a plain float4 or uint2 assignment nvcc may split the first store of
// each row set into scalar stores that each write parts of several sectors.
template <class T>
struct StateBits;
template <>
struct StateBits<float> {
  using Raw = float4;
  static __device__ __forceinline__ float4 to_f32(Raw r) { return r; }
  static __device__ __forceinline__ Raw from_f32(float4 v) { return v; }
  static __device__ __forceinline__ void store_streaming(float* p, Raw r) {
    __stcs(reinterpret_cast<float4*>(p), r);
  }
  static __device__ __forceinline__ void store_plain(float* p, Raw r) {
    __stwb(reinterpret_cast<float4*>(p), r);
  }
  static __device__ __forceinline__ void store_scalar(float* p, int64_t step, Raw r) {
    p[0] = r.x;
    p[step] = r.y;
    p[2 * step] = r.z;
    p[3 * step] = r.w;
  }
};
template <class Half>
struct StateBits16 {
  using Raw = uint2;
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      __half2 h;
      memcpy(&h, &w, 4);
      return __half22float2(h);
    }
  }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    uint32_t w;
    if constexpr (std::is_same_v<Half, __nv_bfloat16>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
      memcpy(&w, &h, 4);
    } else {
      const __half2 h = __floats2half2_rn(a, b);
      memcpy(&w, &h, 4);
    }
    return w;
  }
  static __device__ __forceinline__ float4 to_f32(Raw r) {
    const float2 lo = unpack(r.x), hi = unpack(r.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  static __device__ __forceinline__ Raw from_f32(float4 v) {
    return make_uint2(pack(v.x, v.y), pack(v.z, v.w));
  }
  static __device__ __forceinline__ void store_streaming(Half* p, Raw r) {
    __stcs(reinterpret_cast<uint2*>(p), r);
  }
  static __device__ __forceinline__ void store_plain(Half* p, Raw r) {
    __stwb(reinterpret_cast<uint2*>(p), r);
  }
  static __device__ __forceinline__ void store_scalar(Half* p, int64_t step, Raw r) {
    uint16_t* q = reinterpret_cast<uint16_t*>(p);
    q[0] = uint16_t(r.x);
    q[step] = uint16_t(r.x >> 16);
    q[2 * step] = uint16_t(r.y);
    q[3 * step] = uint16_t(r.y >> 16);
  }
};
template <>
struct StateBits<__nv_bfloat16> : StateBits16<__nv_bfloat16> {};
template <>
struct StateBits<__half> : StateBits16<__half> {};

// ---- arrays of run-time dtype -------------------------------------------------------------------
// Loads return raw bits and conversion is a separate step, so several loads of different arrays
// are in flight together (a conversion right after its load would stall the issue).

__device__ __forceinline__ uint32_t load_bits(const void* p, DType t, int64_t i) {
  if (t == DType::kFloat32) return static_cast<const uint32_t*>(p)[i];
  return static_cast<const uint16_t*>(p)[i];
}

__device__ __forceinline__ float bits_to_f32(uint32_t w, DType t) {
  if (t == DType::kFloat32) return __uint_as_float(w);
  if (t == DType::kBFloat16) return __uint_as_float(w << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w)));
}

// Four consecutive elements starting at element i; 16-bit elements come back packed in x, y.
__device__ __forceinline__ uint4 load_bits4(const void* p, DType t, int64_t i, bool vector) {
  uint4 r{0u, 0u, 0u, 0u};
  if (t == DType::kFloat32) {
    const uint32_t* q = static_cast<const uint32_t*>(p) + i;
    if (vector) {
      r = *reinterpret_cast<const uint4*>(q);
    } else {
      r.x = q[0];
      r.y = q[1];
      r.z = q[2];
      r.w = q[3];
    }
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p) + i;
    if (vector) {
      const uint2 h = *reinterpret_cast<const uint2*>(q);
      r.x = h.x;
      r.y = h.y;
    } else {
      r.x = uint32_t(q[0]) | (uint32_t(q[1]) << 16);
      r.y = uint32_t(q[2]) | (uint32_t(q[3]) << 16);
    }
  }
  return r;
}

// Element i of an array of run-time dtype, as fp32.
__device__ __forceinline__ float load_value(const void* p, DType t, int64_t i) {
  return bits_to_f32(load_bits(p, t, i), t);
}

__device__ __forceinline__ float4 bits4_to_f32(uint4 r, DType t) {
  if (t == DType::kFloat32)
    return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                       __uint_as_float(r.w));
  return make_float4(bits_to_f32(r.x & 0xffffu, t), bits_to_f32(r.x >> 16, t),
                     bits_to_f32(r.y & 0xffffu, t), bits_to_f32(r.y >> 16, t));
}

__device__ __forceinline__ void store_value(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case DType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

// v rounded to dtype t and back (round to nearest even); the identity for fp32.
__device__ __forceinline__ float round_to(DType t, float v) {
  if (t == DType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(v));
  if (t == DType::kFloat16) return __half2float(__float2half_rn(v));
  return v;
}

// 1 / x by the hardware's approximate reciprocal (1 ulp), one instruction: for x in the normal
// range, where __fdividef(1, x) also spends a few on scaling huge and tiny x.
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 2^x by the hardware's approximate exp2 (about 2^-22 relative; results below the normal range
// flush to zero), one instruction.
__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// sigmoid from the hardware's approximate exp2 and reciprocal: four instructions instead of about
// twenty (expf and an IEEE division), within about 1e-6 relative of sigmoid (0 and 1 at the ends,
// NaN for NaN). For act(z), applied to every output element; beta, which enters the state, keeps
// sigmoid.
__device__ __forceinline__ float fast_sigmoid(float x) { return fast_rcp(1.0f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- warp reductions ----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Sums of kRows rows (2, 4 or 8) held by a row set of 4 kRows lanes, each lane with one partial
// per row (p[r]: row r of its set). A transposing butterfly: each stage trades half of the values
// with the lane 2n apart, then two plain stages over the quad. On return every lane of quad
// (lane >> 2) holds the full sum of row (lane >> 2) & (kRows - 1) of its set; kRows + 1 shuffles
// (8 row sums in 9). p is overwritten.
template <int kRows>
__device__ __forceinline__ float transpose_reduce(float (&p)[kRows], int lane) {
  static_assert(kRows == 2 || kRows == 4 || kRows == 8, "2, 4 or 8 rows");
#pragma unroll
  for (int n = kRows; n > 1; n /= 2) {
    const bool hi = lane & (2 * n);
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float keep = hi ? p[i + n / 2] : p[i];
      const float send = hi ? p[i] : p[i + n / 2];
      p[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * n);
    }
  }
  float x = p[0];
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x;
}

// Sums of N values (N = 2, 4 or 8) over the N lanes lane ^ 0 .. lane ^ (N - 1), each lane with one
// partial of every value: a transposing butterfly that trades half of the values at each stage.
// On return the lane holds the full sum of value lane & (N - 1) (N - 1 shuffles for N sums). p is
// overwritten.
template <int N>
__device__ __forceinline__ float transpose_sum(float (&p)[N], int lane) {
  static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 values");
#pragma unroll
  for (int half = N / 2; half >= 1; half /= 2) {
    const bool hi = lane & half;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float keep = hi ? p[i + half] : p[i];
      const float send = hi ? p[i] : p[i + half];
      p[i] = keep + __shfl_xor_sync(0xffffffffu, send, half);
    }
  }
  return p[0];
}

// An sm_90 instruction without operands that also orders memory (a compiler barrier); nothing in
// images for older architectures. Undefined after the sm_90 wrappers.
#if GDN_CUDA_SM90
#define GDN_SM90_MEMORY_INSTRUCTION(text) asm volatile(text : : : "memory")
#else
#define GDN_SM90_MEMORY_INSTRUCTION(text)
#endif

// ---- thread-block clusters (sm_90) --------------------------------------------------------------

// The shared::cta window address of `p`, a pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A relaxed arrive: it orders no memory. It is for lifetime (no CTA exits while a peer may still
// access it) and, after mbarrier_init_fence, for publishing mbarrier initialisation to the peers.
// Data goes between CTAs through store_to_peer or mbarriers: a release arrive would order every
// earlier store of the thread at cluster scope, global ones too, and wait for them to drain
// (MEMBAR.ALL.GPU).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  GDN_SM90_MEMORY_INSTRUCTION("barrier.cluster.arrive.relaxed.aligned;\n");
}
__device__ __forceinline__ void cluster_wait() {
  GDN_SM90_MEMORY_INSTRUCTION("barrier.cluster.wait.acquire.aligned;\n");
}
// Address of the same shared-memory variable in CTA `rank` of this cluster.
__device__ __forceinline__ const float* cluster_peer(const float* p, [[maybe_unused]] int rank) {
#if GDN_CUDA_SM90
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<const float*>(out);
#else
  return p;
#endif
}

// Shared-memory address (shared::cluster window) of `p`'s counterpart in CTA `rank` of this
// cluster.
__device__ __forceinline__ uint32_t cluster_shared_address([[maybe_unused]] const void* p,
                                                           [[maybe_unused]] int rank) {
  uint32_t out = 0;
#if GDN_CUDA_SM90
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(out)
               : "r"(shared_address(p)), "r"(rank));
#endif
  return out;
}
// Stores `value` at `addr` in a peer CTA's shared memory and completes 4 bytes of the transaction
// of the peer's mbarrier at `bar` (both from cluster_shared_address): the peer sees the value once
// that barrier's phase completes. No fence on either side, unlike a release cluster barrier.
__device__ __forceinline__ void store_to_peer([[maybe_unused]] uint32_t addr,
                                              [[maybe_unused]] float value,
                                              [[maybe_unused]] uint32_t bar) {
#if GDN_CUDA_SM90
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(addr),
      "f"(value), "r"(bar)
      : "memory");
#endif
}

// ---- programmatic dependent launch (sm_90) ------------------------------------------------------

// Waits until the grids this launch depends on have completed and their writes are visible (a
// no-op when launched without the programmatic-serialization attribute).
__device__ __forceinline__ void wait_for_prior_grids() {
  GDN_SM90_MEMORY_INSTRUCTION("griddepcontrol.wait;\n");
}
// Lets the next launch in the stream start its blocks once every block of this grid has called
// this or exited (they wait for this grid's completion in wait_for_prior_grids).
__device__ __forceinline__ void allow_dependent_launch() {
  GDN_SM90_MEMORY_INSTRUCTION("griddepcontrol.launch_dependents;\n");
}

// ---- mbarriers and bulk copies global -> shared (sm_90) -----------------------------------------

// Orders this thread's earlier generic-proxy accesses to shared memory before later bulk copies
// (async proxy) into it.
__device__ __forceinline__ void fence_proxy_async() {
  GDN_SM90_MEMORY_INSTRUCTION("fence.proxy.async.shared::cta;\n");
}

// One thread initialises; the fences make the barrier visible to the bulk-copy (async) proxy.
__device__ __forceinline__ void mbarrier_init([[maybe_unused]] uint64_t* bar,
                                              [[maybe_unused]] uint32_t arrivals) {
#if GDN_CUDA_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_init_fence() {
  GDN_SM90_MEMORY_INSTRUCTION("fence.mbarrier_init.release.cluster;\n");
  fence_proxy_async();
}

// L2 policy of a bulk copy's source: with `evict_first` for data read exactly once (the source
// state), else with no eviction preference (what a load without a hint gets).
__device__ __forceinline__ uint64_t l2_policy([[maybe_unused]] bool evict_first) {
  uint64_t policy = 0;
#if GDN_CUDA_SM90
  if (evict_first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

// Arrives on `bar` (one of its arrivals) and expects `bytes` more of transactions in its phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx([[maybe_unused]] uint64_t* bar,
                                                          [[maybe_unused]] uint32_t bytes) {
#if GDN_CUDA_SM90
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
      "r"(bytes)
      : "memory");
#endif
}

// Arms `bar` for `bytes` and copies them from global to shared memory; the barrier's phase
// completes when they have landed. dst, src and bytes are multiples of 16; policy is an L2 cache
// policy (l2_policy).
__device__ __forceinline__ void bulk_load([[maybe_unused]] void* dst,
                                          [[maybe_unused]] const void* src,
                                          [[maybe_unused]] uint32_t bytes,
                                          [[maybe_unused]] uint64_t* bar,
                                          [[maybe_unused]] uint64_t policy) {
#if GDN_CUDA_SM90
  mbarrier_arrive_expect_tx(bar, bytes);
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)), "l"(policy)
      : "memory");
#endif
}

// Blocks until phase `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait([[maybe_unused]] uint64_t* bar,
                                              [[maybe_unused]] uint32_t parity) {
#if GDN_CUDA_SM90
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
#endif
}

#undef GDN_SM90_MEMORY_INSTRUCTION

}  // namespace gdn::cuda
