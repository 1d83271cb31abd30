// create_communicator(): picks the backend, resolves the rendezvous directory
// and hands over to the backend; plus the names and argument checks every
// backend shares.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <system_error>

#include "internal.h"
#include "tierzero/comm/communicator.h"

namespace tz {

std::string_view comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::kAuto: return "auto";
    case CommBackend::kGloo: return "gloo";
    case CommBackend::kNccl: return "nccl";
  }
  return "unknown";
}


namespace comm_detail {
namespace {

bool ranges_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// Shared by the checks of collectives that take `size() * count` elements on one side.
Status check_common(std::string_view op, const void* a, const void* b, std::size_t count, DType type,
                    int rank, int size) {
  const std::size_t element_bytes = dtype_bytes(type);
  if (element_bytes == 0) {
    return invalid_argument("{}: DType {} is not a data type", describe_call(op, count, type, rank, size),
                            static_cast<int>(type));
  }
  if (count > std::numeric_limits<std::size_t>::max() / element_bytes / static_cast<std::size_t>(size)) {
    return invalid_argument("{}: {} ranks x {} elements overflows the address space",
                            describe_call(op, count, type, rank, size), size, count);
  }
  if (count > 0 && (a == nullptr || b == nullptr)) {
    return invalid_argument("{}: null buffer with a non-zero count", describe_call(op, count, type, rank, size));
  }
  return ok_status();
}

Status check_op(std::string_view op, ReduceOp reduce, std::size_t count, DType type, int rank, int size) {
  if (reduce != ReduceOp::kSum && reduce != ReduceOp::kMax && reduce != ReduceOp::kMin) {
    return invalid_argument("{}: ReduceOp {} is not a reduction", describe_call(op, count, type, rank, size),
                            static_cast<int>(reduce));
  }
  return ok_status();
}

}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

std::string file_name_safe(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '-' || c == '_';
    if (!keep) c = '_';
  }
  return out;
}

std::string describe_call(std::string_view op, std::size_t count, DType type, int rank, int size) {
  return fmt::format("{} of {} {} (rank {} of {})", op, count, dtype_name(type), rank, size);
}

Status check_all_gather(const void* send, const void* recv, std::size_t count, DType type, int rank,
                        int size) {
  TZ_TRY(check_common("all_gather", send, recv, count, type, rank, size));
  const std::size_t shard_bytes = count * dtype_bytes(type);
  const auto* own_slot = static_cast<const std::byte*>(recv) + static_cast<std::size_t>(rank) * shard_bytes;
  if (send != own_slot && ranges_overlap(send, shard_bytes, recv, shard_bytes * static_cast<std::size_t>(size))) {
    return invalid_argument("{}: send overlaps recv but is not recv + rank * count (the only in-place form)",
                            describe_call("all_gather", count, type, rank, size));
  }
  return ok_status();
}

Status check_reduce_scatter(const void* send, const void* recv, std::size_t count, DType type, ReduceOp op,
                            int rank, int size) {
  TZ_TRY(check_common("reduce_scatter", send, recv, count, type, rank, size));
  TZ_TRY(check_op("reduce_scatter", op, count, type, rank, size));
  const std::size_t shard_bytes = count * dtype_bytes(type);
  const auto* own_shard = static_cast<const std::byte*>(send) + static_cast<std::size_t>(rank) * shard_bytes;
  if (recv != own_shard && ranges_overlap(recv, shard_bytes, send, shard_bytes * static_cast<std::size_t>(size))) {
    return invalid_argument("{}: recv overlaps send but is not send + rank * count (the only in-place form)",
                            describe_call("reduce_scatter", count, type, rank, size));
  }
  return ok_status();
}

Status check_all_reduce(const void* buf, std::size_t count, DType type, ReduceOp op, int rank, int size) {
  TZ_TRY(check_common("all_reduce", buf, buf, count, type, rank, size));
  return check_op("all_reduce", op, count, type, rank, size);
}

Status check_broadcast(const void* buf, std::size_t bytes, int root, int rank, int size) {
  TZ_TRY(check_common("broadcast", buf, buf, bytes, DType::kUint8, rank, size));
  if (root < 0 || root >= size) {
    return invalid_argument("{}: root {} is not a rank (0..{})",
                            describe_call("broadcast", bytes, DType::kUint8, rank, size), root, size - 1);
  }
  return ok_status();
}

}  // namespace comm_detail

