// Device queries shared by every CUDA operation: device count and a per-architecture probe of the
// compiled kernel images (a kernel symbol existing is not enough: the image must run on the device).
#include <cuda_runtime.h>

#include <string>

#include "cuda_api.hpp"

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
    if (why) *why = "no CUDA device " + std::to_string(device) + " (" + std::to_string(n) + " visible)";
    return false;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, probe_kernel);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  cudaSetDevice(previous);
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
