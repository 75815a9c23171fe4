// Replay verify on CUDA: chains against write-every-token decode_mtp and one-token-at-a-time
// decoding run on the GPU (to within 1e-5 relative L2 with an fp32 state: the replay kernel holds
// the state in another lane layout) and the float64 reference, as the CPU chains are; every head
// split gives the same bits; eight value heads per key head over many CTAs
// (no window row is overwritten while another CTA replays it); invalid device-side rows store
// nothing, zero their outputs and are counted. Skips (with the reason) without a usable GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device_mirror.hpp"
#include "gdn/decode_mtp/cuda.cuh"
#include "gdn/replay/cuda.cuh"
#include "gpu_skip.hpp"
#include "replay_chain.hpp"

namespace gdn::testing {
namespace {

int g_split = 0;  // CTAs per value head of the replay launches (0: chosen by the launcher)

std::vector<TensorView*> step_views(decode_mtp::StepArgs& p) {
  return {&p.mixed_qkv,   &p.a,     &p.b,          &p.A_log, &p.dt_bias,    &p.z,
          &p.norm_weight, &p.state, &p.cu_seqlens, &p.out,   &p.error_count};
}

Status gpu_replay(const replay::Params& host) {
  replay::Params p = host;
  std::vector<TensorView*> views = step_views(p);
  for (TensorView* v : {&p.state_indices, &p.num_accepted_tokens, &p.window_k, &p.window_v,
                        &p.window_a, &p.window_b, &p.window_len})
    views.push_back(v);
  return run_mirrored(views, [&] { return replay::launch_cuda(p, nullptr, g_split); });
}

Status gpu_decode(const decode_mtp::Params& host) {
  decode_mtp::Params p = host;
  std::vector<TensorView*> views = step_views(p);
  views.push_back(&p.state_indices);
  views.push_back(&p.num_accepted_tokens);
  return run_mirrored(views, [&] { return decode_mtp::launch_cuda(p, nullptr); });
}

const Runner kGpu{gpu_replay, gpu_decode, /*bitwise=*/false};

ReplayConfig gpu_config(int64_t H, int64_t ratio, StateLayout layout, uint32_t seed) {
  ReplayConfig c;
  c.H = H;
  c.ratio = ratio;
  c.K = c.V = 128;  // the CUDA kernel's head dim
  c.layout = layout;
  c.seed = seed;
  return c;
}

class ReplayCudaChain : public ::testing::TestWithParam<ChainParam> {};

TEST_P(ReplayCudaChain, EqualsWriteEveryTokenAndSequentialDecoding) {
  GDN_SKIP_WITHOUT_GPU();
  g_split = 0;
  run_chain_bit_for_bit(GetParam(), kGpu);
}

std::vector<ChainParam> gpu_chain_params() {
  const StateLayout vk = StateLayout::kVK, kv = StateLayout::kKV;
  std::vector<ChainParam> out;
  out.push_back({"r1_vk", gpu_config(2, 1, vk, 111), 24});
  out.push_back({"r2_vk", gpu_config(2, 2, vk, 121), 24});
  out.push_back({"r2_kv_slow_path", gpu_config(1, 2, kv, 122), 16});
  out.push_back({"r5_runtime_ratio", gpu_config(1, 5, vk, 151), 16});
  // Eight value heads per key head, many requests: 8 CTAs (x split) replay each stored k row.
  ReplayConfig c = gpu_config(2, 8, vk, 181);
  c.N = 6;
  out.push_back({"r8_many_ctas_per_key_head", c, 16});
  c = gpu_config(2, 2, vk, 161);
  c.fused_windows = false;
  c.first_valid_slot = 1;
  c.gate = GateActivation::kSigmoid;
  c.S = 6;
  out.push_back({"r2_separate_windows_null_block0_S6", c, 16});
  c = gpu_config(2, 3, vk, 171);
  c.act_dtype = DType::kBFloat16;
  out.push_back({"r3_bf16_activations", c, 16});
  // Enough heads (N x HV = 640) for the launcher's large-batch choices on an H200 (>= 4 heads per
  // SM: one fp32 chunk buffer for replay, three for write-all).
  c = gpu_config(4, 8, vk, 191);
  c.N = 20;
  out.push_back({"r8_large_batch", c, 6});
  // Deep windows: the kernel's closed form (use_closed_form in decode_mtp/cuda_launch_rules.hpp),
  // at S = 8 (its solve in registers) and S = 12 (windows of up to 24 tokens: the solve through
  // shared memory, more tokens than solve_in_registers holds).
  const auto closed_form = [&](const char* name_s8, const char* name_s12, uint32_t seed, int N,
                               int steps) {
    ReplayConfig cf = gpu_config(4, 8, vk, seed);
    cf.N = N;
    cf.S = 8;
    out.push_back({name_s8, cf, steps});
    cf.S = 12;
    out.push_back({name_s12, cf, steps});
  };
  closed_form("r8_large_batch_closed_form", "r8_large_batch_closed_form_S12", 201, 20, 6);
  // Short chains (N x HV = 288 heads, two per SM of an H200, from where an fp32 state takes the
  // closed form) that racecheck can run in its time (benchmarks/gpu_check.sh): the per-CTA
  // solve's shared arrays.
  closed_form("r8_closed_form_3_steps", "r8_closed_form_S12_3_steps", 211, 9, 3);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Chains, ReplayCudaChain, ::testing::ValuesIn(gpu_chain_params()),
                         [](const ::testing::TestParamInfo<ChainParam>& info) {
                           return std::string(info.param.name);
                         });

// The same chain with every head split: identical checkpoints, windows and outputs.
TEST(ReplayCuda, SplitsAgreeBitForBit) {
  GDN_SKIP_WITHOUT_GPU();
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (major < 9) GTEST_SKIP() << "head splitting needs thread-block clusters (sm_90+)";
  ReplayConfig cfg = gpu_config(2, 2, StateLayout::kVK, 191);
  std::vector<HostArray> states, outs;
  std::vector<std::vector<int32_t>> lens;
  for (int split : {1, 2, 4, 8}) {
    g_split = split;
    Chain ch(cfg, kGpu);
    for (int step = 0; step < 8; ++step) {
      ch.draw();
      const Status s = ch.run_replay();
      ASSERT_TRUE(s.is_ok()) << "split " << split << ": " << s.reason();
      ch.commit();
    }
    states.push_back(ch.rc.state);
    outs.push_back(ch.batch.out);
    lens.push_back(ch.rc.window_len);
  }
  g_split = 0;
  for (size_t i = 1; i < states.size(); ++i) {
    EXPECT_TRUE(states[i].bytes == states[0].bytes) << "checkpoints, split index " << i;
    EXPECT_TRUE(outs[i].bytes == outs[0].bytes) << "outputs, split index " << i;
    EXPECT_EQ(lens[i], lens[0]);
  }
}

// Device-side invalid rows: the row stores nothing (checkpoint, window, window_len), its outputs
// are zero and error_count counts it once; the other rows run as usual.
TEST(ReplayCuda, InvalidRowsAreIsolated) {
  GDN_SKIP_WITHOUT_GPU();
  g_split = 0;
  struct Bad {
    const char* what;
    void (*mutate)(Chain&);
  };
  const Bad cases[] = {
      {"n > window_len", [](Chain& ch) { ch.n[1] = ch.pending[1] + 1; }},
      {"n < 0", [](Chain& ch) { ch.n[1] = -1; }},
      {"slot >= slots", [](Chain& ch) { ch.slot_ids[1] = int32_t(ch.rc.slots + 3); }},
      {"T > S",
       [](Chain& ch) {
         while (ch.T(1) <= ch.rc.cfg.S) ch.tokens[1].push_back(ch.rc.random_token());
         ch.batch = ch.rc.batch(ch.tokens);
       }},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    ReplayConfig cfg = gpu_config(1, 2, StateLayout::kVK, 201);
    cfg.N = 3;
    cfg.S = 3;
    Chain ch(cfg, kGpu);
    ch.tokens.assign(3, {});
    ch.n.assign(3, 0);
    for (auto& list : ch.tokens)
      for (int t = 0; t < 2; ++t) list.push_back(ch.rc.random_token());
    ch.batch = ch.rc.batch(ch.tokens);
    ASSERT_TRUE(ch.run_replay().is_ok());
    ch.commit();
    ch.draw();
    for (int64_t i = 0; i < 3; ++i)
      if (ch.T(i) == 0) ch.tokens[size_t(i)].push_back(ch.rc.random_token());
    ch.n = {1, 1, 2};
    ch.batch = ch.rc.batch(ch.tokens);
    bad.mutate(ch);
    const ReplayCase before = ch.rc;
    int32_t errors = 0;
    replay::Params p = ch.rc.replay_params(ch.batch, ch.slot_ids, ch.n);
    p.error_count = TensorView::make(&errors, DType::kInt32, {1});
    const Status s = gpu_replay(p);
    ASSERT_TRUE(s.is_ok()) << s.reason();
    EXPECT_EQ(errors, 1);
    for (int64_t e = ch.begin(1) * ch.rc.HVV; e < (ch.begin(1) + ch.T(1)) * ch.rc.HVV; ++e)
      ASSERT_EQ(ch.batch.out.get(e), 0.0f) << "output element " << e;
    for (int64_t s2 = 0; s2 < ch.rc.slots; ++s2) {
      const bool live = s2 == ch.slot_ids[0] || s2 == ch.slot_ids[2];
      if (live) continue;  // the good rows' slots change as usual
      EXPECT_TRUE(same_bytes(ch.rc.slot_ptr(ch.rc.state, s2), ch.rc.slot_ptr(before.state, s2),
                             ch.rc.slot_stride * dtype_size(cfg.state_dtype)))
          << "slot " << s2;
      EXPECT_EQ(ch.rc.window_len[size_t(s2)], before.window_len[size_t(s2)]) << "slot " << s2;
      EXPECT_TRUE(ch.rc.window_bytes(s2) == before.window_bytes(s2)) << "window of slot " << s2;
    }
    for (int64_t i : {0, 2}) {
      EXPECT_EQ(ch.rc.window_len[size_t(ch.slot_ids[size_t(i)])], ch.T(i));
      for (int64_t e = ch.begin(i) * ch.rc.HVV; e < (ch.begin(i) + ch.T(i)) * ch.rc.HVV; ++e)
        ASSERT_FALSE(std::isnan(ch.batch.out.get(e))) << "row " << i;
    }
  }
}

}  // namespace
}  // namespace gdn::testing
