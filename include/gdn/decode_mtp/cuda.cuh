// decode_mtp on CUDA (K = V = 128): the fused GDN decode / MTP-verify kernel and its launcher.
//
// Mapping. The V x K state of one (request, value head) is split by rows over `split` CTAs
// (1, 2, 4 or 8; a thread-block cluster on sm_90 when > 1). Every warp owns 8 consecutive V rows;
// lane l holds K columns 4l..4l+3 of each of them, so a state row is one coalesced 512-byte (fp32)
// or 256-byte (16-bit) access per warp, and the whole slice stays in registers for all T tokens.
// Dot products over K are 4 lane-local products followed by a transposing warp reduction (8 row
// sums in 9 shuffles) that leaves row (lane >> 2) & 7 in lane quad lane >> 2.
//
// Order of work in a CTA: row metadata (cu_seqlens, accepted count, the row's S slot ids) ->
// validity -> the source slice (all of it, into registers, before any store), token 0's
// activations and the epilogue's z / norm weight, all in flight together -> per token: decay,
// read, delta, rank-1 write, output, state store to the token's slot, with the next token's
// activations prefetched -> gated RMSNorm epilogue. The sum of o^2 over V is reduced in one fixed
// order (per-warp partials over 8 rows, then the 16 warp partials in sequence) whatever the split,
// so results do not depend on how a head was split; across CTAs of a cluster the partials are
// read through distributed shared memory.
//
// Math and rounding points follow gdn/decode_mtp/cpu.hpp (fp32 throughout, o kept fp32 into the
// norm, 16-bit state stored round-to-nearest-even). Invalid rows (device-side indices) write no
// state, zero-fill their output rows inside [0, L) and bump the optional error counter once.
// Every global access is bounded by the validated shapes, whatever the index values.
//
// The launcher allocates nothing, never synchronises and sets no function attributes (dynamic
// shared memory stays below 48 KB; cluster sizes <= 8 are portable), so it is safe inside CUDA
// graph capture. Cluster dimensions travel as a launch attribute (cudaLaunchKernelEx).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "gdn/core/dispatch.hpp"
#include "gdn/core/support.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::decode_mtp {
namespace cuda_detail {

inline constexpr int kHeadDim = 128;                               // K = V of this kernel
inline constexpr int kRowsPerWarp = 8;                             // V rows per warp
inline constexpr int kWarpsPerHead = kHeadDim / kRowsPerWarp;      // 16
inline constexpr int kMaxSplit = 8;                                // CTAs per head (cluster size)
inline constexpr int kMaxThreads = kWarpsPerHead * 32;             // 512, at split 1
inline constexpr int kEpilogueSlots = kCudaMaxSpecColumns / 4;     // outputs per thread (T*R / 4R)
// Register cap: a warp's slice of the current head (8 rows x 4 columns per lane, fp32), the next
// head's slice in flight and the per-token working set fit without spills; two 256-thread CTAs
// (split 2) share an SM.
#ifndef GDN_DECODE_MTP_MAXNREG
#define GDN_DECODE_MTP_MAXNREG 128
#endif
inline constexpr int kMaxRegisters = GDN_DECODE_MTP_MAXNREG;
// Whether the next head's source slice is loaded while the current head computes. Off by default:
// on the H200 the second slice of registers cost more than the overlap gained (T = 4, B = 128:
// 388 us off vs 420 us on; T = 1 equal or better; benchmarks/results/tuning/).
#ifndef GDN_DECODE_MTP_PREFETCH_NEXT
#define GDN_DECODE_MTP_PREFETCH_NEXT 0
#endif
inline constexpr bool kPrefetchNextHead = GDN_DECODE_MTP_PREFETCH_NEXT != 0;
static_assert(kCudaMaxSpecColumns <= 32, "slot ids of a row are held one per lane");
static_assert(kCudaMaxSpecColumns % 4 == 0, "epilogue assumes T*R outputs over 4R threads");

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
  bool state_vector;  // "vk" and aligned: one vector access per row chunk
  bool qkv_vector;    // q/k chunks of 4 elements are naturally aligned
  bool gate_sigmoid;
  bool early_dependent_launch;  // the whole grid is resident: let the next launch start early
  float scale, l2_eps, norm_eps;
};

