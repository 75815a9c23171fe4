// Replay verify on CUDA (K = V = 128): the launcher. Contract: docs replay.md.
//
// Two launches on the caller's stream:
//   1. the decode_mtp kernel in replay mode (gdn/decode_mtp/cuda_kernel.cuh, same mapping and
//      split): each CTA reads its rows of the checkpoint and the window tokens it replays, stores
//      the advanced checkpoint rows once and writes its outputs. It never writes the window.
//   2. the window save below: one CTA per request copies the new tokens' raw k, v, a, b rows into
//      the slot's window and sets window_len. It stores only after every CTA of launch 1 has
//      finished (stream order; with programmatic dependent launch its CTAs may be resident early,
//      load what launch 1 does not write, and wait for launch 1's completion before any store),
//      so no window row is overwritten while a CTA of another value head or row block still
//      replays it.
// A row is decided the same way in both launches (classify_replay_row, which reads window_len
// before launch 2 rewrites it), so an invalid row stores nothing anywhere.
//
// Allocates nothing, never synchronises; safe in graph capture.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/device_info.cuh"
#include "gdn/decode_mtp/cuda.cuh"
#include "gdn/replay/params.hpp"

namespace gdn::replay {
namespace cuda_detail {

inline constexpr int kSaveThreads = 256;
// Units of k and v a thread has in flight at once (TP1 with bf16 activations: a request's k and v
// at T = 4 are 3,072 16-byte units, one batch of 256 threads x 12).
inline constexpr int kSaveBatch = 12;

struct WindowSaveArgs {
  const char* mixed_qkv;  // byte pointers: the save copies raw elements
  const char* a;
  const char* b;
  const void* state_indices;
  int64_t index_stride;
  const void* cu_seqlens;
  const void* num_accepted_tokens;
  char* window_k;
  char* window_v;
  char* window_a;
  char* window_b;
  int* window_len;
  // Strides in bytes.
  int64_t qkv_row, a_row, b_row;
  int64_t wk_slot, wk_token, wv_slot, wv_token, wa_slot, wa_token, wb_slot, wb_token;
  int64_t k_bytes, v_bytes;  // bytes of one token's k (H*K) and v (HV*V) part
  int64_t L, S, num_slots, first_valid_slot;
  int HV, qkv_size, a_size, b_size;  // element sizes in bytes
  DType index_dtype, cu_dtype, acc_dtype;
  bool vector;  // every k / v row starts and ends 16-byte aligned on both sides
};

// Unit e of a copy of T tokens of `per_token` units each, as (token t, unit j of the token),
// stepped by the CTA's thread count without a division per unit (a 64-bit division per unit made
// the copy slower than per-token copies at small batches).
struct TokenUnit {
  int64_t t, j;
  __device__ __forceinline__ TokenUnit(int64_t e, int64_t per_token)
      : t(e / per_token), j(e % per_token) {}
  __device__ __forceinline__ void next(int64_t per_token) {
    for (j += kSaveThreads; j >= per_token; j -= per_token) ++t;
  }
};

// An a or b element of `size` bytes, as raw bits.
__device__ __forceinline__ uint32_t load_raw(const char* p, int size) {
  return size == 4 ? *reinterpret_cast<const uint32_t*>(p) : *reinterpret_cast<const uint16_t*>(p);
}
__device__ __forceinline__ void store_raw(char* p, int size, uint32_t bits) {
  if (size == 4)
    *reinterpret_cast<uint32_t*>(p) = bits;
  else
    *reinterpret_cast<uint16_t*>(p) = uint16_t(bits);
}

// One CTA per request row: the T new tokens' raw k and v (contiguous in the mixed_qkv row, in
// units of KvUnit), a and b into the slot's window, and window_len[slot] = T. Nothing it reads is
// written by the replay launch (this call's inputs, and window_len, which only this launch
// writes), so the meta loads and the first batch go out before it waits for that launch; only the
// stores wait (the replay launch has then read every window it replays). A template so that a
// header-defined kernel has one definition however many translation units include it.
template <class KvUnit>
__global__ void __launch_bounds__(kSaveThreads)
    save_window_kernel(const __grid_constant__ WindowSaveArgs args) {
  __shared__ int64_t meta[5];  // slot, c0, c1, replay count, window_len[slot]
  gdn::cuda::allow_dependent_launch();
  const int tid = int(threadIdx.x);
  const int64_t i = blockIdx.x;
  if (tid == 0)
    meta[0] = gdn::load_index(args.state_indices, args.index_dtype, i * args.index_stride);
  else if (tid == 1)
    meta[1] = gdn::load_index(args.cu_seqlens, args.cu_dtype, i);
  else if (tid == 2)
    meta[2] = gdn::load_index(args.cu_seqlens, args.cu_dtype, i + 1);
  else if (tid == 3)
    meta[3] = gdn::load_index(args.num_accepted_tokens, args.acc_dtype, i);
  __syncthreads();
  const int64_t slot = meta[0], c0 = meta[1], c1 = meta[2], n = meta[3], T = c1 - c0;
  // Token range and slot first, so that every load below stays inside the arrays; the window
  // length goes out with the first batch.
  if (classify_replay_row(c0, c1, args.L, args.S, slot, args.num_slots, args.first_valid_slot, n,
                          INT64_MAX) != ReplayRow::kLive)
    return;
  if (tid == 0) meta[4] = args.window_len[slot];

  constexpr int64_t kUnit = sizeof(KvUnit);
  const int64_t k_units = args.k_bytes / kUnit, per_token = k_units + args.v_bytes / kUnit;
  const int64_t kv_count = T * per_token, ab_count = T * args.HV;
  auto kv_src = [&](const TokenUnit& u) {
    return reinterpret_cast<const KvUnit*>(args.mixed_qkv + (c0 + u.t) * args.qkv_row +
                                           args.k_bytes) +
           u.j;
  };
  auto kv_dst = [&](const TokenUnit& u) {
    return u.j < k_units ? reinterpret_cast<KvUnit*>(args.window_k + slot * args.wk_slot +
                                                     u.t * args.wk_token) +
                               u.j
                         : reinterpret_cast<KvUnit*>(args.window_v + slot * args.wv_slot +
                                                     u.t * args.wv_token) +
                               (u.j - k_units);
  };
  // Pass p: k/v units tid + kSaveThreads (kSaveBatch p + b), and element tid + kSaveThreads p of a
  // and of b (token e / HV, head e % HV). The pass count is the same in every thread.
  const int64_t kv_per_pass = int64_t(kSaveBatch) * kSaveThreads;
  const int64_t kv_passes = (kv_count + kv_per_pass - 1) / kv_per_pass;
  const int64_t ab_passes = (ab_count + kSaveThreads - 1) / kSaveThreads;
  const int64_t passes = kv_passes > ab_passes ? kv_passes : ab_passes;
  TokenUnit cursor(tid, per_token);
  for (int64_t p = 0; p < passes; ++p) {
    const TokenUnit first = cursor;
    KvUnit units[kSaveBatch];
#pragma unroll
    for (int b = 0; b < kSaveBatch; ++b) {
      if (cursor.t < T) units[b] = *kv_src(cursor);
      cursor.next(per_token);
    }
    const int64_t e = tid + p * kSaveThreads;
    const int64_t et = e / args.HV, eh = e % args.HV;
    uint32_t a_bits = 0, b_bits = 0;
    if (e < ab_count) {
      a_bits = load_raw(args.a + (c0 + et) * args.a_row + eh * args.a_size, args.a_size);
      b_bits = load_raw(args.b + (c0 + et) * args.b_row + eh * args.b_size, args.b_size);
    }
    if (p == 0) {
      __syncthreads();  // window_len[slot]
      if (classify_replay_row(c0, c1, args.L, args.S, slot, args.num_slots, args.first_valid_slot,
                              n, meta[4]) != ReplayRow::kLive)
        return;
      gdn::cuda::wait_for_prior_grids();  // the replay launch has read the old window
    }
    TokenUnit at = first;
#pragma unroll
    for (int b = 0; b < kSaveBatch; ++b) {
      if (at.t < T) *kv_dst(at) = units[b];
      at.next(per_token);
    }
    if (e < ab_count) {
      store_raw(args.window_a + slot * args.wa_slot + et * args.wa_token + eh * args.a_size,
                args.a_size, a_bits);
      store_raw(args.window_b + slot * args.wb_slot + et * args.wb_token + eh * args.b_size,
                args.b_size, b_bits);
    }
  }
  if (tid == 0) args.window_len[slot] = int(T);
}

template <class KvUnit>
inline Status launch_save_window(const WindowSaveArgs& args, int64_t N, cudaStream_t stream) {
  constexpr auto kernel = save_window_kernel<KvUnit>;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError, std::string("replay: ") + cudaGetErrorString(err));
  }
  gdn::cuda::DeviceInfo info;
  GDN_RETURN_IF_ERROR(gdn::cuda::device_info(device, &info));
  static std::atomic<int> ptx_cache[gdn::cuda::kMaxDevices];
  // Early residency only where the image waits for the replay launch itself (sm_90 code).
  const bool pdl =
      info.major >= 9 && gdn::cuda::kernel_ptx_version(kernel, device, ptx_cache) >= 90;
  return decode_mtp::cuda_detail::launch_ex(kernel, dim3(unsigned(N)), dim3(unsigned(kSaveThreads)),
                                            0, 1, pdl, stream, args, "replay: window save");
}

