// Metadata state rows on the GPU: the one-launch pass against the CPU pass, the per-group shadow
// check and the tests' own vLLM-semantics reference (destinations, sources, counts) on random
// steps (G 1..6, S up to 16, both modes, with and without padding), accepted counts gathered on
// the device, bounds, the whole-step entry point, a CUDA-graph capture replayed with new plans,
// and replay mode (checkpoints and replay counts, the builder in replay mode, a plan of the other
// mode). Skips with a reason when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gdn/kernels/cuda_api_metadata.hpp"
#include "gdn/metadata/builder.cuh"
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
using testing::vllm_expected;

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
  std::unique_ptr<DeviceVector> plan, spec_out, non_spec_out, non_spec_src_out, checkpoint_out,
      error_count, accepted;

  explicit DeviceStep(const Step& s) {
    for (const auto& t : s.tables) tables.push_back(std::make_unique<DeviceVector>(t));
    plan = std::make_unique<DeviceVector>(s.plan);
    spec_out = std::make_unique<DeviceVector>(s.spec_out);
    non_spec_out = std::make_unique<DeviceVector>(s.non_spec_out);
    non_spec_src_out = std::make_unique<DeviceVector>(s.non_spec_src_out);
    checkpoint_out = std::make_unique<DeviceVector>(s.checkpoint_out);
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
    if (s.with_source)
      p.non_spec_source_indices = device_view(*non_spec_src_out, {int64_t(s.G()), s.max_rows});
    if (s.replay) p.checkpoint_indices = device_view(*checkpoint_out, {int64_t(s.G()), s.max_rows});
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
  s->non_spec_src_out = d.non_spec_src_out->to_host();
  s->checkpoint_out = d.checkpoint_out->to_host();
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
            EXPECT_EQ(got.non_spec_src_out, cpu.non_spec_src_out) << "G=" << G << " S=" << S;
            // And the per-group shadow check agrees.
            got.with_accepted = true;
            ShadowReport r;
            Params pg = got.params();
            ASSERT_TRUE(shadow_check(pg, &r).is_ok());
            ASSERT_TRUE(r.ok()) << "G=" << G << " S=" << S << ": " << r.message;
          }
}

