// Occupancy arithmetic of a CUDA launch, host only and free of CUDA headers (the CPU tests check
// it): how much dynamic shared memory a CTA asks for so that a launch's CTAs spread evenly over the
// SMs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gdn {

// Bytes by which an SM allocates shared memory to a CTA (sm_80 and sm_90 allocate in 128-byte
// units; one such unit covers the rounding).
inline constexpr size_t kSharedAllocationUnit = 128;

// CTAs of `needed` bytes of dynamic shared memory that an SM's `shared_per_sm` bytes hold, the
// runtime reserving `reserved_per_cta` bytes per CTA.
inline int64_t shared_memory_resident(size_t needed, size_t shared_per_sm,
                                      size_t reserved_per_cta) {
  return int64_t(shared_per_sm / (needed + reserved_per_cta));
}

// Waves of a launch of `ctas` CTAs at `ctas_per_sm` per SM.
inline int64_t launch_waves(int64_t ctas, int sm_count, int64_t ctas_per_sm) {
  const int64_t per_wave = ctas_per_sm * sm_count;
  return (ctas + per_wave - 1) / per_wave;
}

// The hardware does not spread a launch's CTAs evenly over the SMs when there are fewer than the
// SMs hold at once: it fills some SMs to the kernel's occupancy and leaves others nearly empty,
// and the launch lasts as long as its fullest SMs. A CTA that asks for more shared memory than it
// uses caps the CTAs per SM at the even share, ceil(ctas / sm_count).
//
// A launch of several waves is capped the same way, at the fewest CTAs per SM that still take it
// in as many waves, ceil(ctas / (waves * sm_count)): an SM that holds one CTA more only makes each
// of them slower when the wave count stays. The measurements behind both caps are in
// docs/cuda-kernels.md (launch rules).
//
// Returns the dynamic shared memory to launch with (never less than `needed`): `needed` itself
// when the share is at least what fits an SM anyway (`max_resident` by registers and threads, or
// fewer by `needed` bytes), else the least that lets the share fit and one CTA more not.
// `reserved_per_cta`: the shared memory the runtime reserves per CTA (1 KB on sm_80 and sm_90).
inline size_t even_share_shared_bytes(size_t needed, int64_t ctas, int sm_count,
                                      size_t shared_per_sm, size_t reserved_per_cta,
                                      int max_resident) {
  if (ctas <= 0 || sm_count <= 0 || shared_per_sm == 0) return needed;
  const int64_t fit = shared_memory_resident(needed, shared_per_sm, reserved_per_cta);
  const int64_t resident = fit < max_resident ? fit : int64_t(max_resident);
  if (resident <= 0) return needed;
  const int64_t waves = launch_waves(ctas, sm_count, resident);
  const int64_t share = (ctas + waves * sm_count - 1) / (waves * sm_count);
  if (share >= resident) return needed;
  const size_t slice = shared_per_sm / size_t(share + 1);  // share + 1 CTAs must not fit
  if (slice <= reserved_per_cta) return needed;
  const size_t padded = slice - reserved_per_cta + kSharedAllocationUnit;
  return padded > needed ? padded : needed;
}

}  // namespace gdn
