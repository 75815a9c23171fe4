// Binding of the metadata builder: the plan, the state-row pass (CPU loop or one CUDA launch), the
// shadow check, the plan-buffer layout, and MetadataBuilder, which keeps the persistent buffers
// and block tables of an engine (imported once) so a step passes only the step's host arrays.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"
#include "gdn/metadata/params.hpp"
#include "gdn/metadata/plan.hpp"
#include "gdn/metadata/shadow.hpp"
#include "gdn/metadata/state_rows.hpp"
#ifdef GDN_HAS_CUDA
#include "gdn/kernels/cuda_api_metadata.hpp"
#endif

namespace gdn::python {
namespace {

using metadata::CacheMode;
using metadata::Params;

CacheMode parse_mode(const std::string& s) {
  if (s == "none") return CacheMode::kNone;
  if (s == "align") return CacheMode::kAlign;
  throw nb::value_error(("mode must be 'none' or 'align', got '" + s + "'").c_str());
}

// Page-locked host memory is a host array here too (see to_view): the plan and the CPU pass read
// it.
TensorView view_of(const Array& a, const char* name) { return to_view(a, name); }

TensorView view_of(const OptArray& a, const char* name) {
  return a ? view_of(*a, name) : TensorView{};
}

void* stream_ptr(std::optional<uintptr_t> stream) {
  return reinterpret_cast<void*>(stream.value_or(0));
}

// Scalars and capacity shared by every entry point.
Params base_params(int64_t num_spec, int64_t max_rows, int64_t max_tokens, const std::string& mode,
                   int64_t block_size, int64_t pad_id) {
  Params p;
  p.num_spec = num_spec;
  p.max_rows = max_rows;
  p.max_tokens = max_tokens;
  p.mode = parse_mode(mode);
  p.block_size = block_size;
  if (pad_id < INT32_MIN || pad_id > INT32_MAX) throw nb::value_error("pad_id must fit in int32");
  p.pad_id = int32_t(pad_id);
  return p;
}

void set_step_inputs(Params& p, const Array& query_start_loc, const Array& seq_lens,
                     const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
                     const OptArray& num_computed_tokens, std::optional<int64_t> padded_rows) {
  p.query_start_loc = view_of(query_start_loc, "query_start_loc");
  p.seq_lens = view_of(seq_lens, "seq_lens");
  p.num_draft_tokens = view_of(num_draft_tokens, "num_draft_tokens");
  p.num_accepted_tokens = view_of(num_accepted_tokens, "num_accepted_tokens");
  p.num_computed_tokens = view_of(num_computed_tokens, "num_computed_tokens");
  p.padded_rows = padded_rows.value_or(-1);
}

void set_tables(Params& p, const std::vector<Array>& block_tables) {
  if (block_tables.empty() || block_tables.size() > size_t(metadata::kMaxGroups))
    throw nb::value_error(("block_tables must hold 1.." + std::to_string(metadata::kMaxGroups) +
                           " arrays (one per KV-cache group), got " +
                           std::to_string(block_tables.size()))
                              .c_str());
  p.num_groups = int(block_tables.size());
  for (size_t g = 0; g < block_tables.size(); ++g) {
    const std::string name = "block_tables[" + std::to_string(g) + "]";
    p.block_tables[g] = view_of(block_tables[g], name.c_str());
  }
}

// Rows a launch covers for a step: the padded batch, else every request.
int64_t step_launch_rows(const Params& p) {
  if (p.padded_rows >= 0) return std::max<int64_t>(p.padded_rows, 1);
  return std::max<int64_t>(p.query_start_loc.present() ? p.query_start_loc.shape[0] - 1 : 1, 1);
}

// The state-row pass on the plan buffer's device. Returns the error count on the CPU (the device
// adds it to error_count instead).
std::optional<int64_t> run_state_rows(const Params& p, void* stream) {
  if (p.plan.device.type == DeviceType::kCPU) {
    int64_t errors = 0;
    throw_if_error(metadata::run_state_rows_cpu(p, &errors));
    return errors;
  }
#ifdef GDN_HAS_CUDA
  throw_if_error(cuda_api::metadata_state_rows(p, stream));
#else
  (void)stream;
  throw_if_error(
      Status::unsupported("plan is a CUDA array but this build of gdn has no CUDA kernels"));
#endif
  return std::nullopt;
}

// ---- free functions -----------------------------------------------------------------------------

void plan_fn(const Array& plan, const Array& query_start_loc, const Array& seq_lens,
             const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
             const OptArray& num_computed_tokens, int64_t num_spec, int64_t max_rows,
             int64_t max_tokens, const std::string& mode, int64_t block_size,
             std::optional<int64_t> padded_rows, int64_t pad_id) {
  Params p = base_params(num_spec, max_rows, max_tokens, mode, block_size, pad_id);
  p.plan = view_of(plan, "plan");
  set_step_inputs(p, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                  num_computed_tokens, padded_rows);
  nb::gil_scoped_release release;
  throw_if_error(metadata::plan(p));
}

std::optional<int64_t> state_rows_fn(const Array& plan, const std::vector<Array>& block_tables,
                                     const Array& spec_state_indices,
                                     const Array& non_spec_state_indices, int64_t num_spec,
                                     int64_t max_rows, int64_t max_tokens, int64_t pad_id,
                                     int64_t launch_rows, const OptArray& num_accepted_tokens,
                                     const OptArray& error_count, std::optional<uintptr_t> stream) {
  Params p = base_params(num_spec, max_rows, max_tokens, "none", 0, pad_id);
  p.plan = view_of(plan, "plan");
  set_tables(p, block_tables);
  p.spec_state_indices = view_of(spec_state_indices, "spec_state_indices");
  p.non_spec_state_indices = view_of(non_spec_state_indices, "non_spec_state_indices");
  p.num_accepted_tokens = view_of(num_accepted_tokens, "num_accepted_tokens");
  p.error_count = view_of(error_count, "error_count");
  p.launch_rows = launch_rows;
  nb::gil_scoped_release release;
  return run_state_rows(p, stream_ptr(stream));
}

std::string shadow_check_fn(const Array& plan, const std::vector<Array>& block_tables,
                            const Array& spec_state_indices, const Array& non_spec_state_indices,
                            const Array& query_start_loc, const Array& seq_lens,
                            const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
                            const OptArray& num_computed_tokens, int64_t num_spec, int64_t max_rows,
                            int64_t max_tokens, const std::string& mode, int64_t block_size,
                            std::optional<int64_t> padded_rows, int64_t pad_id) {
  Params p = base_params(num_spec, max_rows, max_tokens, mode, block_size, pad_id);
  p.plan = view_of(plan, "plan");
  set_tables(p, block_tables);
  p.spec_state_indices = view_of(spec_state_indices, "spec_state_indices");
  p.non_spec_state_indices = view_of(non_spec_state_indices, "non_spec_state_indices");
  set_step_inputs(p, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                  num_computed_tokens, padded_rows);
  nb::gil_scoped_release release;
  // The per-group build expects inputs the plan accepts: validate them the same way first.
  int64_t N = 0;
  Params inputs = p;
  throw_if_error(metadata::check_plan_arguments(inputs, &N));
  metadata::ShadowReport report;
  throw_if_error(metadata::shadow_check(p, &report));
  return report.message;
}

nb::dict layout_fn(int64_t max_rows, int64_t max_tokens) {
  if (max_rows < 1 || max_tokens < 0)
    throw nb::value_error("max_rows must be >= 1, max_tokens >= 0");
  const metadata::Layout l = metadata::Layout::make(max_rows, max_tokens);
  nb::dict d;
  auto field = [&](const char* name, int64_t offset, int64_t length, const char* dtype) {
    d[name] = nb::make_tuple(offset, length, dtype);
  };
  const int64_t R = max_rows;
  field("header", l.header, metadata::kHeaderWords, "int32");
  field("spec_request", l.spec_request, R, "int32");
  field("spec_start", l.spec_start, R, "int32");
  field("non_spec_request", l.non_spec_request, R, "int32");
  field("non_spec_start", l.non_spec_start, R, "int32");
  field("spec_query_start_loc", l.spec_query_start_loc, R + 1, "int32");
  field("non_spec_query_start_loc", l.non_spec_query_start_loc, R + 1, "int32");
  field("spec_num_accepted", l.spec_num_accepted, R, "int32");
  field("spec_source_column", l.spec_source_column, R, "int32");
  field("token_split", l.token_split, max_tokens, "int32");
  field("spec_sequence_masks", l.spec_sequence_masks, R, "bool");
  field("has_initial_state", l.has_initial_state, R, "bool");
  d["total_words"] = l.total_words;
  return d;
}

std::vector<std::string> header_fields_fn() {
  std::vector<std::string> names;
  for (int f = 0; f < metadata::kHeaderWords; ++f)
    names.emplace_back(metadata::header_field_name(f));
  return names;
}

// ---- MetadataBuilder
// ------------------------------------------------------------------------------

// Persistent buffers and block tables of one engine, imported once. A step passes only its host
// arrays. CPU builders plan into plans[0] and run the CPU pass on it; CUDA builders plan into a
// host staging slot, copy it into device_plan and launch once.
class MetadataBuilder {
 public:
  MetadataBuilder(const std::vector<Array>& block_tables, const Array& spec_state_indices,
                  const Array& non_spec_state_indices, const std::vector<Array>& host_plans,
                  const std::optional<Array>& device_plan, const std::optional<Array>& error_count,
                  int64_t num_spec, int64_t max_rows, int64_t max_tokens, const std::string& mode,
                  int64_t block_size, int64_t pad_id)
      : keep_(block_tables) {
    base_ = base_params(num_spec, max_rows, max_tokens, mode, block_size, pad_id);
    set_tables(base_, block_tables);
    base_.spec_state_indices = view_of(spec_state_indices, "spec_state_indices");
    base_.non_spec_state_indices = view_of(non_spec_state_indices, "non_spec_state_indices");
    keep_.push_back(spec_state_indices);
    keep_.push_back(non_spec_state_indices);
    if (error_count) {
      base_.error_count = view_of(*error_count, "error_count");
      keep_.push_back(*error_count);
    }
    if (host_plans.empty()) throw nb::value_error("host_plans must hold at least one host buffer");
    for (size_t k = 0; k < host_plans.size(); ++k) {
      host_plans_.push_back(view_of(host_plans[k], "host_plans[k]"));
      keep_.push_back(host_plans[k]);
    }
    cuda_ = device_plan.has_value();
    if (cuda_) {
      device_plan_ = view_of(*device_plan, "device_plan");
      keep_.push_back(*device_plan);
#ifndef GDN_HAS_CUDA
      throw nb::value_error("device_plan given but this build of gdn has no CUDA kernels");
#endif
    }
    // Validate the persistent part once, as the state-row pass will see it.
    Params pass = base_;
    pass.plan = cuda_ ? device_plan_ : host_plans_[0];
    throw_if_error(
        metadata::check_state_rows_arguments(pass, cuda_ ? DeviceType::kCUDA : DeviceType::kCPU));
    for (size_t k = 0; k < host_plans_.size(); ++k) {
      Params hp = base_;
      hp.plan = host_plans_[k];
      if (hp.plan.device.type != DeviceType::kCPU)
        throw nb::value_error("host_plans must be host arrays");
      throw_if_error(metadata::check_common(hp));
    }
  }

