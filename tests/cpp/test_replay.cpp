// CPU replay verify: chains of steps with random acceptance against write-every-token decode_mtp,
// one-token-at-a-time decoding (bit for bit with an fp32 state) and a float64 reference; 16-bit
// states within decode_mtp's bars; invalid rows write nothing; null slots are padded rows;
// argument errors name the argument; the guard.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/replay/cpu.hpp"
#include "replay_chain.hpp"

namespace gdn::testing {
namespace {

// ---- (a) bit for bit against write-every-token and sequential decoding --------------------------

class ReplayChainBitForBit : public ::testing::TestWithParam<ChainParam> {};

TEST_P(ReplayChainBitForBit, EqualsWriteEveryTokenAndSequentialDecoding) {
  run_chain_bit_for_bit(GetParam(), Runner{});
}

ReplayConfig chain_config(int64_t H, int64_t ratio, StateLayout layout, uint32_t seed) {
  ReplayConfig c;
  c.H = H;
  c.ratio = ratio;
  c.layout = layout;
  c.seed = seed;
  return c;
}

std::vector<ChainParam> chain_params() {
  std::vector<ChainParam> out;
  const StateLayout vk = StateLayout::kVK, kv = StateLayout::kKV;
  out.push_back({"r1_vk", chain_config(2, 1, vk, 11), 120});
  out.push_back({"r1_kv", chain_config(2, 1, kv, 12), 120});
  out.push_back({"r2_vk", chain_config(2, 2, vk, 21), 120});
  out.push_back({"r2_kv", chain_config(2, 2, kv, 22), 120});
  out.push_back({"r4_vk", chain_config(1, 4, vk, 41), 120});
  out.push_back({"r4_kv", chain_config(1, 4, kv, 42), 120});
  out.push_back({"r5_vk", chain_config(2, 5, vk, 51), 120});
  out.push_back({"r5_kv", chain_config(2, 5, kv, 52), 120});
  // Separate window arrays, vLLM's null block 0, sigmoid gate, a deeper window.
  ReplayConfig c = chain_config(2, 2, kv, 61);
  c.fused_windows = false;
  c.first_valid_slot = 1;
  c.gate = GateActivation::kSigmoid;
  c.S = 6;
  out.push_back({"r2_kv_separate_windows_null_block0_S6", c, 120});
  // 16-bit activations: the window keeps them as given, so bit for bit still holds.
  c = chain_config(2, 3, vk, 71);
  c.act_dtype = DType::kBFloat16;
  out.push_back({"r3_vk_bf16_activations", c, 100});
  // Eight value heads per key head on an OpenMP team (big enough to be threaded): every head
  // replays the key head's stored k before any save overwrites it.
  c = chain_config(1, 8, vk, 81);
  c.K = c.V = 64;
  c.N = 4;
  out.push_back({"r8_vk_threaded_k64", c, 40});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Chains, ReplayChainBitForBit, ::testing::ValuesIn(chain_params()),
                         [](const ::testing::TestParamInfo<ChainParam>& info) {
                           return std::string(info.param.name);
                         });

// ---- (b) 16-bit checkpoints ---------------------------------------------------------------------

using SixteenBitParam = std::tuple<DType, StateLayout>;
class ReplaySixteenBitState : public ::testing::TestWithParam<SixteenBitParam> {};

// The checkpoint is rounded once per step. Per step against the float64 reference from the stored
// checkpoint: outputs come from the unrounded fp32 state (fp32 bar), the checkpoint carries one
// rounding. Over the chain against the same chain with an fp32 state: decode_mtp's 1e-2 bar.
TEST_P(ReplaySixteenBitState, WithinDecodeMtpBars) {
  const auto [dtype, layout] = GetParam();
  ReplayConfig cfg = chain_config(2, 2, layout, 90 + uint32_t(dtype));
  Chain wide(cfg);
  cfg.state_dtype = dtype;
  Chain narrow(cfg);
  // Same seed, same draws: identical tokens and schedules; the initial states differ only by the
  // 16-bit rounding, so start the fp32 chain from the rounded values.
  for (int64_t e = 0; e < wide.rc.state.count; ++e) wide.rc.state.set(e, narrow.rc.state.get(e));
  double worst_out = 0, worst_state = 0, chain_out = 0, chain_state = 0;
  for (int step = 0; step < 40; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    wide.draw();
    narrow.draw();
    const HostArray before = narrow.rc.state;
    ASSERT_TRUE(wide.run_replay().is_ok());
    const Status s = narrow.run_replay();
    ASSERT_TRUE(s.is_ok()) << s.reason();
    expect_step_matches_reference(narrow, before, 1e-5, 1e-2, &worst_out, &worst_state);
    for (int64_t i = 0; i < cfg.N; ++i) {
      if (narrow.T(i) == 0) continue;
      const int64_t slot = narrow.slot_ids[size_t(i)];
      const double e_state = rel_l2(narrow.rc.slot_values(narrow.rc.state, slot),
                                    wide.rc.slot_values(wide.rc.state, slot));
      const int64_t T = narrow.T(i);
      const double e_out = rel_l2(out_rows(narrow.batch, narrow.begin(i), T, narrow.rc.HVV),
                                  out_rows(wide.batch, wide.begin(i), T, wide.rc.HVV));
      EXPECT_LE(e_state, 1e-2) << "request " << i;
      EXPECT_LE(e_out, 1e-2) << "request " << i;
      chain_state = std::max(chain_state, e_state);
      chain_out = std::max(chain_out, e_out);
    }
    wide.commit();
    narrow.commit();
    if (::testing::Test::HasFailure()) break;
  }
  RecordProperty("worst_step_checkpoint_rel_l2", sci(worst_state));
  RecordProperty("worst_chain_checkpoint_rel_l2", sci(chain_state));
  RecordProperty("worst_chain_out_rel_l2", sci(chain_out));
}

INSTANTIATE_TEST_SUITE_P(StateDtypes, ReplaySixteenBitState,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(StateLayout::kVK, StateLayout::kKV)),
                         [](const ::testing::TestParamInfo<SixteenBitParam>& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == StateLayout::kVK ? "_vk" : "_kv");
                         });

