// Includes the CUDA launcher of decode_mtp and calls it with a valid problem held in host memory:
// the launcher validates every argument, then refuses host arrays before it touches a device, so
// this runs (and checks the refusal) with or without a GPU.
#include <cstdio>
#include <gdn/decode_mtp/cuda.cuh>
#include <string>
#include <vector>

int main() {
  using gdn::DType;
  using gdn::TensorView;
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

  const gdn::Status s = gdn::decode_mtp::launch_cuda(p, /*stream=*/nullptr);
  if (s.is_ok() || s.reason().find("arrays on cpu") == std::string::npos) {
    std::printf("unexpected launcher result: %s\n", s.is_ok() ? "ok" : s.reason().c_str());
    return 1;
  }
  std::printf("ok: decode_mtp CUDA launcher compiled; it refused host arrays: %s\n",
              s.reason().c_str());
  return 0;
}
