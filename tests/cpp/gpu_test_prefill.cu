// prefill on CUDA (the chunked tensor-core kernel) against the float64 token-by-token reference
// and against the CPU path, on fresh random inputs with poisoned outputs: chunk edges (1, 63, 64,
// 65, 127, 128, 129 tokens and long ones), null initial and final slots, in place, checkpoints,
// every head ratio and state dtype, both layouts, padded rows, strided inputs, bf16 activations,
// weak decay (a long memory), every output variant, device-side invalid rows (nothing stored,
// zero outputs, counted), a caller's workspace, and rows whose chunk slots collide under a broken
// cu_seqlens. The kernel's products use bf16 operands with fp32 accumulation, so it is
// held to a relative L2 error, not to the CPU path's bits. Skips (with the reason) without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "device_mirror.hpp"
#include "gdn/kernels/cuda_api_prefill.hpp"
#include "gdn/prefill/cpu.hpp"
#include "gdn/prefill/cuda_kernel.cuh"
#include "gpu_skip.hpp"
#include "prefill_case.hpp"

namespace gdn::prefill {
namespace {

using namespace testing;

// f(p) with p's arrays mirrored on the GPU.
template <class F>
Status on_gpu(const Params& host, F&& f) {
  Params p = host;
  std::vector<TensorView*> views = {&p.mixed_qkv,
                                    &p.a,
                                    &p.b,
                                    &p.A_log,
                                    &p.dt_bias,
                                    &p.z,
                                    &p.norm_weight,
                                    &p.state,
                                    &p.cu_seqlens,
                                    &p.out,
                                    &p.error_count,
                                    &p.initial_state_indices,
                                    &p.final_state_indices,
                                    &p.checkpoint_indices,
                                    &p.workspace};
  return gdn::testing::run_mirrored(views, [&] { return f(p); });
}

Status gpu_prefill(const Params& host, StatePass pass = StatePass::kAuto) {
  return on_gpu(host, [&](const Params& p) { return cuda_api::prefill(p, nullptr, pass); });
}

const Runner kGpu = [](const Params& p) { return gpu_prefill(p); };

// The state passes a call can take (the small cases here choose the recurrence on their own).
constexpr StatePass kPasses[] = {StatePass::kOnePass, StatePass::kRecurrence, StatePass::kFused};
// The fused kernel's shared memory does not fit every device (Hopper holds it, an A100 does not):
// there the launcher never takes it, and the tests do not pin it.
bool runs_here(StatePass pass) {
  if (pass != StatePass::kFused) return true;
  int optin = 0;
  return cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0) ==
             cudaSuccess &&
         optin >= cuda_detail::kFusedSharedBytes<__nv_bfloat16>;
}
const char* pass_name(StatePass pass) {
  return pass == StatePass::kOnePass ? "one pass"
         : pass == StatePass::kFused ? "fused"
                                     : "recurrence";
}

// The CUDA kernel's head dims; two key heads.
CaseConfig gpu_config(std::vector<int64_t> T, int64_t ratio = 2, DType state = DType::kFloat32,
                      StateLayout layout = StateLayout::kVK, uint32_t seed = 1) {
  CaseConfig g = config(std::move(T), ratio, state, layout, seed);
  g.K = g.V = 128;
  g.H = 1;
  return g;
}

// Weak decay (A = -0.01 per unit of softplus): the state remembers hundreds of tokens, so an
// error carried across chunks would grow instead of fading. The other cases' rows are 5 elements
// longer than a token (unaligned rows); the weak-decay case's are whole 16-byte groups.
void long_memory(PrefillCase& pc) {
  for (int64_t hv = 0; hv < pc.c.HV; ++hv) pc.c.A_log.set(hv, std::log(0.01f));
}

TEST(PrefillCuda, ChunkEdgesRatiosDtypesAndLayoutsMatchTheReference) {
  GDN_SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  for (const int64_t ratio : {1, 2, 3, 4, 8, 5})
    for (const DType state : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
      for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
        PrefillCase pc(gpu_config({1, 63, 0, 64, 65, 127, 128, 129}, ratio, state, layout, seed++),
                       {0, 1, 2, -1, 4, 5, 6, 7}, {0, 11, 12, 13, 14, 15, 16, 17});
        SCOPED_TRACE(::testing::Message() << "ratio " << ratio << " state " << to_string(state)
                                          << (layout == StateLayout::kVK ? " vk" : " kv"));
        expect_matches_reference(pc, 2e-2, kGpu);
      }
}

// Each state pass pinned: the one-pass kernel, the recurrence with the output kernel and the fused
// kernel (which the launcher takes for many heads in long requests), on chunk edges, null slots, in
// place, checkpoints, a long request and both layouts; with bf16 state, bf16 activations in rows of
// whole 16-byte groups (the fused kernel stages them with cp.async), else fp32 ones in unaligned
// rows.
TEST(PrefillCuda, EveryStatePassMatchesTheReference) {
  GDN_SKIP_WITHOUT_GPU();
  uint32_t seed = 40;
  for (const StatePass pass : kPasses) {
    if (!runs_here(pass)) continue;
    const Runner run = [pass](const Params& p) { return gpu_prefill(p, pass); };
    for (const int64_t ratio : {1, 4})
      for (const DType state : {DType::kFloat32, DType::kBFloat16})
        for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
          CaseConfig g =
              gpu_config({1, 63, 0, 64, 65, 127, 128, 129, 700}, ratio, state, layout, seed++);
          if (state == DType::kBFloat16) {
            g.act_dtype = g.out_dtype = DType::kBFloat16;
            g.qkv_row_pad = 8;
          }
          PrefillCase pc(g, {0, 1, 2, -1, 4, 5, 6, 7, 8}, {0, 11, 12, 13, 14, 15, 16, 17, 8}, 128,
                         5);
          pc.checkpoints[size_t(5 * 5)] = 18;  // 127 tokens: never reached
          pc.checkpoints[size_t(6 * 5)] = 19;  // 128 tokens: after the last
          pc.checkpoints[size_t(8 * 5 + 2)] = 20;
          pc.checkpoints[size_t(8 * 5 + 4)] = 21;
          SCOPED_TRACE(::testing::Message()
                       << pass_name(pass) << " ratio " << ratio << " state " << to_string(state)
                       << (layout == StateLayout::kVK ? " vk" : " kv"));
          expect_matches_reference(pc, 2e-2, run);
        }
  }
}

