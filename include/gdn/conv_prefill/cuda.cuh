// causal_conv1d_prefill on CUDA. Indices live in device memory and are never synchronised on: the
// kernel applies the row rules of params.hpp itself (classify_row). An invalid row writes no
// state, zero-fills its output rows (when its cu_seqlens range is sane; otherwise it cannot tell
// which rows are its own and writes nothing) and is counted once in the optional error counter.
// Every global access is bounds-checked against the validated shapes, whatever the indices hold.
//
// Work layout. A CTA owns a slice of kRowThreads * V channels (V elements of x in 16 bytes, so a
// row of the slice is one 128-byte line) over a segment of token rows, which it walks in tiles of
// kTileRows rows (one run of kRunRows rows per kRowThreads threads). The tiles stream through a
// ring of kStages tiles in shared memory (cp.async): tile t + 1 is in flight while tile t is
// computed, and tile t - 1 is still there. Thread (rl, cl) of a tile reads the kRunRows consecutive
// rows of run rl from the ring, V channels each, and slides a W - 1 row window (the taps before
// the current row, as fp32) down its run. The W - 1 rows before a run (its halo) are the ring's
// rows before it, in tile t or t - 1; the first run of a segment reads x (out of place) or needs
// none (in place, see below). So every row of x is loaded from global memory once, into the ring;
// out of place a few are read again from x: the first halo of a segment, and the rows a request's
// head reads past its run (see below).
//
// A row's taps before its request's first row read the request's history from the initial slot
// instead (zeros for a null id); a run that starts a request resets its window there.
//
// Two forms, one kernel (kInPlace):
//
// - out is not x. Segments are fixed row ranges, so one request may span many CTAs. x is never
//   written, so any thread may read any row of it. The history of request i is read by one thread
//   only, the one whose run holds the request's first row (its head): it computes the request's
//   first W - 1 outputs itself, past the end of its run when need be (threads whose run starts
//   inside that zone skip those rows), and it writes the final slot after its own history reads,
//   taking the last W - 1 inputs from x. So a final slot equal to the initial one is read before
//   it is written, whichever CTA runs first.
// - out is x. A row's output overwrites an input that the next W - 1 rows still read, so the rows
//   of a request are never split between CTAs: a CTA owns the requests that begin in its segment
//   and no other CTA reads or writes their rows. Inside the CTA every use of a row's input goes
//   through the ring: (1) tile t is loaded into the ring before barrier A_t (its cp.async group is
//   waited for before A_t), by any thread, and no thread stores a row of tile t before A_t; (2) a
//   thread stores only rows of its own run, after A_t, and the loads issued after A_t are of tile t
//   + 2, other rows; (3) the ring's stage of tile t - 1, which holds halos read after A_t, is
//   refilled only after B_t. The history of a request is read by the
//   threads whose runs hold its first W - 1 rows, in tiles up to the one of its last row; its final
//   slot is written by the thread of its last row after barrier B of that tile (the window after
//   that row, kept until then), so after every read of the initial slot. Segments begin at request
//   boundaries, so a segment's first run needs no halo.
//
// A final slot that is another request's initial slot is read and written in no defined order
// (params.hpp). With a cu_seqlens that is not non-decreasing (a call with an invalid row) the rows
// of other requests may be left unwritten or, in place, computed from overwritten inputs; no access
// leaves the arrays and every invalid row is counted.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gdn/conv/conv_kernel_args.cuh"
#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/cuda/device.cuh"
#include "gdn/core/cuda/launch.cuh"
#include "gdn/core/cuda/mma.cuh"
#include "gdn/core/dispatch.hpp"

