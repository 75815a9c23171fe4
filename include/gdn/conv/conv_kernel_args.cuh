// The part of a conv kernel's arguments that ConvArgs gives: causal_conv1d_update's and
// causal_conv1d_prefill's KernelArgs (gdn/conv/cuda.cuh, gdn/conv_prefill/cuda.cuh) name these
// fields alike, so one host-side fill serves both launchers.
#pragma once

#include "gdn/conv/params.hpp"
#include "gdn/core/cuda/launch.cuh"

namespace gdn::conv {

// Sets args' ConvArgs pointers, dtypes, row strides, sizes and options from a call checked into
// `pr`. The caller sets the rest (its slot tables, counts and kernel choices).
template <class KernelArgs>
void fill_conv_kernel_args(const ConvArgs& p, const Problem& pr, KernelArgs& args) {
  args.x = p.x.data;
  args.weight = p.weight.data;
  args.conv_state = p.conv_state.data;
  args.cu_seqlens = p.cu_seqlens.data;
  args.out = p.out.data;
  args.error_count = gdn::cuda::error_counter(p.error_count);
  args.weight_dtype = p.weight.dtype;
  args.state_dtype = p.conv_state.dtype;
  args.out_dtype = p.out.dtype;
  args.cu_dtype = p.cu_seqlens.dtype;
  args.x_row_stride = p.x.strides[0];
  args.out_row_stride = p.out.strides[0];
  args.weight_row_stride = p.weight.strides[0];
  args.L = pr.L;
  args.N = pr.N;
  args.D = pr.D;
  args.W = pr.W;
  args.buffer_len = pr.buffer_len;
  args.num_slots = pr.num_slots;
  args.slot_stride = pr.slot_stride;
  args.first_valid_slot = p.first_valid_slot;
  args.layout = p.layout;
  args.activation = p.activation;
}

}  // namespace gdn::conv