  // Plan + (copy) + state rows. Returns the CPU pass's error count (None on CUDA).
  std::optional<int64_t> step(int64_t slot, const Array& query_start_loc, const Array& seq_lens,
                              const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
                              const OptArray& num_computed_tokens,
                              std::optional<int64_t> padded_rows, std::optional<uintptr_t> stream) {
    Params p = step_params(slot, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                           num_computed_tokens, padded_rows);
    nb::gil_scoped_release release;
    return run_step(p, stream_ptr(stream));
  }

  // Plan (+ copy to the device buffer): what precedes a graph replay of launch().
  void prepare(int64_t slot, const Array& query_start_loc, const Array& seq_lens,
               const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
               const OptArray& num_computed_tokens, std::optional<int64_t> padded_rows,
               std::optional<uintptr_t> stream) {
    Params p = step_params(slot, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                           num_computed_tokens, padded_rows);
    nb::gil_scoped_release release;
    throw_if_error(metadata::plan(p));
#ifdef GDN_HAS_CUDA
    if (cuda_)
      throw_if_error(cuda_api::metadata_copy_plan(p.plan, device_plan_, p.layout().total_words,
                                                  stream_ptr(stream)));
#else
    (void)stream;
#endif
  }

  // The state-row pass alone over `launch_rows` rows, reading the (device) plan buffer: the part a
  // CUDA graph captures. `num_accepted_tokens` (device) is gathered when given.
  std::optional<int64_t> launch(int64_t launch_rows, const OptArray& num_accepted_tokens,
                                std::optional<uintptr_t> stream) {
    Params p = base_;
    p.plan = cuda_ ? device_plan_ : host_plans_[0];
    p.launch_rows = launch_rows;
    p.num_accepted_tokens = view_of(num_accepted_tokens, "num_accepted_tokens");
    nb::gil_scoped_release release;
    return run_state_rows(p, stream_ptr(stream));
  }

