// Note [The step keeps backward's parameter shards] (engine/src/kept_params.h):
// - KeptParams on its own: a kept copy is used only while the stored shard
//   is unchanged, the newest copy wins, and the blocks kept fill the budget
//   from the last block;
// - in the engine, with a remainder master and the 16-bit parameters on
//   NVMe: training is bit for bit training that reads every shard again, on
//   1 and 2 ranks, with accumulation and with clipping biting, steps under
//   backward (kept and redone) included, and the NVMe reads drop by exactly
//   the kept shards' bytes; placements where the parameters live in CPU
//   memory keep nothing; a budget that holds some blocks keeps those only;
//   the planner counts what the engine adds to its plan; and a weight edit
//   or a checkpoint load between backward and the step is not stepped from
//   the copy backward kept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "../../engine/src/kept_params.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

using tz::MasterFormat;
using tz::Tier;

// ---- KeptParams alone --------------------------------------------------------

const std::vector<tz::BlockSpec> kBlocks = {{"a", {{"w", {4096}}}}, {"b", {{"w", {3000}}}}, {"c", {{"w", {6000}}}}};

struct Parts {
  std::unique_ptr<tz::Device> device = tz::create_host_device();
  std::unique_ptr<tz::Stream> stream = device->create_stream().value();
  std::unique_ptr<tz::MemoryPool> host_pool = tz::make_host_pool(*device, 8 << 20, {}).value();
  TempDir dir;
  std::unique_ptr<tz::nvme::SwapStore> swap =
      tz::nvme::SwapStore::create({.paths = {dir.path()}, .capacity_bytes = 4 << 20, .allow_buffered = true}).value();
  tz::NvmeTraffic traffic;
  tz::ModelLayout layout = tz::ModelLayout::make(kBlocks, 1, 0).value();
  std::unique_ptr<tz::TieredStore> param16;

  Parts() {
    std::vector<tz::ShardSpec> shards;
    for (const tz::BlockLayout& b : layout.blocks) shards.push_back({b.name, b.shard_numel});
    param16 = tz::TieredStore::create({.state = tz::StateClass::kParam16, .tier = Tier::kNvme, .elem_bytes = 2,
                                       .colour = tz::Colour::kParam16, .device = device.get(),
                                       .host_pool = host_pool.get(), .swap = swap.get(), .traffic = &traffic},
                                      shards)
                  .value();
  }
  std::vector<std::uint8_t> bytes(std::size_t b, int seed) const {
    std::vector<std::uint8_t> v(param16->shard_bytes(b));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>(i * 31 + seed * 7 + b);
    return v;
  }
  // What the prefetcher does: the shard read from NVMe into pool staging, with the version at the read's issue.
  void fetch_into(tz::detail::KeptParams& kept, std::size_t b) {
    tz::PoolBlock staging = host_pool->allocate(param16->shard_bytes(b)).value();
    const std::uint64_t version = param16->shard_version(b);
    ASSERT_TRUE(param16->read(b, staging.data()).wait().ok());
    kept.keep(b, std::move(staging), version);
  }
};

TEST(KeptParams, ACopyIsUsedOnlyWhileTheStoredShardIsUnchanged) {
  Parts p;
  for (std::size_t b = 0; b < 3; ++b) ASSERT_TRUE(p.param16->put(b, p.bytes(b, 1).data(), *p.stream).ok());
  tz::detail::KeptParams kept({.param16 = p.param16.get(), .layout = &p.layout}, {true, true, false});
  for (std::size_t b = 0; b < 3; ++b) p.fetch_into(kept, b);
  std::vector<std::uint8_t> out(p.param16->shard_bytes(0));
  ASSERT_TRUE(kept.copy_to(0, out.data()));
  EXPECT_EQ(out, p.bytes(0, 1));
  EXPECT_FALSE(kept.copy_to(2, out.data())) << "block 2 may not be kept";
  // Anything that rewrites the shard on its tier makes the copy stale, whatever the path.
  ASSERT_TRUE(p.param16->put(0, p.bytes(0, 2).data(), *p.stream).ok());
  EXPECT_FALSE(kept.copy_to(0, out.data())) << "a copy of the shard before put()";
  tz::PoolBlock value = p.host_pool->allocate(p.param16->shard_bytes(1)).value();
  std::memcpy(value.data(), p.bytes(1, 3).data(), p.param16->shard_bytes(1));
  std::vector<tz::nvme::IoFuture> writes;
  ASSERT_TRUE(p.param16->write_back(1, value.data(), *p.stream, writes).ok());
  for (auto& w : writes) ASSERT_TRUE(w.wait().ok());
  std::vector<std::uint8_t> out1(p.param16->shard_bytes(1));
  EXPECT_FALSE(kept.copy_to(1, out1.data())) << "a copy of the shard before write_back()";
  // A fetch after the change keeps the new bytes in place of the old copy.
  p.fetch_into(kept, 0);
  ASSERT_TRUE(kept.copy_to(0, out.data()));
  EXPECT_EQ(out, p.bytes(0, 2));
  const tz::detail::KeptCounts counts = kept.take_counts();
  EXPECT_EQ(counts.blocks, 2u);
  EXPECT_EQ(counts.bytes, 2 * p.param16->shard_bytes(0));
  EXPECT_EQ(counts.reread, 3u);
  kept.drop_all();
  EXPECT_FALSE(kept.copy_to(0, out.data()));
  EXPECT_EQ(kept.take_counts().reread, 1u);
}

