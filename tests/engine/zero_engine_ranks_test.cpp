// ZeroEngine over 2 and 4 ranks (processes on this machine, Gloo): every
// placement trains to the in-memory reference's parameters, for ZeRO stages
// 1, 2 and 3; a rank killed mid-step makes the others fail within the timeout.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>

#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"
#include "tierzero/kernels.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 64, .batch = 4, .seed = 99};
constexpr double kTolerance = 1e-6;  // lr 1e-3: a real error moves a weight by ~1e-3

// One rank's run: engine and reference side by side; 0 when they agree.
// `batch`, when given, replaces the engine config's batch keys (the reference
// keeps 2 accumulation steps).
int train_rank(const tz::RankInfo& info, const std::string& nvme_dir, int stage, const Placement& placement,
               int steps, const std::optional<tz::BatchKeys>& batch = std::nullopt) {
  const tz::Config config = test_config(nvme_dir + "/rank" + std::to_string(info.rank), stage, 2);
  tz::Config engine_config = config;
  if (batch) {
    engine_config.batch_given = *batch;
    engine_config.gradient_accumulation_steps = batch->gradient_accumulation_steps.value_or(1);
  }
  std::filesystem::create_directories(nvme_dir + "/rank" + std::to_string(info.rank));
  auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", info.rank, comm.status().to_string().c_str());
    return 1;
  }
  auto engine = tz::ZeroEngine::create({.config = engine_config, .comm = comm->get(), .grad_type = tz::DType::kFp32,
                                        .placement = placement},
                                       tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  if (!engine.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", info.rank, engine.status().to_string().c_str());
    return 1;
  }
  if ((*engine)->config().gradient_accumulation_steps != 2) {
    std::fprintf(stderr, "rank %d: the engine runs %lld accumulation steps, not 2\n", info.rank,
                 static_cast<long long>((*engine)->config().gradient_accumulation_steps));
    return 3;
  }
  tz::mlp::Reference ref(kMlp, config, info.world_size, tz::DType::kFp32);
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      auto loss = tz::mlp::train_micro_batch(**engine, kMlp, tz::mlp::make_batch(kMlp, info.rank, micro, step));
      auto report = loss.ok() ? (*engine)->step() : tz::Expected<tz::StepReport>(loss.status());
      if (!report.ok()) {
        std::fprintf(stderr, "rank %d step %d: %s\n", info.rank, step, report.status().to_string().c_str());
        return 1;
      }
    }
    ref.train_step(step);
  }
  auto c = compare_masters(**engine, ref);
  if (!c.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", info.rank, c.status().to_string().c_str());
    return 1;
  }
  if (info.rank == 0) {
    std::printf("[ engine ] %d ranks, stage %d, %-55s largest |master - reference|: %.3g\n", info.world_size, stage,
                placement_name(placement).c_str(), c->max_abs);
  }
  return c->max_abs <= kTolerance ? 0 : 2;
}

TEST(ZeroEngineRanks, TwoAndFourRanksMatchTheReferenceForEveryPlacement) {
  const Placement placements[] = {
      {Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu},
      {Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
      {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},
  };
  for (int world : {2, 4}) {
    for (const Placement& p : placements) {
      TempDir dir;
      const auto codes = run_ranks(world, dir.path(), [&](const tz::RankInfo& info) {
        return train_rank(info, dir.path(), 3, p, 3);
      });
      for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << world << " ranks, rank " << r << ", " << placement_name(p);
    }
  }
}

// Note [Batch keys]: DeepSpeed's train_batch_size with a micro batch size
// means train_batch / (micro x ranks) accumulation steps: 32 / (8 x 2) = 2
// here, which the reference takes. Read as "no accumulation", the engine would
// step after every micro-batch and part from the reference.
TEST(ZeroEngineRanks, TheAccumulationStepsAreDerivedFromTrainBatchSizeAndTheRanks) {
  const Placement p{Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu};
  const tz::BatchKeys batch{.train_batch_size = 32, .train_micro_batch_size_per_gpu = 8};
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) {
    return train_rank(info, dir.path(), 3, p, 2, batch);
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  // 48 with a micro batch of 8 and 2 accumulation steps means 3 ranks: on 1, refused rather than guessed.
  TempDir bad;
  auto config = test_config(bad.path(), 3, 2);
  config.batch_given = {.train_batch_size = 48, .train_micro_batch_size_per_gpu = 8, .gradient_accumulation_steps = 2};
  const auto refused = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("train_batch_size = 48, but"), std::string::npos)
      << refused.status().message();
}