  // Host seconds per step measured in C++ (no Python in the loop), for benchmarks. path:
  // "fused" (one plan, one pass/launch for all groups), "per_group" (plan + pass per group) or
  // "per_group_reference" (the shadow check's per-group build, CPU only). CUDA steps are followed
  // by an untimed stream synchronisation, so each step starts with an idle device.
  double time_step(const std::string& path, int64_t iters, int64_t slot,
                   const Array& query_start_loc, const Array& seq_lens,
                   const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
                   const OptArray& num_computed_tokens, std::optional<int64_t> padded_rows,
                   std::optional<uintptr_t> stream) {
    Params p = step_params(slot, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                           num_computed_tokens, padded_rows);
    if (path != "fused" && path != "per_group" && path != "per_group_reference")
      throw nb::value_error("path must be 'fused', 'per_group' or 'per_group_reference'");
    if (path == "per_group_reference" && cuda_)
      throw nb::value_error("the per-group reference build runs on host tables only");
    nb::gil_scoped_release release;
    void* s = stream_ptr(stream);
    using clock = std::chrono::steady_clock;
    clock::duration total{};
    for (int64_t it = 0; it < iters; ++it) {
      const auto t0 = clock::now();
      if (path == "fused") {
        run_step(p, s);
      } else if (path == "per_group") {
        for (int g = 0; g < base_.num_groups; ++g) run_step(one_group(p, g), s);
      } else {
        for (int g = 0; g < base_.num_groups; ++g) {
          metadata::GroupMetadata m;
          throw_if_error(metadata::build_group_reference(p, g, &m));
        }
      }
      total += clock::now() - t0;
#ifdef GDN_HAS_CUDA
      if (cuda_) throw_if_error(cuda_api::synchronize_stream(s));
#endif
    }
    return std::chrono::duration<double>(total).count() / double(std::max<int64_t>(iters, 1));
  }