template <DType D>
struct device_type;
template <>
struct device_type<DType::kFloat32> { using type = float; };
template <>
struct device_type<DType::kBFloat16> { using type = __nv_bfloat16; };
template <>
struct device_type<DType::kFloat16> { using type = __half; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// One lane's share of a state row (4 consecutive K elements) as raw bits: a float4 for fp32, two
// packed 16-bit pairs for bf16/fp16 (kept packed until used, so a slice in flight costs half the
// registers). Conversions round to nearest even.
template <class T>
struct StateBits;
template <>
struct StateBits<float> {
  using Raw = float4;
  static __device__ __forceinline__ float4 to_f32(Raw r) { return r; }
  static __device__ __forceinline__ Raw from_f32(float4 v) { return v; }
  static __device__ __forceinline__ Raw load_scalar(const float* p, int64_t step) {
    return make_float4(p[0], p[step], p[2 * step], p[3 * step]);
  }
  static __device__ __forceinline__ void store_scalar(float* p, int64_t step, Raw r) {
    p[0] = r.x; p[step] = r.y; p[2 * step] = r.z; p[3 * step] = r.w;
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
  static __device__ __forceinline__ Raw load_scalar(const Half* p, int64_t step) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
    return make_uint2(uint32_t(q[0]) | (uint32_t(q[step]) << 16),
                      uint32_t(q[2 * step]) | (uint32_t(q[3 * step]) << 16));
  }
  static __device__ __forceinline__ void store_scalar(Half* p, int64_t step, Raw r) {
    uint16_t* q = reinterpret_cast<uint16_t*>(p);
    q[0] = uint16_t(r.x); q[step] = uint16_t(r.x >> 16);
    q[2 * step] = uint16_t(r.y); q[3 * step] = uint16_t(r.y >> 16);
  }
};
template <>
struct StateBits<__nv_bfloat16> : StateBits16<__nv_bfloat16> {};
template <>
struct StateBits<__half> : StateBits16<__half> {};

// ---- Activations of run-time dtype --------------------------------------------------------------
// Loads are split into a raw-bits phase and a conversion phase, so several loads of different
// arrays are in flight together (a conversion right after its load would stall the issue).

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
      r.x = q[0]; r.y = q[1]; r.z = q[2]; r.w = q[3];
    }
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p) + i;
    if (vector) {
      const uint2 h = *reinterpret_cast<const uint2*>(q);
      r.x = h.x; r.y = h.y;
    } else {
      r.x = uint32_t(q[0]) | (uint32_t(q[1]) << 16);
      r.y = uint32_t(q[2]) | (uint32_t(q[3]) << 16);
    }
  }
  return r;
}

__device__ __forceinline__ float4 bits4_to_f32(uint4 r, DType t) {
  if (t == DType::kFloat32)
    return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                       __uint_as_float(r.w));
  return make_float4(bits_to_f32(r.x & 0xffffu, t), bits_to_f32(r.x >> 16, t),
                     bits_to_f32(r.y & 0xffffu, t), bits_to_f32(r.y >> 16, t));
}

