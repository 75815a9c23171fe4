// metadata: the per-engine builder. It owns what a step needs besides the step's own host arrays:
// the engine's block tables (imported once), the persistent output buffers a CUDA graph replays
// from, the host plan buffers (a staging ring on CUDA) and the device plan buffer. Each step is
// one plan on the host, then (CUDA) one asynchronous copy of the plan and one launch that fills
// every group's state rows, or (CPU) one pass. Contract: docs metadata.md.
//
// CUTLASS-style use: can_implement(config) -> initialize(config, [buffers,] [ops]) -> step(...)
// each step; for CUDA graphs, prepare(...) each step and replay a capture of launch(...).
// Buffers are caller-provided (BuilderBuffers: views the caller keeps alive and zero-initialises)
// or self-owned (allocated and zeroed once by initialize; workspace_size() says how much).
// BuilderConfig::replay builds for replay verify (one checkpoint slot per request): the same plan
// and launch also fill checkpoint_indices and the replay counts (docs metadata.md §8).
//
// This header compiles with g++ alone: the CUDA runtime is reached through a DeviceOps table,
// which gdn/metadata/builder.cuh (nvcc code) or gdn::cuda_api::metadata_builder_ops()
// (gdn/kernels/cuda_api_metadata.hpp, precompiled) supply. A CPU builder needs none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gdn/core/status.hpp"
#include "gdn/core/tensor_view.hpp"
#include "gdn/metadata/params.hpp"
#include "gdn/metadata/plan.hpp"
#include "gdn/metadata/shadow.hpp"
#include "gdn/metadata/state_rows.hpp"

namespace gdn::metadata {

// Most host plan buffers a CUDA builder cycles through.
inline constexpr int kMaxStagingSlots = 8;

// The CUDA runtime calls of a CUDA builder, as plain function pointers (cudaStream_t, cudaEvent_t
// travel as void*). Every call runs on `device` and leaves the caller's current device as it was.
struct DeviceOps {
  // On `stream`: copies `bytes` from the host plan to the device plan (skipped when host_plan is
  // null), records `event` after the copy (when not null), then launches the state-row pass over
  // `args` (when not null). Never synchronises.
  Status (*submit)(const void* host_plan, void* device_plan, size_t bytes, void* event,
                   const StateRowsArgs* args, int device, void* stream) = nullptr;
  // Copies device memory to host memory on `stream` and waits for it (debug checks only).
  Status (*copy_to_host)(void* dst, const void* src, size_t bytes, int device,
                         void* stream) = nullptr;
  Status (*event_create)(int device, void** event) = nullptr;
  void (*event_destroy)(void* event) = nullptr;
  // Waits until the work recorded in `event` has executed.
  Status (*event_synchronize)(void* event) = nullptr;
  // Zero-initialised device memory (pinned_host = false) or page-locked host memory (true).
  Status (*allocate)(size_t bytes, bool pinned_host, int device, void** out) = nullptr;
  void (*release)(void* ptr, bool pinned_host, int device) = nullptr;
};

// What stays fixed for a builder's life (a CUDA graph that captured launch() bakes it in).
struct BuilderConfig {
  int num_groups = 0;                   // G, 1..kMaxGroups
  TensorView block_tables[kMaxGroups];  // int32 [rows_g, cols_g]: all on the host (CPU builder)
                                        // or all on one CUDA device (CUDA builder)
  int64_t num_spec = 0;                 // S = num_spec + 1 state columns per spec row
  int64_t max_rows = 0;                 // most requests (and padded rows) a step may have
  int64_t max_tokens = 0;               // most token rows a step may have
  CacheMode mode = CacheMode::kNone;
  int64_t block_size = 0;  // mode "align" only
  int32_t pad_id = 0;      // state id of padded and unreadable rows
  // Replay mode (docs replay.md §3, Params::replay): one checkpoint slot per request and group
  // (column start), step inputs' num_accepted_tokens are the replay counts n (0..S), and the step
  // also fills checkpoint_indices and the plan's replay counts. Mode "align" is refused.
  bool replay = false;
  // CUDA: host plan buffers used in turn. Page-locked ones (pinned_staging) make the plan copy
  // truly asynchronous; before a buffer is rewritten the builder waits for the copy issued from
  // it (normally long done). Pageable memory: one buffer, which the driver stages at copy time.
  int staging_slots = 2;
  bool pinned_staging = true;
  // Debug: after every step compare the result against per-group builds (synchronises); a
  // mismatch makes step() return kInternal naming group, field, row and both values.
  bool shadow = false;

