// Two engine steps of a hybrid model's GDN layers, written the way a C++ serving engine would:
//
//   1. a prefill step: the metadata builder (gdn::metadata::Builder) plans it and fills the state
//      rows of both KV-cache groups; its prefill rows (non-spec rows of more than one token) run,
//      per group, through one causal_conv1d_prefill and one prefill call: each row's initial slot
//      is its non_spec_source_indices entry (the null id 0 when has_initial_state is false: a
//      zero state), its final slot its non_spec_state_indices entry. Three fresh prompts (70
//      tokens, across the 64-token chunk, 5 and 2 tokens, shorter than the conv history) and one
//      chunked-prefill continuation (9 tokens on top of 7 in its state);
//   2. a decode / verify step on the pools the prefill step left: the builder plans the step
//      once and fills the state rows in one pass (CPU) or one launch (CUDA); per group,
//      causal_conv1d_update and decode_mtp run on the verify rows, reading their slots, query
//      starts and accepted counts straight from the builder's buffers. Its accepted counts are
//      given as an earlier verify step would have left them (the steps in between are not run).
//
// The verify step mixes verify rows (2 drafts, 0 drafts, 1 draft) with a request that carries no
// drafts this step: it is not a verify row, and reads its state from the slot the previous step
// left it in (non_spec_source_indices), not from column 0. The check: each step's outputs and
// pools, per group, equal a second run whose slots are taken from the block tables by hand. On a
// machine with a GPU and a package built with CUDA both steps run on the device too and are
// compared with the CPU: the conv and decode_mtp to 1e-5, the prefill kernel (bf16 operands, the
// chunked form) to 2e-2 relative L2 difference.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <gdn/gdn.hpp>
#include <random>
#include <string>
#include <vector>

#if defined(GDN_ENGINE_STEP_CUDA)
#include <cuda_runtime.h>

#include <gdn/kernels/cuda_api.hpp>
#include <gdn/kernels/cuda_api_conv.hpp>
#include <gdn/kernels/cuda_api_metadata.hpp>
#include <gdn/kernels/cuda_api_prefill.hpp>
#endif