__device__ __forceinline__ void store_act(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

__device__ __forceinline__ int64_t load_idx(const void* p, DType t, int64_t i) {
  return t == DType::kInt64 ? static_cast<const int64_t*>(p)[i]
                            : int64_t(static_cast<const int32_t*>(p)[i]);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Sums of 8 rows, each spread over the warp as one partial per lane. On return every lane of
// quad (lane >> 2) holds the full sum of row (lane >> 2) & 7 (the same bits in each lane of it).
__device__ __forceinline__ float transpose_reduce8(const float (&p)[8], int lane) {
  float a[4], b[2];
  const bool hi16 = lane & 16, hi8 = lane & 8, hi4 = lane & 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float keep = hi16 ? p[i + 4] : p[i];
    const float send = hi16 ? p[i] : p[i + 4];
    a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float keep = hi8 ? a[i + 2] : a[i];
    const float send = hi8 ? a[i] : a[i + 2];
    b[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  float x = (hi4 ? b[1] : b[0]) + __shfl_xor_sync(0xffffffffu, hi4 ? b[0] : b[1], 4);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x;
}

// ---- Clusters (sm_90+) --------------------------------------------------------------------------

__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// Address of the same shared-memory variable in CTA `rank` of this cluster.
__device__ __forceinline__ const float* cluster_peer(const float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<const float*>(out);
#else
  (void)rank;
  return p;
#endif
}

// ---- Programmatic dependent launch (sm_90+) -----------------------------------------------------

// Waits until the grids this launch depends on have completed and their writes are visible (a
// no-op when launched without the programmatic-serialization attribute).
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next launch in the stream start its blocks (they wait for this grid in the call above).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- Shared memory ------------------------------------------------------------------------------

// One request of a cluster's head range, resolved once per CTA from device-side indices.
struct RequestMeta {
  int64_t cu0;     // first token row
  int64_t source;  // slot of the initial state
  int64_t lo, hi;  // invalid request: its token rows inside [0, L) (zero-filled)
  int32_t T;       // tokens
  int32_t valid;   // 0: invalid (no state written, zero output, counted once)
  int32_t pad[2];
  int64_t slot[kCudaMaxSpecColumns];
};
inline constexpr int kMetaRequests = 32;  // requests one CTA's head range may span

// Offsets (in floats) of one CTA's shared arrays; S = state columns (T <= S), R = rows of the CTA.
struct SmemPlan {
  int meta, qk, v, gates, o, z, ss, rstd, w, total;
  __host__ __device__ SmemPlan(int S, int R, int W) {
    meta = 0;                                              // RequestMeta[kMetaRequests]
    qk = meta + kMetaRequests * int(sizeof(RequestMeta) / sizeof(float));  // [S][2][128] q, k
    v = qk + S * 2 * kHeadDim;                             // [S][R] v of the CTA's rows
    gates = v + S * R;                                     // [S][2] alpha, beta
    o = gates + 2 * S;                                     // [S][R] core output
    z = o + S * R;                                         // [S][R] act(z)
    ss = z + S * R;                                        // [S][W] per-warp partial sums of o^2
    rstd = ss + S * W;                                     // [S]
    w = rstd + S;                                          // [R] norm weight
    total = w + R;
  }
};
static_assert(sizeof(RequestMeta) % 16 == 0, "keeps the float arrays 16-byte aligned");

// ---- The kernel ---------------------------------------------------------------------------------

#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define GDN_DECODE_MTP_BOUNDS __maxnreg__(kMaxRegisters)
#else
#define GDN_DECODE_MTP_BOUNDS __launch_bounds__(kMaxThreads, 1)
#endif
static_assert(kMaxRegisters * kMaxThreads <= 65536, "a CTA of split 1 must fit an SM");

// A cluster of `split` CTAs walks a contiguous range of (request, value head) pairs; CTA `rank`
// owns rows [rank * R, rank * R + R) of every head, R = 128 / split. While head k computes, the
// source slice of head k + 1 is already loading (registers). kRatio = kRuntimeValue (0): head
// ratio taken from args.ratio.
template <class StateT, int kRatio>
__global__ void GDN_DECODE_MTP_BOUNDS decode_mtp_kernel(const __grid_constant__ KernelArgs args) {
  extern __shared__ __align__(16) float smem[];
  const int split = args.split;
  const int R = kHeadDim / split;  // rows of this CTA
  const int W = R / kRowsPerWarp;  // warps of this CTA
  const int S = args.S;
  const int HV = args.HV;
  const SmemPlan plan(S, R, W);
  RequestMeta* meta = reinterpret_cast<RequestMeta*>(smem + plan.meta);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = int(blockIdx.x % unsigned(split));
  const int64_t cluster = blockIdx.x / unsigned(split);
  const int64_t clusters = gridDim.x / unsigned(split);
  const int64_t heads = args.N * HV;
  const int64_t hb = heads * cluster / clusters, he = heads * (cluster + 1) / clusters;
  const int ratio = kRatio == kRuntimeValue ? args.ratio : kRatio;
  const int row0 = rank * R;                       // first row of this CTA
  const int wrow0 = row0 + warp * kRowsPerWarp;    // first row of this warp
  const int my_row = wrow0 + ((lane >> 2) & 7);    // row this lane holds after a reduction
  const int ep_r = tid % R;   // epilogue: this thread's row within the CTA ...
  const int ep_t0 = tid / R;  // ... and first token (outputs e = tid + j * 4R: token ep_t0 + 4j)
  const bool norm = args.norm_weight != nullptr;
  const bool gated = args.z != nullptr;
  const bool clustered = norm && split > 1;
  if (hb >= he) return;  // same for every CTA of the cluster

  wait_for_prior_grids();  // nothing below may read what earlier launches write before this
  if (args.early_dependent_launch) allow_dependent_launch();

  // 1. The requests of this head range: slot ids, token ranges and accepted counts, resolved
  //    once (one round trip), then checked.
  const int64_t n_first = hb / HV;
  const int n_count = int((he - 1) / HV - n_first + 1);  // <= kMetaRequests (host guarantees)
  const uint32_t w_bits = norm && ep_t0 == 0 ? load_bits(args.norm_weight, args.norm_dtype, row0 + ep_r) : 0u;
  for (int base = 0; base < n_count * S; base += blockDim.x) {
    const int e = base + tid;
    const bool has_slot = e < n_count * S, has_req = e < n_count;
    const int64_t slot =
        has_slot ? load_idx(args.state_indices, args.index_dtype, (n_first + e / S) * S + e % S) : 0;
    const int64_t c0 = has_req ? load_idx(args.cu_seqlens, args.cu_dtype, n_first + e) : 0;
    const int64_t c1 = has_req ? load_idx(args.cu_seqlens, args.cu_dtype, n_first + e + 1) : 0;
    const int64_t acc = has_req && args.num_accepted_tokens
                            ? load_idx(args.num_accepted_tokens, args.acc_dtype, n_first + e)
                            : int64_t(1);
    if (has_slot) meta[e / S].slot[e % S] = slot;
    if (has_req) {
      meta[e].cu0 = c0;
      meta[e].hi = c1;
      meta[e].source = acc;  // replaced by the slot below
    }
  }
  if (norm && ep_t0 == 0) smem[plan.w + ep_r] = bits_to_f32(w_bits, args.norm_dtype);
  __syncthreads();
  for (int j = tid; j < n_count; j += blockDim.x) {
    RequestMeta& m = meta[j];
    const int64_t c0 = m.cu0, c1 = m.hi, acc = m.source;
    const bool range_ok = c0 >= 0 && c1 >= c0 && c1 <= args.L;
    bool ok = range_ok && c1 - c0 <= S && acc >= 1 && acc <= S;
    for (int c = 0; c < S; ++c) ok = ok && m.slot[c] < args.num_slots;
    const int64_t source = ok ? m.slot[acc - 1] : -1;
    ok = ok && source >= args.first_valid_slot && source >= 0;
    m.T = range_ok ? int(c1 - c0 <= S ? c1 - c0 : S + 1) : S + 1;
    if (range_ok && c1 == c0) ok = true;  // padded row: valid, nothing to do
    m.valid = ok;
    m.source = source;
    m.lo = c0 < 0 ? 0 : c0;
    m.hi = c1 > args.L ? args.L : c1;
  }
  __syncthreads();

  // 2. Per-head pieces.
  const int64_t head_elems = int64_t(kHeadDim) * kHeadDim;
  const int64_t row_step = args.state_kv ? 1 : kHeadDim;  // element distance between rows
  const int64_t col_step = args.state_kv ? kHeadDim : 1;  // ... and between K columns
  // A head of the range is (j, hv): request meta[j], value head hv; walked in order without
  // 64-bit divisions.
  auto live = [&](int j) {  // the heads of request j have work (valid, T > 0)
    const RequestMeta& m = meta[j];
    return m.valid && m.T > 0;
  };
  // The source slice of head k, complete, into registers (before any store of that head).
  using Bits = StateBits<StateT>;
  using Raw = typename Bits::Raw;
  auto load_state = [&](int j, int hv, Raw(&raw)[kRowsPerWarp]) {
    const RequestMeta& m = meta[j];
    const StateT* src = static_cast<const StateT*>(args.state) + m.source * args.slot_stride +
                        hv * head_elems;
    if (args.state_vector) {
      const StateT* p = src + wrow0 * kHeadDim + 4 * lane;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) raw[i] = *reinterpret_cast<const Raw*>(p + i * kHeadDim);
    } else {
      const StateT* p = src + wrow0 * row_step + 4 * lane * col_step;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) raw[i] = Bits::load_scalar(p + i * row_step, col_step);
    }
  };
  // Activations of one token of head k (warp w stages tokens w, w + W, ...): raw bits, then
  // normalised / converted into shared memory.
  struct Staged {
    uint4 q, k;
    uint32_t v[kHeadDim / 32];
    uint32_t a, b, A_log, dt_bias;
  };
  auto stage_load = [&](int j, int hv, int t) {
    Staged st;
    const RequestMeta& m = meta[j];
    const int h = hv / ratio;  // grouped GVA: value head hv reads key head hv / r
    const int64_t l = m.cu0 + t;
    const int64_t base = l * args.qkv_row_stride;
    st.q = load_bits4(args.mixed_qkv, args.qkv_dtype, base + int64_t(h) * kHeadDim + 4 * lane,
                      args.qkv_vector);
    st.k = load_bits4(args.mixed_qkv, args.qkv_dtype,
                      base + int64_t(args.H + h) * kHeadDim + 4 * lane, args.qkv_vector);
    const int64_t vbase = base + int64_t(2 * args.H + hv) * kHeadDim + row0;
#pragma unroll
    for (int i = 0; i < kHeadDim / 32; ++i)
      st.v[i] = lane + 32 * i < R ? load_bits(args.mixed_qkv, args.qkv_dtype, vbase + lane + 32 * i) : 0u;
    st.a = load_bits(args.a, args.a_dtype, l * args.a_row_stride + hv);
    st.b = load_bits(args.b, args.b_dtype, l * args.b_row_stride + hv);
    st.A_log = load_bits(args.A_log, args.A_log_dtype, hv);
    st.dt_bias = load_bits(args.dt_bias, args.dt_bias_dtype, hv);
    return st;
  };
  auto stage_store = [&](int t, const Staged& st) {
    const float4 q = bits4_to_f32(st.q, args.qkv_dtype);
    const float4 kk4 = bits4_to_f32(st.k, args.qkv_dtype);
    const float qq = warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w);
    const float kk = warp_sum(kk4.x * kk4.x + kk4.y * kk4.y + kk4.z * kk4.z + kk4.w * kk4.w);
    const float qinv = args.scale / sqrtf(qq + args.l2_eps);
    const float kinv = 1.0f / sqrtf(kk + args.l2_eps);
    float* qk = smem + plan.qk + t * 2 * kHeadDim + 4 * lane;
    *reinterpret_cast<float4*>(qk) = make_float4(q.x * qinv, q.y * qinv, q.z * qinv, q.w * qinv);
    *reinterpret_cast<float4*>(qk + kHeadDim) =
        make_float4(kk4.x * kinv, kk4.y * kinv, kk4.z * kinv, kk4.w * kinv);
#pragma unroll
    for (int i = 0; i < kHeadDim / 32; ++i)
      if (lane + 32 * i < R) smem[plan.v + t * R + lane + 32 * i] = bits_to_f32(st.v[i], args.qkv_dtype);
    if (lane == 0) {
      const float A = -expf(bits_to_f32(st.A_log, args.A_log_dtype));
      const float dt_bias = bits_to_f32(st.dt_bias, args.dt_bias_dtype);
      const float a = bits_to_f32(st.a, args.a_dtype);
      const float b = bits_to_f32(st.b, args.b_dtype);
      smem[plan.gates + 2 * t] = expf(A * softplus(a + dt_bias));
      smem[plan.gates + 2 * t + 1] = sigmoid(b);
    }
  };
  auto load_z = [&](int j, int hv, uint32_t(&z_bits)[kEpilogueSlots]) {
    const RequestMeta& m = meta[j];
#pragma unroll
    for (int e = 0; e < kEpilogueSlots; ++e) {
      const int t = ep_t0 + 4 * e;
      z_bits[e] = gated && t < m.T
                      ? load_bits(args.z, args.z_dtype,
                                  (m.cu0 + t) * args.z_row_stride + hv * args.z_head_stride +
                                      row0 + ep_r)
                      : 0u;
    }
  };

  // Hints that pull the next head's activations into L2 while this head computes (they are
  // requested for real at the start of that head; every address lies inside its arrays).
  auto prefetch_l2 = [&](const void* base, DType t, int64_t i) {
    const char* p = static_cast<const char*>(base) + i * (t == DType::kFloat32 ? 4 : 2);
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  };
  auto prefetch_inputs = [&](int j, int hv) {
    const RequestMeta& m = meta[j];
    const int h = hv / ratio;
    for (int t = warp; t < m.T; t += W) {
      const int64_t l = m.cu0 + t;
      const int64_t base = l * args.qkv_row_stride;
      prefetch_l2(args.mixed_qkv, args.qkv_dtype, base + int64_t(h) * kHeadDim + 4 * lane);
      prefetch_l2(args.mixed_qkv, args.qkv_dtype, base + int64_t(args.H + h) * kHeadDim + 4 * lane);
      if (4 * lane < R) {
        prefetch_l2(args.mixed_qkv, args.qkv_dtype,
                    base + int64_t(2 * args.H + hv) * kHeadDim + row0 + 4 * lane);
        if (gated)
          prefetch_l2(args.z, args.z_dtype,
                      l * args.z_row_stride + hv * args.z_head_stride + row0 + 4 * lane);
      }
      if (lane == 0) {
        prefetch_l2(args.a, args.a_dtype, l * args.a_row_stride + hv);
        prefetch_l2(args.b, args.b_dtype, l * args.b_row_stride + hv);
      }
    }
  };

  // 3. The walk over the range. The source slice of the next live head is requested before this
  //    head's tokens run, so its latency hides behind them.
  Raw raw[kRowsPerWarp];
  int j = 0, hv = int(hb % HV);  // position of head hb
  if (kPrefetchNextHead && live(j)) load_state(j, hv, raw);
  bool peers_reading = false;  // a cluster arrive is pending: peers may read our partials

  for (int64_t k = hb; k < he; ++k, hv = hv + 1 == HV ? 0 : hv + 1, j += hv == 0) {
    const RequestMeta& m = meta[j];
    const bool has_next = k + 1 < he;
    const int next_hv = hv + 1 == HV ? 0 : hv + 1, next_j = j + (next_hv == 0);
    if (!(m.valid && m.T > 0)) {  // same decision in every CTA of the cluster
      if (!m.valid) {
        const int64_t count = m.hi > m.lo ? (m.hi - m.lo) * R : 0;
        for (int64_t e = tid; e < count; e += blockDim.x) {
          const int64_t l = m.lo + e / R;
          store_act(args.out, args.out_dtype, (l * HV + hv) * kHeadDim + row0 + e % R, 0.0f);
        }
        if (args.error_count && hv == 0 && rank == 0 && tid == 0) atomicAdd(args.error_count, 1);
      }
      if (kPrefetchNextHead && has_next && live(next_j)) load_state(next_j, next_hv, raw);
      continue;
    }
    const int T = m.T;
    if (!kPrefetchNextHead) load_state(j, hv, raw);

    // This head's inputs: all loads in flight together, then into shared memory.
    Staged first;
    if (warp < T) first = stage_load(j, hv, warp);
    uint32_t z_bits[kEpilogueSlots];
    load_z(j, hv, z_bits);
    float4 s[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) s[i] = Bits::to_f32(raw[i]);
    if (warp < T) stage_store(warp, first);
    for (int t = warp + W; t < T; t += W) stage_store(t, stage_load(j, hv, t));
    if (gated) {
#pragma unroll
      for (int e = 0; e < kEpilogueSlots; ++e) {
        const int t = ep_t0 + 4 * e;
        if (t < T) {
          const float zv = bits_to_f32(z_bits[e], args.z_dtype);
          smem[plan.z + t * R + ep_r] = args.gate_sigmoid ? sigmoid(zv) : zv * sigmoid(zv);
        }
      }
    }
    if (kPrefetchNextHead && has_next && live(next_j))
      load_state(next_j, next_hv, raw);  // in flight from now on
    int64_t my_slot = lane < S ? m.slot[lane] : 0;
    const int64_t head_offset = int64_t(hv) * head_elems;
    __syncthreads();  // staged tokens visible
    if (peers_reading) {  // peers done with our partials of the last head
      cluster_wait();
      peers_reading = false;
    }
    if (has_next && live(next_j)) prefetch_inputs(next_j, next_hv);

    // 4. Tokens.
    for (int t = 0; t < T; ++t) {
      const float* qk = smem + plan.qk + t * 2 * kHeadDim + 4 * lane;
      const float4 kt = *reinterpret_cast<const float4*>(qk + kHeadDim);
      const float alpha = smem[plan.gates + 2 * t];
      const float beta = smem[plan.gates + 2 * t + 1];
      const float v = smem[plan.v + t * R + (my_row - row0)];

      // decay, read u = S k
      float p[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        s[i].x *= alpha; s[i].y *= alpha; s[i].z *= alpha; s[i].w *= alpha;
        p[i] = s[i].x * kt.x + s[i].y * kt.y + s[i].z * kt.z + s[i].w * kt.w;
      }
      const float u = transpose_reduce8(p, lane);
      const float delta_mine = beta * (v - u);
      // rank-1 write S += delta k^T, then the output o = S q of the updated state
      const float4 qt = *reinterpret_cast<const float4*>(qk);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float d = __shfl_sync(0xffffffffu, delta_mine, 4 * i);
        s[i].x += kt.x * d; s[i].y += kt.y * d; s[i].z += kt.z * d; s[i].w += kt.w * d;
        p[i] = s[i].x * qt.x + s[i].y * qt.y + s[i].z * qt.z + s[i].w * qt.w;
      }
      const float o = transpose_reduce8(p, lane);

      // state after token t -> slot state_indices[n, t] (null: skipped)
      const int64_t dest = __shfl_sync(0xffffffffu, my_slot, t);
      if (dest >= args.first_valid_slot && dest >= 0) {
        StateT* dst = static_cast<StateT*>(args.state) + dest * args.slot_stride + head_offset;
        if (args.state_vector) {
          StateT* p = dst + wrow0 * kHeadDim + 4 * lane;
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i)
            *reinterpret_cast<Raw*>(p + i * kHeadDim) = Bits::from_f32(s[i]);
        } else {
          StateT* p = dst + wrow0 * row_step + 4 * lane * col_step;
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i)
            Bits::store_scalar(p + i * row_step, col_step, Bits::from_f32(s[i]));
        }
      }

      if ((lane & 3) == 0) smem[plan.o + t * R + (my_row - row0)] = o;
      if (norm) {  // this warp's share of sum(o^2), fixed order over its 8 rows
        float sq = o * o;
        sq += __shfl_xor_sync(0xffffffffu, sq, 4);
        sq += __shfl_xor_sync(0xffffffffu, sq, 8);
        sq += __shfl_xor_sync(0xffffffffu, sq, 16);
        if (lane == 0) smem[plan.ss + t * W + warp] = sq;
      }
    }

    // 5. Epilogue: gated RMSNorm over all 128 rows (partials of every CTA of the cluster), in
    //    one fixed order whatever the split.
    if (clustered) {
      cluster_arrive();
      cluster_wait();
    } else {
      __syncthreads();
    }
    if (norm) {
      if (warp == 0 && lane < T) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < kWarpsPerHead; ++g) {  // the 16 warp partials of the head, in order
          const float* part = smem + plan.ss + lane * W + g % W;
          total += clustered ? *cluster_peer(part, g / W) : *part;
        }
        smem[plan.rstd + lane] = 1.0f / sqrtf(total / float(kHeadDim) + args.norm_eps);
      }
      __syncthreads();
      if (clustered) {
        cluster_arrive();  // done reading the peers' partials
        peers_reading = true;
      }
    }
