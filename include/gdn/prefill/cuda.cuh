// prefill on CUDA: validates the call on the host, fills the kernels' arguments and launches
// either the fused kernel (one CTA per request and value head, no workspace) or the chunk kernel
// (one CTA per chunk slot and value head) followed by a state pass: the one-pass kernel (one CTA
// per request and value head) or the recurrence and output kernels (gdn/prefill/cuda_kernel.cuh;
// choose_state_pass). Reads no device memory and never synchronises; safe inside CUDA-graph
// capture for a fixed token budget and number of requests. A form with a workspace and no caller
// workspace allocates one stream-ordered (a graph captures the allocation too).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/core/cuda/launch.cuh"
#include "gdn/decode_mtp/step_kernel_args.cuh"
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
  if (p.workspace.present()) {
    const int64_t need = cuda_workspace_bytes(pr.L, pr.N, pr.HV);
    const int64_t have = p.workspace.numel() * int64_t(dtype_size(p.workspace.dtype));
    if (p.workspace.device != pr.device)
      return Status::invalid("workspace is on " + to_string(p.workspace.device) +
                             ", the other arrays on " + to_string(pr.device));
    if (have < need)
      return Status::invalid("workspace has " + std::to_string(have) + " bytes; this call needs " +
                             std::to_string(need) + " (cuda_workspace_bytes(L, N, HV))");
    if (reinterpret_cast<uintptr_t>(p.workspace.data) % 16 != 0)
      return Status::invalid("workspace must be 16-byte aligned");
  }
  return Status::ok();
}

namespace cuda_detail {

inline KernelArgs kernel_args(const Params& p, const Problem& pr) {
  KernelArgs a{};
  decode_mtp::fill_step_kernel_args(p, pr, a);
  a.initial_state_indices = p.initial_state_indices.data;
  a.final_state_indices = p.final_state_indices.data;
  a.checkpoint_indices = p.checkpoint_indices.data_or_null();
  a.norm_weight_dtype = p.norm_weight.present() ? p.norm_weight.dtype : DType::kFloat32;
  a.state_dtype = p.state.dtype;
  a.initial_dtype = p.initial_state_indices.dtype;
  a.final_dtype = p.final_state_indices.dtype;
  a.checkpoint_dtype = p.checkpoint_indices.present() ? p.checkpoint_indices.dtype : DType::kInt32;
  a.initial_stride = p.initial_state_indices.strides[0];
  a.final_stride = p.final_state_indices.strides[0];
  a.checkpoint_row_stride = p.checkpoint_indices.present() ? p.checkpoint_indices.strides[0] : 0;
  a.checkpoint_col_stride = p.checkpoint_indices.present() ? p.checkpoint_indices.strides[1] : 0;
  a.chunk_slots = cuda_chunk_slots(pr.L, pr.N);
  a.H = pr.H;
  a.HV = pr.HV;
  a.ratio = pr.ratio;
  a.checkpoint_every = p.checkpoint_indices.present() ? p.checkpoint_every : 0;
  a.checkpoint_columns = pr.C;
  a.gate = p.gate;
  a.layout = p.layout;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t act_bytes = int64_t(dtype_size(p.mixed_qkv.dtype));
  a.z_rows_aligned = p.z.present() && aligned(p.z.data) && (p.z.strides[0] * act_bytes) % 16 == 0 &&
                     (p.z.strides[1] * act_bytes) % 16 == 0;
  a.out_aligned = aligned(p.out.data);
  a.qkv_vector = reinterpret_cast<uintptr_t>(p.mixed_qkv.data) % (4 * act_bytes) == 0 &&
                 p.mixed_qkv.strides[0] % 4 == 0;
  a.qkv_rows_aligned = aligned(p.mixed_qkv.data) && (p.mixed_qkv.strides[0] * act_bytes) % 16 == 0;
  return a;
}

}  // namespace cuda_detail