TEST(PrefillCuda, LongRequestsWithWeakDecayInPlace) {
  GDN_SKIP_WITHOUT_GPU();
  for (const DType act : {DType::kFloat32, DType::kBFloat16}) {
    CaseConfig g = gpu_config({2000, 700, 3}, 2, DType::kFloat32, StateLayout::kVK, 7);
    g.act_dtype = act;
    g.out_dtype = act;  // on CUDA, mixed_qkv, z and out share one dtype
    g.qkv_row_pad = 8;  // rows of whole 16-byte groups
    PrefillCase pc(g, {4, -1, 6}, {4, 9, 6});
    long_memory(pc);
    SCOPED_TRACE(to_string(act));
    expect_matches_reference(pc, 2e-2, kGpu);
  }
}

TEST(PrefillCuda, CheckpointsEveryETokensAndNullSlots) {
  GDN_SKIP_WITHOUT_GPU();
  PrefillCase pc(gpu_config({200, 128, 40, 64, 300}), {3, -1, 5, 6, 1}, {20, 21, -1, 23, 2}, 64, 4);
  pc.checkpoints = {7, 8, 9, -1, 10, -1, -1, -1, -1, -1, -1, -1, 17, -1, -1, -1, 18, -1, 19, 22};
  long_memory(pc);
  expect_matches_reference(pc, 2e-2, kGpu);
  PrefillCase wide(gpu_config({300}, 1, DType::kBFloat16, StateLayout::kKV, 3), {1}, {1}, 128, 2);
  wide.checkpoints = {5, 6};
  expect_matches_reference(wide, 2e-2, kGpu);
}