#pragma unroll
    for (int e = 0; e < kEpilogueSlots; ++e) {
      const int t = ep_t0 + 4 * e;
      if (t < T) {
        float y = smem[plan.o + t * R + ep_r];
        if (norm) {
          y = y * smem[plan.rstd + t] * smem[plan.w + ep_r];
          if (gated) y *= smem[plan.z + t * R + ep_r];
        }
        store_act(args.out, args.out_dtype, ((m.cu0 + t) * HV + hv) * kHeadDim + row0 + ep_r, y);
      }
    }
    __syncthreads();  // shared arrays are rewritten by the next head
  }
  if (peers_reading) cluster_wait();  // peers may still be reading this CTA's partials
}

// ---- Host side ----------------------------------------------------------------------------------

// Per-device facts, looked up once per device (lock-free; racing first calls store equal values).
struct DeviceInfo {
  int sm_count = 0;
  int major = 0;
};
inline Status device_info(int device, DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sm_count[kMaxDevices];
  static std::atomic<int> major[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return Status(StatusCode::kCudaError, "device index out of range");
  int sms = sm_count[device].load(std::memory_order_relaxed);
  int mj = major[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&mj, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      return Status(StatusCode::kCudaError,
                    std::string("decode_mtp: cannot query the device: ") + cudaGetErrorString(err));
    }
    major[device].store(mj, std::memory_order_relaxed);
    sm_count[device].store(sms, std::memory_order_relaxed);
  }
  info->sm_count = sms;
  info->major = mj;
  return Status::ok();
}

