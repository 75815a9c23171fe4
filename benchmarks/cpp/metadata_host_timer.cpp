// Host seconds per step of the C++ metadata builder, with no Python in the loop:
//
//   fused                one Builder for all G groups: one plan, one pass / one launch
//   per_group            G one-group Builders stepped in turn (plan + pass each)
//   per_group_reference  the shadow check's plain per-group build (CPU only)
//
// On CUDA each step is followed by an untimed stream synchronisation, so every step starts with
// an idle device. Prints one JSON object.
//
//   metadata_host_timer [--device cpu|cuda] [--iters N] [--repeats R] [STEP_FILE]
//   metadata_host_timer --self-test
//
// STEP_FILE (written by bench_metadata.py): whitespace-separated tokens
//   gdn-metadata-step G <G> num_spec <n> mode <none|align> block_size <b> pad_id <p>
//   padded_rows <r> max_rows <R> max_tokens <T>
//   then for each of query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
//   num_computed_tokens: <name> <count> <values...> (count -1: absent)
//   then G times: table <rows> <cols> <values...>
// Without a file: a pure verify step of G = 6, N = 256, S = 5 (the step the README quotes).
// --self-test: a few steps of every path, checked against each other and the per-group builds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <gdn/gdn.hpp>
#include <random>
#include <string>
#include <vector>

#if defined(GDN_TIMER_CUDA)
#include <cuda_runtime.h>

#include <gdn/kernels/cuda_api_metadata.hpp>
#endif

