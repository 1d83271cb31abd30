// Note [Store rendezvous]
//
// Ranks on different machines share no directory, but a launcher such as
// torchrun serves a key-value store on the network (c10d's TCPStore at
// MASTER_ADDR:MASTER_PORT). Handed one (CommOptions::store), the ranks meet
// through it exactly as they do through the file store, with two changes:
//
//   1. A store outlives one communicator (torch's default store lives as
//      long as the process group, torchrun's as long as the job) and may
//      hold another communicator's keys. Each communicator therefore takes
//      a fresh namespace: every rank adds 1 to its own counter
//      "tierzero/communicators/<rank>", and since ranks create their
//      communicators in the same order, the n-th communicator is n on every
//      rank; its keys live under "tierzero/communicator<n>/".
//   2. Every wait goes to the store's get() with what is left of
//      CommOptions::timeout, so the whole rendezvous ends within one
//      timeout, and a key that did not come names the rank that did not
//      arrive (Gloo's keys are the ranks' numbers).
//
// After the barrier that ends creation, each rank erases the keys it wrote,
// so a long-lived store does not fill with addresses nobody will read. A rank
// that fails leaves them: the others' errors read its host there.
#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include <map>

#include "internal.h"
#include "rendezvous.h"

namespace tz::comm_detail {
namespace {

using Clock = Rendezvous::Clock;
using std::chrono::milliseconds;

// Gloo's Store interface over a RendezvousStore, every wait ending at one deadline.
class GlooOverStore final : public gloo::rendezvous::Store {
 public:
  GlooOverStore(RendezvousStore& store, std::string prefix, Clock::time_point deadline)
      : store_(store), prefix_(std::move(prefix)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    TZ_LOG_TRACE("comm", "{}: set {} ({} bytes)", store_.describe(), key, data.size());
    if (Status st = store_.set(prefix_ + key, data); !st.ok()) {
      throw gloo::IoException(fmt::format("{}: setting {}: {}", store_.describe(), key, st.message()));
    }
    written_.push_back(key);
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    return seen_.at(key);
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const milliseconds& /*gloo's*/) override {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (seen_.contains(keys[i])) continue;
      TZ_LOG_TRACE("comm", "{}: wait for {}", store_.describe(), keys[i]);
      const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
      Expected<std::vector<char>> value = store_.get(prefix_ + keys[i], std::max(left, milliseconds(1)));
      if (value.ok()) {
        seen_[keys[i]] = std::move(*value);
        continue;
      }
      if (value.status().code() == ErrorCode::kTimeout) {
        timed_out_keys_.assign(keys.begin() + static_cast<std::ptrdiff_t>(i), keys.end());
        throw gloo::IoException(fmt::format("rendezvous deadline passed waiting for key(s) {}: {}",
                                            fmt::join(timed_out_keys_, ", "), value.status().message()));
      }
      throw gloo::IoException(fmt::format("{}: reading {}: {}", store_.describe(), keys[i], value.status().message()));
    }
  }

  // The value at `key` if it is there now.
  std::optional<std::string> peek(const std::string& key) {
    if (auto it = seen_.find(key); it != seen_.end()) return std::string(it->second.begin(), it->second.end());
    Expected<std::vector<char>> value = store_.get(prefix_ + key, milliseconds(1));
    if (!value.ok()) return std::nullopt;
    return std::string(value->begin(), value->end());
  }

  void erase_written() {
    for (const std::string& key : written_) {
      if (Status st = store_.erase(prefix_ + key); !st.ok()) {
        TZ_LOG_DEBUG("comm", "{}: erasing {}: {}", store_.describe(), key, st.message());
      }
    }
    written_.clear();
  }

  const std::vector<std::string>& timed_out_keys() const { return timed_out_keys_; }

 private:
  RendezvousStore& store_;
  std::string prefix_;
  Clock::time_point deadline_;
  std::map<std::string, std::vector<char>> seen_;
  std::vector<std::string> written_;
  std::vector<std::string> timed_out_keys_;
};

class StoreRendezvous final : public Rendezvous {
 public:
  StoreRendezvous(const RankInfo& ranks, std::shared_ptr<RendezvousStore> store, std::int64_t number,
                  milliseconds timeout)
      : Rendezvous(ranks, timeout),
        store_(std::move(store)),
        number_(number),
        gloo_(*store_, fmt::format("tierzero/communicator{}/", number), deadline_) {}
  ~StoreRendezvous() override {
    if (completed_) gloo_.erase_written();
  }

  gloo::rendezvous::Store& store() override { return gloo_; }
  std::string describe() const override { return fmt::format("{} (communicator {})", store_->describe(), number_); }
  void completed() override { completed_ = true; }
  void publish_host(const std::string& address) override {
    try {
      const std::string text = fmt::format("{} ({})", host_name(), address);
      gloo_.set(host_key(ranks_.rank), std::vector<char>(text.begin(), text.end()));
    } catch (const std::exception& e) {
      TZ_LOG_DEBUG("comm", "{}: could not publish this rank's host: {}", describe(), e.what());
    }
  }

 protected:
  std::optional<std::string> peek(const std::string& key) override { return gloo_.peek(key); }
  std::vector<std::string> timed_out_keys() const override { return gloo_.timed_out_keys(); }
  std::string hint() const override {
    return fmt::format("are they running, with WORLD_SIZE={}, and do they reach {}?", ranks_.world_size,
                       store_->describe());
  }

 private:
  std::shared_ptr<RendezvousStore> store_;
  std::int64_t number_;
  GlooOverStore gloo_;
  bool completed_ = false;
};

}  // namespace

Expected<std::unique_ptr<Rendezvous>> open_store_rendezvous(const RankInfo& ranks,
                                                            std::shared_ptr<RendezvousStore> store,
                                                            milliseconds timeout) {
  // Step 1 of Note [Store rendezvous].
  Expected<std::int64_t> number = store->add(fmt::format("tierzero/communicators/{}", ranks.rank), 1);
  if (!number.ok()) {
    return Status(number.status().code(),
                  fmt::format("rendezvous through {}: rank {} of {} on {} cannot use the store: {}", store->describe(),
                              ranks.rank, ranks.world_size, host_name(), number.status().message()));
  }
  return std::unique_ptr<Rendezvous>(std::make_unique<StoreRendezvous>(ranks, std::move(store), *number, timeout));
}

}  // namespace tz::comm_detail
