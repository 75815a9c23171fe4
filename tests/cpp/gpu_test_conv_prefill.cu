// CUDA causal_conv1d_prefill against the tests' float64 reference and the CPU path over layouts,
// dtypes, widths and request lengths across tiles and in-place segments; in-place outputs and
// slots; the continuation by causal_conv1d_update equal to token-by-token updates on the device;
// the device rules for invalid rows (zero outputs, no state writes, error counter, no
// out-of-bounds access); a CUDA-graph capture / replay with rewritten indices.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "conv_prefill_case.hpp"
#include "device_mirror.hpp"
#include "gdn/conv/cpu.hpp"
#include "gdn/conv_prefill/cpu.hpp"
#include "gdn/kernels/cuda_api_conv.hpp"
#include "gpu_skip.hpp"

namespace gdn::testing::conv_prefill_test {
namespace {

#define CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

// One prefill on the device over the case's host buffers (mirrored there and back); `errors`
// receives the device error counter.
Status prefill_on_device(Case& c, int* errors) {
  *errors = 0;
  conv_prefill::Params p = c.params();
  p.error_count = TensorView::make(errors, DType::kInt32, {1});
  return run_mirrored({&p.x, &p.out, &p.weight, &p.conv_state, &p.initial_state_indices,
                       &p.final_state_indices, &p.cu_seqlens, &p.error_count},
                      [&] { return cuda_api::causal_conv1d_prefill(p, nullptr); });
}

Status run_on_device(Case& c) {
  int errors = -1;
  GDN_RETURN_IF_ERROR(prefill_on_device(c, &errors));
  if (errors != 0) return Status::invalid("error counter = " + std::to_string(errors));
  return Status::ok();
}

Status update_on_device(Case&, conv::Params p) {
  return run_mirrored({&p.x, &p.out, &p.weight, &p.conv_state, &p.conv_state_indices, &p.cu_seqlens,
                       &p.num_accepted_tokens},
                      [&] { return cuda_api::causal_conv1d_update(p, nullptr); });
}

void expect_matches_reference(Case& c) {
  const std::string diff = run_against_reference(c, run_on_device);
  EXPECT_TRUE(diff.empty()) << diff;
}

// The grid: D = 300 channels (several channel blocks, the last one partial), requests up to 1000
// tokens (many tiles; in place, more than one segment).
constexpr int64_t kGridChannels = 300, kGridLongest = 1000;

class GpuConvPrefillGrid : public ::testing::TestWithParam<GridParam> {};

TEST_P(GpuConvPrefillGrid, MatchesFloat64Reference) {
  GDN_SKIP_WITHOUT_GPU();
  for (bool in_place : {false, true}) {
    Config g = grid_config(GetParam(), 30, kGridChannels, kGridLongest);
    g.in_place = in_place;
    Case c(g);
    SCOPED_TRACE(in_place ? "out is x" : "out is not x");
    expect_matches_reference(c);
  }
}

TEST_P(GpuConvPrefillGrid, MatchesCpu) {
  GDN_SKIP_WITHOUT_GPU();
  for (bool in_place : {false, true}) {
    Config g = grid_config(GetParam(), 40, kGridChannels, kGridLongest);
    g.in_place = in_place;
    g.first_valid_slot = 1;
    g.T = {70, 3, 0, 1, 300, 64};
    g.initial = {0, 3, 4, 5, 6, 7};   // row 0 from a null slot
    g.final_ = {9, 3, 11, 12, 0, 7};  // row 1 and 5 in place on a slot, row 4 not written
    Case on_cpu(g), on_gpu(g);
    ASSERT_TRUE(conv_prefill::run_cpu(on_cpu.params()).is_ok());
    ASSERT_TRUE(run_on_device(on_gpu).is_ok());
    EXPECT_TRUE(on_cpu.state.same_bits(on_gpu.state, 0, on_cpu.state.count));
    const Buffer& a = on_cpu.out_buffer();
    const Buffer& b = on_gpu.out_buffer();
    for (int64_t e = 0; e < a.count; ++e) {
      const double want = a.get(e);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(b.get(e))) << "element " << e;
      } else {
        ASSERT_NEAR(b.get(e), want, 2 * out_tolerance(b.dtype, want)) << "element " << e;
      }
    }
  }
}

TEST_P(GpuConvPrefillGrid, UpdatesContinueAsTokenByToken) {
  GDN_SKIP_WITHOUT_GPU();
  for (bool in_place : {false, true}) {
    Config g = grid_config(GetParam(), 50, kGridChannels, kGridLongest);
    g.in_place = in_place;
    g.D = 70;
    g.num_spec = 3;
    g.T = {3, 0, 1, 2, 130, 5};
    g.first_valid_slot = 1;
    g.initial = {4, 9, 0, 6, 7, 8};
    g.final_ = {10, 11, 12, 6, 13, 14};
    const std::string diff = prefill_then_updates(g, run_on_device, update_on_device);
    EXPECT_TRUE(diff.empty()) << (in_place ? "out is x: " : "") << diff;
  }
}

