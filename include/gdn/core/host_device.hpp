// GDN_HOST_DEVICE: marks a function that host-only headers (free of CUDA headers, checked by the
// CPU tests) share with the CUDA kernels, so that nvcc compiles it for both sides without
// --expt-relaxed-constexpr (which a consumer of the headers need not pass). GDN_FORCE_INLINE:
// inlined into the kernels as their own device functions are (__forceinline__), plain inline on
// the host.
#pragma once

#if defined(__CUDACC__)
#define GDN_HOST_DEVICE __host__ __device__
#define GDN_FORCE_INLINE __forceinline__
#else
#define GDN_HOST_DEVICE
#define GDN_FORCE_INLINE inline
#endif
