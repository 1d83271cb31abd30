// XXH3-64 with AVX-512F (compiled with -mavx512f; run only where the CPU has it).
// GCC 12 warns inside its own AVX-512 headers: _mm512_undefined_* initialise
// a variable with itself (GCC PR105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define TZ_XXH3_NAME xxh3_64_avx512
#define TZ_XXH3_VECTOR XXH_AVX512
#include "xxh3_impl.h"
