// splitmix64: a 64-bit mixing function. Counter-based random streams (the
// workloads' initial weights and batches) hash (seed, index) with it, so any
// element or batch is drawn on its own without replaying the others.
#pragma once

#include <cstdint>

namespace tz {

constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace tz
