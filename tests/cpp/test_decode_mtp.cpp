// CPU decode_mtp against the tests' float64 reference, over the parameter grid, plus the contract's
// guarantees: spec == sequential bit for bit, invalid rows write nothing, untouched slots stay
// intact.
#include <gtest/gtest.h>

#include <tuple>

#include "decode_mtp_case.hpp"
#include "gdn/decode_mtp/cpu.hpp"

namespace gdn::testing {
namespace {

// Checks outputs and every written slot against the reference; other slots must be bit-identical.
void expect_matches_reference(DecodeCase& c, double out_tol, double state_tol) {
  const HostArray before = c.state;
  const Reference ref = reference(c);
  decode_mtp::Params p = c.params();
  Status s = decode_mtp::run_cpu(p);
  ASSERT_TRUE(s.is_ok()) << s.reason();

  std::vector<double> got(size_t(c.out.count)), want = ref.out;
  for (int64_t e = 0; e < c.out.count; ++e) got[size_t(e)] = c.out.get(e);
  // Rows covered by a request are written; compare exactly those.
  std::vector<double> g2, w2;
  for (size_t e = 0; e < want.size(); ++e) {
    if (std::isnan(want[e])) continue;
    g2.push_back(got[e]);
    w2.push_back(want[e]);
    ASSERT_FALSE(std::isnan(got[e])) << "output element " << e << " not written";
  }
  if (!w2.empty()) {
    EXPECT_LE(rel_l2(g2, w2), out_tol);
  }

  std::vector<bool> owned(size_t(c.cfg.slots), false);
  for (auto [slot, id] : ref.written) owned[size_t(slot)] = true;
  // The last write to a slot wins (a request's slots are distinct, so there is exactly one).
  for (auto [slot, id] : ref.written) {
    EXPECT_LE(rel_l2(slot_values(c, c.state, slot), ref.states[size_t(id)]), state_tol)
        << "slot " << slot;
  }
  const int64_t esz = dtype_size(c.cfg.state_dtype);
  for (int64_t slot = 0; slot < c.cfg.slots; ++slot) {
    if (owned[size_t(slot)]) continue;
    EXPECT_EQ(0, std::memcmp(before.bytes.data() + slot * c.slot_stride * esz,
                             c.state.bytes.data() + slot * c.slot_stride * esz,
                             size_t(c.slot_stride * esz)))
        << "slot " << slot << " was not a destination but changed";
  }
}

using GridParam = std::tuple<int /*ratio*/, DType /*state*/, StateLayout, GateActivation>;
class DecodeMtpGrid : public ::testing::TestWithParam<GridParam> {};

std::string grid_name(const ::testing::TestParamInfo<GridParam>& info) {
  const auto& [ratio, dtype, layout, gate] = info.param;
  return "r" + std::to_string(ratio) + "_" + std::string(to_string(dtype)) +
         (layout == StateLayout::kVK ? "_vk" : "_kv") +
         (gate == GateActivation::kSiLU ? "_silu" : "_sigmoid");
}

TEST_P(DecodeMtpGrid, MatchesFloat64Reference) {
  auto [ratio, state_dtype, layout, gate] = GetParam();
  CaseConfig cfg;
  cfg.ratio = ratio;
  cfg.H = ratio >= 4 ? 1 : 2;
  cfg.S = 5;
  cfg.slots = 40;
  cfg.T = {3, 0, 5, 1, 2};
  cfg.acc = {2, 1, 5, 1, 3};
  cfg.state_dtype = state_dtype;
  cfg.layout = layout;
  cfg.gate = gate;
  cfg.qkv_row_pad = 7;
  cfg.slot_pad = 8;
  cfg.null_destinations = {2, 3 * 5 + 4};  // request 0 column 2; request 3 column 4 (beyond its T)
  cfg.seed = uint32_t(ratio * 131 + int(state_dtype) * 7 + int(layout) * 3 + int(gate));
  DecodeCase c(cfg);
  const bool fp32 = state_dtype == DType::kFloat32;
  // 16-bit states: one rounding per stored state, on a state that was itself rounded on load.
  expect_matches_reference(c, fp32 ? 1e-5 : 1e-2, fp32 ? 1e-5 : 1e-2);
}

INSTANTIATE_TEST_SUITE_P(
    RatiosDtypesLayoutsGates, DecodeMtpGrid,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8, 5),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(StateLayout::kVK, StateLayout::kKV),
                       ::testing::Values(GateActivation::kSiLU, GateActivation::kSigmoid)),
    grid_name);