  int64_t num_state_columns() const noexcept { return num_spec + 1; }
  bool is_cuda() const noexcept {
    return num_groups > 0 && block_tables[0].device.type == DeviceType::kCUDA;
  }
  int num_host_plans() const noexcept {
    return is_cuda() && pinned_staging ? (staging_slots < 1 ? 1 : staging_slots) : 1;
  }
};

// Caller-provided buffers: int32, contiguous, zero-initialised by the caller, on the tables'
// device unless said otherwise; they must outlive the builder.
struct BuilderBuffers {
  TensorView spec_state_indices;            // [G, max_rows, S]
  TensorView non_spec_state_indices;        // [G, max_rows]: destination of each non-spec row
  TensorView non_spec_source_indices;       // [G, max_rows]: source of each non-spec row
  TensorView checkpoint_indices;            // [G, max_rows]: replay mode only (required there)
  TensorView error_count;                   // [1]: unreadable rows are added to it
  TensorView device_plan;                   // CUDA builders: [plan words]
  int num_host_plans = 0;                   // BuilderConfig::num_host_plans()
  TensorView host_plans[kMaxStagingSlots];  // host [plan words] each
};

// One step's host arrays (and an optional device num_accepted_tokens, gathered by the launch).
struct StepInputs {
  TensorView query_start_loc;      // [N+1]
  TensorView seq_lens;             // [N]
  TensorView num_draft_tokens;     // [N] or absent
  TensorView num_accepted_tokens;  // [N] or absent; host, or on the builder's device (replay
                                   // mode: the replay counts n, 0..S)
  TensorView num_computed_tokens;  // [N] or absent
  int64_t padded_rows = -1;        // CUDA-graph batch size, or -1
};

// Bytes a self-owned builder allocates (16-byte aligned regions).
struct BuilderWorkspace {
  int64_t host_bytes = 0;    // host memory (page-locked on CUDA when pinned_staging)
  int64_t device_bytes = 0;  // CUDA device memory
};

class Builder {
 public:
  Builder() = default;
  ~Builder() { release(); }
  Builder(const Builder&) = delete;
  Builder& operator=(const Builder&) = delete;

  // Whether a builder can be made for `c` (scalars, capacity, tables).
  static Status can_implement(const BuilderConfig& c) {
    if (c.num_groups < 1 || c.num_groups > kMaxGroups)
      return Status::invalid("num_groups must be in [1, " + std::to_string(kMaxGroups) + "], got " +
                             std::to_string(c.num_groups));
    const Device dev = c.block_tables[0].device;
    for (int g = 0; g < c.num_groups; ++g) {
      const std::string name = "block_tables[" + std::to_string(g) + "]";
      GDN_RETURN_IF_ERROR(check::present(c.block_tables[g], name.c_str()));
      GDN_RETURN_IF_ERROR(check::same_device(c.block_tables[g], name.c_str(), dev));
    }
    if (c.is_cuda() && (c.staging_slots < 1 || c.staging_slots > kMaxStagingSlots))
      return Status::invalid("staging_slots must be in [1, " + std::to_string(kMaxStagingSlots) +
                             "], got " + std::to_string(c.staging_slots));
    GDN_RETURN_IF_ERROR(check_scalars(base_params(c, BuilderBuffers{})));
    return Status::ok();
  }

  // Memory a self-owned builder for `c` allocates.
  static BuilderWorkspace workspace_size(const BuilderConfig& c) {
    const Regions r = regions(c);
    return {r.host_words * 4, r.device_words * 4};
  }

  // A builder over caller-provided buffers. CUDA builders need `ops`.
  Status initialize(const BuilderConfig& c, const BuilderBuffers& buffers,
                    const DeviceOps* ops = nullptr) {
    release();
    GDN_RETURN_IF_ERROR(can_implement(c));
    GDN_RETURN_IF_ERROR(setup(c, buffers, ops));
    return Status::ok();
  }

