// tierzero/nvme.h: the NVMe tier. One public header for the module.
//
//   io_engine.h   IoEngine: asynchronous O_DIRECT reads and writes through
//                 io_uring (a pread/pwrite thread pool where io_uring is
//                 refused), split in blocks, striped over files, every
//                 completion checked, optional per-block checksums.
//   swap_store.h  SwapStore: byte extents (tensors) in preallocated swap files
//                 on one or more paths, each extent checksummed.
#pragma once

#include "tierzero/nvme/io_engine.h"
#include "tierzero/nvme/swap_store.h"