TEST(DecodeMtp, EveryTokenCountAndAcceptedCount) {
  for (int64_t S = 1; S <= 9; S += 2) {
    for (int64_t T = 0; T <= S; ++T) {
      CaseConfig cfg;
      cfg.S = S;
      cfg.slots = 3 * S + 2;
      cfg.T = {T, T, T};
      cfg.acc = {1, (S + 1) / 2, S};
      cfg.seed = uint32_t(100 + S * 10 + T);
      DecodeCase c(cfg);
      SCOPED_TRACE("S=" + std::to_string(S) + " T=" + std::to_string(T));
      expect_matches_reference(c, 1e-5, 1e-5);
    }
  }
}

// StepArgs' input options, alone and together (a_is_log_decay with A_log and dt_bias absent,
// b_is_beta, qk_l2_norm off), over head ratios, state dtypes and layouts.
TEST(DecodeMtp, InputOptionsMatchTheReference) {
  for (int options = 1; options < 8; ++options)
    for (const int64_t ratio : {1, 3})
      for (const DType state : {DType::kFloat32, DType::kBFloat16})
        for (const StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
          CaseConfig cfg;
          cfg.ratio = ratio;
          cfg.S = 4;
          cfg.slots = 20;
          cfg.T = {3, 0, 4, 1};
          cfg.acc = {2, 1, 4, 1};
          cfg.state_dtype = state;
          cfg.layout = layout;
          cfg.a_is_log_decay = options & 1;
          cfg.b_is_beta = options & 2;
          cfg.qk_l2_norm = !(options & 4);
          cfg.seed = uint32_t(500 + options * 16 + ratio * 4 + int(state) * 2 + int(layout));
          DecodeCase c(cfg);
          SCOPED_TRACE(::testing::Message() << "options " << options << " ratio " << ratio
                                            << " state " << to_string(state));
          const bool fp32 = state == DType::kFloat32;
          expect_matches_reference(c, fp32 ? 1e-5 : 1e-2, fp32 ? 1e-5 : 1e-2);
        }
}

// A_log and dt_bias may be absent only when `a` holds the log-decay itself.
TEST(DecodeMtp, GateParametersRequiredUnlessLogDecay) {
  CaseConfig cfg;
  cfg.T = {2};
  DecodeCase c(cfg);
  for (const bool drop_A : {true, false}) {
    decode_mtp::Params p = c.params();
    (drop_A ? p.A_log : p.dt_bias) = TensorView{};
    const Status s = decode_mtp::run_cpu(p);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.reason().find(drop_A ? "A_log is required unless a_is_log_decay"
                                     : "dt_bias is required unless a_is_log_decay"),
              std::string::npos)
        << s.reason();
    p.a_is_log_decay = true;
    EXPECT_TRUE(decode_mtp::run_cpu(p).is_ok());
  }
}

TEST(DecodeMtp, SixteenBitActivationsAndOutputs) {
  for (DType act : {DType::kBFloat16, DType::kFloat16}) {
    CaseConfig cfg;
    cfg.T = {4, 2};
    cfg.acc = {3, 1};
    cfg.act_dtype = act;
    cfg.out_dtype = act;
    DecodeCase c(cfg);
    expect_matches_reference(c, 4e-3, 1e-5);
  }
}

