// rank_info_from_env(): which rank this process is, from the launcher's
// environment variables.
#include <charconv>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "tierzero/comm/communicator.h"

namespace tz {
namespace {

// One launcher's names for rank, world size, local rank and local size.
struct LauncherVars {
  std::string_view source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

// In order of precedence: torchrun inside an mpirun allocation is torchrun.
// MPICH and Intel MPI (Hydra) export PMI_RANK/PMI_SIZE and, for the node,
// MPI_LOCALRANKID/MPI_LOCALNRANKS.
constexpr LauncherVars kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
};

// The variable's value; an empty value counts as unset (`RANK= prog` clears it).
std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// The whole value must be a decimal integer: "3 ", "0x3" and "3abc" are refused.
Expected<int> env_int(const char* name, const std::string& value) {
  int out = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, out);
  if (ec != std::errc() || ptr != end) {
    return invalid_argument("environment variable {}=\"{}\" is not an integer", name, value);
  }
  return out;
}

// Reads an optional integer variable; `fallback` when unset.
Expected<int> env_int_or(const char* name, int fallback) {
  std::optional<std::string> value = env(name);
  if (!value) return fallback;
  return env_int(name, *value);
}

Status check_rank_pair(const char* rank_name, int rank, const char* size_name, int size) {
  if (size < 1) return invalid_argument("environment variable {}={} must be at least 1", size_name, size);
  if (rank < 0 || rank >= size) {
    return invalid_argument("environment variable {}={} is out of range for {}={} (0..{})", rank_name, rank,
                            size_name, size, size - 1);
  }
  return ok_status();
}

// Fills rank, world size and the local pair from one launcher's variables.
// Without local variables the job is taken to be on one node.
Status read_launcher(const LauncherVars& vars, RankInfo& info) {
  std::optional<std::string> rank = env(vars.rank);
  std::optional<std::string> size = env(vars.size);
  if (rank.has_value() != size.has_value()) {
    const char* set = rank ? vars.rank : vars.size;
    const char* unset = rank ? vars.size : vars.rank;
    return invalid_argument("environment variable {}={} is set but {} is not (launched by {}?)", set,
                            rank ? *rank : *size, unset, vars.source);
  }
  TZ_ASSIGN_OR_RETURN(info.rank, env_int(vars.rank, *rank));
  TZ_ASSIGN_OR_RETURN(info.world_size, env_int(vars.size, *size));
  TZ_TRY(check_rank_pair(vars.rank, info.rank, vars.size, info.world_size));
  TZ_ASSIGN_OR_RETURN(info.local_rank, env_int_or(vars.local_rank, info.rank));
  TZ_ASSIGN_OR_RETURN(info.local_world_size, env_int_or(vars.local_size, info.world_size));
  TZ_TRY(check_rank_pair(vars.local_rank, info.local_rank, vars.local_size, info.local_world_size));
  if (info.local_world_size > info.world_size) {
    return invalid_argument("environment variable {}={} exceeds {}={}", vars.local_size, info.local_world_size,
                            vars.size, info.world_size);
  }
  info.source = std::string(vars.source);
  return ok_status();
}

Status read_master(RankInfo& info) {
  if (std::optional<std::string> addr = env("MASTER_ADDR")) {
    info.master_addr = *addr;
    info.master_addr_set = true;
  }
  TZ_ASSIGN_OR_RETURN(info.master_port, env_int_or("MASTER_PORT", info.master_port));
  if (info.master_port < 1 || info.master_port > 65535) {
    return invalid_argument("environment variable MASTER_PORT={} must be a port in 1..65535", info.master_port);
  }
  return ok_status();
}

}  // namespace

Expected<RankInfo> rank_info_from_env() {
  RankInfo info;
  for (const LauncherVars& vars : kLaunchers) {
    if (env(vars.rank) || env(vars.size)) {
      TZ_TRY(read_launcher(vars, info));
      break;
    }
  }
  TZ_TRY(read_master(info));
  return info;
}

}  // namespace tz