namespace {

using gdn::DType;
using gdn::Status;
using gdn::TensorView;

// Model and step shapes. K = V = 128: the CUDA kernel's head dim.
constexpr int G = 2;                                       // KV-cache groups (one GDN layer each)
constexpr int64_t H = 1, HV = 2, K = 128, V = 128, W = 4;  // heads, head dims, conv width
constexpr int64_t D = 2 * H * K + HV * V;                  // conv channels = mixed_qkv width
constexpr int64_t kNumSpec = 2, S = kNumSpec + 1;          // drafts per verify row, slot columns
constexpr int64_t kSlots = 32;                             // pool slots per group; slot 0 is null
constexpr int64_t kBuf = W - 1 + kNumSpec;                 // conv buffer length per channel

// The step: (tokens, drafts, accepted count of the previous step) per request. The request
// without drafts comes last, so the verify rows' tokens are the first rows of the batch.
struct Request {
  int32_t tokens, drafts, accepted, context;
};
const std::vector<Request> kRequests = {{3, 2, 2, 10}, {1, 0, 1, 7}, {2, 1, 3, 5}, {1, -1, 2, 9}};

// The prefill step before it, same requests (same block-table rows): (prompt tokens this step,
// tokens already in the request's state). A request with none starts from a zero state.
struct PrefillRequest {
  int32_t tokens, context;
};
const std::vector<PrefillRequest> kPrefill = {{70, 0}, {9, 7}, {2, 0}, {5, 0}};
constexpr int64_t kMaxPrefillTokens = 128;  // the prefill builder's token capacity

bool fail(const char* what, const Status& s) {
  std::printf("%s failed: %s\n", what, s.reason().c_str());
  return false;
}

// Everything one group's layer holds: its block table, weights and pools.
struct Layer {
  std::vector<int32_t> table;  // [N, S + 1]
  std::vector<float> conv_weight, A_log, dt_bias, a, b, conv_pool, state_pool;
};

struct Outputs {
  std::vector<float> conv_out, out, conv_pool, state_pool;
};

struct Problem {
  int64_t N = 0, L = 0;
  std::vector<int32_t> qsl, seq_lens, drafts, accepted, computed;
  std::vector<float> x;  // [L, D] raw inputs of the GDN layers (the same for both groups here)
  Layer layers[G];
  // The prefill step: its query starts, lengths, computed tokens, and inputs.
  int64_t PL = 0;
  std::vector<int32_t> p_qsl, p_seq_lens, p_computed;
  std::vector<float> px;            // [PL, D]
  std::vector<float> pa[G], pb[G];  // [PL, HV] per group
};

Problem make_problem() {
  Problem p;
  std::mt19937 rng(11);
  std::normal_distribution<float> n01;
  p.N = int64_t(kRequests.size());
  p.qsl = {0};
  for (const Request& r : kRequests) {
    p.qsl.push_back(p.qsl.back() + r.tokens);
    p.drafts.push_back(r.drafts);
    p.accepted.push_back(r.accepted);
    p.computed.push_back(r.context);
    p.seq_lens.push_back(r.context + r.tokens);
  }
  p.L = p.qsl.back();
  auto randn = [&](int64_t n, float scale) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& e : v) e = scale * n01(rng);
    return v;
  };
  p.x = randn(p.L * D, 1.0f);
  p.p_qsl = {0};
  for (const PrefillRequest& r : kPrefill) {
    p.p_qsl.push_back(p.p_qsl.back() + r.tokens);
    p.p_computed.push_back(r.context);
    p.p_seq_lens.push_back(r.context + r.tokens);
  }
  p.PL = p.p_qsl.back();
  p.px = randn(p.PL * D, 1.0f);
  for (int g = 0; g < G; ++g) {
    p.pa[g] = randn(p.PL * HV, 1.0f);
    p.pb[g] = randn(p.PL * HV, 1.0f);
  }
  for (int g = 0; g < G; ++g) {
    Layer& l = p.layers[g];
    // Distinct slots per request and column, different per group.
    std::vector<int32_t> slots;
    for (int32_t s = 1; s < kSlots; ++s) slots.push_back(s);
    std::shuffle(slots.begin(), slots.end(), rng);
    l.table.assign(slots.begin(), slots.begin() + p.N * (S + 1));
    l.conv_weight = randn(D * W, 0.5f);
    l.A_log = randn(HV, 0.5f);
    l.dt_bias = randn(HV, 0.1f);
    l.a = randn(p.L * HV, 1.0f);
    l.b = randn(p.L * HV, 1.0f);
    l.conv_pool = randn(kSlots * D * kBuf, 1.0f);
    l.state_pool = randn(kSlots * HV * V * K, 0.05f);
  }
  return p;
}

// The verify rows of one group, given where their slots, query starts and counts live.
struct VerifyRows {
  int64_t rows = 0, tokens = 0;
  const int32_t* state_indices = nullptr;  // [rows, S]
  const int32_t* cu_seqlens = nullptr;     // [rows + 1]
  const int32_t* accepted = nullptr;       // [rows]
  gdn::Device device{};
};

// conv then decode_mtp over the verify rows of group g, on the CPU or (stream) CUDA.
Status run_layer(const VerifyRows& v, const float* x, const float* conv_weight, const float* A_log,
                 const float* dt_bias, const float* a, const float* b, float* conv_pool,
                 float* state_pool, float* conv_out, float* out, void* stream) {
  const gdn::Device dev = v.device;
  gdn::conv::Params c;
  c.x = TensorView::make(x, DType::kFloat32, {v.tokens, D}, {}, dev);
  c.weight = TensorView::make(conv_weight, DType::kFloat32, {D, W}, {}, dev);
  c.conv_state = TensorView::make(conv_pool, DType::kFloat32, {kSlots, D, kBuf}, {}, dev);
  // The conv state slot of a verify row is its column 0.
  c.conv_state_indices = TensorView::make(v.state_indices, DType::kInt32, {v.rows}, {S}, dev);
  c.cu_seqlens = TensorView::make(v.cu_seqlens, DType::kInt32, {v.rows + 1}, {}, dev);
  c.num_accepted_tokens = TensorView::make(v.accepted, DType::kInt32, {v.rows}, {}, dev);
  c.out = TensorView::make(conv_out, DType::kFloat32, {v.tokens, D}, {}, dev);
  c.first_valid_slot = 1;
  gdn::decode_mtp::Params d;
  d.mixed_qkv = TensorView::make(conv_out, DType::kFloat32, {v.tokens, D}, {}, dev);
  d.a = TensorView::make(a, DType::kFloat32, {v.tokens, HV}, {}, dev);
  d.b = TensorView::make(b, DType::kFloat32, {v.tokens, HV}, {}, dev);
  d.A_log = TensorView::make(A_log, DType::kFloat32, {HV}, {}, dev);
  d.dt_bias = TensorView::make(dt_bias, DType::kFloat32, {HV}, {}, dev);
  d.state = TensorView::make(state_pool, DType::kFloat32, {kSlots, HV, V, K}, {}, dev);
  d.state_indices = TensorView::make(v.state_indices, DType::kInt32, {v.rows, S}, {}, dev);
  d.cu_seqlens = c.cu_seqlens;
  d.num_accepted_tokens = c.num_accepted_tokens;
  d.out = TensorView::make(out, DType::kFloat32, {v.tokens, HV, V}, {}, dev);
  d.first_valid_slot = 1;
  if (dev.type == gdn::DeviceType::kCPU) {
    GDN_RETURN_IF_ERROR(gdn::conv::run_cpu(c));
    return gdn::decode_mtp::run_cpu(d);
  }
#if defined(GDN_ENGINE_STEP_CUDA)
  GDN_RETURN_IF_ERROR(gdn::cuda_api::causal_conv1d_update(c, stream));
  return gdn::cuda_api::decode_mtp(d, stream);
#else
  (void)stream;
  return Status::unsupported("this build has no CUDA kernels");
#endif
}

