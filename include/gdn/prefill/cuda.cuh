// prefill on CUDA: validates the call on the host, fills the kernel's arguments and launches one
// CTA per (request, value head) (gdn/prefill/cuda_kernel.cuh). Reads no device memory, allocates
// nothing, never synchronises; safe inside CUDA-graph capture for a fixed number of requests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/prefill/cuda_kernel.cuh"
#include "gdn/prefill/params.hpp"

namespace gdn::prefill {

// What the CUDA kernel supports beyond check_arguments: K = V = 128, and one dtype for mixed_qkv,
// z and out (each compiled kernel image reads and writes one element type).
inline Status check_cuda_support(const Params& p, const Problem& pr) {
  if (pr.K != cuda_detail::kHeadDim || pr.V != cuda_detail::kHeadDim)
    return Status::unsupported(
        "prefill on CUDA supports K = V = " + std::to_string(cuda_detail::kHeadDim) + ", got K = " +
        std::to_string(pr.K) + ", V = " + std::to_string(pr.V) + " (the CPU path takes any K, V)");
  for (const auto& [view, name] :
       {decode_mtp::NamedView{&p.z, "z"}, decode_mtp::NamedView{&p.out, "out"}})
    if (view->present() && view->dtype != p.mixed_qkv.dtype)
      return Status::unsupported(
          std::string("prefill on CUDA needs ") + name + " in mixed_qkv's dtype " +
          std::string(to_string(p.mixed_qkv.dtype)) + ", got " +
          std::string(to_string(view->dtype)) + " (the CPU path takes any mix)");
  return Status::ok();
}

namespace cuda_detail {

inline KernelArgs kernel_args(const Params& p, const Problem& pr) {
  KernelArgs a{};
  a.mixed_qkv = p.mixed_qkv.data;
  a.a = p.a.data;
  a.b = p.b.data;
  a.A_log = p.A_log.data;
  a.dt_bias = p.dt_bias.data;
  a.z = p.z.present() ? p.z.data : nullptr;
  a.norm_weight = p.norm_weight.present() ? p.norm_weight.data : nullptr;
  a.state = p.state.data;
  a.cu_seqlens = p.cu_seqlens.data;
  a.initial_state_indices = p.initial_state_indices.data;
  a.final_state_indices = p.final_state_indices.data;
  a.checkpoint_indices = p.checkpoint_indices.present() ? p.checkpoint_indices.data : nullptr;
  a.out = p.out.data;
  a.error_count = p.error_count.present() ? static_cast<int*>(p.error_count.data) : nullptr;
  a.qkv_dtype = p.mixed_qkv.dtype;
  a.a_dtype = p.a.dtype;
  a.b_dtype = p.b.dtype;
  a.A_log_dtype = p.A_log.dtype;
  a.dt_bias_dtype = p.dt_bias.dtype;
  a.z_dtype = p.z.present() ? p.z.dtype : DType::kFloat32;
  a.norm_weight_dtype = p.norm_weight.present() ? p.norm_weight.dtype : DType::kFloat32;
  a.state_dtype = p.state.dtype;
  a.out_dtype = p.out.dtype;
  a.cu_dtype = p.cu_seqlens.dtype;
  a.initial_dtype = p.initial_state_indices.dtype;
  a.final_dtype = p.final_state_indices.dtype;
  a.checkpoint_dtype = p.checkpoint_indices.present() ? p.checkpoint_indices.dtype : DType::kInt32;
  a.qkv_row_stride = p.mixed_qkv.strides[0];
  a.a_row_stride = p.a.strides[0];
  a.b_row_stride = p.b.strides[0];
  a.z_row_stride = p.z.present() ? p.z.strides[0] : 0;
  a.z_head_stride = p.z.present() ? p.z.strides[1] : 0;
  a.initial_stride = p.initial_state_indices.strides[0];
  a.final_stride = p.final_state_indices.strides[0];
  a.checkpoint_row_stride = p.checkpoint_indices.present() ? p.checkpoint_indices.strides[0] : 0;
  a.checkpoint_col_stride = p.checkpoint_indices.present() ? p.checkpoint_indices.strides[1] : 0;
  a.L = pr.L;
  a.N = pr.N;
  a.H = pr.H;
  a.HV = pr.HV;
  a.ratio = pr.ratio;
  a.num_slots = pr.num_slots;
  a.slot_stride = p.state.strides[0];
  a.first_valid_slot = p.first_valid_slot;
  a.checkpoint_every = p.checkpoint_indices.present() ? p.checkpoint_every : 0;
  a.checkpoint_columns = pr.C;
  a.scale = pr.scale;
  a.l2_eps = p.l2_eps;
  a.norm_eps = p.norm_eps;
  a.gate = p.gate;
  a.layout = p.layout;
  a.round_core_output = p.round_core_output;
  return a;
}

}  // namespace cuda_detail

// Launches prefill on `stream`, on the current device (gdn::cuda_api::prefill makes the arrays'
// device current).
inline Status launch_cuda(const Params& p, cudaStream_t stream) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  if (pr.device.type != DeviceType::kCUDA)
    return Status::invalid("launch_cuda was given tensors on " + to_string(pr.device));
  GDN_RETURN_IF_ERROR(check_cuda_support(p, pr));
  if (pr.N == 0 || pr.L == 0) return Status::ok();
  const int64_t ctas = pr.N * pr.HV;
  if (ctas > 0x7fffffff)
    return Status::unsupported("prefill: N * HV = " + std::to_string(ctas) +
                               " exceeds the launch grid");
  const cuda_detail::KernelArgs args = cuda_detail::kernel_args(p, pr);
  const auto launch = [&]<class T>() -> Status {
    static std::atomic<int> shared_set[cuda::kMaxDevices];
    GDN_RETURN_IF_ERROR(cuda::allow_dynamic_shared(cuda_detail::prefill_kernel<T>, pr.device.index,
                                                   cuda_detail::kSharedBytes, shared_set));
    cuda_detail::prefill_kernel<T>
        <<<unsigned(ctas), cuda_detail::kThreads, cuda_detail::kSharedBytes, stream>>>(args);
    return Status::ok();
  };
  GDN_RETURN_IF_ERROR(p.mixed_qkv.dtype == DType::kBFloat16
                          ? launch.template operator()<__nv_bfloat16>()
                      : p.mixed_qkv.dtype == DType::kFloat16 ? launch.template operator()<__half>()
                                                             : launch.template operator()<float>());
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string("prefill launch failed: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace gdn::prefill
