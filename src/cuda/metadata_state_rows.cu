// Host entry points of the metadata builder's CUDA part (declared in cuda_api_metadata.hpp).
#include <cuda_runtime.h>

#include <string>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/kernels/cuda_api_metadata.hpp"
#include "gdn/metadata/builder.cuh"
#include "gdn/metadata/plan.hpp"
#include "gdn/metadata/state_rows.cuh"

// The kernel is compiled once here for every library user.
template __global__ void
gdn::metadata::cuda_detail::state_rows_kernel<gdn::metadata::cuda_detail::kStateRowThreads>(
    const __grid_constant__ gdn::metadata::StateRowsArgs);

namespace gdn::cuda_api {
namespace {

Status cuda_error(const char* what, cudaError_t err) {
  return Status(StatusCode::kCudaError,
                std::string("metadata: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace

Status metadata_state_rows(const metadata::Params& params, void* stream) {
  if (params.plan.device.type != DeviceType::kCUDA)
    return Status::invalid(
        "metadata_state_rows: the CUDA pass needs the device plan buffer, "
        "plan is on " +
        to_string(params.plan.device));
  return cuda::on_device("metadata_state_rows", params.plan.device.index, [&] {
    return metadata::launch_state_rows_cuda(params, static_cast<cudaStream_t>(stream));
  });
}

Status metadata_copy_plan(const TensorView& host_plan, const TensorView& device_plan, int64_t words,
                          void* stream) {
  if (host_plan.device.type != DeviceType::kCPU || device_plan.device.type != DeviceType::kCUDA)
    return Status::invalid("metadata_copy_plan copies a host plan buffer into a CUDA one");
  if (words < 0 || host_plan.numel() < words || device_plan.numel() < words)
    return Status::invalid("metadata_copy_plan: " + std::to_string(words) +
                           " words do not fit both plan buffers");
  return cuda::on_device("metadata_copy_plan", device_plan.device.index, [&]() -> Status {
    const cudaError_t err =
        cudaMemcpyAsync(device_plan.data, host_plan.data, size_t(words) * sizeof(int32_t),
                        cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return cuda_error("plan copy to the device failed", err);
    return Status::ok();
  });
}

const metadata::DeviceOps& metadata_builder_ops() { return metadata::cuda_builder_ops(); }

Status synchronize_stream(void* stream) {
  const cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return cuda_error("stream synchronisation failed", err);
  return Status::ok();
}

Status metadata_step(const metadata::Params& params, const TensorView& device_plan, void* stream) {
  metadata::Params pass = params;
  pass.plan = device_plan;
  // Everything is validated before the host plan is written.
  GDN_RETURN_IF_ERROR(metadata::check_state_rows_arguments(pass, DeviceType::kCUDA));
  GDN_RETURN_IF_ERROR(metadata::plan(params));
  GDN_RETURN_IF_ERROR(
      metadata_copy_plan(params.plan, device_plan, params.layout().total_words, stream));
  return metadata_state_rows(pass, stream);
}

}  // namespace gdn::cuda_api
