// Shared binding helpers: DLPack arrays (nb::ndarray) -> gdn::TensorView, Status -> Python errors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::python {

namespace nb = nanobind;
using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;
// Arrays the operation only reads: read-only arrays (e.g. a NumPy array with writeable=False) are
// accepted too.
using ConstArray = nb::ndarray<nb::ro>;
using OptConstArray = std::optional<ConstArray>;

inline DType to_dtype(nb::dlpack::dtype t, const char* name) {
  using code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(code::Float) && t.bits == 32) return DType::kFloat32;
    if (t.code == uint8_t(code::Float) && t.bits == 16) return DType::kFloat16;
    if (t.code == uint8_t(code::Float) && t.bits == 64) return DType::kFloat64;
    if (t.code == uint8_t(code::Bfloat) && t.bits == 16) return DType::kBFloat16;
    if (t.code == uint8_t(code::Int) && t.bits == 32) return DType::kInt32;
    if (t.code == uint8_t(code::Int) && t.bits == 64) return DType::kInt64;
    if (t.code == uint8_t(code::Bool) && t.bits == 8) return DType::kBool;
  }
  throw nb::value_error((std::string(name) + " has an unsupported dtype (code " +
                         std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits)")
                            .c_str());
}

template <class... Ts>
inline TensorView to_view(const nb::ndarray<Ts...>& a, const char* name) {
  if (a.ndim() > size_t(TensorView::kMaxDims))
    throw nb::value_error((std::string(name) + " has " + std::to_string(a.ndim()) +
                           " dimensions; at most 4 are supported")
                              .c_str());
  TensorView v;
  // Read-only arrays only ever back views the operation reads.
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = to_dtype(a.dtype(), name);
  v.ndim = int(a.ndim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = int64_t(a.shape(size_t(d)));
    v.strides[d] = int64_t(a.stride(size_t(d)));
  }
  // Page-locked host memory (DLPack kDLCUDAHost: torch's pinned CPU tensors) is host memory.
  if (a.device_type() == nb::device::cpu::value ||
      a.device_type() == nb::device::cuda_host::value) {
    v.device = {DeviceType::kCPU, 0};
  } else if (a.device_type() == nb::device::cuda::value) {
    v.device = {DeviceType::kCUDA, int(a.device_id())};
  } else {
    throw nb::value_error((std::string(name) + " lives on an unsupported device type " +
                           std::to_string(a.device_type()) + " (CPU and CUDA are supported)")
                              .c_str());
  }
  return v;
}

template <class... Ts>
inline TensorView to_view(const std::optional<nb::ndarray<Ts...>>& a, const char* name) {
  return a ? to_view(*a, name) : TensorView{};
}

// Status -> Python exception (ValueError for bad input, RuntimeError for the rest).
inline void throw_if_error(const Status& s) {
  if (s.is_ok()) return;
  if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kUnsupported)
    throw nb::value_error(s.reason().c_str());
  throw std::runtime_error(s.reason());
}

inline GateActivation parse_gate(const std::string& s) {
  if (s == "silu" || s == "swish") return GateActivation::kSiLU;
  if (s == "sigmoid") return GateActivation::kSigmoid;
  throw nb::value_error(("gate must be 'silu' or 'sigmoid', got '" + s + "'").c_str());
}

inline StateLayout parse_layout(const std::string& s) {
  if (s == "vk") return StateLayout::kVK;
  if (s == "kv") return StateLayout::kKV;
  throw nb::value_error(("state_layout must be 'vk' or 'kv', got '" + s + "'").c_str());
}

}  // namespace gdn::python