// Every 64-token block edge and a long request in one call, with a checkpoint at every reached
// boundary in distinct slots, ratio 1, fp32 "kv" pool.
TEST(PrefillCuda, BlockEdgesAndALongRequestWithEveryCheckpoint) {
  GDN_SKIP_WITHOUT_GPU();
  CaseConfig g =
      gpu_config({1, 63, 0, 64, 65, 127, 128, 129, 700}, 1, DType::kFloat32, StateLayout::kKV, 21);
  g.slots = 48;
  PrefillCase pc(g, {0, 1, 2, 3, 4, 5, 6, 7, -1}, {9, 10, 11, 12, 13, 14, 15, 16, 17}, 64, 11);
  int32_t next = 18;  // slots 18.. hold the checkpoints, one each
  for (int64_t i = 0; i < pc.c.N; ++i)
    for (int64_t j = 0; j < (pc.c.cu[size_t(i + 1)] - pc.c.cu[size_t(i)]) / 64; ++j)
      pc.checkpoints[size_t(i * 11 + j)] = next++;
  ASSERT_LE(next, 48);
  expect_matches_reference(pc, 2e-2, kGpu);
}

// Output and input variants against the CPU path (itself bit-exact against decode_mtp), through
// every state pass: no gate, no norm, the sigmoid gate, the core output rounded to out's dtype,
// bf16 activations in unaligned rows, fp16 ones in 16-byte rows (staged by the fused kernel), null
// first slots, and the input options (a as the log-decay, b as beta, q and k without L2 norm).
TEST(PrefillCuda, OutputVariantsMatchTheCpuPath) {
  GDN_SKIP_WITHOUT_GPU();
  struct Variant {
    const char* name;
    void (*apply)(CaseConfig&);
  };
  const Variant variants[] = {
      {"no gate", [](CaseConfig& g) { g.gated = false; }},
      {"no norm", [](CaseConfig& g) { g.norm = false; }},
      {"sigmoid gate", [](CaseConfig& g) { g.gate = GateActivation::kSigmoid; }},
      {"rounded core output",
       [](CaseConfig& g) {
         g.act_dtype = DType::kFloat16;
         g.out_dtype = DType::kFloat16;
         g.round_core_output = true;
       }},
      {"bf16 activations and outputs",
       [](CaseConfig& g) {
         g.act_dtype = DType::kBFloat16;
         g.out_dtype = DType::kBFloat16;
       }},
      {"fp16 activations in 16-byte rows",
       [](CaseConfig& g) {
         g.act_dtype = DType::kFloat16;
         g.out_dtype = DType::kFloat16;
         g.qkv_row_pad = 8;
       }},
      {"first_valid_slot 1", [](CaseConfig& g) { g.first_valid_slot = 1; }},
      {"a is the log-decay (no A_log, dt_bias)", [](CaseConfig& g) { g.a_is_log_decay = true; }},
      {"b is beta", [](CaseConfig& g) { g.b_is_beta = true; }},
      {"q, k without L2 norm", [](CaseConfig& g) { g.qk_l2_norm = false; }},
  };
  uint32_t seed = 40;
  for (const Variant& v : variants)
    for (const StatePass pass : kPasses) {
      if (!runs_here(pass)) continue;
      SCOPED_TRACE(::testing::Message() << v.name << ", " << pass_name(pass));
      CaseConfig g = gpu_config({5, 70, 0, 150}, 2, DType::kFloat32, StateLayout::kVK, seed++);
      v.apply(g);
      PrefillCase cpu(g, {0, 1, 2, 3}, {4, 5, 6, 7}), gpu(g, {0, 1, 2, 3}, {4, 5, 6, 7});
      cpu.c.poison_out();
      gpu.c.poison_out();
      ASSERT_TRUE(run_cpu(cpu.params()).is_ok());
      const Status s = gpu_prefill(gpu.params(), pass);
      ASSERT_TRUE(s.is_ok()) << s.reason();
      double num = 0, den = 0;
      for (int64_t e = 0; e < cpu.c.out.count; ++e) {
        const double want = cpu.c.out.get(e), got = gpu.c.out.get(e);
        if (std::isnan(want)) {  // a padded row: never written
          ASSERT_TRUE(std::isnan(got)) << e;
          continue;
        }
        num += (got - want) * (got - want);
        den += want * want;
      }
      EXPECT_LT(std::sqrt(num / den), 2e-2);
      num = den = 0;
      for (int64_t e = 0; e < cpu.c.state.count; ++e) {
        const double want = cpu.c.state.get(e), got = gpu.c.state.get(e);
        num += (got - want) * (got - want);
        den += want * want;
      }
      EXPECT_LT(std::sqrt(num / den), 2e-2);
    }
}

