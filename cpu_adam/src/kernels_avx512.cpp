// AVX-512 kernels (16 lanes; F, BW, DQ, VL). Built with -mavx512f -mavx512bw
// -mavx512dq -mavx512vl -mfma (cpu_adam/CMakeLists.txt); Note [One object per
// instruction set].
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__)
#error "kernels_avx512.cpp must be built with -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma"
#endif
// GCC 12 warns inside its own AVX-512 headers: _mm512_undefined_* initialise
// a variable with itself (GCC PR105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernel_impl.h"

namespace tz::cpu_adam::detail {
namespace {
constinit const KernelTable kTable = make_table<XsimdOps<xsimd::avx512bw>>(Simd::kAvx512);
}  // namespace

const KernelTable& kernels_avx512() { return kTable; }

}  // namespace tz::cpu_adam::detail
