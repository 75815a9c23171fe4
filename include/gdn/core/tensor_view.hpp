// Non-owning tensor view (pointer, dtype, shape, element strides, device) and the argument checks
// every operation shares. Checks return a Status whose reason names the argument.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "gdn/core/dispatch.hpp"
#include "gdn/core/dtype.hpp"
#include "gdn/core/status.hpp"

namespace gdn {

enum class DeviceType : int { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

inline std::string to_string(Device d) {
  return d.type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = -1;  // -1: absent (an optional argument that was not given)
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  Device device{};

  bool present() const noexcept { return ndim >= 0; }
  // data, or null for an absent view (how a kernel's arguments mark an optional array missing).
  void* data_or_null() const noexcept { return present() ? data : nullptr; }
  int64_t size(int d) const noexcept { return shape[d]; }
  int64_t stride(int d) const noexcept { return strides[d]; }
  int64_t numel() const noexcept {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  template <class T>
  T* ptr() const noexcept {
    return static_cast<T*>(data);
  }

  // Takes const pointers too, so read-only inputs need no const_cast: a view does not carry
  // constness, and an operation writes only through its output arguments.
  static TensorView make(const void* data, DType dtype, std::initializer_list<int64_t> shape,
                         std::initializer_list<int64_t> strides = {}, Device device = {}) {
    TensorView v;
    v.data = const_cast<void*>(data);
    v.dtype = dtype;
    v.device = device;
    v.ndim = int(shape.size());
    int d = 0;
    for (int64_t s : shape) v.shape[d++] = s;
    if (strides.size() == shape.size()) {
      d = 0;
      for (int64_t s : strides) v.strides[d++] = s;
    } else {  // contiguous
      int64_t s = 1;
      for (d = v.ndim - 1; d >= 0; --d) {
        v.strides[d] = s;
        s *= v.shape[d];
      }
    }
    return v;
  }
};

inline std::string shape_string(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + std::to_string(t.shape[d]);
  return s + "]";
}

// Argument checks. Each names the argument in its reason.
namespace check {

inline Status present(const TensorView& t, const char* name) {
  if (!t.present()) return Status::invalid(std::string(name) + " is required");
  if (t.data == nullptr && t.numel() > 0)
    return Status::invalid(std::string(name) + " has a null data pointer");
  return Status::ok();
}

inline Status ndim(const TensorView& t, const char* name, int expected) {
  if (t.ndim != expected)
    return Status::invalid(std::string(name) + " must have " + std::to_string(expected) +
                           " dimensions, got " + std::to_string(t.ndim) + " (shape " +
                           shape_string(t) + ")");
  return Status::ok();
}

inline Status dim(const TensorView& t, const char* name, int d, int64_t expected,
                  const char* what) {
  if (t.shape[d] != expected)
    return Status::invalid(std::string(name) + " dimension " + std::to_string(d) + " must be " +
                           what + " = " + std::to_string(expected) + ", got " +
                           std::to_string(t.shape[d]) + " (shape " + shape_string(t) + ")");
  return Status::ok();
}

// The dtypes an argument accepts: a list of gdn/core/support.hpp (StateDTypes{}, ...) or a braced
// list of one-off dtypes; an error lists them in this order.
class DTypeSet {
 public:
  DTypeSet(std::initializer_list<DType> list) {
    for (DType d : list)
      if (size_ < kMax) items_[size_++] = d;
  }
  template <auto... Vs>
  constexpr DTypeSet(ValueList<Vs...>) : items_{Vs...}, size_(sizeof...(Vs)) {
    static_assert(sizeof...(Vs) <= kMax, "DTypeSet holds at most kMax dtypes");
  }
  const DType* begin() const { return items_; }
  const DType* end() const { return items_ + size_; }

 private:
  static constexpr size_t kMax = 8;
  DType items_[kMax] = {};
  size_t size_ = 0;
};

inline Status dtype_in(const TensorView& t, const char* name, DTypeSet ok) {
  for (DType d : ok)
    if (t.dtype == d) return Status::ok();
  std::string allowed;
  for (DType d : ok) allowed += (allowed.empty() ? "" : ", ") + std::string(to_string(d));
  return Status::invalid(std::string(name) + " has dtype " + std::string(to_string(t.dtype)) +
                         "; expected one of: " + allowed);
}

inline Status unit_stride(const TensorView& t, const char* name, int d) {
  if (t.shape[d] > 1 && t.strides[d] != 1)
    return Status::invalid(std::string(name) + " must have unit stride on dimension " +
                           std::to_string(d) + ", got stride " + std::to_string(t.strides[d]));
  return Status::ok();
}

// Dimensions [first, ndim) are densely packed (row-major) in memory.
inline Status contiguous_from(const TensorView& t, const char* name, int first) {
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= first; --d) {
    if (t.shape[d] > 1 && t.strides[d] != expected)
      return Status::invalid(
          std::string(name) + " must be contiguous in dimensions " + std::to_string(first) + ".." +
          std::to_string(t.ndim - 1) + " (stride of dimension " + std::to_string(d) + " is " +
          std::to_string(t.strides[d]) + ", expected " + std::to_string(expected) + ")");
    expected *= t.shape[d];
  }
  return Status::ok();
}

inline Status nonnegative_strides(const TensorView& t, const char* name) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.strides[d] < 0)
      return Status::invalid(std::string(name) + " has a negative stride on dimension " +
                             std::to_string(d));
  return Status::ok();
}

// A row stride large enough that rows never overlap.
inline Status row_stride_at_least(const TensorView& t, const char* name, int64_t min_stride) {
  if (t.shape[0] > 1 && t.strides[0] < min_stride)
    return Status::invalid(std::string(name) + " row stride " + std::to_string(t.strides[0]) +
                           " is smaller than the row size " + std::to_string(min_stride) +
                           " (rows would overlap)");
  return Status::ok();
}

inline Status same_device(const TensorView& t, const char* name, Device device) {
  if (t.present() && !(t.device == device))
    return Status::invalid(std::string(name) + " is on " + to_string(t.device) +
                           " but the call runs on " + to_string(device));
  return Status::ok();
}

// A present array of `rank` dimensions and one of `dtypes`; its sizes and strides are the caller's.
// Checks in the order present, ndim, dtype_in.
inline Status typed(const TensorView& t, const char* name, int rank, DTypeSet dtypes) {
  GDN_RETURN_IF_ERROR(present(t, name));
  GDN_RETURN_IF_ERROR(ndim(t, name, rank));
  return dtype_in(t, name, dtypes);
}

// A present 2-D array of one of `dtypes` whose rows are unit-stride (any row stride, so a column
// slice of a wider array passes), with no negative stride. Checks in the order present, ndim,
// dtype_in, unit_stride, nonnegative_strides.
inline Status unit_stride_rows(const TensorView& t, const char* name, DTypeSet dtypes) {
  GDN_RETURN_IF_ERROR(typed(t, name, 2, dtypes));
  GDN_RETURN_IF_ERROR(unit_stride(t, name, 1));
  return nonnegative_strides(t, name);
}

// The size one dimension must have, and what that size is (for the message of `dim`).
struct Extent {
  int64_t size;
  const char* what;
};

// A present array of one of `dtypes` whose shape is exactly `extents` (one per dimension).
// Checks in the order present, ndim, dtype_in, dim 0, dim 1, ...; strides are the caller's.
inline Status shaped(const TensorView& t, const char* name, DTypeSet dtypes,
                     std::initializer_list<Extent> extents) {
  GDN_RETURN_IF_ERROR(typed(t, name, int(extents.size()), dtypes));
  int d = 0;
  for (const Extent& e : extents) GDN_RETURN_IF_ERROR(dim(t, name, d++, e.size, e.what));
  return Status::ok();
}

// A contiguous 1-D array of `length` elements of one of `dtypes`.
inline Status contiguous_vector(const TensorView& t, const char* name, DTypeSet dtypes,
                                int64_t length, const char* what) {
  GDN_RETURN_IF_ERROR(shaped(t, name, dtypes, {{length, what}}));
  return contiguous_from(t, name, 0);
}

// An optional error counter: absent, or exactly one int32 element.
inline Status optional_counter(const TensorView& t, const char* name) {
  if (!t.present()) return Status::ok();
  GDN_RETURN_IF_ERROR(present(t, name));
  GDN_RETURN_IF_ERROR(dtype_in(t, name, {DType::kInt32}));
  if (t.numel() != 1)
    return Status::invalid(std::string(name) + " must hold exactly one int32 element");
  return Status::ok();
}

}  // namespace check
}  // namespace gdn
