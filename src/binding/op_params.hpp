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
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6 };
enum DeviceCode : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3 };
}  // namespace dlpack

// An array's element type as DLPack describes it (DLDataType).
struct ElementType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

// The readable name of a DLPack element type: "int16", "uint8", "complex64", "float8_e4m3fn",
// "float32x4" (4 lanes), ...; "DLPack type code C, B bits" for codes without one.
inline std::string dtype_name(ElementType t) {
  // dlpack.h's DLDataTypeCode from kDLFloat8_e3m4 (7) to kDLFloat4_e2m1fn (17).
  static constexpr const char* kNarrowFloats[] = {
      "float8_e3m4",     "float8_e4m3",   "float8_e4m3b11fnuz", "float8_e4m3fn",
      "float8_e4m3fnuz", "float8_e5m2",   "float8_e5m2fnuz",    "float8_e8m0fnu",
      "float6_e2m3fn",   "float6_e3m2fn", "float4_e2m1fn"};
  // dlpack.h's DLDataTypeCode 0 to 5 named <kind><bits> (3, an opaque handle, has no name).
  static constexpr const char* kSizedKinds[] = {"int",   "uint",   "float",
                                                nullptr, "bfloat", "complex"};
  const std::string bits = std::to_string(t.bits);
  std::string name;
  if (t.code < std::size(kSizedKinds) && kSizedKinds[t.code]) {
    name = kSizedKinds[t.code] + bits;
  } else if (t.code == dlpack::kBool) {
    name = t.bits == 8 ? std::string("bool") : "bool (" + bits + " bits)";
  } else if (t.code >= 7 && t.code < 7 + std::size(kNarrowFloats)) {
    name = kNarrowFloats[t.code - 7];
  } else {
    return "DLPack type code " + std::to_string(t.code) + ", " + bits + " bits" +
           (t.lanes == 1 ? "" : ", " + std::to_string(t.lanes) + " lanes");
  }
  return t.lanes == 1 ? name : name + "x" + std::to_string(t.lanes);
}

// The library's DType of a DLPack element type, if it has one.
inline std::optional<DType> to_dtype(ElementType t) noexcept {
  if (t.lanes == 1) {
    if (t.code == dlpack::kFloat && t.bits == 32) return DType::kFloat32;
    if (t.code == dlpack::kFloat && t.bits == 16) return DType::kFloat16;
    if (t.code == dlpack::kFloat && t.bits == 64) return DType::kFloat64;
    if (t.code == dlpack::kBfloat && t.bits == 16) return DType::kBFloat16;
    if (t.code == dlpack::kInt && t.bits == 32) return DType::kInt32;
    if (t.code == dlpack::kInt && t.bits == 64) return DType::kInt64;
    if (t.code == dlpack::kBool && t.bits == 8) return DType::kBool;
  }
  return std::nullopt;
}

// The dtype of the view of an array whose element type has no DType (int16, uint8, complex64, ...):
// a value outside the enumeration, so no argument check accepts it (each refuses it as
// "<name> has dtype unknown").
inline constexpr DType kForeignDType = static_cast<DType>(-1);

// make_view's refusal of an array whose element type has no DType. It carries the view (its dtype
// kForeignDType) and the element type's readable name, so that an operation's Params builder (see
// ForeignDTypes) can refuse the call as the operation's own checks do, with its list of accepted
// dtypes; elsewhere its message names the dtype and those gdn knows.
class ForeignDType : public std::invalid_argument {
 public:
  ForeignDType(const TensorView& view, const char* name, std::string dtype)
      : std::invalid_argument(std::string(name) + " has dtype " + dtype +
                              ", which gdn does not take (it knows float32, bfloat16, float16, "
                              "float64, int32, int64 and bool)"),
        view_(view),
        dtype_(std::move(dtype)) {}
  const TensorView& view() const noexcept { return view_; }
  const std::string& dtype() const noexcept { return dtype_; }

