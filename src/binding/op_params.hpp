// Each operation's Params built from a binding's arguments, and the run of a call on the state's
// device: shared by the nanobind module (src/python/) and the torch op kernels (src/torch_ops/),
// so that both accept and refuse the same calls with the same messages.
//
// Neither nanobind nor torch is included here. A binding hands its arrays over with a
// `view(array, name)` callable (which ends in make_view) and turns the exceptions thrown here
// into its own: std::invalid_argument is a ValueError, std::runtime_error a RuntimeError.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "gdn/conv/params.hpp"
#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/prefill/params.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::binding {

// ---- arrays -------------------------------------------------------------------------------------

// The DLPack codes (dlpack.h: DLDataTypeCode, DLDeviceType) of the arrays a binding meets.
namespace dlpack {
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kBool = 6 };
enum DeviceCode : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3 };
}  // namespace dlpack

// An array's element type as DLPack describes it (DLDataType).
struct ElementType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

inline DType to_dtype(ElementType t, const char* name) {
  if (t.lanes == 1) {
    if (t.code == dlpack::kFloat && t.bits == 32) return DType::kFloat32;
    if (t.code == dlpack::kFloat && t.bits == 16) return DType::kFloat16;
    if (t.code == dlpack::kFloat && t.bits == 64) return DType::kFloat64;
    if (t.code == dlpack::kBfloat && t.bits == 16) return DType::kBFloat16;
    if (t.code == dlpack::kInt && t.bits == 32) return DType::kInt32;
    if (t.code == dlpack::kInt && t.bits == 64) return DType::kInt64;
    if (t.code == dlpack::kBool && t.bits == 8) return DType::kBool;
  }
  throw std::invalid_argument(std::string(name) + " has an unsupported dtype (code " +
                              std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits)");
}

// The view of an array described by DLPack fields (shape and strides in elements, `ndim` of them).
// The one place arrays become views, whichever binding or import read them, so the errors are the
// same.
inline TensorView make_view(const void* data, ElementType dtype, int32_t device_type,
                            int32_t device_id, int64_t ndim, const int64_t* shape,
                            const int64_t* strides, const char* name) {
  if (ndim > TensorView::kMaxDims)
    throw std::invalid_argument(std::string(name) + " has " + std::to_string(ndim) +
                                " dimensions; at most 4 are supported");
  TensorView v;
  // Read-only arrays only ever back views the operation reads.
  v.data = const_cast<void*>(data);
  v.dtype = to_dtype(dtype, name);
  v.ndim = int(ndim);
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = shape[d];
    v.strides[d] = strides[d];
  }
  // Page-locked host memory (DLPack kDLCUDAHost: torch's pinned CPU tensors) is host memory.
  if (device_type == dlpack::kCPU || device_type == dlpack::kCUDAHost) {
    v.device = {DeviceType::kCPU, 0};
  } else if (device_type == dlpack::kCUDA) {
    v.device = {DeviceType::kCUDA, int(device_id)};
  } else {
    throw std::invalid_argument(std::string(name) + " lives on an unsupported device type " +
                                std::to_string(device_type) + " (CPU and CUDA are supported)");
  }
  return v;
}

// The view of an optional array argument: absent when it was not given.
template <class Array, class View>
TensorView optional_view(const std::optional<Array>& a, const char* name, View& view) {
  return a ? view(*a, name) : TensorView{};
}

// ---- errors and string arguments ----------------------------------------------------------------

// Status -> exception: bad input (and what this build does not implement) is an argument error.
inline void throw_if_error(const Status& s) {
  if (s.is_ok()) return;
  if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kUnsupported)
    throw std::invalid_argument(s.reason());
  throw std::runtime_error(s.reason());
}

inline GateActivation parse_gate(std::string_view s) {
  if (s == "silu" || s == "swish") return GateActivation::kSiLU;
  if (s == "sigmoid") return GateActivation::kSigmoid;
  throw std::invalid_argument("gate must be 'silu' or 'sigmoid', got '" + std::string(s) + "'");
}

inline StateLayout parse_layout(std::string_view s) {
  if (s == "vk") return StateLayout::kVK;
  if (s == "kv") return StateLayout::kKV;
  throw std::invalid_argument("state_layout must be 'vk' or 'kv', got '" + std::string(s) + "'");
}

