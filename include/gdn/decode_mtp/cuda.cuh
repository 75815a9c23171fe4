// decode_mtp on CUDA (K = V = 128): the launcher. The kernel and its mapping are described in
// gdn/decode_mtp/cuda_kernel.cuh.
//
// The grid is one CTA per (request, value head, row block). The row split (CTAs per head) is a
// pure function of the shapes and the device: 1 once there are at least as many heads as SMs,
// else the smallest of 2, 4, 8 that gives every SM a CTA (small batches are latency-bound: more,
// smaller CTAs pull their bytes in parallel); 2 or 4 in the measured cases of choose_split. Callers
// may pin it (benchmarks do). This and every other choice of a launch (kernel form, chunk buffers,
// L2 hints, shared memory) are the rules of gdn/decode_mtp/cuda_launch_rules.hpp.
//
// The launcher allocates nothing and never synchronises. The attributes it sets (the kernel's
// dynamic shared memory ceiling, the device's opt-in maximum, and the largest carveout) are set
// once per kernel and device and are not stream operations, so launches are safe inside CUDA-graph
// capture. A launch whose last wave would leave SMs short asks for more shared memory than it uses,
// to spread the CTAs of each wave evenly; it then leaves less room for kernels of other streams on
// those SMs. On sm_90 images it launches with programmatic dependent launch (the kernel waits for
// earlier grids before its first read) and, for a split head, as a thread-block cluster.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gdn/core/cuda/device_info.cuh"
#include "gdn/core/dispatch.hpp"
#include "gdn/core/support.hpp"
#include "gdn/decode_mtp/cuda_kernel.cuh"
#include "gdn/decode_mtp/cuda_launch_rules.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/decode_mtp/step_kernel_args.cuh"

