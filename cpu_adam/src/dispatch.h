// Run-time choice of the kernel object (Note [One object per instruction set]).
#pragma once

#include <optional>

#include "kernel_api.h"
#include "tierzero/cpu_adam.h"

namespace tz::cpu_adam::detail {

// Options::simd if set, else the TIERZERO_SIMD environment variable if set,
// else best_supported(). A forced variant that is not compiled in, or that
// this CPU cannot run, is an InvalidArgument naming it and what the CPU runs.
// Logs the choice once per variant and process.
Expected<Simd> choose_simd(const std::optional<Simd>& forced);

// The kernels of a compiled variant the CPU supports.
const KernelTable& kernel_table(Simd simd);

}  // namespace tz::cpu_adam::detail
