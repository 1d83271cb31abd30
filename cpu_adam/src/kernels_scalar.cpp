// The scalar kernels: plain loops built for the baseline ISA, the variant
// every CPU runs (and the fallback on non-x86 builds).
#define TZ_ADAM_SCALAR_ONLY 1
#include "kernel_impl.h"

namespace tz::cpu_adam::detail {
namespace {
constinit const KernelTable kTable = make_table<ScalarOps>(Simd::kScalar);
}  // namespace

const KernelTable& kernels_scalar() { return kTable; }

}  // namespace tz::cpu_adam::detail
