// The shared front of an operation's CPU run: validate the arguments and every request row before
// anything is written, and refuse tensors that are not in host memory; then the dispatch of a
// state dtype and head ratio onto the compiled CPU specialisations. Each operation's namespace
// provides check_arguments(p, &problem) and check_rows(p, problem, &rows) (found by ADL).
// Host-only (compiles with g++ alone).
#pragma once

#include <vector>

#include "gdn/core/dispatch.hpp"
#include "gdn/core/dtype.hpp"
#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"

namespace gdn {

template <class Params, class Problem, class RowInfo>
Status check_cpu_call(const Params& p, Problem* problem, std::vector<RowInfo>* rows) {
  GDN_RETURN_IF_ERROR(check_arguments(p, problem));
  if (problem->device.type != DeviceType::kCPU)
    return Status::invalid("run_cpu was given tensors on " + to_string(problem->device));
  return check_rows(p, *problem, rows);
}

// Calls f.template operator()<StateT, kRatio>() for a validated state dtype and head ratio (a
// ratio outside HeadRatios takes the run-time-ratio specialisation).
template <class F>
void dispatch_state_and_ratio(DType state, int ratio, F&& f) {
  StateDTypes::dispatch(state, [&]<DType kState>() {
    dispatch_or_runtime<HeadRatios>(
        ratio, [&]<int kRatio>() { f.template operator()<host_type_t<kState>, kRatio>(); });
  });
}

// The whole CPU run of an operation: check_cpu_call, then
// run.template operator()<StateT, kRatio>(p, problem, rows) for the call's state dtype and head
// ratio.
template <class Problem, class RowInfo, class Params, class Run>
Status run_cpu_call(const Params& p, Run&& run) {
  Problem pr;
  std::vector<RowInfo> rows;
  GDN_RETURN_IF_ERROR(check_cpu_call(p, &pr, &rows));
  dispatch_state_and_ratio(p.state.dtype, int(pr.ratio), [&]<class StateT, int kRatio>() {
    run.template operator()<StateT, kRatio>(p, pr, rows);
  });
  return Status::ok();
}

}  // namespace gdn
