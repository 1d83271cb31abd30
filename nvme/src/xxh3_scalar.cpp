// XXH3-64 in portable C (no vector code): any CPU, and the tests' reference.
#define XXH_VECTOR XXH_SCALAR
#define TZ_XXH3_NAME xxh3_64_scalar
#define TZ_XXH3_VECTOR XXH_SCALAR
#include "xxh3_impl.h"