// ---- (c) invalid rows
// -----------------------------------------------------------------------------

// A chain one step in: every request has a window of T tokens pending, and a second step drawn.
Chain primed_chain(uint32_t seed) {
  ReplayConfig cfg = chain_config(2, 2, StateLayout::kVK, seed);
  cfg.N = 4;
  cfg.S = 3;
  Chain ch(cfg);
  ch.tokens.assign(size_t(cfg.N), {});
  ch.n.assign(size_t(cfg.N), 0);
  for (int64_t i = 0; i < cfg.N; ++i)
    for (int64_t t = 0; t < 2; ++t) ch.tokens[size_t(i)].push_back(ch.rc.random_token());
  ch.batch = ch.rc.batch(ch.tokens);
  const Status s = ch.run_replay();
  EXPECT_TRUE(s.is_ok()) << s.reason();
  ch.commit();
  for (int64_t i = 0; i < cfg.N; ++i)
    for (int64_t t = 0; t < 3; ++t) ch.tokens[size_t(i)].push_back(ch.rc.random_token());
  for (auto& list : ch.tokens) list.erase(list.begin(), list.begin() + 2);  // 3 fresh tokens each
  ch.batch = ch.rc.batch(ch.tokens);
  ch.n = {1, 2, 0, 2};
  return ch;
}

