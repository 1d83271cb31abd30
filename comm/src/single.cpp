// The world_size 1 communicator: every collective over one rank is a copy (or
// nothing), so no network, rendezvous or library is involved.
#include <cstring>

#include "internal.h"

namespace tz::comm_detail {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  SingleRankCommunicator(CommBackend backend, Device* device) : backend_(backend), device_(device) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  CommBackend backend() const override { return backend_; }
  std::string describe() const override {
    return fmt::format("{} single rank (no network), {}, rank 0 of 1", comm_backend_name(backend_),
                       device_ ? device_->name() : std::string("host memory"));
  }

  Status all_gather(const void* send, void* recv, std::size_t count, DType type, Stream* stream) override {
    TZ_TRY(check_all_gather(send, recv, count, type, 0, 1));
    return copy("all_gather", recv, send, count, type, stream);
  }
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op,
                        Stream* stream) override {
    TZ_TRY(check_reduce_scatter(send, recv, count, type, op, 0, 1));
    return copy("reduce_scatter", recv, send, count, type, stream);
  }
  Status all_reduce(void* buf, std::size_t count, DType type, ReduceOp op, Stream*) override {
    return check_all_reduce(buf, count, type, op, 0, 1);  // the reduction of one buffer is itself
  }
  Status broadcast(void* buf, std::size_t bytes, int root, Stream*) override {
    return check_broadcast(buf, bytes, root, 0, 1);
  }
  Status barrier() override { return ok_status(); }

 private:
  // CUDA memory is copied in stream order, as NCCL would; host memory at once,
  // as Gloo would (Gloo ignores the stream).
  Status copy(std::string_view op, void* dst, const void* src, std::size_t count, DType type, Stream* stream) {
    const std::size_t bytes = count * dtype_bytes(type);
    if (bytes == 0 || dst == src) return ok_status();
    if (device_ != nullptr && device_->kind() == BackendKind::kCuda) {
      if (stream == nullptr) {
        return invalid_argument("{}: a CUDA device needs a stream to order the copy on",
                                describe_call(op, count, type, 0, 1));
      }
      TZ_TRY_CTX(device_->copy_async(dst, src, bytes, *stream), "{}", describe_call(op, count, type, 0, 1));
      return ok_status();
    }
    std::memcpy(dst, src, bytes);  // the checks refused overlap
    return ok_status();
  }

  CommBackend backend_;
  Device* device_;
};

}  // namespace

std::unique_ptr<Communicator> create_single_rank_communicator(const ResolvedCommOptions& options) {
  return std::make_unique<SingleRankCommunicator>(options.backend, options.device);
}

}  // namespace tz::comm_detail