  // A builder that allocates and zeroes its own buffers (host memory; device memory and
  // page-locked staging through `ops` on CUDA).
  Status initialize(const BuilderConfig& c, const DeviceOps* ops = nullptr) {
    release();
    GDN_RETURN_IF_ERROR(can_implement(c));
    if (c.is_cuda() && !has_ops(ops)) return missing_ops();
    const Regions r = regions(c);
    const int device = c.block_tables[0].device.index;
    int32_t* host = nullptr;
    int32_t* dev = nullptr;
    if (c.is_cuda() && c.pinned_staging) {
      void* p = nullptr;
      GDN_RETURN_IF_ERROR(ops->allocate(size_t(r.host_words) * 4, true, device, &p));
      owned_pinned_ = p;
      host = static_cast<int32_t*>(p);
    } else {
      owned_host_.assign(size_t(r.host_words), 0);
      host = owned_host_.data();
    }
    if (c.is_cuda()) {
      void* p = nullptr;
      const Status st = ops->allocate(size_t(r.device_words) * 4, false, device, &p);
      if (!st.is_ok()) {
        release_memory(ops, device);
        return st;
      }
      owned_device_ = p;
      dev = static_cast<int32_t*>(p);
    }
    owned_ops_ = ops;
    owned_device_index_ = device;
    int32_t* outputs = c.is_cuda() ? dev : host;
    const Device out_dev = c.block_tables[0].device;
    const int64_t G = c.num_groups, R = c.max_rows, S = c.num_state_columns();
    BuilderBuffers b;
    b.spec_state_indices =
        TensorView::make(outputs + r.spec, DType::kInt32, {G, R, S}, {}, out_dev);
    b.non_spec_state_indices =
        TensorView::make(outputs + r.non_spec, DType::kInt32, {G, R}, {}, out_dev);
    b.non_spec_source_indices =
        TensorView::make(outputs + r.non_spec_source, DType::kInt32, {G, R}, {}, out_dev);
    if (c.replay)
      b.checkpoint_indices =
          TensorView::make(outputs + r.checkpoint, DType::kInt32, {G, R}, {}, out_dev);
    b.error_count = TensorView::make(outputs + r.error_count, DType::kInt32, {1}, {}, out_dev);
    if (c.is_cuda())
      b.device_plan =
          TensorView::make(dev + r.device_plan, DType::kInt32, {r.plan_words}, {}, out_dev);
    b.num_host_plans = c.num_host_plans();
    for (int k = 0; k < b.num_host_plans; ++k)
      b.host_plans[k] =
          TensorView::make(host + r.host_plans + k * r.plan_stride, DType::kInt32, {r.plan_words});
    const Status st = setup(c, b, ops);
    if (!st.is_ok()) release();
    return st;
  }

  // Plans the step into the next host plan buffer and fills every group's state rows: one pass on
  // the CPU; on CUDA one asynchronous plan copy and one launch on `stream`. Invalid inputs are
  // reported (naming the argument and row) before anything is written.
  Status step(const StepInputs& in, void* stream = nullptr) {
    GDN_RETURN_IF_ERROR(run_step(in, stream, /*launch=*/true));
    if (config_.shadow) return shadow_status(in, stream);
    return Status::ok();
  }

  // The plan and (CUDA) its copy to the device plan buffer, without the state-row pass: what
  // precedes the replay of a CUDA graph that captured launch().
  Status prepare(const StepInputs& in, void* stream = nullptr) {
    return run_step(in, stream, /*launch=*/false);
  }

  // The state-row pass alone over `launch_rows` rows (0: max_rows), reading the (device) plan
  // buffer: on CUDA one launch and nothing else, so it can be captured in a CUDA graph.
  // `num_accepted_tokens` (on the pass's device, or absent) is gathered by the pass.
  Status launch(int64_t launch_rows, const TensorView& num_accepted_tokens = {},
                void* stream = nullptr) {
    GDN_RETURN_IF_ERROR(require_initialized());
    if (launch_rows < 0 || launch_rows > config_.max_rows)
      return Status::invalid(
          "launch_rows must be in [0, max_rows = " + std::to_string(config_.max_rows) + "], got " +
          std::to_string(launch_rows));
    StateRowsArgs a = args_;
    a.launch_rows = int32_t(launch_rows > 0 ? launch_rows : config_.max_rows);
    GDN_RETURN_IF_ERROR(set_gathered(num_accepted_tokens, /*allow_host=*/false, &a));
    return run_pass(a, stream);
  }

