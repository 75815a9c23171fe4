// The arguments decode_mtp and replay verify share (decode_mtp::StepArgs), converted once for
// both bindings, and the CPU-or-CUDA dispatch of a step call.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::python {

struct StepArgsIn {
  const FastConstArray &mixed_qkv, &a, &b, &A_log, &dt_bias;
  const FastWritableArray& state;
  const FastConstArray& cu_seqlens;
  const FastWritableArray& out;
  const OptFastConstArray &z, &norm_weight;
  std::optional<double> scale;
  double l2_eps, norm_eps;
  const std::string &gate, &state_layout;
  int64_t first_valid_slot, num_k_heads;
  bool round_core_output;
  const OptFastWritableArray& error_count;
};

inline void set_step_args(const StepArgsIn& in, decode_mtp::StepArgs& p) {
  p.mixed_qkv = to_view(in.mixed_qkv, "mixed_qkv");
  p.a = to_view(in.a, "a");
  p.b = to_view(in.b, "b");
  p.A_log = to_view(in.A_log, "A_log");
  p.dt_bias = to_view(in.dt_bias, "dt_bias");
  p.state = to_view(in.state, "state");
  p.cu_seqlens = to_view(in.cu_seqlens, "cu_seqlens");
  p.out = to_view(in.out, "out");
  p.z = to_view(in.z, "z");
  p.norm_weight = to_view(in.norm_weight, "norm_weight");
  p.error_count = to_view(in.error_count, "error_count");
  p.scale = in.scale ? float(*in.scale) : NAN;
  p.l2_eps = float(in.l2_eps);
  p.norm_eps = float(in.norm_eps);
  p.gate = parse_gate(in.gate);
  p.layout = parse_layout(in.state_layout);
  p.first_valid_slot = in.first_valid_slot;
  p.num_k_heads = in.num_k_heads;
  p.round_core_output = in.round_core_output;
}

// Runs `cpu()` for host arrays, else `cuda(stream)` on the given stream or the current stream of
// `state`'s framework, without the GIL; raises on a failed Status. `cuda` is called (and, when
// generic, instantiated) only in builds with CUDA kernels.
template <class Cpu, class Cuda>
void run_step(const decode_mtp::StepArgs& p, const FastWritableArray& state,
              std::optional<uintptr_t> stream, Cpu&& cpu, Cuda&& cuda) {
  Status status;
  if (p.state.device.type == DeviceType::kCPU) {
    nb::gil_scoped_release release;
    status = cpu();
  } else {
#ifdef GDN_HAS_CUDA
    void* launch_on = launch_stream(stream, state);
    nb::gil_scoped_release release;
    status = cuda(launch_on);
#else
    (void)stream;
    (void)state;
    (void)cuda;
    status = Status::unsupported("state is a CUDA array but this build of gdn has no CUDA kernels");
#endif
  }
  throw_if_error(status);
}

}  // namespace gdn::python
