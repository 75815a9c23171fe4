// Binding of replay verify (decode_mtp_replay) and its guard.
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/kernels/cuda_api_replay.hpp"
#include "gdn/replay/cpu.hpp"
#include "gdn/replay/params.hpp"

namespace gdn::python {

static void decode_mtp_replay(const ConstArray& mixed_qkv, const ConstArray& a, const ConstArray& b,
                              const ConstArray& A_log, const ConstArray& dt_bias,
                              const Array& state, const ConstArray& state_indices,
                              const ConstArray& cu_seqlens, const Array& out, const Array& window_k,
                              const Array& window_v, const Array& window_a, const Array& window_b,
                              const Array& window_len, const ConstArray& num_accepted_tokens,
                              const OptConstArray& z, const OptConstArray& norm_weight,
                              std::optional<double> scale, double l2_eps, double norm_eps,
                              const std::string& gate, const std::string& state_layout,
                              int64_t first_valid_slot, int64_t num_k_heads, bool round_core_output,
                              const OptArray& error_count, std::optional<uintptr_t> stream,
                              int split) {
  replay::Params p;
  p.mixed_qkv = to_view(mixed_qkv, "mixed_qkv");
  p.a = to_view(a, "a");
  p.b = to_view(b, "b");
  p.A_log = to_view(A_log, "A_log");
  p.dt_bias = to_view(dt_bias, "dt_bias");
  p.state = to_view(state, "state");
  p.state_indices = to_view(state_indices, "state_indices");
  p.cu_seqlens = to_view(cu_seqlens, "cu_seqlens");
  p.out = to_view(out, "out");
  p.window_k = to_view(window_k, "window_k");
  p.window_v = to_view(window_v, "window_v");
  p.window_a = to_view(window_a, "window_a");
  p.window_b = to_view(window_b, "window_b");
  p.window_len = to_view(window_len, "window_len");
  p.num_accepted_tokens = to_view(num_accepted_tokens, "num_accepted_tokens");
  p.z = to_view(z, "z");
  p.norm_weight = to_view(norm_weight, "norm_weight");
  p.error_count = to_view(error_count, "error_count");
  p.scale = scale ? float(*scale) : NAN;
  p.l2_eps = float(l2_eps);
  p.norm_eps = float(norm_eps);
  p.gate = parse_gate(gate);
  p.layout = parse_layout(state_layout);
  p.first_valid_slot = first_valid_slot;
  p.num_k_heads = num_k_heads;
  p.round_core_output = round_core_output;

  Status status;
  if (p.state.device.type == DeviceType::kCPU) {
    nb::gil_scoped_release release;
    status = replay::run_cpu(p);
  } else {
#ifdef GDN_HAS_CUDA
    nb::gil_scoped_release release;
    status = cuda_api::replay(p, reinterpret_cast<void*>(stream.value_or(0)), split);
#else
    (void)stream;
    (void)split;
    status = Status::unsupported("state is a CUDA array but this build of gdn has no CUDA kernels");
#endif
  }
  throw_if_error(status);
}

void bind_replay(nb::module_& m) {
  m.def(
      "decode_mtp_replay", &decode_mtp_replay, nb::arg("mixed_qkv").noconvert(),
      nb::arg("a").noconvert(), nb::arg("b").noconvert(), nb::arg("A_log").noconvert(),
      nb::arg("dt_bias").noconvert(), nb::arg("state").noconvert(),
      nb::arg("state_indices").noconvert(), nb::arg("cu_seqlens").noconvert(),
      nb::arg("out").noconvert(), nb::arg("window_k").noconvert(), nb::arg("window_v").noconvert(),
      nb::arg("window_a").noconvert(), nb::arg("window_b").noconvert(),
      nb::arg("window_len").noconvert(), nb::arg("num_accepted_tokens").noconvert(), nb::kw_only(),
      nb::arg("z").noconvert().none() = nb::none(),
      nb::arg("norm_weight").noconvert().none() = nb::none(), nb::arg("scale").none() = nb::none(),
      nb::arg("l2_eps") = 1e-6, nb::arg("norm_eps") = 1e-6, nb::arg("gate") = "silu",
      nb::arg("state_layout") = "vk", nb::arg("first_valid_slot") = 0, nb::arg("num_k_heads") = 0,
      nb::arg("round_core_output") = false, nb::arg("error_count").noconvert().none() = nb::none(),
      nb::arg("stream").none() = nb::none(), nb::arg("split") = 0,
      "Replay verify: advances each request's checkpoint by its accepted window tokens, runs the "
      "new tokens into `out` and saves them as the new window. `split` pins the CUDA kernel's "
      "CTAs per value head (1, 2, 4, 8; 0 = automatic), for benchmarks.");
}

}  // namespace gdn::python