namespace {

using gdn::DType;
using gdn::Status;
using gdn::TensorView;
namespace md = gdn::metadata;

struct StepFile {
  int G = 0;
  int64_t num_spec = 0, block_size = 0, padded_rows = -1, max_rows = 0, max_tokens = 0;
  int32_t pad_id = 0;
  md::CacheMode mode = md::CacheMode::kNone;
  std::vector<int32_t> arrays[5];  // qsl, seq_lens, drafts, accepted, computed
  bool present[5] = {};
  std::vector<std::vector<int32_t>> tables;
  std::vector<int64_t> rows, cols;
};

bool read_step(const char* path, StepFile* s) {
  std::ifstream f(path);
  std::string word;
  if (!(f >> word) || word != "gdn-metadata-step") return false;
  std::string mode;
  f >> word >> s->G >> word >> s->num_spec >> word >> mode >> word >> s->block_size >> word >>
      s->pad_id >> word >> s->padded_rows >> word >> s->max_rows >> word >> s->max_tokens;
  s->mode = mode == "align" ? md::CacheMode::kAlign : md::CacheMode::kNone;
  for (int k = 0; k < 5; ++k) {
    int64_t n = 0;
    f >> word >> n;
    s->present[k] = n >= 0;
    s->arrays[k].resize(size_t(n > 0 ? n : 0));
    for (int32_t& v : s->arrays[k]) f >> v;
  }
  for (int g = 0; g < s->G; ++g) {
    int64_t r = 0, c = 0;
    f >> word >> r >> c;
    s->rows.push_back(r);
    s->cols.push_back(c);
    s->tables.emplace_back(size_t(r * c));
    for (int32_t& v : s->tables.back()) f >> v;
  }
  return bool(f);
}

// A pure verify step: every request verifies num_spec drafts, padded for a graph of N rows.
StepFile default_step(int G, int64_t N, int64_t S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> slot(1, 1 << 20), acc(1, int32_t(S)), ctx(1, 4000);
  StepFile s;
  s.G = G;
  s.num_spec = S - 1;
  s.max_rows = N;
  s.max_tokens = N * S;
  s.padded_rows = N;
  s.block_size = 16;
  for (int k = 0; k < 5; ++k) s.present[k] = true;
  s.arrays[0] = {0};
  for (int64_t i = 0; i < N; ++i) {
    const int32_t context = ctx(rng);
    s.arrays[0].push_back(s.arrays[0].back() + int32_t(S));
    s.arrays[1].push_back(context + int32_t(S));
    s.arrays[2].push_back(int32_t(S - 1));
    s.arrays[3].push_back(acc(rng));
    s.arrays[4].push_back(context);
  }
  for (int g = 0; g < G; ++g) {
    s.rows.push_back(N);
    s.cols.push_back(S + 2);
    s.tables.emplace_back(size_t(N * (S + 2)));
    for (int32_t& v : s.tables.back()) v = slot(rng);
  }
  return s;
}

md::StepInputs inputs(const StepFile& s) {
  const int64_t N = int64_t(s.arrays[0].size()) - 1;
  TensorView v[5];
  for (int k = 0; k < 5; ++k)
    if (s.present[k])
      v[k] = TensorView::make(s.arrays[k].data(), DType::kInt32, {k == 0 ? N + 1 : N});
  md::StepInputs in;
  in.query_start_loc = v[0];
  in.seq_lens = v[1];
  in.num_draft_tokens = v[2];
  in.num_accepted_tokens = v[3];
  in.num_computed_tokens = v[4];
  in.padded_rows = s.padded_rows;
  return in;
}

// A builder configuration over groups [first, first + count) of `tables`.
md::BuilderConfig config(const StepFile& s, const std::vector<const int32_t*>& tables, int first,
                         int count, gdn::Device dev) {
  md::BuilderConfig c;
  c.num_groups = count;
  for (int g = 0; g < count; ++g)
    c.block_tables[g] =
        TensorView::make(tables[size_t(first + g)], DType::kInt32,
                         {s.rows[size_t(first + g)], s.cols[size_t(first + g)]}, {}, dev);
  c.num_spec = s.num_spec;
  c.max_rows = s.max_rows;
  c.max_tokens = s.max_tokens;
  c.mode = s.mode;
  c.block_size = s.block_size;
  c.pad_id = s.pad_id;
  return c;
}

struct Timer {
  void* stream = nullptr;
  bool cuda = false;
  void sync() const {
#if defined(GDN_TIMER_CUDA)
    if (cuda) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
#endif
  }
  // Median over `repeats` of the mean seconds per call of `fn` over `iters` calls.
  template <class F>
  double seconds(int iters, int repeats, F&& fn) const {
    std::vector<double> samples;
    for (int r = 0; r < repeats; ++r) {
      std::chrono::steady_clock::duration total{};
      for (int it = 0; it < iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        total += std::chrono::steady_clock::now() - t0;
        sync();
      }
      samples.push_back(std::chrono::duration<double>(total).count() / iters);
    }
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
  }
};

bool check(const Status& s, const char* what) {
  if (!s.is_ok()) std::fprintf(stderr, "%s: %s\n", what, s.reason().c_str());
  return s.is_ok();
}

// Builders of every path over the tables (on `dev`); `ops` for CUDA.
struct Paths {
  md::Builder fused;
  std::vector<md::Builder> per_group;
  explicit Paths(int G) : per_group(size_t(G)) {}
  bool init(const StepFile& s, const std::vector<const int32_t*>& tables, gdn::Device dev,
            const md::DeviceOps* ops, bool shadow) {
    md::BuilderConfig c = config(s, tables, 0, s.G, dev);
    c.shadow = shadow;
    if (!check(fused.initialize(c, ops), "fused builder")) return false;
    for (int g = 0; g < s.G; ++g) {
      c = config(s, tables, g, 1, dev);
      c.shadow = shadow;
      if (!check(per_group[size_t(g)].initialize(c, ops), "per-group builder")) return false;
    }
    return true;
  }
};

// Host copies of a builder's outputs of group g (first `rows` rows).
std::vector<int32_t> outputs(const md::Builder& b, int g, bool cuda) {
  const md::BuilderBuffers& buf = b.buffers();
  const int64_t R = b.config().max_rows, S = b.config().num_spec + 1;
  std::vector<int32_t> out(size_t(R * (S + 2)));
  const int32_t* parts[3] = {buf.spec_state_indices.ptr<const int32_t>() + g * R * S,
                             buf.non_spec_state_indices.ptr<const int32_t>() + g * R,
                             buf.non_spec_source_indices.ptr<const int32_t>() + g * R};
  const int64_t sizes[3] = {R * S, R, R};
  int32_t* at = out.data();
  for (int k = 0; k < 3; ++k) {
#if defined(GDN_TIMER_CUDA)
    if (cuda) {
      cudaMemcpy(at, parts[k], size_t(sizes[k]) * 4, cudaMemcpyDeviceToHost);
      at += sizes[k];
      continue;
    }
#else
    (void)cuda;
#endif
    std::memcpy(at, parts[k], size_t(sizes[k]) * 4);
    at += sizes[k];
  }
  return out;
}

// Runs every path on `s` (timing, or checking in self-test mode). Returns false on an error.
bool run(const StepFile& s, bool cuda, int iters, int repeats, bool self_test) {
  std::vector<const int32_t*> tables;
  for (const auto& t : s.tables) tables.push_back(t.data());
  gdn::Device dev{};
  const md::DeviceOps* ops = nullptr;
  Timer timer;
#if defined(GDN_TIMER_CUDA)
  std::vector<void*> device_tables;
  cudaStream_t stream = nullptr;
  if (cuda) {
    dev = {gdn::DeviceType::kCUDA, 0};
    ops = &gdn::cuda_api::metadata_builder_ops();
    for (auto& p : tables) {
      const size_t bytes = s.tables[device_tables.size()].size() * 4;
      void* d = nullptr;
      if (cudaMalloc(&d, bytes > 0 ? bytes : 4) != cudaSuccess) return false;
      cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice);
      device_tables.push_back(d);
      p = static_cast<const int32_t*>(d);
    }
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    timer.stream = stream;
    timer.cuda = true;
  }
#endif
  bool ok = true;
  {
    Paths paths(s.G);
    ok = paths.init(s, tables, dev, ops, self_test);
    const md::StepInputs in = inputs(s);
    if (ok && self_test) {
      // Every path succeeds (each with its shadow check on) and fused == per group.
      ok = check(paths.fused.step(in, timer.stream), "fused step");
      for (int g = 0; ok && g < s.G; ++g)
        ok = check(paths.per_group[size_t(g)].step(in, timer.stream), "per-group step");
      timer.sync();
      for (int g = 0; ok && g < s.G; ++g)
        ok = outputs(paths.fused, g, cuda) == outputs(paths.per_group[size_t(g)], 0, cuda);
      if (!ok) std::fprintf(stderr, "self-test: the paths disagree\n");
    }
    if (ok && !self_test) {
      const double fused = timer.seconds(iters, repeats, [&] {
        if (!paths.fused.step(in, timer.stream).is_ok()) ok = false;
      });
      const double per_group = timer.seconds(std::max(iters / s.G, 20), repeats, [&] {
        for (auto& b : paths.per_group)
          if (!b.step(in, timer.stream).is_ok()) ok = false;
      });
      double reference = -1;
      if (!cuda) {
        gdn::metadata::Params p;
        p.query_start_loc = in.query_start_loc;
        p.seq_lens = in.seq_lens;
        p.num_draft_tokens = in.num_draft_tokens;
        p.num_accepted_tokens = in.num_accepted_tokens;
        p.num_computed_tokens = in.num_computed_tokens;
        p.padded_rows = in.padded_rows;
        md::BuilderConfig c = config(s, tables, 0, s.G, dev);
        p.num_spec = c.num_spec;
        p.mode = c.mode;
        p.block_size = c.block_size;
        p.pad_id = c.pad_id;
        p.num_groups = s.G;
        for (int g = 0; g < s.G; ++g) p.block_tables[g] = c.block_tables[g];
        reference = timer.seconds(std::max(iters / (4 * s.G), 10), repeats, [&] {
          for (int g = 0; g < s.G; ++g) {
            md::GroupMetadata m;
            if (!md::build_group_reference(p, g, &m).is_ok()) ok = false;
          }
        });
      }
      if (ok) {
        std::printf("{\"device\": \"%s\", \"fused_us\": %.3f, \"per_group_us\": %.3f",
                    cuda ? "cuda" : "cpu", 1e6 * fused, 1e6 * per_group);
        if (reference >= 0) std::printf(", \"per_group_reference_us\": %.3f", 1e6 * reference);
        std::printf("}\n");
      } else {
        std::fprintf(stderr, "a timed step failed\n");
      }
    }
  }
#if defined(GDN_TIMER_CUDA)
  for (void* d : device_tables) cudaFree(d);
  if (stream) cudaStreamDestroy(stream);
#endif
  return ok;
}