TEST(ZeroEngineRanks, StagesOneAndTwoMatchTheReference) {
  const Placement p{Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu};
  for (int stage : {1, 2}) {
    TempDir dir;
    const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) {
      return train_rank(info, dir.path(), stage, p, 3);
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "stage " << stage << ", rank " << r;
  }
}

// set_master over 2 ranks: rank 1's values reach both ranks' shards (rank 0
// passes other values, which the broadcast overwrites), with a persistent
// block and a partitioned one; ranks naming different blocks are refused on
// both, with nothing changed.
TEST(ZeroEngineRanks, SetMasterTakesTheRootsValuesOnEveryRank) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    tz::Config config = test_config(dir.path() + "/rank" + std::to_string(info.rank), 3, 1);
    std::filesystem::create_directories(dir.path() + "/rank" + std::to_string(info.rank));
    config.zero.stage3_param_persistence_threshold = 100;  // "small" stays whole on every rank
    const std::vector<tz::BlockSpec> model = {{"small", {{"w", {4, 16}}}}, {"big", {{"w", {96, 64}}, {"b", {64}}}}};
    const tz::ParamInit init = [](std::size_t b, std::size_t p, float* out, std::uint64_t n) {
      for (std::uint64_t i = 0; i < n; ++i) out[i] = static_cast<float>((b * 31 + p * 7 + i) % 17) / 16.0F - 0.5F;
    };
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    auto created = tz::ZeroEngine::create({.config = config, .comm = comm->get()}, model, init);
    if (!created.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", info.rank, created.status().to_string().c_str());
      return 1;
    }
    tz::ZeroEngine& engine = **created;
    if (!engine.layout().blocks[0].persistent || engine.layout().blocks[1].persistent) return 9;
    for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
      std::vector<float> w = engine.gather_master(b).value();
      std::vector<float> want = w;
      for (std::size_t i = 0; i < want.size(); i += 7) want[i] = static_cast<float>(i % 13) * 0.25F;
      if (info.rank == 1) w = want;
      else std::fill(w.begin(), w.end(), -9.0F);
      if (tz::Status s = engine.set_master(b, w.data(), w.size(), 1); !s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", info.rank, s.to_string().c_str());
        return 2;
      }
      if (w != want || engine.gather_master(b).value() != want) {
        std::fprintf(stderr, "rank %d, block %zu: not rank 1's values\n", info.rank, b);
        return 3;
      }
      auto p = engine.fetch(b);  // the 16-bit copy, gathered from both ranks' shards (persistent or not)
      if (!p.ok()) return 4;
      const auto* got = static_cast<const std::uint16_t*>(p->data());
      for (std::size_t i = 0; i < engine.layout().blocks[b].used_numel; ++i) {
        if (got[i] != tz::kernels::fp32_to_bf16(want[i])) {
          std::fprintf(stderr, "rank %d, block %zu (%s): 16-bit element %zu is not the new master rounded\n",
                       info.rank, b, engine.layout().blocks[b].persistent ? "persistent" : "partitioned", i);
          return 5;
        }
      }
      *p = tz::GatheredBlock();
      if (!engine.step().ok()) return 6;  // ends the micro-batch that fetch began
    }
    std::vector<float> w = engine.gather_master(0).value();
    const std::vector<float> before = w;
    w[0] += 1;
    const tz::Status split = engine.set_master(info.rank, w.data(), w.size(), 0);
    if (split.ok() || split.message().find("the ranks name different blocks or roots") == std::string::npos) {
      std::fprintf(stderr, "rank %d: ranks naming different blocks: %s\n", info.rank, split.to_string().c_str());
      return 7;
    }
    return engine.gather_master(0).value() == before ? 0 : 8;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A one-step test config whose NVMe files go to dir/rank<rank>.
tz::Config rank_config(const std::string& dir, int rank) {
  const std::string mine = dir + "/rank" + std::to_string(rank);
  std::filesystem::create_directories(mine);
  return test_config(mine, 3, 1);
}

// report(what, status): one rank's failure, on stderr, for the harness's log.
auto failure_report(int rank) {
  return [rank](const char* what, const tz::Status& s) {
    std::fprintf(stderr, "rank %d, %s: %s\n", rank, what, s.to_string().c_str());
  };
}

