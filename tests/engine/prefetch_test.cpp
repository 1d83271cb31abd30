// The prefetch scheduler's trace (engine/src/prefetch.h): a fetch order that
// changes once is recorded again and prefetching resumes; one that never
// holds switches it off; a forward abandoned half-way and rewound leaves it
// on. Each run trains beside a twin engine that only trains: whatever the
// prefetcher does, the weights must come out bit for bit the same.
#include <gtest/gtest.h>

#include "tierzero/testing/engine.h"
#include "../nvme/nvme_test_util.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 77};
// Parameters and optimizer on NVMe: every fetch has an NVMe read to hide.
constexpr Placement kNvme{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};

struct Training {
  TempDir nvme, twin_nvme;
  std::unique_ptr<tz::ZeroEngine> engine, twin;  // twin: the same training, nothing else fetched
  std::vector<std::uint64_t> fetches, prefetched;  // engine's, per step

  Training() : engine(make(nvme)), twin(make(twin_nvme)) {}

  static std::unique_ptr<tz::ZeroEngine> make(const TempDir& dir) {
    return tz::ZeroEngine::create({.config = test_config(dir.path(), 3, 1), .placement = kNvme},
                                  tz::mlp::model(kMlp), tz::mlp::init(kMlp))
        .value();
  }

  // One micro-batch (gradient_accumulation_steps 1: one optimizer step) on
  // both, after `before` has made whatever fetches the test wants first.
  void step(int step, const std::function<void(tz::ZeroEngine&)>& before = {}) {
    if (before) before(*engine);
    for (tz::ZeroEngine* e : {engine.get(), twin.get()}) {
      auto loss = tz::mlp::train_micro_batch(*e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step));
      ASSERT_TRUE(loss.ok()) << loss.status().to_string();
      auto r = e->step();
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      if (e == engine.get()) {
        fetches.push_back(r->fetches);
        prefetched.push_back(r->prefetched);
      }
    }
  }

  void expect_twins_weights() {
    for (std::size_t b = 0; b < engine->layout().blocks.size(); ++b) {
      EXPECT_EQ(engine->gather_master(b).value(), twin->gather_master(b).value())
          << "block " << b << ": the prefetcher changed what training computed";
    }
  }

  std::string counts() const {
    std::string s;
    for (std::size_t i = 0; i < fetches.size(); ++i) s += fmt::format(" {}/{}", prefetched[i], fetches[i]);
    return s;
  }
};

// The first k blocks of a forward, fetched and let go (a forward that raised
// at block k).
void forward_prefix(tz::ZeroEngine& engine, std::size_t k) {
  for (std::size_t b = 0; b < k; ++b) {
    auto p = engine.fetch(b);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
  }
}

TEST(Prefetcher, AForwardAbandonedHalfWayAndRewoundKeepsPrefetchingOn) {
  for (const bool rewind : {true, false}) {
    SCOPED_TRACE(rewind ? "rewound" : "not rewound (control)");
    Training run;
    for (int step = 0; step < 5; ++step) {
      run.step(step, [&](tz::ZeroEngine& e) {
        if (step != 2) return;
        const tz::FetchMark mark = e.fetch_mark();
        forward_prefix(e, 2);
        if (rewind) {
          tz::Status s = e.rewind_fetches(mark);
          ASSERT_TRUE(s.ok()) << s.to_string();
        }
      });
    }
    std::printf("[ prefetch ] %-28s prefetched/fetched per step:%s\n", rewind ? "rewound" : "not rewound",
                run.counts().c_str());
    const std::uint64_t per_step = run.fetches[1];
    EXPECT_EQ(run.prefetched[1], per_step) << "steps after the first are prefetched";
    if (rewind) {
      // The abandoned prefix took the window's first blocks; they are fetched again.
      EXPECT_EQ(run.fetches[2], per_step + 2);
      EXPECT_EQ(run.prefetched[2], run.fetches[2]) << "the micro-batch goes on prefetched after the rewind";
      EXPECT_EQ(run.prefetched[3], per_step);
    } else {
      EXPECT_EQ(run.prefetched[3], 0u) << "the control's next micro-batch records the order again";
    }
    EXPECT_EQ(run.prefetched[4], per_step) << "prefetching is on again either way";
    run.expect_twins_weights();
  }
}