// The state pass for a call (StatePass). A request's chunks run in order, so one CTA per (request,
// value head) leaves SMs idle when there are few of them: then the recurrence's rows split over
// four CTAs per head (without the norm a state row never needs another) and the outputs of every
// chunk run at once afterwards. With more heads and long requests the fused kernel keeps every
// chunk's tiles on chip; short requests, and devices whose shared memory does not hold the fused
// kernel's, take the one-pass kernel.
inline StatePass choose_state_pass(const Problem& pr, const cuda::DeviceInfo& device) {
  constexpr int recurrence_bytes =
      cuda_detail::kRecurrenceSharedBytes<cuda_detail::kRecurrenceWarps,
                                          cuda_detail::kRecurrenceStages>;
  if (2 * pr.N * pr.HV <= device.sm_count && device.shared_per_cta >= recurrence_bytes)
    return StatePass::kRecurrence;
  // The fused kernel runs a request's chunks in sequence, one CTA per (request, value head), and
  // loads and stores the state once per CTA with nothing to overlap it: short requests (on
  // average over the token budget) run faster through the chunk-parallel one-pass kernel. Its
  // largest CTA: 2-byte activations also stage the next chunk's rows.
  const bool long_requests = pr.L >= kFusedMinMeanTokens * pr.N;
  return long_requests && device.shared_per_cta >= cuda_detail::kFusedSharedBytes<__nv_bfloat16>
             ? StatePass::kFused
             : StatePass::kOnePass;
}

// The workspace a call with kAuto needs on its arrays' device (0: the fused form, which reads
// none). A caller that passes a workspace of this size (or none when it is 0) makes the launch
// allocate nothing.
inline Status cuda_workspace_bytes(const Params& p, int64_t* bytes) {
  Problem pr;
  GDN_RETURN_IF_ERROR(cuda::check_cuda_call(p, &pr));
  GDN_RETURN_IF_ERROR(check_cuda_support(p, pr));
  cuda::DeviceInfo device;
  GDN_RETURN_IF_ERROR(cuda::device_info(pr.device.index, &device));
  *bytes = pr.N == 0 || pr.L == 0 || choose_state_pass(pr, device) == StatePass::kFused
               ? 0
               : cuda_workspace_bytes(pr.L, pr.N, pr.HV);
  return Status::ok();
}