// Ranks that pass different models (a shape differs) fail at creation,
// every one of them, naming what differs, instead of meeting each other's
// collectives with other sizes.
TEST(ZeroEngineRanks, DifferentModelsOnTheRanksAreRefusedAtCreation) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    const tz::Config config = rank_config(dir.path(), info.rank);
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    const std::int64_t width = info.rank == 0 ? 64 : 65;
    const std::vector<tz::BlockSpec> model = {{"a", {{"w", {width, 64}}}}, {"b", {{"w", {64, 64}}}}};
    const tz::ParamInit init = [](std::size_t, std::size_t, float* out, std::uint64_t n) { std::fill(out, out + n, 0.5F); };
    auto created = tz::ZeroEngine::create({.config = config, .comm = comm->get()}, model, init);
    if (created.ok()) return 2;
    const std::string msg = created.status().message();
    if (msg.find("creating the engine: the ranks name different models") == std::string::npos ||
        msg.find(info.rank == 0 ? "8192 parameters" : "8256 parameters") == std::string::npos) {
      std::fprintf(stderr, "rank %d: %s\n", info.rank, created.status().to_string().c_str());
      return 3;
    }
    return 0;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Note [Ranks agree on their settings]: a rank with another lr once stepped
// its shard with it and exited 0; another accumulation count waited for the
// 300 s timeout; another precision died in Gloo. Each now fails creation on
// every rank at once, naming the setting and both values.
TEST(ZeroEngineRanks, RanksWithDifferentSettingsAreRefusedAtCreationNamingTheSetting) {
  struct Case {
    std::function<void(tz::Config&)> edit;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](tz::Config& c) { c.optimizer.lr = 1e-3; }, "first at optimizer.params.lr: rank 0 has 'optimizer.params.lr = 0.01', rank 1 has 'optimizer.params.lr = 0.001'"},
      {[](tz::Config& c) { tz::override_gradient_accumulation_steps(c, 4); }, "first at gradient_accumulation_steps"},
      {[](tz::Config& c) { c.gradient_clipping = 0.5; }, "first at gradient_clipping"},
      {[](tz::Config& c) { ASSERT_TRUE(tz::set_training_precision(c, "fp32").ok()); }, "first at precision"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.want);
    TempDir dir;
    const auto start = std::chrono::steady_clock::now();
    const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
      tz::Config config = rank_config(dir.path(), info.rank);
      config.optimizer.lr = 0.01;
      if (info.rank == 1) k.edit(config);
      auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
      if (!comm.ok()) return 1;
      auto created = tz::ZeroEngine::create({.config = config, .comm = comm->get()}, tz::mlp::model(kMlp),
                                            tz::mlp::init(kMlp));
      if (created.ok()) return 2;
      const std::string msg = created.status().message();
      if (created.status().code() != tz::ErrorCode::kInvalidArgument ||
          msg.find("creating the engine: the ranks' settings differ, " + k.want) == std::string::npos) {
        std::fprintf(stderr, "rank %d: %s\n", info.rank, created.status().to_string().c_str());
        return 3;
      }
      return 0;
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "refused, not timed out";
    EXPECT_EQ(dir.files(), std::vector<std::string>{}) << "no swap, rendezvous or phase file is left";
  }
}