// A fetch out of order (the evaluation test's control, a submodule called on
// its own in training mode) pauses prefetching while the order is recorded
// again; it does not switch it off for the rest of the run.
TEST(Prefetcher, AnOrderThatChangesOnceIsRecordedAgainAndPrefetchingResumes) {
  Training run;
  for (int step = 0; step < 6; ++step) {
    run.step(step, [&](tz::ZeroEngine& e) {
      if (step == 2) {
        ASSERT_TRUE(e.fetch(e.layout().blocks.size() - 1).ok());  // the last block, first
      }
    });
  }
  std::printf("[ prefetch ] prefetched/fetched per step:%s\n", run.counts().c_str());
  EXPECT_EQ(run.prefetched[2], 0u) << "the step that left the order fetches on demand";
  EXPECT_EQ(run.prefetched[3], 0u) << "the next one records it again";
  EXPECT_EQ(run.prefetched[4], run.fetches[4]);
  EXPECT_EQ(run.prefetched[5], run.fetches[5]);
  run.expect_twins_weights();
}

// Data-dependent control flow: every other micro-batch fetches one more
// block first, so no recorded order holds for a whole micro-batch. After
// three traces running that none followed, prefetching is off for good,
// even on micro-batches that would match.
TEST(Prefetcher, AnOrderThatNeverHoldsSwitchesPrefetchingOff) {
  Training run;
  for (int step = 0; step < 9; ++step) {
    run.step(step, [&](tz::ZeroEngine& e) {
      if (step % 2 == 1) {
        ASSERT_TRUE(e.fetch(0).ok());
      }
    });
  }
  std::printf("[ prefetch ] prefetched/fetched per step:%s\n", run.counts().c_str());
  // Recorded at steps 0, 2, 4; broken at 1, 3, 5 after their first fetch
  // (block 0, as the trace has it); off from 6.
  for (int step : {0, 2, 4, 6, 7, 8}) EXPECT_EQ(run.prefetched[step], 0u) << "step " << step;
  for (int step : {1, 3, 5}) EXPECT_EQ(run.prefetched[step], 1u) << "step " << step << " should prefetch again";
  run.expect_twins_weights();
}

// A micro-batch that fetches nothing (a step() with no forward before it,
// or a model whose blocks are all persistent) says nothing about the order.
// Before, an empty first micro-batch recorded an empty trace and prefetching
// never started; an empty one later made the next record the order again.
TEST(Prefetcher, AMicroBatchThatFetchesNothingLeavesTheTraceAlone) {
  Training run;
  auto empty_step = [&] {
    auto r = run.engine->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->fetches, 0u);
  };
  empty_step();  // before any training: nothing to record
  run.step(0);
  run.step(1);
  empty_step();
  run.step(2);
  std::printf("[ prefetch ] prefetched/fetched per step:%s\n", run.counts().c_str());
  EXPECT_EQ(run.prefetched[0], 0u) << "the first micro-batch that fetches records the order";
  EXPECT_EQ(run.prefetched[1], run.fetches[1]) << "prefetching starts after it";
  EXPECT_EQ(run.prefetched[2], run.fetches[2]) << "an empty micro-batch in between changes nothing";
}

