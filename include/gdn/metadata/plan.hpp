// metadata: the shared plan of one step, computed once for all KV-cache groups on the host from
// host arrays (no device access, no synchronisation). Classification follows vLLM's GDN builder:
//   - spec (verify) rows: num_draft_tokens >= 0, a row with zero drafts included (it still reads
//     its state at column acc - 1);
//   - a fresh row (T > 0 tokens and no computed prefix: num_computed_tokens = 0, or seq_lens = T
//     when num_computed_tokens is absent) is never a decode: it has no state to read;
//   - without spec rows, split_decodes_and_prefills(threshold 1, short extends as prefills): the
//     decodes are the leading run of rows with <= 1 token that are not fresh; the prefills run from
//     there to the last row with a token (trailing zero-length rows are in neither count);
//   - with spec rows, the other rows are decodes (1 token), prefills (> 1 token) and zero-length
//     rows (neither), and the decodes are reclassified as prefills.
// Every row carries its accepted count: non-spec rows read their state from column
// start + acc - 1 (metadata.md §2.1), unless has_initial_state is false (then from no slot). In
// replay mode the counts given are the replay counts n (0..S), kept per row next to the accepted
// counts max(n, 1).
// Every input is validated before the first write; a bad input names the argument and the row.
// Host-only (compiles with g++ alone).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "gdn/core/status.hpp"
#include "gdn/metadata/params.hpp"

