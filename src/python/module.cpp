// gdn._C: the nanobind module. Each operation binds itself in its own bind_*.cpp.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common.hpp"
#include "gdn/core/support.hpp"
#include "gdn/kernels/cuda_api.hpp"

namespace nb = nanobind;

namespace gdn::python {
void bind_decode_mtp(nb::module_& m);
void bind_conv(nb::module_& m);
void bind_metadata(nb::module_& m);
void bind_replay(nb::module_& m);
void bind_prefill(nb::module_& m);
}  // namespace gdn::python

NB_MODULE(_C, m) {
  m.doc() = "libgdn: Gated DeltaNet decode / MTP-verify kernels and metadata builders";
  m.attr("__version__") = GDN_VERSION;
#ifdef GDN_HAS_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("cuda_architectures") = GDN_CUDA_ARCHS;
#else
  m.attr("built_with_cuda") = false;
  m.attr("cuda_architectures") = "";
#endif

  m.def(
      "supported_head_ratios",
      [] {
        return std::vector<int>(gdn::HeadRatios::values.begin(), gdn::HeadRatios::values.end());
      },
      "Head ratios HV / H compiled as template parameters (others run the generic path).");
  m.def(
      "supported_state_dtypes",
      [] {
        std::vector<std::string> out;
        for (auto d : gdn::StateDTypes::values) out.emplace_back(gdn::to_string(d));
        return out;
      },
      "Storage dtypes of the recurrent state.");
  m.def(
      "cuda_head_dims",
      [] {
        return std::vector<int>(gdn::CudaHeadDims::values.begin(), gdn::CudaHeadDims::values.end());
      },
      "Head dims (K = V) of the CUDA kernel.");
  m.attr("cuda_max_spec_columns") = gdn::kCudaMaxSpecColumns;

  m.def(
      "cuda_device_count",
      [] {
#ifdef GDN_HAS_CUDA
        return gdn::cuda_api::device_count();
#else
        return 0;
#endif
      },
      "Visible CUDA devices (0 without a driver, a device or a CUDA build).");
  m.def(
      "cuda_kernels_available",
      [](int device) {
        std::string why = "this build of gdn has no CUDA kernels";
#ifdef GDN_HAS_CUDA
        bool ok = gdn::cuda_api::kernels_available(device, &why);
        return nb::make_tuple(ok, why);
#else
        (void)device;
        return nb::make_tuple(false, why);
#endif
      },
      nb::arg("device") = 0,
      "(available, reason): whether a compiled kernel image runs on this CUDA device.");

  // Per-argument probes with the operations' own casters: the Python wrappers call them only after
  // a call was refused, to name the argument nanobind could not convert.
  using gdn::python::FastConstArray;
  using gdn::python::FastWritableArray;
  m.def("_accepts_array", [](const FastWritableArray&) { return true; }, nb::arg("x").noconvert());
  m.def(
      "_accepts_readonly_array", [](const FastConstArray&) { return true; },
      nb::arg("x").noconvert());
  m.def(
      "_fast_import_available",
      [](nb::handle x, bool readonly) {
        return readonly ? FastConstArray().import_fast(x.ptr())
                        : FastWritableArray().import_fast(x.ptr());
      },
      nb::arg("x").none(), nb::arg("readonly") = false,
      "Whether `x` is read through the DLPack C exchange API of its type (no Python call), as an "
      "argument that is written (or, with `readonly`, only read); False: nanobind's import.");
  m.def(
      "_array_view",
      [](const FastWritableArray& a) {
        nb::list shape, strides;
        for (int d = 0; d < a.ndim && d < gdn::TensorView::kMaxDims; ++d) {
          shape.append(a.shape[d]);
          strides.append(a.strides[d]);
        }
        return nb::make_tuple(a.api != nullptr, reinterpret_cast<uintptr_t>(a.data),
                              nb::make_tuple(a.dtype.code, a.dtype.bits, a.dtype.lanes),
                              nb::make_tuple(a.device.device_type, a.device.device_id), a.ndim,
                              nb::tuple(shape), nb::tuple(strides));
      },
      nb::arg("x").noconvert(),
      "(fast import, data pointer, (dtype code, bits, lanes), (device type, id), ndim, shape, "
      "strides) of `x` as a written argument reads it (at most 4 dimensions listed).");
  m.def("_accepts_int", [](int64_t) { return true; }, nb::arg("x"));
  m.def("_accepts_float", [](double) { return true; }, nb::arg("x"));
  m.def("_accepts_bool", [](bool) { return true; }, nb::arg("x"));
  m.def("_accepts_str", [](const std::string&) { return true; }, nb::arg("x"));
  m.def("_accepts_stream", [](uintptr_t) { return true; }, nb::arg("x"));

  gdn::python::bind_decode_mtp(m);
  gdn::python::bind_conv(m);
  gdn::python::bind_metadata(m);
  gdn::python::bind_replay(m);
  gdn::python::bind_prefill(m);
}