// Whether the kernel image that runs on `device` was compiled with cluster support (PTX >= 9.0;
// a build for sm_80 only, JIT-compiled on a newer GPU, has none). Cached per device.
template <class StateT, int kRatio>
inline bool kernel_has_clusters(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= kMaxDevices) return false;
  int c = cached[device].load(std::memory_order_relaxed);
  if (c == 0) {
    cudaFuncAttributes attr{};
    const bool ok = cudaFuncGetAttributes(&attr, decode_mtp_kernel<StateT, kRatio>) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
    c = ok && attr.ptxVersion >= 90 ? 2 : 1;
    cached[device].store(c, std::memory_order_relaxed);
  }
  return c == 2;
}

// CTAs per head: 1 (a 512-thread CTA per SM walking its heads; measured fastest on H200 for
// every T once there are half as many heads as SMs), else 4 or 8 (a cluster) so that small
// batches still fill the GPU.
inline int choose_split(int64_t heads, int sm_count, bool clusters) {
  if (!clusters || 2 * heads >= sm_count) return 1;
  return heads * 4 >= sm_count ? 4 : 8;
}

inline size_t shared_bytes(int S, int split) {
  const int R = kHeadDim / split;
  return size_t(SmemPlan(S, R, R / kRowsPerWarp).total) * sizeof(float);
}