// vLLM's numerics: o rounded to out's dtype (bf16) before the gated RMSNorm. Against a float64
// reference that rounds o at the same point, the bf16 outputs are the same bits nearly everywhere;
// the flag changes the outputs (it is not a no-op) and leaves the states alone.
TEST(DecodeMtp, RoundedCoreOutputFollowsVllm) {
  CaseConfig cfg;
  cfg.T = {4, 2, 3};
  cfg.acc = {3, 1, 2};
  cfg.K = cfg.V = 64;
  cfg.act_dtype = cfg.out_dtype = DType::kBFloat16;
  cfg.round_core_output = true;
  DecodeCase rounded(cfg), exact([&] {
    CaseConfig e = cfg;
    e.round_core_output = false;
    return e;
  }());
  const Reference ref = reference(rounded);
  const decode_mtp::Params pr = rounded.params(), pe = exact.params();
  ASSERT_TRUE(decode_mtp::run_cpu(pr).is_ok());
  ASSERT_TRUE(decode_mtp::run_cpu(pe).is_ok());
  const auto* r = static_cast<const uint16_t*>(rounded.out.data());
  const auto* e = static_cast<const uint16_t*>(exact.out.data());
  const size_t n = ref.out.size();
  size_t differ_ref = 0, far = 0, differ_flag = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint16_t want = to_bf16(float(ref.out[i])).bits;
    differ_ref += r[i] != want;
    far += std::abs(int(r[i]) - int(want)) > 1;
    differ_flag += r[i] != e[i];
  }
  EXPECT_EQ(far, 0u);
  EXPECT_LE(double(differ_ref), 0.01 * double(n)) << differ_ref << " of " << n;
  EXPECT_GE(double(differ_flag), 0.02 * double(n))
      << "the flag changed only " << differ_flag << " of " << n;
  EXPECT_TRUE(rounded.state.bytes == exact.state.bytes);
}

TEST(DecodeMtp, NoNormAndNormWithoutGate) {
  for (bool gated : {false, true}) {
    CaseConfig cfg;
    cfg.T = {3, 1};
    cfg.acc = {2, 4};
    cfg.norm = gated;  // gated=false: no norm at all (out = o)
    cfg.gated = false;
    DecodeCase c(cfg);
    expect_matches_reference(c, 1e-5, 1e-5);
  }
}

TEST(DecodeMtp, VllmNullSlotConventionAndLargeHeadDim) {
  CaseConfig cfg;
  cfg.H = 1;
  cfg.ratio = 2;
  cfg.K = cfg.V = 128;
  cfg.S = 3;
  cfg.slots = 8;
  cfg.T = {3, 2};
  cfg.acc = {3, 2};
  cfg.first_valid_slot = 1;  // slot 0 is the reserved null block
  cfg.null_destinations = {0};
  DecodeCase c(cfg);
  expect_matches_reference(c, 1e-5, 1e-5);
}

// Running T tokens and accepting n gives bit-identical state and outputs to n calls of T = 1.
TEST(DecodeMtp, SpeculativeEqualsSequentialBitForBit) {
  constexpr int64_t S = 4;
  for (int64_t n = 1; n <= S; ++n) {
    CaseConfig cfg;
    cfg.S = S;
    cfg.slots = 16;
    cfg.T = {S};
    cfg.acc = {2};
    cfg.seed = uint32_t(900 + n);
    DecodeCase spec(cfg);
    DecodeCase seq(cfg);  // same seed: identical inputs and pool
    ASSERT_TRUE(decode_mtp::run_cpu(spec.params()).is_ok());

    // Sequential: n calls of T = 1. Row [dest, prev] with acc = 2 reads prev and writes dest.
    for (int64_t t = 0; t < n; ++t) {
      const int32_t prev =
          t == 0 ? seq.indices[size_t(cfg.acc[0] - 1)] : seq.indices[size_t(t - 1)];
      int32_t row[2] = {seq.indices[size_t(t)], prev};
      int32_t cu[2] = {0, 1}, acc[1] = {2};
      decode_mtp::Params p = seq.params();
      auto advance = [t](TensorView& v) {
        v.data = static_cast<uint8_t*>(v.data) + t * v.strides[0] * dtype_size(v.dtype);
        v.shape[0] = 1;
      };
      advance(p.mixed_qkv);
      advance(p.a);
      advance(p.b);
      advance(p.z);
      advance(p.out);
      p.state_indices = TensorView::make(row, DType::kInt32, {1, 2});
      p.cu_seqlens = TensorView::make(cu, DType::kInt32, {2});
      p.num_accepted_tokens = TensorView::make(acc, DType::kInt32, {1});
      Status s = decode_mtp::run_cpu(p);
      ASSERT_TRUE(s.is_ok()) << s.reason();
    }
    // Continuing state: column n-1 of the spec call == the sequential chain's last slot.
    const int64_t esz = dtype_size(cfg.state_dtype);
    const int64_t slot = spec.indices[size_t(n - 1)];
    EXPECT_EQ(0, std::memcmp(spec.state.bytes.data() + slot * spec.slot_stride * esz,
                             seq.state.bytes.data() + slot * seq.slot_stride * esz,
                             size_t(spec.slot_stride * esz)))
        << "state after " << n << " accepted tokens differs";
    EXPECT_EQ(0, std::memcmp(spec.out.bytes.data(), seq.out.bytes.data(),
                             size_t(n * spec.HV * cfg.V * 4)))
        << "outputs of the first " << n << " tokens differ";
  }
}