// Note [Initial values]: ranks whose initialisers differ (seeded apart)
// all start from rank 0's values, a persistent block (whole on every rank)
// too; with kSameOnEveryRank the engine takes the caller's word and each
// rank keeps its own shard.
TEST(ZeroEngineRanks, EveryRankStartsFromRankZerosValues) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    const std::vector<tz::BlockSpec> model = {{"small", {{"w", {4, 16}}}}, {"big", {{"w", {96, 64}}, {"b", {64}}}}};
    const auto value = [](int rank, std::size_t b, std::size_t p, std::uint64_t i) {
      return static_cast<float>((b * 31 + p * 7 + i) % 17) / 16.0F - 0.5F + static_cast<float>(rank);
    };
    const tz::ParamInit init = [&](std::size_t b, std::size_t p, float* out, std::uint64_t n) {
      for (std::uint64_t i = 0; i < n; ++i) out[i] = value(info.rank, b, p, i);
    };
    for (const tz::InitialValues from : {tz::InitialValues::kRankZero, tz::InitialValues::kSameOnEveryRank}) {
      const bool rank_zeros = from == tz::InitialValues::kRankZero;
      tz::Config config = rank_config(dir.path() + (rank_zeros ? "/zero" : "/same"), info.rank);
      config.zero.stage3_param_persistence_threshold = 100;  // "small" stays whole on every rank
      auto created = tz::ZeroEngine::create({.config = config, .comm = comm->get(), .initial_values = from}, model, init);
      if (!created.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", info.rank, created.status().to_string().c_str());
        return 2;
      }
      tz::ZeroEngine& engine = **created;
      if (!engine.layout().blocks[0].persistent || engine.layout().blocks[1].persistent) return 3;
      std::vector<tz::GatheredBlock> fetches;  // held to the end: a step would move the weights
      for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
        const tz::BlockLayout& block = engine.layout().blocks[b];
        const std::vector<float> master = engine.gather_master(b).value();
        auto fetched = engine.fetch(b);  // the 16-bit copy, gathered from the ranks' shards
        if (!fetched.ok()) return 4;
        const auto* p16 = static_cast<const std::uint16_t*>(fetched->data());
        fetches.push_back(std::move(*fetched));
        for (std::size_t p = 0; p < block.params.size(); ++p) {
          for (std::uint64_t i = 0; i < block.params[p].numel; ++i) {
            const std::uint64_t at = block.params[p].offset + i;
            const int owner = rank_zeros ? 0 : static_cast<int>(at / block.shard_numel);
            const float want = value(owner, b, p, i);
            if (master[at] != want || p16[at] != tz::kernels::fp32_to_bf16(want)) {
              std::fprintf(stderr, "rank %d, %s, %s.%s[%llu]: master %g, want rank %d's %g\n", info.rank,
                           rank_zeros ? "kRankZero" : "kSameOnEveryRank", block.name.c_str(),
                           block.params[p].name.c_str(), static_cast<unsigned long long>(i), master[at], owner, want);
              return 5;
            }
          }
        }
      }
      fetches.clear();
      if (!engine.step().ok()) return 6;  // ends the micro-batch the fetches began
    }
    return 0;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// kSetLater: no weights are written at creation, and until set_master()
// gives a block its values every call that would read it is refused, naming
// it. Set to the initialiser's values (rank 0's, rank 1 passing garbage),
// the engine then trains as the reference does, so the moments started at
// zero; partitioned and persistent blocks, masters and moments on NVMe.
TEST(ZeroEngineRanks, BlocksSetLaterAreRefusedUntilSetAndThenTrainAsTheReference) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    const auto report = failure_report(info.rank);
    const tz::ParamInit init = tz::mlp::init(kMlp);
    for (const std::int64_t persist_below : {0, 5000}) {  // none persistent, then all
      const std::string mine = dir.path() + "/p" + std::to_string(persist_below) + "/rank" + std::to_string(info.rank);
      std::filesystem::create_directories(mine);
      tz::Config config = test_config(mine, 3, 2);
      config.zero.stage3_param_persistence_threshold = persist_below;
      auto created = tz::ZeroEngine::create({.config = config, .comm = comm->get(), .grad_type = tz::DType::kFp32,
                                             .placement = Placement{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},
                                             .initial_values = tz::InitialValues::kSetLater},
                                            tz::mlp::model(kMlp), tz::ParamInit());
      if (!created.ok()) return report("create", created.status()), 2;
      tz::ZeroEngine& engine = **created;
      const auto refused = [&](const char* what, const tz::Status& s, const std::string& want) {
        if (s.code() == tz::ErrorCode::kFailedPrecondition && s.message().find(want) != std::string::npos) return false;
        report(what, s);
        return true;
      };
      const std::string none = "block 'layer0' has no values yet (the engine was made with initial_values = "
                               "kSetLater, and 3 of its 3 blocks are still unset)";
      if (refused("fetch", engine.fetch(0).status(), "fetch: " + none)) return 3;
      if (refused("gather_master", engine.gather_master(0).status(), "gather_master: " + none)) return 3;
      if (refused("step", engine.step().status(), "step: " + none)) return 3;
      if (refused("save", engine.save_checkpoint(mine + "/ckpt"), "save_checkpoint: " + none)) return 3;
      if (refused("export", engine.export_safetensors(mine + "/w.safetensors"), "export_safetensors: " + none)) return 3;
      if (std::filesystem::exists(mine + "/ckpt") || std::filesystem::exists(mine + "/w.safetensors")) return 4;
      for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
        const tz::BlockLayout& block = engine.layout().blocks[b];
        std::vector<float> whole(block.whole_numel, -7.0F);
        if (info.rank == 0) {
          std::fill(whole.begin(), whole.end(), 0.0F);
          for (std::size_t p = 0; p < block.params.size(); ++p) {
            init(b, p, whole.data() + block.params[p].offset, block.params[p].numel);
          }
        }
        if (tz::Status s = engine.set_master(b, whole.data(), whole.size(), 0); !s.ok()) return report("set", s), 5;
        if (b == 0 && refused("fetch", engine.fetch(1).status(), "block 'layer1' has no values yet")) return 6;
        if (b == 0 && refused("fetch", engine.fetch(1).status(), "2 of its 3 blocks are still unset")) return 6;
      }
      tz::mlp::Reference ref(kMlp, config, info.world_size, tz::DType::kFp32);
      const double worst = train_and_compare(engine, ref, kMlp, 3, 2);
      if (info.rank == 0) {
        std::printf("[ engine ] set later, persistence threshold %lld: largest |master - reference| %.3g\n",
                    static_cast<long long>(persist_below), worst);
      }
      if (!(worst <= kTolerance)) return 7;
    }
    return 0;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A write that fails on one rank while the engine is created, or while a
