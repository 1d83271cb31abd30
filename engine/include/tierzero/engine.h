// tierzero/engine.h: the engine module's public header, and the one header a
// program that links tierzero::engine needs.
//
//   engine/comm.h   Communicator: collectives over ranks (Gloo on CPU, NCCL on GPU)
//   engine/model.h  the model as blocks of parameters; flattening and sharding
//   engine/zero.h   ZeroEngine: partitioned, tiered states and the training step
//   engine/mlp.h    a built-in MLP workload and its in-memory reference
//   engine/reference.h  the in-memory states and optimizer step references share
// It also re-exports the modules the engine builds on (offload, nvme,
// cpu_adam, and through them common and kernels).
#pragma once

#include <string>

#include "tierzero/cpu_adam.h"
#include "tierzero/engine/comm.h"
#include "tierzero/engine/mlp.h"
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
