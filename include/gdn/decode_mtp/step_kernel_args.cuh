// The part of a step kernel's arguments that StepArgs gives: decode_mtp's and replay's KernelArgs
// (gdn/decode_mtp/cuda_kernel.cuh) and prefill's (gdn/prefill/cuda_kernel.cuh) name these fields
// alike, so one host-side fill serves all three launchers.
#pragma once

#include "gdn/core/cuda/launch.cuh"
#include "gdn/decode_mtp/params.hpp"

namespace gdn::decode_mtp {

// Sets args' StepArgs pointers, row strides, dtypes and options from a call checked into `pr`;
// absent optional arrays become null pointers (their dtypes float32, never read). The caller sets
// the rest (its slot tables, counts and launch choices).
template <class KernelArgs>
void fill_step_kernel_args(const StepArgs& p, const Problem& pr, KernelArgs& args) {
  args.mixed_qkv = p.mixed_qkv.data;
  args.a = p.a.data;
  args.b = p.b.data;
  args.A_log = p.A_log.data_or_null();
  args.dt_bias = p.dt_bias.data_or_null();
  args.z = p.z.data_or_null();
  args.norm_weight = p.norm_weight.data_or_null();
  args.state = p.state.data;
  args.cu_seqlens = p.cu_seqlens.data;
  args.out = p.out.data;
  args.error_count = gdn::cuda::error_counter(p.error_count);
  args.qkv_row_stride = p.mixed_qkv.strides[0];
  args.a_row_stride = p.a.strides[0];
  args.b_row_stride = p.b.strides[0];
  args.z_row_stride = p.z.present() ? p.z.strides[0] : 0;
  args.z_head_stride = p.z.present() ? p.z.strides[1] : 0;
  args.slot_stride = p.state.strides[0];
  args.num_slots = pr.num_slots;
  args.first_valid_slot = p.first_valid_slot;
  args.L = pr.L;
  args.N = pr.N;
  args.a_dtype = p.a.dtype;
  args.b_dtype = p.b.dtype;
  args.A_log_dtype = p.A_log.present() ? p.A_log.dtype : DType::kFloat32;
  args.dt_bias_dtype = p.dt_bias.present() ? p.dt_bias.dtype : DType::kFloat32;
  args.out_dtype = p.out.dtype;
  args.cu_dtype = p.cu_seqlens.dtype;
  args.round_core_output = p.round_core_output;
  args.a_is_log_decay = p.a_is_log_decay;
  args.b_is_beta = p.b_is_beta;
  args.qk_l2_norm = p.qk_l2_norm;
  args.scale = pr.scale;
  args.l2_eps = p.l2_eps;
  args.norm_eps = p.norm_eps;
}

}  // namespace gdn::decode_mtp