  // Compares the buffers (as the last step left them) against per-group builds of `in`, exactly,
  // on the rows the step writes; `report` names the first mismatch. Synchronises `stream` on CUDA.
  Status check(const StepInputs& in, void* stream, ShadowReport* report) const {
    GDN_RETURN_IF_ERROR(require_initialized());
    Params p = base_;
    set_inputs(in, &p);
    p.plan = buffers_.host_plans[0];
    const bool device_acc =
        p.num_accepted_tokens.present() && p.num_accepted_tokens.device.type != DeviceType::kCPU;
    {
      // The per-group build expects inputs the plan accepts: validate them the same way.
      Params inputs = p;
      if (device_acc) inputs.num_accepted_tokens = TensorView{};
      int64_t N = 0;
      GDN_RETURN_IF_ERROR(check_plan_arguments(inputs, &N));
    }
    if (!cuda_) return shadow_check(p, report);
    // Host copies of everything the comparison reads.
    std::vector<std::vector<int32_t>> copies;
    auto to_host = [&](TensorView* v, int64_t elements) -> Status {
      copies.emplace_back(size_t(elements > 0 ? elements : 0));
      if (elements > 0)
        GDN_RETURN_IF_ERROR(ops_->copy_to_host(copies.back().data(), v->data, size_t(elements) * 4,
                                               device_, stream));
      v->data = copies.back().data();
      v->device = {DeviceType::kCPU, 0};
      return Status::ok();
    };
    p.plan = buffers_.device_plan;
    GDN_RETURN_IF_ERROR(to_host(&p.plan, layout_.total_words));
    for (int g = 0; g < config_.num_groups; ++g) {
      TensorView& t = p.block_tables[g];
      GDN_RETURN_IF_ERROR(
          to_host(&t, t.numel() > 0 ? (t.shape[0] - 1) * t.strides[0] + t.shape[1] : 0));
    }
    for (TensorView* v :
         {&p.spec_state_indices, &p.non_spec_state_indices, &p.non_spec_source_indices})
      GDN_RETURN_IF_ERROR(to_host(v, v->numel()));
    if (p.replay) GDN_RETURN_IF_ERROR(to_host(&p.checkpoint_indices, p.checkpoint_indices.numel()));
    p.error_count = TensorView{};
    if (device_acc)
      GDN_RETURN_IF_ERROR(to_host(&p.num_accepted_tokens, p.num_accepted_tokens.numel()));
    return shadow_check(p, report);
  }

  bool initialized() const noexcept { return initialized_; }
  bool is_cuda() const noexcept { return cuda_; }
  int device() const noexcept { return device_; }
  const BuilderConfig& config() const noexcept { return config_; }
  const BuilderBuffers& buffers() const noexcept { return buffers_; }
  const Layout& layout() const noexcept { return layout_; }
  // The host plan buffer the last step (or prepare) planned into; its header holds the counts.
  int last_slot() const noexcept { return last_slot_; }
  const int32_t* host_plan(int slot) const noexcept {
    return buffers_.host_plans[slot].ptr<const int32_t>();
  }
  // CPU builders: the rows the last pass padded for bounds (also added to error_count). CUDA
  // builders count on the device only (error_count).
  int64_t last_errors() const noexcept { return last_errors_; }

 private:
  // Word offsets of a self-owned builder's regions (each 16-byte aligned).
  struct Regions {
    int64_t plan_words = 0, plan_stride = 0;
    int64_t spec = 0, non_spec = 0, non_spec_source = 0, checkpoint = 0, error_count = 0;
    int64_t device_plan = 0, host_plans = 0;
    int64_t host_words = 0, device_words = 0;
  };
  static Regions regions(const BuilderConfig& c) {
    Regions r;
    r.plan_words = Layout::make(c.max_rows, c.max_tokens).total_words;
    r.plan_stride = Layout::align_words(r.plan_words);
    const int64_t G = c.num_groups, R = c.max_rows, S = c.num_state_columns();
    int64_t at = 0;
    auto take = [&at](int64_t words) {
      const int64_t offset = at;
      at += Layout::align_words(words);
      return offset;
    };
    r.spec = take(G * R * S);
    r.non_spec = take(G * R);
    r.non_spec_source = take(G * R);
    if (c.replay) r.checkpoint = take(G * R);
    r.error_count = take(1);
    if (c.is_cuda()) {
      r.device_plan = take(r.plan_words);
      r.device_words = at;
      at = 0;  // outputs and the device plan live on the device, plans on the host
    }
    r.host_plans = take(r.plan_stride * c.num_host_plans());
    r.host_words = at;
    return r;
  }

  static bool has_ops(const DeviceOps* ops) {
    return ops && ops->submit && ops->copy_to_host && ops->event_create && ops->event_destroy &&
           ops->event_synchronize && ops->allocate && ops->release;
  }
  static Status missing_ops() {
    return Status::invalid(
        "a CUDA builder (block tables on a CUDA device) needs the CUDA operations: pass "
        "gdn::cuda_api::metadata_builder_ops() (gdn::kernels) or "
        "gdn::metadata::cuda_builder_ops() (gdn/metadata/builder.cuh)");
  }

