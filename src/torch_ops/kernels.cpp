// The C++ kernels of the per-layer torch ops torch.ops.gdn.decode_mtp, decode_mtp_replay, prefill,
// causal_conv1d_update and causal_conv1d_prefill, for the CPU and (against a torch built with
// CUDA) the CUDA dispatch key: an eager call goes from torch's dispatcher straight into the
// library instead of back into a Python kernel. The schemas are python/gdn/ops.py's; this library
// only implements them, and ops.py loads it (torch.ops.load_library) only into the torch version it
// was built against.
//
// A kernel builds the Params the nanobind binding builds (binding/op_params.hpp) and calls the
// same CPU run or CUDA launch, so a bad call raises the exception type and message the gdn
// function raises.
#include <ATen/DLConvertor.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string_view>

#include "binding/op_params.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/conv_prefill/cpu.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/kernels/cuda_api.hpp"
#include "gdn/kernels/cuda_api_conv.hpp"
#include "gdn/kernels/cuda_api_prefill.hpp"
#include "gdn/kernels/cuda_api_replay.hpp"
#include "gdn/prefill/cpu.hpp"
#include "gdn/replay/cpu.hpp"

// GDN_HAS_CUDA (this target links the CUDA kernels) is set only against a torch built with CUDA:
// a CPU torch has no c10_cuda to link and no CUDA tensors to run on.
#ifdef GDN_HAS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace gdn::torch_ops {
namespace {

using OptTensor = std::optional<at::Tensor>;

// A tensor as the library's view, described to binding::make_view in the DLPack terms the gdn
// function's import of the same tensor sees, so that its errors read the same.
TensorView view_of(const at::Tensor& t, const char* name) {
  const DLDataType dtype = at::getDLDataType(t);
  // Only CPU and CUDA tensors reach these kernels: 0 (no DLPack device) is refused, never met.
  const int32_t device = t.is_cuda()  ? binding::dlpack::kCUDA
                         : t.is_cpu() ? binding::dlpack::kCPU
                                      : 0;
  return binding::make_view(t.data_ptr(), {dtype.code, dtype.bits, dtype.lanes}, device,
                            t.is_cuda() ? int32_t(t.get_device()) : 0, t.dim(), t.sizes().data(),
                            t.strides().data(), name);
}

// Older torch versions pass `str` arguments as c10::string_view, a class of its own.
std::string_view text(c10::string_view s) { return {s.data(), s.size()}; }

// Runs a kernel's body with the library's errors raised as the c10 errors torch turns into the
// gdn function's Python exceptions: argument errors as ValueError, the rest as RuntimeError, with
// the same message (a std exception would reach Python as a RuntimeError).
template <class Body>
void raising_c10_errors(Body&& body) {
  try {
    body();
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, e.what());
  } catch (const std::runtime_error& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

// Runs a call (binding::run): `cpu()` for a host state, else `cuda(stream)` on torch's current
// stream of the state's device, the stream a torch op runs on (the library's CUDA entry points make
// that device current themselves, gdn::cuda::on_device). `cuda` is generic: a build without the
// CUDA kernels never instantiates it.
template <class Cpu, class Cuda>
void run_call(const TensorView& state_view, const char* state_name, const at::Tensor& state,
              Cpu&& cpu, Cuda&& cuda) {
#ifdef GDN_HAS_CUDA
  binding::run(state_view, state_name, cpu, [&] {
    return cuda(
        static_cast<void*>(c10::cuda::getCurrentCUDAStream(state.device().index()).stream()));
  });
#else
  (void)state;
  binding::run(state_view, state_name, cpu, cuda);  // refuses a CUDA state: never calls `cuda`
#endif
}

void decode_mtp(const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b,
                const OptTensor& A_log, const OptTensor& dt_bias, at::Tensor& state,
                const at::Tensor& state_indices, const at::Tensor& cu_seqlens, at::Tensor& out,
                const OptTensor& z, const OptTensor& norm_weight,
                const OptTensor& num_accepted_tokens, std::optional<double> scale, double l2_eps,
                double norm_eps, c10::string_view gate, c10::string_view state_layout,
                int64_t first_valid_slot, int64_t num_k_heads, bool round_core_output,
                bool a_is_log_decay, bool b_is_beta, bool qk_l2_norm,
                const OptTensor& error_count) {
  raising_c10_errors([&] {
    const decode_mtp::Params p = binding::decode_mtp_params<at::Tensor, at::Tensor>(
        {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
         norm_eps, text(gate), text(state_layout), first_valid_slot, num_k_heads,
         binding::StepFlags{round_core_output, a_is_log_decay, b_is_beta, qk_l2_norm}, error_count},
        state_indices, num_accepted_tokens, view_of);
    run_call(
        p.state, "state", state, [&] { return decode_mtp::run_cpu(p); },
        [&](auto stream) { return cuda_api::decode_mtp(p, stream); });
  });
}

void decode_mtp_replay(const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b,
                       const OptTensor& A_log, const OptTensor& dt_bias, at::Tensor& state,
                       const at::Tensor& state_indices, const at::Tensor& cu_seqlens,
                       at::Tensor& out, at::Tensor& window_k, at::Tensor& window_v,
                       at::Tensor& window_a, at::Tensor& window_b, at::Tensor& window_len,
                       const at::Tensor& num_accepted_tokens, const OptTensor& z,
                       const OptTensor& norm_weight, std::optional<double> scale, double l2_eps,
                       double norm_eps, c10::string_view gate, c10::string_view state_layout,
                       int64_t first_valid_slot, int64_t num_k_heads, bool round_core_output,
                       bool a_is_log_decay, bool b_is_beta, bool qk_l2_norm,
                       const OptTensor& error_count) {
  raising_c10_errors([&] {
    const replay::Params p = binding::replay_params<at::Tensor, at::Tensor>(
        {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
         norm_eps, text(gate), text(state_layout), first_valid_slot, num_k_heads,
         binding::StepFlags{round_core_output, a_is_log_decay, b_is_beta, qk_l2_norm}, error_count},
        {state_indices, window_k, window_v, window_a, window_b, window_len, num_accepted_tokens},
        view_of);
    run_call(
        p.state, "state", state, [&] { return replay::run_cpu(p); },
        [&](auto stream) { return cuda_api::replay(p, stream); });
  });
}

void prefill(const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b,
             const OptTensor& A_log, const OptTensor& dt_bias, at::Tensor& state,
             const at::Tensor& initial_state_indices, const at::Tensor& final_state_indices,
             const at::Tensor& cu_seqlens, at::Tensor& out, const OptTensor& z,
             const OptTensor& norm_weight, std::optional<double> scale, double l2_eps,
             double norm_eps, c10::string_view gate, c10::string_view state_layout,
             int64_t first_valid_slot, int64_t num_k_heads, bool a_is_log_decay, bool b_is_beta,
             bool qk_l2_norm, const OptTensor& checkpoint_indices, int64_t checkpoint_every,
             const OptTensor& error_count) {
  raising_c10_errors([&] {
    const prefill::Params p = binding::prefill_params<at::Tensor, at::Tensor>(
        {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
         norm_eps, text(gate), text(state_layout), first_valid_slot, num_k_heads,
         binding::StepFlags{/*round_core_output=*/false, a_is_log_decay, b_is_beta, qk_l2_norm},
         error_count},
        initial_state_indices, final_state_indices, checkpoint_indices, checkpoint_every, view_of);
    run_call(
        p.state, "state", state, [&] { return prefill::run_cpu(p); },
        [&](auto stream) {
          // The CUDA path's workspace, where the call's form needs one, comes from torch's
          // caching allocator (graph-safe, and no stream-ordered allocation per call).
          int64_t bytes = 0;
          GDN_RETURN_IF_ERROR(cuda_api::prefill_workspace_bytes(p, &bytes));
          if (bytes == 0) return cuda_api::prefill(p, stream);
          prefill::Params with_workspace = p;
          const at::Tensor workspace =
              at::empty({(bytes + 3) / 4}, state.options().dtype(at::kInt));
          with_workspace.workspace = view_of(workspace, "workspace");
          return cuda_api::prefill(with_workspace, stream);
        });
  });
}

void causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_state,
                          const at::Tensor& conv_state_indices, const at::Tensor& cu_seqlens,
                          at::Tensor& out, const OptTensor& num_accepted_tokens,
                          c10::string_view activation, c10::string_view state_layout,
                          int64_t first_valid_slot, const OptTensor& error_count) {
  raising_c10_errors([&] {
    const conv::Params p = binding::conv_params<at::Tensor>(
        {x, weight, conv_state, conv_state_indices, cu_seqlens, out, num_accepted_tokens,
         text(activation), text(state_layout), first_valid_slot, error_count},
        view_of);
    run_call(
        p.conv_state, "conv_state", conv_state, [&] { return conv::run_cpu(p); },
        [&](auto stream) { return cuda_api::causal_conv1d_update(p, stream); });
  });
}

void causal_conv1d_prefill(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_state,
                           const at::Tensor& initial_state_indices,
                           const at::Tensor& final_state_indices, const at::Tensor& cu_seqlens,
                           at::Tensor& out, c10::string_view activation,
                           c10::string_view state_layout, int64_t first_valid_slot,
                           const OptTensor& error_count) {
  raising_c10_errors([&] {
    const conv_prefill::Params p = binding::conv_prefill_params<at::Tensor>(
        {x, weight, conv_state, initial_state_indices, final_state_indices, cu_seqlens, out,
         text(activation), text(state_layout), first_valid_slot, error_count},
        view_of);
    run_call(
        p.conv_state, "conv_state", conv_state, [&] { return conv_prefill::run_cpu(p); },
        [&](auto stream) { return cuda_api::causal_conv1d_prefill(p, stream); });
  });
}

// One kernel per op serves both keys: it runs where the state lives (a CPU state with a CUDA
// input is refused by the library's device check, as the gdn function refuses it).
void implement(torch::Library& m) {
  m.impl("decode_mtp", TORCH_FN(decode_mtp));
  m.impl("decode_mtp_replay", TORCH_FN(decode_mtp_replay));
  m.impl("prefill", TORCH_FN(prefill));
  m.impl("causal_conv1d_update", TORCH_FN(causal_conv1d_update));
  m.impl("causal_conv1d_prefill", TORCH_FN(causal_conv1d_prefill));
}

}  // namespace
}  // namespace gdn::torch_ops

TORCH_LIBRARY_IMPL(gdn, CPU, m) { gdn::torch_ops::implement(m); }

// GDN_TORCH_HAS_CUDA: torch was built with CUDA (with or without this build's CUDA kernels; without
// them a CUDA call raises the gdn function's "no CUDA kernels" error).
#ifdef GDN_TORCH_HAS_CUDA
TORCH_LIBRARY_IMPL(gdn, CUDA, m) { gdn::torch_ops::implement(m); }
#endif