// The prefill rows of one group, given where their slots and query starts live.
struct PrefillRows {
  int64_t rows = 0, tokens = 0;
  const int32_t* initial = nullptr;      // [rows] non_spec_source_indices (null id: zero state)
  const int32_t* final_slots = nullptr;  // [rows] non_spec_state_indices
  const int32_t* cu_seqlens = nullptr;   // [rows + 1]
  gdn::Device device{};
};

// causal_conv1d_prefill then prefill over the prefill rows of a group, one call each, on the CPU
// or (stream) CUDA. The conv history of a row that continues a state is in its destination slot
// (column 0); the caller passes it as the conv's initial slot only where that equals the SSM
// source (accepted count 1), so one index array serves both calls.
Status run_prefill_layer(const PrefillRows& r, const float* x, const float* conv_weight,
                         const float* A_log, const float* dt_bias, const float* a, const float* b,
                         float* conv_pool, float* state_pool, float* conv_out, float* out,
                         void* stream) {
  const gdn::Device dev = r.device;
  gdn::conv_prefill::Params c;
  c.x = TensorView::make(x, DType::kFloat32, {r.tokens, D}, {}, dev);
  c.weight = TensorView::make(conv_weight, DType::kFloat32, {D, W}, {}, dev);
  c.conv_state = TensorView::make(conv_pool, DType::kFloat32, {kSlots, D, kBuf}, {}, dev);
  c.initial_state_indices = TensorView::make(r.initial, DType::kInt32, {r.rows}, {}, dev);
  c.final_state_indices = TensorView::make(r.final_slots, DType::kInt32, {r.rows}, {}, dev);
  c.cu_seqlens = TensorView::make(r.cu_seqlens, DType::kInt32, {r.rows + 1}, {}, dev);
  c.out = TensorView::make(conv_out, DType::kFloat32, {r.tokens, D}, {}, dev);
  c.first_valid_slot = 1;
  gdn::prefill::Params d;
  d.mixed_qkv = TensorView::make(conv_out, DType::kFloat32, {r.tokens, D}, {}, dev);
  d.a = TensorView::make(a, DType::kFloat32, {r.tokens, HV}, {}, dev);
  d.b = TensorView::make(b, DType::kFloat32, {r.tokens, HV}, {}, dev);
  d.A_log = TensorView::make(A_log, DType::kFloat32, {HV}, {}, dev);
  d.dt_bias = TensorView::make(dt_bias, DType::kFloat32, {HV}, {}, dev);
  d.state = TensorView::make(state_pool, DType::kFloat32, {kSlots, HV, V, K}, {}, dev);
  d.initial_state_indices = c.initial_state_indices;
  d.final_state_indices = c.final_state_indices;
  d.cu_seqlens = c.cu_seqlens;
  d.out = TensorView::make(out, DType::kFloat32, {r.tokens, HV, V}, {}, dev);
  d.first_valid_slot = 1;
  if (dev.type == gdn::DeviceType::kCPU) {
    GDN_RETURN_IF_ERROR(gdn::conv_prefill::run_cpu(c));
    return gdn::prefill::run_cpu(d);
  }
#if defined(GDN_ENGINE_STEP_CUDA)
  GDN_RETURN_IF_ERROR(gdn::cuda_api::causal_conv1d_prefill(c, stream));
  return gdn::cuda_api::prefill(d, stream);
#else
  (void)stream;
  return Status::unsupported("this build has no CUDA kernels");
#endif
}

