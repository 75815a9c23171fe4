// metadata: the CUDA part of the builder (builder.hpp): the DeviceOps table over the CUDA runtime
// and the state-row launch. nvcc code includes this and passes cuda_builder_ops() to
// Builder::initialize; host-compiled code linking gdn::kernels gets the same table from
// gdn::cuda_api::metadata_builder_ops(). Each operation selects the builder's device for its own
// duration only; none synchronises except copy_to_host (debug checks) and allocate (once).
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/metadata/builder.hpp"
#include "gdn/metadata/state_rows.cuh"

namespace gdn::metadata {
namespace cuda_builder_detail {

inline constexpr const char* kOp = "metadata builder";

inline Status error(const char* what, cudaError_t err) {
  return Status(StatusCode::kCudaError,
                std::string(kOp) + ": " + what + ": " + cudaGetErrorString(err));
}

inline Status submit(const void* host_plan, void* device_plan, size_t bytes, void* event,
                     const StateRowsArgs* args, int device, void* stream) {
  const cuda::DeviceGuard guard(kOp, device);
  GDN_RETURN_IF_ERROR(guard.status());
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (host_plan) {
    const cudaError_t err =
        cudaMemcpyAsync(device_plan, host_plan, bytes, cudaMemcpyHostToDevice, s);
    if (err != cudaSuccess) return error("plan copy to the device failed", err);
  }
  if (event) {
    const cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(event), s);
    if (err != cudaSuccess) return error("event record failed", err);
  }
  if (args) GDN_RETURN_IF_ERROR(launch_state_rows_cuda(*args, s));
  return Status::ok();
}

inline Status copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream) {
  const cuda::DeviceGuard guard(kOp, device);
  GDN_RETURN_IF_ERROR(guard.status());
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return error("copy to the host failed", err);
  return Status::ok();
}

inline Status event_create(int device, void** event) {
  const cuda::DeviceGuard guard(kOp, device);
  GDN_RETURN_IF_ERROR(guard.status());
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (err != cudaSuccess) return error("event creation failed", err);
  *event = e;
  return Status::ok();
}

inline void event_destroy(void* event) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

inline Status event_synchronize(void* event) {
  const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  if (err != cudaSuccess) return error("waiting for a plan copy failed", err);
  return Status::ok();
}

inline Status allocate(size_t bytes, bool pinned_host, int device, void** out) {
  const cuda::DeviceGuard guard(kOp, device);
  GDN_RETURN_IF_ERROR(guard.status());
  void* p = nullptr;
  if (bytes == 0) bytes = 16;
  if (pinned_host) {
    const cudaError_t err = cudaMallocHost(&p, bytes);
    if (err != cudaSuccess) return error("page-locked allocation failed", err);
    std::memset(p, 0, bytes);
  } else {
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) return error("device allocation failed", err);
    err = cudaMemset(p, 0, bytes);
    if (err == cudaSuccess) err = cudaStreamSynchronize(nullptr);  // zero before any step
    if (err != cudaSuccess) {
      (void)cudaFree(p);
      return error("device memset failed", err);
    }
  }
  *out = p;
  return Status::ok();
}

inline void release(void* ptr, bool pinned_host, int device) {
  const cuda::DeviceGuard guard(kOp, device);  // nothing to report: frees what it can
  if (pinned_host)
    (void)cudaFreeHost(ptr);
  else
    (void)cudaFree(ptr);
}

}  // namespace cuda_builder_detail

// The CUDA runtime operations of a CUDA metadata builder.
inline const DeviceOps& cuda_builder_ops() {
  static const DeviceOps ops = [] {
    DeviceOps o;
    o.submit = cuda_builder_detail::submit;
    o.copy_to_host = cuda_builder_detail::copy_to_host;
    o.event_create = cuda_builder_detail::event_create;
    o.event_destroy = cuda_builder_detail::event_destroy;
    o.event_synchronize = cuda_builder_detail::event_synchronize;
    o.allocate = cuda_builder_detail::allocate;
    o.release = cuda_builder_detail::release;
    return o;
  }();
  return ops;
}

}  // namespace gdn::metadata
