// The host-side front and back every CUDA launcher shares: validate the arguments and refuse
// arrays that are not on a CUDA device before anything is launched; after the launches, turn a
// failed launch into a Status naming the operation.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn::cuda {

// check_arguments(p, problem) (the operation's, found by ADL), then that its arrays are on a CUDA
// device.
template <class Params, class Problem>
Status check_cuda_call(const Params& p, Problem* problem) {
  GDN_RETURN_IF_ERROR(check_arguments(p, problem));
  if (problem->device.type != DeviceType::kCUDA)
    return Status::invalid("launch_cuda was given tensors on " + to_string(problem->device));
  return Status::ok();
}

// The int counter an optional error_count array holds, null when it is absent (nothing counted).
inline int* error_counter(const TensorView& error_count) {
  return static_cast<int*>(error_count.data_or_null());
}

// Whether the launches just made on this thread started: "<what> launch failed: <CUDA error>"
// when one did not.
inline Status launch_status(const std::string& what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError, what + " launch failed: " + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace gdn::cuda
