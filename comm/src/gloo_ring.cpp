// Note [Ring reduce-scatter]
//
// Gloo 0.5 has no reduce-scatter in its current API (unbound buffers, a
// timeout per call, any reduction function). Its old
// ReduceScatterHalvingDoubling has no timeouts and takes a typed reduction,
// and an allreduce followed by keeping our shard moves every byte twice (an
// allreduce is a reduce-scatter plus an all-gather) and needs a copy of the
// const input. So the reduce-scatter is a ring built on Gloo's point-to-point
// sends and receives, which moves (size - 1) / size of the input per rank,
// the least any reduce-scatter can:
//
//   block b = send[b * count, (b + 1) * count) on every rank; rank r owns block r.
//   step s = 0 .. size-2: rank r sends its running reduction of block r-s-1
//   to rank r+1, receives block r-s-2's from rank r-1 and reduces its own
//   input for that block into it (indices mod size). After size-1 steps the
//   block that arrived last, r, holds every rank's contribution.
//
// Each block moves in segments of up to 1 MiB, all posted at once, so the
// reduction of one segment overlaps the arrival of the next. Running
// reductions live in two block-sized scratch buffers (one is received into
// while the other is sent), kept between calls so steady state allocates
// nothing. Sums of bf16/fp16 round once per step, as NCCL's ring does.
#include "gloo_ring.h"

#include <algorithm>
#include <string>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "tierzero/common/log.h"

namespace tz::comm_detail {

void close_on_failure(gloo::Context& context, const std::function<void()>& call) {
  try {
    call();
  } catch (...) {
    try {
      context.closeConnections();
    } catch (const std::exception& e) {  // the caller reports the first error
      TZ_LOG_DEBUG("comm", "closing gloo connections after a failure: {}", e.what());
    }
    throw;
  }
}

namespace {

constexpr std::uint8_t kRingSlotPrefix = 0x54;  // apart from Gloo's own collectives (0x01..0x08)
constexpr std::size_t kSegmentBytes = std::size_t{1} << 20;

}  // namespace

RingReduceScatter::RingReduceScatter(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout) {}

std::byte* RingReduceScatter::scratch(std::size_t bytes) {
  if (scratch_bytes_ < bytes) {
    scratch_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

void RingReduceScatter::run(const std::byte* send, std::byte* recv, std::size_t count, std::size_t element_bytes,
                            ReduceFn reduce) {
  const int n = context_->size;
  const int r = context_->rank;
  const std::size_t block = count * element_bytes;
  const auto at = [&](int b) { return static_cast<std::size_t>(((b % n) + n) % n) * block; };
  std::byte* buffers = scratch(n == 2 ? block : 2 * block);
  for (int s = 0; s + 1 < n; ++s) {
    Step step_buffers{
        .partial = s == 0 ? send + at(r - 1) : buffers + static_cast<std::size_t>((s - 1) % 2) * block,
        .incoming = buffers + static_cast<std::size_t>(s % 2) * block,
        .own = send + at(r - s - 2),
        .result = nullptr,
    };
    step_buffers.result = s + 2 == n ? recv : step_buffers.incoming;
    step(step_buffers, block, element_bytes, reduce);
  }
}

void RingReduceScatter::step(const Step& s, std::size_t block_bytes, std::size_t element_bytes, ReduceFn reduce) {
  const int n = context_->size;
  const int right = (context_->rank + 1) % n;
  const int left = (context_->rank + n - 1) % n;
  const std::uint64_t slot = gloo::Slot::build(kRingSlotPrefix, 0);
  const std::size_t segment = std::max(element_bytes, kSegmentBytes / element_bytes * element_bytes);

  // One unbound buffer per segment: Gloo allows one pending operation per buffer.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recvs;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends;
  // The event loop may still be failing the other segments' buffers when a
  // wait throws: Note [Buffers outlive the failure] in gloo.cpp.
  close_on_failure(*context_, [&] {
    for (std::size_t offset = 0; offset < block_bytes; offset += segment) {
      const std::size_t length = std::min(segment, block_bytes - offset);
      recvs.push_back(context_->createUnboundBuffer(s.incoming + offset, length));
      recvs.back()->recv(left, slot);
      // Gloo only reads a buffer it sends from.
      sends.push_back(context_->createUnboundBuffer(const_cast<std::byte*>(s.partial + offset), length));
      sends.back()->send(right, slot);
    }
    for (std::size_t i = 0; i < recvs.size(); ++i) {
      if (!recvs[i]->waitRecv(timeout_)) throw gloo::IoException("reduce_scatter: receive aborted");
      const std::size_t offset = i * segment;
      reduce(s.result + offset, s.own + offset, s.incoming + offset, recvs[i]->size / element_bytes);
    }
    for (auto& buffer : sends) {
      if (!buffer->waitSend(timeout_)) throw gloo::IoException("reduce_scatter: send aborted");
    }
  });
}

}  // namespace tz::comm_detail
