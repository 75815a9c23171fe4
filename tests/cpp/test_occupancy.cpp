// The even-share shared-memory request of a launch (gdn/core/occupancy.hpp): the CTAs per SM it
// allows, computed the way an SM allocates shared memory.
#include <gtest/gtest.h>

#include "gdn/core/occupancy.hpp"

namespace gdn::testing {
namespace {

constexpr size_t kH200Shared = 233472;  // 228 KB per SM
constexpr size_t kReserved = 1024;
constexpr int kSms = 132;

// CTAs of `dynamic` bytes each that fit an SM of `shared` bytes.
int64_t resident(size_t dynamic, size_t shared = kH200Shared) {
  const size_t unit = kSharedAllocationUnit;
  const size_t per_cta = (dynamic + unit - 1) / unit * unit + kReserved;
  return int64_t(shared / per_cta);
}

TEST(Occupancy, CapsCtasPerSmAtTheEvenShare) {
  const size_t needed = 37092;  // a 16-bit write-all CTA at T = 1: six fit an SM
  for (int64_t ctas : {1, 132, 133, 256, 264, 300, 512, 528, 600}) {
    const int64_t share = (ctas + kSms - 1) / kSms;
    const size_t bytes = even_share_shared_bytes(needed, ctas, kSms, kH200Shared, kReserved, 6);
    ASSERT_GE(bytes, needed) << ctas;
    EXPECT_EQ(resident(bytes), share) << ctas << " CTAs";
  }
}

TEST(Occupancy, LeavesFullWavesAlone) {
  const size_t needed = 37092;
  for (int64_t ctas : {int64_t(661), int64_t(792), int64_t(1584), int64_t(4096), int64_t(1) << 30})
    EXPECT_EQ(even_share_shared_bytes(needed, ctas, kSms, kH200Shared, kReserved, 6), needed)
        << ctas;
  // Shared memory already limits a 53 KB CTA to four per SM: a share of four needs no padding.
  EXPECT_EQ(even_share_shared_bytes(53872, 528, kSms, kH200Shared, kReserved, 6), size_t(53872));
  EXPECT_EQ(resident(even_share_shared_bytes(53872, 396, kSms, kH200Shared, kReserved, 6)), 3);
}

TEST(Occupancy, LaterWavesTakeTheFewestCtasPerSmOfTheirWaveCount) {
  const size_t needed = 37092;  // six fit an SM
  for (int64_t ctas : {int64_t(793), int64_t(1024), int64_t(1600), int64_t(2000), int64_t(16384)}) {
    const int64_t per_wave = 6 * kSms, waves = (ctas + per_wave - 1) / per_wave;
    const size_t bytes = even_share_shared_bytes(needed, ctas, kSms, kH200Shared, kReserved, 6);
    ASSERT_GE(bytes, needed) << ctas;
    const int64_t r = resident(bytes);
    EXPECT_EQ((ctas + r * kSms - 1) / (r * kSms), waves) << ctas << " CTAs: as many waves";
    EXPECT_GT((ctas + (r - 1) * kSms - 1) / ((r - 1) * kSms), waves) << ctas << " CTAs: the fewest";
  }
  EXPECT_EQ(resident(even_share_shared_bytes(needed, 1024, kSms, kH200Shared, kReserved, 6)), 4);
}

TEST(Occupancy, RegisterLimitCounts) {
  // Eight fit by shared memory, the register budget allows six: a share of six is full already.
  EXPECT_EQ(even_share_shared_bytes(20000, 792, kSms, kH200Shared, kReserved, 6), size_t(20000));
  EXPECT_EQ(resident(even_share_shared_bytes(20000, 700, kSms, kH200Shared, kReserved, 8)), 6);
}

TEST(Occupancy, DegenerateInputsKeepTheRequest) {
  EXPECT_EQ(even_share_shared_bytes(1000, 0, kSms, kH200Shared, kReserved, 6), size_t(1000));
  EXPECT_EQ(even_share_shared_bytes(1000, 10, 0, kH200Shared, kReserved, 6), size_t(1000));
  EXPECT_EQ(even_share_shared_bytes(1000, 10, kSms, 0, kReserved, 6), size_t(1000));
}

}  // namespace
}  // namespace gdn::testing
