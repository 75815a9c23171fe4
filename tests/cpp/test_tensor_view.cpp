// TensorView::make: views of read-only (const) inputs need no const_cast; contiguous strides.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>

#include "gdn/core/tensor_view.hpp"

namespace gdn::testing {
namespace {

TEST(TensorView, MakeFromConstPointer) {
  const std::array<float, 6> weights = {1, 2, 3, 4, 5, 6};
  const TensorView v = TensorView::make(weights.data(), DType::kFloat32, {2, 3});
  EXPECT_EQ(v.data, static_cast<const void*>(weights.data()));
  EXPECT_EQ(v.ptr<const float>()[4], 5.0f);
  EXPECT_EQ(v.ndim, 2);
  EXPECT_EQ(v.stride(0), 3);
  EXPECT_EQ(v.stride(1), 1);
  EXPECT_EQ(v.numel(), 6);
}

TEST(TensorView, MakeFromMutablePointerWithStrides) {
  std::array<int32_t, 8> rows{};
  const TensorView v = TensorView::make(rows.data(), DType::kInt32, {2, 2}, {4, 1});
  v.ptr<int32_t>()[4] = 7;
  EXPECT_EQ(rows[4], 7);
  EXPECT_EQ(v.stride(0), 4);
  EXPECT_TRUE(check::present(v, "rows").is_ok());
  EXPECT_FALSE(TensorView{}.present());
}

}  // namespace
}  // namespace gdn::testing