  int64_t num_slots() const { return int64_t(host_plans_.size()); }
  bool is_cuda() const { return cuda_; }

 private:
  Params step_params(int64_t slot, const Array& query_start_loc, const Array& seq_lens,
                     const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
                     const OptArray& num_computed_tokens, std::optional<int64_t> padded_rows) {
    if (slot < 0 || slot >= int64_t(host_plans_.size()))
      throw nb::value_error(
          ("slot must be in [0, " + std::to_string(host_plans_.size()) + ")").c_str());
    Params p = base_;
    p.plan = host_plans_[size_t(slot)];
    set_step_inputs(p, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                    num_computed_tokens, padded_rows);
    p.launch_rows = step_launch_rows(p);
    return p;
  }

  // The same step restricted to group g (the per-group path of the benchmark).
  Params one_group(const Params& p, int g) const {
    Params q = p;
    q.num_groups = 1;
    q.block_tables[0] = p.block_tables[g];
    q.spec_state_indices.data =
        p.spec_state_indices.ptr<int32_t>() + g * p.spec_state_indices.strides[0];
    q.spec_state_indices.shape[0] = 1;
    q.non_spec_state_indices.data =
        p.non_spec_state_indices.ptr<int32_t>() + g * p.non_spec_state_indices.strides[0];
    q.non_spec_state_indices.shape[0] = 1;
    return q;
  }

  // p.plan is the host slot; returns the CPU error count.
  std::optional<int64_t> run_step(const Params& p, void* stream) {
    if (!cuda_) {
      throw_if_error(metadata::plan(p));
      return run_state_rows(p, stream);
    }
#ifdef GDN_HAS_CUDA
    throw_if_error(cuda_api::metadata_step(p, device_plan_, stream));
#else
    (void)stream;
#endif
    return std::nullopt;
  }

