// SSE4.2 kernels (4 lanes, no FMA, software fp16). Built with -msse4.2 only
// (cpu_adam/CMakeLists.txt); Note [One object per instruction set].
#if !defined(__SSE4_2__)
#error "kernels_sse4_2.cpp must be built with -msse4.2"
#endif
#include "kernel_impl.h"

namespace tz::cpu_adam::detail {
namespace {
constinit const KernelTable kTable = make_table<XsimdOps<xsimd::sse4_2>>(Simd::kSse4_2);
}  // namespace

const KernelTable& kernels_sse4_2() { return kTable; }

}  // namespace tz::cpu_adam::detail
