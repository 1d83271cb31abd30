// The NCCL backend: collectives between GPUs, enqueued on the caller's CUDA
// stream. Built only with TIERZERO_CUDA and NCCL (TIERZERO_WITH_NCCL).
//
// Note [NCCL failures]
// NCCL's default calls block: a rank that never arrives hangs
// ncclCommInitRank, and a peer that dies leaves a kernel spinning on the GPU
// while the caller waits on its stream. So:
//   - the communicator is non-blocking (ncclConfig_t::blocking = 0); each call
//     returns at once and this rank polls ncclCommGetAsyncError until the
//     operation settles or CommOptions::timeout passes, then aborts;
//   - a watchdog thread records an event behind each collective. When one has
//     not completed within the timeout of its enqueue, or NCCL reports an
//     asynchronous error (a peer's connection broke), it aborts the
//     communicator, which ends the waiting kernels, and every later call
//     fails with that error (PyTorch's ProcessGroupNCCL watchdog does the
//     same). A collective queued behind long work on its stream counts that
//     work against its timeout, as there.
// All NCCL calls on the communicator, the watchdog's included, hold mu_.

// nccl.h and cuda_runtime.h come before any tierzero header, so checks.h
// defines TZ_CUDA_CHECK and TZ_NCCL_CHECK.
#include <cuda_runtime.h>
#include <nccl.h>

#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "internal.h"
#include "rendezvous.h"
#include "tierzero/common/checks.h"

#include <gloo/rendezvous/store.h>

namespace tz::comm_detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr auto kWatchdogPeriod = milliseconds(100);
constexpr const char* kUniqueIdKey = "nccl_unique_id";

struct NcclAbort {
  void operator()(ncclComm* comm) const { ncclCommAbort(comm); }
};
using UniqueNcclComm = std::unique_ptr<ncclComm, NcclAbort>;

struct CudaFree {
  void operator()(void* d_ptr) const { cudaFree(d_ptr); }
};
struct CudaStreamDestroy {
  void operator()(CUstream_st* stream) const { cudaStreamDestroy(stream); }
};
using UniqueCudaStream = std::unique_ptr<CUstream_st, CudaStreamDestroy>;

ncclDataType_t nccl_type(DType type) {
  switch (type) {
    case DType::kFp32: return ncclFloat32;
    case DType::kBf16: return ncclBfloat16;
    case DType::kFp16: return ncclFloat16;
    case DType::kFp64: return ncclFloat64;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUint8: return ncclUint8;
  }
  return ncclUint8;  // unreachable: the checks refuse other values
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;  // unreachable: the checks refuse other values
}

// NCCL uses the current device; set it as the CUDA Device does.
Status use_device(int ordinal) {
  int current = -1;
  TZ_CUDA_CHECK(cudaGetDevice(&current));
  if (current != ordinal) TZ_CUDA_CHECK(cudaSetDevice(ordinal));
  return ok_status();
}

// The GPU behind a tierzero CUDA Device: the device of one of its streams
// (Device does not expose its ordinal).
Expected<int> cuda_ordinal(Device& device) {
#if CUDART_VERSION >= 12080
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream());
  int ordinal = -1;
  TZ_CUDA_CHECK(cudaStreamGetDevice(static_cast<cudaStream_t>(stream->native_handle()), &ordinal));
  return ordinal;
#else
  // Older runtimes lack cudaStreamGetDevice; Device::name() starts "cuda:<ordinal> ".
  const std::string name = device.name();
  int ordinal = -1;
  if (name.starts_with("cuda:")) {
    auto [ptr, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), ordinal);
    if (ec == std::errc()) return ordinal;
  }
  return invalid_argument("cannot tell the CUDA ordinal of device \"{}\"", name);
#endif
}

Status async_failure(ncclComm_t comm, ncclResult_t state, std::string_view call) {
  return detail::nccl_error(state, std::string(call).c_str(), std::source_location::current())
      .with_context(fmt::format("nccl {}: {}", call, ncclGetLastError(comm)));
}

