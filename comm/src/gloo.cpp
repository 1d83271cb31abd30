// The Gloo backend: collectives between processes over TCP, on host memory,
// run on the calling thread.
//
// Note [Gloo timeouts]
// Gloo bounds every wait inside a collective (a segment to arrive, a send to
// drain) by the timeout it is given, not the collective as a whole: a large
// all-gather on a slow link may take longer than the timeout while it keeps
// moving, but a peer that stops answering fails it within one timeout. A
// peer that dies closes its sockets and fails it at once (IoError).
//
// Note [Failing fast]
// After any failure the communicator closes its connections and refuses
// further calls (FailedPrecondition naming the first error), as an aborted
// NCCL communicator does: bytes of a half-finished collective must never be
// read as the next one's, and peers waiting on this rank see the connection
// close and fail now instead of after their timeout.
//
// Note [SIGPIPE]
// Gloo writes to its sockets with writev(), which raises SIGPIPE on a
// connection the peer has reset (a rank killed with data unread), and
// SIGPIPE's default action would kill this rank along with the dead one
// instead of returning an error. Gloo's handshake (data moves only once the
// receiver is ready, and a read error closes the pair first) makes that a
// narrow race, hard to provoke in a test, so it is prevented, not awaited. The process's signal
// disposition is the program's, not a library's, so SIGPIPE is blocked only
// in the threads that write: the calling thread for the length of each call,
// and Gloo's event-loop thread, which inherits the mask from the thread that
// creates the device. The write then fails with EPIPE, which Gloo reports;
// a SIGPIPE left pending on the calling thread is consumed on the way out.
//
// Note [Buffers outlive the failure]
// When a peer dies, Gloo's event-loop thread fails every operation pending on
// that pair, one UnboundBuffer at a time (Pair::signalException, under the
// pair's lock), and the first one it signals wakes the calling thread, which
// throws. Unwinding destroys the collective's buffers (the options object's,
// the ring's) while the loop thread may still be signalling them: a
// use-after-free (ThreadSanitizer reports the condition variable destroyed
// under the loop thread's broadcast, and the surviving rank then exits 66
// instead of reporting the error). So every Gloo call that can fail runs
// through close_on_failure(): on an exception it closes the connections
// *before* the buffers go. Pair::close() takes each pair's lock, so it waits
// for the loop thread to finish signalling that pair, and the closed pair is
// off the loop: nothing touches the buffers after that.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "gloo_ring.h"
#include "internal.h"
#include "phase_board.h"
#include "reduce.h"
#include "rendezvous.h"

namespace tz::comm_detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Blocks SIGPIPE in this thread for the scope: Note [SIGPIPE].
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &saved_);
    was_pending_ = pending();
  }
  ~ScopedSigpipeBlock() {
    if (!was_pending_ && pending()) {
      const timespec zero{};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  static bool pending() {
    sigset_t set;
    sigemptyset(&set);
    return sigpending(&set) == 0 && sigismember(&set, SIGPIPE) == 1;
  }
  sigset_t pipe_{};
  sigset_t saved_{};
  bool was_pending_ = false;
};

struct TcpEndpoint {
  gloo::transport::tcp::attr attr;
  std::string label;  // "lo 127.0.0.1", for describe()
};

// The local address the kernel would send from to reach `host` (a UDP
// connect() sends nothing; it only routes). IPv4 first: "localhost" often
// resolves to ::1 first, and containers often lack IPv6.
Expected<std::string> local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0) {
    return invalid_argument("MASTER_ADDR {} does not resolve: {}", host, gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, &::freeaddrinfo);
  std::vector<const addrinfo*> candidates;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) candidates.insert(candidates.begin(), a);
    else if (a->ai_family == AF_INET6) candidates.push_back(a);
  }
  int last_errno = EADDRNOTAVAIL;
  for (const addrinfo* a : candidates) {
    UniqueFd fd(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (!fd.valid() || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      last_errno = errno;
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr = local.ss_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, addr, text, sizeof(text)) != nullptr) return std::string(text);
    last_errno = errno;
  }
  return errno_status(last_errno, fmt::format("no route from this host to MASTER_ADDR {}", host));
}

