// XXH3-64 with AVX2 (compiled with -mavx2; run only where the CPU has it).
#define TZ_XXH3_NAME xxh3_64_avx2
#define TZ_XXH3_VECTOR XXH_AVX2
#include "xxh3_impl.h"
