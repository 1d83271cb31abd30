#include "tierzero/comm/agreement.h"

#include <cstdint>

#include "tierzero/comm/host_collectives.h"
#include "tierzero/nvme.h"

namespace tz {

Status RankAgreement::barrier() { return run([&] { return comm_.barrier(); }); }

// Every rank says whether it succeeded; all learn whether all did.
Status RankAgreement::agree(const Status& mine, std::string_view what) {
  std::int64_t failed = mine.ok() ? 0 : 1;
  TZ_TRY(run([&] {
    return detail::all_reduce_host(comm_, device_, device_pool_, &failed, 1, DType::kInt64, ReduceOp::kSum);
  }));
  if (!mine.ok()) return mine;
  if (failed > 0) return io_error("{}: {} other rank(s) failed (see their errors)", what, failed);
  return ok_status();
}

Status RankAgreement::agree_on(const std::string& value, std::string_view what, std::string_view noun,
                               std::string_view advice) {
  // The largest and the smallest of the ranks' hashes (as max of h and of -h):
  // equal when all ranks agree. Shifted to 62 bits so -h cannot overflow.
  const auto h = static_cast<std::int64_t>(nvme::checksum(value.data(), value.size()) >> 2);
  std::int64_t extremes[2] = {h, -h};
  TZ_TRY(run([&] {
    return detail::all_reduce_host(comm_, device_, device_pool_, extremes, 2, DType::kInt64, ReduceOp::kMax);
  }));
  if (extremes[0] != -extremes[1]) {
    return invalid_argument("{}: the ranks name different {} (this rank: '{}'); every rank must {}", what, noun, value,
                            advice);
  }
  return ok_status();
}

Status RankAgreement::agree(const std::string& value, const Status& refusal, std::string_view what) {
  TZ_TRY(agree(refusal, what));
  return agree_on(value, what, "values", "do the same");
}

Status RankAgreement::broadcast(void* data, std::size_t bytes, int root) {
  TZ_TRY(agree_on(fmt::format("{} bytes from rank {}", bytes, root), "broadcast", "sizes or roots",
                  "pass the same size and root"));
  if (root < 0 || root >= comm_.size()) {
    return invalid_argument("broadcast: root rank {} is not one of the {} rank(s)", root, comm_.size());
  }
  return run([&] { return detail::broadcast_host(comm_, device_, device_pool_, data, bytes, root); });
}

}  // namespace tz