// The interface holding `address` ("lo" for 127.0.0.1); "" when none does.
std::string interface_holding(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (const ifaddrs* it = list; it != nullptr && name.empty(); it = it->ifa_next) {
    if (it->ifa_addr == nullptr || (it->ifa_addr->sa_family != AF_INET && it->ifa_addr->sa_family != AF_INET6)) {
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr = it->ifa_addr->sa_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(it->ifa_addr)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(it->ifa_addr)->sin6_addr);
    if (::inet_ntop(it->ifa_addr->sa_family, addr, text, sizeof(text)) != nullptr && address == text) {
      name = it->ifa_name;
    }
  }
  ::freeifaddrs(list);
  return name;
}

bool is_ip_literal(const std::string& text) {
  in6_addr scratch{};
  return ::inet_pton(AF_INET, text.c_str(), &scratch) == 1 || ::inet_pton(AF_INET6, text.c_str(), &scratch) == 1;
}

// CommOptions::interface: an address, an interface name, or "" for the
// address that reaches master_addr.
Expected<TcpEndpoint> choose_endpoint(const std::string& interface, const RankInfo& ranks,
                                      RendezvousKind rendezvous) {
  TcpEndpoint endpoint;
  if (interface.empty() && rendezvous == RendezvousKind::kMpi && !ranks.master_addr_set) {
    // mpirun sets no MASTER_ADDR: this host's name, as Gloo's own default.
    endpoint.attr.hostname = host_name();
    endpoint.label = fmt::format("host name {}", endpoint.attr.hostname);
    return endpoint;
  }
  const std::string& master_addr = ranks.master_addr;
  if (!interface.empty() && !is_ip_literal(interface)) {
    if (::if_nametoindex(interface.c_str()) == 0) {
      return invalid_argument("network interface \"{}\" (CommOptions::interface or GLOO_SOCKET_IFNAME) does not "
                              "exist on {}", interface, host_name());
    }
    endpoint.attr.iface = interface;
    endpoint.label = interface;
    return endpoint;
  }
  std::string address = interface;
  if (address.empty()) {
    TZ_ASSIGN_OR_RETURN(address, local_address_toward(master_addr));
  }
  endpoint.attr.hostname = address;
  const std::string name = interface_holding(address);
  endpoint.label = name.empty() ? address : fmt::format("{} {}", name, address);
  return endpoint;
}

// "[10.0.0.1]" from a Gloo device's str() ("tcp, pci=, iface=eth0, speed=-1,
// addr=[10.0.0.1]"); `fallback` when it has no address.
std::string bound_address(const std::string& device, const std::string& fallback) {
  const std::size_t at = device.find("addr=");
  return at == std::string::npos ? fallback : device.substr(at + 5);
}

bool mentions_timeout(std::string_view what) {
  std::string lower(what);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return lower.find("timeout") != std::string::npos || lower.find("timed out") != std::string::npos;
}

// What the ranks were doing, for a timeout's message: Note [What the other
// ranks were doing].
std::string phases(const PhaseBoard* board, std::string_view board_error) {
  if (board == nullptr) {
    return board_error.empty() ? "" : fmt::format("; what the other ranks were doing is unknown ({})", board_error);
  }
  return fmt::format("; this rank was in its collective {}; {}", board->describe_mine(), board->describe_others());
}

// Gloo reports both a dead peer and a silent one as IoException; the text
// tells them apart.
Status gloo_failure(std::string_view call, std::string_view what, Clock::time_point start, milliseconds timeout,
                    std::string_view phases = "") {
  const auto elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  if (mentions_timeout(what)) {
    // The ranks agreed on their settings at creation (Note [Ranks agree on
    // their settings]), so a peer that does not answer is stuck, killed or
    // far slower, not in another collective by configuration.
    return timeout_error("gloo {} timed out after {} ms (timeout {} ms; tierzero-train --collective-timeout, "
                         "CommOptions::timeout): a peer rank stopped answering (stuck, killed, or slower by more "
                         "than the timeout): {}{}",
                         call, elapsed, timeout.count(), what, phases);
  }
  return io_error("gloo {} failed after {} ms: {}", call, elapsed, what);
}

