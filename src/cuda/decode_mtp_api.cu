// Host entry point of the compiled decode_mtp CUDA kernels (declared in cuda_api.hpp).
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "cuda_api.hpp"
#include "gdn/decode_mtp/cuda.cuh"

namespace gdn::cuda_api {
namespace {

// GDN_DECODE_MTP_SPLIT=1|2|4|8 pins the number of CTAs per value head (a tuning knob for
// benchmarks; unset or 0 = automatic). Read at each call: a captured graph keeps the split that
// was in force when it was captured.
int split_override() {
  const char* env = std::getenv("GDN_DECODE_MTP_SPLIT");
  return env ? std::atoi(env) : 0;
}

}  // namespace

Status decode_mtp(const decode_mtp::Params& params, void* stream) {
  if (params.state.device.type != DeviceType::kCUDA)
    return Status::invalid("decode_mtp: the CUDA path needs CUDA arrays, state is on " +
                           to_string(params.state.device));
  const int device = params.state.device.index;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError,
                  std::string("decode_mtp: no usable CUDA device: ") + cudaGetErrorString(err));
  }
  // Launch on the arrays' device: the caller's stream belongs to it.
  if (previous != device && cudaSetDevice(device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError, "decode_mtp: cannot select CUDA device " +
                                              std::to_string(device) + ": " + cudaGetErrorString(err));
  }
  Status status =
      decode_mtp::launch_cuda(params, static_cast<cudaStream_t>(stream), split_override());
  const cudaError_t err = status.is_ok() ? cudaGetLastError() : cudaSuccess;
  if (previous != device) (void)cudaSetDevice(previous);
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string("decode_mtp: CUDA error after launch: ") + cudaGetErrorString(err));
  return status;
}

}  // namespace gdn::cuda_api
