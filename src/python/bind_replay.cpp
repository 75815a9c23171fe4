// Binding of replay verify (decode_mtp_replay) and its guard.
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/kernels/cuda_api_replay.hpp"
#include "gdn/replay/cpu.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::python {

static void decode_mtp_replay(
    const FastConstArray& mixed_qkv, const FastConstArray& a, const FastConstArray& b,
    const OptFastConstArray& A_log, const OptFastConstArray& dt_bias,
    const FastWritableArray& state, const FastConstArray& state_indices,
    const FastConstArray& cu_seqlens, const FastWritableArray& out,
    const FastWritableArray& window_k, const FastWritableArray& window_v,
    const FastWritableArray& window_a, const FastWritableArray& window_b,
    const FastWritableArray& window_len, const FastConstArray& num_accepted_tokens,
    const OptFastConstArray& z, const OptFastConstArray& norm_weight, std::optional<double> scale,
    double l2_eps, double norm_eps, const std::string& gate, const std::string& state_layout,
    int64_t first_valid_slot, int64_t num_k_heads, bool round_core_output, bool a_is_log_decay,
    bool b_is_beta, bool qk_l2_norm, const OptFastWritableArray& error_count,
    std::optional<uintptr_t> stream, int split) {
  const replay::Params p = binding::replay_params<FastConstArray, FastWritableArray>(
      {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
       norm_eps, gate, state_layout, first_valid_slot, num_k_heads,
       binding::StepFlags{round_core_output, a_is_log_decay, b_is_beta, qk_l2_norm}, error_count},
      {state_indices, window_k, window_v, window_a, window_b, window_len, num_accepted_tokens},
      array_view);
  run_call(
      p.state, "state", state, stream, [&] { return replay::run_cpu(p); },
      // Generic, so that a build without CUDA kernels never instantiates (links) the call.
      [&](auto on) { return cuda_api::replay(p, on, split); });
}

void bind_replay(nb::module_& m) {
  def_verify_step(
      m, "decode_mtp_replay", &decode_mtp_replay,
      "Replay verify: advances each request's checkpoint by its accepted window tokens, runs the "
      "new tokens into `out` and saves them as the new window. `split` pins the CUDA kernel's "
      "CTAs per value head (1, 2, 4, 8; 0 = automatic), for benchmarks.",
      nb::arg("mixed_qkv").noconvert(), nb::arg("a").noconvert(), nb::arg("b").noconvert(),
      nb::arg("A_log").noconvert().none(), nb::arg("dt_bias").noconvert().none(),
      nb::arg("state").noconvert(), nb::arg("state_indices").noconvert(),
      nb::arg("cu_seqlens").noconvert(), nb::arg("out").noconvert(),
      nb::arg("window_k").noconvert(), nb::arg("window_v").noconvert(),
      nb::arg("window_a").noconvert(), nb::arg("window_b").noconvert(),
      nb::arg("window_len").noconvert(), nb::arg("num_accepted_tokens").noconvert(),
      nb::arg("z").noconvert().none() = nb::none(),
      nb::arg("norm_weight").noconvert().none() = nb::none());
}

}  // namespace gdn::python
