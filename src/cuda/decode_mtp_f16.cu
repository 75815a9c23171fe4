// Compiled decode_mtp kernels for one state dtype (all head ratios); see gdn/decode_mtp/cuda.cuh.
#include "gdn/decode_mtp/cuda.cuh"

namespace gdn::decode_mtp::cuda_detail {
template Status launch_state_dtype<DType::kFloat16, false>(const KernelArgs&, int, int,
                                                           cudaStream_t);
}  // namespace gdn::decode_mtp::cuda_detail