TEST(KeptParams, TheBlocksKeptFillTheShareFromTheLastBlock) {
  Parts p;
  const std::uint64_t b1 = p.param16->shard_bytes(1), b2 = p.param16->shard_bytes(2);  // whole pages already
  const tz::detail::KeptChoice two = tz::detail::choose_kept_blocks(p.layout, *p.param16, b1 + b2 + 100);
  EXPECT_EQ(two.may, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(two.blocks, 2u);
  EXPECT_EQ(two.bytes, b1 + b2);
  EXPECT_EQ(tz::detail::choose_kept_blocks(p.layout, *p.param16, b2 - 1).blocks, 0u);
  EXPECT_EQ(tz::detail::choose_kept_blocks(p.layout, *p.param16, 1 << 30).blocks, 3u);
  const tz::ModelLayout persistent = tz::ModelLayout::make(kBlocks, 1, 5000).value();  // a and b persistent
  EXPECT_EQ(tz::detail::choose_kept_blocks(persistent, *p.param16, 1 << 30).may, (std::vector<bool>{false, false, true}));
}

// ---- in the engine -----------------------------------------------------------

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 43};
constexpr int kSteps = 22;

const Placement kNvmeParams[] = {
    {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},   // the main job's
    {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme},
    {Tier::kNvme, Tier::kCpu, Tier::kCpu, Tier::kCpu},     // the optimizer in CPU memory
};
const Placement kCpuParams = {Tier::kCpu, Tier::kCpu, Tier::kNvme, Tier::kNvme};

struct Arm {
  Placement placement;
  int gas = 2;
  tz::StepUnderBackward ahead = tz::StepUnderBackward::kOff;
  tz::MomentFormat moments = tz::MomentFormat::kFp32;
  double clip = 1.0;  // gradient_clipping (0: off)
};

tz::Config config_for(const std::string& nvme, const Arm& a) {
  tz::Config config = test_config(nvme, 3, a.gas);
  config.gradient_clipping = a.clip;
  config.states = {MasterFormat::kRemainder, a.moments};
  config.zero.sub_group_size = 12000;  // several sub-groups
  config.step_under_backward = a.ahead;
  return config;
}

struct Run {
  RunBits bits;
  std::vector<tz::StepReport> reports;  // the boundary micro-batches'
  std::uint64_t param_shard_bytes = 0;  // this rank's, every block
};

tz::Expected<Run> train(const std::string& nvme, const Arm& a, bool keep, tz::Communicator* comm = nullptr) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> e,
                      tz::ZeroEngine::create({.config = config_for(nvme, a), .comm = comm, .placement = a.placement,
                                              .keep_fetched_params = keep},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  Run run;
  for (const tz::BlockLayout& b : e->layout().blocks) run.param_shard_bytes += b.shard_numel * 2;
  for (int step = 0; step < kSteps; ++step) {
    for (int micro = 0; micro < a.gas; ++micro) {
      TZ_TRY(tz::mlp::train_micro_batch(*e, kMlp, tz::mlp::make_batch(kMlp, e->rank(), micro, step)).status());
      TZ_ASSIGN_OR_RETURN(tz::StepReport report, e->step());
      if (report.stepped) run.bits.grad_norms.push_back(report.grad_norm);
      if (micro + 1 == a.gas) run.reports.push_back(report);
    }
    TZ_ASSIGN_OR_RETURN(run.bits.masters.emplace_back(), master_bits(*e));
  }
  return run;
}

