// causal_conv1d_prefill on CUDA. Indices live in device memory and are never synchronised on: the
// kernel applies the row rules of params.hpp itself (classify_row). An invalid row writes no
// state, zero-fills its output rows (when its cu_seqlens range is sane; otherwise it cannot tell
// which rows are its own and writes nothing) and is counted once in the optional error counter.
// Every global access is bounds-checked against the validated shapes, whatever the indices hold.
//
// Work is split over tiles of kTileRows token rows x kChannels channels of the L rows, whatever
// the requests' lengths: a CTA stages its rows, plus the W - 1 rows before them, in shared memory
// (fp32), finds the request of every row (a binary search over cu_seqlens, which a valid call
// holds non-decreasing) and computes each output from the staged rows, or from the request's
// initial slot for the taps before the request's first row. Two forms:
//
// - out is not x (kInPlace false): a CTA owns one tile. The rows before it are read from x, which
//   no CTA writes. The first W - 1 rows of a request (the only ones whose taps read the initial
//   slot) belong to the CTA of the request's first row, even where they run past its tile, and the
//   same CTA writes the final slot after a barrier: every read of the initial slot precedes the
//   write of the final one, so the two may be one slot.
// - out is x (kInPlace true): a row's output overwrites an input that the next W - 1 rows still
//   read, so the rows of a request must not be split between CTAs. A CTA owns the requests that
//   begin in its segment of kSegmentRows rows and walks their rows tile by tile, carrying the last
//   W - 1 raw rows of a tile in shared memory to the next; it writes a request's final slot in the
//   tile of the request's last row, after the barrier that follows every read of its history.
//
// With a cu_seqlens that is not non-decreasing (a call with an invalid row) the rows of other
// requests may be left unwritten or, in place, computed from overwritten inputs; no access leaves
// the arrays and every invalid row is counted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/cuda/device.cuh"
#include "gdn/core/dispatch.hpp"

namespace gdn::conv_prefill {
namespace cuda_detail {

// Plain-data copy of Params/Problem for the kernel (TensorView is host-side).
struct KernelArgs {
  const void* x;
  const void* weight;
  void* conv_state;
  const void* initial_state_indices;
  const void* final_state_indices;
  const void* cu_seqlens;
  void* out;
  int* error_count;  // null: not counted
  DType x_dtype, weight_dtype, state_dtype, out_dtype, initial_dtype, final_dtype, cu_dtype;
  int64_t x_row_stride, out_row_stride, weight_row_stride, initial_stride, final_stride;
  int64_t L, N, D, W, buffer_len, num_slots, slot_stride, first_valid_slot;
  StateLayout layout;
  Activation activation;
};

namespace dev = gdn::cuda;  // qualified calls: gdn:: holds host functions of the same names

inline constexpr int kThreads = 256;
inline constexpr int kTileRows = 64;
// In place: the rows of a segment (the requests beginning in it belong to one CTA).
inline constexpr int64_t kSegmentRows = 256;
// Channels of a CTA: a warp reads 32 consecutive channels of a row. In place a CTA walks whole
// requests, so narrower CTAs give a long request more of them.
template <bool kInPlace>
inline constexpr int kChannelsOf = kInPlace ? 32 : 64;

// The request a token row belongs to, as the kernel sees it.
struct RowOwner {
  int64_t begin, end;         // the request's rows
  int64_t initial, final_id;  // slots; -1: null
  int action;                 // kSkip, kRun, kZero
};
enum : int { kSkip = 0, kRun = 1, kZero = 2 };

__device__ __forceinline__ int64_t load_cu(const KernelArgs& a, int64_t i) {
  return gdn::load_index(a.cu_seqlens, a.cu_dtype, i);
}

// The owner of token row r (0 <= r < L): the request i with cu[i] <= r < cu[i + 1], found by
// binary search for the first i with cu[i + 1] > r.
__device__ inline RowOwner find_owner(const KernelArgs& a, int64_t r) {
  int64_t lo = 0, hi = a.N;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (load_cu(a, mid + 1) > r)
      hi = mid;
    else
      lo = mid + 1;
  }
  RowOwner o{0, 0, -1, -1, kSkip};
  if (lo >= a.N) return o;
  const int64_t c0 = load_cu(a, lo), c1 = load_cu(a, lo + 1);
  if (!(c0 <= r && r < c1)) return o;
  const int64_t initial =
      gdn::load_index(a.initial_state_indices, a.initial_dtype, lo * a.initial_stride);
  const int64_t final_id =
      gdn::load_index(a.final_state_indices, a.final_dtype, lo * a.final_stride);
  const RowClass cls = classify_row(c0, c1, a.L, initial, final_id, a.num_slots);
  o.begin = c0;
  o.end = c1;
  if (cls == RowClass::kLive) {
    o.initial = initial < a.first_valid_slot ? -1 : initial;
    o.final_id = final_id < a.first_valid_slot ? -1 : final_id;
    o.action = kRun;
  } else if (c0 >= 0 && c1 >= c0 && c1 <= a.L) {
    o.action = kZero;  // an invalid row whose own rows are known
  }
  return o;
}

// The first request boundary (an entry of cu_seqlens) at or after row r, or L.
__device__ inline int64_t boundary_at_or_after(const KernelArgs& a, int64_t r) {
  if (r >= a.L) return a.L;
  int64_t lo = 0, hi = a.N + 1;  // first j with cu[j] >= r
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (load_cu(a, mid) >= r)
      hi = mid;
    else
      lo = mid + 1;
  }
  if (lo > a.N) return a.L;
  const int64_t b = load_cu(a, lo);
  return b < 0 ? 0 : (b > a.L ? a.L : b);
}