INSTANTIATE_TEST_SUITE_P(ConvPrefill, GpuConvPrefillGrid,
                         ::testing::Combine(::testing::Values(conv::StateLayout::kChannelsMajor,
                                                              conv::StateLayout::kTokensMajor),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16),
                                            ::testing::Values(2, 4, 5 /* run-time width */)),
                         GridName());

TEST(GpuConvPrefill, MixedDtypesStridesAndManyShortRequests) {
  GDN_SKIP_WITHOUT_GPU();
  Config g;
  g.weight_dtype = DType::kBFloat16;
  g.x_dtype = DType::kFloat16;
  g.out_dtype = DType::kFloat32;
  g.state_dtype = DType::kBFloat16;
  g.index_dtype = DType::kInt64;
  g.x_row_pad = 5;
  g.out_row_pad = 3;
  g.weight_row_pad = 2;
  g.slot_pad = 7;
  g.index_stride = 3;
  g.activation = conv::Activation::kNone;
  g.slots = 400;
  // 150 requests of 0..4 tokens, then a long one: tiles hold many requests.
  for (int i = 0; i < 150; ++i) g.T.push_back(i % 5);
  g.T.push_back(200);
  for (bool in_place : {false, true}) {
    Config gi = g;
    gi.in_place = in_place;
    if (in_place) gi.x_dtype = gi.out_dtype = DType::kFloat16;
    Case c(gi);
    expect_matches_reference(c);
  }
}

// Requests that begin on the last row of a run, of a tile and of a 1024-row CTA segment, short
// ones that cross runs, all updated in place on their slot (final = initial), so that the history
// reads and the final-slot writes of one request fall in different threads and CTAs.
TEST(GpuConvPrefill, RequestsAcrossRunTileAndSegmentEdges) {
  GDN_SKIP_WITHOUT_GPU();
  for (DType act : {DType::kBFloat16, DType::kFloat32})
    for (int W : {4, 5, 8})  // W = 8: a run's halo reaches back past the run before it
      for (bool in_place : {false, true}) {
        Config g;
        g.D = 72;  // a partial channel block for every element size
        g.W = W;
        g.x_dtype = g.out_dtype = act;
        g.state_dtype = DType::kBFloat16;
        g.in_place = in_place;
        // Begins: 0, 1021, 1023 (segment end), 1028, 1029, 1030, 1279 (run and tile end),
        // 1281, 1287, 1289, 1291.
        g.T = {1021, 2, 5, 1, 1, 249, 2, 6, 2, 2, 300};
        g.slots = 16;
        for (int64_t i = 0; i < int64_t(g.T.size()); ++i) {
          g.initial.push_back(1 + i);
          g.final_.push_back(1 + i);
        }
        Case c(g);
        SCOPED_TRACE(std::string(to_string(act)) + " W" + std::to_string(W) +
                     (in_place ? " in place" : ""));
        expect_matches_reference(c);
      }
}

// Invalid rows on the device: no state writes, zero outputs (where the row's range is sane), one
// count each, and nothing outside the arrays is touched even for wild indices.
TEST(GpuConvPrefill, InvalidRowsAreZeroedAndCounted) {
  GDN_SKIP_WITHOUT_GPU();
  for (bool in_place : {false, true}) {
    Config g;
    g.D = 150;
    g.slots = 20;
    g.first_valid_slot = 1;
    g.in_place = in_place;
    g.T = {2, 70, 4, 1, 3, 0, 90};
    g.initial = {2, 3, 1000000, 5, -7, 1 << 30, 8};
    g.final_ = {10, 1 << 30, 12, 13, 0, -(1 << 30), 16};
    // Rows 1 and 2: a slot past the pool; row 4: null slots (runs, writes no state); row 5:
    // padded (any ids).
    Case c(g);
    const Buffer state_before = c.state;
    Case ref_case = c;
    ref_case.set_initial(1, 0);
    ref_case.set_final(1, 0);
    ref_case.set_initial(2, 0);
    ref_case.set_final(2, 0);
    const Expected e = reference(ref_case);
    int errors = -1;
    ASSERT_TRUE(prefill_on_device(c, &errors).is_ok());
    EXPECT_EQ(errors, 2);
    const Buffer& got = c.out_buffer();
    for (int64_t l = 0; l < c.L; ++l) {
      const bool invalid = l >= c.cu[1] && l < c.cu[3];
      for (int64_t ch = 0; ch < g.D; ++ch) {
        const int64_t k = l * c.out_stride + ch;
        if (invalid) {
          ASSERT_EQ(got.get(k), 0.0f) << "row " << l;
        } else {
          const double want = e.out[size_t(l * g.D + ch)];
          ASSERT_NEAR(got.get(k), want, out_tolerance(got.dtype, want)) << "row " << l;
        }
      }
    }
    for (int64_t k = 0; k < c.state.count; ++k) {
      if (e.written[size_t(k)])
        ASSERT_EQ(double(c.state.get(k)), e.state[size_t(k)]) << "state element " << k;
      else
        ASSERT_TRUE(c.state.bits_equal(k, state_before, k)) << "state element " << k << " changed";
    }

    // A broken cu_seqlens range: the row cannot know its rows; it writes nothing and is counted.
    Case c2(g);
    c2.cu.back() = int32_t(c2.L + 50);  // the last row ends past L
    for (int64_t i = 0; i < c2.N; ++i) {
      c2.set_initial(i, 1 + i);
      c2.set_final(i, 1 + i);
    }
    const Buffer out2_before = c2.out_buffer();
    ASSERT_TRUE(prefill_on_device(c2, &errors).is_ok());
    EXPECT_EQ(errors, 1);
    for (int64_t l = c2.cu[6]; l < c2.L; ++l)
      for (int64_t ch = 0; ch < g.D; ++ch)
        ASSERT_TRUE(c2.out_buffer().bits_equal(l * c2.out_stride + ch, out2_before,
                                               l * c2.out_stride + ch));
  }
}

