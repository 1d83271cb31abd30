// XXH3-64 with SSE2 (the x86-64 baseline flags).
#define TZ_XXH3_NAME xxh3_64_sse2
#define TZ_XXH3_VECTOR XXH_SSE2
#include "xxh3_impl.h"