// The median gradient norm of the arm's run without clipping: as the max
// norm, it clips about half the steps (the norms are global: every rank's is the same).
tz::Expected<Arm> clipping_half(Arm a, tz::Communicator* comm = nullptr) {
  TempDir nvme;
  a.clip = 0;
  TZ_ASSIGN_OR_RETURN(Run run, train(nvme.path(), a, false, comm));
  a.clip = median_grad_norm(run.bits.grad_norms);
  return a;
}

// The kept run against the one that reads every shard again: the same bits,
// and per step the NVMe reads lower by exactly the bytes taken from kept
// copies, which are every shard the step took (each block's, once, or twice
// for a block stepped under backward and redone). Returns "" or what differs.
std::string compare(const Run& kept, const Run& again, bool params_on_nvme) {
  std::string diff = first_difference(kept.bits, again.bits);
  if (!diff.empty()) return diff;
  int clipped = 0;
  for (const tz::StepReport& r : kept.reports) clipped += r.clip_coef < 1.0;
  if (clipped == 0 || clipped == kSteps) return fmt::format("clipping bit on {} of {} steps", clipped, kSteps);
  for (std::size_t s = 0; s < kept.reports.size(); ++s) {
    const tz::StepReport &k = kept.reports[s], &a = again.reports[s];
    const std::uint64_t want = params_on_nvme ? kept.param_shard_bytes : 0;
    if ((params_on_nvme ? k.kept_param_bytes < want : k.kept_param_bytes != 0) || k.reread_param_blocks != 0 ||
        a.kept_param_bytes != 0) {
      return fmt::format("step {}: kept {} B of {} B of shards, {} blocks read again", s + 1, k.kept_param_bytes,
                         kept.param_shard_bytes, k.reread_param_blocks);
    }
    if (a.nvme_read_bytes - k.nvme_read_bytes != k.kept_param_bytes || a.nvme_write_bytes != k.nvme_write_bytes) {
      return fmt::format("step {}: NVMe reads {} vs {} B (kept {} B), writes {} vs {} B", s + 1, k.nvme_read_bytes,
                         a.nvme_read_bytes, k.kept_param_bytes, k.nvme_write_bytes, a.nvme_write_bytes);
    }
  }
  return "";
}

TEST(KeptParams, TrainingIsBitForBitAsReadingTheShardsAgainAndReadsLess) {
  std::vector<Arm> arms;
  for (const Placement& placement : kNvmeParams) {
    arms.push_back({placement, 2});
    arms.push_back({placement, 1});
  }
  arms.push_back({kNvmeParams[0], 2, tz::StepUnderBackward::kAlways});  // steps under backward, kept and redone
  arms.push_back({kNvmeParams[0], 1, tz::StepUnderBackward::kAuto, tz::MomentFormat::kInt8});
  arms.push_back({kCpuParams, 2});  // parameters in pinned CPU memory: stepped in place, nothing kept
  for (const Arm& unclipped : arms) {
    SCOPED_TRACE(fmt::format("{}, {} micro-batches, step_under_backward {}, moments {}",
                             placement_name(unclipped.placement), unclipped.gas,
                             tz::step_under_backward_name(unclipped.ahead), tz::moment_format_name(unclipped.moments)));
    const auto clipping = clipping_half(unclipped);
    ASSERT_TRUE(clipping.ok()) << clipping.status().to_string();
    const Arm& a = *clipping;
    TempDir nvme;
    const auto kept = train(nvme.path(), a, true);
    const auto again = train(nvme.path(), a, false);
    ASSERT_TRUE(kept.ok() && again.ok()) << (kept.ok() ? again.status() : kept.status()).to_string();
    const bool on_nvme = a.placement[0] == Tier::kNvme;
    EXPECT_EQ(compare(*kept, *again, on_nvme), "");
    if (a.ahead == tz::StepUnderBackward::kAlways) {
      std::uint64_t committed = 0, redone = 0;
      for (const tz::StepReport& r : kept->reports) committed += r.ahead_blocks, redone += r.ahead_redone;
      EXPECT_GT(committed, 0u);
      EXPECT_GT(redone, 0u);
    }
  }
}

