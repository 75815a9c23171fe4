// One causal_conv1d_update step on the CPU (one request, T = 2 tokens, width 4, two channels) with
// integer values, so every output and every conv state entry is known exactly; then a call with
// an out-of-range slot, which must be refused before anything is written.
#include <cstdio>
#include <gdn/conv/cpu.hpp>
#include <vector>

int main() {
  using gdn::DType;
  using gdn::TensorView;
  constexpr int64_t D = 2, W = 4, Lbuf = 4, T = 2, slots = 2;  // Lbuf = W - 1 + num_spec (1)
  // Pool [slots, D, Lbuf]: slot 1 holds the last W - 1 = 3 accepted inputs of each channel.
  std::vector<float> pool = {-1, -1, -1, -1,  -1, -1, -1, -1,  // slot 0 (not used)
                             1,  2,  3,  100, 4,  5,  6,  200};
  const std::vector<float> weight = {1, 10, 100, 1000,  // channel 0
                                     1, 2,  3,   4};    // channel 1
  const std::vector<float> x = {7, 8, 9, 10};           // [T, D]
  const std::vector<int32_t> slot = {1}, cu = {0, T};
  std::vector<float> out(T * D, -1);

  gdn::conv::Params p;
  p.x = TensorView::make(x.data(), DType::kFloat32, {T, D});
  p.weight = TensorView::make(weight.data(), DType::kFloat32, {D, W});
  p.conv_state = TensorView::make(pool.data(), DType::kFloat32, {slots, D, Lbuf});
  p.conv_state_indices = TensorView::make(slot.data(), DType::kInt32, {1});
  p.cu_seqlens = TensorView::make(cu.data(), DType::kInt32, {2});
  p.out = TensorView::make(out.data(), DType::kFloat32, {T, D});
  p.activation = gdn::conv::Activation::kNone;
  gdn::Status status = gdn::conv::run_cpu(p);
  if (!status) {
    std::printf("causal_conv1d_update failed: %s\n", status.reason().c_str());
    return 1;
  }
  // out[t, c] = sum_j weight[c, j] * [history | x][t + j]; the slot keeps the last 3 inputs from
  // position 0 and the call's inputs after them.
  const std::vector<float> want_out = {1 + 20 + 300 + 7000, 4 + 10 + 18 + 32,   // t = 0
                                       2 + 30 + 700 + 9000, 5 + 12 + 24 + 40};  // t = 1
  const std::vector<float> want_pool = {-1, -1, -1, -1, -1, -1, -1, -1,         //
                                        2,  3,  7,  9,  5,  6,  8,  10};
  if (out != want_out || pool != want_pool) {
    std::printf("wrong result: out = %g %g %g %g\n", out[0], out[1], out[2], out[3]);
    return 1;
  }

  const std::vector<int32_t> bad_slot = {slots};
  p.conv_state_indices = TensorView::make(bad_slot.data(), DType::kInt32, {1});
  status = gdn::conv::run_cpu(p);
  if (status || out != want_out || pool != want_pool) {
    std::printf("an out-of-range slot was not refused, or something was written\n");
    return 1;
  }
  std::printf("refused: %s\n", status.reason().c_str());
  std::printf("ok: causal_conv1d_update (libgdn via %s)\n", GDN_USE);
  return 0;
}