  Params base_;
  std::vector<TensorView> host_plans_;
  TensorView device_plan_;
  bool cuda_ = false;
  std::vector<Array> keep_;  // the imported arrays stay alive as long as the builder
};

}  // namespace

void bind_metadata(nb::module_& m) {
  m.def("metadata_plan", &plan_fn, nb::arg("plan").noconvert(),
        nb::arg("query_start_loc").noconvert(), nb::arg("seq_lens").noconvert(), nb::kw_only(),
        nb::arg("num_draft_tokens").noconvert().none() = nb::none(),
        nb::arg("num_accepted_tokens").noconvert().none() = nb::none(),
        nb::arg("num_computed_tokens").noconvert().none() = nb::none(), nb::arg("num_spec"),
        nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("mode") = "none",
        nb::arg("block_size") = 0, nb::arg("padded_rows").none() = nb::none(),
        nb::arg("pad_id") = 0,
        "Plans one step into the host int32 buffer `plan` (classification and every shared "
        "field). Reads host arrays only; never touches a device.");
  m.def("metadata_state_rows", &state_rows_fn, nb::arg("plan").noconvert(),
        nb::arg("block_tables").noconvert(), nb::arg("spec_state_indices").noconvert(),
        nb::arg("non_spec_state_indices").noconvert(), nb::kw_only(), nb::arg("num_spec"),
        nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("pad_id") = 0,
        nb::arg("launch_rows") = 0, nb::arg("num_accepted_tokens").noconvert().none() = nb::none(),
        nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("stream").none() = nb::none(),
        "Fills every group's state rows in one pass (CPU loop, or one CUDA launch on `stream`) "
        "from the plan buffer on the same device. Returns the CPU pass's error count.");
  m.def("metadata_shadow_check", &shadow_check_fn, nb::arg("plan").noconvert(),
        nb::arg("block_tables").noconvert(), nb::arg("spec_state_indices").noconvert(),
        nb::arg("non_spec_state_indices").noconvert(), nb::arg("query_start_loc").noconvert(),
        nb::arg("seq_lens").noconvert(), nb::kw_only(),
        nb::arg("num_draft_tokens").noconvert().none() = nb::none(),
        nb::arg("num_accepted_tokens").noconvert().none() = nb::none(),
        nb::arg("num_computed_tokens").noconvert().none() = nb::none(), nb::arg("num_spec"),
        nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("mode") = "none",
        nb::arg("block_size") = 0, nb::arg("padded_rows").none() = nb::none(),
        nb::arg("pad_id") = 0,
        "Compares host copies of a step's plan and state rows against per-group builds on the "
        "rows the step writes. Returns '' when they agree, else a message naming group, field, "
        "row and both values.");
  m.def("metadata_layout", &layout_fn, nb::arg("max_rows"), nb::arg("max_tokens"),
        "{field: (word offset, length, dtype)} of the plan buffer, plus 'total_words'.");
  m.def("metadata_header_fields", &header_fields_fn, "Names of the plan header's int32 words.");
  m.attr("metadata_max_groups") = metadata::kMaxGroups;

  nb::class_<MetadataBuilder>(m, "MetadataBuilder")
      .def(
          nb::init<const std::vector<Array>&, const Array&, const Array&, const std::vector<Array>&,
                   const std::optional<Array>&, const std::optional<Array>&, int64_t, int64_t,
                   int64_t, const std::string&, int64_t, int64_t>(),
          nb::arg("block_tables").noconvert(), nb::arg("spec_state_indices").noconvert(),
          nb::arg("non_spec_state_indices").noconvert(), nb::arg("host_plans").noconvert(),
          nb::arg("device_plan").noconvert().none(), nb::arg("error_count").noconvert().none(),
          nb::arg("num_spec"), nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("mode"),
          nb::arg("block_size"), nb::arg("pad_id"))
      .def("step", &MetadataBuilder::step, nb::arg("slot"), nb::arg("query_start_loc").noconvert(),
           nb::arg("seq_lens").noconvert(), nb::arg("num_draft_tokens").noconvert().none(),
           nb::arg("num_accepted_tokens").noconvert().none(),
           nb::arg("num_computed_tokens").noconvert().none(), nb::arg("padded_rows").none(),
           nb::arg("stream").none())
      .def("prepare", &MetadataBuilder::prepare, nb::arg("slot"),
           nb::arg("query_start_loc").noconvert(), nb::arg("seq_lens").noconvert(),
           nb::arg("num_draft_tokens").noconvert().none(),
           nb::arg("num_accepted_tokens").noconvert().none(),
           nb::arg("num_computed_tokens").noconvert().none(), nb::arg("padded_rows").none(),
           nb::arg("stream").none())
      .def("launch", &MetadataBuilder::launch, nb::arg("launch_rows"),
           nb::arg("num_accepted_tokens").noconvert().none(), nb::arg("stream").none())
      .def("time_step", &MetadataBuilder::time_step, nb::arg("path"), nb::arg("iters"),
           nb::arg("slot"), nb::arg("query_start_loc").noconvert(), nb::arg("seq_lens").noconvert(),
           nb::arg("num_draft_tokens").noconvert().none(),
           nb::arg("num_accepted_tokens").noconvert().none(),
           nb::arg("num_computed_tokens").noconvert().none(), nb::arg("padded_rows").none(),
           nb::arg("stream").none())
      .def_prop_ro("num_slots", &MetadataBuilder::num_slots)
      .def_prop_ro("is_cuda", &MetadataBuilder::is_cuda);
}

}  // namespace gdn::python
