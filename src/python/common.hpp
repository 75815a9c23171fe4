// Shared binding helpers: DLPack arrays (nb::ndarray, FastArray) -> gdn::TensorView, the launch
// stream and the run of a call. Status -> Python errors and the string arguments are
// binding/op_params.hpp's (nanobind raises its std::invalid_argument as ValueError,
// std::runtime_error as RuntimeError).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "binding/op_params.hpp"
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

// The view of an array described by DLPack fields: binding::make_view, the one place arrays become
// views (here and in the torch op kernels), so the errors are the same.
inline TensorView make_view(const void* data, nb::dlpack::dtype dtype, int32_t device_type,
                            int32_t device_id, int64_t ndim, const int64_t* shape,
                            const int64_t* strides, const char* name) {
  return binding::make_view(data, {dtype.code, dtype.bits, dtype.lanes}, device_type, device_id,
                            ndim, shape, strides, name);
}

template <class... Ts>
inline TensorView to_view(const nb::ndarray<Ts...>& a, const char* name) {
  return make_view(a.data(), a.dtype(), a.device_type(), a.device_id(), int64_t(a.ndim()),
                   a.shape_ptr(), a.stride_ptr(), name);
}

template <class... Ts>
inline TensorView to_view(const std::optional<nb::ndarray<Ts...>>& a, const char* name) {
  return a ? to_view(*a, name) : TensorView{};
}

// ---- FastArray: array arguments read without a Python call where the producer allows it ---------
//
// Importing an array through nanobind's ndarray caster calls the producer's `__dlpack__()` (a
// Python call and a capsule per array), which dominates the host cost of a call. Producers that
// implement the DLPack C exchange API (DLPack >= 1.2; torch >= 2.10 sets
// `torch.Tensor.__dlpack_c_exchange_api__`) fill a borrowed DLTensor from C instead, and name their
// current stream. FastArray takes that path when it can and nanobind's import otherwise (NumPy,
// CuPy, JAX, older torch, capsules, buffer-protocol objects, and any object the fast import
// refuses), so what a call accepts and every error it raises are those of the nanobind path.

// The DLPack C exchange API table, declared from the DLPack specification (dlpack.h, 1.2+).
namespace dlpack_c {
struct Version {
  uint32_t major;
  uint32_t minor;
};
struct ApiHeader {
  Version version;
  ApiHeader* prev_api;  // an older table in the chain, or null
};
struct Api {
  ApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // Fills `out` with a view that stays valid while the object lives; 0 on success, else -1 with a
  // Python error set. May be null.
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  // The producer's current stream on a device (null on the CPU); 0 on success, else -1 with a
  // Python error set.
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};
}  // namespace dlpack_c

struct ExchangeProducer {
  const dlpack_c::Api* api = nullptr;  // null: this type takes nanobind's import
  // The producer never exports read-only arrays, so its arrays may be written. A borrowed DLTensor
  // carries no read-only flag; only torch (which has no read-only tensors) is known to qualify.
  bool writable = false;
};

namespace detail {

inline PyObject* type_attr(PyObject* type, const char* name) noexcept {
  PyObject* v = PyObject_GetAttrString(type, name);
  if (!v) PyErr_Clear();
  return v;
}

// The first class in `type`'s MRO whose own namespace defines `name` (borrowed), or null.
inline PyObject* defining_class(PyTypeObject* type, const char* name) noexcept {
  PyObject* mro = type->tp_mro;
  if (!mro || !PyTuple_Check(mro)) return nullptr;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); ++i) {
    PyObject* base = PyTuple_GET_ITEM(mro, i);
    PyObject* dict = type_attr(base, "__dict__");
    if (!dict) continue;
    const int has = PyMapping_HasKeyString(dict, name);
    Py_DECREF(dict);
    if (has == 1) return base;
  }
  return nullptr;
}