// The prefill step's host inputs as the builder takes them (no drafts, accepted counts 1).
gdn::metadata::StepInputs prefill_inputs(const Problem& p) {
  gdn::metadata::StepInputs in;
  in.query_start_loc = TensorView::make(p.p_qsl.data(), DType::kInt32, {p.N + 1});
  in.seq_lens = TensorView::make(p.p_seq_lens.data(), DType::kInt32, {p.N});
  in.num_computed_tokens = TensorView::make(p.p_computed.data(), DType::kInt32, {p.N});
  return in;
}

// The step's host inputs as the builder takes them.
gdn::metadata::StepInputs step_inputs(const Problem& p) {
  gdn::metadata::StepInputs in;
  in.query_start_loc = TensorView::make(p.qsl.data(), DType::kInt32, {p.N + 1});
  in.seq_lens = TensorView::make(p.seq_lens.data(), DType::kInt32, {p.N});
  in.num_draft_tokens = TensorView::make(p.drafts.data(), DType::kInt32, {p.N});
  in.num_accepted_tokens = TensorView::make(p.accepted.data(), DType::kInt32, {p.N});
  in.num_computed_tokens = TensorView::make(p.computed.data(), DType::kInt32, {p.N});
  return in;
}

gdn::metadata::BuilderConfig builder_config(const Problem& p, const int32_t* const tables[G],
                                            gdn::Device dev, int64_t max_tokens = 8 * S) {
  gdn::metadata::BuilderConfig c;
  c.num_groups = G;
  for (int g = 0; g < G; ++g)
    c.block_tables[g] = TensorView::make(tables[g], DType::kInt32, {p.N, S + 1}, {}, dev);
  c.num_spec = kNumSpec;
  c.max_rows = 8;
  c.max_tokens = max_tokens;
  c.pad_id = 0;  // slot 0 is the null block
  return c;
}

// Where the prefill step's prefill rows read and write, from a planned builder: this step has
// only prefill rows (non-spec rows of more than one token), in request order, so they are the
// non-spec rows and their tokens are the step's rows in order. Checks that, and that a row with an
// initial state continues from column 0 (accepted count 1), where its conv history is.
bool prefill_rows(const gdn::metadata::Builder& builder, const int32_t* plan, int64_t L, int g,
                  PrefillRows* r) {
  const gdn::metadata::Layout& lay = builder.layout();
  const int32_t* h = plan + lay.header;
  const int64_t n = h[gdn::metadata::kNumNonSpecRows];
  const int32_t* qsl = plan + lay.non_spec_query_start_loc;
  const auto* has_initial = reinterpret_cast<const uint8_t*>(plan + lay.has_initial_state);
  for (int64_t j = 0; j < n; ++j) {
    if (qsl[j + 1] - qsl[j] < 2)
      return fail("prefill rows", Status::invalid("a row of < 2 tokens"));
    if (has_initial[j] && plan[lay.non_spec_source_column + j] != 0)
      return fail("prefill rows", Status::invalid("a continuation not in column 0"));
  }
  for (int64_t t = 0; t < L; ++t)
    if (plan[lay.token_split + t] != t) return fail("token order", Status::invalid("unexpected"));
  if (h[gdn::metadata::kNumSpecDecodes] != 0 || h[gdn::metadata::kNumPrefills] != n ||
      h[gdn::metadata::kNumPrefillTokens] != L)
    return fail("prefill step counts", Status::invalid("unexpected"));
  const gdn::metadata::BuilderBuffers& buf = builder.buffers();
  const int64_t R = builder.config().max_rows;
  r->rows = n;
  r->tokens = L;
  r->initial = buf.non_spec_source_indices.ptr<const int32_t>() + g * R;
  r->final_slots = buf.non_spec_state_indices.ptr<const int32_t>() + g * R;
  r->cu_seqlens = qsl;
  return true;
}

