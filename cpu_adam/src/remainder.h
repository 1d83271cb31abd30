// The remainder master format, element by element: the scalar split and join
// that the scalar kernels and the public conversions use (the SIMD kernels do
// the same lane-wise, simd_ops.h).
//
// Note [Remainder masters]
// The remainder format keeps an fp32 master m as its bf16 parameter h =
// RNE(m) plus what h lacks. On the raw bit pattern, round to nearest even is
//   h = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
// for either sign, so d = bits(m) - (h << 16), taken in uint32 wrap-around
// arithmetic, lies in [-0x8000, 0x8000]. The masters that round to an even h
// are the bit patterns (h << 16) - 0x8000 to (h << 16) + 0x8000 inclusive:
// 65537 values, because both ties round to the even h; an odd h has only the
// 65535 from (h << 16) - 0x7fff to (h << 16) + 0x7fff. (+-0 and +-inf keep one
// side of that window, 32769: beyond them lie the other sign or NaNs.) So 16
// bits cannot rebuild every master. We store
//   r = int16(d)      (d = +0x8000 wraps to -0x8000)
//   t = (d == 0x8000) (the tie above an even h)
// and rebuild bits = (h << 16) + sext(r) + (t ? 0x10000 : 0). No value needs a
// special case: finite masters that round up to infinity (0x7f7f8000 to
// 0x7f7fffff, and their negatives) have d in [-0x8000, -1]. NaN masters have
// no h to be near (the copy-out makes (bits >> 16) | 0x40 of them), so they
// store r = t = 0 and come back as that bf16 NaN widened: still a NaN, its
// payload's low bits lost (a NaN master has no future in a step anyway).
// Cost: 2 + 1/8 bytes a parameter instead of 4 (tz::master_bytes in
// common/state_format.h, whose Note [Master remainder] sizes the format for
// the planner).
//
// The tie bits are packed, element i in bit i % 8 of byte i / 8. Tiles start
// at multiples of 16 elements (optimizer.cpp: kTileQuantum, and
// Options::tile_elems is a multiple of 16), so no two threads write one byte;
// inside a tile, vectors narrower than a byte (4 lanes, 1 lane) take a byte's
// 8 elements together, reading and writing it once (kernel_impl.h,
// kTieGroup). Tails go through the zero-padded buffers of Note [Tails and
// unaligned spans] with their bits copied in and out one by one, so the bits
// of the last byte past n are left as they were.
// tests/cpu_adam/remainder_test.cpp enumerates every master of a few even and
// odd h and round-trips it through the conversions and every kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "convert.h"

namespace tz::cpu_adam::detail {

// The split and join themselves are shared with the GPU optimizer's compact
// Adam (tierzero/common/state_math.h).
using state_math::join_master;
using state_math::kTie;
using state_math::kTieStep;
using state_math::split_master;
using state_math::SplitMaster;

}  // namespace tz::cpu_adam::detail
