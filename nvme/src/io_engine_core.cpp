// IoEngineCore: how one completion settles a piece, and how the last piece of
// a request completes it. Shared by the io_uring and the thread rings, so both
// read results the same way.
#include <cerrno>

#include "io_engine_internal.h"

namespace tz::nvme::detail {

bool IoEngineCore::needs_hash(const Piece& piece) {
  return !piece.hashed && piece.request->op == IoOp::kWrite && piece.request->checksums != nullptr;
}

void IoEngineCore::hash_write(Piece& piece) {
  if (!needs_hash(piece)) return;
  piece.hashed = true;
  piece.request->checksums[piece.index] = checksum(piece.data, piece.length);
}

Fault IoEngineCore::consult_injector(const Piece& piece, std::size_t length) {
  const std::uint64_t sequence = pieces_.fetch_add(1, std::memory_order_relaxed);
  if (!options_.fault_injector) return {};
  return options_.fault_injector(PieceInfo{.sequence = sequence,
                                           .op = piece.request->op,
                                           .path = piece.file->path,
                                           .offset = piece.offset + piece.done,
                                           .length = length});
}

void IoEngineCore::fail(RequestState& request, Status status) {
  std::lock_guard<std::mutex> lock(request.mu);
  if (request.error.ok()) {
    if (!request.label.empty()) status = std::move(status).with_context(request.label);
    request.error = std::move(status);
  }
  request.failed.store(true, std::memory_order_release);
}

IoEngineCore::Next IoEngineCore::settle(Piece& piece, long res) {
  RequestState& r = *piece.request;
  const std::uint64_t at = piece.offset + piece.done;
  const std::size_t rest = piece.length - piece.done;
  if (res == -EAGAIN || res == -EINTR) {
    if (++piece.retries <= kMaxRetries && !skip(piece)) {
      retries_.fetch_add(1, std::memory_order_relaxed);
      return Next::kResubmit;
    }
  }
  if (res < 0) {
    const int err = static_cast<int>(-res);
    fail(r, errno_status(err, fmt::format("{} of {} bytes at offset {} of {}", io_op_name(r.op), rest, at,
                                          piece.file->path)));
    return Next::kFinished;
  }
  if (res == 0 && rest > 0) {
    if (r.op == IoOp::kWrite) {
      // Not end of file: a write extends the file. Trying again would most
      // likely loop, so the request fails here.
      fail(r, io_error("write of {} bytes at offset {} of {}: the device accepted no bytes ({} of the piece's {} "
                       "bytes transferred)",
                       rest, at, piece.file->path, piece.done, piece.length));
    } else {
      // A read at end of file: the file is shorter than the request says.
      fail(r, io_error("read of {} bytes at offset {} of {}: end of file ({} of the piece's {} bytes transferred)",
                       rest, at, piece.file->path, piece.done, piece.length));
    }
    return Next::kFinished;
  }
  if (static_cast<std::size_t>(res) > rest) {
    // The kernel never returns more than was asked; a result that says so is
    // not trusted with the rest of the piece.
    fail(r, io_error("{} of {} bytes at offset {} of {}: the kernel reported {} bytes transferred",
                     io_op_name(r.op), rest, at, piece.file->path, res));
    return Next::kFinished;
  }
  piece.done += static_cast<std::size_t>(res);
  (r.op == IoOp::kRead ? bytes_read_ : bytes_written_).fetch_add(static_cast<std::uint64_t>(res),
                                                                   std::memory_order_relaxed);
  if (piece.done < piece.length) {
    short_transfers_.fetch_add(1, std::memory_order_relaxed);
    return skip(piece) ? Next::kFinished : Next::kResubmit;
  }
  return Next::kComplete;
}

void IoEngineCore::check(Piece& piece) {
  RequestState& r = *piece.request;
  if (r.checksums == nullptr || skip(piece)) return;  // a failed request's checksums are not used
  if (r.op == IoOp::kWrite) {
    hash_write(piece);
    return;
  }
  const std::uint64_t got = checksum(piece.data, piece.length);
  if (got != r.checksums[piece.index]) {
    fail(r, data_corruption("checksum mismatch reading {} bytes at offset {} of {} (piece {}: stored {:016x}, "
                            "read {:016x}): the data on disk is not what was written",
                            piece.length, piece.offset, piece.file->path, piece.index, r.checksums[piece.index], got));
  }
}

void IoEngineCore::finish(Piece& piece) {
  RequestState* r = piece.request;
  if (r->pieces_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // The last piece: every other ring is done with this request.
  std::unique_ptr<RequestState> owned(r);
  for (OpenFile* f : r->files) f->active_requests.fetch_sub(1, std::memory_order_acq_rel);
  Status status;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    status = std::move(r->error);
  }
  if (!status.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
  busy_end(r->op);
  const IoResult result{.bytes = status.ok() ? r->total_bytes : 0};
  IoCallback callback = std::move(r->callback);
  owned.reset();
  callback(status, result);
}

EngineStats IoEngineCore::stats() const {
  return {.requests = requests_.load(),
          .pieces = pieces_.load(),
          .bytes_read = bytes_read_.load(),
          .bytes_written = bytes_written_.load(),
          .short_transfers = short_transfers_.load(),
          .retries = retries_.load(),
          .errors = errors_.load(),
          .fixed_buffer_pieces = fixed_buffer_pieces_.load(),
          .read_busy_ns = busy_[0].ns(),
          .write_busy_ns = busy_[1].ns(),
          .io_busy_ns = busy_[2].ns()};
}

}  // namespace tz::nvme::detail