TEST(KeptParams, TwoRanksTrainBitForBitAsReadingTheShardsAgain) {
  TempDir dir;
  const std::vector<int> codes = run_engine_ranks(2, dir.path(), [&](const tz::RankInfo& info, tz::Communicator* comm, const std::string& nvme) {
    int code = 0;
    for (const Arm& unclipped : {Arm{kNvmeParams[0], 2}, Arm{kNvmeParams[1], 1, tz::StepUnderBackward::kAlways}}) {
      const auto clipping = clipping_half(unclipped, comm);
      if (!clipping.ok()) return 1;
      const Arm& a = *clipping;
      const auto kept = train(nvme, a, true, comm);
      const auto again = train(nvme, a, false, comm);
      if (!kept.ok() || !again.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", info.rank, (kept.ok() ? again.status() : kept.status()).to_string().c_str());
        return 1;
      }
      const std::string diff = compare(*kept, *again, true);
      std::printf("[ kept ] rank %d, 2 ranks, %s, %d micro-batches: %s\n", info.rank,
                  placement_name(a.placement).c_str(), a.gas, diff.empty() ? "same bits, reads less" : diff.c_str());
      if (!diff.empty()) code = 2;
    }
    return code;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

// deepspeed_nvme_config (the main job's placement) with a remainder master
// and the steps under backward off.
tz::Config remainder_nvme_config(const std::string& nvme) {
  tz::Config config = deepspeed_nvme_config(nvme);
  config.states.master = MasterFormat::kRemainder;
  config.step_under_backward = tz::StepUnderBackward::kOff;
  return config;
}

std::uint64_t kept_item(const tz::Plan& plan) {
  for (const tz::NeedItem& i : plan.usage_of(Tier::kCpu).breakdown) {
    if (i.what.find("parameter shards kept for the step") != std::string::npos) return i.bytes;
  }
  return 0;
}

// The CPU tier's headroom holds two blocks' shards: those two are kept (the
// last two), the others read again; the bits do not change.
TEST(KeptParams, WhereTheBudgetHoldsSomeBlocksOnlyThoseAreKept) {
  TempDir nvme;
  tz::Config config = remainder_nvme_config(nvme.path());
  auto create = [&](bool keep) {
    return tz::ZeroEngine::create({.config = config, .keep_fetched_params = keep}, tz::mlp::model(kMlp),
                                  tz::mlp::init(kMlp));
  };
  auto probe = create(true);
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  const tz::TierUsage& planned = (*probe)->plan().usage_of(Tier::kCpu);
  const std::uint64_t without = planned.need_bytes - kept_item((*probe)->plan());
  const std::vector<tz::BlockLayout> blocks = (*probe)->layout().blocks;
  ASSERT_GE(blocks.size(), 3u);
  probe->reset();
  const std::uint64_t two = (blocks[blocks.size() - 1].shard_numel + blocks[blocks.size() - 2].shard_numel) * 2;
  config.tiers.cpu = tz::ByteBudget::of(without + two + 100);
  auto e = create(true);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(kept_item((*e)->plan()), two);
  EXPECT_NE((*e)->describe().find(fmt::format("2 of {} blocks' 16-bit shards are kept", blocks.size())),
            std::string::npos) << (*e)->describe();
  tz::StepReport last;
  for (int step = 0; step < 3; ++step) {
    const auto trained = tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step));
    ASSERT_TRUE(trained.ok()) << trained.status().to_string();
    auto r = (*e)->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    last = *r;
  }
  EXPECT_EQ(last.kept_param_blocks, 2u);
  EXPECT_EQ(last.kept_param_bytes, two);
  EXPECT_EQ(last.reread_param_blocks, blocks.size() - 2);
  EXPECT_LE(last.peak_cpu_bytes, last.cpu_budget_bytes);
}

// The planner (tierzero-estimate) counts what the engine adds to its plan:
// the same blocks, the same CPU memory but for the pool's page rounding, and
// the step's NVMe reads of those shards out of the traffic.
TEST(KeptParams, ThePlannerCountsWhatTheEngineAddsToItsPlan) {
  TempDir nvme;
  const tz::Config config = remainder_nvme_config(nvme.path());
  auto e = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const tz::Plan& engine_plan = (*e)->plan();
  const tz::ResolvedBudgets budgets = budgets_of(engine_plan);
  const auto plan = [&](bool keep) {
    tz::PlanInput in = tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets);
    in.keep_fetched_params = keep;
    return tz::plan_placement(in);
  };
  const auto planned = plan(true), unkept = plan(false);
  ASSERT_TRUE(planned.ok() && unkept.ok()) << planned.status().to_string();
  ASSERT_EQ(planned->tier, engine_plan.tier);
  const std::size_t blocks = (*e)->layout().blocks.size();
  EXPECT_EQ(planned->kept_param_blocks, blocks);
  EXPECT_EQ(planned->keepable_param_blocks, blocks);
  const std::uint64_t engine_cpu = kept_item(engine_plan), planned_cpu = kept_item(*planned);
  ASSERT_GT(planned_cpu, 0u);
  EXPECT_LE(planned_cpu, engine_cpu);
  EXPECT_LT(engine_cpu - planned_cpu, blocks * 4096) << engine_cpu << " vs " << planned_cpu;
  EXPECT_EQ(unkept->traffic.nvme_read_bytes - planned->traffic.nvme_read_bytes, planned_cpu);
  EXPECT_EQ(kept_item(*unkept), 0u);
  EXPECT_NE(tz::format_plan(*planned, tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets))
                .find(fmt::format("keeps from their fetch (remainder master): {} of {} blocks", blocks, blocks)),
            std::string::npos);
  // The engine's step takes them: its NVMe reads are the unkept plan's less the kept shards'.
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
    auto r = (*e)->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->kept_param_blocks, blocks);
  }
}