// Polls a non-blocking communicator until its last operation settles.
Status settle(ncclComm_t comm, Clock::time_point deadline, std::string_view call, milliseconds timeout) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    TZ_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return ok_status();
    if (state != ncclInProgress) return async_failure(comm, state, call);
    if (Clock::now() >= deadline) {
      return timeout_error("nccl {} did not finish within {} ms; the communicator was aborted", call,
                           timeout.count());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Rank 0 makes the id; the others read it from the rendezvous store.
Status share_unique_id(int rank, Rendezvous& rendezvous, ncclUniqueId& id) {
  try {
    if (rank == 0) {
      TZ_NCCL_CHECK(ncclGetUniqueId(&id));
      const auto* bytes = reinterpret_cast<const char*>(&id);
      rendezvous.store().set(kUniqueIdKey, std::vector<char>(bytes, bytes + sizeof(id)));
      return ok_status();
    }
    std::vector<char> bytes = rendezvous.store().get(kUniqueIdKey);
    if (bytes.size() != sizeof(id)) {
      return data_corruption("rendezvous through {}: ncclUniqueId has {} bytes, expected {}", rendezvous.describe(),
                             bytes.size(), sizeof(id));
    }
    std::memcpy(&id, bytes.data(), sizeof(id));
    return ok_status();
  } catch (const std::exception& e) {
    return rendezvous.failure_status(e.what(), io_error("rendezvous through {}: sharing the ncclUniqueId: {}",
                                                        rendezvous.describe(), e.what()));
  }
}

Expected<UniqueNcclComm> init_comm(const RankInfo& ranks, int ordinal, Rendezvous& rendezvous,
                                   milliseconds timeout) {
  ncclUniqueId id{};
  TZ_TRY(share_unique_id(ranks.rank, rendezvous, id));
  TZ_TRY(use_device(ordinal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [NCCL failures]
  ncclComm_t raw = nullptr;
  const ncclResult_t rc = ncclCommInitRankConfig(&raw, ranks.world_size, id, ranks.rank, &config);
  UniqueNcclComm comm(raw);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    return detail::nccl_error(rc, "ncclCommInitRankConfig", std::source_location::current())
        .with_context(fmt::format("rendezvous through {} (rank {} of {})", rendezvous.describe(), ranks.rank,
                                  ranks.world_size));
  }
  TZ_TRY_CTX(settle(comm.get(), rendezvous.deadline(), "ncclCommInitRankConfig", timeout),
             "rendezvous through {} (rank {} of {}): waiting for every rank to join", rendezvous.describe(),
             ranks.rank, ranks.world_size);
  return comm;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(UniqueNcclComm comm, int ordinal, const ResolvedCommOptions& options)
      : comm_(std::move(comm)),
        ordinal_(ordinal),
        rank_(options.ranks.rank),
        size_(options.ranks.world_size),
        timeout_(options.timeout),
        device_name_(options.device->name()) {}
  ~NcclCommunicator() override;

  Status start();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  CommBackend backend() const override { return CommBackend::kNccl; }
  std::string describe() const override {
    int version = 0;
    ncclGetVersion(&version);
    return fmt::format("nccl {} on {}, rank {} of {}", version, device_name_, rank_, size_);
  }

  Status all_gather(const void* send, void* recv, std::size_t count, DType type, Stream* stream) override {
    TZ_TRY(check_all_gather(send, recv, count, type, rank_, size_));
    return enqueue(describe_call("all_gather", count, type, rank_, size_), count, stream,
                   [&](ncclComm_t comm, cudaStream_t s) {
                     return ncclAllGather(send, recv, count, nccl_type(type), comm, s);
                   });
  }
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op,
                        Stream* stream) override {
    TZ_TRY(check_reduce_scatter(send, recv, count, type, op, rank_, size_));
    return enqueue(describe_call("reduce_scatter", count, type, rank_, size_), count, stream,
                   [&](ncclComm_t comm, cudaStream_t s) {
                     return ncclReduceScatter(send, recv, count, nccl_type(type), nccl_op(op), comm, s);
                   });
  }
  Status all_reduce(void* buf, std::size_t count, DType type, ReduceOp op, Stream* stream) override {
    TZ_TRY(check_all_reduce(buf, count, type, op, rank_, size_));
    return enqueue(describe_call("all_reduce", count, type, rank_, size_), count, stream,
                   [&](ncclComm_t comm, cudaStream_t s) {
                     return ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), comm, s);
                   });
  }
  Status broadcast(void* buf, std::size_t bytes, int root, Stream* stream) override {
    TZ_TRY(check_broadcast(buf, bytes, root, rank_, size_));
    return enqueue(fmt::format("broadcast of {} bytes from rank {} (rank {} of {})", bytes, root, rank_, size_),
                   bytes, stream, [&](ncclComm_t comm, cudaStream_t s) {
                     return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm, s);
                   });
  }
  Status barrier() override;

 private:
  using Enqueue = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;
  struct InFlight {
    cudaEvent_t event;
    Clock::time_point deadline;
    std::string call;
  };

  Status enqueue(const std::string& call, std::size_t count, Stream* stream, const Enqueue& fn);
  Status enqueue_locked(const std::string& call, cudaStream_t stream, const Enqueue& fn);
  Status watch_locked(const std::string& call, cudaStream_t stream);
  Status fail_locked(Status status);
  void watchdog(std::stop_token stop);
  Status check_in_flight_locked();

  std::mutex mu_;
  std::condition_variable_any wake_;
  UniqueNcclComm comm_;  // null once aborted
  int ordinal_;
  int rank_;
  int size_;
  milliseconds timeout_;
  std::string device_name_;
  Status failed_;                         // the first failure: Note [NCCL failures]
  std::deque<InFlight> in_flight_;        // oldest first
  std::vector<cudaEvent_t> spare_events_;
  UniqueCudaStream barrier_stream_;
  std::unique_ptr<void, CudaFree> d_barrier_;  // (1,) int32
  std::jthread watchdog_;                 // last: stops and joins before the rest goes
};

