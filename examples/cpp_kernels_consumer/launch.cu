// The header launcher, compiled against gdn::kernels: the kernels come from the package.
#include <gdn/decode_mtp/cuda.cuh>

gdn::Status launch_decode_mtp(const gdn::decode_mtp::Params& p, void* stream) {
  return gdn::decode_mtp::launch_cuda(p, static_cast<cudaStream_t>(stream));
}