// Over two ranks the window's all-gathers are collectives: both ranks abandon
// the same forward and rewind, and go on prefetched, to the reference's
// weights (no rank left waiting in a gather the other dropped).
TEST(Prefetcher, TwoRanksRewindTogetherAndGoOnPrefetched) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    const std::string nvme = dir.path() + "/rank" + std::to_string(info.rank);
    std::filesystem::create_directories(nvme);
    const tz::Config config = test_config(nvme, 3, 1);
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    auto engine = tz::ZeroEngine::create({.config = config, .comm = comm->get(), .grad_type = tz::DType::kFp32,
                                          .placement = kNvme},
                                         tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    if (!engine.ok()) return 1;
    tz::ZeroEngine& e = **engine;
    tz::mlp::Reference ref(kMlp, config, info.world_size, tz::DType::kFp32);
    std::string counts;
    bool prefetched_after = true;
    for (int step = 0; step < 4; ++step) {
      if (step == 1) {  // a prefetched micro-batch (the first recorded the order)
        const tz::FetchMark mark = e.fetch_mark();
        for (std::size_t b = 0; b < 2; ++b) {
          if (!e.fetch(b).ok()) return 1;
        }
        if (tz::Status s = e.rewind_fetches(mark); !s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", info.rank, s.to_string().c_str());
          return 1;
        }
      }
      auto loss = tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, info.rank, 0, step));
      auto r = loss.ok() ? e.step() : tz::Expected<tz::StepReport>(loss.status());
      if (!r.ok()) {
        std::fprintf(stderr, "rank %d step %d: %s\n", info.rank, step, r.status().to_string().c_str());
        return 1;
      }
      ref.train_step(step);
      counts += fmt::format(" {}/{}", r->prefetched, r->fetches);
      if (step >= 1 && r->prefetched != r->fetches) prefetched_after = false;
    }
    auto c = compare_masters(e, ref);
    if (!c.ok()) return 1;
    std::printf("[ prefetch ] rank %d: prefetched/fetched per step:%s; largest |master - reference| %.3g\n",
                info.rank, counts.c_str(), c->max_abs);
    if (!prefetched_after) return 5;
    return c->max_abs <= 1e-6 ? 0 : 2;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " (5: a step after the first not prefetched)";
}

// The abandoned forward itself left the order (a stray fetch before the
// block that raised): the rewind forgets that too, and the micro-batch goes
// on prefetched, nothing recorded again.
TEST(Prefetcher, ARewindForgetsADepartureInsideTheAbandonedForward) {
  Training run;
  for (int step = 0; step < 4; ++step) {
    run.step(step, [&](tz::ZeroEngine& e) {
      if (step != 1) return;
      const tz::FetchMark mark = e.fetch_mark();
      forward_prefix(e, 1);
      ASSERT_TRUE(e.fetch(e.layout().blocks.size() - 1).ok());  // out of order
      tz::Status s = e.rewind_fetches(mark);
      ASSERT_TRUE(s.ok()) << s.to_string();
    });
  }
  std::printf("[ prefetch ] prefetched/fetched per step:%s\n", run.counts().c_str());
  // Step 1: the in-order fetch and the rest prefetched; the stray one on demand.
  EXPECT_EQ(run.prefetched[1], run.fetches[1] - 1);
  EXPECT_EQ(run.prefetched[2], run.fetches[2]) << "the next micro-batch should not record the order again";
  EXPECT_EQ(run.prefetched[3], run.fetches[3]);
  run.expect_twins_weights();
}

// A mark is good in its own micro-batch, up to the fetches it counted.
TEST(Prefetcher, AMarkFromAnotherMicroBatchOrPastARewindIsRefused) {
  Training run;
  run.step(0);
  tz::ZeroEngine& e = *run.engine;
  auto expect_refused = [&](const tz::FetchMark& mark, const std::string& why) {
    tz::Status s = e.rewind_fetches(mark);
    EXPECT_EQ(s.code(), tz::ErrorCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(why), std::string::npos) << s.to_string();
  };
  const tz::FetchMark start = e.fetch_mark();
  EXPECT_EQ(start.fetches, 0u);
  forward_prefix(e, 3);
  const tz::FetchMark three = e.fetch_mark();
  EXPECT_EQ(three.fetches, 3u);
  EXPECT_EQ(three.micro_batch, start.micro_batch);
  ASSERT_TRUE(e.rewind_fetches(start).ok());
  expect_refused(three, "the mark is at fetch 3 of this micro-batch, past its 0 traced fetches");
  auto r = e.step();  // the micro-batch ends (no backward: the optimizer steps with zero gradients)
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  forward_prefix(e, 3);  // the next micro-batch, three fetches in: more than either old mark counted
  expect_refused(start, fmt::format("the mark is from micro-batch {}, and this is micro-batch {}", start.micro_batch,
                                    start.micro_batch + 1));
  EXPECT_EQ(e.fetch_mark().fetches, 3u) << "a refused rewind changes nothing";
  // The mark of now rewinds to nothing: a no-op.
  EXPECT_TRUE(e.rewind_fetches(e.fetch_mark()).ok());
}

}  // namespace
}  // namespace tzt