// Rows whose indices are invalid on the device: a slot past the pool (initial, final, or a
// checkpoint the request reaches) or more checkpoint boundaries than columns store nothing, zero
// their output rows and are counted once; a broken cu_seqlens range writes nothing; the valid
// rows around them run normally.
void expect_invalid_rows_write_nothing(StatePass pass) {
  SCOPED_TRACE(pass_name(pass));
  PrefillCase pc(gpu_config({10, 20, 30, 70, 130, 40}), {0, 99, 2, 3, 4, 5}, {6, 7, 50, 8, 9, 10},
                 64, 1);
  // Row 3 (70 tokens) checkpoints to slot 77 (past the pool); row 4 (130 tokens) crosses two
  // boundaries with one column; rows 1 and 2 have a bad initial / final slot.
  pc.checkpoints = {-1, -1, -1, 77, 11, -1};
  std::vector<int32_t> err = {0};
  pc.c.poison_out();
  const HostArray before = pc.c.state;
  Params p = pc.params();
  p.error_count = TensorView::make(err.data(), DType::kInt32, {1});
  const Status s = gpu_prefill(p, pass);
  ASSERT_TRUE(s.is_ok()) << s.reason();
  EXPECT_EQ(err[0], 4);
  const int64_t row_elems = pc.c.HV * pc.c.cfg.V;
  for (const int64_t i : {1, 2, 3, 4}) {
    for (int64_t e = pc.c.cu[size_t(i)] * row_elems; e < pc.c.cu[size_t(i + 1)] * row_elems; ++e)
      ASSERT_EQ(pc.c.out.get(e), 0.0f) << "row " << i;
  }
  for (const int64_t slot : {7, 8, 9, 11})
    for (int64_t e = slot * pc.c.slot_stride; e < (slot + 1) * pc.c.slot_stride; ++e)
      ASSERT_EQ(pc.c.state.get(e), before.get(e)) << "slot " << slot;
  // The valid rows 0 and 5 ran: their outputs are finite and their final slots changed.
  for (const int64_t i : {0, 5})
    for (int64_t e = pc.c.cu[size_t(i)] * row_elems; e < pc.c.cu[size_t(i + 1)] * row_elems; ++e)
      ASSERT_TRUE(std::isfinite(pc.c.out.get(e))) << "row " << i;
  EXPECT_NE(pc.c.state.get(6 * pc.c.slot_stride), before.get(6 * pc.c.slot_stride));

  // A cu_seqlens range past L: that row writes nothing at all.
  PrefillCase bad(gpu_config({10, 20}), {0, 1}, {2, 3});
  bad.c.cu[2] = int32_t(bad.c.L + 5);
  // Host validation would refuse it; the device path only sees it on the device.
  bad.c.poison_out();
  const HostArray bad_before = bad.c.state;
  Params q = bad.params();
  q.cu_seqlens = TensorView::make(bad.c.cu.data(), DType::kInt32, {3});
  std::vector<int32_t> err2 = {0};
  q.error_count = TensorView::make(err2.data(), DType::kInt32, {1});
  ASSERT_TRUE(gpu_prefill(q, pass).is_ok());
  EXPECT_EQ(err2[0], 1);
  for (int64_t e = 3 * bad.c.slot_stride; e < 4 * bad.c.slot_stride; ++e)
    ASSERT_EQ(bad.c.state.get(e), bad_before.get(e));
}