// Launches prefill on `stream`, on the current device (gdn::cuda_api::prefill makes the arrays'
// device current).
inline Status launch_cuda(const Params& p, cudaStream_t stream, StatePass pass = StatePass::kAuto) {
  Problem pr;
  GDN_RETURN_IF_ERROR(cuda::check_cuda_call(p, &pr));
  GDN_RETURN_IF_ERROR(check_cuda_support(p, pr));
  if (pr.N == 0 || pr.L == 0) return Status::ok();
  if (pr.N * pr.HV * cuda_detail::kRecurrenceCtasPerHead > 0x7fffffff ||
      cuda_chunk_slots(pr.L, pr.N) * pr.HV > 0x7fffffff)
    return Status::unsupported("prefill: N = " + std::to_string(pr.N) +
                               ", L = " + std::to_string(pr.L) + ", HV = " + std::to_string(pr.HV) +
                               " exceed the launch grid");
  cuda::DeviceInfo device;
  GDN_RETURN_IF_ERROR(cuda::device_info(pr.device.index, &device));
  if (pass == StatePass::kAuto) pass = choose_state_pass(pr, device);
  cuda_detail::KernelArgs args = cuda_detail::kernel_args(p, pr);
  void* owned_workspace = nullptr;
  if (p.workspace.present()) {
    args.workspace = p.workspace.data;
  } else if (pass != StatePass::kFused) {  // the fused kernel reads no workspace
    const cudaError_t err =
        cudaMallocAsync(&owned_workspace, size_t(cuda_workspace_bytes(pr.L, pr.N, pr.HV)), stream);
    if (err != cudaSuccess)
      return Status(
          StatusCode::kCudaError,
          std::string("prefill: cannot allocate its workspace: ") + cudaGetErrorString(err));
    args.workspace = owned_workspace;
  }
  const unsigned chunk_grid = unsigned(args.chunk_slots * pr.HV);
  const auto launch = [&]<class T>() -> Status {
    namespace d = cuda_detail;
    if (pass == StatePass::kFused) {
      static std::atomic<int> fused_shared_set[cuda::kMaxDevices];
      GDN_RETURN_IF_ERROR(cuda::allow_dynamic_shared(d::prefill_fused_kernel<T>, pr.device.index,
                                                     d::kFusedSharedBytes<T>, fused_shared_set));
      d::prefill_fused_kernel<T>
          <<<unsigned(pr.N * pr.HV), d::kThreads, d::kFusedSharedBytes<T>, stream>>>(args);
      return Status::ok();
    }
    static std::atomic<int> chunk_shared_set[cuda::kMaxDevices];
    GDN_RETURN_IF_ERROR(cuda::allow_dynamic_shared(d::prefill_chunk_kernel<T>, pr.device.index,
                                                   d::kChunkSharedBytes, chunk_shared_set));
    d::prefill_chunk_kernel<T><<<chunk_grid, d::kThreads, d::kChunkSharedBytes, stream>>>(args);
    const auto one_pass = [&]<int kStages>() -> Status {
      static std::atomic<int> state_shared_set[cuda::kMaxDevices];
      constexpr int bytes = d::kStateSharedBytes<T, kStages>;
      GDN_RETURN_IF_ERROR(cuda::allow_dynamic_shared(d::prefill_state_kernel<T, kStages>,
                                                     pr.device.index, bytes, state_shared_set));
      d::prefill_state_kernel<T, kStages>
          <<<unsigned(pr.N * pr.HV), d::kThreads, bytes, stream>>>(args);
      return Status::ok();
    };
    if (pass == StatePass::kRecurrence) {
      static std::atomic<int> recurrence_shared_set[cuda::kMaxDevices];
      static std::atomic<int> output_shared_set[cuda::kMaxDevices];
      constexpr auto recurrence =
          d::prefill_recurrence_kernel<d::kRecurrenceWarps, d::kRecurrenceStages>;
      constexpr int bytes = d::kRecurrenceSharedBytes<d::kRecurrenceWarps, d::kRecurrenceStages>;
      GDN_RETURN_IF_ERROR(
          cuda::allow_dynamic_shared(recurrence, pr.device.index, bytes, recurrence_shared_set));
      GDN_RETURN_IF_ERROR(cuda::allow_dynamic_shared(d::prefill_output_kernel<T>, pr.device.index,
                                                     d::kOutputSharedBytes<T>, output_shared_set));
      recurrence<<<unsigned(pr.N * pr.HV * d::kRecurrenceCtasPerHead), 32 * d::kRecurrenceWarps,
                   bytes, stream>>>(args);
      d::prefill_output_kernel<T>
          <<<chunk_grid, d::kThreads, d::kOutputSharedBytes<T>, stream>>>(args);
      return Status::ok();
    }
    // Two buffers where the device's shared memory holds them (the next chunk's copy overlaps the
    // current chunk's work), else one.
    return device.shared_per_cta >= d::kStateSharedBytes<T, 2> ? one_pass.template operator()<2>()
                                                               : one_pass.template operator()<1>();
  };
  Status status = Status::unsupported(
      "prefill: mixed_qkv dtype " + std::string(to_string(p.mixed_qkv.dtype)) + " not compiled in");
  ActivationDTypes::dispatch(p.mixed_qkv.dtype, [&]<DType kAct>() {
    (void)(status = launch.template operator()<typename cuda::device_type<kAct>::type>());
  });
  const cudaError_t freed = owned_workspace ? cudaFreeAsync(owned_workspace, stream) : cudaSuccess;
  GDN_RETURN_IF_ERROR(status);
  if (freed != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  std::string("prefill: cannot free its workspace: ") + cudaGetErrorString(freed));
  return cuda::launch_status("prefill");
}

}  // namespace gdn::prefill
