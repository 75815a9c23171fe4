// Binding of prefill (many tokens of many requests from their states, docs prefill.md §1).
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/kernels/cuda_api_prefill.hpp"
#include "gdn/prefill/cpu.hpp"
#include "gdn/prefill/params.hpp"

namespace gdn::python {

static void prefill(const FastConstArray& mixed_qkv, const FastConstArray& a,
                    const FastConstArray& b, const OptFastConstArray& A_log,
                    const OptFastConstArray& dt_bias, const FastWritableArray& state,
                    const FastConstArray& initial_state_indices,
                    const FastConstArray& final_state_indices, const FastConstArray& cu_seqlens,
                    const FastWritableArray& out, const OptFastConstArray& z,
                    const OptFastConstArray& norm_weight, std::optional<double> scale,
                    double l2_eps, double norm_eps, const std::string& gate,
                    const std::string& state_layout, int64_t first_valid_slot, int64_t num_k_heads,
                    bool a_is_log_decay, bool b_is_beta, bool qk_l2_norm,
                    const OptFastConstArray& checkpoint_indices, int64_t checkpoint_every,
                    const OptFastWritableArray& error_count, std::optional<uintptr_t> stream) {
  const prefill::Params p = binding::prefill_params<FastConstArray, FastWritableArray>(
      {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
       norm_eps, gate, state_layout, first_valid_slot, num_k_heads,
       binding::StepFlags{/*round_core_output=*/false, a_is_log_decay, b_is_beta, qk_l2_norm},
       error_count},
      initial_state_indices, final_state_indices, checkpoint_indices, checkpoint_every, array_view);
  run_call(
      p.state, "state", state, stream, [&] { return prefill::run_cpu(p); },
      // Generic, so that a build without CUDA kernels never instantiates (links) the call.
      [&](auto on) { return cuda_api::prefill(p, on); });
}

void bind_prefill(nb::module_& m) {
  m.def("prefill", &prefill, nb::arg("mixed_qkv").noconvert(), nb::arg("a").noconvert(),
        nb::arg("b").noconvert(), nb::arg("A_log").noconvert().none(),
        nb::arg("dt_bias").noconvert().none(), nb::arg("state").noconvert(),
        nb::arg("initial_state_indices").noconvert(), nb::arg("final_state_indices").noconvert(),
        nb::arg("cu_seqlens").noconvert(), nb::arg("out").noconvert(),
        nb::arg("z").noconvert().none() = nb::none(),
        nb::arg("norm_weight").noconvert().none() = nb::none(),
        nb::arg("scale").none() = nb::none(), nb::arg("l2_eps") = 1e-6, nb::arg("norm_eps") = 1e-6,
        nb::arg("gate") = "silu", nb::arg("state_layout") = "vk", nb::arg("first_valid_slot") = 0,
        nb::arg("num_k_heads") = 0, nb::arg("a_is_log_decay") = false, nb::arg("b_is_beta") = false,
        nb::arg("qk_l2_norm") = true, nb::arg("checkpoint_indices").noconvert().none() = nb::none(),
        nb::arg("checkpoint_every") = 0, nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("stream").none() = nb::none(),
        "GDN prefill: runs many tokens of many requests from the states in their initial slots, "
        "writes `out`, the final states and the checkpoints. `stream`: the CUDA stream handle; "
        "None launches on the current stream of `state`'s framework (torch, CuPy), else on the "
        "legacy default stream.");
}

}  // namespace gdn::python
