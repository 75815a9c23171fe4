// causal_conv1d_update on CUDA: one thread per (request, channel), a W-tap window in registers.
// Indices live in device memory and are never synchronised on: the kernel applies the row rules
// of params.hpp itself. An invalid row writes no state, zero-fills its output rows (when its
// cu_seqlens range is sane; otherwise it cannot tell which rows are its own and writes nothing)
// and bumps the optional error counter. T = 0 rows and null-slot rows are skipped (nothing
// written). Every global access is bounds-checked against the validated shapes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gdn/conv/conv_kernel_args.cuh"
#include "gdn/conv/params.hpp"
#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/launch.cuh"
#include "gdn/core/dispatch.hpp"

namespace gdn::conv {
namespace cuda_detail {

// Plain-data copy of Params/Problem for the kernel (TensorView is host-side).
struct KernelArgs {
  const void* x;
  const void* weight;
  void* conv_state;
  const void* conv_state_indices;
  const void* cu_seqlens;
  const void* num_accepted_tokens;  // null: all 1
  void* out;
  int* error_count;  // null: not counted
  DType x_dtype, weight_dtype, state_dtype, out_dtype, index_dtype, cu_dtype, acc_dtype;
  int64_t x_row_stride, out_row_stride, weight_row_stride, index_stride;
  int64_t L, N, D, W, buffer_len, S, num_slots, slot_stride, first_valid_slot;
  StateLayout layout;
  Activation activation;
};

namespace dev = gdn::cuda;  // qualified calls: gdn:: holds host functions of the same names

// kWidth = kRuntimeValue (0): width taken from args.W (<= kConvMaxWidth).
template <int kWidth>
__global__ void __launch_bounds__(128) conv_update_kernel(const KernelArgs args) {
  constexpr int kMax = kWidth == kRuntimeValue ? kConvMaxWidth : kWidth;
  const int W = kWidth == kRuntimeValue ? int(args.W) : kWidth;
  const int64_t i = blockIdx.x;  // request
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  const bool reporter = blockIdx.y == 0 && threadIdx.x == 0;  // counts this row's error once

  const int64_t begin = gdn::load_index(args.cu_seqlens, args.cu_dtype, i);
  const int64_t end = gdn::load_index(args.cu_seqlens, args.cu_dtype, i + 1);
  if (begin < 0 || end < begin || end > args.L) {  // rows unknown: write nothing
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    return;
  }
  const int64_t T = end - begin;
  if (T == 0) return;
  const int64_t slot =
      gdn::load_index(args.conv_state_indices, args.index_dtype, i * args.index_stride);
  if (slot < args.first_valid_slot) return;
  const int64_t acc =
      args.num_accepted_tokens ? gdn::load_index(args.num_accepted_tokens, args.acc_dtype, i) : 1;
  if (slot >= args.num_slots || T > args.S || acc < 1 || acc > args.S) {
    if (reporter && args.error_count) atomicAdd(args.error_count, 1);
    if (c < args.D)
      for (int64_t t = 0; t < T; ++t)
        dev::store_value(args.out, args.out_dtype, (begin + t) * args.out_row_stride + c, 0.0f);
    return;
  }
  if (c >= args.D) return;

  const auto at = [&](int64_t pos) {
    return state_offset(args.layout, args.slot_stride, args.D, args.buffer_len, slot, c, pos);
  };
  float w[kMax];
  float window[kMax];
#pragma unroll
  for (int j = 0; j < kMax; ++j)
    if (j < W)
      w[j] = dev::load_value(args.weight, args.weight_dtype, c * args.weight_row_stride + j);
  // Read the whole accepted window before the buffer is rewritten (old and new windows overlap).
#pragma unroll
  for (int j = 0; j < kMax - 1; ++j)
    if (j < W - 1) window[j] = dev::load_value(args.conv_state, args.state_dtype, at(acc - 1 + j));
#pragma unroll
  for (int j = 0; j < kMax - 2; ++j)
    if (j < W - 2) dev::store_value(args.conv_state, args.state_dtype, at(j), window[j + 1]);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t l = begin + t;
    const float xv =
        dev::load_value(args.x, args.x_dtype, l * args.x_row_stride + c);  // before out: may alias
    // Fixed order, no contraction: the same sum as the CPU path and as T one-token calls.
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMax - 1; ++j)
      if (j < W - 1) sum = __fadd_rn(sum, __fmul_rn(w[j], window[j]));
    sum = __fadd_rn(sum, __fmul_rn(w[W - 1], xv));
    const float y = args.activation == Activation::kSiLU ? sum / (1.0f + expf(-sum)) : sum;
    dev::store_value(args.out, args.out_dtype, l * args.out_row_stride + c, y);
    dev::store_value(args.conv_state, args.state_dtype, at(W - 2 + t), xv);
#pragma unroll
    for (int j = 0; j < kMax - 2; ++j)
      if (j < W - 2) window[j] = window[j + 1];
    window[W - 2] = dev::round_to(args.state_dtype, xv);
  }
}

}  // namespace cuda_detail

// Launches causal_conv1d_update on `stream`. Validates the arguments on the host (reads no device
// memory), allocates nothing, never synchronises; safe inside CUDA-graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream) {
  Problem pr;
  GDN_RETURN_IF_ERROR(cuda::check_cuda_call(p, &pr));
  if (pr.N == 0) return Status::ok();
  constexpr int kThreads = 128;
  const int64_t channel_blocks = (pr.D + kThreads - 1) / kThreads;
  if (pr.N > 0x7fffffff || channel_blocks > 65535)
    return Status::unsupported("causal_conv1d_update: N = " + std::to_string(pr.N) +
                               ", D = " + std::to_string(pr.D) + " exceed the launch grid");
  cuda_detail::KernelArgs a{};
  fill_conv_kernel_args(p, pr, a);
  a.conv_state_indices = p.conv_state_indices.data;
  a.num_accepted_tokens = p.num_accepted_tokens.data_or_null();
  a.x_dtype = p.x.dtype;
  a.index_dtype = p.conv_state_indices.dtype;
  a.acc_dtype = p.num_accepted_tokens.present() ? p.num_accepted_tokens.dtype : DType::kInt32;
  a.index_stride = p.conv_state_indices.strides[0];
  a.S = pr.S;

  const dim3 grid(unsigned(pr.N), unsigned(channel_blocks));
  dispatch_or_runtime<ConvWidths>(int(pr.W), [&]<int kWidth>() {
    cuda_detail::conv_update_kernel<kWidth><<<grid, kThreads, 0, stream>>>(a);
  });
  return cuda::launch_status("causal_conv1d_update");
}

}  // namespace gdn::conv
