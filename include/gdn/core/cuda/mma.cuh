// Warp-level tensor-core building blocks (sm_80 and later): mma.sync m16n8k16 with 16-bit inputs
// and m16n8k8 with tf32 inputs, fp32 accumulators, ldmatrix fragment loads from 16-bit tiles in
// shared memory, and the cp.async copies that stage those tiles.
//
// Fragment layout (PTX ISA, m16n8k16): an accumulator tile d[4] holds rows lane / 4 (d[0], d[1])
// and lane / 4 + 8 (d[2], d[3]), columns 2 * (lane % 4) and the next one. A tile's rows start at a
// 16-byte aligned address; a row stride of 16 bytes times an odd number keeps ldmatrix free of
// bank conflicts.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "gdn/core/cuda/device.cuh"

namespace gdn::cuda::mma {

// d += a b (16 x 8 x 16): Half (bf16 or fp16) inputs, fp32 accumulators; traps on images older
// than sm_80, which no launcher runs.
template <class Half>
__device__ __forceinline__ void mma_16bit(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<Half, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// d += a b (16 x 8 x 8) with tf32 inputs (fp32 values with 10-bit mantissas) and fp32
// accumulators; traps on images older than sm_80, which no launcher runs.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// x rounded to the nearest tf32 value.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r = __float_as_uint(x);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#endif
  return r;
}

// d += rows m0.. (16) of the fp32 tile a times columns n0.. (8) of the fp32 tile b, over kSteps
// steps of 8 from a's column ak0 and b's row bk0; both tiles row-major (row strides a_ld, b_ld).
template <int kSteps>
__device__ __forceinline__ void product_tf32(float (&d)[4], const float* a, int a_ld, int m0,
                                             int ak0, const float* b, int b_ld, int bk0, int n0,
                                             int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const float* ar = a + (m0 + g) * a_ld + ak0 + 8 * s + t;
    const uint32_t af[4] = {to_tf32(ar[0]), to_tf32(ar[8 * a_ld]), to_tf32(ar[4]),
                            to_tf32(ar[8 * a_ld + 4])};
    const float* bc = b + (bk0 + 8 * s + t) * b_ld + n0 + g;
    mma_tf32(d, af, to_tf32(bc[0]), to_tf32(bc[4 * b_ld]));
  }
}

// Stores the accumulator tile d (16 x 8) times `sign` at (r0, c0) of a row-major fp32 tile.
__device__ __forceinline__ void store_accumulators(const float (&d)[4], float* tile, int ld, int r0,
                                                   int c0, float sign, int lane) {
  float* p = tile + (r0 + lane / 4) * ld + c0 + 2 * (lane % 4);
  *reinterpret_cast<float2*>(p) = make_float2(sign * d[0], sign * d[1]);
  *reinterpret_cast<float2*>(p + 8 * ld) = make_float2(sign * d[2], sign * d[3]);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// The A fragment (16 x 16) at (row0, k0) of a row-major tile A[m][k] with row stride ld.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int ld,
                                       int row0, int k0, int lane) {
  ldmatrix_x4(a, tile + (row0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

// The A fragment (16 x 16) at (m0, k0) of A stored transposed, At[k][m] with row stride ld.
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const __nv_bfloat16* tile,
                                                  int ld, int m0, int k0, int lane) {
  ldmatrix_x4_trans(
      a, tile + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8);
}

// The B fragments of two adjacent n tiles (n0 and n0 + 8, 16 deep from k0) of B stored as
// Bt[n][k] (each output column's operand a contiguous row): b[0], b[1] for n0; b[2], b[3] for
// n0 + 8.
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[4], const __nv_bfloat16* tile, int ld,
                                            int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// The same two n tiles of B stored row-major, B[k][n].
__device__ __forceinline__ void load_b_pair_transposed(uint32_t (&b)[4], const __nv_bfloat16* tile,
                                                       int ld, int n0, int k0, int lane) {
  ldmatrix_x4_trans(
      b, tile + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ld + n0 + ((lane >> 4) << 3));
}

// Starts a 16-byte copy global -> shared that bypasses L1 (both addresses 16-byte aligned); a
// plain copy on images without cp.async, where the commits and waits below do nothing.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)), "l"(src)
               : "memory");
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}

// Closes the group of copies this thread started since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace gdn::cuda::mma
