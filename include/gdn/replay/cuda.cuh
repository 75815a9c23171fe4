// Replay verify on CUDA (K = V = 128): the launcher. Contract: docs replay.md.
//
// Two launches on the caller's stream:
//   1. the decode_mtp kernel in replay mode (gdn/decode_mtp/cuda_kernel.cuh, same mapping and
//      split): each CTA reads its rows of the checkpoint and the window tokens it replays, stores
//      the advanced checkpoint rows once and writes its outputs. It never writes the window.
//   2. the window save below: one CTA per request copies the new tokens' raw k, v, a, b rows into
//      the slot's window and sets window_len. It starts only after every CTA of launch 1 has
//      finished (stream order; with programmatic dependent launch its CTAs may be resident early
//      but wait for launch 1's completion before any access), so no window row is overwritten
//      while a CTA of another value head or row block still replays it.
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

using decode_mtp::cuda_detail::classify_replay_row;
using decode_mtp::cuda_detail::ReplayRow;

inline constexpr int kSaveThreads = 256;

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

// Copies `count` units of `Unit` (element i of token t at src(t) + i, dst(t) + i) by the whole CTA.
// Each thread loads kBatch units before storing them, so a request's copy costs a few memory
// round trips rather than one per token (the loads do not wait behind the previous stores).
template <class Unit, class Src, class Dst>
__device__ __forceinline__ void cta_copy_tokens(int64_t tokens, int64_t per_token, Src src,
                                                Dst dst) {
  constexpr int kBatch = 8;
  const int64_t count = tokens * per_token;
  int64_t t = threadIdx.x / per_token, i = threadIdx.x % per_token;  // of unit `base`
  for (int64_t base = threadIdx.x; base < count; base += int64_t(kBatch) * kSaveThreads) {
    Unit u[kBatch];
    int64_t ts[kBatch], is[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {  // unit base + b * kSaveThreads is element i of token t
      ts[b] = t;
      is[b] = i;
      if (t < tokens) u[b] = reinterpret_cast<const Unit*>(src(t))[i];
      for (i += kSaveThreads; i >= per_token; i -= per_token) ++t;  // no division per unit
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (ts[b] < tokens) reinterpret_cast<Unit*>(dst(ts[b]))[is[b]] = u[b];
  }
}

// One token's k and v (k_bytes + v_bytes, contiguous in mixed_qkv's row, split in the window),
// in units of `Unit`.
template <class Unit>
__device__ __forceinline__ void copy_kv(const WindowSaveArgs& args, int64_t slot, int64_t c0,
                                        int64_t T) {
  const int64_t k_units = args.k_bytes / int64_t(sizeof(Unit));
  const int64_t v_units = args.v_bytes / int64_t(sizeof(Unit));
  cta_copy_tokens<Unit>(
      T, k_units,
      [&](int64_t t) { return args.mixed_qkv + (c0 + t) * args.qkv_row + args.k_bytes; },
      [&](int64_t t) { return args.window_k + slot * args.wk_slot + t * args.wk_token; });
  cta_copy_tokens<Unit>(
      T, v_units,
      [&](int64_t t) { return args.mixed_qkv + (c0 + t) * args.qkv_row + 2 * args.k_bytes; },
      [&](int64_t t) { return args.window_v + slot * args.wv_slot + t * args.wv_token; });
}

// a or b (HV elements per token, `size` bytes each) of T tokens into its window.
template <class Unit>
__device__ __forceinline__ void copy_gate(const char* src, int64_t src_row, char* dst,
                                          int64_t dst_slot, int64_t dst_token, int64_t slot,
                                          int64_t c0, int64_t T, int HV) {
  cta_copy_tokens<Unit>(
      T, HV, [&](int64_t t) { return src + (c0 + t) * src_row; },
      [&](int64_t t) { return dst + slot * dst_slot + t * dst_token; });
}

// One CTA per request row. A template so that a header-defined kernel has one definition however
// many translation units include it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    save_window_kernel(const __grid_constant__ WindowSaveArgs args) {
  static_assert(kThreads == kSaveThreads, "the copies stride by kSaveThreads");
  __shared__ int64_t meta[5];         // slot, c0, c1, replay count, window_len[slot]
  gdn::cuda::wait_for_prior_grids();  // the replay launch has read every window it replays
  gdn::cuda::allow_dependent_launch();
  const int64_t i = blockIdx.x;
  if (threadIdx.x == 0) {
    const int64_t slot =
        gdn::cuda::load_index(args.state_indices, args.index_dtype, i * args.index_stride);
    meta[0] = slot;
    meta[1] = gdn::cuda::load_index(args.cu_seqlens, args.cu_dtype, i);
    meta[2] = gdn::cuda::load_index(args.cu_seqlens, args.cu_dtype, i + 1);
    meta[3] = gdn::cuda::load_index(args.num_accepted_tokens, args.acc_dtype, i);
    meta[4] = slot >= 0 && slot < args.num_slots ? int64_t(args.window_len[slot]) : 0;
  }
  __syncthreads();
  const int64_t slot = meta[0], c0 = meta[1], c1 = meta[2], T = c1 - c0;
  if (classify_replay_row(c0, c1, args.L, args.S, slot, args.num_slots, args.first_valid_slot,
                          meta[3], meta[4]) != ReplayRow::kLive)
    return;
  if (args.vector)
    copy_kv<uint4>(args, slot, c0, T);
  else if (args.qkv_size == 4)
    copy_kv<uint32_t>(args, slot, c0, T);
  else
    copy_kv<uint16_t>(args, slot, c0, T);
  if (args.a_size == 4)
    copy_gate<uint32_t>(args.a, args.a_row, args.window_a, args.wa_slot, args.wa_token, slot, c0, T,
                        args.HV);
  else
    copy_gate<uint16_t>(args.a, args.a_row, args.window_a, args.wa_slot, args.wa_token, slot, c0, T,
                        args.HV);
  if (args.b_size == 4)
    copy_gate<uint32_t>(args.b, args.b_row, args.window_b, args.wb_slot, args.wb_token, slot, c0, T,
                        args.HV);
  else
    copy_gate<uint16_t>(args.b, args.b_row, args.window_b, args.wb_slot, args.wb_token, slot, c0, T,
                        args.HV);
  if (threadIdx.x == 0) args.window_len[slot] = int(T);  // this thread read it above
}

inline Status launch_save_window(const WindowSaveArgs& args, int64_t N, cudaStream_t stream) {
  constexpr auto kernel = save_window_kernel<kSaveThreads>;
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
