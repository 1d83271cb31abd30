// tierzero/offload.h: the offload module's public header — the memory tiers.
//
//   device.h       Device (CUDA | Host backend), streams, events, async copies
//   pool.h         MemoryPool: budgeted caching allocator with {current, peak} stats
//   host_memory.h  pinned, NUMA-placed host memory; pool factories per tier
//   planner.h      placement planner: which tier holds each state class
//   tiered_store.h TieredStore: one state's shards on the gpu, cpu or nvme tier
//
// Include this header; the parts are split by concern so each reads on its own.
#pragma once

#include "tierzero/offload/device.h"
#include "tierzero/offload/host_memory.h"
#include "tierzero/offload/planner.h"
#include "tierzero/offload/pool.h"
#include "tierzero/offload/tiered_store.h"