namespace gdn::metadata {

// Validates the step inputs of `p` (the host part) and derives N.
inline Status check_plan_arguments(const Params& p, int64_t* num_requests) {
  GDN_RETURN_IF_ERROR(check_common(p));
  if (p.plan.device.type != DeviceType::kCPU)
    return Status::invalid(
        "plan must be a host array: the plan is written on the host (copy it "
        "to the device buffer afterwards), got one on " +
        to_string(p.plan.device));
  GDN_RETURN_IF_ERROR(detail::int32_vector(p.query_start_loc, "query_start_loc"));
  if (p.query_start_loc.device.type != DeviceType::kCPU)
    return Status::invalid("query_start_loc must be a host array, got one on " +
                           to_string(p.query_start_loc.device));
  const int64_t N = p.query_start_loc.shape[0] - 1;
  if (N < 0) return Status::invalid("query_start_loc must have N + 1 >= 1 entries, got 0");
  if (N > p.max_rows)
    return Status::invalid("the step has N = " + std::to_string(N) +
                           " requests but max_rows = " + std::to_string(p.max_rows));
  GDN_RETURN_IF_ERROR(detail::host_int32_vector(p.seq_lens, "seq_lens", N, "N (requests)"));
  if (p.num_computed_tokens.present())
    GDN_RETURN_IF_ERROR(
        detail::host_int32_vector(p.num_computed_tokens, "num_computed_tokens", N, "N (requests)"));
  if (p.num_draft_tokens.present())
    GDN_RETURN_IF_ERROR(
        detail::host_int32_vector(p.num_draft_tokens, "num_draft_tokens", N, "N (requests)"));
  if (p.num_accepted_tokens.present() && p.num_accepted_tokens.device.type == DeviceType::kCPU)
    GDN_RETURN_IF_ERROR(
        detail::host_int32_vector(p.num_accepted_tokens, "num_accepted_tokens", N, "N (requests)"));
  if (p.padded_rows != -1 && (p.padded_rows < N || p.padded_rows > p.max_rows))
    return Status::invalid("padded_rows = " + std::to_string(p.padded_rows) +
                           " must be -1 (not padded) or in [N = " + std::to_string(N) +
                           ", max_rows = " + std::to_string(p.max_rows) + "]");
  *num_requests = N;
  return Status::ok();
}

// Computes the shared plan of one step into the host buffer `p.plan`.
inline Status plan(const Params& p) {
  int64_t N = 0;
  GDN_RETURN_IF_ERROR(check_plan_arguments(p, &N));
  const int32_t* qsl = p.query_start_loc.ptr<const int32_t>();
  const int32_t* seq_lens = p.seq_lens.ptr<const int32_t>();
  const int32_t* computed =
      p.num_computed_tokens.present() ? p.num_computed_tokens.ptr<const int32_t>() : nullptr;
  const int32_t* drafts =
      p.num_draft_tokens.present() ? p.num_draft_tokens.ptr<const int32_t>() : nullptr;
  const int32_t* accepted =
      (p.num_accepted_tokens.present() && p.num_accepted_tokens.device.type == DeviceType::kCPU)
          ? p.num_accepted_tokens.ptr<const int32_t>()
          : nullptr;
  const int64_t S = p.num_state_columns();
  const bool replay = p.replay;
  const int32_t min_accepted = replay ? 0 : 1;  // replay: n = 0 when the window is empty

  // ---- pass 1: validate and count (nothing is written) ----
  // The context of request i (tokens already in its state): num_computed_tokens, else seq_lens
  // minus the row's T tokens. A row with tokens and no context is fresh: no initial state.
  const auto context_of = [&](int64_t i, int64_t T) -> int64_t {
    return computed ? int64_t(computed[i]) : int64_t(seq_lens[i]) - T;
  };
  if (qsl[0] != 0)
    return Status::invalid("query_start_loc[0] must be 0, got " + std::to_string(qsl[0]));
  // One loop: validation, plus the tallies of both classifications.
  int64_t cand_rows = 0, cand_tokens = 0, cand_too_long = -1;  // rows with drafts >= 0
  int64_t zero_other = 0;
  int64_t leading_run = N;  // rows before the first one with more than 1 token, or fresh
  int64_t last_live = -1;   // the last row with a token
  for (int64_t i = 0; i < N; ++i) {
    const int64_t T = int64_t(qsl[i + 1]) - qsl[i];
    if (accepted && (accepted[i] < min_accepted || accepted[i] > S))
      return Status::invalid(
          "num_accepted_tokens[" + std::to_string(i) + "] = " + std::to_string(accepted[i]) +
          " is outside [" + std::to_string(min_accepted) + ", S = " + std::to_string(S) + "]" +
          (replay ? " (replay mode: the window tokens to replay, 0 when the window is empty)"
                  : ""));
    if (T < 0)
      return Status::invalid("query_start_loc decreases at request " + std::to_string(i) + ": " +
                             std::to_string(qsl[i]) + " -> " + std::to_string(qsl[i + 1]));
    if (seq_lens[i] < 0)
      return Status::invalid("seq_lens[" + std::to_string(i) +
                             "] = " + std::to_string(seq_lens[i]) + " is negative");
    if (!computed && seq_lens[i] < T)
      return Status::invalid("seq_lens[" + std::to_string(i) + "] = " +
                             std::to_string(seq_lens[i]) + " is smaller than the request's " +
                             std::to_string(T) + " query tokens (context would be negative)");
    if ((T > 1 || (T > 0 && context_of(i, T) <= 0)) && leading_run == N) leading_run = i;
    if (T > 0) last_live = i;
    if (drafts) {
      if (drafts[i] < -1 || drafts[i] > p.num_spec)
        return Status::invalid("num_draft_tokens[" + std::to_string(i) +
                               "] = " + std::to_string(drafts[i]) +
                               " is outside [-1, num_spec = " + std::to_string(p.num_spec) + "]");
      if (drafts[i] >= 0) {
        ++cand_rows;
        cand_tokens += T;
        if (T > S && cand_too_long < 0) cand_too_long = i;
        continue;
      }
    }
    zero_other += (T == 0);
  }
  const int64_t total_tokens = qsl[N];
  if (total_tokens > p.max_tokens)
    return Status::invalid("query_start_loc[N] = " + std::to_string(total_tokens) +
                           " tokens exceed max_tokens = " + std::to_string(p.max_tokens));
  const bool spec_step = cand_rows > 0;
  if (cand_too_long >= 0) {
    const int64_t i = cand_too_long;
    return Status::invalid("spec row of request " + std::to_string(i) + " has " +
                           std::to_string(qsl[i + 1] - qsl[i]) +
                           " tokens but S = num_spec + 1 = " + std::to_string(S));
  }
  const int64_t num_spec_rows = cand_rows;
  const int64_t num_spec_tokens = cand_tokens;
  const int64_t num_zero = zero_other;
  const int64_t num_non_spec_rows = N - num_spec_rows;
  const int64_t num_non_spec_tokens = total_tokens - num_spec_tokens;
  int64_t num_decodes, num_decode_tokens, num_prefills;
  if (num_spec_rows == 0) {  // vLLM's split_decodes_and_prefills(threshold 1)
    num_decodes = leading_run;
    num_decode_tokens = qsl[leading_run];
    // Prefills end at the last row with a token: trailing zero-length rows are padding.
    num_prefills = leading_run == N ? 0 : last_live + 1 - leading_run;
  } else {  // the prefill kernel takes the 1-token rows
    num_decodes = 0;
    num_decode_tokens = 0;
    num_prefills = num_non_spec_rows - num_zero;
  }

  // ---- pass 2: write ----
  const Layout l = p.layout();
  int32_t* w = p.plan.ptr<int32_t>();
  int32_t* spec_request = w + l.spec_request;
  int32_t* spec_start = w + l.spec_start;
  int32_t* ns_request = w + l.non_spec_request;
  int32_t* ns_start = w + l.non_spec_start;
  int32_t* spec_qsl = w + l.spec_query_start_loc;
  int32_t* ns_qsl = w + l.non_spec_query_start_loc;
  int32_t* spec_acc = w + l.spec_num_accepted;
  int32_t* spec_src = w + l.spec_source_column;
  int32_t* ns_src = w + l.non_spec_source_column;
  int32_t* spec_replay = w + l.replay_counts;
  int32_t* ns_replay = w + l.non_spec_replay_counts;
  int32_t* split = w + l.token_split;
  uint8_t* mask = reinterpret_cast<uint8_t*>(w + l.spec_sequence_masks);
  uint8_t* has_init = reinterpret_cast<uint8_t*>(w + l.has_initial_state);

  const bool align = p.mode == CacheMode::kAlign;
  const int64_t block_size = p.block_size;
  int64_t js = 0, jn = 0, max_column_end = 0;
  int32_t spec_tok = 0, ns_tok = 0;
  spec_qsl[0] = 0;
  ns_qsl[0] = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int32_t T = qsl[i + 1] - qsl[i];
    const int32_t start = align ? int32_t(std::max<int64_t>((seq_lens[i] - 1) / block_size, 0)) : 0;
    const bool is_spec = spec_step && drafts[i] >= 0;
    // Replay mode: n = the given count (absent: 0), the accepted count max(n, 1).
    const int32_t n = accepted ? accepted[i] : min_accepted;
    const int32_t acc = std::max<int32_t>(n, 1);
    mask[i] = is_spec;
    max_column_end = std::max<int64_t>(max_column_end, start + S);
    if (is_spec) {
      spec_request[js] = int32_t(i);
      spec_start[js] = start;
      spec_acc[js] = acc;
      spec_src[js] = acc - 1;
      if (replay) spec_replay[js] = n;
      spec_tok += T;
      spec_qsl[++js] = spec_tok;
    } else {
      ns_request[jn] = int32_t(i);
      ns_start[jn] = start;
      ns_src[jn] = acc - 1;
      if (replay) ns_replay[jn] = n;
      has_init[jn] = context_of(i, T) > 0;
      ns_tok += T;
      ns_qsl[++jn] = ns_tok;
    }
  }
  // Token split (non-spec tokens, then spec tokens, each in order): a run of rows of one kind
  // owns one contiguous range of tokens, written in one loop.
  int32_t* ns_dst = split;
  int32_t* spec_dst = split + num_non_spec_tokens;
  for (int64_t i = 0; i < N;) {
    const uint8_t kind = mask[i];
    int64_t end = i + 1;
    while (end < N && mask[end] == kind) ++end;
    int32_t*& dst = kind ? spec_dst : ns_dst;
    const int32_t first = qsl[i], count = qsl[end] - first;
    int32_t* out = dst;
    for (int32_t t = 0; t < count; ++t) out[t] = first + t;
    dst = out + count;
    i = end;
  }
  // Graph padding: padded rows carry no token, accept 1 (replay nothing) and read the pad id.
  const int64_t spec_written = p.padded_rows >= 0 ? p.padded_rows : num_spec_rows;
  const int64_t ns_written = p.padded_rows >= 0 ? p.padded_rows : num_non_spec_rows;
  const int64_t mask_written = p.padded_rows >= 0 ? p.padded_rows : N;
  for (int64_t j = num_spec_rows; j < spec_written; ++j) {
    spec_request[j] = -1;
    spec_start[j] = 0;
    spec_acc[j] = 1;
    spec_src[j] = 0;
    if (replay) spec_replay[j] = 0;
    spec_qsl[j + 1] = spec_tok;
  }
  for (int64_t j = num_non_spec_rows; j < ns_written; ++j) {
    ns_request[j] = -1;
    ns_start[j] = 0;
    ns_src[j] = 0;
    if (replay) ns_replay[j] = 0;
    has_init[j] = 0;
    ns_qsl[j + 1] = ns_tok;
  }
  if (mask_written > N) std::memset(mask + N, 0, size_t(mask_written - N));

  int32_t* h = w + l.header;
  h[kNumRequests] = int32_t(N);
  h[kNumPrefills] = int32_t(num_prefills);
  h[kNumPrefillTokens] = int32_t(num_non_spec_tokens - num_decode_tokens);
  h[kNumDecodes] = int32_t(num_decodes);
  h[kNumDecodeTokens] = int32_t(num_decode_tokens);
  h[kNumSpecDecodes] = int32_t(num_spec_rows);
  h[kNumSpecDecodeTokens] = int32_t(num_spec_tokens);
  h[kNumActualTokens] = int32_t(total_tokens);
  h[kNumNonSpecRows] = int32_t(num_non_spec_rows);
  h[kNumZeroLengthRows] = int32_t(num_zero);
  h[kSpecRowsWritten] = int32_t(spec_written);
  h[kNonSpecRowsWritten] = int32_t(ns_written);
  h[kMaskRowsWritten] = int32_t(mask_written);
  h[kMaxColumnEnd] = int32_t(max_column_end);
  h[kNumSpecColumns] = int32_t(S);
  h[kPaddedRows] = int32_t(p.padded_rows);
  h[kReplay] = replay ? 1 : 0;
  return Status::ok();
}

}  // namespace gdn::metadata