  static Params base_params(const BuilderConfig& c, const BuilderBuffers& b) {
    Params p;
    p.num_spec = c.num_spec;
    p.mode = c.mode;
    p.block_size = c.block_size;
    p.pad_id = c.pad_id;
    p.replay = c.replay;
    p.max_rows = c.max_rows;
    p.max_tokens = c.max_tokens;
    p.num_groups = c.num_groups;
    for (int g = 0; g < c.num_groups; ++g) p.block_tables[g] = c.block_tables[g];
    p.spec_state_indices = b.spec_state_indices;
    p.non_spec_state_indices = b.non_spec_state_indices;
    p.non_spec_source_indices = b.non_spec_source_indices;
    p.checkpoint_indices = b.checkpoint_indices;
    p.error_count = b.error_count;
    return p;
  }

  Status setup(const BuilderConfig& c, const BuilderBuffers& b, const DeviceOps* ops) {
    cuda_ = c.is_cuda();
    device_ = c.block_tables[0].device.index;
    if (cuda_ && !has_ops(ops)) return missing_ops();
    const Layout l = Layout::make(c.max_rows, c.max_tokens);
    const DeviceType where = cuda_ ? DeviceType::kCUDA : DeviceType::kCPU;
    GDN_RETURN_IF_ERROR(check::present(b.non_spec_source_indices, "non_spec_source_indices"));
    if (b.num_host_plans != c.num_host_plans())
      return Status::invalid("host_plans: the configuration uses " +
                             std::to_string(c.num_host_plans()) + " host plan buffers, got " +
                             std::to_string(b.num_host_plans));
    for (int k = 0; k < b.num_host_plans; ++k) {
      const std::string name = "host_plans[" + std::to_string(k) + "]";
      GDN_RETURN_IF_ERROR(detail::int32_vector(b.host_plans[k], name.c_str()));
      if (b.host_plans[k].device.type != DeviceType::kCPU)
        return Status::invalid(name + " must be a host array");
      if (b.host_plans[k].shape[0] < l.total_words)
        return Status::invalid(name + " holds " + std::to_string(b.host_plans[k].shape[0]) +
                               " int32 words, the plan needs " + std::to_string(l.total_words));
    }
    Params p = base_params(c, b);
    p.plan = cuda_ ? b.device_plan : b.host_plans[0];
    if (cuda_) GDN_RETURN_IF_ERROR(check::present(b.device_plan, "device_plan"));
    GDN_RETURN_IF_ERROR(check::present(b.error_count, "error_count"));
    GDN_RETURN_IF_ERROR(check_state_rows_arguments(p, where));
    config_ = c;
    buffers_ = b;
    layout_ = l;
    ops_ = ops;
    base_ = p;
    base_.launch_rows = 0;
    args_ = make_state_rows_args(p);
    if (cuda_ && c.pinned_staging)
      for (int k = 0; k < b.num_host_plans; ++k) {
        const Status st = ops->event_create(device_, &events_[k]);
        if (!st.is_ok()) {
          destroy_events();
          return st;
        }
      }
    slot_ = 0;
    last_slot_ = 0;
    last_errors_ = 0;
    initialized_ = true;
    return Status::ok();
  }

  Status require_initialized() const {
    if (!initialized_) return Status::invalid("the metadata builder is not initialized");
    return Status::ok();
  }

  static void set_inputs(const StepInputs& in, Params* p) {
    p->query_start_loc = in.query_start_loc;
    p->seq_lens = in.seq_lens;
    p->num_draft_tokens = in.num_draft_tokens;
    p->num_accepted_tokens = in.num_accepted_tokens;
    p->num_computed_tokens = in.num_computed_tokens;
    p->padded_rows = in.padded_rows;
  }

  // Accepted counts the pass gathers: device ones on a CUDA builder (host ones are planned).
  Status set_gathered(const TensorView& acc, bool allow_host, StateRowsArgs* a) const {
    a->accepted = nullptr;
    a->accepted_len = 0;
    if (!acc.present()) return Status::ok();
    if (acc.device.type == DeviceType::kCPU) {
      if (allow_host) return Status::ok();  // the plan reads it
      if (cuda_)
        return Status::invalid(
            "num_accepted_tokens of launch() must be on the builder's CUDA device (host counts "
            "are planned by prepare())");
    } else if (!cuda_ || acc.device.index != device_) {
      return Status::invalid(
          "num_accepted_tokens must be a host array or live on the "
          "builder's device, got one on " +
          to_string(acc.device));
    }
    GDN_RETURN_IF_ERROR(detail::int32_vector(acc, "num_accepted_tokens"));
    a->accepted = acc.ptr<const int32_t>();
    a->accepted_len = int32_t(acc.shape[0] < INT32_MAX ? acc.shape[0] : INT32_MAX);
    return Status::ok();
  }

