// Host side: per-device facts looked up once per device and cached (lock-free; racing first calls
// store equal values), kernel attributes set once per (kernel, device), and the device guard and
// error boundary of every CUDA entry point.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <utility>

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::cuda {

inline constexpr int kMaxDevices = 64;

struct DeviceInfo {
  int sm_count = 0;
  int major = 0;
  int shared_per_sm = 0;     // bytes of shared memory an SM gives its resident CTAs
  int reserved_per_cta = 0;  // bytes of it the runtime reserves per CTA
  int shared_per_cta = 0;    // the most a CTA may ask for (opting in)
};

inline Status device_info(int device, DeviceInfo* info) {
  static std::atomic<int> sm_count[kMaxDevices];
  static std::atomic<int> major[kMaxDevices];
  static std::atomic<int> shared_per_sm[kMaxDevices];
  static std::atomic<int> reserved_per_cta[kMaxDevices];
  static std::atomic<int> shared_per_cta[kMaxDevices];
  if (device < 0 || device >= kMaxDevices)
    return Status(StatusCode::kCudaError,
                  "device index " + std::to_string(device) + " out of range");
  int sms = sm_count[device].load(std::memory_order_acquire);
  if (sms == 0) {
    int mj = 0, smem = 0, reserved = 0, optin = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&mj, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      return Status(StatusCode::kCudaError,
                    std::string("cannot query CUDA device: ") + cudaGetErrorString(err));
    }
    major[device].store(mj, std::memory_order_relaxed);
    shared_per_sm[device].store(smem, std::memory_order_relaxed);
    reserved_per_cta[device].store(reserved, std::memory_order_relaxed);
    shared_per_cta[device].store(optin, std::memory_order_relaxed);
    sm_count[device].store(sms, std::memory_order_release);
  }
  info->sm_count = sms;
  info->major = major[device].load(std::memory_order_relaxed);
  info->shared_per_sm = shared_per_sm[device].load(std::memory_order_relaxed);
  info->reserved_per_cta = reserved_per_cta[device].load(std::memory_order_relaxed);
  info->shared_per_cta = shared_per_cta[device].load(std::memory_order_relaxed);
  return Status::ok();
}

// The PTX version `kernel`'s image on the current device was built for (90 = sm_90 features
// such as clusters and bulk copies are there), cached per device by the caller's static.
template <class Kernel>
inline int kernel_ptx_version(Kernel kernel, int device, std::atomic<int> (&cache)[kMaxDevices]) {
  if (device < 0 || device >= kMaxDevices) return 0;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess) {
      v = attr.ptxVersion;
    } else {
      (void)cudaGetLastError();
      v = -1;
    }
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Lets `kernel` take up to `bytes` of dynamic shared memory on `device` and prefer the largest
// shared-memory carveout (the launcher's occupancy arithmetic assumes it): attribute calls once per
// (kernel, device), not stream operations, so they are also safe while a graph is being captured.
template <class Kernel>
inline Status allow_dynamic_shared(Kernel kernel, int device, int bytes,
                                   std::atomic<int> (&cache)[kMaxDevices]) {
  if (device < 0 || device >= kMaxDevices)
    return Status(StatusCode::kCudaError,
                  "device index " + std::to_string(device) + " out of range");
  if (cache[device].load(std::memory_order_acquire) >= bytes) return Status::ok();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
      cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(
        StatusCode::kCudaError,
        std::string("cannot set the kernel's shared memory size: ") + cudaGetErrorString(err));
  }
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           int(cudaSharedmemCarveoutMaxShared)) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(
        StatusCode::kCudaError,
        std::string("cannot set the kernel's shared memory carveout: ") + cudaGetErrorString(err));
  }
  cache[device].store(bytes, std::memory_order_release);
  return Status::ok();
}

// Makes `device` current for the guard's lifetime (no runtime call where it already is) and makes
// the caller's device current again when it ends. status(): a failure to select the device, naming
// `op`. Every CUDA entry point (on_device) and every runtime operation of the CUDA metadata builder
// runs under one.
class DeviceGuard {
 public:
  DeviceGuard(const char* op, int device) : status_(select(op, device)) {}
  ~DeviceGuard() {
    if (restore_) (void)cudaSetDevice(previous_);  // was current a moment ago
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  Status select(const char* op, int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      return Status(StatusCode::kCudaError,
                    std::string(op) + ": no usable CUDA device: " + cudaGetErrorString(err));
    }
    if (previous_ == device) return Status::ok();
    if (cudaSetDevice(device) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      return Status(StatusCode::kCudaError, std::string(op) + ": cannot select CUDA device " +
                                                std::to_string(device) + ": " +
                                                cudaGetErrorString(err));
    }
    restore_ = true;
    return Status::ok();
  }

  int previous_ = -1;
  bool restore_ = false;
  Status status_;  // after previous_ and restore_, which select() sets
};

// The error boundary of every CUDA entry point: runs `launch` with `device` (the arrays' device; a
// caller's stream belongs to it) current, restores the caller's device, and reports a failure to
// select the device or an error raised by the launch as a Status naming `op`.
template <class F>
inline Status on_device(const char* op, int device, F&& launch) {
  const DeviceGuard guard(op, device);
  if (!guard.status().is_ok()) return guard.status();
  Status status = launch();
  if (!status.is_ok()) return status;
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string(op) + ": CUDA error after launch: " + cudaGetErrorString(err));
  return status;
}

// `on_device` on the device of `array` (the argument named `name`, whose device the call runs on),
// refused naming where it is when that is not a CUDA device.
template <class F>
inline Status on_array_device(const char* op, const TensorView& array, const char* name,
                              F&& launch) {
  if (array.device.type != DeviceType::kCUDA)
    return Status::invalid(std::string(op) + ": the CUDA path needs CUDA arrays, " + name +
                           " is on " + to_string(array.device));
  return on_device(op, array.device.index, std::forward<F>(launch));
}

}  // namespace gdn::cuda
