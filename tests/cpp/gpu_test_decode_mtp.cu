// decode_mtp on CUDA against the CPU path (run_cpu) and against a float64 reference of this file,
// on fresh random data with poisoned outputs; hostile device-side indices with the error counter;
// CUDA-graph capture and replay. Skips (with the reason) when no CUDA device is usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/decode_mtp/cuda.cuh"
#include "gpu_skip.hpp"

namespace {

using gdn::DType;
using gdn::StateLayout;
using gdn::TensorView;
using gdn::decode_mtp::Params;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

// A host array of a run-time float dtype (bytes + element count) and its device twin.
struct Array {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape, strides;  // strides in elements
  std::vector<unsigned char> host;
  void* device = nullptr;

  Array() = default;
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  ~Array() {
    if (device) cudaFree(device);
  }
  int64_t storage_elems() const { return int64_t(host.size()) / gdn::dtype_size(dtype); }
  void init(DType t, std::vector<int64_t> shp, std::vector<int64_t> str = {}) {
    dtype = t;
    shape = std::move(shp);
    if (str.empty()) {
      str.assign(shape.size(), 1);
      for (int d = int(shape.size()) - 2; d >= 0; --d) str[d] = str[d + 1] * shape[d + 1];
    }
    strides = std::move(str);
    int64_t extent = 1;  // one past the last element
    for (size_t d = 0; d < shape.size(); ++d)
      if (shape[d] > 0) extent += (shape[d] - 1) * strides[d];
    if (shape.empty()) extent = 1;
    for (int64_t s : shape)
      if (s == 0) extent = 0;
    host.assign(size_t(std::max<int64_t>(extent, 1) * gdn::dtype_size(t)), 0);
  }
  float get(int64_t i) const { return gdn::load_float(host.data(), dtype, i); }
  void set(int64_t i, float v) { gdn::store_float(host.data(), dtype, i, v); }
  int64_t get_index(int64_t i) const { return gdn::load_index(host.data(), dtype, i); }
  void set_index(int64_t i, int64_t v) {
    if (dtype == DType::kInt64)
      reinterpret_cast<int64_t*>(host.data())[i] = v;
    else
      reinterpret_cast<int32_t*>(host.data())[i] = int32_t(v);
  }
  void fill_random(std::mt19937& rng, float scale) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t i = 0; i < storage_elems(); ++i) set(i, scale * nd(rng));
  }
  void fill_nan() {
    for (int64_t i = 0; i < storage_elems(); ++i) set(i, NAN);
  }
  void upload() {
    if (!device) ASSERT_EQ(cudaMalloc(&device, host.size()), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(host.size());
    EXPECT_EQ(cudaMemcpy(out.data(), device, host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  TensorView view(bool on_device) const {
    TensorView v;
    v.data = on_device ? device : const_cast<unsigned char*>(host.data());
    v.dtype = dtype;
    v.ndim = int(shape.size());
    for (int d = 0; d < v.ndim; ++d) {
      v.shape[d] = shape[d];
      v.strides[d] = strides[d];
    }
    v.device = on_device ? gdn::Device{gdn::DeviceType::kCUDA, 0} : gdn::Device{};
    return v;
  }
};

struct Config {
  int H = 2, ratio = 2, N = 3, S = 4;
  std::vector<int> T;    // per request
  std::vector<int> acc;  // per request (empty: num_accepted_tokens absent)
  DType state = DType::kFloat32, act = DType::kFloat32, index = DType::kInt32;
  StateLayout layout = StateLayout::kVK;
  bool sigmoid_gate = false, norm = true, gate = true;
  int64_t slot_pad = 0;  // extra elements per slot (paged pool)
  int64_t row_pad = 0;   // extra elements per mixed_qkv / a / b / z row
  int first_valid_slot = 0;
  bool null_dest = false;  // make some destinations null
  // StepArgs' input options: a then holds log-decays <= 0 (A_log, dt_bias absent), b betas.
  bool a_is_log_decay = false, b_is_beta = false, qk_l2_norm = true;
  uint32_t seed = 1;
};

constexpr int kDim = 128;

// Everything one call needs, host and device.
struct Problem {
  Config cfg;
  int HV = 0, L = 0, num_slots = 0;
  Array qkv, a, b, A_log, dt_bias, z, norm_w, state, idx, cu, acc, out;

  void build(const Config& c) {
    cfg = c;
    HV = c.H * c.ratio;
    std::mt19937 rng(c.seed);
    std::vector<int64_t> cu_v(size_t(c.N) + 1, 0);
    for (int i = 0; i < c.N; ++i) cu_v[size_t(i) + 1] = cu_v[size_t(i)] + c.T[size_t(i)];
    L = int(cu_v.back());
    const int64_t width = 2 * int64_t(c.H) * kDim + int64_t(HV) * kDim;
    qkv.init(c.act, {L, width}, {width + c.row_pad, 1});
    qkv.fill_random(rng, 1.0f);
    if (!c.qk_l2_norm)  // q and k used as given: rows of norm near 1 keep the recurrence stable
      for (int64_t l = 0; l < L; ++l)
        for (int64_t e = 0; e < 2 * int64_t(c.H) * kDim; ++e)
          qkv.set(l * qkv.strides[0] + e, qkv.get(l * qkv.strides[0] + e) / std::sqrt(float(kDim)));
    // a and b: two halves of one [L, 2 HV (+pad)] buffer, as engines pass them.
    a.init(c.act, {L, HV}, {2 * HV + c.row_pad, 1});
    b.init(c.act, {L, HV}, {2 * HV + c.row_pad, 1});
    a.fill_random(rng, 1.0f);
    b.fill_random(rng, 1.0f);
    for (int64_t l = 0; l < L; ++l)
      for (int hv = 0; hv < HV; ++hv) {
        const int64_t e = l * a.strides[0] + hv;
        if (c.a_is_log_decay) a.set(e, -0.5f * std::fabs(a.get(e)));
        if (c.b_is_beta) b.set(e, 1.0f / (1.0f + std::exp(-b.get(e))));
      }
    A_log.init(DType::kFloat32, {HV});
    A_log.fill_random(rng, 0.5f);
    dt_bias.init(c.act, {HV});
    dt_bias.fill_random(rng, 0.1f);
    z.init(c.act, {L, HV, kDim}, {int64_t(HV) * kDim + c.row_pad, kDim, 1});
    z.fill_random(rng, 1.0f);
    norm_w.init(c.act, {kDim});
    norm_w.fill_random(rng, 1.0f);
    // Pool: every request owns S distinct slots; a few spare slots nobody owns.
    num_slots = c.first_valid_slot + c.N * c.S + 3;
    const int64_t slot_elems = int64_t(HV) * kDim * kDim;
    state.init(c.state, {num_slots, HV, kDim, kDim},
               {slot_elems + c.slot_pad, kDim * kDim, kDim, 1});
    state.fill_random(rng, 0.1f);
    idx.init(c.index, {c.N, c.S});
    std::vector<int> perm(size_t(c.N * c.S));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = c.first_valid_slot + 1 + int(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < c.N * c.S; ++i) idx.set_index(i, perm[size_t(i)]);
    if (c.null_dest)  // null every other destination that is not a row's source
      for (int i = 0; i < c.N; ++i)
        for (int t = 0; t < c.S; ++t) {
          const int src_col = c.acc.empty() ? 0 : c.acc[size_t(i)] - 1;
          if (t != src_col && (t + i) % 2 == 0) idx.set_index(int64_t(i) * c.S + t, -1);
        }
    cu.init(c.index, {c.N + 1});
    for (int i = 0; i <= c.N; ++i) cu.set_index(i, cu_v[size_t(i)]);
    if (!c.acc.empty()) {
      acc.init(c.index, {c.N});
      for (int i = 0; i < c.N; ++i) acc.set_index(i, c.acc[size_t(i)]);
    }
    out.init(c.act, {L, HV, kDim});
    out.fill_nan();
  }

  void upload_all() {
    for (Array* x : {&qkv, &a, &b, &A_log, &dt_bias, &z, &norm_w, &state, &idx, &cu, &out})
      x->upload();
    if (!cfg.acc.empty()) acc.upload();
  }

  Params params(bool dev) const {
    Params p;
    p.mixed_qkv = qkv.view(dev);
    p.a = a.view(dev);
    p.b = b.view(dev);
    if (!cfg.a_is_log_decay) {
      p.A_log = A_log.view(dev);
      p.dt_bias = dt_bias.view(dev);
    }
    p.a_is_log_decay = cfg.a_is_log_decay;
    p.b_is_beta = cfg.b_is_beta;
    p.qk_l2_norm = cfg.qk_l2_norm;
    if (cfg.norm) {
      p.norm_weight = norm_w.view(dev);
      if (cfg.gate) p.z = z.view(dev);
    }
    p.state = state.view(dev);
    p.state_indices = idx.view(dev);
    p.cu_seqlens = cu.view(dev);
    if (!cfg.acc.empty()) p.num_accepted_tokens = acc.view(dev);
    p.out = out.view(dev);
    p.gate = cfg.sigmoid_gate ? gdn::GateActivation::kSigmoid : gdn::GateActivation::kSiLU;
    p.layout = cfg.layout;
    p.first_valid_slot = cfg.first_valid_slot;
    return p;
  }

  // Layout-aware element (slot, hv, v, k) of the pool.
  int64_t state_offset(int64_t slot, int hv, int v, int k) const {
    const int64_t head = slot * state.strides[0] + int64_t(hv) * kDim * kDim;
    return cfg.layout == StateLayout::kVK ? head + int64_t(v) * kDim + k
                                          : head + int64_t(k) * kDim + v;
  }
};

// float64 reference on the host arrays: returns out [L, HV, V] and the whole pool after the call.
void reference(const Problem& pb, std::vector<double>* out, std::vector<double>* pool) {
  const Config& c = pb.cfg;
  const int HV = pb.HV, H = c.H;
  pool->assign(size_t(pb.state.storage_elems()), 0.0);
  for (int64_t e = 0; e < pb.state.storage_elems(); ++e) (*pool)[size_t(e)] = pb.state.get(e);
  out->assign(size_t(pb.L) * HV * kDim, NAN);
  const double scale = 1.0 / std::sqrt(double(kDim));
  std::vector<double> M(size_t(kDim) * kDim), q(kDim), k(kDim), o(kDim);
  for (int i = 0; i < c.N; ++i) {
    const int64_t begin = pb.cu.get_index(i);
    const int T = int(pb.cu.get_index(i + 1) - begin);
    if (T == 0) continue;
    const int acc = c.acc.empty() ? 1 : int(pb.acc.get_index(i));
    const int64_t src = pb.idx.get_index(int64_t(i) * c.S + acc - 1);
    for (int hv = 0; hv < HV; ++hv) {
      const int h = hv / c.ratio;
      for (int v = 0; v < kDim; ++v)
        for (int kk = 0; kk < kDim; ++kk)
          M[size_t(v) * kDim + kk] = (*pool)[size_t(pb.state_offset(src, hv, v, kk))];
      const double A = -std::exp(double(pb.A_log.get(hv)));
      for (int t = 0; t < T; ++t) {
        const int64_t l = begin + t;
        const int64_t row = l * pb.qkv.strides[0];
        double qq = 0, kq = 0;
        for (int d = 0; d < kDim; ++d) {
          q[size_t(d)] = pb.qkv.get(row + int64_t(h) * kDim + d);
          k[size_t(d)] = pb.qkv.get(row + int64_t(H + h) * kDim + d);
          qq += q[size_t(d)] * q[size_t(d)];
          kq += k[size_t(d)] * k[size_t(d)];
        }
        const double qs = c.qk_l2_norm ? scale / std::sqrt(qq + 1e-6) : scale;
        const double ks = c.qk_l2_norm ? 1.0 / std::sqrt(kq + 1e-6) : 1.0;
        for (int d = 0; d < kDim; ++d) q[size_t(d)] *= qs, k[size_t(d)] *= ks;
        const double av = pb.a.get(l * pb.a.strides[0] + hv);
        const double x = av + pb.dt_bias.get(hv);
        const double sp = x > 20 ? x : std::log1p(std::exp(x));
        const double alpha = std::exp(c.a_is_log_decay ? av : A * sp);
        const double bv = pb.b.get(l * pb.b.strides[0] + hv);
        const double beta = c.b_is_beta ? bv : 1.0 / (1.0 + std::exp(-bv));
        double ss = 0;
        for (int v = 0; v < kDim; ++v) {
          double* Mr = &M[size_t(v) * kDim];
          double u = 0;
          for (int d = 0; d < kDim; ++d) u += (Mr[d] *= alpha) * k[size_t(d)];
          const double vv = pb.qkv.get(row + int64_t(2 * H + hv) * kDim + v);
          const double delta = beta * (vv - u);
          double od = 0;
          for (int d = 0; d < kDim; ++d) od += (Mr[d] += k[size_t(d)] * delta) * q[size_t(d)];
          o[size_t(v)] = od;
          ss += od * od;
        }
        const double rstd = 1.0 / std::sqrt(ss / kDim + 1e-6);
        for (int v = 0; v < kDim; ++v) {
          double y = o[size_t(v)];
          if (c.norm) {
            y = y * rstd * pb.norm_w.get(v);
            if (c.gate) {
              const double zz = pb.z.get(l * pb.z.strides[0] + int64_t(hv) * kDim + v);
              const double sg = 1.0 / (1.0 + std::exp(-zz));
              y *= c.sigmoid_gate ? sg : zz * sg;
            }
          }
          (*out)[size_t((l * HV + hv) * kDim + v)] = y;
        }
        const int64_t dest = pb.idx.get_index(int64_t(i) * c.S + t);
        if (dest >= c.first_valid_slot)
          for (int v = 0; v < kDim; ++v)
            for (int kk = 0; kk < kDim; ++kk)
              (*pool)[size_t(pb.state_offset(dest, hv, v, kk))] = M[size_t(v) * kDim + kk];
      }
    }
  }
}

double rel_l2(const std::vector<double>& ref, const Array& got, const std::vector<size_t>& which) {
  double num = 0, den = 0;
  for (size_t e : which) {
    const double d = double(got.get(int64_t(e))) - ref[e];
    num += d * d;
    den += ref[e] * ref[e];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Elements of the pool some valid request writes (its non-null destination slots, all heads).
std::vector<size_t> written_elements(const Problem& pb) {
  std::vector<size_t> e;
  for (int i = 0; i < pb.cfg.N; ++i) {
    const int T = int(pb.cu.get_index(i + 1) - pb.cu.get_index(i));
    for (int t = 0; t < T; ++t) {
      const int64_t slot = pb.idx.get_index(int64_t(i) * pb.cfg.S + t);
      if (slot < pb.cfg.first_valid_slot) continue;
      const int64_t base = slot * pb.state.strides[0];
      for (int64_t x = 0; x < int64_t(pb.HV) * kDim * kDim; ++x) e.push_back(size_t(base + x));
    }
  }
  return e;
}

// Runs `cfg` on CUDA and on the CPU path, checks both against the float64 reference.
void check_config(const Config& cfg) {
  Problem gpu, cpu;
  gpu.build(cfg);
  cpu.build(cfg);
  std::vector<double> ref_out, ref_pool;
  reference(gpu, &ref_out, &ref_pool);
  gpu.upload_all();

  const gdn::Status st = gdn::decode_mtp::launch_cuda(gpu.params(true), nullptr);
  ASSERT_TRUE(st.is_ok()) << st.reason();
  CUDA_OK(cudaDeviceSynchronize());
  gpu.out.host = gpu.out.download();
  const std::vector<unsigned char> pool_before = gpu.state.host;
  gpu.state.host = gpu.state.download();

  const gdn::Status cs = gdn::decode_mtp::run_cpu(cpu.params(false));
  ASSERT_TRUE(cs.is_ok()) << cs.reason();

  const bool exact_inputs = cfg.act == DType::kFloat32;
  const double out_bar = exact_inputs && cfg.state == DType::kFloat32 ? 1e-5 : 4e-3;
  const double state_bar = cfg.state == DType::kFloat32 ? 1e-5 : 1e-2;
  std::vector<size_t> all_out(ref_out.size());
  for (size_t e = 0; e < all_out.size(); ++e) all_out[e] = e;
  const std::string what = "state " + std::string(gdn::to_string(cfg.state)) + ", act " +
                           std::string(gdn::to_string(cfg.act)) + ", ratio " +
                           std::to_string(cfg.ratio) + ", S " + std::to_string(cfg.S);
  for (size_t e = 0; e < ref_out.size(); ++e)
    ASSERT_FALSE(std::isnan(gpu.out.get(int64_t(e))))
        << "output element " << e << " not written; " << what;
  EXPECT_LE(rel_l2(ref_out, gpu.out, all_out), out_bar) << "CUDA out vs float64; " << what;
  EXPECT_LE(rel_l2(ref_out, cpu.out, all_out), out_bar) << "CPU out vs float64; " << what;

  const std::vector<size_t> written = written_elements(gpu);
  EXPECT_LE(rel_l2(ref_pool, gpu.state, written), state_bar) << "CUDA state vs float64; " << what;
  // CUDA and CPU agree closely, and every element nobody owns is untouched, bit for bit.
  std::vector<char> owned(gpu.state.host.size() / size_t(gdn::dtype_size(cfg.state)), 0);
  for (size_t e : written) owned[e] = 1;
  const size_t es = size_t(gdn::dtype_size(cfg.state));
  for (size_t e = 0; e < owned.size(); ++e)
    if (!owned[e])
      ASSERT_EQ(std::memcmp(&gpu.state.host[e * es], &pool_before[e * es], es), 0)
          << "pool element " << e << " changed but belongs to no destination; " << what;
  double num = 0, den = 0;
  for (size_t e : written) {
    const double d = double(gpu.state.get(int64_t(e))) - cpu.state.get(int64_t(e));
    num += d * d;
    den += double(cpu.state.get(int64_t(e))) * cpu.state.get(int64_t(e));
  }
  EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), state_bar) << "CUDA vs CPU state; " << what;
}

TEST(DecodeMtpCuda, MatchesCpuAndFloat64AcrossRatiosAndDtypes) {
  GDN_SKIP_WITHOUT_GPU();
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  int seed = 10;
  for (int ratio : {1, 2, 3, 4, 8, 5}) {
    for (DType state : dtypes) {
      Config c;
      c.H = ratio == 8 ? 1 : 2;
      c.ratio = ratio;
      c.N = 3;
      c.S = 4;
      c.T = {4, 1, 3};
      c.acc = {2, 4, 1};
      c.state = state;
      c.act = dtypes[seed % 3];
      c.seed = uint32_t(seed++);
      check_config(c);
    }
  }
}

TEST(DecodeMtpCuda, LayoutsStridesNullSlotsAndGates) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.N = 4;
  c.S = 5;
  c.T = {5, 0, 2, 3};
  c.acc = {3, 1, 5, 2};
  c.index = DType::kInt64;
  for (StateLayout layout : {StateLayout::kVK, StateLayout::kKV}) {
    for (int variant = 0; variant < 3; ++variant) {
      c.layout = layout;
      c.slot_pad = variant == 1 ? 4 : (variant == 2 ? 3 : 0);  // 3: unaligned slots
      c.row_pad = variant == 2 ? 5 : 8;
      c.null_dest = variant != 0;
      c.first_valid_slot = variant == 1 ? 1 : 0;
      c.sigmoid_gate = variant == 1;
      c.norm = variant != 2;
      c.state = variant == 0 ? DType::kFloat32 : DType::kBFloat16;
      c.act = variant == 2 ? DType::kFloat32 : DType::kBFloat16;
      c.seed = uint32_t(100 + variant + 10 * int(layout));
      check_config(c);
    }
  }
}

TEST(DecodeMtpCuda, LongRowsAndSmallBatch) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.H = 1;
  c.ratio = 1;
  c.N = 1;
  c.S = 16;  // kCudaMaxSpecColumns
  c.T = {16};
  c.acc = {7};
  c.seed = 7;
  check_config(c);
  c.N = 2;
  c.S = 9;
  c.T = {9, 1};
  c.acc = {9, 1};
  c.acc.clear();  // num_accepted_tokens absent: all 1
  c.seed = 8;
  check_config(c);
}

// StepArgs' input options (a_is_log_decay with A_log and dt_bias absent, b_is_beta, qk_l2_norm
// off), alone and together, in both layouts and every state dtype.
TEST(DecodeMtpCuda, InputOptions) {
  GDN_SKIP_WITHOUT_GPU();
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (int options = 1; options < 8; ++options) {
    Config c;
    c.H = 2;
    c.ratio = options % 2 == 0 ? 3 : 2;
    c.N = 3;
    c.S = 4;
    c.T = {4, 1, 3};
    c.acc = {2, 4, 1};
    c.a_is_log_decay = options & 1;
    c.b_is_beta = options & 2;
    c.qk_l2_norm = !(options & 4);
    c.layout = options % 3 == 0 ? StateLayout::kKV : StateLayout::kVK;
    c.state = dtypes[options % 3];
    c.act = dtypes[(options + 1) % 3];
    c.seed = uint32_t(300 + options);
    SCOPED_TRACE("options " + std::to_string(options));
    check_config(c);
  }
}

// Invalid rows (device-side indices): no state write, zero output rows inside [0, L), one error
// count each; valid rows unaffected; nothing outside owned slots touched, whatever the ids.
TEST(DecodeMtpCuda, HostileIndicesNeverEscape) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.H = 1;
  c.ratio = 2;
  c.N = 9;
  c.S = 3;
  c.T = {2, 2, 2, 2, 2, 2, 2, 2, 2};
  c.acc = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  Problem pb;
  pb.build(c);
  const int64_t big = int64_t(1) << 40;
  // row 0 valid; row 1: slot >= num_slots (int64 beyond 2^32); row 2: acc = 0; row 3: acc > S;
  // row 4: null source; row 5: T > S; row 6: decreasing cu_seqlens; row 7: T > S again;
  // row 8: range running past L.
  pb.idx.dtype = DType::kInt64;  // rebuild indices as int64 to carry huge ids
  pb.idx.init(DType::kInt64, {c.N, c.S});
  int next = 1;
  for (int i = 0; i < c.N * c.S; ++i) pb.idx.set_index(i, next++);
  pb.idx.set_index(1 * c.S + 2, big);
  pb.acc.init(DType::kInt64, {c.N});
  for (int i = 0; i < c.N; ++i) pb.acc.set_index(i, 1);
  pb.acc.set_index(2, 0);
  pb.acc.set_index(3, c.S + 1);
  pb.idx.set_index(4 * c.S + 0, -7);
  pb.cu.init(DType::kInt64, {c.N + 1});
  const int64_t cu_vals[] = {0, 2, 4, 6, 8, 10, 14, 12, 16, 1000};
  for (int i = 0; i <= c.N; ++i) pb.cu.set_index(i, cu_vals[i]);
  // L = 18 rows: row 8's range [16, 1000) runs past it.
  pb.L = 18;
  const int64_t width = 2 * int64_t(c.H) * kDim + int64_t(pb.HV) * kDim;
  std::mt19937 rng(3);
  pb.qkv.init(c.act, {pb.L, width});
  pb.qkv.fill_random(rng, 1.0f);
  pb.a.init(c.act, {pb.L, pb.HV});
  pb.b.init(c.act, {pb.L, pb.HV});
  pb.a.fill_random(rng, 1.0f);
  pb.b.fill_random(rng, 1.0f);
  pb.z.init(c.act, {pb.L, pb.HV, kDim});
  pb.z.fill_random(rng, 1.0f);
  pb.out.init(c.act, {pb.L, pb.HV, kDim});
  pb.out.fill_nan();
  pb.cfg.index = DType::kInt64;
  pb.upload_all();
  pb.acc.upload();
  int* counter = nullptr;
  CUDA_OK(cudaMalloc(&counter, sizeof(int)));
  CUDA_OK(cudaMemset(counter, 0, sizeof(int)));
  Params p = pb.params(true);
  p.num_accepted_tokens = pb.acc.view(true);
  p.error_count = TensorView::make(counter, DType::kInt32, {1}, {}, {gdn::DeviceType::kCUDA, 0});
  const std::vector<unsigned char> pool_before = pb.state.host;
  const gdn::Status st = gdn::decode_mtp::launch_cuda(p, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.reason();
  CUDA_OK(cudaDeviceSynchronize());
  int errors = -1;
  CUDA_OK(cudaMemcpy(&errors, counter, sizeof(int), cudaMemcpyDeviceToHost));
  cudaFree(counter);
  EXPECT_EQ(errors, 8) << "rows 1..8 are invalid";

  pb.out.host = pb.out.download();
  const std::vector<unsigned char> pool_after = pb.state.download();
  const int64_t row_elems = int64_t(pb.HV) * kDim;
  // Token rows 2..15 belong to invalid requests only: zeros.
  for (int64_t l = 2; l < 16; ++l) {
    for (int64_t e = 0; e < row_elems; ++e)
      ASSERT_EQ(pb.out.get(l * row_elems + e), 0.0f) << "token row " << l << " element " << e;
  }
  // Row 0 is valid: finite output. Row 8's rows inside [0, L) (16, 17) are zero-filled.
  for (int64_t e = 0; e < 2 * row_elems; ++e) ASSERT_TRUE(std::isfinite(pb.out.get(e)));
  for (int64_t e = 16 * row_elems; e < 18 * row_elems; ++e) ASSERT_EQ(pb.out.get(e), 0.0f);
  // Only row 0's destination slots (ids 1, 2) may change.
  const size_t es = size_t(gdn::dtype_size(c.state));
  const int64_t slot_bytes = pb.state.strides[0] * int64_t(es);
  for (int64_t slot = 0; slot < pb.num_slots; ++slot) {
    const bool owned = slot == 1 || slot == 2;
    const bool same = std::memcmp(&pool_after[size_t(slot * slot_bytes)],
                                  &pool_before[size_t(slot * slot_bytes)], size_t(slot_bytes)) == 0;
    if (!owned)
      EXPECT_TRUE(same) << "slot " << slot << " was written by an invalid row";
    else
      EXPECT_FALSE(same) << "valid row 0 did not write slot " << slot;
  }
}

// Capture one launch in a CUDA graph, then replay it on new data in the same buffers.
TEST(DecodeMtpCuda, GraphCaptureAndReplay) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.N = 3;
  c.S = 3;
  c.T = {3, 1, 2};
  c.acc = {2, 1, 3};
  c.state = DType::kBFloat16;
  c.act = DType::kBFloat16;
  c.seed = 41;
  Problem pb;
  pb.build(c);
  pb.upload_all();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const gdn::Status st = gdn::decode_mtp::launch_cuda(pb.params(true), stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(st.is_ok()) << st.reason();
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (uint32_t round = 0; round < 2; ++round) {
    // Fresh inputs and state, same shapes and buffers.
    Problem fresh;
    c.seed = 500 + round;
    fresh.build(c);
    pb.qkv.host = fresh.qkv.host;
    pb.a.host = fresh.a.host;
    pb.b.host = fresh.b.host;
    pb.z.host = fresh.z.host;
    pb.state.host = fresh.state.host;
    pb.out.fill_nan();
    for (Array* x : {&pb.qkv, &pb.a, &pb.b, &pb.z, &pb.state, &pb.out}) x->upload();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<double> ref_out, ref_pool;
    reference(pb, &ref_out, &ref_pool);
    Array got;
    got.dtype = pb.out.dtype;
    got.host = pb.out.download();
    std::vector<size_t> all(ref_out.size());
    for (size_t e = 0; e < all.size(); ++e) all[e] = e;
    EXPECT_LE(rel_l2(ref_out, got, all), 4e-3) << "graph replay round " << round;
    Array pool;
    pool.dtype = pb.state.dtype;
    pool.host = pb.state.download();
    EXPECT_LE(rel_l2(ref_pool, pool, written_elements(pb)), 1e-2) << "graph replay round " << round;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Every split of a head (1, 2, 4, 8 CTAs) gives the same bits: the norm's reduction order does not
// depend on it.
TEST(DecodeMtpCuda, SplitsAgreeBitForBit) {
  GDN_SKIP_WITHOUT_GPU();
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) GTEST_SKIP() << "head splitting needs thread-block clusters (sm_90+)";
  Config c;
  c.N = 2;
  c.S = 4;
  c.T = {4, 2};
  c.acc = {3, 1};
  c.seed = 77;
  std::vector<unsigned char> first_out, first_pool;
  for (int split : {1, 2, 4, 8}) {
    Problem pb;
    pb.build(c);
    pb.upload_all();
    const gdn::Status st = gdn::decode_mtp::launch_cuda(pb.params(true), nullptr, split);
    ASSERT_TRUE(st.is_ok()) << st.reason();
    CUDA_OK(cudaDeviceSynchronize());
    if (split == 1) {
      first_out = pb.out.download();
      first_pool = pb.state.download();
    } else {
      EXPECT_TRUE(pb.out.download() == first_out) << "split " << split;
      EXPECT_TRUE(pb.state.download() == first_pool) << "split " << split;
    }
  }
}

// vLLM's numerics (o rounded to out's dtype before the norm): CUDA and the CPU path round at the
// same point, so their bf16 outputs are the same bits nearly everywhere and never more than one
// unit in the last place apart.
TEST(DecodeMtpCuda, RoundedCoreOutputMatchesCpu) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.N = 3;
  c.S = 4;
  c.T = {4, 1, 3};
  c.acc = {2, 1, 4};
  c.act = DType::kBFloat16;
  c.seed = 91;
  auto mismatches = [&](bool round, int* beyond_one_ulp) -> std::pair<int, size_t> {
    Problem gpu, cpu;
    gpu.build(c);
    cpu.build(c);
    gpu.upload_all();
    Params pg = gpu.params(true), pc = cpu.params(false);
    pg.round_core_output = pc.round_core_output = round;
    const gdn::Status st = gdn::decode_mtp::launch_cuda(pg, nullptr);
    EXPECT_TRUE(st.is_ok()) << st.reason();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    gpu.out.host = gpu.out.download();
    const gdn::Status cs = gdn::decode_mtp::run_cpu(pc);
    EXPECT_TRUE(cs.is_ok()) << cs.reason();
    const auto* g = reinterpret_cast<const uint16_t*>(gpu.out.host.data());
    const auto* h = reinterpret_cast<const uint16_t*>(cpu.out.host.data());
    const size_t n = gpu.out.host.size() / 2;
    int differ = 0;
    *beyond_one_ulp = 0;
    for (size_t e = 0; e < n; ++e) {
      if (g[e] == h[e]) continue;
      ++differ;
      if (std::abs(int(g[e]) - int(h[e])) > 1) ++*beyond_one_ulp;
    }
    return {differ, n};
  };
  int far = 0;
  const auto [differ, n] = mismatches(true, &far);
  EXPECT_EQ(far, 0);
  EXPECT_LE(double(differ), 0.01 * double(n)) << differ << " of " << n << " outputs differ";
}

TEST(DecodeMtpCuda, GuardRefusesWithReason) {
  GDN_SKIP_WITHOUT_GPU();
  Config c;
  c.N = 1;
  c.S = 17;  // > kCudaMaxSpecColumns
  c.T = {1};
  Problem pb;
  pb.build(c);
  pb.upload_all();
  const gdn::Status st = gdn::decode_mtp::launch_cuda(pb.params(true), nullptr);
  EXPECT_EQ(st.code(), gdn::StatusCode::kUnsupported);
  EXPECT_NE(st.reason().find("S <="), std::string::npos) << st.reason();
  Params host = pb.params(false);
  const gdn::Status hs = gdn::decode_mtp::launch_cuda(host, nullptr);
  EXPECT_EQ(hs.code(), gdn::StatusCode::kInvalidArgument) << hs.reason();
}

}  // namespace
