#include <gtest/gtest.h>
#include "gdn/gdn.hpp"
TEST(Dispatch, HeadRatiosListed) {
  int seen = -1;
  EXPECT_TRUE(gdn::HeadRatios::dispatch(3, [&]<int R>() { seen = R; }));
  EXPECT_EQ(seen, 3);
  EXPECT_FALSE(gdn::dispatch_or_runtime<gdn::HeadRatios>(5, [&]<int R>() { seen = R; }));
  EXPECT_EQ(seen, 0);
}
