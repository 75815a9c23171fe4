// Binding of the metadata builder: the plan, the state-row pass (CPU loop or one CUDA launch), the
// shadow check, the plan-buffer layout, and MetadataBuilder, the C++ metadata::Builder
// (gdn/metadata/builder.hpp) over the persistent arrays the Python Builder owns: this file only
// converts arrays.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"
#include "gdn/metadata/builder.hpp"
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

TensorView view_of(const ConstArray& a, const char* name) { return to_view(a, name); }

TensorView view_of(const OptConstArray& a, const char* name) {
  return a ? view_of(*a, name) : TensorView{};
}

void* stream_ptr(std::optional<uintptr_t> stream) {
  return reinterpret_cast<void*>(stream.value_or(0));
}

// Scalars and capacity shared by every entry point.
Params base_params(int64_t num_spec, int64_t max_rows, int64_t max_tokens, const std::string& mode,
                   int64_t block_size, int64_t pad_id, bool replay) {
  Params p;
  p.replay = replay;
  p.num_spec = num_spec;
  p.max_rows = max_rows;
  p.max_tokens = max_tokens;
  p.mode = parse_mode(mode);
  p.block_size = block_size;
  if (pad_id < INT32_MIN || pad_id > INT32_MAX) throw nb::value_error("pad_id must fit in int32");
  p.pad_id = int32_t(pad_id);
  return p;
}

