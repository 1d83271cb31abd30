// Communicator: the collectives the engine needs across data-parallel ranks.
//
// Backends: Gloo (CPU memory, TCP) for machines without GPUs and for tests;
// NCCL (GPU memory, on a stream) on GPU machines. Both meet through one
// rendezvous: ranks find their rank and world size the way torchrun starts
// them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) or as mpirun does (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, or
// PMI_RANK/PMI_SIZE). They exchange addresses once, through one of three
// rendezvous, picked in this order and named in the log (info, "comm"):
//   - CommOptions::store, a key-value store on the network (torch's c10d
//     store where Python ranks run under torchrun; tierzero/comm/store.h);
//   - MPI, when the variables are mpirun's, no rendezvous directory is named,
//     and this tierzero was built with MPI (Note [MPI rendezvous]);
//   - a rendezvous directory (Gloo's FileStore; on one node a local
//     directory, across nodes one on a shared file system).
// With none of the launcher variables set, a process is rank 0 of 1.
//
// Network interface: CommOptions::interface, else GLOO_SOCKET_IFNAME (Gloo)
// or NCCL_SOCKET_IFNAME (NCCL's own bootstrap reads it), else the address
// that reaches MASTER_ADDR.
//
// Failure: every collective is bounded by CommOptions::timeout. A rank that
// dies (or never arrives) makes the others fail with Timeout or IoError naming
// the collective and the peer where known, never hang.
//
// Example:
//   TZ_ASSIGN_OR_RETURN(tz::RankInfo ranks, tz::rank_info_from_env());
//   TZ_ASSIGN_OR_RETURN(auto comm, tz::create_communicator({.ranks = ranks}));
//   TZ_TRY(comm->all_gather(shard, whole, shard_numel, tz::DType::kBf16));
//
// Threads: one collective at a time per communicator (calls from several
// threads are serialised in call order; ranks must issue collectives in the
// same order). Memory: Gloo takes host pointers; NCCL device pointers.
// Streams: NCCL enqueues each collective on `stream` (required) and returns;
// completion is observed through the stream (events). Gloo ignores `stream`,
// runs on the calling thread and returns when the collective is complete.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "tierzero/comm/store.h"
#include "tierzero/offload.h"

namespace tz {

enum class CommBackend : std::uint8_t { kAuto, kGloo, kNccl };
std::string_view comm_backend_name(CommBackend backend);  // "auto" | "gloo" | "nccl"


enum class ReduceOp : std::uint8_t { kSum, kMax, kMin };

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "default";  // "torchrun", "mpirun (Open MPI)", "PMI", "default"
  bool master_addr_set = false;      // MASTER_ADDR was in the environment
};

// Reads the environment (see the header comment). Inconsistent values
// (RANK >= WORLD_SIZE, a non-number, a port outside 1..65535) are
// InvalidArgument naming the variable and its value.
Expected<RankInfo> rank_info_from_env();

struct CommOptions {
  CommBackend backend = CommBackend::kAuto;  // kAuto: NCCL when the device is CUDA, else Gloo
  RankInfo ranks;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // per collective and for the rendezvous
  // Where ranks meet; "" = $TIERZERO_RENDEZVOUS_DIR, else
  // /tmp/tierzero-rendezvous-<master_addr>-<master_port>. Created if missing.
  std::string rendezvous_dir;
  // A store every rank reaches (tierzero/comm/store.h); when set, ranks meet
  // through it and rendezvous_dir is unused.
  std::shared_ptr<RendezvousStore> store;
  // Network interface or address Gloo binds to; "" = $GLOO_SOCKET_IFNAME,
  // else the one that reaches master_addr (or, under MPI without MASTER_ADDR,
  // the address this host's name resolves to).
  std::string interface;
  Device* device = nullptr;                  // NCCL: the CUDA device (required); Gloo: unused
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual CommBackend backend() const = 0;
  // "gloo over tcp (eth0), rank 1 of 4" ...
  virtual std::string describe() const = 0;

  // recv (size() * count elements) = every rank's send (count elements), in
  // rank order. send may alias recv + rank() * count (in place).
  virtual Status all_gather(const void* send, void* recv, std::size_t count, DType type,
                            Stream* stream = nullptr) = 0;
  // recv (count elements) = op over ranks of send[rank() * count, (rank() + 1) * count),
  // send being size() * count elements.
  virtual Status reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op,
                                Stream* stream = nullptr) = 0;
  // In place: buf (count elements) = op over ranks of buf.
  virtual Status all_reduce(void* buf, std::size_t count, DType type, ReduceOp op, Stream* stream = nullptr) = 0;
  // buf (bytes) on every rank = root's buf.
  virtual Status broadcast(void* buf, std::size_t bytes, int root, Stream* stream = nullptr) = 0;
  virtual Status barrier() = 0;

  // What this rank is doing, posted where the other ranks read it when one of
  // their collectives times out, so the message can say (Gloo: Note [What the
  // other ranks were doing]; the other backends ignore it). `step`: the
  // optimizer step under way, 1-based. `activity`: what the next collectives
  // are for ("" for nothing in particular). Any thread; a few stores.
  virtual void note_step(std::int64_t /*step*/) {}
  virtual void note_activity(std::string_view /*activity*/) {}
};

// Joins the group described by options.ranks; waits up to options.timeout for
// every rank to arrive. On one rank (world_size 1) no network is used.
Expected<std::unique_ptr<Communicator>> create_communicator(const CommOptions& options);

}  // namespace tz
