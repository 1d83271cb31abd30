// The whole of each xxh3_<isa>.cpp: XXH3-64 from xxhash.h, inlined, its vector
// code picked by the flags the file is compiled with (or by XXH_VECTOR where
// the file sets it). The including file defines TZ_XXH3_NAME (the function to
// define) and TZ_XXH3_VECTOR (the XXH_VECTOR the flags must give).
//
// Include nothing else here. With XXH_INLINE_ALL every xxhash function is
// static, so nothing compiled with AVX flags leaves the object but
// TZ_XXH3_NAME; an inline function from a shared C++ header, by contrast,
// could be emitted here with AVX-512 code and be the copy the linker keeps
// for the whole program.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "xxh3_variants.h"

#if XXH_VECTOR != TZ_XXH3_VECTOR
#error "xxh3_impl.h: the compiler flags of this file do not give the XXH3 vector code its name promises"
#endif

namespace tz::nvme::detail {

std::uint64_t TZ_XXH3_NAME(const void* data, std::size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace tz::nvme::detail