// Each invalid input is rejected with a reason and leaves pool and output bytes untouched.
TEST(DecodeMtp, InvalidRowsWriteNothing) {
  struct Bad {
    const char* what;
    void (*mutate)(DecodeCase&);
    const char* reason_contains;
  };
  const Bad cases[] = {
      {"acc = 0", [](DecodeCase& c) { c.acc[1] = 0; }, "num_accepted_tokens"},
      {"acc > S", [](DecodeCase& c) { c.acc[1] = int32_t(c.cfg.S + 1); }, "num_accepted_tokens"},
      {"T > S",
       [](DecodeCase& c) {
         c.cu[2] = c.cu[1] + int32_t(c.cfg.S + 1);
         c.cu[3] = c.cu[2];
       },
       ""},
      {"null source", [](DecodeCase& c) { c.indices[size_t(1 * c.cfg.S + c.acc[1] - 1)] = -1; },
       "null"},
      {"slot out of range",
       [](DecodeCase& c) { c.indices[size_t(2 * c.cfg.S)] = int32_t(c.cfg.slots); }, "slot count"},
      {"decreasing cu_seqlens", [](DecodeCase& c) { c.cu[2] = c.cu[1] - 1; }, "cu_seqlens"},
  };
  for (const Bad& bad : cases) {
    CaseConfig cfg;
    cfg.S = 3;
    cfg.T = {2, 3, 1};
    cfg.acc = {1, 2, 3};
    DecodeCase c(cfg);
    bad.mutate(c);
    const auto state_before = c.state.bytes;
    const auto out_before = c.out.bytes;
    decode_mtp::Params p = c.params();
    p.mixed_qkv.shape[0] = p.a.shape[0] = p.b.shape[0] = p.z.shape[0] = p.out.shape[0] = c.L + 8;
    // Larger L so that T > S stays inside [0, L]; buffers are only read for covered rows.
    c.qkv.bytes.resize(size_t((c.L + 8) * c.row_stride * 4));
    Status s = decode_mtp::run_cpu(p);
    EXPECT_FALSE(s.is_ok()) << bad.what;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.what;
    EXPECT_NE(s.reason().find(bad.reason_contains), std::string::npos)
        << bad.what << ": " << s.reason();
    EXPECT_NE(s.reason().find("request row"), std::string::npos) << bad.what << ": " << s.reason();
    EXPECT_TRUE(c.state.bytes == state_before) << bad.what << ": state changed";
    EXPECT_TRUE(std::memcmp(c.out.bytes.data(), out_before.data(), out_before.size()) == 0)
        << bad.what << ": out changed";
  }
}

TEST(DecodeMtp, ArgumentErrorsNameTheArgument) {
  CaseConfig cfg;
  cfg.T = {2};
  cfg.acc = {1};
  DecodeCase c(cfg);
  {
    auto p = c.params();
    p.a.shape[1] += 1;
    Status s = decode_mtp::run_cpu(p);
    EXPECT_NE(s.reason().find("a dimension 1"), std::string::npos) << s.reason();
  }
  {
    auto p = c.params();
    p.mixed_qkv.shape[1] -= 1;
    Status s = decode_mtp::run_cpu(p);
    EXPECT_NE(s.reason().find("mixed_qkv width"), std::string::npos) << s.reason();
  }
  {
    auto p = c.params();
    p.state_indices.dtype = DType::kFloat32;
    Status s = decode_mtp::run_cpu(p);
    EXPECT_NE(s.reason().find("state_indices has dtype float32"), std::string::npos) << s.reason();
  }
  {
    auto p = c.params();
    p.state.strides[0] = 10;
    Status s = decode_mtp::run_cpu(p);
    EXPECT_NE(s.reason().find("slot stride"), std::string::npos) << s.reason();
  }
  {
    auto p = c.params();
    p.num_k_heads = 3;
    Status s = decode_mtp::run_cpu(p);
    EXPECT_NE(s.reason().find("num_k_heads"), std::string::npos) << s.reason();
  }
}