// Resident CTAs per SM of one kernel for (split, S), cached per device.
template <class StateT, int kRatio>
inline int ctas_per_sm(int device, int split, int S) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices][4][kCudaMaxSpecColumns + 1];
  const int si = split == 1 ? 0 : split == 2 ? 1 : split == 4 ? 2 : 3;
  if (device < 0 || device >= kMaxDevices || S < 0 || S > kCudaMaxSpecColumns) return 1;
  int n = cached[device][si][S].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_mtp_kernel<StateT, kRatio>,
                                                      kMaxThreads / split,
                                                      shared_bytes(S, split)) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 1;
    }
    n = n < 1 ? 1 : n;
    cached[device][si][S].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <DType kState, int kRatio>
inline Status launch_kernel(const KernelArgs& args_in, int device, int split_request,
                            cudaStream_t stream) {
  using StateT = typename device_type<kState>::type;
  KernelArgs args = args_in;
  DeviceInfo info;
  GDN_RETURN_IF_ERROR(device_info(device, &info));
  // sm_90 image: thread-block clusters and programmatic dependent launch.
  const bool hopper = info.major >= 9 && kernel_has_clusters<StateT, kRatio>(device);
  const int64_t heads = args.N * args.HV;
  const int split = split_request > 0 ? split_request : choose_split(heads, info.sm_count, hopper);
  if (split != 1 && split != 2 && split != 4 && split != 8)
    return Status::invalid("decode_mtp: split must be 1, 2, 4 or 8, got " + std::to_string(split));
  if (split > 1 && !hopper)
    return Status::unsupported("decode_mtp: splitting a head over CTAs needs thread-block "
                               "clusters (sm_90 and a kernel image built for it)");
  args.split = split;

  // Persistent grid: as many clusters as fit at once (each walks a contiguous head range), but
  // enough that no range spans more than kMetaRequests requests.
  const int64_t resident =
      std::max<int64_t>(1, int64_t(info.sm_count) * ctas_per_sm<StateT, kRatio>(device, split, args.S) / split);
  const int64_t span_limit = (heads + int64_t(kMetaRequests - 1) * args.HV - 1) /
                             (int64_t(kMetaRequests - 1) * args.HV);
  const int64_t n_clusters = std::min(heads, std::max(resident, span_limit));
  if (n_clusters * split > int64_t(INT_MAX))
    return Status::unsupported("decode_mtp: too many (request, value head) pairs for one launch");
  args.early_dependent_launch = hopper && n_clusters <= resident;

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(n_clusters * split));
  config.blockDim = dim3(unsigned(kMaxThreads / split));
  config.dynamicSmemBytes = shared_bytes(args.S, split);
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (split > 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = unsigned(split);
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (hopper) {  // may start before the previous launch ends; the kernel waits before any read
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  config.attrs = attr;
  config.numAttrs = num_attrs;
  const cudaError_t err = cudaLaunchKernelEx(&config, decode_mtp_kernel<StateT, kRatio>, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kCudaError,
                  std::string("decode_mtp: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return Status::ok();
}

// All head ratios of one state dtype (HeadRatios, plus the run-time-ratio kernel). The compiled
// library instantiates this once per state dtype, in its own translation unit.
template <DType kState>
Status launch_state_dtype(const KernelArgs& args, int device, int split, cudaStream_t stream) {
  Status status;
  const int ratio = args.ratio <= 8 ? args.ratio : kRuntimeValue;
  dispatch_or_runtime<HeadRatios>(ratio, [&]<int kRatio>() {
    (void)(status = launch_kernel<kState, kRatio>(args, device, split, stream));
  });
  return status;
}

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace cuda_detail

// The compiled library (gdn_kernels, which defines GDN_HAS_CUDA) holds one explicit instantiation
// per state dtype in src/cuda/decode_mtp_<dtype>.cu; code that includes this header on its own
// instantiates what it uses.
#if defined(GDN_HAS_CUDA)
static_assert(StateDTypes::size == 3 && StateDTypes::contains(DType::kFloat32) &&
                  StateDTypes::contains(DType::kBFloat16) && StateDTypes::contains(DType::kFloat16),
              "one compiled translation unit per state dtype: update src/cuda/decode_mtp_*.cu");
namespace cuda_detail {
extern template Status launch_state_dtype<DType::kFloat32>(const KernelArgs&, int, int, cudaStream_t);
extern template Status launch_state_dtype<DType::kBFloat16>(const KernelArgs&, int, int, cudaStream_t);
extern template Status launch_state_dtype<DType::kFloat16>(const KernelArgs&, int, int, cudaStream_t);
}  // namespace cuda_detail
#endif

// Validates on the host (reads no device memory), applies the guard and launches on `stream`,
// on the current device (which must hold the arrays). `split` = CTAs per value head (1, 2, 4, 8;
// 0 = chosen from the problem size and the device). Never synchronises; safe in graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream, int split = 0) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  if (pr.device.type != DeviceType::kCUDA)
    return Status::invalid("decode_mtp CUDA launcher was given arrays on " + to_string(pr.device));
  if (p.first_valid_slot < 0)
    return Status::invalid("first_valid_slot = " + std::to_string(p.first_valid_slot) +
                           " must be >= 0 (slot ids below it are null)");
  const Support support =
      can_use(DeviceType::kCUDA, pr.H, pr.HV, pr.K, pr.V, pr.S, p.state.dtype, true);
  if (support.path == Path::kUnsupported) return Status::unsupported("decode_mtp: " + support.reason);
  if (pr.N == 0) return Status::ok();
  if (pr.HV > 65535 || pr.H > 65535)
    return Status::unsupported("decode_mtp: more than 65535 heads");

  using cuda_detail::aligned;
  cuda_detail::KernelArgs args{};
  args.mixed_qkv = p.mixed_qkv.data;
  args.a = p.a.data;
  args.b = p.b.data;
  args.A_log = p.A_log.data;
  args.dt_bias = p.dt_bias.data;
  args.z = p.z.present() ? p.z.data : nullptr;
  args.norm_weight = p.norm_weight.present() ? p.norm_weight.data : nullptr;
  args.state = p.state.data;
  args.state_indices = p.state_indices.data;
  args.cu_seqlens = p.cu_seqlens.data;
  args.num_accepted_tokens = p.num_accepted_tokens.present() ? p.num_accepted_tokens.data : nullptr;
  args.out = p.out.data;
  args.error_count = p.error_count.present() ? static_cast<int*>(p.error_count.data) : nullptr;
  args.qkv_row_stride = p.mixed_qkv.strides[0];
  args.a_row_stride = p.a.strides[0];
  args.b_row_stride = p.b.strides[0];
  args.z_row_stride = p.z.present() ? p.z.strides[0] : 0;
  args.z_head_stride = p.z.present() ? p.z.strides[1] : 0;
  args.slot_stride = p.state.strides[0];
  args.num_slots = pr.num_slots;
  args.first_valid_slot = p.first_valid_slot;
  args.L = pr.L;
  args.N = pr.N;
  args.S = int(pr.S);
  args.H = int(pr.H);
  args.HV = int(pr.HV);
  args.ratio = int(pr.ratio);
  args.qkv_dtype = p.mixed_qkv.dtype;
  args.a_dtype = p.a.dtype;
  args.b_dtype = p.b.dtype;
  args.A_log_dtype = p.A_log.dtype;
  args.dt_bias_dtype = p.dt_bias.dtype;
  args.z_dtype = p.z.present() ? p.z.dtype : DType::kFloat32;
  args.norm_dtype = p.norm_weight.present() ? p.norm_weight.dtype : DType::kFloat32;
  args.out_dtype = p.out.dtype;
  args.index_dtype = p.state_indices.dtype;
  args.cu_dtype = p.cu_seqlens.dtype;
  args.acc_dtype = p.num_accepted_tokens.present() ? p.num_accepted_tokens.dtype : DType::kInt32;
  args.state_kv = p.layout == StateLayout::kKV;
  const size_t state_bytes = size_t(dtype_size(p.state.dtype));
  const size_t state_chunk = 4 * state_bytes;  // one lane's 4 elements of a row
  args.state_vector = !args.state_kv && aligned(p.state.data, state_chunk) &&
                      (size_t(p.state.strides[0]) * state_bytes) % state_chunk == 0;
  const size_t qkv_chunk = 4 * size_t(dtype_size(p.mixed_qkv.dtype));
  args.qkv_vector = aligned(p.mixed_qkv.data, qkv_chunk) &&
                    (size_t(p.mixed_qkv.strides[0]) * size_t(dtype_size(p.mixed_qkv.dtype))) % qkv_chunk == 0;
  args.gate_sigmoid = p.gate == GateActivation::kSigmoid;
  args.scale = pr.scale;
  args.l2_eps = p.l2_eps;
  args.norm_eps = p.norm_eps;

  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError, std::string("decode_mtp: ") + cudaGetErrorString(err));
  }
  Status status = Status::unsupported("decode_mtp: state dtype " +
                                      std::string(to_string(p.state.dtype)) + " not compiled in");
  StateDTypes::dispatch(p.state.dtype, [&]<DType kState>() {
    (void)(status = cuda_detail::launch_state_dtype<kState>(args, device, split, stream));
  });
  return status;
}

}  // namespace gdn::decode_mtp