TEST(Replay, InvalidRowsRaiseBeforeAnythingIsWritten) {
  struct Bad {
    const char* what;
    void (*mutate)(Chain&);
    const char* contains;  // besides "request row <row>"
    int row;
  };
  const Bad cases[] = {
      {"n > window_len", [](Chain& ch) { ch.n[2] = 3; },
       "num_accepted_tokens[2] = 3 exceeds window_len[", 2},
      {"n > S", [](Chain& ch) { ch.n[1] = 4; }, "num_accepted_tokens[1] = 4 is outside [0, S = 3]",
       1},
      {"n < 0", [](Chain& ch) { ch.n[3] = -1; }, "num_accepted_tokens[3] = -1", 3},
      {"T > S",
       [](Chain& ch) {
         ch.tokens[3].push_back(ch.rc.random_token());
         ch.batch = ch.rc.batch(ch.tokens);
       },
       "has T = 4 tokens but the window holds only S = 3", 3},
      {"slot >= slots", [](Chain& ch) { ch.slot_ids[1] = int32_t(ch.rc.slots); },
       "state_indices[1] = ", 1},
      {"shared checkpoint slot", [](Chain& ch) { ch.slot_ids[3] = ch.slot_ids[0]; },
       "is also the checkpoint slot of request row 0", 3},
      {"decreasing cu_seqlens", [](Chain& ch) { ch.batch.cu[2] = ch.batch.cu[1] - 1; },
       "cu_seqlens[1..]", 1},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    Chain ch = primed_chain(300);
    bad.mutate(ch);
    const ReplayCase before = ch.rc;
    const auto out_before = ch.batch.out.bytes;
    const Status s = ch.run_replay();
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.reason().find("request row " + std::to_string(bad.row) + ": "), std::string::npos)
        << s.reason();
    EXPECT_NE(s.reason().find(bad.contains), std::string::npos) << s.reason();
    EXPECT_TRUE(ch.rc.state.bytes == before.state.bytes) << "state changed";
    EXPECT_TRUE(ch.rc.window_kv.bytes == before.window_kv.bytes) << "window_k / window_v changed";
    EXPECT_TRUE(ch.rc.window_ab.bytes == before.window_ab.bytes) << "window_a / window_b changed";
    EXPECT_TRUE(ch.rc.window_len == before.window_len) << "window_len changed";
    EXPECT_TRUE(ch.batch.out.bytes == out_before) << "out changed";
  }
  // The unmutated step is valid (the failures above come from the mutations alone).
  Chain ch = primed_chain(300);
  const Status s = ch.run_replay();
  EXPECT_TRUE(s.is_ok()) << s.reason();
}

// ---- (d) null checkpoint slots and rows without tokens
// --------------------------------------------

// A null slot (below first_valid_slot) or T = 0 makes a padded row: no checkpoint, window, count or
// output is read or written for it, whatever its replay count; the other rows are unaffected.
TEST(Replay, NullCheckpointSlotIsAPaddedRow) {
  for (int64_t first_valid : {0, 1}) {
    SCOPED_TRACE("first_valid_slot " + std::to_string(first_valid));
    ReplayConfig cfg = chain_config(2, 2, StateLayout::kKV, 400 + uint32_t(first_valid));
    cfg.first_valid_slot = first_valid;
    cfg.N = 4;
    Chain ch(cfg), twin(cfg);  // twin: the same requests without the padded rows
    for (int step = 0; step < 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      ch.draw();
      twin.draw();
      // Row 1: null slot with tokens and a nonsense count; row 2: no tokens and a nonsense count.
      if (ch.tokens[1].empty()) ch.tokens[1].push_back(ch.rc.random_token());
      ch.slot_ids[1] = int32_t(first_valid - 1);
      ch.n[1] = 99;
      ch.tokens[2].clear();
      ch.n[2] = -7;
      ch.batch = ch.rc.batch(ch.tokens);
      const ReplayCase before = ch.rc;
      const Status s = ch.run_replay();
      ASSERT_TRUE(s.is_ok()) << s.reason();
      // Padded rows: their slots, windows and counts are untouched; their outputs stay poisoned.
      for (int64_t owner : {1, 2}) {
        const int64_t slot = ch.rc.owner_slot[size_t(owner)];
        EXPECT_TRUE(same_bytes(ch.rc.slot_ptr(ch.rc.state, slot),
                               ch.rc.slot_ptr(before.state, slot), ch.rc.state_bytes()));
        EXPECT_EQ(ch.rc.window_len[size_t(slot)], before.window_len[size_t(slot)]);
        EXPECT_TRUE(ch.rc.window_bytes(slot) == before.window_bytes(slot));
      }
      for (int64_t e = ch.begin(1) * ch.rc.HVV; e < (ch.begin(1) + ch.T(1)) * ch.rc.HVV; ++e)
        ASSERT_TRUE(std::isnan(ch.batch.out.get(e))) << "padded row 1 output written";
      // The live rows match a call without the padded rows.
      twin.tokens[1].clear();
      twin.tokens[2].clear();
      twin.n[0] = ch.n[0];
      twin.n[3] = ch.n[3];
      twin.tokens[0] = ch.tokens[0];
      twin.tokens[3] = ch.tokens[3];
      twin.batch = twin.rc.batch(twin.tokens);
      ASSERT_TRUE(twin.run_replay().is_ok());
      const int64_t esz = dtype_size(cfg.act_dtype);
      for (int64_t i : {0, 3}) {
        const int64_t slot = ch.slot_ids[size_t(i)];
        EXPECT_TRUE(same_bytes(ch.rc.slot_ptr(ch.rc.state, slot),
                               twin.rc.slot_ptr(twin.rc.state, slot), ch.rc.state_bytes()));
        EXPECT_TRUE(same_bytes(ch.batch.out.bytes.data() + ch.begin(i) * ch.rc.HVV * esz,
                               twin.batch.out.bytes.data() + twin.begin(i) * twin.rc.HVV * esz,
                               ch.T(i) * ch.rc.HVV * esz));
      }
      ch.slot_ids[1] = ch.rc.owner_slot[1];
      ch.tokens[1].clear();  // nothing was saved for the padded rows: their windows stay pending
      ch.commit();
      twin.commit();
    }
  }
}