// Runs `fn` with a pointer type whose size is the element size, which is how
// Gloo's typed options learn the element size.
template <typename F>
void with_element_type(std::size_t element_bytes, F&& fn) {
  switch (element_bytes) {
    case 1: fn(std::uint8_t{}); break;
    case 2: fn(std::uint16_t{}); break;
    case 4: fn(std::uint32_t{}); break;
    default: fn(std::uint64_t{}); break;
  }
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::string label, milliseconds timeout,
                   std::unique_ptr<PhaseBoard> board, std::string board_error)
      : context_(std::move(context)),
        label_(std::move(label)),
        timeout_(timeout),
        ring_(context_, timeout),
        board_(std::move(board)),
        board_error_(std::move(board_error)) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  CommBackend backend() const override { return CommBackend::kGloo; }
  std::string describe() const override {
    return fmt::format("gloo over tcp ({}), rank {} of {}", label_, rank(), size());
  }

  Status all_gather(const void* send, void* recv, std::size_t count, DType type, Stream*) override {
    TZ_TRY(check_all_gather(send, recv, count, type, rank(), size()));
    if (count == 0) return ok_status();
    const std::size_t shard_bytes = count * dtype_bytes(type);
    auto* out = static_cast<std::uint8_t*>(recv);
    auto* in = static_cast<std::uint8_t*>(const_cast<void*>(send));  // Gloo only reads it
    return run(describe_call("all_gather", count, type, rank(), size()), [&] {
      gloo::AllgatherOptions opts(context_);
      if (in != out + static_cast<std::size_t>(rank()) * shard_bytes) opts.setInput(in, shard_bytes);
      opts.setOutput(out, shard_bytes * static_cast<std::size_t>(size()));
      opts.setTimeout(timeout_);
      close_on_failure(*context_, [&] { gloo::allgather(opts); });
    });
  }

  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op,
                        Stream*) override {
    TZ_TRY(check_reduce_scatter(send, recv, count, type, op, rank(), size()));
    if (count == 0) return ok_status();
    return run(describe_call("reduce_scatter", count, type, rank(), size()), [&] {
      ring_.run(static_cast<const std::byte*>(send), static_cast<std::byte*>(recv), count, dtype_bytes(type),
                reduce_function(type, op));
    });
  }

  Status all_reduce(void* buf, std::size_t count, DType type, ReduceOp op, Stream*) override {
    TZ_TRY(check_all_reduce(buf, count, type, op, rank(), size()));
    if (count == 0) return ok_status();
    return run(describe_call("all_reduce", count, type, rank(), size()), [&] {
      gloo::AllreduceOptions opts(context_);
      with_element_type(dtype_bytes(type), [&](auto element) {
        opts.setOutput(static_cast<decltype(element)*>(buf), count);
      });
      opts.setReduceFunction(reduce_function(type, op));
      opts.setTimeout(timeout_);
      close_on_failure(*context_, [&] { gloo::allreduce(opts); });
    });
  }

  Status broadcast(void* buf, std::size_t bytes, int root, Stream*) override {
    TZ_TRY(check_broadcast(buf, bytes, root, rank(), size()));
    if (bytes == 0) return ok_status();
    return run(fmt::format("broadcast of {} bytes from rank {} (rank {} of {})", bytes, root, rank(), size()), [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<std::uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      close_on_failure(*context_, [&] { gloo::broadcast(opts); });
    });
  }

  void note_step(std::int64_t step) override {
    if (board_) board_->set_step(step);
  }
  void note_activity(std::string_view activity) override {
    if (board_) board_->set_activity(activity);
  }

  Status barrier() override {
    return run(fmt::format("barrier (rank {} of {})", rank(), size()), [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(timeout_);
      close_on_failure(*context_, [&] { gloo::barrier(opts); });
    });
  }

 private:
  // One collective at a time; Gloo's exceptions stop here. Notes [Failing
  // fast] and [SIGPIPE].
  Status run(const std::string& call, const std::function<void()>& body) {
    std::lock_guard lock(mu_);
    if (!failed_.ok()) {
      return failed_precondition("gloo {}: this communicator failed earlier and is closed ({}); create a new one",
                                 call, failed_.message());
    }
    ScopedSigpipeBlock sigpipe;
    const Clock::time_point start = Clock::now();
    if (board_) board_->enter(call);
    try {
      body();
      if (board_) board_->leave();
      return ok_status();
    } catch (const std::bad_alloc&) {
      failed_ = out_of_memory("gloo {}: out of host memory for its buffers", call);
    } catch (const std::exception& e) {  // gloo::IoException, gloo::EnforceNotMet, ...
      failed_ = gloo_failure(call, e.what(), start, timeout_, mentions_timeout(e.what()) ? phases(board_.get(), board_error_) : "");
    }
    close_connections();
    return failed_;
  }

  void close_connections() noexcept {
    try {
      context_->closeConnections();
    } catch (const std::exception& e) {
      TZ_LOG_DEBUG("comm", "closing gloo connections after a failure: {}", e.what());
    }
  }

  std::mutex mu_;
  std::shared_ptr<gloo::Context> context_;
  std::string label_;
  milliseconds timeout_;
  RingReduceScatter ring_;
  std::unique_ptr<PhaseBoard> board_;  // null when it could not be opened (board_error_ says why)
  std::string board_error_;
  Status failed_;  // the first failure; see Note [Failing fast]
};

}  // namespace