namespace gdn::conv_prefill {
namespace cuda_detail {

// Plain-data copy of Params/Problem for the kernel (TensorView is host-side). x's dtype is the
// kernel's element type; out's too, unless the kernel stores through out_dtype.
struct KernelArgs {
  const void* x;
  const void* weight;
  void* conv_state;
  const void* initial_state_indices;
  const void* final_state_indices;
  const void* cu_seqlens;
  void* out;
  int* error_count;  // null: not counted
  DType weight_dtype, state_dtype, out_dtype, initial_dtype, final_dtype, cu_dtype;
  int64_t x_row_stride, out_row_stride, weight_row_stride, initial_stride, final_stride;
  int64_t L, N, D, W, buffer_len, num_slots, slot_stride, first_valid_slot;
  StateLayout layout;
  Activation activation;
  bool x_vector, out_vector;  // rows of x / out may be accessed 16 bytes at a time
  bool round_to_state;        // x values change when stored in the state dtype
};

namespace dev = gdn::cuda;  // qualified calls: gdn:: holds host functions of the same names

inline constexpr int kThreads = 256;
inline constexpr int kRowThreads = 8;                     // threads across a row of the slice
inline constexpr int kRowLanes = kThreads / kRowThreads;  // runs per tile
inline constexpr int64_t kSegmentRows = 1024;             // rows of a CTA (in place: start)
inline constexpr int kRunRows = 4;                        // consecutive rows of a thread
inline constexpr int kTileRows = kRowLanes * kRunRows;
// Tiles of x in the CTA's shared ring: while one is computed the next is in flight, and the one
// before it still holds the first run's halo. Two CTAs share an SM within 128 registers a thread.
inline constexpr int kStages = 3;
static_assert(kConvMaxWidth - 1 <= kTileRows, "a halo lies in the tile before at most");
static_assert(kSegmentRows % kTileRows == 0);

// The 16-byte vector of x / out elements a thread holds per row: V elements, fp32 <-> raw bits.
template <class T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_f32(uint32_t b) { return __uint_as_float(b); }
  static __device__ __forceinline__ uint32_t pack(float a) { return __float_as_uint(a); }
};
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f32(uint32_t b) { return __uint_as_float(b << 16); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ float to_f32(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};

__device__ __forceinline__ uint32_t word(const uint4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}
__device__ __forceinline__ void set_word(uint4& r, int i, uint32_t v) {
  if (i == 0)
    r.x = v;
  else if (i == 1)
    r.y = v;
  else if (i == 2)
    r.z = v;
  else
    r.w = v;
}

// Bits of element k (< V) of a row vector, and the reverse.
template <class T>
__device__ __forceinline__ uint32_t element_bits(const uint4& r, int k) {
  if constexpr (sizeof(T) == 4) return word(r, k);
  return (word(r, k / 2) >> (16 * (k % 2))) & 0xffffu;
}

template <class T>
__device__ __forceinline__ void unpack(const uint4& r, float (&v)[16 / sizeof(T)]) {
#pragma unroll
  for (int k = 0; k < 16 / int(sizeof(T)); ++k) v[k] = Elem<T>::to_f32(element_bits<T>(r, k));
}

template <class T>
__device__ __forceinline__ uint4 pack(const float (&v)[16 / sizeof(T)]) {
  uint4 r;
  if constexpr (sizeof(T) == 4) {
    r = make_uint4(Elem<T>::pack(v[0]), Elem<T>::pack(v[1]), Elem<T>::pack(v[2]),
                   Elem<T>::pack(v[3]));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) set_word(r, i, Elem<T>::pack(v[2 * i], v[2 * i + 1]));
  }
  return r;
}

// Elements [0, n) of a row at p, one 16-byte access when `vector` (n = V, p aligned); zeros past n.
template <class T>
__device__ __forceinline__ uint4 load_row(const T* p, int n, bool vector) {
  if (vector) return *reinterpret_cast<const uint4*>(p);
  uint4 r{0u, 0u, 0u, 0u};
  const auto* q =
      reinterpret_cast<const std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>*>(p);
#pragma unroll
  for (int k = 0; k < 16 / int(sizeof(T)); ++k) {
    if (k >= n) break;
    if constexpr (sizeof(T) == 4) {
      set_word(r, k, q[k]);
    } else {
      set_word(r, k / 2, word(r, k / 2) | (uint32_t(q[k]) << (16 * (k % 2))));
    }
  }
  return r;
}

template <class T>
__device__ __forceinline__ void store_row(T* p, int n, bool vector, const uint4& r) {
  if (vector) {
    __stcs(reinterpret_cast<uint4*>(p), r);
    return;
  }
  auto* q = reinterpret_cast<std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>*>(p);
#pragma unroll
  for (int k = 0; k < 16 / int(sizeof(T)); ++k) {
    if (k >= n) break;
    q[k] = static_cast<std::remove_reference_t<decltype(q[k])>>(element_bits<T>(r, k));
  }
}

// win[j] (j < H) is the tap of row r - H + j of the row r about to be computed; rolling pushes the
// input of row r as the newest. Written for a run-time H too (selects, no dynamic register index).
template <int kHalo, int kV>
__device__ __forceinline__ void roll(float (&win)[kHalo][kV], const float (&v)[kV], int H) {
#pragma unroll
  for (int j = 0; j < kHalo; ++j)
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      if (j + 1 < kHalo && j + 1 < H)
        win[j][k] = win[j + 1 < kHalo ? j + 1 : j][k];
      else if (j + 1 == H)
        win[j][k] = v[k];
    }
}

