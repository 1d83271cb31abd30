// One io_uring ring and the thread that submits to it and reaps it.
//
// Note [Waking the ring thread]
// The thread sleeps in io_uring_wait_cqe while pieces are in flight. New work
// must wake it even then (a ring below its queue depth should take it at once,
// not after the next completion), so the ring always has one read of an
// eventfd outstanding; enqueue() writes the eventfd, the read completes, and
// the thread takes the new pieces and re-arms the read. The read is not
// counted in the queue depth.
//
// Each turn of the loop: take new pieces, queue and submit up to the depth,
// hash the writes just submitted, wait, settle what completed, refill and
// submit the freed slots, and only then verify the reads that completed
// (Note [Checksums off the I/O path] in io_engine_internal.h).
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <thread>

#include "io_engine_internal.h"

namespace tz::nvme::detail {
namespace {

constexpr std::uint64_t kWakeTag = 0;  // user_data of the eventfd read; pieces use their address
constexpr unsigned kSqpollIdleMs = 50;

class UringRing final : public Ring {
 public:
  UringRing(IoEngineCore& core, int id) : core_(core), id_(id), depth_(core.options().queue_depth) {}
  ~UringRing() override;

  Status init(bool& fixed_files);
  void enqueue(std::vector<Piece*> pieces) override;
  void set_file(std::uint32_t index, int fd) override;
  int set_buffer(int index, void* data, std::size_t bytes) override;

 private:
  void run();
  void arm_wake();
  // Takes pieces from `pending` into SQEs up to the queue depth, submits
  // them, then hashes the writes among them.
  void fill_and_submit(std::deque<Piece*>& pending);
  void fill(std::deque<Piece*>& pending);
  void submit_ready();
  // Settles one completion: resubmissions go to the front of `pending`,
  // complete pieces to checking_.
  void complete(Piece* piece, long res, std::deque<Piece*>& pending);
  // check() and finish() for every piece in checking_.
  void check_completed();
  void wake();

  IoEngineCore& core_;
  const int id_;
  const int depth_;
  io_uring ring_{};
  bool ring_ready_ = false;
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  int buffers_errno_ = 0;       // why the registered buffer table was refused
  UniqueFd wake_fd_;
  std::uint64_t wake_buf_ = 0;  // the eventfd read's target; only the kernel writes it
  int inflight_ = 0;            // pieces, not counting the wake read
  bool rearm_ = false;
  std::vector<Piece*> to_hash_;   // writes queued by fill(), hashed once submitted
  std::vector<Piece*> checking_;  // settled complete, awaiting check() and finish()

  std::mutex mu_;
  std::vector<Piece*> incoming_;  // guarded by mu_
  bool stop_ = false;             // guarded by mu_
  std::thread thread_;
};

Status UringRing::init(bool& fixed_files) {
  io_uring_params params{};
  params.flags = IORING_SETUP_CLAMP;
  if (core_.options().sqpoll) {
    params.flags |= IORING_SETUP_SQPOLL;
    params.sq_thread_idle = kSqpollIdleMs;
  }
  const unsigned entries = static_cast<unsigned>(depth_) + 1;  // + the wake read
  int rc = io_uring_queue_init_params(entries, &ring_, &params);
  if (rc < 0 && core_.options().sqpoll) {
    TZ_LOG_ONCE_WARN("nvme", "io_uring SQPOLL refused ({}); rings run without it", std::strerror(-rc));
    params = io_uring_params{};
    params.flags = IORING_SETUP_CLAMP;
    rc = io_uring_queue_init_params(entries, &ring_, &params);
  }
  if (rc < 0) return errno_status(-rc, fmt::format("io_uring_queue_init({} entries)", entries));
  ring_ready_ = true;
  if (fixed_files) {
    const int frc = io_uring_register_files_sparse(&ring_, kMaxFiles);
    if (frc < 0) {
      TZ_LOG_DEBUG("nvme", "ring {}: no registered file table ({}); plain file descriptors", id_, std::strerror(-frc));
      fixed_files = false;
    }
  }
  fixed_files_ = fixed_files;
  if (core_.options().fixed_buffers) {
    const int brc = io_uring_register_buffers_sparse(&ring_, kMaxFixedBuffers);
    fixed_buffers_ = brc >= 0;
    buffers_errno_ = brc < 0 ? -brc : 0;
    if (brc < 0) TZ_LOG_DEBUG("nvme", "ring {}: no registered buffer table ({})", id_, std::strerror(-brc));
  }
  TZ_SYSCALL(efd, ::eventfd(0, EFD_CLOEXEC));
  wake_fd_ = UniqueFd(efd);
  arm_wake();
  submit_ready();
  thread_ = std::thread([this] { run(); });
  return ok_status();
}

UringRing::~UringRing() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake();
    thread_.join();
  }
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

void UringRing::wake() {
  const std::uint64_t one = 1;
  // A full counter (never, at 2^64 - 2) or EINTR would only delay the wake-up
  // to the next completion; there is nothing to report.
  while (::write(wake_fd_.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void UringRing::enqueue(std::vector<Piece*> pieces) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (incoming_.empty()) {
      incoming_ = std::move(pieces);
    } else {
      incoming_.insert(incoming_.end(), pieces.begin(), pieces.end());
    }
  }
  wake();
}

void UringRing::set_file(std::uint32_t index, int fd) {
  if (!fixed_files_) return;
  const int rc = io_uring_register_files_update(&ring_, index, &fd, 1);
  if (rc < 0) TZ_LOG_WARN("nvme", "ring {}: updating registered file {}: {}", id_, index, std::strerror(-rc));
}

int UringRing::set_buffer(int index, void* data, std::size_t bytes) {
  if (!fixed_buffers_) return data == nullptr ? 0 : buffers_errno_;
  iovec iov{data, bytes};
  __u64 tag = 0;
  const int rc = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, &tag, 1);
  if (rc < 0) {
    TZ_LOG_DEBUG("nvme", "ring {}: registering buffer slot {} ({} bytes): {}", id_, index, bytes, std::strerror(-rc));
    return -rc;
  }
  return 0;
}

void UringRing::arm_wake() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  // The ring has depth + 1 entries and at most depth pieces are queued.
  io_uring_prep_read(sqe, wake_fd_.get(), &wake_buf_, sizeof(wake_buf_), 0);
  io_uring_sqe_set_data64(sqe, kWakeTag);
}