Expected<std::unique_ptr<Communicator>> create_gloo_communicator(const ResolvedCommOptions& options) {
  TZ_ASSIGN_OR_RETURN(TcpEndpoint endpoint, choose_endpoint(options.interface, options.ranks, options.rendezvous));
  TZ_ASSIGN_OR_RETURN(auto rendezvous, open_rendezvous(options));
  // Posting what this rank does only serves messages: a board that cannot
  // be opened (a read-only or lockless directory) is named in them instead.
  // Ranks that meet through a store or MPI share no directory to post in.
  std::string board_error;
  Expected<std::unique_ptr<PhaseBoard>> board = std::unique_ptr<PhaseBoard>();
  if (const auto shared = rendezvous->shared_dir_and_run()) {
    board = PhaseBoard::open(shared->first, fmt::format("{}-{}.{}", file_name_safe(options.ranks.master_addr),
                                                        options.ranks.master_port, shared->second),
                             options.ranks.rank, options.ranks.world_size);
    if (!board.ok()) {
      board_error = board.status().message();
      TZ_LOG_WARN("comm", "rank {}: posting this rank's collectives for the others' timeout messages: {}",
                  options.ranks.rank, board_error);
    }
  } else {
    board_error = fmt::format("the ranks met through {}, with no shared directory to post in", rendezvous->describe());
  }
  ScopedSigpipeBlock sigpipe;  // the device's event-loop thread inherits this: Note [SIGPIPE]
  const Clock::time_point start = Clock::now();
  try {
    auto device = gloo::transport::tcp::CreateDevice(endpoint.attr);
    rendezvous->publish_host(bound_address(device->str(), endpoint.label));
    auto context = std::make_shared<gloo::rendezvous::Context>(options.ranks.rank, options.ranks.world_size);
    // Gloo waits up to 5x the context timeout for each pair to connect; a
    // fifth keeps the whole rendezvous near one CommOptions::timeout.
    context->setTimeout(std::max(options.timeout / 5, milliseconds(1)));
    context->connectFullMesh(rendezvous->store(), device);
    context->setTimeout(options.timeout);
    // Every rank has read every key once all pass this barrier: Note [Rendezvous runs], step 4.
    gloo::BarrierOptions barrier(context);
    barrier.setTimeout(options.timeout);
    close_on_failure(*context, [&] { gloo::barrier(barrier); });
    rendezvous->completed();
    TZ_LOG_DEBUG("comm", "gloo rank {} of {} connected over {} ({})", options.ranks.rank,
                 options.ranks.world_size, endpoint.label, rendezvous->describe());
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(std::move(context), endpoint.label, options.timeout,
                                           board.ok() ? std::move(*board) : nullptr, std::move(board_error)));
  } catch (const std::exception& e) {
    const std::string call = fmt::format("rendezvous through {} (rank {} of {} on {}, over {})",
                                         rendezvous->describe(), options.ranks.rank, options.ranks.world_size,
                                         host_name(), endpoint.label);
    return rendezvous->failure_status(e.what(), gloo_failure(call, e.what(), start, options.timeout));
  }
}

}  // namespace tz::comm_detail