  Status run_pass(const StateRowsArgs& a, void* stream) {
    if (!cuda_) {
      last_errors_ = run_state_rows_cpu(a);
      return Status::ok();
    }
    return ops_->submit(nullptr, nullptr, 0, nullptr, &a, device_, stream);
  }

  Status run_step(const StepInputs& in, void* stream, bool launch) {
    GDN_RETURN_IF_ERROR(require_initialized());
    StateRowsArgs a = args_;
    GDN_RETURN_IF_ERROR(set_gathered(in.num_accepted_tokens, /*allow_host=*/true, &a));
    // The next host plan buffer, once the copy issued from it has executed.
    const int k = slot_;
    if (events_[k] && recorded_[k]) {
      GDN_RETURN_IF_ERROR(ops_->event_synchronize(events_[k]));
      recorded_[k] = false;
    }
    Params p = base_;
    set_inputs(in, &p);
    p.plan = buffers_.host_plans[k];
    GDN_RETURN_IF_ERROR(plan(p));  // validates every input before writing
    slot_ = (k + 1) % buffers_.num_host_plans;
    last_slot_ = k;
    const int64_t N = p.query_start_loc.shape[0] - 1;
    const int64_t rows = p.padded_rows >= 0 ? p.padded_rows : N;
    a.launch_rows = int32_t(rows > 1 ? rows : 1);
    if (!cuda_) {
      if (launch) last_errors_ = run_state_rows_cpu(a);
      return Status::ok();
    }
    const Status st = ops_->submit(buffers_.host_plans[k].data, buffers_.device_plan.data,
                                   size_t(layout_.total_words) * 4, events_[k],
                                   launch ? &a : nullptr, device_, stream);
    if (st.is_ok()) recorded_[k] = events_[k] != nullptr;
    return st;
  }

  Status shadow_status(const StepInputs& in, void* stream) const {
    ShadowReport report;
    GDN_RETURN_IF_ERROR(check(in, stream, &report));
    if (!report.ok()) return Status(StatusCode::kInternal, report.message);
    return Status::ok();
  }

  void destroy_events() {
    for (int k = 0; k < kMaxStagingSlots; ++k) {
      if (events_[k] && ops_) ops_->event_destroy(events_[k]);
      events_[k] = nullptr;
      recorded_[k] = false;
    }
  }

  void release_memory(const DeviceOps* ops, int device) {
    if (owned_device_ && ops) ops->release(owned_device_, false, device);
    if (owned_pinned_ && ops) ops->release(owned_pinned_, true, device);
    owned_device_ = owned_pinned_ = nullptr;
    owned_host_.clear();
    owned_host_.shrink_to_fit();
  }

  void release() {
    // Events are recorded after copies that may still be pending: wait before freeing memory.
    for (int k = 0; k < kMaxStagingSlots; ++k)
      if (events_[k] && recorded_[k] && ops_) (void)ops_->event_synchronize(events_[k]);
    destroy_events();
    release_memory(owned_ops_, owned_device_index_);
    owned_ops_ = nullptr;
    initialized_ = false;
  }

  BuilderConfig config_;
  BuilderBuffers buffers_;
  Layout layout_;
  Params base_;         // tables, outputs and scalars; the step sets inputs and the plan
  StateRowsArgs args_;  // the pass over the device plan (CUDA) or host_plans[0] (CPU)
  const DeviceOps* ops_ = nullptr;
  bool initialized_ = false;
  bool cuda_ = false;
  int device_ = 0;
  int slot_ = 0, last_slot_ = 0;
  int64_t last_errors_ = 0;
  void* events_[kMaxStagingSlots] = {};
  bool recorded_[kMaxStagingSlots] = {};
  // Self-owned memory.
  std::vector<int32_t> owned_host_;
  void* owned_device_ = nullptr;
  void* owned_pinned_ = nullptr;
  const DeviceOps* owned_ops_ = nullptr;
  int owned_device_index_ = 0;
};

}  // namespace gdn::metadata
