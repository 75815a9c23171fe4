// Bindings of causal_conv1d_update (conv state update for decode and speculative verify) and
// causal_conv1d_prefill (the conv over whole requests, from their initial slots to their final
// ones).
#include <cstdint>
#include <optional>
#include <string>

#include "common.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/conv/params.hpp"
#include "gdn/conv_prefill/cpu.hpp"
#include "gdn/kernels/cuda_api_conv.hpp"

namespace gdn::python {

static void causal_conv1d_update(const FastWritableArray& x, const FastWritableArray& weight,
                                 const FastWritableArray& conv_state,
                                 const FastWritableArray& conv_state_indices,
                                 const FastWritableArray& cu_seqlens, const FastWritableArray& out,
                                 const OptFastWritableArray& num_accepted_tokens,
                                 const std::string& activation, const std::string& state_layout,
                                 int64_t first_valid_slot, const OptFastWritableArray& error_count,
                                 std::optional<uintptr_t> stream) {
  const conv::Params p = binding::conv_params<FastWritableArray>(
      {x, weight, conv_state, conv_state_indices, cu_seqlens, out, num_accepted_tokens, activation,
       state_layout, first_valid_slot, error_count},
      array_view);
  run_call(
      p.conv_state, "conv_state", conv_state, stream, [&] { return conv::run_cpu(p); },
      // Generic, so that a build without CUDA kernels never instantiates (links) the call.
      [&](auto on) { return cuda_api::causal_conv1d_update(p, on); });
}

static void causal_conv1d_prefill(const FastWritableArray& x, const FastWritableArray& weight,
                                  const FastWritableArray& conv_state,
                                  const FastWritableArray& initial_state_indices,
                                  const FastWritableArray& final_state_indices,
                                  const FastWritableArray& cu_seqlens, const FastWritableArray& out,
                                  const std::string& activation, const std::string& state_layout,
                                  int64_t first_valid_slot, const OptFastWritableArray& error_count,
                                  std::optional<uintptr_t> stream) {
  const conv_prefill::Params p = binding::conv_prefill_params<FastWritableArray>(
      {x, weight, conv_state, initial_state_indices, final_state_indices, cu_seqlens, out,
       activation, state_layout, first_valid_slot, error_count},
      array_view);
  run_call(
      p.conv_state, "conv_state", conv_state, stream, [&] { return conv_prefill::run_cpu(p); },
      // Generic, so that a build without CUDA kernels never instantiates (links) the call.
      [&](auto on) { return cuda_api::causal_conv1d_prefill(p, on); });
}

// Binds a conv call (causal_conv1d_update, causal_conv1d_prefill) as `name`: its own arguments
// `own...`, then the options both take, named, ordered and defaulted as in their Python
// signatures; its docstring is `doc` followed by what the `stream` option does.
template <class F, class... Own>
void def_conv(nb::module_& m, const char* name, F* f, const char* doc, const Own&... own) {
  const std::string full_doc =
      std::string(doc) +
      " `stream`: the CUDA stream handle; None launches on the current stream of `conv_state`'s "
      "framework (torch, CuPy), else on the legacy default stream.";
  m.def(name, f, own..., nb::arg("activation") = "silu", nb::arg("state_layout") = "channels_major",
        nb::arg("first_valid_slot") = 0, nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("stream").none() = nb::none(), full_doc.c_str());
}

void bind_conv(nb::module_& m) {
  def_conv(
      m, "causal_conv1d_update", &causal_conv1d_update,
      "Depthwise causal conv1d over each request's tokens with speculative rollback of the conv "
      "state: updates `conv_state` in place and writes `out` (which may be `x`).",
      nb::arg("x").noconvert(), nb::arg("weight").noconvert(), nb::arg("conv_state").noconvert(),
      nb::arg("conv_state_indices").noconvert(), nb::arg("cu_seqlens").noconvert(),
      nb::arg("out").noconvert(), nb::arg("num_accepted_tokens").noconvert().none() = nb::none());
  def_conv(
      m, "causal_conv1d_prefill", &causal_conv1d_prefill,
      "Depthwise causal conv1d over whole requests (prefill): each request's history comes from "
      "its initial slot of `conv_state` (zeros for a null id), its last W - 1 inputs go to its "
      "final slot; writes `out` (which may be `x`).",
      nb::arg("x").noconvert(), nb::arg("weight").noconvert(), nb::arg("conv_state").noconvert(),
      nb::arg("initial_state_indices").noconvert(), nb::arg("final_state_indices").noconvert(),
      nb::arg("cu_seqlens").noconvert(), nb::arg("out").noconvert());
}

}  // namespace gdn::python
