// One check macro per foreign API. Each turns the API's failure convention into
// a Status that names the call, and returns it from the enclosing function
// (which must return Status or Expected<T>).
//
//   TZ_SYSCALL(n, ::pread(fd, buf, len, off));   // -1/errno, EINTR retried; n = result
//   TZ_URING_CHECK(io_uring_queue_init(64, &ring, 0));   // negative errno
//   TZ_CUDA_CHECK(cudaMemcpyAsync(...));   // cudaError_t; clears the error state
//   TZ_NCCL_CHECK(ncclAllGather(...));     // ncclResult_t
//
// The CUDA and NCCL macros exist when the including file has cuda_runtime.h /
// nccl.h included first.
#pragma once

#include <cerrno>

#include "tierzero/common/status.h"

namespace tz::detail {
inline Status syscall_error(int err, const char* call, std::source_location where) {
  return errno_status(err, call).add_frame(where);
}
}  // namespace tz::detail

// Runs `call` until it does not fail with EINTR; on -1 returns an errno Status
// naming the call; otherwise stores the result in `result_var` (declared here).
#define TZ_SYSCALL(result_var, call)                                             \
  auto result_var = (call);                                                      \
  while (result_var == -1 && errno == EINTR) result_var = (call);                \
  if (result_var == -1) {                                                        \
    return ::tz::detail::syscall_error(errno, #call, std::source_location::current()); \
  }

// Runs `call` (EINTR retried) and discards its non-error result.
#define TZ_SYSCALL_CHECK(call)                                                   \
  do {                                                                           \
    TZ_SYSCALL(tz_syscall_result_, call);                                        \
    (void)tz_syscall_result_;                                                    \
  } while (0)

// liburing returns -errno.
#define TZ_URING_CHECK(call)                                                     \
  do {                                                                           \
    int tz_uring_rc_ = (call);                                                   \
    if (tz_uring_rc_ < 0) {                                                      \
      return ::tz::detail::syscall_error(-tz_uring_rc_, #call, std::source_location::current()); \
    }                                                                            \
  } while (0)

#if defined(__CUDA_RUNTIME_API_H__) || defined(__CUDACC__)
namespace tz::detail {
// Names the call and the CUDA error, and clears the (non-sticky) error so the
// next call does not see it. Sticky errors (a kernel fault) stay, and say so.
inline Status cuda_error(cudaError_t err, const char* call, std::source_location where) {
  (void)cudaGetLastError();
  ErrorCode code = err == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory
                   : (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
                       ? ErrorCode::kUnavailable
                       : ErrorCode::kInternal;
  return Status(code, fmt::format("{}: {} ({}, CUDA error {})", call, cudaGetErrorString(err),
                                  cudaGetErrorName(err), static_cast<int>(err)))
      .add_frame(where);
}
}  // namespace tz::detail
#define TZ_CUDA_CHECK(call)                                                      \
  do {                                                                           \
    cudaError_t tz_cuda_err_ = (call);                                           \
    if (tz_cuda_err_ != cudaSuccess) {                                           \
      return ::tz::detail::cuda_error(tz_cuda_err_, #call, std::source_location::current()); \
    }                                                                            \
  } while (0)
#endif

#if defined(NCCL_H_)
namespace tz::detail {
inline Status nccl_error(ncclResult_t res, const char* call, std::source_location where) {
  ErrorCode code = res == ncclInvalidArgument || res == ncclInvalidUsage ? ErrorCode::kInvalidArgument
                   : res == ncclSystemError                             ? ErrorCode::kIoError
                                                                        : ErrorCode::kInternal;
  return Status(code, fmt::format("{}: {} (NCCL error {})", call, ncclGetErrorString(res),
                                  static_cast<int>(res)))
      .add_frame(where);
}
}  // namespace tz::detail
#define TZ_NCCL_CHECK(call)                                                      \
  do {                                                                           \
    ncclResult_t tz_nccl_res_ = (call);                                          \
    if (tz_nccl_res_ != ncclSuccess && tz_nccl_res_ != ncclInProgress) {         \
      return ::tz::detail::nccl_error(tz_nccl_res_, #call, std::source_location::current()); \
    }                                                                            \
  } while (0)
#endif