namespace gdn::decode_mtp {
namespace cuda_detail {

using gdn::cuda::allow_dynamic_shared;
using gdn::cuda::device_info;
using gdn::cuda::device_type;
using gdn::cuda::DeviceInfo;
using gdn::cuda::kernel_ptx_version;
using gdn::cuda::kMaxDevices;

template <class StateT>
inline size_t shared_bytes(int S, int split, int buffers, bool replay, bool closed_form,
                           int z_bytes = 4, bool tensor_cores = false) {
  return size_t(SmemPlan(S, kHeadDim / split, int(sizeof(StateT)), buffers, replay, closed_form,
                         z_bytes, tensor_cores)
                    .total);
}

// Launches `kernel` with the config's grid, block and shared memory on `stream`, as a cluster of
// `cluster` CTAs when > 1 and with programmatic dependent launch when `pdl`.
template <class Kernel, class Args>
inline Status launch_ex(Kernel kernel, dim3 grid, dim3 block, size_t smem, int cluster, bool pdl,
                        cudaStream_t stream, const Args& args, const char* what) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (cluster > 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = unsigned(cluster);
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (pdl) {  // may start before the previous launch ends; the kernel waits before any read
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  config.attrs = attr;
  config.numAttrs = num_attrs;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status(StatusCode::kCudaError,
                  std::string(what) + ": kernel launch failed: " + cudaGetErrorString(err));
  }
  return Status::ok();
}

// Whether replay's closed form on tensor cores can run on `device`: a 16-bit state and a kernel
// image for sm_80 or later (mma.sync with bf16 and fp16 inputs), which the default fat binary
// (sm_90a, sm_80) gives every device from sm_80 on.
template <class StateT, int kRatio, bool kReplay>
inline bool tensor_core_image(int device, const DeviceInfo& info) {
  if constexpr (kReplay && sizeof(StateT) == 2) {
    static std::atomic<int> ptx_cache[kMaxDevices];
    return info.major >= 8 &&
           kernel_ptx_version(
               replay_closed_form_kernel<StateT, kRatio, ClosedFormMath::kTensorCores,
                                         KernelImage::kRuntimeDtypes>,
               device, ptx_cache) >= 80;
  } else {
    return false;
  }
}

// The kernel of form `form` (a KernelForm valid for the mode and state dtype) in image kImage.
using KernelFunction = void (*)(KernelArgs);
template <class StateT, int kRatio, bool kReplay, KernelImage kImage>
inline KernelFunction form_kernel(int form) {
  if constexpr (!kReplay) {
    if constexpr (sizeof(StateT) == 2)
      if (form == kSingleTokenForm)
        return write_all_kernel<StateT, kRatio, WriteAllForm::kSingleToken, kImage>;
    return write_all_kernel<StateT, kRatio, WriteAllForm::kStandard, kImage>;
  } else {
    if (form == kClosedFormRows)
      return replay_closed_form_kernel<StateT, kRatio, ClosedFormMath::kCudaCores, kImage>;
    if (form == kFourRowsForm)
      return replay_tokens_kernel<StateT, kRatio, ReplayTokensForm::kFourRows, kImage>;
    if constexpr (sizeof(StateT) == 2) {
      if (form == kStageFirstForm)
        return replay_tokens_kernel<StateT, kRatio, ReplayTokensForm::kTokensFirst, kImage>;
      if (form == kTensorCoreForm)
        return replay_closed_form_kernel<StateT, kRatio, ClosedFormMath::kTensorCores, kImage>;
      if (form == kTensorCoreEightForm)
        return replay_closed_form_kernel<StateT, kRatio, ClosedFormMath::kTensorCoresEightCtas,
                                         kImage>;
    }
    return replay_tokens_kernel<StateT, kRatio, ReplayTokensForm::kStandard, kImage>;
  }
}

// Replay with bf16 activations (mixed_qkv and so the window's k and v, a, b, out, and z if given:
// the serving case) takes the kernel images that know those dtypes at compile time
// (kBf16Activations), for every head ratio of HeadRatios. Other dtypes, and the run-time ratio,
// take the images that read them from KernelArgs. Replay is bound by its instructions, and these
// images carry no per-element dtype branches (figures: docs/cuda-kernels.md, kernel images). A
// build may leave them out (GDN_NO_BF16_ACTIVATION_IMAGES: CMake's GDN_BF16_ACTIVATION_IMAGES=OFF).
#ifdef GDN_NO_BF16_ACTIVATION_IMAGES
inline constexpr bool kBf16ActivationImages = false;
#else
inline constexpr bool kBf16ActivationImages = true;
#endif
template <int kRatio, bool kReplay>
inline constexpr bool kHasBf16ActivationImages =
    kBf16ActivationImages && kReplay && kRatio != kRuntimeValue;
template <int kRatio, bool kReplay>
inline bool use_bf16_activations(const KernelArgs& args) {
  constexpr DType bf16 = DType::kBFloat16;
  return kHasBf16ActivationImages<kRatio, kReplay> && args.qkv_dtype == bf16 &&
         args.a_dtype == bf16 && args.b_dtype == bf16 && args.out_dtype == bf16 &&
         (args.z == nullptr || args.z_dtype == bf16);
}

template <DType kState, int kRatio, bool kReplay>
inline Status launch_kernel(const KernelArgs& args_in, int device, int split_request,
                            cudaStream_t stream) {
  using StateT = typename device_type<kState>::type;
  KernelArgs args = args_in;
  DeviceInfo info;
  GDN_RETURN_IF_ERROR(device_info(device, &info));
  const int64_t heads = args.N * args.HV;
  // CTAs of `bytes` of dynamic shared memory that an SM holds.
  const auto resident = [&](size_t bytes) {
    return shared_memory_resident(bytes, size_t(info.shared_per_sm), size_t(info.reserved_per_cta));
  };
  int form = choose_form(kReplay, int(sizeof(StateT)), args.S, heads, info.sm_count,
                         tensor_core_image<StateT, kRatio, kReplay>(device, info),
                         resident(shared_bytes<StateT>(1, 1, kSingleTokenBuffers, false, false)) >=
                             kSingleTokenCtasPerSm);
  const bool closed_form = is_closed_form(form), tensor_cores = is_tensor_core_form(form);
  const bool single_token = form == kSingleTokenForm;
  const bool bf16_activations = use_bf16_activations<kRatio, kReplay>(args);
  // An aligned "kv" pool comes with the run-time ratio (launch_state_dtype).
  const bool kv_image = kRatio == kRuntimeValue && args.kv_vector;
  // The images are exclusive: bf16 activations have them at compile-time ratios only.
  const KernelImage image_kind = bf16_activations ? KernelImage::kBf16Activations
                                 : kv_image       ? KernelImage::kAlignedKv
                                                  : KernelImage::kRuntimeDtypes;
  const auto image = [&](int f) {
    if constexpr (kHasBf16ActivationImages<kRatio, kReplay>)
      if (bf16_activations)
        return form_kernel<StateT, kRatio, kReplay, KernelImage::kBf16Activations>(f);
    if constexpr (kRatio == kRuntimeValue)
      if (kv_image) return form_kernel<StateT, kRatio, kReplay, KernelImage::kAlignedKv>(f);
    return form_kernel<StateT, kRatio, kReplay, KernelImage::kRuntimeDtypes>(f);
  };
  auto kernel = image(form);
  static std::atomic<int> ptx_cache[kMaxDevices];
  // Per kernel form and image (activations: run-time dtypes, bf16; an aligned "kv" pool).
  static std::atomic<int> smem_cache[3][kKernelForms][kMaxDevices];
  // sm_90 image: clusters, bulk copies and programmatic dependent launch.
  const bool hopper = info.major >= 9 && kernel_ptx_version(kernel, device, ptx_cache) >= 90;
  const int split = split_request > 0 ? split_request
                                      : choose_split(heads, info.sm_count, hopper, args.S, kReplay,
                                                     closed_form, int(sizeof(StateT)));
  if (split != 1 && split != 2 && split != 4 && split != 8)
    return Status::invalid("decode_mtp: split must be 1, 2, 4 or 8, got " + std::to_string(split));
  if (split > 1 && !hopper)
    return Status::unsupported(
        "decode_mtp: splitting a head over CTAs needs thread-block "
        "clusters (sm_90 and a kernel image built for it)");
  if (heads * split > int64_t(INT_MAX))
    return Status::unsupported("decode_mtp: too many (request, value head) pairs for one launch");
  args.split = split;
  args.bulk_load = hopper && args.state_vector;
  args.buffers = single_token ? kSingleTokenBuffers
                              : choose_buffers(int(sizeof(StateT)), heads, info.sm_count, kReplay,
                                               closed_form, args.bulk_load);
  args.evict_hints = use_evict_hints(int(sizeof(StateT)), closed_form, heads, info.sm_count);

  const size_t needed = shared_bytes<StateT>(args.S, split, args.buffers, kReplay, closed_form,
                                             staged_z_bytes(closed_form, args), tensor_cores);
  const bool tensor_core_eight =
      tensor_cores && split == 1 &&  // (a benchmark may pin another split)
      use_tensor_core_eight(args.S, heads, info.sm_count,
                            resident(needed) >= kTensorCoreEightCtasPerSm);
  if (tensor_core_eight) {
    form = kTensorCoreEightForm;
    kernel = image(form);
  }
  // A launch asks for the shared memory that spreads the CTAs of each of its waves evenly over the
  // SMs (launch_shared_bytes). That arithmetic assumes the largest carveout, and the kernel may
  // ask for up to all of an SM's shared memory.
  const size_t smem =
      launch_shared_bytes(needed, heads, split, form_ctas_per_sm(single_token, tensor_core_eight),
                          info.sm_count, size_t(info.shared_per_sm), size_t(info.reserved_per_cta));
  GDN_RETURN_IF_ERROR(
      allow_dynamic_shared(kernel, device, info.shared_per_cta, smem_cache[int(image_kind)][form]));
  return launch_ex(kernel, dim3(unsigned(heads * split)), dim3(unsigned(kThreads)), smem, split,
                   hopper, stream, args, kReplay ? "replay" : "decode_mtp");
}

// All head ratios of one state dtype (HeadRatios, plus the run-time-ratio kernel), decode_mtp
// (kReplay = false) or replay verify. The compiled library instantiates this once per state dtype
// and mode, each in its own translation unit.
template <DType kState, bool kReplay>
Status launch_state_dtype(const KernelArgs& args, int device, int split, cudaStream_t stream) {
  Status status;
  // The images for an aligned "kv" pool exist for the run-time ratio only (a slower path already).
  const int ratio = args.ratio <= 8 && !args.kv_vector ? args.ratio : kRuntimeValue;
  dispatch_or_runtime<HeadRatios>(ratio, [&]<int kRatio>() {
    (void)(status = launch_kernel<kState, kRatio, kReplay>(args, device, split, stream));
  });
  return status;
}

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace cuda_detail

// The compiled library (gdn_kernels, which defines GDN_HAS_CUDA) holds one explicit instantiation
// per state dtype in src/cuda/decode_mtp_<dtype>.cu and src/cuda/replay_<dtype>.cu; code that
// includes this header on its own instantiates what it uses.
#if defined(GDN_HAS_CUDA)
static_assert(
    StateDTypes::size == 3 && StateDTypes::contains(DType::kFloat32) &&
        StateDTypes::contains(DType::kBFloat16) && StateDTypes::contains(DType::kFloat16),
    "one compiled translation unit per state dtype: update src/cuda/decode_mtp_*.cu, replay_*.cu");
namespace cuda_detail {
#define GDN_DECODE_MTP_EXTERN(kState)                                                   \
  extern template Status launch_state_dtype<kState, false>(const KernelArgs&, int, int, \
                                                           cudaStream_t);               \
  extern template Status launch_state_dtype<kState, true>(const KernelArgs&, int, int,  \
                                                          cudaStream_t);
GDN_DECODE_MTP_EXTERN(DType::kFloat32)
GDN_DECODE_MTP_EXTERN(DType::kBFloat16)
GDN_DECODE_MTP_EXTERN(DType::kFloat16)
#undef GDN_DECODE_MTP_EXTERN
}  // namespace cuda_detail
#endif

namespace cuda_detail {

// The host checks a CUDA launch of a step operation adds to check_arguments: the device, the null
// slot rule and the guard. `what` names the operation in errors.
inline Status check_cuda_step(const StepArgs& p, const Problem& pr, const char* what) {
  if (pr.device.type != DeviceType::kCUDA)
    return Status::invalid(std::string(what) + " CUDA launcher was given arrays on " +
                           to_string(pr.device));
  if (p.first_valid_slot < 0)
    return Status::invalid("first_valid_slot = " + std::to_string(p.first_valid_slot) +
                           " must be >= 0 (slot ids below it are null)");
  const Support support =
      can_use(DeviceType::kCUDA, pr.H, pr.HV, pr.K, pr.V, pr.S, p.state.dtype, true, p.layout);
  if (support.path == Path::kUnsupported)
    return Status::unsupported(std::string(what) + ": " + support.reason);
  if (pr.HV > 65535 || pr.H > 65535)
    return Status::unsupported(std::string(what) + ": more than 65535 heads");
  return Status::ok();
}

// The kernel arguments every step operation shares (StepArgs, checked into `pr`); the caller adds
// its slot table, accepted counts and (replay) window.
inline KernelArgs step_kernel_args(const StepArgs& p, const Problem& pr) {
  KernelArgs args{};
  fill_step_kernel_args(p, pr, args);
  args.S = int(pr.S);
  args.H = int(pr.H);
  args.HV = int(pr.HV);
  args.ratio = int(pr.ratio);
  args.qkv_dtype = p.mixed_qkv.dtype;
  args.z_dtype = p.z.present() ? p.z.dtype : DType::kFloat32;
  args.norm_dtype = p.norm_weight.present() ? p.norm_weight.dtype : DType::kFloat32;
  args.state_kv = p.layout == StateLayout::kKV;
  const size_t state_bytes = size_t(dtype_size(p.state.dtype));
  const size_t state_chunk = 16;  // bulk copies and vector row accesses
  const bool slots_aligned = aligned(p.state.data, state_chunk) &&
                             (size_t(p.state.strides[0]) * state_bytes) % state_chunk == 0;
  args.state_vector = !args.state_kv && slots_aligned;
  args.kv_vector = args.state_kv && slots_aligned;
  const size_t qkv_chunk = 4 * size_t(dtype_size(p.mixed_qkv.dtype));
  args.qkv_vector =
      aligned(p.mixed_qkv.data, qkv_chunk) &&
      (size_t(p.mixed_qkv.strides[0]) * size_t(dtype_size(p.mixed_qkv.dtype))) % qkv_chunk == 0;
  args.gate_sigmoid = p.gate == GateActivation::kSigmoid;
  return args;
}

// Launches the decode_mtp (kReplay = false) or replay kernel for the state dtype on `stream`, on
// the current device.
template <bool kReplay>
inline Status launch_step(const KernelArgs& args, DType state_dtype, int split, cudaStream_t stream,
                          const char* what) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(err));
  }
  Status status = Status::unsupported(std::string(what) + ": state dtype " +
                                      std::string(to_string(state_dtype)) + " not compiled in");
  StateDTypes::dispatch(state_dtype, [&]<DType kState>() {
    (void)(status = launch_state_dtype<kState, kReplay>(args, device, split, stream));
  });
  return status;
}

}  // namespace cuda_detail

// Validates on the host (reads no device memory), applies the guard and launches on `stream`,
// on the current device (which must hold the arrays). `split` = CTAs per value head (1, 2, 4, 8;
// 0 = chosen from the problem size and the device). Never synchronises; safe in graph capture.
inline Status launch_cuda(const Params& p, cudaStream_t stream, int split = 0) {
  Problem pr;
  GDN_RETURN_IF_ERROR(check_arguments(p, &pr));
  GDN_RETURN_IF_ERROR(cuda_detail::check_cuda_step(p, pr, "decode_mtp"));
  if (pr.N == 0) return Status::ok();
  cuda_detail::KernelArgs args = cuda_detail::step_kernel_args(p, pr);
  args.state_indices = p.state_indices.data;
  args.index_dtype = p.state_indices.dtype;
  args.num_accepted_tokens = p.num_accepted_tokens.data_or_null();
  args.acc_dtype = p.num_accepted_tokens.present() ? p.num_accepted_tokens.dtype : DType::kInt32;
  return cuda_detail::launch_step<false>(args, p.state.dtype, split, stream, "decode_mtp");
}

}  // namespace gdn::decode_mtp