bool cuda_usable() {
#if defined(GDN_TIMER_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  bool cuda = false, self_test = false;
  int iters = 1000, repeats = 3;
  const char* path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      cuda = std::string(argv[++i]) == "cuda";
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--self-test") {
      self_test = true;
    } else if (a[0] != '-') {
      path = argv[i];
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (cuda && !cuda_usable()) {
    std::fprintf(stderr, "--device cuda: no usable CUDA device in this build or machine\n");
    return 2;
  }
  if (self_test) {
    // Mixed and padded steps of several shapes, both cache modes, on the CPU and (when there is
    // a GPU) on CUDA.
    bool ok = true;
    for (int G : {1, 3, 6})
      for (int64_t S : {2, 5})
        ok = ok && run(default_step(G, 64, S, uint64_t(G * 10 + S)), false, 1, 1, true);
    StepFile mixed = default_step(4, 40, 4, 7);
    mixed.mode = md::CacheMode::kAlign;
    mixed.block_size = 8;
    for (size_t i = 0; i < 40; ++i) {
      mixed.arrays[1][i] = 4 + int32_t(i % 20);  // starts 0..2: mostly inside the tables
      mixed.arrays[4][i] = mixed.arrays[1][i] - 4;
      if (i % 3 == 0) mixed.arrays[2][i] = -1;  // some rows carry no drafts
    }
    ok = ok && run(mixed, false, 1, 1, true);
    if (cuda_usable()) {
      ok = ok && run(default_step(6, 64, 5, 1), true, 1, 1, true) && run(mixed, true, 1, 1, true);
      std::printf("self-test on CUDA: %s\n", ok ? "ok" : "FAILED");
    } else {
      std::printf("self-test on CUDA: skipped (no GPU)\n");
    }
    std::printf("%s\n", ok ? "ok: metadata host timer self-test" : "FAILED");
    return ok ? 0 : 1;
  }
  StepFile s;
  if (path) {
    if (!read_step(path, &s)) {
      std::fprintf(stderr, "cannot read step file %s\n", path);
      return 2;
    }
  } else {
    s = default_step(6, 256, 5, 0);
  }
  return run(s, cuda, iters, repeats, false) ? 0 : 1;
}
