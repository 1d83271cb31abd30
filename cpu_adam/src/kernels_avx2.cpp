// AVX2 kernels (8 lanes, FMA, F16C). Built with -mavx2 -mfma -mf16c
// (cpu_adam/CMakeLists.txt); Note [One object per instruction set].
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kernels_avx2.cpp must be built with -mavx2 -mfma -mf16c"
#endif
#include "kernel_impl.h"

namespace tz::cpu_adam::detail {
namespace {
constinit const KernelTable kTable = make_table<XsimdOps<xsimd::fma3<xsimd::avx2>>>(Simd::kAvx2);
}  // namespace

const KernelTable& kernels_avx2() { return kTable; }

}  // namespace tz::cpu_adam::detail
