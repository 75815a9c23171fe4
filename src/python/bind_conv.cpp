// Binding of causal_conv1d_update (conv state update for decode and speculative verify).
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/conv/params.hpp"
#ifdef GDN_HAS_CUDA
#include "gdn/kernels/cuda_api_conv.hpp"
#endif

namespace gdn::python {

static conv::StateLayout parse_conv_layout(const std::string& s) {
  if (s == "channels_major") return conv::StateLayout::kChannelsMajor;
  if (s == "tokens_major") return conv::StateLayout::kTokensMajor;
  throw nb::value_error(("state_layout must be 'channels_major' ([slots, D, Lbuf]) or "
                         "'tokens_major' ([slots, Lbuf, D]), got '" +
                         s + "'")
                            .c_str());
}

static conv::Activation parse_activation(const std::string& s) {
  if (s == "silu" || s == "swish") return conv::Activation::kSiLU;
  if (s == "none") return conv::Activation::kNone;
  throw nb::value_error(("activation must be 'silu' or 'none', got '" + s + "'").c_str());
}

static void causal_conv1d_update(const FastWritableArray& x, const FastWritableArray& weight,
                                 const FastWritableArray& conv_state,
                                 const FastWritableArray& conv_state_indices,
                                 const FastWritableArray& cu_seqlens, const FastWritableArray& out,
                                 const OptFastWritableArray& num_accepted_tokens,
                                 const std::string& activation, const std::string& state_layout,
                                 int64_t first_valid_slot, const OptFastWritableArray& error_count,
                                 std::optional<uintptr_t> stream) {
  conv::Params p;
  p.x = to_view(x, "x");
  p.weight = to_view(weight, "weight");
  p.conv_state = to_view(conv_state, "conv_state");
  p.conv_state_indices = to_view(conv_state_indices, "conv_state_indices");
  p.cu_seqlens = to_view(cu_seqlens, "cu_seqlens");
  p.out = to_view(out, "out");
  p.num_accepted_tokens = to_view(num_accepted_tokens, "num_accepted_tokens");
  p.error_count = to_view(error_count, "error_count");
  p.activation = parse_activation(activation);
  p.layout = parse_conv_layout(state_layout);
  p.first_valid_slot = first_valid_slot;

  Status status;
  if (p.conv_state.device.type == DeviceType::kCPU) {
    nb::gil_scoped_release release;
    status = conv::run_cpu(p);
  } else {
#ifdef GDN_HAS_CUDA
    void* launch_on = launch_stream(stream, conv_state);
    nb::gil_scoped_release release;
    status = cuda_api::causal_conv1d_update(p, launch_on);
#else
    (void)stream;
    status =
        Status::unsupported("conv_state is a CUDA array but this build of gdn has no CUDA kernels");
#endif
  }
  throw_if_error(status);
}

void bind_conv(nb::module_& m) {
  m.def("causal_conv1d_update", &causal_conv1d_update, nb::arg("x").noconvert(),
        nb::arg("weight").noconvert(), nb::arg("conv_state").noconvert(),
        nb::arg("conv_state_indices").noconvert(), nb::arg("cu_seqlens").noconvert(),
        nb::arg("out").noconvert(), nb::arg("num_accepted_tokens").noconvert().none() = nb::none(),
        nb::arg("activation") = "silu", nb::arg("state_layout") = "channels_major",
        nb::arg("first_valid_slot") = 0, nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("stream").none() = nb::none(),
        "Depthwise causal conv1d over each request's tokens with speculative rollback of the conv "
        "state: updates `conv_state` in place and writes `out` (which may be `x`). `stream`: the "
        "CUDA stream handle; None launches on the current stream of `conv_state`'s framework "
        "(torch, CuPy), else on the legacy default stream.");
}

}  // namespace gdn::python