// The CPU prefill step: builder, then conv prefill + prefill per group from the builder's buffers,
// checked against slots taken by hand; the layers' pools then hold what the step left.
bool cpu_prefill_step(Problem& p, Outputs (&result)[G]) {
  const int32_t* tables[G];
  for (int g = 0; g < G; ++g) tables[g] = p.layers[g].table.data();
  gdn::metadata::BuilderConfig config = builder_config(p, tables, {}, kMaxPrefillTokens);
  config.shadow = true;
  gdn::metadata::Builder builder;
  Status s = builder.initialize(config);
  if (!s) return fail("prefill builder initialize", s);
  s = builder.step(prefill_inputs(p));
  if (!s) return fail("prefill builder step", s);
  const int32_t* plan = builder.host_plan(builder.last_slot());
  const int32_t* h = plan + builder.layout().header;
  std::printf(
      "prefill step: %lld prefill rows (%lld tokens), %lld decodes, %lld verify rows\n",
      (long long)h[gdn::metadata::kNumPrefills], (long long)h[gdn::metadata::kNumPrefillTokens],
      (long long)h[gdn::metadata::kNumDecodes], (long long)h[gdn::metadata::kNumSpecDecodes]);
  for (int g = 0; g < G; ++g) {
    Layer& l = p.layers[g];
    PrefillRows r;
    if (!prefill_rows(builder, plan, p.PL, g, &r)) return false;
    std::printf("group %d:", g);
    for (int64_t j = 0; j < r.rows; ++j)
      std::printf(" request %d %d tokens, slot %d -> %d;",
                  plan[builder.layout().non_spec_request + j],
                  r.cu_seqlens[j + 1] - r.cu_seqlens[j], r.initial[j], r.final_slots[j]);
    std::printf(" (0: null, a zero state)\n");
    Outputs& o = result[g];
    o.conv_pool = l.conv_pool;
    o.state_pool = l.state_pool;
    o.conv_out.assign(size_t(p.PL * D), NAN);
    o.out.assign(size_t(p.PL * HV * V), NAN);
    s = run_prefill_layer(r, p.px.data(), l.conv_weight.data(), l.A_log.data(), l.dt_bias.data(),
                          p.pa[g].data(), p.pb[g].data(), o.conv_pool.data(), o.state_pool.data(),
                          o.conv_out.data(), o.out.data(), nullptr);
    if (!s) return fail("conv prefill + prefill", s);

    // By hand: request i reads column 0 of its row if it has tokens in its state (null
    // otherwise) and writes column 0.
    std::vector<int32_t> initial, final_slots;
    for (int64_t i = 0; i < p.N; ++i) {
      const int32_t column0 = l.table[size_t(i * (S + 1))];
      initial.push_back(kPrefill[size_t(i)].context > 0 ? column0 : 0);
      final_slots.push_back(column0);
    }
    PrefillRows w = r;
    w.initial = initial.data();
    w.final_slots = final_slots.data();
    w.cu_seqlens = p.p_qsl.data();
    Outputs ref;
    ref.conv_pool = l.conv_pool;
    ref.state_pool = l.state_pool;
    ref.conv_out.assign(o.conv_out.size(), NAN);
    ref.out.assign(o.out.size(), NAN);
    s = run_prefill_layer(w, p.px.data(), l.conv_weight.data(), l.A_log.data(), l.dt_bias.data(),
                          p.pa[g].data(), p.pb[g].data(), ref.conv_pool.data(),
                          ref.state_pool.data(), ref.conv_out.data(), ref.out.data(), nullptr);
    if (!s) return fail("conv prefill + prefill (slots by hand)", s);
    if (o.out != ref.out || o.state_pool != ref.state_pool || o.conv_pool != ref.conv_pool)
      return fail("prefill outputs", Status::invalid("differ from the slots-by-hand run"));
    for (float e : o.out)
      if (!std::isfinite(e)) return fail("prefill outputs", Status::invalid("not finite"));
    l.conv_pool = o.conv_pool;  // the verify step runs on what the prefill step left
    l.state_pool = o.state_pool;
  }
  std::printf("ok: CPU prefill step (builder -> causal_conv1d_prefill -> prefill, %d groups)\n", G);
  return true;
}

