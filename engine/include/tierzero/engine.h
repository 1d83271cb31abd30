// tierzero/engine.h: the engine module's public header, and the one header a
// program that links tierzero::engine needs.
//
// The engine (ZeRO-3 partitioning, collectives, prefetch scheduler, training
// step, checkpoints) is being built; today this header re-exports the tiers it
// builds on (offload, and through it common and kernels) and says what this
// build of tierzero is.
#pragma once

#include <string>

#include "tierzero/offload.h"

namespace tz {

// "0.1.0".
std::string version();
// One line: version, CUDA on/off and architectures, build type.
std::string build_summary();

}  // namespace tz
