// Status type of the core: no exceptions below the binding edge, every failure carries a reason.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "gdn/core/enum_table.hpp"

namespace gdn {

enum class StatusCode {
  kSuccess,
  kInvalidArgument,  // malformed input: shape, dtype, stride, device or index out of range
  kUnsupported,      // well-formed, but outside what this build / path implements
  kCudaError,        // a CUDA runtime call failed
  kInternal,         // a self-check failed (the metadata builder's shadow check found a mismatch)
};

constexpr std::string_view to_string(StatusCode code) noexcept {
  constexpr std::string_view kNames[] = {"success", "invalid argument", "unsupported", "CUDA error",
                                         "internal check failed"};  // StatusCode's order
  return table_entry(code, kNames, "unknown");
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string reason) : code_(code), reason_(std::move(reason)) {}

  static Status ok() { return {}; }
  static Status invalid(std::string reason) {
    return {StatusCode::kInvalidArgument, std::move(reason)};
  }
  static Status unsupported(std::string reason) {
    return {StatusCode::kUnsupported, std::move(reason)};
  }

  bool is_ok() const noexcept { return code_ == StatusCode::kSuccess; }
  explicit operator bool() const noexcept { return is_ok(); }
  StatusCode code() const noexcept { return code_; }
  const std::string& reason() const noexcept { return reason_; }

 private:
  StatusCode code_ = StatusCode::kSuccess;
  std::string reason_;
};

}  // namespace gdn

// Propagates a failed Status out of the enclosing function.
#define GDN_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    ::gdn::Status gdn_status_ = (expr);           \
    if (!gdn_status_.is_ok()) return gdn_status_; \
  } while (0)