TEST(PrefillCuda, InvalidDeviceRowsWriteNothingAndAreCounted) {
  GDN_SKIP_WITHOUT_GPU();
  for (const StatePass pass : kPasses)
    if (runs_here(pass)) expect_invalid_rows_write_nothing(pass);
}

// The workspace query follows the form the launch takes: cuda_workspace_bytes(L, N, HV) for the
// chunk kernel's forms (few heads: the recurrence; many heads in short requests: the one-pass
// kernel), none for the fused kernel (many heads in long requests); a launch without a workspace
// then matches the reference either way.
TEST(PrefillCuda, WorkspaceQueryFollowsTheForm) {
  GDN_SKIP_WITHOUT_GPU();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int64_t kHV = 16;                // H = 8, ratio 2
  const int64_t many = sms / (2 * kHV) + 1;  // 2 N HV > SMs
  const int64_t long_request = kFusedMinMeanTokens + 6;
  struct Form {
    int64_t requests, tokens;
    bool fused;
  };
  const Form forms[] = {{1, 70, false}, {many, 70, false}, {many, long_request, true}};
  for (const Form& f : forms) {
    CaseConfig g = gpu_config(std::vector<int64_t>(size_t(f.requests), f.tokens), 2,
                              DType::kFloat32, StateLayout::kVK, 70);
    g.H = kHV / 2;
    g.slots = 2 * f.requests + 1;
    std::vector<int64_t> initial(static_cast<size_t>(f.requests)), final_slot(initial);
    for (int64_t i = 0; i < f.requests; ++i) {
      initial[size_t(i)] = i % 3 == 0 ? -1 : i;  // some new requests (null slots)
      final_slot[size_t(i)] = f.requests + i;
    }
    PrefillCase pc(g, initial, final_slot);
    int64_t bytes = -1;
    const Status s = on_gpu(
        pc.params(), [&](const Params& p) { return cuda_api::prefill_workspace_bytes(p, &bytes); });
    ASSERT_TRUE(s.is_ok()) << s.reason();
    SCOPED_TRACE(::testing::Message() << f.requests << " requests of " << f.tokens << " tokens");
    const bool fused = f.fused && runs_here(StatePass::kFused);
    EXPECT_EQ(bytes, fused ? 0 : cuda_workspace_bytes(pc.c.L, pc.c.N, pc.c.HV));
    expect_matches_reference(pc, 2e-2, kGpu);
  }
}

// A caller's workspace of cuda_workspace_bytes gives the same bits as the launch's own; a smaller
// one is refused, naming it, before anything is written.
TEST(PrefillCuda, CallerWorkspace) {
  GDN_SKIP_WITHOUT_GPU();
  const CaseConfig g = gpu_config({100, 64, 1, 200}, 2, DType::kFloat32, StateLayout::kVK, 11);
  PrefillCase own(g, {0, 1, 2, 3}, {4, 5, 6, 7}), given(g, {0, 1, 2, 3}, {4, 5, 6, 7});
  own.c.poison_out();
  given.c.poison_out();
  ASSERT_TRUE(gpu_prefill(own.params()).is_ok());
  const int64_t bytes = cuda_workspace_bytes(given.c.L, given.c.N, given.c.HV);
  const int64_t words = (bytes + 3) / 4;
  std::vector<int32_t> workspace(size_t(words) + 4);
  // 16-byte aligned within its host buffer, so within its device copy too.
  const size_t pad = (16 - reinterpret_cast<uintptr_t>(workspace.data()) % 16) % 16 / 4;
  Params p = given.params();
  p.workspace = TensorView::make(workspace.data() + pad, DType::kInt32, {words});
  const Status s = gpu_prefill(p);
  ASSERT_TRUE(s.is_ok()) << s.reason();
  for (int64_t e = 0; e < own.c.out.count; ++e) {
    const float a = own.c.out.get(e), b = given.c.out.get(e);
    ASSERT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << e;
  }
  for (int64_t e = 0; e < own.c.state.count; ++e)
    ASSERT_EQ(own.c.state.get(e), given.c.state.get(e)) << e;

  PrefillCase small(g, {0, 1, 2, 3}, {4, 5, 6, 7});
  small.c.poison_out();
  Params q = small.params();
  q.workspace = TensorView::make(workspace.data() + pad, DType::kInt32, {words - 1});
  const Status refused = gpu_prefill(q);
  EXPECT_FALSE(refused.is_ok());
  EXPECT_NE(refused.reason().find("workspace has"), std::string::npos) << refused.reason();
  for (int64_t e = 0; e < small.c.out.count; ++e) ASSERT_TRUE(std::isnan(small.c.out.get(e)));
}

