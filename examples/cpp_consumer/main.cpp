// Runs one MTP verify step (T = 3 tokens, previous step accepted 2) of a tiny GDN layer through the
// CPU decode_mtp of the installed package and prints where the states went. Inputs are const
// arrays; only the state pool and the output are written.
#include <cmath>
#include <cstdio>
#include <gdn/gdn.hpp>
#include <random>
#include <vector>

int main() {
  using gdn::DType;
  using gdn::TensorView;
  constexpr int64_t H = 2, HV = 4, K = 16, V = 16, S = 3, T = 3, slots = 8;
  constexpr int64_t width = 2 * H * K + HV * V;
  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  auto randn = [&](size_t n, float s) {
    std::vector<float> x(n);
    for (auto& e : x) e = s * n01(rng);
    return x;
  };
  const auto qkv = randn(T * width, 1.0f), a = randn(T * HV, 1.0f), b = randn(T * HV, 1.0f);
  const auto A_log = randn(HV, 0.5f), dt_bias = randn(HV, 0.1f), w = randn(V, 1.0f);
  const auto z = randn(T * HV * V, 1.0f);
  auto pool = randn(slots * HV * V * K, 0.01f);
  const std::vector<int32_t> indices = {3, 5, 6}, cu = {0, T}, acc = {2};
  std::vector<float> out(T * HV * V, NAN);

  gdn::decode_mtp::Params p;
  p.mixed_qkv = TensorView::make(qkv.data(), DType::kFloat32, {T, width});
  p.a = TensorView::make(a.data(), DType::kFloat32, {T, HV});
  p.b = TensorView::make(b.data(), DType::kFloat32, {T, HV});
  p.A_log = TensorView::make(A_log.data(), DType::kFloat32, {HV});
  p.dt_bias = TensorView::make(dt_bias.data(), DType::kFloat32, {HV});
  p.z = TensorView::make(z.data(), DType::kFloat32, {T, HV, V});
  p.norm_weight = TensorView::make(w.data(), DType::kFloat32, {V});
  p.state = TensorView::make(pool.data(), DType::kFloat32, {slots, HV, V, K});
  p.state_indices = TensorView::make(indices.data(), DType::kInt32, {1, S});
  p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {2});
  p.num_accepted_tokens = TensorView::make(acc.data(), DType::kInt32, {1});
  p.out = TensorView::make(out.data(), DType::kFloat32, {T, HV, V});

  auto support = gdn::decode_mtp::can_use(gdn::DeviceType::kCPU, H, HV, K, V, S, DType::kFloat32);
#if defined(_OPENMP)
  std::printf("OpenMP: on\n");
#else
  std::printf("OpenMP: off\n");  // find_package(gdn) with GDN_WITH_OPENMP=OFF, or no OpenMP found
#endif
  std::printf("guard: %s (%s)\n", gdn::decode_mtp::to_string(support.path), support.reason.c_str());
  gdn::Status status = gdn::decode_mtp::run_cpu(p);
  if (!status) {
    std::printf("decode_mtp failed: %s\n", status.reason().c_str());
    return 1;
  }
  double sum = 0;
  for (float v : out) {
    if (!std::isfinite(v)) return 1;
    sum += std::fabs(v);
  }
  std::printf("ok: read slot %d, wrote slots 3 5 6, mean |out| = %.4f\n", indices[1],
              sum / out.size());
  return 0;
}