__device__ __forceinline__ float activate(const KernelArgs& a, float sum) {
  return a.activation == Activation::kSiLU ? sum / (1.0f + expf(-sum)) : sum;
}

// kWidth = kRuntimeValue (0): width taken from a.W (<= kConvMaxWidth).
template <int kWidth, bool kInPlace>
__global__ void __launch_bounds__(kThreads) conv_prefill_kernel(const KernelArgs a) {
  constexpr int kMax = kWidth == kRuntimeValue ? kConvMaxWidth : kWidth;
  constexpr int kChannels = kChannelsOf<kInPlace>;
  constexpr int kRowLanes = kThreads / kChannels;
  // Staged rows: W - 1 before the tile, the tile, and (one tile per CTA) the W - 2 rows after it
  // that the first rows of a request beginning in the tile may reach.
  constexpr int kStaged = (kMax - 1) + kTileRows + (kInPlace ? 0 : kMax - 2);
  constexpr int kLoads = (kStaged + kRowLanes - 1) / kRowLanes;
  __shared__ float tile[kStaged][kChannels];
  __shared__ RowOwner owner[kStaged];

  const int W = kWidth == kRuntimeValue ? int(a.W) : kWidth;
  const int H = W - 1;
  const int tid = int(threadIdx.x);
  const int lane = tid % kChannels;  // channel within the CTA's block
  const int row_lane = tid / kChannels;
  const int64_t c = int64_t(blockIdx.y) * kChannels + lane;
  const bool channel_ok = c < a.D;

  // Every invalid row is counted once, by the first CTA.
  if (a.error_count && blockIdx.x == 0 && blockIdx.y == 0) {
    for (int64_t i = tid; i < a.N; i += kThreads) {
      const int64_t initial =
          gdn::load_index(a.initial_state_indices, a.initial_dtype, i * a.initial_stride);
      const int64_t final_id =
          gdn::load_index(a.final_state_indices, a.final_dtype, i * a.final_stride);
      if (classify_row(load_cu(a, i), load_cu(a, i + 1), a.L, initial, final_id, a.num_slots) ==
          RowClass::kInvalid)
        atomicAdd(a.error_count, 1);
    }
  }

  float w[kMax];
#pragma unroll
  for (int j = 0; j < kMax; ++j)
    w[j] = channel_ok && j < W
               ? dev::load_value(a.weight, a.weight_dtype, c * a.weight_row_stride + j)
               : 0.0f;
  // Slot position `pos` of this thread's channel.
  const auto at = [&](int64_t slot, int64_t pos) {
    return conv::state_offset(a.layout, a.slot_stride, a.D, a.buffer_len, slot, c, pos);
  };
  // History column `col` (< H) of an initial slot: what causal_conv1d_update reads at offset 0.
  const auto history = [&](int64_t initial, int64_t col) {
    return initial >= 0 ? dev::load_value(a.conv_state, a.state_dtype, at(initial, col)) : 0.0f;
  };

  // The rows this CTA walks: one tile, or (in place) the requests beginning in its segment.
  int64_t first, last;
  if constexpr (kInPlace) {
    first = boundary_at_or_after(a, int64_t(blockIdx.x) * kSegmentRows);
    last = boundary_at_or_after(a, (int64_t(blockIdx.x) + 1) * kSegmentRows);
  } else {
    first = int64_t(blockIdx.x) * kTileRows;
    last = first + kTileRows < a.L ? first + kTileRows : a.L;
  }

  for (int64_t t0 = first; t0 < last; t0 += kTileRows) {
    const int rows = int(last - t0 < kTileRows ? last - t0 : kTileRows);
    // Staged row k is token row t0 - H + k. Rows read: in place only the tile's own (the rows
    // before it are the carried ones, or precede the segment's first request); otherwise the H
    // rows before the tile and the H - 1 after it too.
    const int k_begin = kInPlace ? H : 0;
    const int k_end = kInPlace ? H + rows : 2 * H + rows - 1;
    // Loads first, into registers, so that they are in flight during the owner search.
    float staged[kLoads];
#pragma unroll
    for (int m = 0; m < kLoads; ++m) {
      const int k = row_lane + m * kRowLanes;
      const int64_t r = t0 - H + k;
      staged[m] = k >= k_begin && k < k_end && r >= 0 && r < a.L && channel_ok
                      ? dev::load_value(a.x, a.x_dtype, r * a.x_row_stride + c)
                      : 0.0f;
    }
    for (int k = H + tid; k < k_end; k += kThreads) {
      const int64_t r = t0 - H + k;
      owner[k] = r < a.L ? find_owner(a, r) : RowOwner{0, 0, -1, -1, kSkip};
    }
#pragma unroll
    for (int m = 0; m < kLoads; ++m) {
      const int k = row_lane + m * kRowLanes;
      if (k >= k_begin && k < kStaged) tile[k][lane] = staged[m];
    }
    __syncthreads();

    // Outputs.
    for (int k = H + row_lane; k < k_end; k += kRowLanes) {
      const RowOwner o = owner[k];
      const int64_t r = t0 - H + k;
      if (o.action == kSkip || !channel_ok) continue;
      if (!kInPlace) {
        // The first H rows of a request belong to the CTA of its first row.
        const int64_t owner_row = r - o.begin < H ? o.begin : r;
        if (owner_row < t0 || owner_row >= t0 + rows) continue;
      }
      if (o.action == kZero) {
        dev::store_value(a.out, a.out_dtype, r * a.out_row_stride + c, 0.0f);
        continue;
      }
      // Fixed order, no contraction: the same sum as the CPU path and causal_conv1d_update.
      float sum = 0.0f;
      for (int j = 0; j < H; ++j) {
        const int64_t pos = r - H + j;  // the tap's token row
        const float v = pos >= o.begin ? dev::round_to(a.state_dtype, tile[k - H + j][lane])
                                       : history(o.initial, pos - o.begin + H);
        sum = __fadd_rn(sum, __fmul_rn(w[j], v));
      }
      sum = __fadd_rn(sum, __fmul_rn(w[H], tile[k][lane]));
      dev::store_value(a.out, a.out_dtype, r * a.out_row_stride + c, activate(a, sum));
    }
    __syncthreads();  // every read of an initial slot in this tile is done

    // Final slots: of the requests beginning in this tile (one tile per CTA), or ending in it (in
    // place, where the last inputs are still staged).
    for (int k = H + row_lane; k < H + rows; k += kRowLanes) {
      const RowOwner o = owner[k];
      const int64_t r = t0 - H + k;
      if (o.action != kRun || o.final_id < 0 || !channel_ok) continue;
      if (r != (kInPlace ? o.end - 1 : o.begin)) continue;
      // The last H inputs F[T .. T + H - 1], all read before the first write.
      float last_inputs[kMax];
#pragma unroll
      for (int j = 0; j < kMax - 1; ++j) {
        if (j >= H) continue;
        const int64_t pos = o.end - H + j;
        float v;
        if (pos < o.begin) {
          v = history(o.initial, pos - o.begin + H);
        } else if constexpr (kInPlace) {
          v = dev::round_to(a.state_dtype, tile[pos - (t0 - H)][lane]);
        } else {
          v = dev::round_to(a.state_dtype,
                            dev::load_value(a.x, a.x_dtype, pos * a.x_row_stride + c));
        }
        last_inputs[j] = v;
      }
      if (o.final_id != o.initial) {
        for (int64_t pos = H; pos < a.buffer_len; ++pos) {
          const float v = o.initial >= 0
                              ? dev::load_value(a.conv_state, a.state_dtype, at(o.initial, pos))
                              : 0.0f;
          dev::store_value(a.conv_state, a.state_dtype, at(o.final_id, pos), v);
        }
      }
#pragma unroll
      for (int j = 0; j < kMax - 1; ++j)
        if (j < H) dev::store_value(a.conv_state, a.state_dtype, at(o.final_id, j), last_inputs[j]);
    }

    if constexpr (kInPlace) {
      // Carry the tile's last H raw rows to the front for the next tile (a full one: a shorter
      // tile ends the segment).
      if (t0 + kTileRows < last) {
        float carry[kMax - 1];
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kMax - 1; ++m) {
          const int k = row_lane + m * kRowLanes;
          carry[m] = k < H ? tile[kTileRows + k][lane] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kMax - 1; ++m) {
          const int k = row_lane + m * kRowLanes;
          if (k < H) tile[k][lane] = carry[m];
        }
      }
      __syncthreads();  // the staged rows and owners are free for the next tile
    }
  }
}

}  // namespace cuda_detail

