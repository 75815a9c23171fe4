// Device queries shared by every CUDA operation: device count and a per-architecture probe of the
// compiled kernel images (a kernel symbol existing is not enough: the image must run on the
// device).
#include <cuda_runtime.h>

#include <string>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api.hpp"

namespace gdn::cuda_api {
namespace {
__global__ void probe_kernel() {}
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

bool kernels_available(int device, std::string* why) {
  const int n = device_count();
  if (device < 0 || device >= n) {
    if (why)
      *why = "no CUDA device " + std::to_string(device) + " (" + std::to_string(n) + " visible)";
    return false;
  }
  cudaFuncAttributes attr{};
  cudaDeviceProp prop{};
  cudaError_t err = cudaSuccess;
  const Status selected = cuda::on_device("kernels_available", device, [&] {
    err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err != cudaSuccess) (void)cudaGetLastError();  // reported below, not as a launch error
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) (void)cudaGetLastError();
    return Status::ok();
  });
  if (!selected.is_ok()) {
    if (why) *why = selected.reason();
    return false;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why)
      *why = "no kernel image for sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
             " in this build (" + cudaGetErrorString(err) + ")";
    return false;
  }
  if (why)
    *why = "kernel image for sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
           " (binary sm_" + std::to_string(attr.binaryVersion) + ", ptx " +
           std::to_string(attr.ptxVersion) + ")";
  return true;
}

}  // namespace gdn::cuda_api