// checkpoint loads into an engine made with kSetLater, fails every rank at
// once, each saying why (not the others after the communicator's timeout,
// waiting in a broadcast or gather the failed rank never joins); after the
// failed load every rank still has the same blocks unset, so the next calls
// are refused alike on all of them.
TEST(ZeroEngineRanks, AWriteFailingOnOneRankFailsCreationAndLoadsOnEveryRankAtOnce) {
  TempDir dir, ckpt;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(30)});
    if (!comm.ok()) return 1;
    const auto report = failure_report(info.rank);
    const auto quick = [](auto since) { return std::chrono::steady_clock::now() - since < std::chrono::seconds(10); };
    std::atomic<bool> armed{true};
    const Placement nvme{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};
    const auto options = [&](const std::string& sub, tz::InitialValues from) {
      tz::ZeroOptions o{.config = rank_config(dir.path() + sub, info.rank), .comm = comm->get(), .placement = nvme,
                        .initial_values = from};
      o.nvme_fault_injector = [&armed, rank = info.rank](const tz::nvme::PieceInfo& p) {
        return armed.load() && rank == 1 && p.op == tz::nvme::IoOp::kWrite ? tz::nvme::Fault{.error = EIO}
                                                                           : tz::nvme::Fault{};
      };
      return o;
    };
    // Creation: rank 1's first write fails; rank 0 must not go on to the next block's broadcast.
    auto since = std::chrono::steady_clock::now();
    auto failed = tz::ZeroEngine::create(options("/a", tz::InitialValues::kRankZero), tz::mlp::model(kMlp),
                                         tz::mlp::init(kMlp));
    const std::string want_create = info.rank == 1 ? "initialising layer0" : "initialising layer0: 1 other rank(s)";
    if (failed.ok() || failed.status().message().find(want_create) == std::string::npos || !quick(since)) {
      return report("create", failed.status()), 2;
    }
    // A checkpoint of a healthy engine, then a load into a kSetLater engine that fails on rank 1.
    armed = false;
    auto healthy = tz::ZeroEngine::create(options("/b", tz::InitialValues::kRankZero), tz::mlp::model(kMlp),
                                          tz::mlp::init(kMlp));
    if (!healthy.ok()) return report("healthy", healthy.status()), 3;
    if (tz::Status s = (*healthy)->save_checkpoint(ckpt.path()); !s.ok()) return report("save", s), 3;
    auto later = tz::ZeroEngine::create(options("/c", tz::InitialValues::kSetLater), tz::mlp::model(kMlp),
                                        tz::ParamInit());
    if (!later.ok()) return report("later", later.status()), 4;
    armed = true;
    since = std::chrono::steady_clock::now();
    const tz::Status load = (*later)->load_checkpoint(ckpt.path());
    if (load.ok() || !quick(since)) return report("load", load), 5;
    for (std::size_t b = 0; b < (*later)->layout().blocks.size(); ++b) {
      if ((*later)->has_values(b)) return report("has_values after the failed load", load), 6;
    }
    const tz::Status refused = (*later)->gather_master(0).status();
    if (refused.code() != tz::ErrorCode::kFailedPrecondition) return report("gather after the failed load", refused), 7;
    armed = false;  // the same load, now whole, sets every block on both ranks
    if (tz::Status s = (*later)->load_checkpoint(ckpt.path()); !s.ok()) return report("second load", s), 8;
    return (*later)->gather_master(2).value() == (*healthy)->gather_master(2).value() ? 0 : 9;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Note [Streamed checkpoints]: a put failing on one rank while an engine