// Launches causal_conv1d_prefill on `stream`. Validates the arguments on the host (reads no device
// memory), allocates nothing, never synchronises; safe inside CUDA-graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  if (pr.device.type != DeviceType::kCUDA)
    return Status::invalid("launch_cuda was given tensors on " + to_string(pr.device));
  if (pr.N == 0) return Status::ok();
  // In place is out == x (check_arguments refuses any other sharing of x's pointer).
  const bool in_place = p.out.data == p.x.data && pr.L > 0;
  const int channels = in_place ? cuda_detail::kChannelsOf<true> : cuda_detail::kChannelsOf<false>;
  const int64_t rows_per_cta = in_place ? cuda_detail::kSegmentRows : cuda_detail::kTileRows;
  const int64_t channel_blocks = (pr.D + channels - 1) / channels;
  // At least one CTA: the first counts the invalid rows even of a call without token rows.
  const int64_t row_blocks = pr.L > 0 ? (pr.L + rows_per_cta - 1) / rows_per_cta : 1;
  if (row_blocks > 0x7fffffff || channel_blocks > 65535)
    return Status::unsupported("causal_conv1d_prefill: L = " + std::to_string(pr.L) +
                               ", D = " + std::to_string(pr.D) + " exceed the launch grid");
  cuda_detail::KernelArgs a{};
  a.x = p.x.data;
  a.weight = p.weight.data;
  a.conv_state = p.conv_state.data;
  a.initial_state_indices = p.initial_state_indices.data;
  a.final_state_indices = p.final_state_indices.data;
  a.cu_seqlens = p.cu_seqlens.data;
  a.out = p.out.data;
  a.error_count = p.error_count.present() ? static_cast<int*>(p.error_count.data) : nullptr;
  a.x_dtype = p.x.dtype;
  a.weight_dtype = p.weight.dtype;
  a.state_dtype = p.conv_state.dtype;
  a.out_dtype = p.out.dtype;
  a.initial_dtype = p.initial_state_indices.dtype;
  a.final_dtype = p.final_state_indices.dtype;
  a.cu_dtype = p.cu_seqlens.dtype;
  a.x_row_stride = p.x.strides[0];
  a.out_row_stride = p.out.strides[0];
  a.weight_row_stride = p.weight.strides[0];
  a.initial_stride = p.initial_state_indices.strides[0];
  a.final_stride = p.final_state_indices.strides[0];
  a.L = pr.L;
  a.N = pr.N;
  a.D = pr.D;
  a.W = pr.W;
  a.buffer_len = pr.buffer_len;
  a.num_slots = pr.num_slots;
  a.slot_stride = pr.slot_stride;
  a.first_valid_slot = p.first_valid_slot;
  a.layout = p.layout;
  a.activation = p.activation;

  const dim3 grid{unsigned(row_blocks), unsigned(channel_blocks)};
  dispatch_or_runtime<ConvWidths>(int(pr.W), [&]<int kWidth>() {
    if (in_place)
      cuda_detail::conv_prefill_kernel<kWidth, true><<<grid, cuda_detail::kThreads, 0, stream>>>(a);
    else
      cuda_detail::conv_prefill_kernel<kWidth, false>
          <<<grid, cuda_detail::kThreads, 0, stream>>>(a);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string("causal_conv1d_prefill launch failed: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace gdn::conv_prefill