TEST(DecodeMtpGuard, RatioMustDivideExactly) {
  using decode_mtp::can_use;
  using decode_mtp::Path;
  EXPECT_EQ(can_use(DeviceType::kCPU, 16, 32, 128, 128, 4, DType::kFloat32).path, Path::kFast);
  EXPECT_EQ(can_use(DeviceType::kCPU, 2, 10, 128, 128, 4, DType::kFloat32).path, Path::kGeneric);
  const auto s = can_use(DeviceType::kCPU, 4, 10, 128, 128, 4, DType::kFloat32);
  EXPECT_EQ(s.path, Path::kUnsupported);  // 10 / 4 would floor to the listed ratio 2
  EXPECT_NE(s.reason.find("not a multiple"), std::string::npos);
  EXPECT_EQ(can_use(DeviceType::kCUDA, 16, 32, 128, 128, 4, DType::kFloat32, false).path,
            Path::kUnsupported);
  EXPECT_EQ(can_use(DeviceType::kCUDA, 16, 32, 64, 64, 4, DType::kFloat32, true).path,
            Path::kUnsupported);
  EXPECT_EQ(can_use(DeviceType::kCUDA, 16, 32, 128, 128, 17, DType::kFloat32, true).path,
            Path::kUnsupported);
  EXPECT_EQ(can_use(DeviceType::kCUDA, 16, 48, 128, 128, 4, DType::kBFloat16, true).path,
            Path::kFast);
  // The "kv" layout is the CUDA kernel's slow path, and the guard says so; the CPU does not care.
  const auto kv =
      can_use(DeviceType::kCUDA, 16, 32, 128, 128, 4, DType::kFloat32, true, StateLayout::kKV);
  EXPECT_EQ(kv.path, Path::kGeneric);
  EXPECT_NE(kv.reason.find("slow path"), std::string::npos);
  EXPECT_EQ(
      can_use(DeviceType::kCPU, 16, 32, 128, 128, 4, DType::kFloat32, false, StateLayout::kKV).path,
      Path::kFast);
}

TEST(Dispatch, ListedAndRuntimeValues) {
  int seen = -1;
  EXPECT_TRUE(HeadRatios::dispatch(3, [&]<int R>() { seen = R; }));
  EXPECT_EQ(seen, 3);
  EXPECT_FALSE(dispatch_or_runtime<HeadRatios>(5, [&]<int R>() { seen = R; }));
  EXPECT_EQ(seen, kRuntimeValue);
  DType got = DType::kInt32;
  EXPECT_TRUE(StateDTypes::dispatch(DType::kFloat16, [&]<DType D>() { got = D; }));
  EXPECT_EQ(got, DType::kFloat16);
  EXPECT_FALSE(StateDTypes::dispatch(DType::kInt64, [&]<DType D>() { got = D; }));
}

TEST(DType, SixteenBitRoundToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(to_bf16(bits_to_float(0x3f808000u)).bits, 0x3f80);  // tie -> even
  EXPECT_EQ(to_bf16(bits_to_float(0x3f818000u)).bits, 0x3f82);  // tie -> even (up)
  EXPECT_EQ(to_bf16(bits_to_float(0x3f808001u)).bits, 0x3f81);  // above tie -> up
  EXPECT_EQ(to_f16(1.0f).bits, 0x3c00);
  EXPECT_EQ(to_f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(to_f16(65536.0f).bits, 0x7c00);                 // overflow -> inf
  EXPECT_EQ(to_f16(1.0f + 1.0f / 2048).bits, 0x3c00);       // tie -> even
  EXPECT_EQ(to_f16(1.0f + 3.0f / 2048).bits, 0x3c02);       // tie -> even (up)
  EXPECT_EQ(to_f16(5.9604644775390625e-08f).bits, 0x0001);  // smallest subnormal
  for (uint32_t h = 0; h < 0x7c00; h += 7) EXPECT_EQ(to_f16(to_float(f16_t{uint16_t(h)})).bits, h);
}

}  // namespace
}  // namespace gdn::testing
