// CUDA causal_conv1d_update against the tests' float64 reference, spec == sequential on the device,
// the device rules for invalid rows (zero outputs, no state writes, error counter, no
// out-of-bounds access) and a CUDA-graph capture / replay with re-written indices.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "conv_case.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/kernels/cuda_api.hpp"
#include "gdn/kernels/cuda_api_conv.hpp"
#include "gpu_skip.hpp"

namespace gdn::testing::conv_test {
namespace {

#define CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

// Device copies of a case's buffers; `params()` are views over them on cuda:0.
struct DeviceCase {
  Case& c;
  void *x = nullptr, *out = nullptr, *weight = nullptr, *state = nullptr, *indices = nullptr,
       *cu = nullptr, *acc = nullptr;
  int* errors = nullptr;

  explicit DeviceCase(Case& host) : c(host) {
    x = upload(c.x.bytes);
    if (!c.cfg.in_place) out = upload(c.out.bytes);
    weight = upload(c.weight.bytes);
    state = upload(c.state.bytes);
    indices = upload(c.indices);
    cu = upload(c.cu);
    if (!c.acc.empty()) acc = upload(c.acc);
    cudaMalloc(&errors, sizeof(int));
    cudaMemset(errors, 0, sizeof(int));
  }
  ~DeviceCase() {
    for (void* p : {x, out, weight, state, indices, cu, acc, static_cast<void*>(errors)})
      cudaFree(p);
  }
  template <class V>
  static void* upload(const V& v) {
    void* p = nullptr;
    const size_t n = std::max<size_t>(v.size() * sizeof(v[0]), 1);
    cudaMalloc(&p, n);
    cudaMemcpy(p, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice);
    return p;
  }
  // Re-uploads the host-side inputs that tests change between calls.
  void refresh_inputs() {
    cudaMemcpy(x, c.x.bytes.data(), c.x.bytes.size(), cudaMemcpyHostToDevice);
    if (out) cudaMemcpy(out, c.out.bytes.data(), c.out.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(indices, c.indices.data(), c.indices.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(cu, c.cu.data(), c.cu.size() * 4, cudaMemcpyHostToDevice);
    if (acc) cudaMemcpy(acc, c.acc.data(), c.acc.size() * 4, cudaMemcpyHostToDevice);
  }
  conv::Params params(bool count_errors = true) {
    conv::Params p = c.params();
    const Device dev{DeviceType::kCUDA, 0};
    p.x.data = x;
    p.out.data = c.cfg.in_place ? x : out;
    p.weight.data = weight;
    p.conv_state.data = state;
    p.conv_state_indices.data = indices;
    p.cu_seqlens.data = cu;
    if (acc) p.num_accepted_tokens.data = acc;
    for (TensorView* v : {&p.x, &p.out, &p.weight, &p.conv_state, &p.conv_state_indices,
                          &p.cu_seqlens, &p.num_accepted_tokens})
      v->device = dev;
    if (count_errors) p.error_count = TensorView::make(errors, DType::kInt32, {1}, {}, dev);
    return p;
  }
  void download() {
    cudaDeviceSynchronize();
    cudaMemcpy(c.x.bytes.data(), x, c.x.bytes.size(), cudaMemcpyDeviceToHost);
    if (out) cudaMemcpy(c.out.bytes.data(), out, c.out.bytes.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(c.state.bytes.data(), state, c.state.bytes.size(), cudaMemcpyDeviceToHost);
  }
  int error_count() {
    int n = -1;
    cudaMemcpy(&n, errors, sizeof(int), cudaMemcpyDeviceToHost);
    return n;
  }
};

// One call on the device, results copied back into the case's host buffers.
Status run_on_device(Case& c) {
  DeviceCase d(c);
  Status s = cuda_api::causal_conv1d_update(d.params(), nullptr);
  if (!s.is_ok()) return s;
  d.download();
  if (cudaGetLastError() != cudaSuccess) return Status(StatusCode::kCudaError, "kernel failed");
  if (d.error_count() != 0)
    return Status::invalid("error counter = " + std::to_string(d.error_count()));
  return Status::ok();
}

void expect_matches_reference(Case& c) {
  const std::string diff = run_against_reference(c, run_on_device);
  EXPECT_TRUE(diff.empty()) << diff;
}

class GpuConvGrid : public ::testing::TestWithParam<GridParam> {};

TEST_P(GpuConvGrid, MatchesFloat64Reference) {
  GDN_SKIP_WITHOUT_GPU();
  for (int64_t num_spec : {0, 1, 3, 7}) {
    // D = 300: several channel blocks, the last one partial.
    Case c(grid_config(GetParam(), num_spec, /*D=*/300, /*N=*/7, /*seed_base=*/300));
    SCOPED_TRACE("num_spec " + std::to_string(num_spec));
    expect_matches_reference(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Conv, GpuConvGrid,
                         ::testing::Combine(::testing::Values(conv::StateLayout::kChannelsMajor,
                                                              conv::StateLayout::kTokensMajor),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16),
                                            ::testing::Values(2, 4, 5 /* run-time width */)),
                         GridName());

TEST(GpuConv, MixedDtypesStridesInPlaceAndSkippedRows) {
  GDN_SKIP_WITHOUT_GPU();
  {
    Config g;
    g.weight_dtype = DType::kBFloat16;
    g.x_dtype = DType::kFloat16;
    g.state_dtype = DType::kBFloat16;
    g.index_dtype = DType::kInt64;
    g.x_row_pad = 5;
    g.out_row_pad = 3;
    g.weight_row_pad = 2;
    g.slot_pad = 7;
    g.index_stride = 4;
    g.activation = conv::Activation::kNone;
    Case c(random_rows(g, 5, 7));
    expect_matches_reference(c);
  }
  {
    Config g;
    g.in_place = true;
    g.x_dtype = DType::kBFloat16;
    g.x_row_pad = 6;
    g.layout = conv::StateLayout::kTokensMajor;
    Case c(random_rows(g, 4, 11));
    expect_matches_reference(c);
  }
  {
    Config g;
    g.first_valid_slot = 1;
    g.T = {4, 0, 3, 2, 0};
    g.acc = {2, 9, 1, 3, 0};  // padded rows may carry any accepted count
    g.slot = {3, 5, 0, 7, 0};
    Case c(g);
    expect_matches_reference(c);
  }
}

TEST(GpuConv, SpecEqualsSequentialBitForBit) {
  GDN_SKIP_WITHOUT_GPU();
  for (auto layout : {conv::StateLayout::kChannelsMajor, conv::StateLayout::kTokensMajor})
    for (auto [state, act] : {std::pair{DType::kFloat32, DType::kFloat32},
                              std::pair{DType::kBFloat16, DType::kBFloat16},
                              std::pair{DType::kBFloat16, DType::kFloat32}})
      for (int64_t W : {2, 4, 5})
        for (int64_t num_spec : {1, 3}) {
          const std::string diff =
              spec_vs_sequential(layout, state, act, W, num_spec, run_on_device);
          ASSERT_TRUE(diff.empty())
              << conv::to_string(layout) << " W " << W << " num_spec " << num_spec << ": " << diff;
        }
}

TEST(GpuConv, ConvStateMatchesCpuBitForBit) {
  GDN_SKIP_WITHOUT_GPU();
  Config g = random_rows(Config{}, 9, 5);
  g.D = 260;
  g.state_dtype = DType::kBFloat16;
  g.x_dtype = g.out_dtype = DType::kBFloat16;
  Case on_cpu(g), on_gpu(g);
  ASSERT_TRUE(conv::run_cpu(on_cpu.params()).is_ok());
  ASSERT_TRUE(run_on_device(on_gpu).is_ok());
  EXPECT_TRUE(on_cpu.state.same_bits(on_gpu.state, 0, on_cpu.state.count));
}

// Invalid rows on the device: no state writes, zero outputs (where the row's range is sane), one
// count each, and nothing outside the arrays is touched even for wild indices.
TEST(GpuConv, InvalidRowsAreZeroedAndCounted) {
  GDN_SKIP_WITHOUT_GPU();
  Config g;
  g.D = 150;
  g.slots = 10;
  g.first_valid_slot = 1;
  g.T = {2, 3, 4, 1, 2, 3, 0, 2};
  g.acc = {1, 0, 2, 4, 5, 1, 77, 2};
  g.slot = {2, 3, 4, 1000000, 5, -7, 1 << 30, 6};
  Case c(g);
  // Row 1: acc 0; row 3: slot past the pool; row 4: acc 5 > S = 4; row 5: null slot (skipped);
  // row 6: T = 0 (skipped); rows 0, 2, 7 valid.
  c.cu = {0, 2, 5, 9, 10, 12, 15, 15, 17};
  const Buffer state_before = c.state;
  const Buffer out_before = c.out;
  // The reference of the valid rows: the same case with the invalid rows' slots made null.
  Case ref_case = c;
  for (int64_t i : {1, 3, 4}) ref_case.set_slot(i, 0);
  ref_case.acc[6] = 1;
  const Expected e = reference(ref_case);

  DeviceCase d(c);
  ASSERT_TRUE(cuda_api::causal_conv1d_update(d.params(), nullptr).is_ok());
  d.download();
  CUDA_OK(cudaGetLastError());
  EXPECT_EQ(d.error_count(), 3);
  for (int64_t l = 0; l < c.L; ++l) {
    const bool invalid = (l >= 2 && l < 5) || (l >= 9 && l < 12);
    const bool skipped = l >= 12 && l < 15;
    for (int64_t ch = 0; ch < g.D; ++ch) {
      const int64_t k = l * c.out_stride + ch;
      if (invalid) {
        ASSERT_EQ(c.out.get(k), 0.0f) << "row " << l;
      } else if (skipped) {
        ASSERT_TRUE(c.out.bits_equal(k, out_before, k)) << "row " << l;
      } else {
        const double want = e.out[size_t(l * g.D + ch)];
        ASSERT_NEAR(c.out.get(k), want, out_tolerance(c.out.dtype, want)) << "row " << l;
      }
    }
  }
  for (int64_t k = 0; k < c.state.count; ++k) {
    if (e.written[size_t(k)])
      ASSERT_EQ(double(c.state.get(k)), e.state[size_t(k)]) << "state element " << k;
    else
      ASSERT_TRUE(c.state.bits_equal(k, state_before, k)) << "state element " << k << " changed";
  }

  // A broken cu_seqlens range: the row cannot know its rows, so it writes nothing, and counts.
  Case c2(g);
  c2.cu = {0, 2, 5, 9, 10, 12, 15, 15, 99};  // last row ends past L
  for (int64_t i = 0; i < c2.N; ++i) c2.set_slot(i, 1 + i);
  c2.acc = {1, 1, 1, 1, 1, 1, 1, 1};
  const Buffer out2_before = c2.out;
  DeviceCase d2(c2);
  ASSERT_TRUE(cuda_api::causal_conv1d_update(d2.params(), nullptr).is_ok());
  d2.download();
  EXPECT_EQ(d2.error_count(), 1);
  for (int64_t ch = 0; ch < g.D; ++ch)
    ASSERT_TRUE(c2.out.bits_equal(15 * c2.out_stride + ch, out2_before, 15 * c2.out_stride + ch));
}

// Capture one launch in a CUDA graph, then change inputs, indices and accepted counts in place and
// replay: each replay matches the reference of the new inputs.
TEST(GpuConv, GraphCaptureAndReplay) {
  GDN_SKIP_WITHOUT_GPU();
  Config g = random_rows(Config{}, 6, 41);
  g.D = 200;
  g.T.assign(6, g.num_spec + 1);
  Case c(g);
  DeviceCase d(c);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  Status s = cuda_api::causal_conv1d_update(d.params(), stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.is_ok()) << s.reason();
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::mt19937 rng(3);
  std::normal_distribution<float> n01;
  for (int replay = 0; replay < 4; ++replay) {
    for (int64_t e = 0; e < c.x.count; ++e) c.x.set(e, n01(rng));
    for (int64_t i = 0; i < c.N; ++i)
      c.acc[size_t(i)] = int32_t(1 + rng() % uint32_t(g.num_spec + 1));
    std::vector<int64_t> perm(size_t(g.slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = 0; i < c.N; ++i) c.set_slot(i, perm[size_t(i)]);
    c.poison_out();
    d.refresh_inputs();
    const Expected e = reference(c);
    const Buffer out_before = c.out, state_before = c.state;
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    d.download();
    const std::string diff = compare(c, e, c.out, out_before, state_before, c.state);
    ASSERT_TRUE(diff.empty()) << "replay " << replay << ": " << diff;
  }
  EXPECT_EQ(d.error_count(), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace gdn::testing::conv_test