// Between backward (which kept the shards) and the step, the user rewrites a
// block's weights (set_master, what tierzero.torch's weight edits call), or
// loads a checkpoint: the step must rebuild the masters from the new 16-bit
// shards, not the kept ones. Each engine does the same thing beside one that
// keeps nothing; the weights after must be the same bits.
TEST(KeptParams, AWeightEditOrACheckpointLoadBeforeTheStepIsNotSteppedFromAStaleCopy) {
  for (const bool edit : {true, false}) {
    SCOPED_TRACE(edit ? "set_master between backward and step" : "load_checkpoint between backward and step");
    RunBits bits[2];
    std::uint64_t kept_after[2] = {0, 0}, reread_after[2] = {0, 0};
    for (const bool keep : {true, false}) {
      TempDir nvme, ckpt;
      const Arm arm{kNvmeParams[0], 1};
      auto e = tz::ZeroEngine::create({.config = config_for(nvme.path(), arm), .placement = arm.placement,
                                       .keep_fetched_params = keep},
                                      tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      ASSERT_TRUE(e.ok()) << e.status().to_string();
      ASSERT_TRUE(train_for_bits(**e, kMlp, 2, 1).ok());
      ASSERT_TRUE((*e)->save_checkpoint(ckpt.path()).ok());
      ASSERT_TRUE(train_for_bits(**e, kMlp, 2, 1).ok());  // the shards move on from the checkpoint's
      std::vector<std::vector<float>> edited;  // every other block's weights, scaled
      for (std::size_t b = 0; b < (*e)->layout().blocks.size(); b += 2) {
        auto master = (*e)->gather_master(b);
        ASSERT_TRUE(master.ok());
        for (float& x : *master) x = x * 1.5F + 0.01F;
        edited.push_back(std::move(*master));
      }
      ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 9)).ok());  // backward keeps
      if (edit) {
        for (std::size_t i = 0; i < edited.size(); ++i) {
          ASSERT_TRUE((*e)->set_master(2 * i, edited[i].data(), edited[i].size(), 0).ok());
        }
      } else {
        ASSERT_TRUE((*e)->load_checkpoint(ckpt.path()).ok());
      }
      auto r = (*e)->step();
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_TRUE(r->stepped);
      kept_after[keep] = r->kept_param_blocks;
      reread_after[keep] = r->reread_param_blocks;
      auto after = train_for_bits(**e, kMlp, 2, 1);
      ASSERT_TRUE(after.ok()) << after.status().to_string();
      bits[keep] = std::move(*after);
    }
    EXPECT_EQ(first_difference(bits[1], bits[0]), "");
    EXPECT_GT(reread_after[1], 0u) << "the kept run read the changed shards again";
    EXPECT_EQ(kept_after[0] + reread_after[0], 0u);
  }
}

}  // namespace
}  // namespace tzt