inline ExchangeProducer find_exchange_producer(PyTypeObject* type) noexcept {
  ExchangeProducer none;
  PyObject* capsule = type_attr(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (!capsule) return none;
  const dlpack_c::ApiHeader* header = nullptr;
  if (PyCapsule_IsValid(capsule, "dlpack_exchange_api"))
    header = static_cast<const dlpack_c::ApiHeader*>(
        PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  Py_DECREF(capsule);
  // The table's layout is that of major version 1 from minor 2 on; newer majors chain to older
  // tables.
  while (header && !(header->version.major == 1 && header->version.minor >= 2))
    header = header->prev_api;
  const auto* api = reinterpret_cast<const dlpack_c::Api*>(header);
  if (!api || !api->dltensor_from_py_object_no_sync || !api->current_work_stream) return none;

  // A subclass that overrides `__dlpack__` chose its own export: honour it through nanobind.
  PyObject* owner = defining_class(type, "__dlpack_c_exchange_api__");
  if (!owner) return none;
  PyObject* mine = type_attr(reinterpret_cast<PyObject*>(type), "__dlpack__");
  PyObject* theirs = type_attr(owner, "__dlpack__");
  const bool same_export = mine && mine == theirs;
  Py_XDECREF(mine);
  Py_XDECREF(theirs);
  if (!same_export) return none;

  ExchangeProducer p;
  p.api = api;
  if (PyObject* module = type_attr(owner, "__module__")) {
    const char* name = PyUnicode_Check(module) ? PyUnicode_AsUTF8(module) : nullptr;
    if (!name) PyErr_Clear();
    const std::string_view m = name ? name : "";
    p.writable = m == "torch" || m.substr(0, 6) == "torch.";
    Py_DECREF(module);
  }
  return p;
}

}  // namespace detail

// The exchange API of an object's type, looked up once per type. Callers hold the GIL.
inline ExchangeProducer exchange_producer(PyTypeObject* type) noexcept {
  // A few types ever reach a binding (torch.Tensor, its subclasses, numpy.ndarray, ...). Each
  // cached type is kept alive, so its address cannot be reused by another type; past the table's
  // size the lookup simply runs every time.
  struct Entry {
    PyTypeObject* type;
    ExchangeProducer producer;
  };
  static Entry table[32];
  static int size = 0;
  for (int i = 0; i < size; ++i)
    if (table[i].type == type) return table[i].producer;
  const ExchangeProducer p = detail::find_exchange_producer(type);
  if (size < int(sizeof(table) / sizeof(table[0]))) {
    Py_INCREF(type);
    table[size++] = {type, p};
  }
  return p;
}

// One array argument of a call, borrowed for the call's duration.
template <bool ReadOnly>
struct FastArray {
  using Generic = std::conditional_t<ReadOnly, nb::ndarray<nb::ro>, nb::ndarray<>>;

  void* data = nullptr;
  nb::dlpack::dtype dtype;
  nb::dlpack::device device;
  int ndim = 0;
  int64_t shape[TensorView::kMaxDims] = {};
  int64_t strides[TensorView::kMaxDims] = {};
  PyObject* object = nullptr;          // the Python object (borrowed: the call holds it)
  const dlpack_c::Api* api = nullptr;  // set when imported through the exchange API
  Generic generic;                     // holds a nanobind import for the call

  // The exchange-API import; false (no Python error set) when it does not apply.
  bool import_fast(PyObject* o) noexcept {
    const ExchangeProducer p = exchange_producer(Py_TYPE(o));
    if (!p.api || !(ReadOnly || p.writable)) return false;
    nb::dlpack::dltensor t;
    if (p.api->dltensor_from_py_object_no_sync(o, &t) != 0) {
      PyErr_Clear();  // e.g. a meta tensor: the nanobind import decides and words the error
      return false;
    }
    // Beyond TensorView's rank, and without strides (DLPack < 1.2), nanobind's import decides.
    if (t.ndim < 0 || t.ndim > TensorView::kMaxDims || (t.ndim > 0 && !t.strides)) return false;
    data = static_cast<char*>(t.data) + t.byte_offset;
    dtype = t.dtype;
    device = t.device;
    ndim = t.ndim;
    for (int d = 0; d < ndim; ++d) {
      shape[d] = t.shape[d];
      strides[d] = t.strides[d];
    }
    object = o;
    api = p.api;
    return true;
  }

  void set_generic(PyObject* o, Generic&& a) noexcept {
    data = const_cast<void*>(static_cast<const void*>(a.data()));
    dtype = a.dtype();
    device = {a.device_type(), a.device_id()};
    ndim = int(a.ndim());
    for (int d = 0; d < ndim && d < TensorView::kMaxDims; ++d) {
      shape[d] = int64_t(a.shape(size_t(d)));
      strides[d] = int64_t(a.stride(size_t(d)));
    }
    object = o;
    api = nullptr;
    generic = std::move(a);
  }
};

using FastConstArray = FastArray<true>;  // only read: read-only arrays are accepted too
using FastWritableArray = FastArray<false>;
using OptFastConstArray = std::optional<FastConstArray>;
using OptFastWritableArray = std::optional<FastWritableArray>;

template <bool ReadOnly>
inline TensorView to_view(const FastArray<ReadOnly>& a, const char* name) {
  return make_view(a.data, a.dtype, a.device.device_type, a.device.device_id, a.ndim, a.shape,
                   a.strides, name);
}

template <bool ReadOnly>
inline TensorView to_view(const std::optional<FastArray<ReadOnly>>& a, const char* name) {
  return a ? to_view(*a, name) : TensorView{};
}

// The CUDA stream a call on `state` launches on: `stream` when given; else the current stream of
// the state's framework: through the exchange API when the state came that way, else as
// gdn._common._stream_of finds it (CuPy, torch without the exchange API); else (and for host
// arrays) the legacy default stream. Needs the GIL.
template <bool ReadOnly>
inline void* launch_stream(std::optional<uintptr_t> stream, const FastArray<ReadOnly>& state) {
  if (stream) return reinterpret_cast<void*>(*stream);
  if (state.device.device_type != nb::device::cuda::value) return nullptr;
  if (state.api) {
    void* s = nullptr;
    if (state.api->current_work_stream(state.device.device_type, state.device.device_id, &s) != 0)
      throw nb::python_error();
    return s;
  }
  nb::object s =
      nb::module_::import_("gdn._common").attr("_stream_of")(nb::handle(state.object), nb::none());
  return s.is_none() ? nullptr : reinterpret_cast<void*>(nb::cast<uintptr_t>(s));
}

// binding::*_params' `view`: the nanobind arrays' to_view.
inline constexpr auto array_view = [](const auto& array, const char* name) {
  return to_view(array, name);
};

// Runs a call (binding::run): `cpu()` for host state, else `cuda(stream)` on the given stream or
// the current stream of `state`'s framework, each without the GIL; raises on a failed Status.
// `cuda` is called (and, when generic, instantiated) only in builds with CUDA kernels.
template <class Cpu, class Cuda>
void run_call(const TensorView& state_view, const char* state_name, const FastWritableArray& state,
              std::optional<uintptr_t> stream, Cpu&& cpu, Cuda&& cuda) {
  binding::run(
      state_view, state_name,
      [&] {
        nb::gil_scoped_release release;
        return cpu();
      },
      [&](auto...) {
        void* launch_on = launch_stream(stream, state);
        nb::gil_scoped_release release;
        return cuda(launch_on);
      });
}

// Binds a verify step (decode_mtp, decode_mtp_replay) as `name`: its own arguments `own...` (up to
// the first option), then the options both take, named, ordered and defaulted as in their Python
// signatures, and `split`, which pins the CUDA kernel's CTAs per value head.
template <class F, class... Own>
void def_verify_step(nb::module_& m, const char* name, F* f, const char* doc, const Own&... own) {
  m.def(name, f, own..., nb::arg("scale").none() = nb::none(), nb::arg("l2_eps") = 1e-6,
        nb::arg("norm_eps") = 1e-6, nb::arg("gate") = "silu", nb::arg("state_layout") = "vk",
        nb::arg("first_valid_slot") = 0, nb::arg("num_k_heads") = 0,
        nb::arg("round_core_output") = false, nb::arg("a_is_log_decay") = false,
        nb::arg("b_is_beta") = false, nb::arg("qk_l2_norm") = true,
        nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("stream").none() = nb::none(), nb::arg("split") = 0, doc);
}

using binding::parse_layout;
using binding::throw_if_error;

}  // namespace gdn::python

// FastArray's caster: the exchange-API import first, else nanobind's ndarray caster (whose stub
// name it also takes, so signatures read as with a plain ndarray argument).
namespace nanobind::detail {
template <bool ReadOnly>
struct type_caster<gdn::python::FastArray<ReadOnly>> {
  using Generic = typename gdn::python::FastArray<ReadOnly>::Generic;
  NB_TYPE_CASTER(gdn::python::FastArray<ReadOnly>, make_caster<Generic>::Name)

  bool from_python(handle src, uint32_t flags, cleanup_list* cleanup) noexcept {
    if (value.import_fast(src.ptr())) return true;
    make_caster<Generic> generic;
    if (!generic.from_python(src, flags, cleanup)) return false;
    value.set_generic(src.ptr(), std::move(generic.value));
    return true;
  }
  static handle from_cpp(const Value&, rv_policy, cleanup_list*) noexcept { return handle(); }
};
}  // namespace nanobind::detail