// The tests' own vLLM-semantics reference (metadata_case.hpp) against the device pass, outputs
// poisoned beforehand, accepted counts from the plan or gathered on the device.
TEST(MetadataCuda, DevicePassMatchesTheVllmReference) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(555);
  for (int rep = 0; rep < 120; ++rep) {
    const int G = 1 + rep % 6;
    const int64_t S = 1 + (rep / 6) % 9;
    const bool gather = rep % 2;
    Step s = random_step(rng, G, S, rep % 3 ? CacheMode::kNone : CacheMode::kAlign, rep % 4 < 2);
    const testing::VllmExpected e = vllm_expected(s);
    Step host = s;
    if (gather) host.with_accepted = false;  // the plan leaves them to the device pass
    Params ph = host.params();
    ASSERT_TRUE(plan(ph).is_ok());
    DeviceStep dev(host);
    dev.plan->upload(host.plan);
    Params pd = dev.params(host, gather);
    ASSERT_TRUE(launch_state_rows_cuda(pd, nullptr).is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    Step got = host;
    download(dev, &got);
    EXPECT_EQ(got.header(kNumDecodes), e.num_decodes) << rep;
    EXPECT_EQ(got.header(kNumDecodeTokens), e.num_decode_tokens) << rep;
    EXPECT_EQ(got.header(kNumPrefills), e.num_prefills) << rep;
    EXPECT_EQ(got.header(kNumPrefillTokens), e.num_prefill_tokens) << rep;
    EXPECT_EQ(got.error_count, e.unreadable) << rep;
    const int64_t R = s.max_rows;
    for (int g = 0; g < G; ++g)
      for (int64_t j = 0; j < R; ++j) {
        const size_t k = size_t(g * R + j);
        const bool written = j < e.rows_written;
        ASSERT_EQ(got.non_spec_out[k], written ? e.destination[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
        ASSERT_EQ(got.non_spec_src_out[k], written ? e.source[size_t(g)][size_t(j)] : kPoison)
            << rep << " group " << g << " row " << j;
      }
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

// ---- the C++ builder (builder.hpp + builder.cuh) on the GPU
// --------------------------------------

#define GDN_OK(expr)                                           \
  do {                                                         \
    const ::gdn::Status st_ = (expr);                          \
    ASSERT_TRUE(st_.is_ok()) << #expr << ": " << st_.reason(); \
  } while (0)

// Device copies of a base step's tables, and a builder configuration over them.
struct DeviceTables {
  std::vector<std::unique_ptr<DeviceVector>> tables;
  explicit DeviceTables(const Step& base) {
    for (const auto& t : base.tables) tables.push_back(std::make_unique<DeviceVector>(t));
  }
  BuilderConfig config(Step& base) const {
    BuilderConfig c = base.config();
    for (int g = 0; g < base.G(); ++g)
      c.block_tables[g] =
          device_view(*tables[size_t(g)], {base.table_rows[size_t(g)], base.table_cols[size_t(g)]},
                      {base.table_stride[size_t(g)], 1});
    return c;
  }
};

std::vector<int32_t> to_host_vector(const TensorView& v) {
  std::vector<int32_t> h(size_t(v.numel()));
  if (!h.empty()) cudaMemcpy(h.data(), v.data, h.size() * 4, cudaMemcpyDeviceToHost);
  return h;
}

// The builder's device buffers after a step against the tests' own vLLM reference of `s`.
void expect_device_builder_matches(const Builder& b, Step& s, const std::string& where) {
  const testing::VllmExpected e = vllm_expected(s);
  const int32_t* h = b.host_plan(b.last_slot()) + b.layout().header;
  EXPECT_EQ(h[kNumDecodes], e.num_decodes) << where;
  EXPECT_EQ(h[kNumPrefills], e.num_prefills) << where;
  EXPECT_EQ(h[kNumPrefillTokens], e.num_prefill_tokens) << where;
  const std::vector<int32_t> dst = to_host_vector(b.buffers().non_spec_state_indices);
  const std::vector<int32_t> src = to_host_vector(b.buffers().non_spec_source_indices);
  const std::vector<int32_t> spec = to_host_vector(b.buffers().spec_state_indices);
  const int64_t R = s.max_rows, S = s.S();
  for (int g = 0; g < s.G(); ++g) {
    for (int64_t j = 0; j < e.rows_written; ++j) {
      ASSERT_EQ(dst[size_t(g * R + j)], e.destination[size_t(g)][size_t(j)])
          << where << " group " << g << " row " << j;
      ASSERT_EQ(src[size_t(g * R + j)], e.source[size_t(g)][size_t(j)])
          << where << " group " << g << " row " << j;
    }
    for (int64_t k = 0; k < e.spec_rows_written * S; ++k)
      ASSERT_EQ(spec[size_t(g * R * S + k)], e.spec[size_t(g)][size_t(k)])
          << where << " group " << g << " element " << k;
  }
  if (!s.replay) return;
  const std::vector<int32_t> ck = to_host_vector(b.buffers().checkpoint_indices);
  const std::vector<int32_t> plan = to_host_vector(b.buffers().device_plan);
  const Layout& l = b.layout();
  for (int g = 0; g < s.G(); ++g)
    for (int64_t j = 0; j < e.spec_rows_written; ++j)
      ASSERT_EQ(ck[size_t(g * R + j)], e.checkpoint[size_t(g)][size_t(j)])
          << where << " group " << g << " row " << j;
  EXPECT_EQ(std::vector<int32_t>(plan.begin() + l.replay_counts,
                                 plan.begin() + l.replay_counts + e.spec_rows_written),
            e.replay_counts)
      << where;
  EXPECT_EQ(std::vector<int32_t>(plan.begin() + l.non_spec_replay_counts,
                                 plan.begin() + l.non_spec_replay_counts + e.rows_written),
            e.non_spec_replay_counts)
      << where;
}

TEST(MetadataBuilderCuda, StepsMatchTheReferenceForEveryOpsTableAndStaging) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(91);
  const DeviceOps* tables_of_ops[] = {&cuda_builder_ops(), &cuda_api::metadata_builder_ops()};
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int run = 0;
  for (const DeviceOps* ops : tables_of_ops)
    for (int staging : {0, 1, 2}) {  // pinned ring of 2, pinned single buffer, pageable
      Step base = random_step(rng, 1 + run % 6, 2 + run % 5,
                              run % 2 ? CacheMode::kAlign : CacheMode::kNone, false);
      base.max_rows = 48;
      base.max_tokens = 48 * 20;
      base.make_tables(base.G(), 48, base.mode == CacheMode::kNone ? base.S() + 1 : base.S() + 6);
      base.allocate();
      const DeviceTables dev(base);
      BuilderConfig c = dev.config(base);
      c.staging_slots = staging == 0 ? 2 : 1;
      c.pinned_staging = staging != 2;
      c.shadow = run % 2 == 0;
      Builder b;
      GDN_OK(b.initialize(c, ops));
      ASSERT_TRUE(b.is_cuda());
      for (int k = 0; k < 12; ++k) {
        Step s = random_step_on(rng, base, k % 2);
        GDN_OK(b.step(s.inputs(), stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        expect_device_builder_matches(b, s,
                                      "run " + std::to_string(run) + " step " + std::to_string(k));
      }
      // Back-to-back steps (host buffers reused while earlier copies may be pending): the last
      // one's rows are what the buffers hold.
      Step last;
      for (int k = 0; k < 16; ++k) {
        last = random_step_on(rng, base, true);
        GDN_OK(b.step(last.inputs(), stream));
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      expect_device_builder_matches(b, last, "run " + std::to_string(run) + " back to back");
      ShadowReport r;
      GDN_OK(b.check(last.inputs(), stream, &r));
      EXPECT_TRUE(r.ok()) << r.message;
      ++run;
    }
  cudaStreamDestroy(stream);
}

TEST(MetadataBuilderCuda, DeviceAcceptedCountsAreGatheredByTheLaunch) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(92);
  Step base = random_step(rng, 4, 5, CacheMode::kAlign, false);
  base.max_rows = 40;
  base.max_tokens = 40 * 20;
  base.make_tables(4, 40, 12);
  base.allocate();
  const DeviceTables dev(base);
  Builder b;
  GDN_OK(b.initialize(dev.config(base), &cuda_api::metadata_builder_ops()));
  for (int k = 0; k < 10; ++k) {
    Step s = random_step_on(rng, base, k % 2);
    DeviceVector acc(s.num_accepted_tokens);
    StepInputs in = s.inputs();
    in.num_accepted_tokens = device_view(acc, {int64_t(acc.n)});
    GDN_OK(b.step(in, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    expect_device_builder_matches(b, s, "step " + std::to_string(k));
    ShadowReport r;
    GDN_OK(b.check(in, nullptr, &r));  // copies the device counts to compare
    EXPECT_TRUE(r.ok()) << r.message;
  }
}

TEST(MetadataBuilderCuda, CapturedLaunchReplaysPreparedSteps) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(93);
  const int64_t B = 24;
  Step base = random_step(rng, 6, 5, CacheMode::kNone, false);
  base.max_rows = 32;
  base.max_tokens = 32 * 16;
  base.make_tables(6, 32, 7);
  base.allocate();
  const DeviceTables dev(base);
  Builder b;
  GDN_OK(b.initialize(dev.config(base), &cuda_builder_ops()));
  DeviceVector acc(std::vector<int32_t>(size_t(B), 1));
  const TensorView acc_view = device_view(acc, {B});
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Step first = random_step_on(rng, base, true);
  while (first.N() > B) first = random_step_on(rng, base, true);
  first.padded_rows = B;
  GDN_OK(b.prepare(first.inputs(), stream));
  GDN_OK(b.launch(B, acc_view, stream));  // outside the capture first
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status st = b.launch(B, acc_view, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  GDN_OK(st);
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 1u) << "the captured state rows must be one launch";
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 8; ++replay) {
    Step s = random_step_on(rng, base, true);
    while (s.N() > B) s = random_step_on(rng, base, true);
    s.padded_rows = B;
    s.num_accepted_tokens.resize(size_t(B), 1);
    acc.upload(s.num_accepted_tokens);
    s.num_accepted_tokens.resize(size_t(s.N()));
    StepInputs in = s.inputs();
    in.num_accepted_tokens = TensorView{};  // gathered by the captured launch
    GDN_OK(b.prepare(in, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    expect_device_builder_matches(b, s, "replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(MetadataBuilderCuda, CallerProvidedBuffersAndErrors) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(94);
  Step s = random_step(rng, 3, 4, CacheMode::kAlign, true);
  DeviceStep d(s);
  int32_t* pinned[2] = {};
  for (auto& p : pinned) CUDA_OK(cudaMallocHost(&p, s.plan.size() * 4));
  Params dp = d.params(s, false);
  BuilderConfig c = s.config();
  for (int g = 0; g < s.G(); ++g) c.block_tables[g] = dp.block_tables[g];
  BuilderBuffers buf;
  buf.spec_state_indices = dp.spec_state_indices;
  buf.non_spec_state_indices = dp.non_spec_state_indices;
  buf.non_spec_source_indices = dp.non_spec_source_indices;
  buf.error_count = dp.error_count;
  buf.device_plan = dp.plan;
  buf.num_host_plans = 2;
  for (int k = 0; k < 2; ++k)
    buf.host_plans[k] = TensorView::make(pinned[k], DType::kInt32, {int64_t(s.plan.size())});
  auto owner = std::make_unique<Builder>();  // freed before the pinned buffers it uses
  Builder& b = *owner;
  EXPECT_NE(b.initialize(c, buf).reason().find("needs the CUDA operations"), std::string::npos);
  GDN_OK(b.initialize(c, buf, &cuda_builder_ops()));
  GDN_OK(b.step(s.inputs(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_builder_matches(b, s, "caller buffers");
  Step got = s;
  download(d, &got);
  EXPECT_EQ(got.error_count, vllm_expected(s).unreadable);
  // A device accepted-count array on the host side of launch() is refused, naming it.
  EXPECT_NE(b.launch(0, s.inputs().num_accepted_tokens, nullptr)
                .reason()
                .find("num_accepted_tokens of launch() must be on the builder's CUDA device"),
            std::string::npos);
  owner.reset();
  for (auto& p : pinned) cudaFreeHost(p);
}

// ---- replay mode ------------------------------------------------------------------------------

TEST(MetadataCuda, ReplayOneLaunchMatchesTheCpuPassAndTheReference) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4242);
  int checked = 0;
  for (int G = 1; G <= 6; ++G)
    for (int64_t S : {1, 2, 4, 9, 16})
      for (bool padded : {false, true})
        for (bool gather : {false, true}) {
          Step host = random_step(rng, G, S, CacheMode::kNone, padded, /*replay=*/true);
          const testing::VllmExpected e = vllm_expected(host);
          if (gather) host.with_accepted = false;  // the device pass gathers the replay counts
          Step cpu = host;
          Params pc = cpu.params();
          ASSERT_TRUE(plan(pc).is_ok());
          DeviceStep dev(host);  // poisoned outputs
          dev.plan->upload(cpu.plan);
          if (gather)
            pc.num_accepted_tokens = TensorView::make(cpu.num_accepted_tokens.data(), DType::kInt32,
                                                      {int64_t(cpu.num_accepted_tokens.size())});
          int64_t cpu_errors = 0;
          ASSERT_TRUE(run_state_rows_cpu(pc, &cpu_errors).is_ok());
          Params pd = dev.params(host, gather);
          ASSERT_TRUE(launch_state_rows_cuda(pd, nullptr).is_ok());
          CUDA_OK(cudaDeviceSynchronize());
          Step got = host;
          download(dev, &got);
          const std::string where = "G=" + std::to_string(G) + " S=" + std::to_string(S);
          EXPECT_EQ(got.error_count, cpu_errors) << where;
          EXPECT_EQ(got.error_count, e.unreadable) << where;
          EXPECT_EQ(got.plan, cpu.plan) << where;
          EXPECT_EQ(got.spec_out, cpu.spec_out) << where;
          EXPECT_EQ(got.checkpoint_out, cpu.checkpoint_out) << where;
          EXPECT_EQ(got.non_spec_out, cpu.non_spec_out) << where;
          EXPECT_EQ(got.non_spec_src_out, cpu.non_spec_src_out) << where;
          const int64_t R = host.max_rows;
          for (int g = 0; g < G; ++g)
            for (int64_t j = 0; j < R; ++j)
              ASSERT_EQ(got.checkpoint_out[size_t(g * R + j)],
                        j < e.spec_rows_written ? e.checkpoint[size_t(g)][size_t(j)] : kPoison)
                  << where << " group " << g << " row " << j;
          got.with_accepted = true;
          ShadowReport r;
          Params pg = got.params();
          ASSERT_TRUE(shadow_check(pg, &r).is_ok());
          ASSERT_TRUE(r.ok()) << where << ": " << r.message;
          ++checked;
        }
  EXPECT_EQ(checked, 6 * 5 * 2 * 2);
}

TEST(MetadataCuda, APlanOfTheOtherModeIsPaddedAndCountedOnTheDevice) {
  GDN_SKIP_WITHOUT_GPU();
  Step s = testing::make_step({{3, 2}, {1, -1}, {3, 2}}, 2, /*G=*/2);
  s.padded_rows = 4;
  s.pad_id = -1;
  s.allocate();
  Params ph = s.params();
  ASSERT_TRUE(plan(ph).is_ok());  // planned without replay
  Step t = s;
  t.replay = true;  // a replay-mode pass
  DeviceStep dev(t);
  dev.plan->upload(s.plan);
  Params pd = dev.params(t, false);
  ASSERT_TRUE(launch_state_rows_cuda(pd, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  Step got = t;
  download(dev, &got);
  EXPECT_EQ(got.error_count, 1);
  const int64_t R = s.max_rows;
  for (int g = 0; g < 2; ++g)
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT_EQ(got.checkpoint_out[size_t(g * R + j)], -1);
      EXPECT_EQ(got.non_spec_out[size_t(g * R + j)], -1);
      for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(got.spec_out[size_t((g * R + j) * 3 + c)], -1);
    }
}

TEST(MetadataBuilderCuda, ReplayStepsAndACapturedLaunchMatchTheReference) {
  GDN_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(95);
  const int G = 4;
  const int64_t S = 4, B = 24;
  Step base = random_step(rng, G, S, CacheMode::kNone, false, /*replay=*/true);
  base.max_rows = 32;
  base.max_tokens = 32 * 16;
  base.make_tables(G, 32, 1);  // one checkpoint slot per request
  base.allocate();
  const DeviceTables dev(base);
  BuilderConfig c = dev.config(base);
  ASSERT_TRUE(c.replay);
  c.shadow = true;
  Builder b;
  GDN_OK(b.initialize(c, &cuda_api::metadata_builder_ops()));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Eager steps, replay counts on the host or gathered from the device.
  for (int k = 0; k < 10; ++k) {
    Step s = random_step_on(rng, base, k % 2);
    DeviceVector n(s.num_accepted_tokens);
    StepInputs in = s.inputs();
    if (k % 3 == 0) in.num_accepted_tokens = device_view(n, {int64_t(n.n)});
    GDN_OK(b.step(in, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    expect_device_builder_matches(b, s, "replay step " + std::to_string(k));
  }
  // A captured launch replayed after prepare(), the replay counts gathered on the device.
  c.shadow = false;
  Builder captured;
  GDN_OK(captured.initialize(c, &cuda_builder_ops()));
  DeviceVector counts(std::vector<int32_t>(size_t(B), 0));
  const TensorView counts_view = device_view(counts, {B});
  Step first = random_step_on(rng, base, true);
  while (first.N() > B) first = random_step_on(rng, base, true);
  first.padded_rows = B;
  GDN_OK(captured.prepare(first.inputs(), stream));
  GDN_OK(captured.launch(B, counts_view, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status st = captured.launch(B, counts_view, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  GDN_OK(st);
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 1u) << "the captured state rows must be one launch";
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 6; ++replay) {
    Step s = random_step_on(rng, base, true);
    while (s.N() > B) s = random_step_on(rng, base, true);
    s.padded_rows = B;
    s.num_accepted_tokens.resize(size_t(B), 0);
    counts.upload(s.num_accepted_tokens);
    s.num_accepted_tokens.resize(size_t(s.N()));
    StepInputs in = s.inputs();
    in.num_accepted_tokens = TensorView{};  // gathered by the captured launch
    GDN_OK(captured.prepare(in, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    expect_device_builder_matches(captured, s, "captured replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace gdn::metadata