// k and v move in 16-byte units where every row is aligned, else element by element.
inline Status launch_save_window(const WindowSaveArgs& args, int64_t N, cudaStream_t stream) {
  if (args.vector) return launch_save_window<uint4>(args, N, stream);
  if (args.qkv_size == 4) return launch_save_window<uint32_t>(args, N, stream);
  return launch_save_window<uint16_t>(args, N, stream);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace cuda_detail

// Validates on the host (reads no device memory), applies the guard and launches both kernels on
// `stream`, on the current device (which must hold the arrays). `split` as in decode_mtp (CTAs
// per value head; 0 = chosen from the problem size). Never synchronises; safe in graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream, int split = 0) {
  namespace dm = decode_mtp::cuda_detail;
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  GDN_RETURN_IF_ERROR(dm::check_cuda_step(p, pr, "replay"));
  if (pr.N == 0) return Status::ok();
  if (pr.N > int64_t(INT32_MAX))
    return Status::unsupported("replay: more than 2^31 - 1 request rows in one call");

  dm::KernelArgs args = dm::step_kernel_args(p, pr);
  args.state_indices = p.state_indices.data;
  args.index_stride = p.state_indices.strides[0];
  args.index_dtype = p.state_indices.dtype;
  args.num_accepted_tokens = p.num_accepted_tokens.data;
  args.acc_dtype = p.num_accepted_tokens.dtype;
  args.window_k = p.window_k.data;
  args.window_v = p.window_v.data;
  args.window_a = p.window_a.data;
  args.window_b = p.window_b.data;
  args.window_len = static_cast<const int*>(p.window_len.data);
  args.wk_slot_stride = p.window_k.strides[0];
  args.wk_token_stride = p.window_k.strides[1];
  args.wv_slot_stride = p.window_v.strides[0];
  args.wv_token_stride = p.window_v.strides[1];
  args.wa_slot_stride = p.window_a.strides[0];
  args.wa_token_stride = p.window_a.strides[1];
  args.wb_slot_stride = p.window_b.strides[0];
  args.wb_token_stride = p.window_b.strides[1];
  const int64_t qkv_size = dtype_size(p.mixed_qkv.dtype);
  args.window_k_vector = dm::aligned(p.window_k.data, size_t(4 * qkv_size)) &&
                         p.window_k.strides[0] % 4 == 0 && p.window_k.strides[1] % 4 == 0;

  cuda_detail::WindowSaveArgs save{};
  save.mixed_qkv = static_cast<const char*>(p.mixed_qkv.data);
  save.a = static_cast<const char*>(p.a.data);
  save.b = static_cast<const char*>(p.b.data);
  save.state_indices = p.state_indices.data;
  save.index_stride = p.state_indices.strides[0];
  save.cu_seqlens = p.cu_seqlens.data;
  save.num_accepted_tokens = p.num_accepted_tokens.data;
  save.window_k = static_cast<char*>(p.window_k.data);
  save.window_v = static_cast<char*>(p.window_v.data);
  save.window_a = static_cast<char*>(p.window_a.data);
  save.window_b = static_cast<char*>(p.window_b.data);
  save.window_len = static_cast<int*>(p.window_len.data);
  const int64_t a_size = dtype_size(p.a.dtype), b_size = dtype_size(p.b.dtype);
  save.qkv_row = p.mixed_qkv.strides[0] * qkv_size;
  save.a_row = p.a.strides[0] * a_size;
  save.b_row = p.b.strides[0] * b_size;
  save.wk_slot = p.window_k.strides[0] * qkv_size;
  save.wk_token = p.window_k.strides[1] * qkv_size;
  save.wv_slot = p.window_v.strides[0] * qkv_size;
  save.wv_token = p.window_v.strides[1] * qkv_size;
  save.wa_slot = p.window_a.strides[0] * a_size;
  save.wa_token = p.window_a.strides[1] * a_size;
  save.wb_slot = p.window_b.strides[0] * b_size;
  save.wb_token = p.window_b.strides[1] * b_size;
  save.k_bytes = pr.H * pr.K * qkv_size;
  save.v_bytes = pr.HV * pr.V * qkv_size;
  save.L = pr.L;
  save.S = pr.S;
  save.num_slots = pr.num_slots;
  save.first_valid_slot = p.first_valid_slot;
  save.HV = int(pr.HV);
  save.qkv_size = int(qkv_size);
  save.a_size = int(a_size);
  save.b_size = int(b_size);
  save.index_dtype = p.state_indices.dtype;
  save.cu_dtype = p.cu_seqlens.dtype;
  save.acc_dtype = p.num_accepted_tokens.dtype;
  save.vector = cuda_detail::aligned16(save.mixed_qkv) && cuda_detail::aligned16(save.window_k) &&
                cuda_detail::aligned16(save.window_v) && save.qkv_row % 16 == 0 &&
                save.k_bytes % 16 == 0 && save.v_bytes % 16 == 0 && save.wk_slot % 16 == 0 &&
                save.wk_token % 16 == 0 && save.wv_slot % 16 == 0 && save.wv_token % 16 == 0;

  GDN_RETURN_IF_ERROR(dm::launch_step<true>(args, p.state.dtype, split, stream, "replay"));
  return cuda_detail::launch_save_window(save, pr.N, stream);
}

}  // namespace gdn::replay
