// causal_conv1d_prefill on CUDA against a device-to-device copy of its bytes.
//
// Build and run (repository root, one GPU):
//   nvcc -std=c++20 -O3 -arch=sm_90a --expt-relaxed-constexpr -Iinclude \
//     benchmarks/cuda/conv_prefill_bench.cu -o /tmp/conv_prefill_bench && /tmp/conv_prefill_bench
//
// Shapes: Qwen3-Next TP1 conv (D = 2 * 16 * 128 + 32 * 128 = 8192 channels, W = 4, SiLU), bf16 x,
// out, weight and conv_state [2N + 1, D, 3] (channels_major; initial slots 1..N, final slots
// N+1..2N), on 1 x 8192 and 64 x 128 tokens, out of place and in place (out is x).
// Bytes of a call: x read + out written + the initial slots' history read + the final slots
// written. Timing: buffer sets rotated so that each set's bytes together exceed 50 MB (L2), 5
// warm-up calls, then 50 calls each timed with CUDA events; the median. The copy moves half the
// call's bytes (a copy reads and writes each byte), rotated the same way.
// Before timing, every configuration (and a small one with a partial channel block, padded and
// short requests and a long one) is checked against the CPU path: outputs within bf16 rounding,
// final slots bit for bit.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gdn/conv_prefill/cpu.hpp"
#include "gdn/conv_prefill/cuda.cuh"