// that has trained (prefetching on) loads a checkpoint. The ranks agree on
// the puts before the gathers that follow them, so both fail at once, not
// after the timeout, and both mark every block unset; the same load, whole,
// then resumes both.
TEST(ZeroEngineRanks, APutFailingOnOneRankDuringALoadUnsetsEveryBlockOnEveryRankAtOnce) {
  TempDir dir, ckpt;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(30)});
    if (!comm.ok()) return 1;
    const auto report = failure_report(info.rank);
    std::atomic<bool> armed{false};
    tz::ZeroOptions o{.config = rank_config(dir.path(), info.rank), .comm = comm->get(),
                      .placement = Placement{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme}};
    o.nvme_fault_injector = [&armed, rank = info.rank](const tz::nvme::PieceInfo& p) {
      return armed.load() && rank == 1 && p.op == tz::nvme::IoOp::kWrite ? tz::nvme::Fault{.error = EIO}
                                                                         : tz::nvme::Fault{};
    };
    auto created = tz::ZeroEngine::create(o, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    if (!created.ok()) return report("create", created.status()), 2;
    tz::ZeroEngine& e = **created;
    const auto train = [&](int from, int to) -> tz::Status {
      for (int step = from; step < to; ++step) {
        TZ_TRY(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, info.rank, 0, step)).status());
        TZ_TRY(e.step().status());
      }
      return tz::ok_status();
    };
    const auto masters = [&] {
      std::vector<std::vector<float>> out;
      for (std::size_t b = 0; b < e.layout().blocks.size(); ++b) out.push_back(e.gather_master(b).value());
      return out;
    };
    if (tz::Status s = train(0, 2); !s.ok()) return report("train", s), 3;
    if (tz::Status s = e.save_checkpoint(ckpt.path()); !s.ok()) return report("save", s), 3;
    if (tz::Status s = train(2, 3); !s.ok()) return report("train", s), 3;
    const auto after_step_3 = masters();
    armed = true;
    const auto since = std::chrono::steady_clock::now();
    const tz::Status load = e.load_checkpoint(ckpt.path());
    armed = false;
    if (load.ok() || std::chrono::steady_clock::now() - since > std::chrono::seconds(10)) return report("load", load), 4;
    const std::string want = info.rank == 1 ? "Input/output error" : "1 other rank(s) failed";
    if (load.message().find(want) == std::string::npos) return report("load's error", load), 4;
    for (std::size_t b = 0; b < e.layout().blocks.size(); ++b) {
      if (e.has_values(b)) return report("has_values after the failed load", load), 5;
    }
    const tz::Status refused = train(3, 4);
    if (refused.code() != tz::ErrorCode::kFailedPrecondition) return report("training after the failed load", refused), 6;
    if (tz::Status s = e.load_checkpoint(ckpt.path()); !s.ok()) return report("second load", s), 7;
    if (tz::Status s = train(2, 3); !s.ok()) return report("train after the load", s), 8;
    return masters() == after_step_3 ? 0 : 9;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(ZeroEngineRanks, ARankKilledMidStepMakesTheOthersFailWithinTheTimeout) {
  TempDir dir;
  constexpr auto kTimeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    const tz::Config config = test_config(dir.path(), 3, 1);
    auto comm = tz::create_communicator({.ranks = info, .timeout = kTimeout});
    if (!comm.ok()) {  // codes[r] == 1: set-up failed, not the case under test
      std::fprintf(stderr, "rank %d: communicator: %s\n", info.rank, comm.status().to_string().c_str());
      return 1;
    }
    auto engine = tz::ZeroEngine::create({.config = config, .comm = comm->get()}, tz::mlp::model(kMlp),
                                         tz::mlp::init(kMlp));
    if (!engine.ok()) {
      std::fprintf(stderr, "rank %d: engine: %s\n", info.rank, engine.status().to_string().c_str());
      return 1;
    }
    if (info.rank == 1) ::raise(SIGKILL);  // dies before the first forward
    auto loss = tz::mlp::train_micro_batch(**engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 0));
    auto report = loss.ok() ? (*engine)->step() : tz::Expected<tz::StepReport>(loss.status());
    if (report.ok()) return 0;  // must not happen
    std::fprintf(stderr, "rank 0 failed as it should: %s\n", report.status().to_string().c_str());
    return 10;
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(codes[0], 10) << "the surviving rank must report an error";
  EXPECT_EQ(codes[1], 128 + SIGKILL);
  EXPECT_LT(seconds, 30.0) << "the survivor must not hang past its timeout";
}

}  // namespace
}  // namespace tzt