Status NcclCommunicator::start() {
  TZ_TRY(use_device(ordinal_));
  cudaStream_t stream = nullptr;
  TZ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  barrier_stream_.reset(stream);
  void* d_flag = nullptr;
  TZ_CUDA_CHECK(cudaMalloc(&d_flag, sizeof(std::int32_t)));
  d_barrier_.reset(d_flag);
  TZ_CUDA_CHECK(cudaMemset(d_flag, 0, sizeof(std::int32_t)));
  watchdog_ = std::jthread([this](std::stop_token stop) { watchdog(std::move(stop)); });
  return ok_status();
}

NcclCommunicator::~NcclCommunicator() {
  watchdog_.request_stop();
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard lock(mu_);
  (void)use_device(ordinal_).ok();
  if (comm_ && failed_.ok()) {
    // A clean goodbye flushes pending work; abort if it does not finish in time.
    const ncclResult_t rc = ncclCommFinalize(comm_.get());
    const bool flushed = (rc == ncclSuccess || rc == ncclInProgress) &&
                         settle(comm_.get(), Clock::now() + timeout_, "ncclCommFinalize", timeout_).ok();
    if (flushed && ncclCommDestroy(comm_.get()) == ncclSuccess) (void)comm_.release();
  }
  comm_.reset();  // aborts whatever is left
  for (const InFlight& f : in_flight_) cudaEventDestroy(f.event);
  for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
}

Status NcclCommunicator::enqueue(const std::string& call, std::size_t count, Stream* stream, const Enqueue& fn) {
  if (stream == nullptr) {
    return invalid_argument("nccl {}: a stream is required (NCCL enqueues the collective on it)", call);
  }
  std::lock_guard lock(mu_);
  if (!failed_.ok()) {
    return failed_precondition("nccl {}: this communicator was aborted after an earlier failure ({}); create a "
                               "new one", call, failed_.message());
  }
  if (count == 0) return ok_status();
  return enqueue_locked(call, static_cast<cudaStream_t>(stream->native_handle()), fn);
}

Status NcclCommunicator::enqueue_locked(const std::string& call, cudaStream_t stream, const Enqueue& fn) {
  TZ_TRY(use_device(ordinal_));
  const ncclResult_t rc = fn(comm_.get(), stream);
  if (rc == ncclInvalidArgument || rc == ncclInvalidUsage) {
    // Refused before anything was enqueued: the communicator is still sound.
    return detail::nccl_error(rc, call.c_str(), std::source_location::current())
        .with_context(fmt::format("nccl {}: {}", call, ncclGetLastError(comm_.get())));
  }
  if (rc != ncclSuccess && rc != ncclInProgress) return fail_locked(async_failure(comm_.get(), rc, call));
  if (Status s = settle(comm_.get(), Clock::now() + timeout_, call, timeout_); !s.ok()) {
    return fail_locked(std::move(s));
  }
  return watch_locked(call, stream);
}

