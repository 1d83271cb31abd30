#include "tierzero/comm/agreement.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "tierzero/comm/host_collectives.h"
#include "tierzero/nvme.h"

namespace tz {

Status RankAgreement::barrier() { return run("a barrier", [&] { return comm_.barrier(); }); }

// Every rank says whether it succeeded; all learn whether all did.
Status RankAgreement::agree(const Status& mine, std::string_view what) {
  std::int64_t failed = mine.ok() ? 0 : 1;
  TZ_TRY(run(what, [&] {
    return detail::all_reduce_host(comm_, device_, device_pool_, &failed, 1, DType::kInt64, ReduceOp::kSum);
  }));
  if (!mine.ok()) return mine;
  if (failed > 0) return io_error("{}: {} other rank(s) failed (see their errors)", what, failed);
  return ok_status();
}

// The largest and the smallest of the ranks' hashes (as max of h and of -h):
// equal when all ranks agree. Shifted to 62 bits so -h cannot overflow.
Expected<bool> RankAgreement::same_everywhere(const std::string& value, std::string_view what) {
  const auto h = static_cast<std::int64_t>(nvme::checksum(value.data(), value.size()) >> 2);
  std::int64_t extremes[2] = {h, -h};
  TZ_TRY(run(what, [&] {
    return detail::all_reduce_host(comm_, device_, device_pool_, extremes, 2, DType::kInt64, ReduceOp::kMax);
  }));
  return extremes[0] == -extremes[1];
}

Status RankAgreement::agree_on(const std::string& value, std::string_view what, std::string_view noun,
                               std::string_view advice) {
  TZ_ASSIGN_OR_RETURN(const bool same, same_everywhere(value, what));
  if (!same) {
    return invalid_argument("{}: the ranks name different {} (this rank: '{}'); every rank must {}", what, noun, value,
                            advice);
  }
  return ok_status();
}

Status RankAgreement::agree(const std::string& value, const Status& refusal, std::string_view what) {
  TZ_TRY(agree(refusal, what));
  return agree_on(value, what, "values", "do the same");
}

namespace {

std::string setting_line(const RankAgreement::Settings& settings, std::size_t i) {
  return i < settings.size() ? settings[i].first + " = " + settings[i].second : "(no more settings)";
}

}  // namespace

// Note [Agreeing on settings]
// One hash decides the common case (one all-reduce). When the ranks differ,
// rank 0's settings are broadcast, every rank finds its first difference
// from them, and an all-reduce of (index, rank) finds the first setting that
// differs anywhere and the lowest rank that has it; that rank broadcasts its
// line, so every rank's error names both values.
Status RankAgreement::agree_on_settings(const Settings& settings, std::string_view what, std::string_view advice) {
  std::string text;
  for (std::size_t i = 0; i < settings.size(); ++i) text += setting_line(settings, i) + "\n";
  TZ_ASSIGN_OR_RETURN(const bool same, same_everywhere(text, what));
  if (same) return ok_status();
  // Rank `root`'s string into every rank's `s`, its size first.
  auto share = [&](std::string& s, int root) -> Status {
    std::int64_t n = static_cast<std::int64_t>(s.size());
    TZ_TRY(run(what, [&] { return detail::broadcast_host(comm_, device_, device_pool_, &n, sizeof n, root); }));
    s.resize(static_cast<std::size_t>(n));
    if (n == 0) return ok_status();
    return run(what, [&] { return detail::broadcast_host(comm_, device_, device_pool_, s.data(), s.size(), root); });
  };
  std::string theirs = text;
  TZ_TRY(share(theirs, 0));
  std::vector<std::string> rank0;
  for (std::size_t at = 0, nl; (nl = theirs.find('\n', at)) != std::string::npos; at = nl + 1) {
    rank0.push_back(theirs.substr(at, nl - at));
  }
  std::size_t first = 0;
  while (first < std::max(rank0.size(), settings.size()) &&
         (first < rank0.size() ? rank0[first] : "(no more settings)") == setting_line(settings, first)) {
    ++first;
  }
  constexpr std::int64_t kRankBits = 24;
  const bool differs = first < std::max(rank0.size(), settings.size());
  std::int64_t key = differs ? (static_cast<std::int64_t>(first) << kRankBits) | comm_.rank()
                             : std::numeric_limits<std::int64_t>::max();
  TZ_TRY(run(what, [&] {
    return detail::all_reduce_host(comm_, device_, device_pool_, &key, 1, DType::kInt64, ReduceOp::kMin);
  }));
  if (key == std::numeric_limits<std::int64_t>::max()) return ok_status();  // the hashes collided, the lines agree
  const auto index = static_cast<std::size_t>(key >> kRankBits);
  const int who = static_cast<int>(key & ((std::int64_t{1} << kRankBits) - 1));
  std::string line = setting_line(settings, index);
  TZ_TRY(share(line, who));
  const std::string zero = index < rank0.size() ? rank0[index] : "(no more settings)";
  const std::string& named = line.find(" = ") != std::string::npos ? line : zero;  // whichever has the setting
  return invalid_argument("{}: the ranks' settings differ, first at {}: rank 0 has '{}', rank {} has '{}'; {}", what,
                          named.substr(0, named.find(" = ")), zero, who, line, advice);
}

Status RankAgreement::broadcast(void* data, std::size_t bytes, int root) {
  TZ_TRY(agree_on(fmt::format("{} bytes from rank {}", bytes, root), "broadcast", "sizes or roots",
                  "pass the same size and root"));
  if (root < 0 || root >= comm_.size()) {
    return invalid_argument("broadcast: root rank {} is not one of the {} rank(s)", root, comm_.size());
  }
  return run("a broadcast", [&] { return detail::broadcast_host(comm_, device_, device_pool_, data, bytes, root); });
}

}  // namespace tz
