// The I/O engine's limits on its options, which are also the `aio` config
// keys' ranges. nvme owns them (IoEngine::create refuses a value outside
// them); common's config loader includes this header so a config is refused
// at load time for exactly what the engine would refuse later.
// Note [Config key ranges] in common/src/config.cpp says why this header
// includes nothing and lives in its own folder.
#pragma once

#include <cstddef>

namespace tz::nvme {

// aio.block_size: the largest piece one request is split into. O_DIRECT wants
// whole 4 KiB blocks; a registered buffer slot is at most 1 GiB (the kernel's limit).
inline constexpr std::size_t kBlockSizeAlignBytes = 4096;
inline constexpr std::size_t kMaxBlockSizeBytes = std::size_t{1} << 30;

// aio.queue_depth: pieces in flight per ring (its io_uring gets one entry
// more). The kernel would take up to 32768 entries; 4096 pieces of even 4 KiB
// in flight on one ring are already past what an NVMe queue keeps busy.
inline constexpr int kMaxQueueDepth = 4096;

// aio.intra_op_parallelism (alias thread_count): rings, each with its own
// thread; more than 64 would only contend for the same device queues.
inline constexpr int kMaxRings = 64;

}  // namespace tz::nvme
