// Element-wise reductions for the CPU collectives, one per (DType, ReduceOp).
//
//   out[i] = a[i] op b[i], i < n
//
// `out` may alias `a` or `b` (each element is read before it is written).
// 16-bit floats (bf16, fp16) are widened to fp32 for the operation and the
// sum is rounded back to nearest, ties to even, once per addition (the
// rounding NCCL applies at each step of its ring). Max and min return one of
// the inputs exactly, and a NaN in either input wins (a NaN must not vanish
// in an overflow check). Integer sums wrap (two's complement), as NCCL's do.
#pragma once

#include <cstddef>

#include "tierzero/comm/communicator.h"

namespace tz::comm_detail {

using ReduceFn = void (*)(void* out, const void* a, const void* b, std::size_t n);

// nullptr for a value outside the enums (the callers check first).
ReduceFn reduce_function(DType type, ReduceOp op);

}  // namespace tz::comm_detail