// Records an event behind the collective for the watchdog to check.
Status NcclCommunicator::watch_locked(const std::string& call, cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  if (!spare_events_.empty()) {
    event = spare_events_.back();
    spare_events_.pop_back();
  } else {
    TZ_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  if (cudaError_t err = cudaEventRecord(event, stream); err != cudaSuccess) {
    spare_events_.push_back(event);
    TZ_CUDA_CHECK(err);
  }
  in_flight_.push_back({event, Clock::now() + timeout_, call});
  return ok_status();
}

Status NcclCommunicator::fail_locked(Status status) {
  TZ_LOG_ERROR("comm", "aborting NCCL communicator (rank {} of {}): {}", rank_, size_, status.message());
  failed_ = status;
  comm_.reset();  // ncclCommAbort: ends kernels still waiting on peers
  return status;
}

Status NcclCommunicator::check_in_flight_locked() {
  while (!in_flight_.empty()) {
    InFlight& oldest = in_flight_.front();
    const cudaError_t done = cudaEventQuery(oldest.event);
    if (done == cudaErrorNotReady) {
      if (Clock::now() < oldest.deadline) break;
      return timeout_error("nccl {} did not complete within {} ms of being enqueued (a peer died or stopped "
                           "issuing collectives?); the communicator was aborted", oldest.call, timeout_.count());
    }
    TZ_CUDA_CHECK(done);
    spare_events_.push_back(oldest.event);
    in_flight_.pop_front();
  }
  ncclResult_t state = ncclSuccess;
  TZ_NCCL_CHECK(ncclCommGetAsyncError(comm_.get(), &state));
  if (state != ncclSuccess && state != ncclInProgress) return async_failure(comm_.get(), state, "watchdog");
  return ok_status();
}

void NcclCommunicator::watchdog(std::stop_token stop) {
  (void)use_device(ordinal_).ok();
  std::unique_lock lock(mu_);
  while (!stop.stop_requested()) {
    wake_.wait_for(lock, stop, kWatchdogPeriod, [] { return false; });
    if (stop.stop_requested() || !comm_ || !failed_.ok()) continue;
    if (Status s = check_in_flight_locked(); !s.ok()) (void)fail_locked(std::move(s)).ok();
  }
}

// NCCL has no barrier: an all-reduce of one int that this thread waits for.
Status NcclCommunicator::barrier() {
  const std::string call = fmt::format("barrier (rank {} of {})", rank_, size_);
  {
    std::lock_guard lock(mu_);
    if (!failed_.ok()) {
      return failed_precondition("nccl {}: this communicator was aborted after an earlier failure ({})", call,
                                 failed_.message());
    }
    TZ_TRY(enqueue_locked(call, barrier_stream_.get(), [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllReduce(d_barrier_.get(), d_barrier_.get(), 1, ncclInt32, ncclSum, comm, s);
    }));
  }
  const Clock::time_point deadline = Clock::now() + timeout_;
  for (;;) {
    const cudaError_t done = cudaStreamQuery(barrier_stream_.get());
    if (done == cudaSuccess) break;
    if (done != cudaErrorNotReady) TZ_CUDA_CHECK(done);
    {
      std::lock_guard lock(mu_);
      if (!failed_.ok()) return failed_;  // the watchdog aborted it
      if (Clock::now() >= deadline) {
        return fail_locked(timeout_error("nccl {} did not complete within {} ms", call, timeout_.count()));
      }
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  return ok_status();
}

}  // namespace

Expected<std::unique_ptr<Communicator>> create_nccl_communicator(const ResolvedCommOptions& options) {
  TZ_TRY(load_nccl());  // Note [CUDA libraries load on first use]
  TZ_ASSIGN_OR_RETURN(int ordinal, cuda_ordinal(*options.device));
  TZ_ASSIGN_OR_RETURN(auto rendezvous, open_rendezvous(options));
  TZ_ASSIGN_OR_RETURN(UniqueNcclComm comm, init_comm(options.ranks, ordinal, *rendezvous, options.timeout));
  rendezvous->completed();  // the init finished on every rank, so every rank has read the id
  rendezvous.reset();
  auto communicator = std::make_unique<NcclCommunicator>(std::move(comm), ordinal, options);
  TZ_TRY_CTX(communicator->start(), "starting the NCCL communicator on cuda:{}", ordinal);
  TZ_LOG_DEBUG("comm", "{}", communicator->describe());
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace tz::comm_detail