// ---- (e) argument errors
// --------------------------------------------------------------------------

TEST(Replay, ArgumentErrorsNameTheArgument) {
  Chain ch = primed_chain(500);
  const auto expect_error = [&](const char* contains, auto mutate) {
    replay::Params p = ch.rc.replay_params(ch.batch, ch.slot_ids, ch.n);
    mutate(p);
    const Status s = replay::run_cpu(p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << contains;
    EXPECT_NE(s.reason().find(contains), std::string::npos) << s.reason();
  };
  expect_error("window_k is required", [](replay::Params& p) { p.window_k = TensorView{}; });
  expect_error("window_b is required", [](replay::Params& p) { p.window_b = TensorView{}; });
  expect_error("num_accepted_tokens is required",
               [](replay::Params& p) { p.num_accepted_tokens = TensorView{}; });
  expect_error("window_len is required", [](replay::Params& p) { p.window_len = TensorView{}; });
  expect_error("state_indices must have 1 dimensions", [](replay::Params& p) {
    p.state_indices.ndim = 2;
    p.state_indices.shape[1] = 1;
  });
  expect_error("window_v has dtype bfloat16 but must have mixed_qkv's dtype float32",
               [](replay::Params& p) { p.window_v.dtype = DType::kBFloat16; });
  expect_error("window_a has dtype float16 but must have a's dtype",
               [](replay::Params& p) { p.window_a.dtype = DType::kFloat16; });
  expect_error("window_k dimension 2 must be H*K",
               [](replay::Params& p) { p.window_k.shape[2] += 1; });
  expect_error("window_v dimension 1 must be S (dim 1 of window_k)",
               [](replay::Params& p) { p.window_v.shape[1] -= 1; });
  expect_error("window_a dimension 0 must be slots",
               [](replay::Params& p) { p.window_a.shape[0] -= 1; });
  expect_error("window_b strides (",
               [](replay::Params& p) { p.window_b.strides[0] = p.window_b.strides[1]; });
  expect_error("window_k must have unit stride on dimension 2",
               [](replay::Params& p) { p.window_k.strides[2] = 2; });
  expect_error("window_len has dtype int64",
               [](replay::Params& p) { p.window_len.dtype = DType::kInt64; });
  expect_error("window_len dimension 0 must be slots",
               [](replay::Params& p) { p.window_len.shape[0] -= 1; });
  expect_error("num_accepted_tokens dimension 0 must be N",
               [](replay::Params& p) { p.num_accepted_tokens.shape[0] += 1; });
  expect_error("window_k must hold at least one token", [](replay::Params& p) {
    for (TensorView* w : {&p.window_k, &p.window_v, &p.window_a, &p.window_b}) w->shape[1] = 0;
  });
  expect_error("window_v is on cuda:0",
               [](replay::Params& p) { p.window_v.device = {DeviceType::kCUDA, 0}; });
  // The shared arguments are checked exactly as decode_mtp checks them.
  expect_error("a dimension 1", [](replay::Params& p) { p.a.shape[1] += 1; });
  expect_error("mixed_qkv width", [](replay::Params& p) { p.mixed_qkv.shape[1] -= 1; });
  expect_error("cu_seqlens dimension 0 must be N + 1",
               [](replay::Params& p) { p.cu_seqlens.shape[0] += 1; });
  expect_error("state slot stride", [](replay::Params& p) { p.state.strides[0] = 10; });
  // None of it wrote anything: the valid call still runs from the primed state.
  const Status s = ch.run_replay();
  EXPECT_TRUE(s.is_ok()) << s.reason();
}

// ---- the window format, written by the caller
// ------------------------------------------------------

// A window the caller fills by the documented format (as a prefill-then-resume engine might) is
// replayed like one the call saved: compared with the float64 reference.
TEST(Replay, ReadsACallerWrittenWindow) {
  for (bool fused : {true, false}) {
    ReplayConfig cfg = chain_config(2, 2, StateLayout::kVK, 600 + uint32_t(fused));
    cfg.fused_windows = fused;
    cfg.N = 2;
    Chain ch(cfg);
    ch.tokens.assign(2, {});
    for (int64_t i = 0; i < 2; ++i)
      for (int t = 0; t < 3; ++t) ch.tokens[size_t(i)].push_back(ch.rc.random_token());
    // Write tokens as the previous step's window via the params' views.
    replay::Params p = ch.rc.replay_params(ch.batch, ch.slot_ids, ch.n);
    const int64_t esz = dtype_size(cfg.act_dtype);
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t s = ch.slot_ids[size_t(i)];
      for (int64_t t = 0; t < 3; ++t) {
        const Token& tok = ch.tokens[size_t(i)][size_t(t)];
        const auto put = [&](const TensorView& w, const uint8_t* src, int64_t count) {
          std::memcpy(static_cast<uint8_t*>(w.data) + replay::window_offset(w, s, t) * esz, src,
                      size_t(count * esz));
        };
        put(p.window_k, tok.qkv.bytes.data() + ch.rc.HK * esz, ch.rc.HK);
        put(p.window_v, tok.qkv.bytes.data() + 2 * ch.rc.HK * esz, ch.rc.HVV);
        put(p.window_a, tok.ab.bytes.data(), ch.rc.HV);
        put(p.window_b, tok.ab.bytes.data() + ch.rc.HV * esz, ch.rc.HV);
      }
      ch.rc.window_len[size_t(s)] = 3;
    }
    ch.commit();
    for (auto& list : ch.tokens) list = {ch.rc.random_token(), ch.rc.random_token()};
    ch.batch = ch.rc.batch(ch.tokens);
    ch.n = {3, 2};
    const HostArray before = ch.rc.state;
    const Status s = ch.run_replay();
    ASSERT_TRUE(s.is_ok()) << s.reason();
    double worst_out = 0, worst_state = 0;
    expect_step_matches_reference(ch, before, 1e-5, 1e-5, &worst_out, &worst_state);
  }
}

// ---- guard
// -----------------------------------------------------------------------------------------

TEST(ReplayGuard, SameSupportedSetAsDecodeMtp) {
  for (DeviceType dev : {DeviceType::kCPU, DeviceType::kCUDA})
    for (int64_t HV : {16, 32, 40, 10})
      for (DType sd : {DType::kFloat32, DType::kBFloat16, DType::kInt32})
        for (bool cuda : {false, true}) {
          const auto r = replay::can_use(dev, 4, HV, 128, 128, 5, sd, cuda);
          const auto d = decode_mtp::can_use(dev, 4, HV, 128, 128, 5, sd, cuda);
          EXPECT_EQ(r.path, d.path);
          EXPECT_EQ(r.reason, d.reason);
        }
  EXPECT_EQ(replay::can_use(DeviceType::kCPU, 4, 20, 128, 128, 5, DType::kFloat32).path,
            replay::Path::kGeneric);
  EXPECT_EQ(replay::can_use(DeviceType::kCPU, 4, 10, 128, 128, 5, DType::kFloat32).path,
            replay::Path::kUnsupported);  // 10 / 4 would floor to the listed ratio 2
}

}  // namespace
}  // namespace gdn::testing