// The request a token row belongs to, as the kernel sees it.
struct RowOwner {
  int64_t begin, end;         // the request's rows; a row of no request: [r, r + 1)
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
  RowOwner o{r, r + 1, -1, -1, kSkip};
  if (lo >= a.N) return o;
  const int64_t c0 = load_cu(a, lo), c1 = load_cu(a, lo + 1);
  if (!(c0 <= r && r < c1)) return o;
  const int64_t initial =
      gdn::load_index(a.initial_state_indices, a.initial_dtype, lo * a.initial_stride);
  const int64_t final_id =
      gdn::load_index(a.final_state_indices, a.final_dtype, lo * a.final_stride);
  const RowClass cls = classify_row(c0, c1, a.L, initial, final_id, a.num_slots);
  if (cls == RowClass::kLive) {
    o = RowOwner{c0, c1, initial < a.first_valid_slot ? -1 : initial,
                 final_id < a.first_valid_slot ? -1 : final_id, kRun};
  } else if (c0 >= 0 && c1 >= c0 && c1 <= a.L) {
    o = RowOwner{c0, c1, -1, -1, kZero};  // an invalid row whose own rows are known
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

// T: x's element type (and out's when kSameOut; otherwise out is stored through a.out_dtype).
// kWidth = kRuntimeValue (0): width taken from a.W (<= kConvMaxWidth).
template <class T, bool kSameOut, int kWidth, bool kInPlace>
__global__ void __launch_bounds__(kThreads, 2) conv_prefill_kernel(const KernelArgs a) {
  constexpr int kV = 16 / int(sizeof(T));
  constexpr int kMax = kWidth == kRuntimeValue ? kConvMaxWidth : kWidth;
  constexpr int kHalo = kMax - 1;
  __shared__ uint4 ring[kStages][kTileRows][kRowThreads];  // tile k in ring[k % kStages]

  const int H = kWidth == kRuntimeValue ? int(a.W) - 1 : kHalo;
  const int tid = int(threadIdx.x);
  const int cl = tid % kRowThreads;
  const int rl = tid / kRowThreads;
  const int64_t c0 = (int64_t(blockIdx.x) * kRowThreads + cl) * kV;
  const int n = a.D - c0 >= kV ? kV : (a.D > c0 ? int(a.D - c0) : 0);  // channels held
  const T* x = static_cast<const T*>(a.x);

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

  // The rows this CTA walks: a fixed range, or (in place) the requests beginning in it.
  const int64_t seg = int64_t(blockIdx.y) * kSegmentRows;
  const int64_t first = kInPlace ? boundary_at_or_after(a, seg) : seg;
  const int64_t last = kInPlace ? boundary_at_or_after(a, seg + kSegmentRows)
                                : (seg + kSegmentRows < a.L ? seg + kSegmentRows : a.L);
  if (first >= last) return;  // CTA-uniform

  const auto load = [&](int64_t r) {
    return n > 0 ? load_row(x + r * a.x_row_stride + c0, n, a.x_vector && n == kV)
                 : uint4{0u, 0u, 0u, 0u};
  };
  // Starts loading tile k (rows first + k kTileRows ..) into its ring stage as one cp.async
  // group (empty past the last tile, so that a fixed wait count means "tile k has landed"); the
  // thread copies the rows rl, rl + kRowLanes, .. of its own channels. Rows at or past `last` are
  // zeros. Unaligned or partial rows are copied by the thread itself, visible after the next
  // barrier like the rest.
  const auto fill = [&](int64_t k) {
    const int64_t t0 = first + k * kTileRows;
    if (t0 < last) {
      uint4(*to)[kRowThreads] = ring[k % kStages];
#pragma unroll
      for (int row = rl; row < kTileRows; row += kRowLanes) {
        const int64_t r = t0 + row;
        if (r < last && n == kV && a.x_vector)
          dev::mma::cp_async_16(&to[row][cl], x + r * a.x_row_stride + c0);
        else
          to[row][cl] = r < last ? load(r) : uint4{0u, 0u, 0u, 0u};
      }
    }
    dev::mma::cp_async_commit();
  };
  const auto stored_as_state = [&](float (&v)[kV]) {
    if (a.round_to_state)
#pragma unroll
      for (int k = 0; k < kV; ++k) v[k] = dev::round_to(a.state_dtype, v[k]);
  };
  const auto at = [&](int64_t slot, int k, int64_t pos) {
    return conv::state_offset(a.layout, a.slot_stride, a.D, a.buffer_len, slot, c0 + k, pos);
  };
  // History column `col` (< H) of a request: what causal_conv1d_update reads at offset 0.
  const auto history = [&](const RowOwner& o, int64_t col, float (&v)[kV]) {
#pragma unroll
    for (int k = 0; k < kV; ++k)
      v[k] = o.initial >= 0 && k < n
                 ? dev::load_value(a.conv_state, a.state_dtype, at(o.initial, k, col))
                 : 0.0f;
  };
  // The final slot of o: columns 0 .. H - 1 from f (f[j], j < H, oldest first), the columns past
  // them from the initial slot (zeros for a null id), read before the final slot is written.
  const auto write_final = [&](const RowOwner& o, const float (&f)[kHalo][kV]) {
    for (int k = 0; k < n; ++k) {
      if (o.final_id != o.initial)
        for (int64_t pos = H; pos < a.buffer_len; ++pos) {
          const float v = o.initial >= 0
                              ? dev::load_value(a.conv_state, a.state_dtype, at(o.initial, k, pos))
                              : 0.0f;
          dev::store_value(a.conv_state, a.state_dtype, at(o.final_id, k, pos), v);
        }
#pragma unroll
      for (int j = 0; j < kHalo; ++j)
        if (j < H) dev::store_value(a.conv_state, a.state_dtype, at(o.final_id, k, j), f[j][k]);
    }
  };

  float w_hist[kHalo][kV], w_cur[kV];
#pragma unroll
  for (int k = 0; k < kV; ++k) {
    const int64_t row = (c0 + k) * a.weight_row_stride;
#pragma unroll
    for (int j = 0; j < kHalo; ++j)
      w_hist[j][k] = k < n && j < H ? dev::load_value(a.weight, a.weight_dtype, row + j) : 0.0f;
    w_cur[k] = k < n ? dev::load_value(a.weight, a.weight_dtype, row + H) : 0.0f;
  }

  fill(0);
  fill(1);
  int64_t tile_index = 0;
  for (int64_t t0 = first; t0 < last; t0 += kTileRows, ++tile_index) {
    const int64_t r0 = t0 + int64_t(rl) * kRunRows;
    dev::mma::cp_async_wait<kStages - 2>();
    __syncthreads();  // A: this tile has landed (and the one before it is still in the ring)
    const uint4(*tile)[kRowThreads] = ring[tile_index % kStages];
    const uint4(*before)[kRowThreads] = ring[(tile_index + kStages - 1) % kStages];

    // halo[s] is row r0 - kHalo + s: from this tile or the one before it; before the segment's
    // first tile, out of place from x, in place none (those rows belong to other requests and are
    // never a tap).
    uint4 halo[kHalo];
#pragma unroll
    for (int s = 0; s < kHalo; ++s) {
      const int at_row = rl * kRunRows - kHalo + s;  // row within the tile
      if (at_row >= 0)
        halo[s] = tile[at_row][cl];
      else if (t0 > first)
        halo[s] = before[kTileRows + at_row][cl];
      else
        halo[s] = !kInPlace && r0 - kHalo + s >= 0 ? load(r0 - kHalo + s) : uint4{0u, 0u, 0u, 0u};
    }

    RowOwner o = find_owner(a, r0 < a.L ? r0 : a.L - 1);
    float win[kHalo][kV] = {};
#pragma unroll
    for (int s = 0; s < kHalo; ++s) {
      if (s < kHalo - H) continue;
      float v[kV];
      unpack<T>(halo[s], v);
      stored_as_state(v);
      roll(win, v, H);
    }
    // In place, a run that starts inside its request's first H rows takes the taps before the
    // request from the history (out of place those rows belong to the request's head).
    if (kInPlace && o.action == kRun && o.begin < r0 && r0 - H < o.begin) {
#pragma unroll
      for (int j = 0; j < kHalo; ++j) {
        const int64_t p = r0 - H + j;
        if (j < H && p < o.begin) history(o, p - o.begin + H, win[j]);
      }
    }

    // Final slots written by this run: out of place those of the requests it heads, in place
    // those of the requests ending in it (their F[T .. T + H - 1], the window after the last row,
    // kept in local memory until after barrier B).
    int finals = 0;
    int64_t final_rows[kRunRows];
    float pending[kInPlace ? kRunRows : 1][kHalo][kV];
    int64_t zone_end = r0 + kRunRows;  // out of place: past this, rows of a head's first H rows
#pragma unroll
    for (int q = 0; q < kRunRows + (kInPlace ? 0 : kHalo - 1); ++q) {
      const int64_t r = r0 + q;
      uint4 raw;
      if (q < kRunRows) {
        if (r >= last) break;
        raw = tile[rl * kRunRows + q][cl];
      } else {
        if (r >= zone_end) break;
        raw = load(r);
      }
      if (r >= o.end || r < o.begin) o = find_owner(a, r);
      float v[kV];
      unpack<T>(raw, v);
      bool compute = o.action != kSkip;
      if (o.action == kRun) {
        if (r == o.begin) {
#pragma unroll 1
          for (int j = 0; j < H; ++j) {
            float h[kV];
            history(o, j, h);
            roll(win, h, H);
          }
          if constexpr (!kInPlace) {
            const int64_t zone = o.begin + H < o.end ? o.begin + H : o.end;
            if (zone > zone_end) zone_end = zone;
            if (o.final_id >= 0) final_rows[finals++] = r;
          }
        } else if (!kInPlace && o.begin < r0 && r < o.begin + H) {
          compute = false;  // the head's
        }
      }
      if (compute && n > 0) {
        float y[kV];
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          // Fixed order, no contraction: the same sum as the CPU path and causal_conv1d_update.
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < kHalo; ++j)
            if (j < H) sum = __fadd_rn(sum, __fmul_rn(w_hist[j][k], win[j][k]));
          sum = __fadd_rn(sum, __fmul_rn(w_cur[k], v[k]));
          y[k] = sum;
        }
        if (o.action == kZero) {
#pragma unroll
          for (int k = 0; k < kV; ++k) y[k] = 0.0f;
        } else if (a.activation == Activation::kSiLU) {
#pragma unroll
          for (int k = 0; k < kV; ++k) y[k] = y[k] / (1.0f + expf(-y[k]));
        }
        if constexpr (kSameOut) {
          store_row(static_cast<T*>(a.out) + r * a.out_row_stride + c0, n, a.out_vector && n == kV,
                    pack<T>(y));
        } else {
          for (int k = 0; k < n; ++k)
            dev::store_value(a.out, a.out_dtype, r * a.out_row_stride + c0 + k, y[k]);
        }
      }
      stored_as_state(v);
      roll(win, v, H);
      if (kInPlace && o.action == kRun && o.final_id >= 0 && r == o.end - 1) {
        final_rows[finals] = r;
#pragma unroll
        for (int j = 0; j < kHalo; ++j)
#pragma unroll
          for (int k = 0; k < kV; ++k) pending[kInPlace ? finals : 0][j][k] = win[j][k];
        ++finals;
      }
    }

    if constexpr (!kInPlace) {
      // Out of place: after this thread's own history reads (the only ones of its requests).
      // F[T + j], j < H: the inputs of rows end - H + j (x is never written), or the history.
#pragma unroll 1
      for (int i = 0; i < finals; ++i) {
        const RowOwner h = find_owner(a, final_rows[i]);
        float f[kHalo][kV] = {};
#pragma unroll 1
        for (int j = 0; j < H; ++j) {
          const int64_t p = h.end - H + j;
          float fv[kV];
          if (p < h.begin) {
            history(h, p - h.begin + H, fv);
          } else {
            unpack<T>(load(p), fv);
            stored_as_state(fv);
          }
          roll(f, fv, H);
        }
        write_final(h, f);
      }
    }
    __syncthreads();  // B: every read of the tile before this one and of this tile's history is
                      // done
    if constexpr (kInPlace) {
#pragma unroll 1
      for (int i = 0; i < finals; ++i) write_final(find_owner(a, final_rows[i]), pending[i]);
    }
    fill(tile_index + kStages - 1);  // into the stage of the tile before this one
  }
}

}  // namespace cuda_detail