namespace {

#if defined(TIERZERO_WITH_NCCL)
constexpr bool kNcclBuilt = true;
#else
constexpr bool kNcclBuilt = false;
#endif

bool is_cuda(const Device* device) { return device != nullptr && device->kind() == BackendKind::kCuda; }

Expected<CommBackend> resolve_backend(const CommOptions& options) {
  switch (options.backend) {
    case CommBackend::kGloo: return CommBackend::kGloo;
    case CommBackend::kAuto:
      if (is_cuda(options.device) && kNcclBuilt) return CommBackend::kNccl;
      if (is_cuda(options.device)) {
        TZ_LOG_ONCE_WARN("comm", "CUDA device but no NCCL in this build ({}); using gloo, which takes host "
                         "pointers only", TIERZERO_NCCL_STATUS);
      }
      return CommBackend::kGloo;
    case CommBackend::kNccl:
      if (!kNcclBuilt) {
        return unavailable("the NCCL backend was asked for, but this tierzero was built without NCCL ({})",
                           TIERZERO_NCCL_STATUS);
      }
      if (!is_cuda(options.device)) {
        return invalid_argument("the NCCL backend needs CommOptions::device to be a CUDA device (got {})",
                                options.device ? options.device->name() : std::string("none"));
      }
      return CommBackend::kNccl;
  }
  return invalid_argument("CommBackend {} is not a backend", static_cast<int>(options.backend));
}

Status check_options(const CommOptions& options) {
  const RankInfo& r = options.ranks;
  if (r.world_size < 1) return invalid_argument("RankInfo: world_size {} must be at least 1", r.world_size);
  if (r.rank < 0 || r.rank >= r.world_size) {
    return invalid_argument("RankInfo: rank {} is out of range for world_size {} (0..{})", r.rank, r.world_size,
                            r.world_size - 1);
  }
  if (r.master_port < 1 || r.master_port > 65535) {
    return invalid_argument("RankInfo: master_port {} must be in 1..65535", r.master_port);
  }
  if (r.master_addr.empty()) return invalid_argument("RankInfo: master_addr is empty");
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    return invalid_argument("CommOptions: timeout {} ms must be positive", options.timeout.count());
  }
  return ok_status();
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

bool launched_by_mpi(const RankInfo& ranks) { return ranks.source.starts_with("mpirun") || ranks.source == "PMI"; }

// The order comm/communicator.h states: a store, MPI, a directory.
comm_detail::RendezvousKind pick_rendezvous(const CommOptions& options) {
  if (options.store) return comm_detail::RendezvousKind::kStore;
  const bool dir_named = !options.rendezvous_dir.empty() || !env_or_empty("TIERZERO_RENDEZVOUS_DIR").empty();
  if (launched_by_mpi(options.ranks) && !dir_named) {
    if (comm_detail::mpi_built()) return comm_detail::RendezvousKind::kMpi;
    TZ_LOG_ONCE_WARN("comm", "launched by {}, but this tierzero was built without MPI: ranks meet in a rendezvous "
                     "directory, which ranks on other machines reach only on a shared file system",
                     options.ranks.source);
  }
  if (!dir_named && options.ranks.local_world_size < options.ranks.world_size) {
    TZ_LOG_ONCE_WARN("comm", "ranks on several machines (LOCAL_WORLD_SIZE {} < WORLD_SIZE {}, launched by {}) meet "
                     "in a rendezvous directory, which only a file system every machine shares can hold: set "
                     "TIERZERO_RENDEZVOUS_DIR to one, launch C++ programs with mpirun, or Python ranks with torchrun "
                     "(docs/engine.md, \"Ranks on several machines\")",
                     options.ranks.local_world_size, options.ranks.world_size, options.ranks.source);
  }
  return comm_detail::RendezvousKind::kFile;
}

// CommOptions::interface, else GLOO_SOCKET_IFNAME's first entry (torch
// accepts a comma-separated list; a Gloo device binds to one interface).
std::string resolve_interface(const CommOptions& options) {
  if (!options.interface.empty()) return options.interface;
  const std::string list = env_or_empty("GLOO_SOCKET_IFNAME");
  const std::string first = list.substr(0, list.find(','));
  if (first.size() < list.size()) {
    TZ_LOG_ONCE_INFO("comm", "GLOO_SOCKET_IFNAME={}: Gloo binds to the first, {}", list, first);
  }
  return first;
}

Expected<std::string> resolve_rendezvous_dir(const CommOptions& options) {
  std::string dir = options.rendezvous_dir;
  if (dir.empty()) {
    const std::string env = env_or_empty("TIERZERO_RENDEZVOUS_DIR");
    dir = !env.empty()
              ? env
              : fmt::format("/tmp/tierzero-rendezvous-{}-{}", comm_detail::file_name_safe(options.ranks.master_addr),
                            options.ranks.master_port);
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return errno_status(ec.value(), fmt::format("creating rendezvous directory {}", dir));
  if (!std::filesystem::is_directory(dir, ec)) {
    return invalid_argument("rendezvous directory {} exists but is not a directory", dir);
  }
  return dir;
}

}  // namespace

Expected<std::unique_ptr<Communicator>> create_communicator(const CommOptions& options) {
  TZ_TRY(check_options(options));
  TZ_ASSIGN_OR_RETURN(CommBackend backend, resolve_backend(options));
  comm_detail::ResolvedCommOptions resolved{.backend = backend,
                                            .ranks = options.ranks,
                                            .timeout = options.timeout,
                                            .rendezvous = pick_rendezvous(options),
                                            .rendezvous_dir = {},
                                            .store = options.store,
                                            .interface = resolve_interface(options),
                                            .device = options.device};
  if (options.ranks.world_size == 1) return comm_detail::create_single_rank_communicator(resolved);
  if (resolved.rendezvous == comm_detail::RendezvousKind::kFile) {
    TZ_ASSIGN_OR_RETURN(resolved.rendezvous_dir, resolve_rendezvous_dir(options));
  }
#if defined(TIERZERO_WITH_NCCL)
  if (backend == CommBackend::kNccl) return comm_detail::create_nccl_communicator(resolved);
#endif
  return comm_detail::create_gloo_communicator(resolved);
}

}  // namespace tz
