// The NCCL entry points the NCCL backend (nccl.cpp) calls, loaded on first
// use instead of linked (Note [CUDA libraries load on first use] in
// common/src/shared_library.cpp). Each definition below has nccl.h's name and
// signature and forwards to libnccl's function; a call made when the library
// could not be loaded returns ncclSystemError (create_nccl_communicator calls
// load_nccl() first, which says why).
#include <nccl.h>

#include <string>

#include "internal.h"
#include "tierzero/common/shared_library.h"

// X(return type, name, (parameters), (arguments), value when not loaded)
#define TZ_NCCL_ENTRY_POINTS(X)                                                                                    \
  X(ncclResult_t, ncclGetVersion, (int* version), (version), ncclSystemError)                                      \
  X(ncclResult_t, ncclGetUniqueId, (ncclUniqueId * id), (id), ncclSystemError)                                     \
  X(ncclResult_t, ncclCommInitRankConfig,                                                                          \
    (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config),                              \
    (comm, nranks, id, rank, config), ncclSystemError)                                                             \
  X(ncclResult_t, ncclCommFinalize, (ncclComm_t comm), (comm), ncclSystemError)                                    \
  X(ncclResult_t, ncclCommDestroy, (ncclComm_t comm), (comm), ncclSystemError)                                     \
  X(ncclResult_t, ncclCommAbort, (ncclComm_t comm), (comm), ncclSystemError)                                       \
  X(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * state), (comm, state), ncclSystemError) \
  X(const char*, ncclGetErrorString, (ncclResult_t result), (result), "NCCL is not loaded")                        \
  X(const char*, ncclGetLastError, (ncclComm_t comm), (comm), "NCCL is not loaded")                               \
  X(ncclResult_t, ncclAllGather,                                                                                   \
    (const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream),       \
    (send, recv, count, type, comm, stream), ncclSystemError)                                                      \
  X(ncclResult_t, ncclReduceScatter,                                                                               \
    (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,             \
     cudaStream_t stream),                                                                                         \
    (send, recv, count, type, op, comm, stream), ncclSystemError)                                                  \
  X(ncclResult_t, ncclAllReduce,                                                                                   \
    (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,             \
     cudaStream_t stream),                                                                                         \
    (send, recv, count, type, op, comm, stream), ncclSystemError)                                                  \
  X(ncclResult_t, ncclBroadcast,                                                                                   \
    (const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,                   \
     cudaStream_t stream),                                                                                         \
    (send, recv, count, type, root, comm, stream), ncclSystemError)

namespace tz::comm_detail {
namespace {

TZ_LAZY_API(NcclApi, TZ_NCCL_ENTRY_POINTS);
NcclApi api;

LazyLibrary& nccl_library() {
  static LazyLibrary library("NCCL", "libnccl.so." + std::to_string(NCCL_MAJOR), TIERZERO_NCCL_LIBRARY_DIR,
                             [](const SharedLibrary& lib) { return api.resolve(lib); });
  return library;
}

}  // namespace

Status load_nccl() { return nccl_library().load(); }

}  // namespace tz::comm_detail

// Hidden: neither the executable nor the Python module exports them, so they
// cannot stand in for another copy of NCCL loaded in the same process.
#pragma GCC visibility push(hidden)
extern "C" {
#define TZ_NCCL_FORWARD(ret, name, params, args, failed) \
  TZ_FORWARD_LAZY(tz::comm_detail::nccl_library(), tz::comm_detail::api, failed, ret, name, params, args)
TZ_NCCL_ENTRY_POINTS(TZ_NCCL_FORWARD)
#undef TZ_NCCL_FORWARD
}
#pragma GCC visibility pop
