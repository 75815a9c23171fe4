// Umbrella header of libgdn's host-side API (compiles with any C++20 compiler; no CUDA needed).
// CUDA kernels: include the .cuh headers (e.g. gdn/decode_mtp/cuda.cuh) from nvcc-compiled code.
#pragma once

#include "gdn/conv/cpu.hpp"
#include "gdn/conv/params.hpp"
#include "gdn/conv_prefill/cpu.hpp"
#include "gdn/conv_prefill/params.hpp"
#include "gdn/core/dispatch.hpp"
#include "gdn/core/dtype.hpp"
#include "gdn/core/status.hpp"
#include "gdn/core/support.hpp"
#include "gdn/core/tensor_view.hpp"
#include "gdn/decode_mtp/cpu.hpp"
#include "gdn/decode_mtp/params.hpp"
#include "gdn/metadata/builder.hpp"
#include "gdn/metadata/params.hpp"
#include "gdn/metadata/plan.hpp"
#include "gdn/metadata/shadow.hpp"
#include "gdn/metadata/state_rows.hpp"
#include "gdn/prefill/cpu.hpp"
#include "gdn/prefill/params.hpp"
#include "gdn/replay/cpu.hpp"
#include "gdn/replay/params.hpp"
