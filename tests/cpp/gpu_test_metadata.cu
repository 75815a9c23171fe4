// Metadata state rows on the GPU: the one-launch pass against the CPU pass and the per-group
// shadow check on random steps (G 1..6, S up to 16, both modes, with and without padding),
// accepted counts gathered on the device, bounds, the whole-step entry point, and a CUDA-graph
// capture replayed with new plans. Skips with a reason when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gdn/kernels/cuda_api_metadata.hpp"
#include "gdn/metadata/plan.hpp"
#include "gdn/metadata/shadow.hpp"
#include "gdn/metadata/state_rows.cuh"
#include "gpu_skip.hpp"
#include "metadata_case.hpp"

namespace gdn::metadata {
namespace {

using testing::kPoison;
using testing::random_step;
using testing::Step;

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

// A device copy of a host vector (freed with the object). Poisoned copies use the poison value.
struct DeviceVector {
  int32_t* ptr = nullptr;
  size_t n = 0;
  explicit DeviceVector(const std::vector<int32_t>& host) : n(host.size()) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * 4) != cudaSuccess) ptr = nullptr;
    if (ptr && n) cudaMemcpy(ptr, host.data(), n * 4, cudaMemcpyHostToDevice);
  }
  ~DeviceVector() { cudaFree(ptr); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  std::vector<int32_t> to_host() const {
    std::vector<int32_t> h(n);
    if (n) cudaMemcpy(h.data(), ptr, n * 4, cudaMemcpyDeviceToHost);
    return h;
  }
  void upload(const std::vector<int32_t>& host) const {
    cudaMemcpy(ptr, host.data(), std::min(n, host.size()) * 4, cudaMemcpyHostToDevice);
  }
};

TensorView device_view(const DeviceVector& d, std::initializer_list<int64_t> shape,
                       std::initializer_list<int64_t> strides = {}) {
  return TensorView::make(d.ptr, DType::kInt32, shape, strides, {DeviceType::kCUDA, 0});
}

// Device mirror of a Step's tables and buffers.
struct DeviceStep {
  std::vector<std::unique_ptr<DeviceVector>> tables;
  std::unique_ptr<DeviceVector> plan, spec_out, non_spec_out, error_count, accepted;

  explicit DeviceStep(const Step& s) {
    for (const auto& t : s.tables) tables.push_back(std::make_unique<DeviceVector>(t));
    plan = std::make_unique<DeviceVector>(s.plan);
    spec_out = std::make_unique<DeviceVector>(s.spec_out);
    non_spec_out = std::make_unique<DeviceVector>(s.non_spec_out);
    error_count = std::make_unique<DeviceVector>(std::vector<int32_t>{0});
    accepted = std::make_unique<DeviceVector>(s.num_accepted_tokens);
  }

  // The params of the device pass: host Params with the device arrays swapped in.
  Params params(Step& s, bool gather_accepted) const {
    Params p = s.params();
    p.plan = device_view(*plan, {int64_t(s.plan.size())});
    for (int g = 0; g < s.G(); ++g)
      p.block_tables[g] =
          device_view(*tables[size_t(g)], {s.table_rows[size_t(g)], s.table_cols[size_t(g)]},
                      {s.table_stride[size_t(g)], 1});
    p.spec_state_indices = device_view(*spec_out, {int64_t(s.G()), s.max_rows, s.S()});
    p.non_spec_state_indices = device_view(*non_spec_out, {int64_t(s.G()), s.max_rows});
    p.error_count = device_view(*error_count, {1});
    p.num_accepted_tokens =
        gather_accepted ? device_view(*accepted, {int64_t(accepted->n)}) : TensorView{};
    return p;
  }
};

// Copies device results back into a Step (for the CPU comparisons).
void download(const DeviceStep& d, Step* s) {
  s->plan = d.plan->to_host();
  s->spec_out = d.spec_out->to_host();
  s->non_spec_out = d.non_spec_out->to_host();
  s->error_count = d.error_count->to_host()[0];
}

TEST(MetadataCuda, OneLaunchMatchesTheCpuPassAndPerGroupBuilds) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(2024);
  for (int G = 1; G <= 6; ++G)
    for (int64_t S : {1, 2, 5, 9, 16})
      for (CacheMode mode : {CacheMode::kNone, CacheMode::kAlign})
        for (bool padded : {false, true})
          for (bool gather : {false, true}) {
            Step host = random_step(rng, G, S, mode, padded);
            if (gather) host.with_accepted = false;  // the device pass gathers them
            // CPU reference run.
            Step cpu = host;
            Params pc = cpu.params();
            ASSERT_TRUE(plan(pc).is_ok());
            DeviceStep dev(host);        // poisoned outputs
            dev.plan->upload(cpu.plan);  // the host plan (before the CPU pass touches it)
            if (gather)
              pc.num_accepted_tokens =
                  TensorView::make(cpu.num_accepted_tokens.data(), DType::kInt32,
                                   {int64_t(cpu.num_accepted_tokens.size())});
            int64_t cpu_errors = 0;
            ASSERT_TRUE(run_state_rows_cpu(pc, &cpu_errors).is_ok());

            Params pd = dev.params(host, gather);
            const Status st = launch_state_rows_cuda(pd, nullptr);
            ASSERT_TRUE(st.is_ok()) << st.reason();
            CUDA_OK(cudaDeviceSynchronize());
            Step got = host;
            download(dev, &got);
            EXPECT_EQ(got.error_count, cpu_errors) << "G=" << G << " S=" << S;
            // Everything written equals the CPU pass (including accepted counts gathered on the
            // device); the poisoned rest stays as it was on both sides.
            EXPECT_EQ(got.plan, cpu.plan) << "G=" << G << " S=" << S;
            EXPECT_EQ(got.spec_out, cpu.spec_out) << "G=" << G << " S=" << S;
            EXPECT_EQ(got.non_spec_out, cpu.non_spec_out) << "G=" << G << " S=" << S;
            // And the per-group shadow check agrees.
            got.with_accepted = true;
            ShadowReport r;
            Params pg = got.params();
            ASSERT_TRUE(shadow_check(pg, &r).is_ok());
            ASSERT_TRUE(r.ok()) << "G=" << G << " S=" << S << ": " << r.message;
          }
}