// A cu_seqlens that is not non-decreasing can give two requests the same chunk slot: row 0 =
// [128, 320) and row 2 = [0, 64) both map to slot 2 here (row 1 = [320, 0) is broken). The slot's
// owner runs exactly as it would alone; the other request is refused as an invalid row.
TEST(PrefillCuda, RequestsWhoseChunkSlotsCollideAreRefused) {
  GDN_SKIP_WITHOUT_GPU();
  const CaseConfig g = gpu_config({128, 192, 0}, 2, DType::kFloat32, StateLayout::kVK, 12);
  PrefillCase broken(g, {0, 1, 2}, {3, 4, 5}), alone(g, {0, 1, 2}, {3, 4, 5});
  const std::vector<int32_t> broken_cu = {128, 320, 0, 64}, alone_cu = {128, 320, 320, 320};
  const auto run = [](PrefillCase& pc, const std::vector<int32_t>& cu, int32_t* errors) {
    pc.c.poison_out();
    pc.c.cu.assign(cu.begin(), cu.end());
    Params p = pc.params();
    p.cu_seqlens = TensorView::make(pc.c.cu.data(), DType::kInt32, {int64_t(cu.size())});
    p.error_count = TensorView::make(errors, DType::kInt32, {1});
    const Status s = gpu_prefill(p);
    ASSERT_TRUE(s.is_ok()) << s.reason();
  };
  int32_t broken_errors = 0, alone_errors = 0;
  run(broken, broken_cu, &broken_errors);
  run(alone, alone_cu, &alone_errors);
  EXPECT_EQ(broken_errors, 2);  // rows 1 and 2
  EXPECT_EQ(alone_errors, 0);
  const int64_t row_elems = broken.c.HV * 128;
  for (int64_t e = 0; e < 64 * row_elems; ++e) ASSERT_EQ(broken.c.out.get(e), 0.0f) << e;
  for (int64_t e = 64 * row_elems; e < 128 * row_elems; ++e)
    ASSERT_TRUE(std::isnan(broken.c.out.get(e))) << e;
  for (int64_t e = 128 * row_elems; e < 320 * row_elems; ++e)
    ASSERT_EQ(broken.c.out.get(e), alone.c.out.get(e)) << e;
  for (int64_t e = 0; e < broken.c.state.count; ++e)
    ASSERT_EQ(broken.c.state.get(e), alone.c.state.get(e)) << e;
}

// On CUDA mixed_qkv, z and out share one dtype; another mix is refused before anything runs.
TEST(PrefillCuda, MixedActivationDtypesAreRefused) {
  GDN_SKIP_WITHOUT_GPU();
  CaseConfig g = gpu_config({5});
  g.out_dtype = DType::kBFloat16;
  PrefillCase pc(g, {0}, {1});
  pc.c.poison_out();
  const Status s = gpu_prefill(pc.params());
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.reason().find("out in mixed_qkv's dtype float32, got bfloat16"), std::string::npos)
      << s.reason();
  for (int64_t e = 0; e < pc.c.out.count; ++e) ASSERT_TRUE(std::isnan(pc.c.out.get(e)));
}

}  // namespace
}  // namespace gdn::prefill