namespace {

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

using gdn::DType;
using gdn::TensorView;

constexpr int64_t kW = 4;
constexpr int64_t kL2Bytes = 50ll << 20;

uint16_t to_bf16(float v) { return gdn::to_bf16(v).bits; }
float from_bf16(uint16_t b) { return gdn::to_float(gdn::bf16_t{b}); }

struct Shape {
  int64_t N, T, D;
  std::vector<int64_t> lengths;  // empty: N requests of T tokens
};

// One problem's host data.
struct Host {
  int64_t N, L, D, slots;
  std::vector<uint16_t> x, weight, state;
  std::vector<int32_t> cu, initial, final_;
  explicit Host(const Shape& s, uint32_t seed) : N(s.N), D(s.D) {
    std::vector<int64_t> len = s.lengths;
    if (len.empty()) len.assign(size_t(s.N), s.T);
    N = int64_t(len.size());
    cu.assign(1, 0);
    for (int64_t t : len) cu.push_back(cu.back() + int32_t(t));
    L = cu.back();
    slots = 2 * N + 1;
    std::mt19937 rng(seed);
    std::normal_distribution<float> n01;
    x.resize(size_t(L * D));
    weight.resize(size_t(D * kW));
    state.resize(size_t(slots * D * (kW - 1)));
    for (auto& v : x) v = to_bf16(n01(rng));
    for (auto& v : weight) v = to_bf16(0.3f * n01(rng));
    for (auto& v : state) v = to_bf16(n01(rng));
    for (int64_t i = 0; i < N; ++i) {
      initial.push_back(int32_t(1 + i));
      final_.push_back(int32_t(N + 1 + i));
    }
  }
  int64_t bytes() const { return 2 * L * D * 2 + 2 * N * D * (kW - 1) * 2; }
};

// Device copies of one problem (a buffer set).
struct DeviceSet {
  uint16_t *x = nullptr, *out = nullptr, *state = nullptr;
  void alloc(const Host& h) {
    CHECK_CUDA(cudaMalloc(&x, h.x.size() * 2));
    CHECK_CUDA(cudaMalloc(&out, h.x.size() * 2));
    CHECK_CUDA(cudaMalloc(&state, h.state.size() * 2));
    upload(h);
  }
  void upload(const Host& h) {
    CHECK_CUDA(cudaMemcpy(x, h.x.data(), h.x.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(state, h.state.data(), h.state.size() * 2, cudaMemcpyHostToDevice));
  }
  void release() {
    cudaFree(x);
    cudaFree(out);
    cudaFree(state);
  }
};

struct Shared {  // weight and indices, shared by the sets
  uint16_t* weight = nullptr;
  int32_t *cu = nullptr, *initial = nullptr, *final_ = nullptr;
  void alloc(const Host& h) {
    CHECK_CUDA(cudaMalloc(&weight, h.weight.size() * 2));
    CHECK_CUDA(cudaMalloc(&cu, h.cu.size() * 4));
    CHECK_CUDA(cudaMalloc(&initial, h.initial.size() * 4 + 4));
    CHECK_CUDA(cudaMalloc(&final_, h.final_.size() * 4 + 4));
    CHECK_CUDA(cudaMemcpy(weight, h.weight.data(), h.weight.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(cu, h.cu.data(), h.cu.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(initial, h.initial.data(), h.initial.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(final_, h.final_.data(), h.final_.size() * 4, cudaMemcpyHostToDevice));
  }
  void release() {
    cudaFree(weight);
    cudaFree(cu);
    cudaFree(initial);
    cudaFree(final_);
  }
};

gdn::conv_prefill::Params params(const Host& h, void* x, void* out, void* weight, void* state,
                                 void* cu, void* initial, void* final_, gdn::Device dev) {
  gdn::conv_prefill::Params p;
  p.x = TensorView::make(x, DType::kBFloat16, {h.L, h.D}, {h.D, 1}, dev);
  p.out = TensorView::make(out, DType::kBFloat16, {h.L, h.D}, {h.D, 1}, dev);
  p.weight = TensorView::make(weight, DType::kBFloat16, {h.D, kW}, {kW, 1}, dev);
  p.conv_state = TensorView::make(state, DType::kBFloat16, {h.slots, h.D, kW - 1},
                                  {h.D * (kW - 1), kW - 1, 1}, dev);
  p.cu_seqlens = TensorView::make(cu, DType::kInt32, {h.N + 1}, {1}, dev);
  p.initial_state_indices = TensorView::make(initial, DType::kInt32, {h.N}, {1}, dev);
  p.final_state_indices = TensorView::make(final_, DType::kInt32, {h.N}, {1}, dev);
  return p;
}

// The CUDA call on one set against the CPU path on the host data; returns false on a mismatch.
bool verify(const Shape& s, bool in_place, uint32_t seed) {
  Host h(s, seed);
  DeviceSet d;
  Shared sh;
  d.alloc(h);
  sh.alloc(h);
  const gdn::Device gpu{gdn::DeviceType::kCUDA, 0};
  gdn::conv_prefill::Params p =
      params(h, d.x, in_place ? d.x : d.out, sh.weight, d.state, sh.cu, sh.initial, sh.final_, gpu);
  const gdn::Status st = gdn::conv_prefill::launch_cuda(p, nullptr);
  if (!st.is_ok()) {
    std::printf("launch failed: %s\n", st.reason().c_str());
    return false;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> got(h.x.size()), state(h.state.size());
  CHECK_CUDA(
      cudaMemcpy(got.data(), in_place ? d.x : d.out, got.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(state.data(), d.state, state.size() * 2, cudaMemcpyDeviceToHost));
  d.release();
  sh.release();

  Host c = h;  // CPU path on copies
  std::vector<uint16_t> cpu_out(h.x.size());
  gdn::conv_prefill::Params q =
      params(c, c.x.data(), in_place ? c.x.data() : cpu_out.data(), c.weight.data(), c.state.data(),
             c.cu.data(), c.initial.data(), c.final_.data(), gdn::Device{});
  if (!gdn::conv_prefill::run_cpu(q).is_ok()) return false;
  const std::vector<uint16_t>& want = in_place ? c.x : cpu_out;
  for (size_t e = 0; e < want.size(); ++e) {
    const float a = from_bf16(got[e]), b = from_bf16(want[e]);
    if (!(std::fabs(a - b) <= 1e-2f * std::fabs(b) + 1e-3f)) {
      std::printf("  out element %zu (row %zu, channel %zu): %g, CPU %g\n", e, e / size_t(h.D),
                  e % size_t(h.D), a, b);
      return false;
    }
  }
  for (size_t e = 0; e < state.size(); ++e)
    if (state[e] != c.state[e]) {
      std::printf("  conv_state element %zu: %g, CPU %g\n", e, from_bf16(state[e]),
                  from_bf16(c.state[e]));
      return false;
    }
  return true;
}

template <class F>
double median_us(int sets, F&& call) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) call(i % sets);
  std::vector<float> t;
  for (int i = 0; i < 50; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    call(i % sets);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return 1e3 * t[t.size() / 2];
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);

  bool ok = true;
  const Shape small{0, 0, 200, {3, 0, 1, 2, 300, 64, 5, 1000, 2, 257}};
  for (bool in_place : {false, true}) {
    const bool good = verify(small, in_place, 7);
    std::printf("check small (D = 200, mixed lengths) %s: %s\n",
                in_place ? "in place" : "out of place", good ? "ok" : "MISMATCH");
    ok = ok && good;
  }
  const Shape shapes[] = {{1, 8192, 8192, {}}, {64, 128, 8192, {}}};
  for (const Shape& s : shapes)
    for (bool in_place : {false, true}) {
      const bool good = verify(s, in_place, 11);
      std::printf("check %lld x %lld %s: %s\n", (long long)s.N, (long long)s.T,
                  in_place ? "in place" : "out of place", good ? "ok" : "MISMATCH");
      ok = ok && good;
    }

  std::printf("\n%-10s %-13s %10s %10s %8s %10s\n", "shape", "form", "conv us", "copy us", "ratio",
              "conv TB/s");
  for (const Shape& s : shapes) {
    const Host h(s, 5);
    const int64_t bytes = h.bytes();
    const int64_t set_bytes = int64_t(h.x.size() * 4 + h.state.size() * 2);
    const int sets = int(std::max<int64_t>(2, (kL2Bytes + set_bytes - 1) / set_bytes));
    std::vector<DeviceSet> dev(static_cast<size_t>(sets));
    for (auto& d : dev) d.alloc(h);
    Shared sh;
    sh.alloc(h);
    const gdn::Device gpu{gdn::DeviceType::kCUDA, 0};

    // The copy: half the call's bytes, rotated over the same number of sets.
    const size_t copy_bytes = size_t(bytes / 2);
    std::vector<void*> src(static_cast<size_t>(sets)), dst(static_cast<size_t>(sets));
    for (int i = 0; i < sets; ++i) {
      CHECK_CUDA(cudaMalloc(&src[size_t(i)], copy_bytes));
      CHECK_CUDA(cudaMalloc(&dst[size_t(i)], copy_bytes));
      CHECK_CUDA(cudaMemset(src[size_t(i)], 1, copy_bytes));
    }
    const double copy_us = median_us(sets, [&](int i) {
      CHECK_CUDA(cudaMemcpyAsync(dst[size_t(i)], src[size_t(i)], copy_bytes,
                                 cudaMemcpyDeviceToDevice, nullptr));
    });
    for (int i = 0; i < sets; ++i) {
      cudaFree(src[size_t(i)]);
      cudaFree(dst[size_t(i)]);
    }

    for (bool in_place : {false, true}) {
      std::vector<gdn::conv_prefill::Params> ps;
      for (auto& d : dev)
        ps.push_back(params(h, d.x, in_place ? d.x : d.out, sh.weight, d.state, sh.cu, sh.initial,
                            sh.final_, gpu));
      const double us = median_us(sets, [&](int i) {
        const gdn::Status st = gdn::conv_prefill::launch_cuda(ps[size_t(i)], nullptr);
        if (!st.is_ok()) {
          std::fprintf(stderr, "launch failed: %s\n", st.reason().c_str());
          std::exit(1);
        }
      });
      char name[32];
      std::snprintf(name, sizeof name, "%lldx%lld", (long long)s.N, (long long)s.T);
      std::printf("%-10s %-13s %10.1f %10.1f %8.2f %10.2f\n", name,
                  in_place ? "in place" : "out of place", us, copy_us, us / copy_us,
                  double(bytes) / us * 1e-6);
    }
    for (auto& d : dev) d.release();
    sh.release();
  }
  std::printf("\n%s\n", ok ? "all checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