 private:
  TensorView view_;
  std::string dtype_;
};

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
  const std::optional<DType> known = to_dtype(dtype);
  v.dtype = known ? *known : kForeignDType;
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
  if (!known) throw ForeignDType(v, name, dtype_name(dtype));
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

// Arrays of dtypes without a DType in one call. A Params builder takes the views make_view refuses
// with ForeignDType (their dtype kForeignDType) through `taking(view)`, then `refuse_if_any`
// refuses the call with the operation's first argument error, `check_arguments` (which reads no
// data), in which each such array's dtype is named: "cu_seqlens has dtype int16; expected one of:
// int32, int64", as for any other dtype the argument does not accept. Nothing runs on such views.
class ForeignDTypes {
 public:
  // `view`, taking the views make_view refuses for their dtype alone.
  template <class View>
  auto taking(View& view) {
    return [this, &view](const auto& array, const char* name) -> TensorView {
      try {
        return view(array, name);
      } catch (const ForeignDType& e) {
        entries_.push_back({name, e.dtype(), e.what()});
        return e.view();
      }
    };
  }

  // Raises the first argument error `check_arguments()` (a Status) finds, when an array of a
  // foreign dtype was taken; returns when none was.
  template <class Check>
  void refuse_if_any(Check&& check_arguments) const {
    if (entries_.empty()) return;
    const Status s = check_arguments();
    // Every argument's dtype is checked, so this is not expected; the call is refused all the same.
    if (s.is_ok()) throw std::invalid_argument(entries_.front().message);
    std::string reason = s.reason();
    for (const Entry& e : entries_) name_dtype(reason, e);
    throw_if_error(Status(s.code(), std::move(reason)));
  }

 private:
  struct Entry {
    std::string name, dtype, message;
  };

  static bool identifier_char(char c) noexcept {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  }

  // "<name> has dtype unknown" (to_string of kForeignDType) -> "<name> has dtype <e.dtype>".
  static void name_dtype(std::string& reason, const Entry& e) {
    const std::string_view unknown = to_string(kForeignDType);
    const std::string said = e.name + " has dtype " + std::string(unknown);
    for (size_t at = reason.find(said); at != std::string::npos; at = reason.find(said, at + 1)) {
      if (at > 0 && identifier_char(reason[at - 1])) continue;  // another argument's name
      reason.replace(at + said.size() - unknown.size(), unknown.size(), e.dtype);
      return;
    }
  }

  std::vector<Entry> entries_;
};

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

// An operation's Params as `fill(p, taking)` sets them from the binding's arguments, every array
// taken through ForeignDTypes; an array of a dtype the library has no name for refuses the call
// with the first argument error the operation's check_arguments finds.
template <class Params, class Problem, class View, class Fill>
Params taken_params(View& view, Fill&& fill) {
  ForeignDTypes foreign;
  auto taking = foreign.taking(view);
  Params p;
  fill(p, taking);
  foreign.refuse_if_any([&p] {
    Problem pr;
    return check_arguments(p, &pr);
  });
  return p;
}

// The switches of a step call, as StepArgs names them.
struct StepFlags {
  bool round_core_output, a_is_log_decay, b_is_beta, qk_l2_norm;
};

// The arguments decode_mtp and replay verify share (decode_mtp::StepArgs).
template <class In, class Out>
struct StepArgsIn {
  const In &mixed_qkv, &a, &b;
  const std::optional<In>&A_log, &dt_bias;  // absent only with a_is_log_decay
  const Out& state;
  const In& cu_seqlens;
  const Out& out;
  const std::optional<In>&z, &norm_weight;
  std::optional<double> scale;
  double l2_eps, norm_eps;
  std::string_view gate, state_layout;
  int64_t first_valid_slot, num_k_heads;
  StepFlags flags;
  const std::optional<Out>& error_count;
};

