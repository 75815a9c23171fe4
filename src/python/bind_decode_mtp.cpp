// Binding of decode_mtp and its guard.
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/kernels/cuda_api.hpp"

namespace gdn::python {

static void decode_mtp(const FastConstArray& mixed_qkv, const FastConstArray& a,
                       const FastConstArray& b, const OptFastConstArray& A_log,
                       const OptFastConstArray& dt_bias, const FastWritableArray& state,
                       const FastConstArray& state_indices, const FastConstArray& cu_seqlens,
                       const FastWritableArray& out, const OptFastConstArray& z,
                       const OptFastConstArray& norm_weight,
                       const OptFastConstArray& num_accepted_tokens, std::optional<double> scale,
                       double l2_eps, double norm_eps, const std::string& gate,
                       const std::string& state_layout, int64_t first_valid_slot,
                       int64_t num_k_heads, bool round_core_output, bool a_is_log_decay,
                       bool b_is_beta, bool qk_l2_norm, const OptFastWritableArray& error_count,
                       std::optional<uintptr_t> stream, int split) {
  const decode_mtp::Params p = binding::decode_mtp_params<FastConstArray, FastWritableArray>(
      {mixed_qkv, a, b, A_log, dt_bias, state, cu_seqlens, out, z, norm_weight, scale, l2_eps,
       norm_eps, gate, state_layout, first_valid_slot, num_k_heads,
       binding::StepFlags{round_core_output, a_is_log_decay, b_is_beta, qk_l2_norm}, error_count},
      state_indices, num_accepted_tokens, array_view);
  run_call(
      p.state, "state", state, stream, [&] { return decode_mtp::run_cpu(p); },
      // Generic, so that a build without CUDA kernels never instantiates (links) the call.
      [&](auto on) { return cuda_api::decode_mtp(p, on, split); });
}

// `cuda_available` / `cuda_reason` answer for a named architecture instead of probing a device
// (the Python wrapper decides them from the compiled architecture list).
static nb::tuple can_use_decode_mtp(const std::string& device, int64_t H, int64_t HV, int64_t K,
                                    int64_t V, int64_t S, const std::string& state_dtype,
                                    int device_index, const std::string& state_layout,
                                    std::optional<bool> cuda_available,
                                    const std::string& cuda_reason) {
  DType sd;
  if (state_dtype == "float32")
    sd = DType::kFloat32;
  else if (state_dtype == "bfloat16")
    sd = DType::kBFloat16;
  else if (state_dtype == "float16")
    sd = DType::kFloat16;
  else
    throw nb::value_error(
        ("state_dtype must be float32, bfloat16 or float16, got '" + state_dtype + "'").c_str());
  DeviceType dev;
  if (device == "cpu")
    dev = DeviceType::kCPU;
  else if (device == "cuda")
    dev = DeviceType::kCUDA;
  else
    throw nb::value_error(("device must be 'cpu' or 'cuda', got '" + device + "'").c_str());
  const StateLayout layout = parse_layout(state_layout);
  bool cuda_ok = false;
  std::string why = cuda_reason;
  if (dev == DeviceType::kCUDA && cuda_available) {
    cuda_ok = *cuda_available;
  } else if (dev == DeviceType::kCUDA) {
#ifdef GDN_HAS_CUDA
    cuda_ok = cuda_api::kernels_available(device_index, &why);
#else
    why = "this build of gdn has no CUDA kernels";
#endif
  }
  (void)device_index;
  decode_mtp::Support s = decode_mtp::can_use(dev, H, HV, K, V, S, sd, cuda_ok, layout);
  if (dev == DeviceType::kCUDA && !cuda_ok) {
    // The configuration's own verdict first (it holds on any GPU), then why no kernel runs here.
    const decode_mtp::Support anywhere = decode_mtp::can_use(dev, H, HV, K, V, S, sd, true, layout);
    if (anywhere.path != decode_mtp::Path::kUnsupported) {
      s.reason = (why.empty() ? s.reason : why) +
                 "; on a supported GPU this configuration "
                 "would take the " +
                 decode_mtp::to_string(anywhere.path) + " path (" + anywhere.reason + ")";
    } else {
      s.reason = anywhere.reason;
    }
  }
  return nb::make_tuple(std::string(decode_mtp::to_string(s.path)), s.reason);
}

void bind_decode_mtp(nb::module_& m) {
  def_verify_step(
      m, "decode_mtp", &decode_mtp,
      "Fused GDN decode / MTP verify: updates `state` in place and writes `out`. `stream`: the "
      "CUDA stream handle; None launches on the current stream of `state`'s framework (torch, "
      "CuPy), else on the legacy default stream. `split` pins the CUDA kernel's CTAs per value "
      "head (1, 2, 4, 8; 0 = automatic), for benchmarks.",
      nb::arg("mixed_qkv").noconvert(), nb::arg("a").noconvert(), nb::arg("b").noconvert(),
      nb::arg("A_log").noconvert().none(), nb::arg("dt_bias").noconvert().none(),
      nb::arg("state").noconvert(), nb::arg("state_indices").noconvert(),
      nb::arg("cu_seqlens").noconvert(), nb::arg("out").noconvert(),
      nb::arg("z").noconvert().none() = nb::none(),
      nb::arg("norm_weight").noconvert().none() = nb::none(),
      nb::arg("num_accepted_tokens").noconvert().none() = nb::none());
  m.def("can_use_decode_mtp", &can_use_decode_mtp, nb::arg("device"), nb::arg("H"), nb::arg("HV"),
        nb::arg("K") = 128, nb::arg("V") = 128, nb::arg("S") = 1,
        nb::arg("state_dtype") = "float32", nb::arg("device_index") = 0,
        nb::arg("state_layout") = "vk", nb::arg("cuda_available").none() = nb::none(),
        nb::arg("cuda_reason") = "",
        "(path, reason): path is 'fast', 'generic' or 'unsupported'. `cuda_available` (with "
        "`cuda_reason`) replaces the device probe, to answer for a named architecture.");
}

}  // namespace gdn::python
