// What the communicator backends share, private to engine/src: the options
// after defaults are applied, each backend's factory, and the argument checks
// every backend runs first (so a bad call reads the same whichever backend
// it reaches).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "tierzero/comm/communicator.h"

namespace tz::comm_detail {

// Where ranks meet (comm/communicator.h says how it is picked).
enum class RendezvousKind : std::uint8_t { kStore, kMpi, kFile };

// CommOptions with the backend and rendezvous picked, the rendezvous
// directory resolved and the interface read from the environment.
struct ResolvedCommOptions {
  CommBackend backend = CommBackend::kGloo;  // never kAuto here
  RankInfo ranks;
  std::chrono::milliseconds timeout{0};
  RendezvousKind rendezvous = RendezvousKind::kFile;
  std::string rendezvous_dir;  // kFile: absolute or as given; exists
  std::shared_ptr<RendezvousStore> store;  // kStore
  std::string interface;
  Device* device = nullptr;
};

// Whether this build can meet through MPI (TIERZERO_WITH_MPI).
bool mpi_built();

// world_size 1: no network; collectives are copies (stream-ordered through
// the device when it is a CUDA device, memcpy otherwise).
std::unique_ptr<Communicator> create_single_rank_communicator(const ResolvedCommOptions& options);
Expected<std::unique_ptr<Communicator>> create_gloo_communicator(const ResolvedCommOptions& options);
// Built with NCCL only (nccl.cpp, nccl_stubs.cpp). load_nccl() loads libnccl
// and resolves the entry points the backend calls, once per process (Note
// [CUDA libraries load on first use]); the error names the paths tried.
Status load_nccl();
// Defined only in builds with NCCL (TIERZERO_WITH_NCCL).
Expected<std::unique_ptr<Communicator>> create_nccl_communicator(const ResolvedCommOptions& options);

// "all_gather of 1000 bf16 (rank 1 of 4)": how every error names a collective.
std::string describe_call(std::string_view op, std::size_t count, DType type, int rank, int size);

// Argument checks (InvalidArgument naming the collective, count and rank).
// Counts are elements; null pointers are allowed only with count 0.
Status check_all_gather(const void* send, const void* recv, std::size_t count, DType type, int rank,
                        int size);
Status check_reduce_scatter(const void* send, const void* recv, std::size_t count, DType type, ReduceOp op,
                            int rank, int size);
Status check_all_reduce(const void* buf, std::size_t count, DType type, ReduceOp op, int rank, int size);
Status check_broadcast(const void* buf, std::size_t bytes, int root, int rank, int size);

std::string_view reduce_op_name(ReduceOp op);  // "sum" | "max" | "min"

// Keeps an address usable in a file name: "::1" -> "__1".
std::string file_name_safe(std::string_view text);

}  // namespace tz::comm_detail