// The CPU step: builder, then conv + decode_mtp per group from the builder's buffers.
bool cpu_step(Problem& p, Outputs (&result)[G]) {
  const int32_t* tables[G];
  for (int g = 0; g < G; ++g) tables[g] = p.layers[g].table.data();
  gdn::metadata::BuilderConfig config = builder_config(p, tables, {});
  config.shadow = true;  // debug switch: every step checked against per-group builds
  gdn::metadata::Builder builder;
  Status s = builder.initialize(config);
  if (!s) return fail("metadata builder initialize", s);
  s = builder.step(step_inputs(p));
  if (!s) return fail("metadata builder step", s);

  const gdn::metadata::Layout& lay = builder.layout();
  const int32_t* plan = builder.host_plan(builder.last_slot());
  const int32_t* h = plan + lay.header;
  const int64_t rows = h[gdn::metadata::kNumSpecDecodes];
  const int64_t tokens = h[gdn::metadata::kNumSpecDecodeTokens];
  std::printf("step: %lld verify rows (%lld tokens), %lld prefills, %lld decodes\n",
              (long long)rows, (long long)tokens, (long long)h[gdn::metadata::kNumPrefills],
              (long long)h[gdn::metadata::kNumDecodes]);
  // The verify rows' tokens lead the batch (the request without drafts comes last).
  const int32_t* spec_tokens = plan + lay.token_split + (p.L - tokens);
  for (int64_t t = 0; t < tokens; ++t)
    if (spec_tokens[t] != t) return fail("token order", Status::invalid("unexpected"));

  const gdn::metadata::BuilderBuffers& buf = builder.buffers();
  const int64_t R = config.max_rows;
  for (int g = 0; g < G; ++g) {
    Layer& l = p.layers[g];
    const int32_t* ns_dst = buf.non_spec_state_indices.ptr<const int32_t>() + g * R;
    const int32_t* ns_src = buf.non_spec_source_indices.ptr<const int32_t>() + g * R;
    const int32_t request = plan[lay.non_spec_request];
    std::printf(
        "group %d: request %d (no drafts) reads slot %d (column acc - 1 = %d), "
        "writes slot %d\n",
        g, request, ns_src[0], p.accepted[size_t(request)] - 1, ns_dst[0]);
    const int32_t* row = l.table.data() + request * (S + 1);
    if (ns_src[0] != row[p.accepted[size_t(request)] - 1] || ns_dst[0] != row[0])
      return fail("non-spec slots", Status::invalid("wrong slot"));

    // From the builder's buffers ...
    VerifyRows v;
    v.rows = rows;
    v.tokens = tokens;
    v.state_indices = buf.spec_state_indices.ptr<const int32_t>() + g * R * S;
    v.cu_seqlens = plan + lay.spec_query_start_loc;
    v.accepted = plan + lay.spec_num_accepted;
    Outputs& o = result[g];
    o.conv_pool = l.conv_pool;
    o.state_pool = l.state_pool;
    o.conv_out.assign(size_t(tokens * D), NAN);
    o.out.assign(size_t(tokens * HV * V), NAN);
    s = run_layer(v, p.x.data(), l.conv_weight.data(), l.A_log.data(), l.dt_bias.data(), l.a.data(),
                  l.b.data(), o.conv_pool.data(), o.state_pool.data(), o.conv_out.data(),
                  o.out.data(), nullptr);
    if (!s) return fail("conv + decode_mtp", s);

    // ... and from slots taken from the block table by hand: identical, bit for bit.
    std::vector<int32_t> by_hand, cu = {0}, acc;
    for (int64_t i = 0; i < p.N; ++i) {
      if (p.drafts[size_t(i)] < 0) continue;
      for (int64_t c = 0; c < S; ++c) by_hand.push_back(l.table[size_t(i * (S + 1) + c)]);
      cu.push_back(cu.back() + kRequests[size_t(i)].tokens);
      acc.push_back(p.accepted[size_t(i)]);
    }
    VerifyRows w = v;
    w.state_indices = by_hand.data();
    w.cu_seqlens = cu.data();
    w.accepted = acc.data();
    Outputs ref;
    ref.conv_pool = l.conv_pool;
    ref.state_pool = l.state_pool;
    ref.conv_out.assign(o.conv_out.size(), NAN);
    ref.out.assign(o.out.size(), NAN);
    s = run_layer(w, p.x.data(), l.conv_weight.data(), l.A_log.data(), l.dt_bias.data(), l.a.data(),
                  l.b.data(), ref.conv_pool.data(), ref.state_pool.data(), ref.conv_out.data(),
                  ref.out.data(), nullptr);
    if (!s) return fail("conv + decode_mtp (slots by hand)", s);
    if (o.out != ref.out || o.state_pool != ref.state_pool || o.conv_pool != ref.conv_pool)
      return fail("group outputs", Status::invalid("differ from the slots-by-hand run"));
    for (float e : o.out)
      if (!std::isfinite(e)) return fail("group outputs", Status::invalid("not finite"));
  }
  std::printf("ok: CPU engine step (builder -> conv -> decode_mtp, %d groups)\n", G);
  return true;
}