inline conv::StateLayout parse_conv_layout(std::string_view s) {
  if (s == "channels_major") return conv::StateLayout::kChannelsMajor;
  if (s == "tokens_major") return conv::StateLayout::kTokensMajor;
  throw std::invalid_argument(
      "state_layout must be 'channels_major' ([slots, D, Lbuf]) or 'tokens_major' ([slots, Lbuf, "
      "D]), got '" +
      std::string(s) + "'");
}

inline conv::Activation parse_activation(std::string_view s) {
  if (s == "silu" || s == "swish") return conv::Activation::kSiLU;
  if (s == "none") return conv::Activation::kNone;
  throw std::invalid_argument("activation must be 'silu' or 'none', got '" + std::string(s) + "'");
}

// ---- each operation's arguments -----------------------------------------------------------------
//
// `In` is the binding's type of an array the operation only reads, `Out` of one it writes (the
// same type where the binding makes no difference). Members are references to the binding's
// arguments, valid for the call.

// The arguments decode_mtp and replay verify share (decode_mtp::StepArgs).
template <class In, class Out>
struct StepArgsIn {
  const In &mixed_qkv, &a, &b, &A_log, &dt_bias;
  const Out& state;
  const In& cu_seqlens;
  const Out& out;
  const std::optional<In>&z, &norm_weight;
  std::optional<double> scale;
  double l2_eps, norm_eps;
  std::string_view gate, state_layout;
  int64_t first_valid_slot, num_k_heads;
  bool round_core_output;
  const std::optional<Out>& error_count;
};

template <class In, class Out, class View>
void set_step_args(const StepArgsIn<In, Out>& in, View& view, decode_mtp::StepArgs& p) {
  p.mixed_qkv = view(in.mixed_qkv, "mixed_qkv");
  p.a = view(in.a, "a");
  p.b = view(in.b, "b");
  p.A_log = view(in.A_log, "A_log");
  p.dt_bias = view(in.dt_bias, "dt_bias");
  p.state = view(in.state, "state");
  p.cu_seqlens = view(in.cu_seqlens, "cu_seqlens");
  p.out = view(in.out, "out");
  p.z = optional_view(in.z, "z", view);
  p.norm_weight = optional_view(in.norm_weight, "norm_weight", view);
  p.error_count = optional_view(in.error_count, "error_count", view);
  p.scale = in.scale ? float(*in.scale) : NAN;
  p.l2_eps = float(in.l2_eps);
  p.norm_eps = float(in.norm_eps);
  p.gate = parse_gate(in.gate);
  p.layout = parse_layout(in.state_layout);
  p.first_valid_slot = in.first_valid_slot;
  p.num_k_heads = in.num_k_heads;
  p.round_core_output = in.round_core_output;
}

template <class In, class Out, class View>
decode_mtp::Params decode_mtp_params(const StepArgsIn<In, Out>& step, const In& state_indices,
                                     const std::optional<In>& num_accepted_tokens, View&& view) {
  decode_mtp::Params p;
  set_step_args(step, view, p);
  p.state_indices = view(state_indices, "state_indices");
  p.num_accepted_tokens = optional_view(num_accepted_tokens, "num_accepted_tokens", view);
  return p;
}

// prefill: the step arguments (prefill takes no round_core_output: the caller passes false) and
// its own slot arrays and checkpoint period.
template <class In, class Out, class View>
prefill::Params prefill_params(const StepArgsIn<In, Out>& step, const In& initial_state_indices,
                               const In& final_state_indices,
                               const std::optional<In>& checkpoint_indices,
                               int64_t checkpoint_every, View&& view) {
  prefill::Params p;
  set_step_args(step, view, p);
  p.initial_state_indices = view(initial_state_indices, "initial_state_indices");
  p.final_state_indices = view(final_state_indices, "final_state_indices");
  p.checkpoint_indices = optional_view(checkpoint_indices, "checkpoint_indices", view);
  p.checkpoint_every = checkpoint_every;
  return p;
}