// Launches causal_conv1d_prefill on `stream`. Validates the arguments on the host (reads no device
// memory), allocates nothing, never synchronises; safe inside CUDA-graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream) {
  Problem pr;
  GDN_RETURN_IF_ERROR(cuda::check_cuda_call(p, &pr));
  if (pr.N == 0) return Status::ok();
  // In place is out == x (check_arguments refuses any other sharing of x's pointer).
  const bool in_place = p.out.data == p.x.data && pr.L > 0;
  const bool same_out = p.out.dtype == p.x.dtype;
  const int64_t V = 16 / dtype_size(p.x.dtype);
  const int64_t channel_blocks =
      (pr.D + cuda_detail::kRowThreads * V - 1) / (cuda_detail::kRowThreads * V);
  // At least one CTA: the first counts the invalid rows even of a call without token rows.
  const int64_t segments =
      pr.L > 0 ? (pr.L + cuda_detail::kSegmentRows - 1) / cuda_detail::kSegmentRows : 1;
  if (segments > 65535 || channel_blocks > 0x7fffffff)
    return Status::unsupported("causal_conv1d_prefill: L = " + std::to_string(pr.L) +
                               ", D = " + std::to_string(pr.D) + " exceed the launch grid");
  // 16-byte row accesses need aligned rows: the base and every row start.
  const auto vector_rows = [&](const TensorView& t) {
    const int64_t elem = dtype_size(t.dtype);
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && (t.strides[0] * elem) % 16 == 0;
  };
  cuda_detail::KernelArgs a{};
  conv::fill_conv_kernel_args(p, pr, a);
  a.initial_state_indices = p.initial_state_indices.data;
  a.final_state_indices = p.final_state_indices.data;
  a.initial_dtype = p.initial_state_indices.dtype;
  a.final_dtype = p.final_state_indices.dtype;
  a.initial_stride = p.initial_state_indices.strides[0];
  a.final_stride = p.final_state_indices.strides[0];
  a.x_vector = vector_rows(p.x);
  a.out_vector = same_out && vector_rows(p.out);
  a.round_to_state = p.conv_state.dtype != p.x.dtype && p.conv_state.dtype != DType::kFloat32;

  const dim3 grid{unsigned(channel_blocks), unsigned(segments)};
  const auto launch = [&]<class T>() {
    using cuda_detail::conv_prefill_kernel;
    constexpr int kThreads = cuda_detail::kThreads;
    if (!same_out) {  // mixed x / out dtypes: out stored element by element, run-time width
      conv_prefill_kernel<T, false, kRuntimeValue, false><<<grid, kThreads, 0, stream>>>(a);
      return;
    }
    dispatch_or_runtime<ConvWidths>(int(pr.W), [&]<int kWidth>() {
      if (in_place)
        conv_prefill_kernel<T, true, kWidth, true><<<grid, kThreads, 0, stream>>>(a);
      else
        conv_prefill_kernel<T, true, kWidth, false><<<grid, kThreads, 0, stream>>>(a);
    });
  };
  ActivationDTypes::dispatch(p.x.dtype, [&]<DType kX>() {
    launch.template operator()<typename cuda::device_type<kX>::type>();
  });
  return cuda::launch_status("causal_conv1d_prefill");
}

}  // namespace gdn::conv_prefill