// Capture one launch in a CUDA graph, then rewrite the inputs and slots in place and replay: each
// replay matches the reference of its inputs.
TEST(GpuConvPrefill, GraphCaptureAndReplay) {
  GDN_SKIP_WITHOUT_GPU();
  Config g;
  g.D = 200;
  g.T = {100, 3, 64, 1};
  Case c(g);
  auto upload = [](const void* host, size_t bytes) {
    void* d = nullptr;
    cudaMalloc(&d, bytes);
    cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
    return d;
  };
  void* x = upload(c.x.data(), c.x.bytes.size());
  void* out = upload(c.out.data(), c.out.bytes.size());
  void* weight = upload(c.weight.data(), c.weight.bytes.size());
  void* state = upload(c.state.data(), c.state.bytes.size());
  void* initial = upload(c.initial_bytes.data(), c.initial_bytes.size());
  void* final_ids = upload(c.final_bytes.data(), c.final_bytes.size());
  void* cu = upload(c.cu.data(), c.cu.size() * 4);
  int zero = 0;
  void* errors = upload(&zero, 4);
  conv_prefill::Params p = c.params();
  const Device dev{DeviceType::kCUDA, 0};
  p.x.data = x;
  p.out.data = out;
  p.weight.data = weight;
  p.conv_state.data = state;
  p.initial_state_indices.data = initial;
  p.final_state_indices.data = final_ids;
  p.cu_seqlens.data = cu;
  p.error_count = TensorView::make(errors, DType::kInt32, {1}, {}, dev);
  for (TensorView* v : {&p.x, &p.out, &p.weight, &p.conv_state, &p.initial_state_indices,
                        &p.final_state_indices, &p.cu_seqlens})
    v->device = dev;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status s = cuda_api::causal_conv1d_prefill(p, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.is_ok()) << s.reason();
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::mt19937 rng(3);
  std::normal_distribution<float> n01;
  for (int replay = 0; replay < 3; ++replay) {
    for (int64_t e = 0; e < c.x.count; ++e) c.x.set(e, n01(rng));
    std::vector<int64_t> perm(size_t(g.slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = 0; i < c.N; ++i) {
      c.set_initial(i, perm[size_t(i)]);
      c.set_final(i, replay == 1 ? perm[size_t(i)] : perm[size_t(i + c.N)]);
    }
    c.poison_out();
    cudaMemcpy(x, c.x.data(), c.x.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(out, c.out.data(), c.out.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(initial, c.initial_bytes.data(), c.initial_bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(final_ids, c.final_bytes.data(), c.final_bytes.size(), cudaMemcpyHostToDevice);
    const Expected e = reference(c);
    const Buffer out_before = c.out, state_before = c.state;
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaMemcpy(c.out.data(), out, c.out.bytes.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(c.state.data(), state, c.state.bytes.size(), cudaMemcpyDeviceToHost);
    const std::string diff = compare(c, e, c.out, out_before, state_before, c.state);
    ASSERT_TRUE(diff.empty()) << "replay " << replay << ": " << diff;
  }
  int count = -1;
  cudaMemcpy(&count, errors, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(count, 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* ptr : {x, out, weight, state, initial, final_ids, cu, errors}) cudaFree(ptr);
}

}  // namespace
}  // namespace gdn::testing::conv_prefill_test
