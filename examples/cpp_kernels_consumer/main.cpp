// Calls the precompiled kernels' host entry points: the device count, whether this build has a
// kernel image for device 0, and decode_mtp with a valid problem held in host memory, which the
// entry point refuses before it touches a device (so this runs with or without a GPU).
#include <cstdio>
#include <gdn/gdn.hpp>
#include <gdn/kernels/cuda_api.hpp>
#include <string>
#include <vector>

#if defined(GDN_CONSUMER_LAUNCH_CU)
gdn::Status launch_decode_mtp(const gdn::decode_mtp::Params& p, void* stream);  // launch.cu
#endif

namespace {
bool refused(const char* what, const gdn::Status& s, const char* expected) {
  if (s.is_ok() || s.reason().find(expected) == std::string::npos) {
    std::printf("%s: unexpected result: %s\n", what, s.is_ok() ? "ok" : s.reason().c_str());
    return false;
  }
  std::printf("%s refused host arrays: %s\n", what, s.reason().c_str());
  return true;
}
}  // namespace

int main() {
  using gdn::DType;
  using gdn::TensorView;
  const int devices = gdn::cuda_api::device_count();
  std::string why;
  const bool available = gdn::cuda_api::kernels_available(0, &why);
  std::printf("CUDA devices: %d; kernels for device 0: %s (%s)\n", devices,
              available ? "yes" : "no", why.c_str());

  constexpr int64_t H = 1, HV = 2, K = 128, V = 128, S = 2, T = 2, slots = 4;
  constexpr int64_t width = 2 * H * K + HV * V;
  const std::vector<float> qkv(T * width, 0.1f), ab(T * HV, 0.5f), per_head(HV, 0.0f);
  const std::vector<int32_t> indices = {1, 2}, cu = {0, T};
  std::vector<float> pool(slots * HV * V * K, 0.0f), out(T * HV * V, 0.0f);
  gdn::decode_mtp::Params p;
  p.mixed_qkv = TensorView::make(qkv.data(), DType::kFloat32, {T, width});
  p.a = TensorView::make(ab.data(), DType::kFloat32, {T, HV});
  p.b = TensorView::make(ab.data(), DType::kFloat32, {T, HV});
  p.A_log = TensorView::make(per_head.data(), DType::kFloat32, {HV});
  p.dt_bias = TensorView::make(per_head.data(), DType::kFloat32, {HV});
  p.state = TensorView::make(pool.data(), DType::kFloat32, {slots, HV, V, K});
  p.state_indices = TensorView::make(indices.data(), DType::kInt32, {1, S});
  p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {2});
  p.out = TensorView::make(out.data(), DType::kFloat32, {T, HV, V});

  bool ok =
      refused("cuda_api::decode_mtp", gdn::cuda_api::decode_mtp(p, nullptr), "needs CUDA arrays");
#if defined(GDN_CONSUMER_LAUNCH_CU)
  ok = refused("decode_mtp::launch_cuda", launch_decode_mtp(p, nullptr), "arrays on cpu") && ok;
#endif
  // The problem itself is valid: the refusals are only about where the arrays live.
  ok = gdn::decode_mtp::check_arguments(p, nullptr).is_ok() && ok;
  if (!ok) return 1;
  std::printf("ok\n");
  return 0;
}
