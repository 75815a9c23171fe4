// The one dispatch helper: maps a run-time value onto a compile-time template argument drawn from
// a closed list, by calling a C++20 templated lambda `f.template operator()<V>()`.
//
//   HeadRatios::dispatch(ratio, [&]<int R>() { run<R>(...); });
//
// Lists are defined once, in gdn/core/support.hpp.
#pragma once

#include <array>
#include <cstddef>
#include <utility>

namespace gdn {

template <auto... Vs>
struct ValueList {
  static constexpr std::size_t size = sizeof...(Vs);
  static constexpr std::array values{Vs...};

  template <class T>
  static constexpr bool contains(T v) noexcept {
    return ((v == Vs) || ...);
  }

  // Calls f.template operator()<V>() for the V equal to v; returns false if v is not listed.
  template <class T, class F>
  static constexpr bool dispatch(T v, F&& f) {
    return ((v == Vs ? (f.template operator()<Vs>(), true) : false) || ...);
  }
};

// Value 0 of an integral template parameter selects the generic (run-time valued) variant.
inline constexpr int kRuntimeValue = 0;

// Dispatches v to its compile-time specialisation if listed, else to the kRuntimeValue variant.
template <class List, class F>
constexpr bool dispatch_or_runtime(int v, F&& f) {
  if (List::dispatch(v, f)) return true;
  f.template operator()<kRuntimeValue>();
  return false;
}

}  // namespace gdn