TEST(MetadataCuda, OutOfRangeColumnsArePaddedAndCountedOnTheDevice) {
  GDN_SKIP_WITHOUT_GPU();
  // S = 16 in align mode with tables exactly as wide as needed for some rows only: the table
  // allocation has no slack (row stride = cols), so a read past the end would leave the buffer.
  Step s = testing::make_step({{16, 15}, {16, 15}, {1, -1}}, 15, /*G=*/2);
  s.mode = CacheMode::kAlign;
  s.block_size = 32;
  s.seq_lens = {40, 20, 200};  // starts 1, 0, 6
  s.make_tables(2, 3, 16, /*extra_stride=*/0);
  s.pad_id = -1;
  s.allocate();
  Params ph = s.params();
  ASSERT_TRUE(plan(ph).is_ok());
  DeviceStep dev(s);
  Params pd = dev.params(s, false);
  ASSERT_TRUE(launch_state_rows_cuda(pd, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  Step got = s;
  download(dev, &got);
  // Per group: request 0 (start 1 + 16 > 16) and the non-spec row (column 6 < 16 is fine).
  EXPECT_EQ(got.error_count, 2);
  for (int g = 0; g < 2; ++g) {
    for (int c = 0; c < 16; ++c) {
      EXPECT_EQ(got.spec_out[size_t((g * s.max_rows + 0) * 16 + c)], -1);
      EXPECT_EQ(got.spec_out[size_t((g * s.max_rows + 1) * 16 + c)], 100000 * (g + 1) + 100 + c);
    }
    EXPECT_EQ(got.non_spec_out[size_t(g * s.max_rows)], 100000 * (g + 1) + 200 + 6);
  }
}

TEST(MetadataCuda, GraphReplayWithNewPlansGivesTheNewRows) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(77);
  // Fixed capacity and tables; each replay refreshes only the plan buffer.
  const int G = 6;
  const int64_t S = 5, R = 32, padded = 24;
  Step base = random_step(rng, G, S, CacheMode::kAlign, true);
  base.max_rows = R;
  base.max_tokens = R * 16;
  base.padded_rows = padded;
  base.make_tables(G, R, 40);
  base.allocate();
  DeviceStep dev(base);
  Params pd = dev.params(base, false);
  pd.launch_rows = padded;

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status st = launch_state_rows_cuda(pd, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(st.is_ok()) << st.reason();
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 1u) << "all groups' state rows must be one launch";
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 6; ++replay) {
    // A new step with N <= padded requests on the same tables and buffers.
    Step s = random_step(rng, G, S, replay % 2 ? CacheMode::kAlign : CacheMode::kNone, true);
    while (s.N() > padded) s = random_step(rng, G, S, CacheMode::kNone, true);
    s.max_rows = R;
    s.max_tokens = R * 16;
    s.padded_rows = padded;
    s.pad_id = base.pad_id;  // like the tables and S, a constant of the captured launch
    s.tables = base.tables;
    s.table_rows = base.table_rows;
    s.table_cols = base.table_cols;
    s.table_stride = base.table_stride;
    s.allocate();
    Params ph = s.params();
    ASSERT_TRUE(plan(ph).is_ok());
    dev.plan->upload(s.plan);
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    Step got = s;
    download(dev, &got);
    ShadowReport r;
    Params pg = got.params();
    ASSERT_TRUE(shadow_check(pg, &r).is_ok());
    ASSERT_TRUE(r.ok()) << "replay " << replay << ": " << r.message;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(MetadataCuda, WholeStepEntryPlansCopiesAndLaunches) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  Step s = random_step(rng, 3, 9, CacheMode::kAlign, true);
  // Pinned host plan buffer, as the entry point expects for an asynchronous copy.
  int32_t* pinned = nullptr;
  CUDA_OK(cudaMallocHost(&pinned, s.plan.size() * 4));
  DeviceStep dev(s);
  Params p = dev.params(s, /*gather_accepted=*/true);  // accepted counts live on the device
  p.plan = TensorView::make(pinned, DType::kInt32, {int64_t(s.plan.size())});
  p.launch_rows = s.padded_rows;
  const TensorView device_plan = device_view(*dev.plan, {int64_t(s.plan.size())});
  const Status st = cuda_api::metadata_step(p, device_plan, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.reason();
  CUDA_OK(cudaDeviceSynchronize());
  Step got = s;
  download(dev, &got);
  ShadowReport r;
  Params pg = got.params();  // host accepted counts for the per-group build
  ASSERT_TRUE(shadow_check(pg, &r).is_ok());
  EXPECT_TRUE(r.ok()) << r.message;
  cudaFreeHost(pinned);
}

TEST(MetadataCuda, DeviceArgumentsAreChecked) {
  GDN_SKIP_WITHOUT_GPU();
  Step s = testing::make_step({{2, 1}}, 1, 2);
  DeviceStep dev(s);
  Params p = dev.params(s, false);
  p.block_tables[1] = s.params().block_tables[1];  // a host table in a device pass
  const Status st = launch_state_rows_cuda(p, nullptr);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.reason().find("block_tables[1] is on cpu"), std::string::npos) << st.reason();
}

}  // namespace
}  // namespace gdn::metadata