// Replay verify's own arrays, in the order of its arguments.
template <class In, class Out>
struct ReplayArraysIn {
  const In& state_indices;
  const Out &window_k, &window_v, &window_a, &window_b, &window_len;
  const In& num_accepted_tokens;
};

template <class In, class Out, class View>
replay::Params replay_params(const StepArgsIn<In, Out>& step, const ReplayArraysIn<In, Out>& own,
                             View&& view) {
  replay::Params p;
  set_step_args(step, view, p);
  p.state_indices = view(own.state_indices, "state_indices");
  p.num_accepted_tokens = view(own.num_accepted_tokens, "num_accepted_tokens");
  p.window_k = view(own.window_k, "window_k");
  p.window_v = view(own.window_v, "window_v");
  p.window_a = view(own.window_a, "window_a");
  p.window_b = view(own.window_b, "window_b");
  p.window_len = view(own.window_len, "window_len");
  return p;
}

// causal_conv1d_update's arguments (`Array`: the nanobind binding takes every array as written).
template <class Array>
struct ConvArgsIn {
  const Array &x, &weight, &conv_state, &conv_state_indices, &cu_seqlens, &out;
  const std::optional<Array>& num_accepted_tokens;
  std::string_view activation, state_layout;
  int64_t first_valid_slot;
  const std::optional<Array>& error_count;
};

template <class Array, class View>
conv::Params conv_params(const ConvArgsIn<Array>& in, View&& view) {
  conv::Params p;
  p.x = view(in.x, "x");
  p.weight = view(in.weight, "weight");
  p.conv_state = view(in.conv_state, "conv_state");
  p.conv_state_indices = view(in.conv_state_indices, "conv_state_indices");
  p.cu_seqlens = view(in.cu_seqlens, "cu_seqlens");
  p.out = view(in.out, "out");
  p.num_accepted_tokens = optional_view(in.num_accepted_tokens, "num_accepted_tokens", view);
  p.error_count = optional_view(in.error_count, "error_count", view);
  p.activation = parse_activation(in.activation);
  p.layout = parse_conv_layout(in.state_layout);
  p.first_valid_slot = in.first_valid_slot;
  return p;
}

// causal_conv1d_prefill's arguments.
template <class Array>
struct ConvPrefillArgsIn {
  const Array &x, &weight, &conv_state, &initial_state_indices, &final_state_indices, &cu_seqlens,
      &out;
  std::string_view activation, state_layout;
  int64_t first_valid_slot;
  const std::optional<Array>& error_count;
};

template <class Array, class View>
conv_prefill::Params conv_prefill_params(const ConvPrefillArgsIn<Array>& in, View&& view) {
  conv_prefill::Params p;
  p.x = view(in.x, "x");
  p.weight = view(in.weight, "weight");
  p.conv_state = view(in.conv_state, "conv_state");
  p.initial_state_indices = view(in.initial_state_indices, "initial_state_indices");
  p.final_state_indices = view(in.final_state_indices, "final_state_indices");
  p.cu_seqlens = view(in.cu_seqlens, "cu_seqlens");
  p.out = view(in.out, "out");
  p.error_count = optional_view(in.error_count, "error_count", view);
  p.activation = parse_activation(in.activation);
  p.layout = parse_conv_layout(in.state_layout);
  p.first_valid_slot = in.first_valid_slot;
  return p;
}

// ---- the run ------------------------------------------------------------------------------------

// Runs `cpu()` when the state (the view named `state_name`) is in host memory, else `cuda()`; each
// returns a Status, raised here when it failed. `cuda` is called, and so (when generic)
// instantiated, only in builds with the CUDA kernels (GDN_HAS_CUDA), which it may then reference.
template <class Cpu, class Cuda>
void run(const TensorView& state, [[maybe_unused]] const char* state_name, Cpu&& cpu, Cuda&& cuda) {
  Status status;
  if (state.device.type == DeviceType::kCPU) {
    status = cpu();
  } else {
#ifdef GDN_HAS_CUDA
    status = cuda();
#else
    (void)cuda;
    status = Status::unsupported(std::string(state_name) +
                                 " is a CUDA array but this build of gdn has no CUDA kernels");
#endif
  }
  throw_if_error(status);
}

}  // namespace gdn::binding