#if defined(GDN_ENGINE_STEP_CUDA)

// Device copies (freed with the object).
struct DeviceMemory {
  std::vector<void*> owned;
  ~DeviceMemory() {
    for (void* p : owned) cudaFree(p);
  }
  template <class T>
  T* copy(const std::vector<T>& host) {
    void* p = nullptr;
    if (cudaMalloc(&p, host.size() * sizeof(T)) != cudaSuccess) return nullptr;
    owned.push_back(p);
    cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return static_cast<T*>(p);
  }
  template <class T>
  static std::vector<T> back(const T* p, size_t n) {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

// The prefill step on the GPU from the same pools: a CUDA builder, then conv prefill + prefill per
// group on the stream, compared with the CPU prefill step. The CUDA prefill kernel is the chunked
// form with bf16 operands: within 2e-2 relative L2 of the CPU path (which equals token-by-token
// fp32 bit for bit); the conv prefill is exact fp32.
bool cuda_prefill_step(const Problem& p, const Outputs (&cpu)[G]) {
  DeviceMemory dev;
  const gdn::Device cuda{gdn::DeviceType::kCUDA, 0};
  const int32_t* tables[G];
  for (int g = 0; g < G; ++g) tables[g] = dev.copy(p.layers[g].table);
  gdn::metadata::Builder builder;
  Status s = builder.initialize(builder_config(p, tables, cuda, kMaxPrefillTokens),
                                &gdn::cuda_api::metadata_builder_ops());
  if (!s) return fail("CUDA prefill builder initialize", s);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) return fail("stream", Status::invalid("none"));
  s = builder.step(prefill_inputs(p), stream);
  if (!s) return fail("CUDA prefill builder step", s);
  const int32_t* plan = builder.host_plan(builder.last_slot());
  const int32_t* device_plan = builder.buffers().device_plan.ptr<const int32_t>();
  bool ok = true;
  for (int g = 0; g < G && ok; ++g) {
    const Layer& l = p.layers[g];
    PrefillRows r;
    if (!prefill_rows(builder, plan, p.PL, g, &r)) return false;
    r.cu_seqlens = device_plan + builder.layout().non_spec_query_start_loc;
    r.device = cuda;
    float* conv_pool = dev.copy(l.conv_pool);
    float* state_pool = dev.copy(l.state_pool);
    float* conv_out = dev.copy(std::vector<float>(size_t(p.PL * D), 0.0f));
    float* out = dev.copy(std::vector<float>(size_t(p.PL * HV * V), 0.0f));
    s = run_prefill_layer(r, dev.copy(p.px), dev.copy(l.conv_weight), dev.copy(l.A_log),
                          dev.copy(l.dt_bias), dev.copy(p.pa[g]), dev.copy(p.pb[g]), conv_pool,
                          state_pool, conv_out, out, stream);
    if (!s) return fail("CUDA conv prefill + prefill", s);
    cudaStreamSynchronize(stream);
    const double e_out = rel_diff(DeviceMemory::back(out, cpu[g].out.size()), cpu[g].out);
    const double e_state =
        rel_diff(DeviceMemory::back(state_pool, cpu[g].state_pool.size()), cpu[g].state_pool);
    const double e_conv_out =
        rel_diff(DeviceMemory::back(conv_out, cpu[g].conv_out.size()), cpu[g].conv_out);
    const double e_conv =
        rel_diff(DeviceMemory::back(conv_pool, cpu[g].conv_pool.size()), cpu[g].conv_pool);
    std::printf(
        "prefill group %d on CUDA vs CPU: relative difference out %.2e, state %.2e, conv out "
        "%.2e, conv %.2e\n",
        g, e_out, e_state, e_conv_out, e_conv);
    ok = e_out <= 2e-2 && e_state <= 2e-2 && e_conv_out <= 1e-5 && e_conv <= 1e-6;
  }
  cudaStreamDestroy(stream);
  if (!ok) return fail("CUDA prefill step", Status::invalid("differs from the CPU step"));
  std::printf(
      "ok: CUDA prefill step (one metadata launch, then conv prefill -> prefill per group)\n");
  return true;
}

// The same step on the GPU: a CUDA builder (one plan copy + one launch for both groups), then
// conv + decode_mtp per group on the stream, compared with the CPU step.
bool cuda_step(const Problem& p, const Outputs (&cpu)[G]) {
  DeviceMemory dev;
  const gdn::Device cuda{gdn::DeviceType::kCUDA, 0};
  const int32_t* tables[G];
  for (int g = 0; g < G; ++g) tables[g] = dev.copy(p.layers[g].table);
  gdn::metadata::Builder builder;
  Status s =
      builder.initialize(builder_config(p, tables, cuda), &gdn::cuda_api::metadata_builder_ops());
  if (!s) return fail("CUDA metadata builder initialize", s);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) return fail("stream", Status::invalid("none"));
  s = builder.step(step_inputs(p), stream);
  if (!s) return fail("CUDA metadata builder step", s);
  const int32_t* h = builder.host_plan(builder.last_slot()) + builder.layout().header;
  const gdn::metadata::Layout& lay = builder.layout();
  const int32_t* device_plan = builder.buffers().device_plan.ptr<const int32_t>();
  const int64_t R = builder.config().max_rows;
  bool ok = true;
  for (int g = 0; g < G && ok; ++g) {
    const Layer& l = p.layers[g];
    VerifyRows v;
    v.rows = h[gdn::metadata::kNumSpecDecodes];
    v.tokens = h[gdn::metadata::kNumSpecDecodeTokens];
    v.state_indices = builder.buffers().spec_state_indices.ptr<const int32_t>() + g * R * S;
    v.cu_seqlens = device_plan + lay.spec_query_start_loc;
    v.accepted = device_plan + lay.spec_num_accepted;
    v.device = cuda;
    float* conv_pool = dev.copy(l.conv_pool);
    float* state_pool = dev.copy(l.state_pool);
    float* conv_out = dev.copy(std::vector<float>(size_t(v.tokens * D), 0.0f));
    float* out = dev.copy(std::vector<float>(size_t(v.tokens * HV * V), 0.0f));
    s = run_layer(v, dev.copy(p.x), dev.copy(l.conv_weight), dev.copy(l.A_log), dev.copy(l.dt_bias),
                  dev.copy(l.a), dev.copy(l.b), conv_pool, state_pool, conv_out, out, stream);
    if (!s) return fail("CUDA conv + decode_mtp", s);
    cudaStreamSynchronize(stream);
    const double e_out = rel_diff(DeviceMemory::back(out, cpu[g].out.size()), cpu[g].out);
    const double e_state =
        rel_diff(DeviceMemory::back(state_pool, cpu[g].state_pool.size()), cpu[g].state_pool);
    const double e_conv =
        rel_diff(DeviceMemory::back(conv_pool, cpu[g].conv_pool.size()), cpu[g].conv_pool);
    std::printf("group %d on CUDA vs CPU: relative difference out %.2e, state %.2e, conv %.2e\n", g,
                e_out, e_state, e_conv);
    ok = e_out <= 1e-5 && e_state <= 1e-5 && e_conv <= 1e-6;
  }
  cudaStreamDestroy(stream);
  if (!ok) return fail("CUDA step", Status::invalid("differs from the CPU step"));
  std::printf("ok: CUDA engine step (one metadata launch, then conv -> decode_mtp per group)\n");
  return true;
}

#endif

}  // namespace

int main() {
  Problem p = make_problem();
  const Problem before_prefill = p;
  Outputs cpu_prefill[G], cpu[G];
  if (!cpu_prefill_step(p, cpu_prefill)) return 1;  // leaves its pools in p for the next step
  if (!cpu_step(p, cpu)) return 1;
#if defined(GDN_ENGINE_STEP_CUDA)
  std::string why = "the CUDA driver sees no device";
  if (gdn::cuda_api::device_count() > 0 && gdn::cuda_api::kernels_available(0, &why)) {
    if (!cuda_prefill_step(before_prefill, cpu_prefill)) return 1;
    if (!cuda_step(p, cpu)) return 1;  // from the CPU prefill step's pools
  } else {
    std::printf("CUDA: skipped (no GPU usable: %s)\n", why.c_str());
  }
#else
  (void)before_prefill;
  std::printf("CUDA: not in this package (built without gdn::kernels)\n");
#endif
  return 0;
}