void UringRing::submit_ready() {
  while (io_uring_sq_ready(&ring_) > 0) {
    const int rc = io_uring_submit(&ring_);
    if (rc >= 0 || rc == -EINTR) continue;
    if (rc == -EAGAIN || rc == -EBUSY) return;  // the kernel is short of resources: reap, then retry
    TZ_LOG_ERROR("nvme", "ring {}: io_uring_submit: {}; retrying", id_, std::strerror(-rc));
    return;
  }
}

void UringRing::fill_and_submit(std::deque<Piece*>& pending) {
  fill(pending);
  submit_ready();
  // Before this thread next reaps, so before any of these pieces can finish.
  for (Piece* p : to_hash_) core_.hash_write(*p);
  to_hash_.clear();
}

void UringRing::fill(std::deque<Piece*>& pending) {
  while (inflight_ < depth_ && !pending.empty()) {
    Piece* p = pending.front();
    pending.pop_front();
    if (IoEngineCore::skip(*p)) {
      core_.finish(*p);
      continue;
    }
    std::size_t length = p->length - p->done;
    const Fault fault = core_.consult_injector(*p, length);
    if (fault.error > 0 || fault.no_bytes) {
      complete(p, fault.no_bytes ? 0 : -fault.error, pending);
      continue;
    }
    if (fault.short_bytes > 0 && fault.short_bytes < length) length = fault.short_bytes;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    char* data = p->data + p->done;
    const std::uint64_t offset = p->offset + p->done;
    const int fd = p->file->fixed ? static_cast<int>(p->file->index) : p->file->fd.get();
    const auto len = static_cast<unsigned>(length);
    const bool read = p->request->op == IoOp::kRead;
    if (p->buffer_index >= 0) {
      if (read) {
        io_uring_prep_read_fixed(sqe, fd, data, len, offset, p->buffer_index);
      } else {
        io_uring_prep_write_fixed(sqe, fd, data, len, offset, p->buffer_index);
      }
      core_.count_fixed_buffer();
    } else if (read) {
      io_uring_prep_read(sqe, fd, data, len, offset);
    } else {
      io_uring_prep_write(sqe, fd, data, len, offset);
    }
    if (p->file->fixed) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, p);
    ++inflight_;
    // Only pieces in an SQE: one completed in this loop (an injected fault)
    // may already be finished and freed.
    if (IoEngineCore::needs_hash(*p)) to_hash_.push_back(p);
    if (core_.options().single_submit) submit_ready();
  }
}

void UringRing::complete(Piece* piece, long res, std::deque<Piece*>& pending) {
  switch (core_.settle(*piece, res)) {
    case IoEngineCore::Next::kResubmit:
      pending.push_front(piece);  // the rest of this piece goes before newer work
      break;
    case IoEngineCore::Next::kComplete:
      checking_.push_back(piece);
      break;
    case IoEngineCore::Next::kFinished:
      core_.finish(*piece);
      break;
  }
}

void UringRing::check_completed() {
  for (Piece* p : checking_) {
    core_.check(*p);
    core_.finish(*p);
  }
  checking_.clear();
}

void UringRing::run() {
  std::deque<Piece*> pending;
  std::vector<Piece*> taken;
  for (;;) {
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      taken.swap(incoming_);
      stopping = stop_;
    }
    pending.insert(pending.end(), taken.begin(), taken.end());
    taken.clear();
    if (rearm_) {
      arm_wake();
      rearm_ = false;
    }
    fill_and_submit(pending);
    if (stopping && inflight_ == 0 && pending.empty()) return;

    io_uring_cqe* cqe = nullptr;
    int rc = 0;
    if (io_uring_sq_ready(&ring_) > 0) {
      // Submission was refused for now: poll for completions instead of sleeping.
      __kernel_timespec ts{.tv_sec = 0, .tv_nsec = 1'000'000};
      rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    } else {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    }
    if (rc < 0 && rc != -EINTR && rc != -ETIME && rc != -EAGAIN) {
      TZ_LOG_ERROR("nvme", "ring {}: waiting for completions: {}", id_, std::strerror(-rc));
    }
    unsigned head = 0, seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        rearm_ = true;  // a failed wake read (it cannot fail on an eventfd) is re-armed the same way
        continue;
      }
      --inflight_;
      complete(reinterpret_cast<Piece*>(tag), cqe->res, pending);
    }
    io_uring_cq_advance(&ring_, seen);
    // The freed slots go back to the device before the reads are verified.
    fill_and_submit(pending);
    check_completed();
  }
}

}  // namespace

Expected<std::unique_ptr<Ring>> make_uring_ring(IoEngineCore& core, int id, bool& fixed_files) {
  auto ring = std::make_unique<UringRing>(core, id);
  TZ_TRY(ring->init(fixed_files));
  return std::unique_ptr<Ring>(std::move(ring));
}

}  // namespace tz::nvme::detail
