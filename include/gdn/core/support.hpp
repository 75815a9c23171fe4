// The supported set, defined exactly once. Everything that asks "is this a fast path?" — the C++
// guards, the CUDA instantiation lists and Python (through gdn.supported_*()) — reads these lists.
#pragma once

#include "gdn/core/dispatch.hpp"
#include "gdn/core/dtype.hpp"

namespace gdn {

enum class GateActivation : int { kSiLU, kSigmoid };
enum class StateLayout : int {
  kVK,
  kKV
};  // kVK: [slots, HV, V, K] (K contiguous); kKV: [.., K, V]

// Head ratios r = HV / H compiled as template parameters (other integral ratios take the generic
// run-time-ratio path).
using HeadRatios = ValueList<1, 2, 3, 4, 8>;
// Storage dtypes of the recurrent state (math is always fp32).
using StateDTypes = ValueList<DType::kFloat32, DType::kBFloat16, DType::kFloat16>;
// Dtypes of activations (mixed_qkv, a, b, z, out; the conv's x, weight and state).
using ActivationDTypes = ValueList<DType::kBFloat16, DType::kFloat16, DType::kFloat32>;
// Dtypes of per-head parameters (A_log, dt_bias, norm_weight).
using ParameterDTypes = ValueList<DType::kFloat32, DType::kBFloat16, DType::kFloat16>;
// Dtypes of index arrays (slot ids, token offsets, accepted counts).
using IndexDTypes = ValueList<DType::kInt32, DType::kInt64>;
// Output-gate activations of the gated RMSNorm.
using GateActivations = ValueList<GateActivation::kSiLU, GateActivation::kSigmoid>;
// Head dims (K = V) of the CUDA fast path. The CPU path takes any K and V.
using CudaHeadDims = ValueList<128>;
// Largest number of state columns S (= num_spec + 1) the CUDA kernel supports. The CPU path has no
// limit.
inline constexpr int kCudaMaxSpecColumns = 16;
// Causal conv1d widths W compiled as template parameters (other widths up to kConvMaxWidth run a
// run-time-width variant on CUDA; the CPU path takes any width in [2, kConvMaxWidth]).
using ConvWidths = ValueList<2, 3, 4>;
inline constexpr int kConvMaxWidth = 8;

}  // namespace gdn