template <class In, class Out, class View>
void set_step_args(const StepArgsIn<In, Out>& in, View& view, decode_mtp::StepArgs& p) {
  p.mixed_qkv = view(in.mixed_qkv, "mixed_qkv");
  p.a = view(in.a, "a");
  p.b = view(in.b, "b");
  p.A_log = optional_view(in.A_log, "A_log", view);
  p.dt_bias = optional_view(in.dt_bias, "dt_bias", view);
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
  p.round_core_output = in.flags.round_core_output;
  p.a_is_log_decay = in.flags.a_is_log_decay;
  p.b_is_beta = in.flags.b_is_beta;
  p.qk_l2_norm = in.flags.qk_l2_norm;
}

template <class In, class Out, class View>
decode_mtp::Params decode_mtp_params(const StepArgsIn<In, Out>& step, const In& state_indices,
                                     const std::optional<In>& num_accepted_tokens, View&& view) {
  return taken_params<decode_mtp::Params, decode_mtp::Problem>(
      view, [&](decode_mtp::Params& p, auto& taking) {
        set_step_args(step, taking, p);
        p.state_indices = taking(state_indices, "state_indices");
        p.num_accepted_tokens = optional_view(num_accepted_tokens, "num_accepted_tokens", taking);
      });
}

// prefill: the step arguments (prefill takes no round_core_output: the caller passes false) and
// its own slot arrays and checkpoint period.
template <class In, class Out, class View>
prefill::Params prefill_params(const StepArgsIn<In, Out>& step, const In& initial_state_indices,
                               const In& final_state_indices,
                               const std::optional<In>& checkpoint_indices,
                               int64_t checkpoint_every, View&& view) {
  return taken_params<prefill::Params, prefill::Problem>(
      view, [&](prefill::Params& p, auto& taking) {
        set_step_args(step, taking, p);
        p.initial_state_indices = taking(initial_state_indices, "initial_state_indices");
        p.final_state_indices = taking(final_state_indices, "final_state_indices");
        p.checkpoint_indices = optional_view(checkpoint_indices, "checkpoint_indices", taking);
        p.checkpoint_every = checkpoint_every;
      });
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
  return taken_params<replay::Params, replay::Problem>(view, [&](replay::Params& p, auto& taking) {
    set_step_args(step, taking, p);
    p.state_indices = taking(own.state_indices, "state_indices");
    p.num_accepted_tokens = taking(own.num_accepted_tokens, "num_accepted_tokens");
    p.window_k = taking(own.window_k, "window_k");
    p.window_v = taking(own.window_v, "window_v");
    p.window_a = taking(own.window_a, "window_a");
    p.window_b = taking(own.window_b, "window_b");
    p.window_len = taking(own.window_len, "window_len");
  });
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

// The arguments both conv operations take (conv::ConvArgs), from either one's ConvArgsIn or
// ConvPrefillArgsIn.
template <class In, class View>
void set_conv_args(const In& in, View& view, conv::ConvArgs& p) {
  p.x = view(in.x, "x");
  p.weight = view(in.weight, "weight");
  p.conv_state = view(in.conv_state, "conv_state");
  p.cu_seqlens = view(in.cu_seqlens, "cu_seqlens");
  p.out = view(in.out, "out");
  p.error_count = optional_view(in.error_count, "error_count", view);
  p.activation = parse_activation(in.activation);
  p.layout = parse_conv_layout(in.state_layout);
  p.first_valid_slot = in.first_valid_slot;
}

template <class Array, class View>
conv::Params conv_params(const ConvArgsIn<Array>& in, View&& view) {
  return taken_params<conv::Params, conv::Problem>(view, [&](conv::Params& p, auto& taking) {
    set_conv_args(in, taking, p);
    p.conv_state_indices = taking(in.conv_state_indices, "conv_state_indices");
    p.num_accepted_tokens = optional_view(in.num_accepted_tokens, "num_accepted_tokens", taking);
  });
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
  return taken_params<conv_prefill::Params, conv_prefill::Problem>(
      view, [&](conv_prefill::Params& p, auto& taking) {
        set_conv_args(in, taking, p);
        p.initial_state_indices = taking(in.initial_state_indices, "initial_state_indices");
        p.final_state_indices = taking(in.final_state_indices, "final_state_indices");
      });
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
