// tierzero/engine.h: the engine module's public header, and the one header a
// program that links tierzero::engine needs.
//
//   engine/model.h  the model as blocks of parameters; flattening and sharding
//   engine/zero.h   ZeroEngine: partitioned, tiered states and the training step
//   engine/reference.h  the in-memory states and optimizer step references share
// It also re-exports the modules the engine builds on (comm, offload, nvme,
// cpu_adam, and through them common and kernels). The MLP test workload lives
// in tierzero::testing (tierzero/testing/mlp.h).
#pragma once

#include <string>

#include "tierzero/cpu_adam.h"
#include "tierzero/comm.h"
#include "tierzero/engine/model.h"
#include "tierzero/engine/reference.h"
#include "tierzero/engine/zero.h"
#include "tierzero/nvme.h"
#include "tierzero/offload.h"

namespace tz {

// "0.1.0".
std::string version();
// One line: version, CUDA on/off and architectures, build type.
std::string build_summary();

}  // namespace tz