// The step inputs' views into `p` (Params, or the builder's StepInputs: they name them alike).
template <class P, class In, class OptIn>
void set_step_inputs(P& p, const In& query_start_loc, const In& seq_lens,
                     const OptIn& num_draft_tokens, const OptIn& num_accepted_tokens,
                     const OptIn& num_computed_tokens, std::optional<int64_t> padded_rows) {
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

// The plan buffer, block tables and state-row arrays: what a state-rows pass writes and a shadow
// check compares.
void set_state_row_arrays(Params& p, const Array& plan, const std::vector<Array>& block_tables,
                          const Array& spec_state_indices, const Array& non_spec_state_indices,
                          const OptArray& non_spec_source_indices,
                          const OptArray& checkpoint_indices) {
  p.plan = view_of(plan, "plan");
  set_tables(p, block_tables);
  p.spec_state_indices = view_of(spec_state_indices, "spec_state_indices");
  p.non_spec_state_indices = view_of(non_spec_state_indices, "non_spec_state_indices");
  p.non_spec_source_indices = view_of(non_spec_source_indices, "non_spec_source_indices");
  p.checkpoint_indices = view_of(checkpoint_indices, "checkpoint_indices");
}

// ---- free functions -----------------------------------------------------------------------------

void plan_fn(const Array& plan, const Array& query_start_loc, const Array& seq_lens,
             const OptArray& num_draft_tokens, const OptArray& num_accepted_tokens,
             const OptArray& num_computed_tokens, int64_t num_spec, int64_t max_rows,
             int64_t max_tokens, const std::string& mode, int64_t block_size,
             std::optional<int64_t> padded_rows, int64_t pad_id, bool replay) {
  Params p = base_params(num_spec, max_rows, max_tokens, mode, block_size, pad_id, replay);
  p.plan = view_of(plan, "plan");
  set_step_inputs(p, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                  num_computed_tokens, padded_rows);
  nb::gil_scoped_release release;
  throw_if_error(metadata::plan(p));
}

std::optional<int64_t> state_rows_fn(
    const Array& plan, const std::vector<Array>& block_tables, const Array& spec_state_indices,
    const Array& non_spec_state_indices, int64_t num_spec, int64_t max_rows, int64_t max_tokens,
    int64_t pad_id, int64_t launch_rows, const OptArray& num_accepted_tokens,
    const OptArray& error_count, const OptArray& non_spec_source_indices, bool replay,
    const OptArray& checkpoint_indices, std::optional<uintptr_t> stream) {
  Params p = base_params(num_spec, max_rows, max_tokens, "none", 0, pad_id, replay);
  set_state_row_arrays(p, plan, block_tables, spec_state_indices, non_spec_state_indices,
                       non_spec_source_indices, checkpoint_indices);
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
                            std::optional<int64_t> padded_rows, int64_t pad_id,
                            const OptArray& non_spec_source_indices, bool replay,
                            const OptArray& checkpoint_indices) {
  Params p = base_params(num_spec, max_rows, max_tokens, mode, block_size, pad_id, replay);
  set_state_row_arrays(p, plan, block_tables, spec_state_indices, non_spec_state_indices,
                       non_spec_source_indices, checkpoint_indices);
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
  field("non_spec_source_column", l.non_spec_source_column, R, "int32");
  field("replay_counts", l.replay_counts, R, "int32");
  field("non_spec_replay_counts", l.non_spec_replay_counts, R, "int32");
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

// ---- MetadataBuilder: metadata::Builder over arrays the Python Builder owns ------------------

class MetadataBuilder {
 public:
  MetadataBuilder(const std::vector<Array>& block_tables, const Array& spec_state_indices,
                  const Array& non_spec_state_indices, const Array& non_spec_source_indices,
                  const OptArray& checkpoint_indices, const std::vector<Array>& host_plans,
                  const std::optional<Array>& device_plan, const Array& error_count,
                  int64_t num_spec, int64_t max_rows, int64_t max_tokens, const std::string& mode,
                  int64_t block_size, int64_t pad_id, bool replay, bool pinned_staging, bool shadow)
      : keep_(block_tables) {
    if (block_tables.empty() || block_tables.size() > size_t(metadata::kMaxGroups))
      throw nb::value_error(("block_tables must hold 1.." + std::to_string(metadata::kMaxGroups) +
                             " arrays (one per KV-cache group), got " +
                             std::to_string(block_tables.size()))
                                .c_str());
    if (host_plans.empty() || host_plans.size() > size_t(metadata::kMaxStagingSlots))
      throw nb::value_error(("host_plans must hold 1.." +
                             std::to_string(metadata::kMaxStagingSlots) + " host buffers")
                                .c_str());
    if (pad_id < INT32_MIN || pad_id > INT32_MAX) throw nb::value_error("pad_id must fit in int32");
    metadata::BuilderConfig c;
    c.num_groups = int(block_tables.size());
    for (size_t g = 0; g < block_tables.size(); ++g) {
      const std::string name = "block_tables[" + std::to_string(g) + "]";
      c.block_tables[g] = view_of(block_tables[g], name.c_str());
    }
    c.num_spec = num_spec;
    c.max_rows = max_rows;
    c.max_tokens = max_tokens;
    c.mode = parse_mode(mode);
    c.block_size = block_size;
    c.pad_id = int32_t(pad_id);
    c.replay = replay;
    c.staging_slots = int(host_plans.size());
    c.pinned_staging = pinned_staging;
    c.shadow = shadow;
    metadata::BuilderBuffers b;
    b.spec_state_indices = view_of(spec_state_indices, "spec_state_indices");
    b.non_spec_state_indices = view_of(non_spec_state_indices, "non_spec_state_indices");
    b.non_spec_source_indices = view_of(non_spec_source_indices, "non_spec_source_indices");
    b.checkpoint_indices = view_of(checkpoint_indices, "checkpoint_indices");
    b.error_count = view_of(error_count, "error_count");
    if (device_plan) b.device_plan = view_of(*device_plan, "device_plan");
    b.num_host_plans = int(host_plans.size());
    for (size_t k = 0; k < host_plans.size(); ++k)
      b.host_plans[k] = view_of(host_plans[k], "host_plans[k]");
    for (const Array* a :
         {&spec_state_indices, &non_spec_state_indices, &non_spec_source_indices, &error_count})
      keep_.push_back(*a);
    if (checkpoint_indices) keep_.push_back(*checkpoint_indices);
    keep_.insert(keep_.end(), host_plans.begin(), host_plans.end());
    if (device_plan) keep_.push_back(*device_plan);
    const metadata::DeviceOps* ops = nullptr;
#ifdef GDN_HAS_CUDA
    if (c.is_cuda()) ops = &cuda_api::metadata_builder_ops();
#else
    if (c.is_cuda())
      throw nb::value_error(
          "the block tables are CUDA arrays but this build of gdn has no CUDA "
          "kernels");
#endif
    throw_if_error(builder_.initialize(c, b, ops));
  }

  // A call on one step's inputs (step, prepare, check): converts them, then runs `Phase` on the
  // builder without the GIL.
  template <auto Phase>
  auto step_call(const ConstArray& query_start_loc, const ConstArray& seq_lens,
                 const OptConstArray& num_draft_tokens, const OptConstArray& num_accepted_tokens,
                 const OptConstArray& num_computed_tokens, std::optional<int64_t> padded_rows,
                 std::optional<uintptr_t> stream) {
    // The builder only reads the inputs, so read-only arrays are accepted.
    metadata::StepInputs in;
    set_step_inputs(in, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                    num_computed_tokens, padded_rows);
    nb::gil_scoped_release release;
    return Phase(builder_, in, stream_ptr(stream));
  }

  // step_call's phases. Builder::step (plan + copy + state rows) and Builder::prepare (the
  // graph-replay path) return the host plan slot they planned into.
  template <Status (metadata::Builder::*Plan)(const metadata::StepInputs&, void*)>
  static int planned(metadata::Builder& b, const metadata::StepInputs& in, void* stream) {
    throw_if_error((b.*Plan)(in, stream));
    return b.last_slot();
  }

  // The shadow check of the buffers against `step`'s inputs: "" or the first mismatch.
  static std::string checked(metadata::Builder& b, const metadata::StepInputs& in, void* stream) {
    metadata::ShadowReport report;
    throw_if_error(b.check(in, stream, &report));
    return report.message;
  }

  // Returns the CPU pass's error count (None on CUDA).
  std::optional<int64_t> launch(int64_t launch_rows, const OptArray& num_accepted_tokens,
                                std::optional<uintptr_t> stream) {
    const TensorView acc = view_of(num_accepted_tokens, "num_accepted_tokens");
    nb::gil_scoped_release release;
    throw_if_error(builder_.launch(launch_rows, acc, stream_ptr(stream)));
    if (builder_.is_cuda()) return std::nullopt;
    return builder_.last_errors();
  }

  int64_t num_slots() const { return builder_.buffers().num_host_plans; }
  bool is_cuda() const { return builder_.is_cuda(); }
  std::optional<int64_t> last_errors() const {
    if (builder_.is_cuda()) return std::nullopt;
    return builder_.last_errors();
  }

 private:
  metadata::Builder builder_;
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
        nb::arg("pad_id") = 0, nb::arg("replay") = false,
        "Plans one step into the host int32 buffer `plan` (classification and every shared "
        "field). Reads host arrays only; never touches a device.");
  m.def("metadata_state_rows", &state_rows_fn, nb::arg("plan").noconvert(),
        nb::arg("block_tables").noconvert(), nb::arg("spec_state_indices").noconvert(),
        nb::arg("non_spec_state_indices").noconvert(), nb::kw_only(), nb::arg("num_spec"),
        nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("pad_id") = 0,
        nb::arg("launch_rows") = 0, nb::arg("num_accepted_tokens").noconvert().none() = nb::none(),
        nb::arg("error_count").noconvert().none() = nb::none(),
        nb::arg("non_spec_source_indices").noconvert().none() = nb::none(),
        nb::arg("replay") = false, nb::arg("checkpoint_indices").noconvert().none() = nb::none(),
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
        nb::arg("pad_id") = 0, nb::arg("non_spec_source_indices").noconvert().none() = nb::none(),
        nb::arg("replay") = false, nb::arg("checkpoint_indices").noconvert().none() = nb::none(),
        "Compares host copies of a step's plan and state rows against per-group builds on the "
        "rows the step writes. Returns '' when they agree, else a message naming group, field, "
        "row and both values.");
  m.def("metadata_layout", &layout_fn, nb::arg("max_rows"), nb::arg("max_tokens"),
        "{field: (word offset, length, dtype)} of the plan buffer, plus 'total_words'.");
  m.def("metadata_header_fields", &header_fields_fn, "Names of the plan header's int32 words.");
  m.attr("metadata_max_groups") = metadata::kMaxGroups;

  nb::class_<MetadataBuilder> builder(m, "MetadataBuilder");
  builder
      .def(nb::init<const std::vector<Array>&, const Array&, const Array&, const Array&,
                    const OptArray&, const std::vector<Array>&, const std::optional<Array>&,
                    const Array&, int64_t, int64_t, int64_t, const std::string&, int64_t, int64_t,
                    bool, bool, bool>(),
           nb::arg("block_tables").noconvert(), nb::arg("spec_state_indices").noconvert(),
           nb::arg("non_spec_state_indices").noconvert(),
           nb::arg("non_spec_source_indices").noconvert(),
           nb::arg("checkpoint_indices").noconvert().none(), nb::arg("host_plans").noconvert(),
           nb::arg("device_plan").noconvert().none(), nb::arg("error_count").noconvert(),
           nb::arg("num_spec"), nb::arg("max_rows"), nb::arg("max_tokens"), nb::arg("mode"),
           nb::arg("block_size"), nb::arg("pad_id"), nb::arg("replay"), nb::arg("pinned_staging"),
           nb::arg("shadow"))
      .def("launch", &MetadataBuilder::launch, nb::arg("launch_rows"),
           nb::arg("num_accepted_tokens").noconvert().none(), nb::arg("stream").none())
      .def_prop_ro("num_slots", &MetadataBuilder::num_slots)
      .def_prop_ro("is_cuda", &MetadataBuilder::is_cuda)
      .def_prop_ro("last_errors", &MetadataBuilder::last_errors);
  // step, prepare and check take the same step inputs, named alike.
  const auto def_step_call = [&builder](const char* name, auto method) {
    builder.def(name, method, nb::arg("query_start_loc").noconvert(),
                nb::arg("seq_lens").noconvert(), nb::arg("num_draft_tokens").noconvert().none(),
                nb::arg("num_accepted_tokens").noconvert().none(),
                nb::arg("num_computed_tokens").noconvert().none(), nb::arg("padded_rows").none(),
                nb::arg("stream").none());
  };
  using B = MetadataBuilder;
  def_step_call("step", &B::step_call<&B::planned<&metadata::Builder::step>>);
  def_step_call("prepare", &B::step_call<&B::planned<&metadata::Builder::prepare>>);
  def_step_call("check", &B::step_call<&B::checked>);
}

}  // namespace gdn::python
