// Element types and host-side 16-bit float conversion (round to nearest even).
// Host-only: compiles with g++ alone. CUDA code uses the cuda_bf16/cuda_fp16 types instead.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "gdn/core/enum_table.hpp"
#include "gdn/core/host_device.hpp"

namespace gdn {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kInt32, kInt64, kBool, kFloat64 };

// Bytes of an element (0 for a value outside the enum).
constexpr int dtype_size(DType t) noexcept {
  constexpr int kSizes[] = {4, 2, 2, 4, 8, 1, 8};  // DType's order
  return table_entry(t, kSizes, 0);
}

constexpr std::string_view to_string(DType t) noexcept {
  constexpr std::string_view kNames[] = {"float32", "bfloat16", "float16", "int32",
                                         "int64",   "bool",     "float64"};  // DType's order
  return table_entry(t, kNames, "unknown");
}

constexpr bool is_float16ish(DType t) noexcept {
  return t == DType::kBFloat16 || t == DType::kFloat16;
}

// Storage types for 16-bit floats on the host: raw bits, converted explicitly.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) noexcept {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_float(float x) noexcept { return x; }
inline float to_float(bf16_t x) noexcept { return bits_to_float(uint32_t(x.bits) << 16); }

inline float to_float(f16_t x) noexcept {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    // Subnormal: value = mant * 2^-24, exact in fp32.
    float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline bf16_t to_bf16(float f) noexcept {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
}

inline f16_t to_f16(float f) noexcept {
  uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)};   // nan
  if (u >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (u < 0x38800000u) {
    // Result is subnormal or zero: scale to units of 2^-24 and round half to even.
    float a = bits_to_float(u) * 16777216.0f;  // exact scaling by 2^24
    uint32_t m = uint32_t(a);
    float rem = a - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16_t{uint16_t(sign | m)};
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits, half to even.
  uint32_t r = u - 0x38000000u;  // exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return f16_t{uint16_t(sign | (r >> 13))};
}

template <class T>
inline T from_float(float f) noexcept;
template <>
inline float from_float<float>(float f) noexcept {
  return f;
}
template <>
inline bf16_t from_float<bf16_t>(float f) noexcept {
  return to_bf16(f);
}
template <>
inline f16_t from_float<f16_t>(float f) noexcept {
  return to_f16(f);
}

// The storage type of floating DType D, given the float32, bfloat16 and float16 types of one
// side: the host's (host_type below) and the device's (cuda::device_type) differ in the 16-bit
// ones.
template <DType D, class F32, class BF16, class F16>
struct float_storage {
  static_assert(D == DType::kFloat32 || D == DType::kBFloat16 || D == DType::kFloat16,
                "a floating DType");
  using type = std::conditional_t<D == DType::kFloat32, F32,
                                  std::conditional_t<D == DType::kBFloat16, BF16, F16>>;
};

// Host storage type of a floating DType.
template <DType D>
struct host_type : float_storage<D, float, bf16_t, f16_t> {};
template <DType D>
using host_type_t = typename host_type<D>::type;

// Reads element i of a floating array whose dtype is only known at run time.
inline float load_float(const void* p, DType t, int64_t i) noexcept {
  switch (t) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return to_float(static_cast<const bf16_t*>(p)[i]);
    case DType::kFloat16:
      return to_float(static_cast<const f16_t*>(p)[i]);
    case DType::kFloat64:
      return float(static_cast<const double*>(p)[i]);
    default:
      return 0.0f;
  }
}

inline void store_float(void* p, DType t, int64_t i, float v) noexcept {
  switch (t) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBFloat16:
      static_cast<bf16_t*>(p)[i] = to_bf16(v);
      break;
    case DType::kFloat16:
      static_cast<f16_t*>(p)[i] = to_f16(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(p)[i] = double(v);
      break;
    default:
      break;
  }
}

// v rounded to dtype t and back (round to nearest even); the identity for fp32 and fp64.
inline float round_to(DType t, float v) noexcept {
  switch (t) {
    case DType::kBFloat16:
      return to_float(to_bf16(v));
    case DType::kFloat16:
      return to_float(to_f16(v));
    default:
      return v;
  }
}

// Reads element i of an int32 or int64 index array (host code and the CUDA kernels).
GDN_HOST_DEVICE GDN_FORCE_INLINE int64_t load_index(const void* p, DType t, int64_t i) noexcept {
  return t == DType::kInt64 ? static_cast<const int64_t*>(p)[i]
                            : int64_t(static_cast<const int32_t*>(p)[i]);
}

}  // namespace gdn
