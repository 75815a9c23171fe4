// The GPU test binaries' skip rule: without a usable GPU every device test skips, saying so.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

namespace gdn::testing {

// Whether a CUDA device is usable; otherwise `why` says there is no GPU and what CUDA reported
// (a machine without a driver reports "driver version is insufficient", which is not the point).
inline bool gpu_present(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess && n > 0) return true;
  (void)cudaGetLastError();  // clear the sticky "no device / no driver" error
  *why = err != cudaSuccess
             ? std::string("no GPU: no usable CUDA driver or device (CUDA reports: ") +
                   cudaGetErrorString(err) + ")"
             : std::string("no GPU: the CUDA driver sees no device");
  return false;
}

}  // namespace gdn::testing

#define GDN_SKIP_WITHOUT_GPU()                                     \
  do {                                                             \
    std::string why_;                                              \
    if (!::gdn::testing::gpu_present(&why_)) GTEST_SKIP() << why_; \
  } while (0)
