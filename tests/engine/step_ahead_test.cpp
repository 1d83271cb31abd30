// Note [Stepping under backward] (engine/src/step_ahead.h): the CPU
// optimizer steps blocks under backward, and the weights after every step are
// the bits of stepping after backward (tierzero.step_under_backward false),
// on every placement, in bf16, fp16 and fp32, with clipping that clips on
// some steps and not on others, an fp16 overflow, a learning rate changed
// after backward, 1 and 2 ranks, an NVMe fault under backward, and a run
// stopped under backward (its checkpoints resume bit for bit).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>

#include "../../engine/src/step_ahead.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 4, .hidden = 64, .batch = 6, .seed = 31};
constexpr int kSteps = 22;
constexpr float kLoud = 30;
constexpr auto kAuto = tz::StepUnderBackward::kAuto;
constexpr auto kAlways = tz::StepUnderBackward::kAlways;
constexpr std::size_t kNoBlockFound = static_cast<std::size_t>(-1);

const Placement kPlacements[] = {
    {Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu},      // the Host backend's "device" memory: the CPU pass
    {Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},      // ZeRO-Offload
    {Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
    {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},   // ZeRO-Infinity
    {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme},  // the gradients on NVMe too
};
const Placement kInfinity = kPlacements[3];

struct AheadRun {
  RunBits bits;
  std::vector<tz::StepReport> reports;  // the boundary micro-batches'
};

struct Options {
  int steps = kSteps;
  int gas = 1;
  std::set<int> overflow_steps;   // fp16: an inf in block inf_block's gradient on these steps
  int inf_block = -1;
  std::set<int> new_lr_steps;     // set_learning_rate after backward on these steps
  std::set<int> new_decay_steps;  // set_weight_decay (block 1, parameter 0) after backward on these steps
  std::set<int> loud_steps;       // targets x kLoud: a gradient norm far above the quiet steps'
  std::function<void(int step)> before_last_micro;  // e.g. arms a fault
};

// Trains like train_for_bits, keeping the reports; masters after each step.
tz::Expected<AheadRun> train(tz::ZeroEngine& e, const Options& o) {
  AheadRun run;
  for (int step = 0; step < o.steps; ++step) {
    for (int micro = 0; micro < o.gas; ++micro) {
      const bool last = micro + 1 == o.gas;
      if (last && o.before_last_micro) o.before_last_micro(step);
      const bool inf = last && o.overflow_steps.count(step) != 0;
      tz::mlp::Batch batch = tz::mlp::make_batch(kMlp, e.rank(), micro, step);
      if (o.loud_steps.count(step) != 0) {
        for (float& t : batch.target) t *= kLoud;
      }
      TZ_TRY(tz::mlp::train_micro_batch(e, kMlp, batch, {}, inf, o.inf_block).status());
      if (last && o.new_lr_steps.count(step) != 0) TZ_TRY(e.set_learning_rate(1e-3 * (1 + 0.1 * step)));
      if (last && o.new_decay_steps.count(step) != 0) TZ_TRY(e.set_weight_decay(1, 0, 0.3 + 0.1 * step));
      TZ_ASSIGN_OR_RETURN(tz::StepReport report, e.step());
      if (report.stepped) run.bits.grad_norms.push_back(report.grad_norm);
      if (last) run.reports.push_back(report);
    }
    TZ_ASSIGN_OR_RETURN(run.bits.masters.emplace_back(), master_bits(e));
  }
  TZ_ASSIGN_OR_RETURN(run.bits.params, gathered_params(e));
  return run;
}

tz::Expected<std::unique_ptr<tz::ZeroEngine>> make(tz::Config config, const Placement& placement,
                                                   tz::StepUnderBackward mode, tz::Communicator* comm = nullptr,
                                                   tz::nvme::FaultInjector faults = {}) {
  config.step_under_backward = mode;
  // The calm and back-off rules alone: these tests count windows, and the
  // measured pace would depend on this machine's load.
  tz::ZeroOptions options{.config = config, .comm = comm, .placement = placement, .auto_ahead_by_pace = false};
  options.auto_ahead_min_block_numel = 0;  // the test MLP's blocks are small; the floor has its own test
  options.nvme_fault_injector = std::move(faults);
  return tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
}

tz::StepUnderBackward mode_of(bool ahead) { return ahead ? tz::StepUnderBackward::kAlways : tz::StepUnderBackward::kOff; }

tz::Expected<std::unique_ptr<tz::ZeroEngine>> make(const tz::Config& config, const Placement& placement, bool ahead,
                                                   tz::Communicator* comm = nullptr,
                                                   tz::nvme::FaultInjector faults = {}) {
  return make(config, placement, mode_of(ahead), comm, std::move(faults));
}

tz::Expected<AheadRun> train_new(const tz::Config& config, const Placement& placement, tz::StepUnderBackward mode,
                                 const Options& o, tz::Communicator* comm = nullptr) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> e, make(config, placement, mode, comm));
  return train(*e, o);
}

tz::Expected<AheadRun> train_new(const tz::Config& config, const Placement& placement, bool ahead, const Options& o,
                            tz::Communicator* comm = nullptr) {
  return train_new(config, placement, mode_of(ahead), o, comm);
}

// A max norm that clips some steps and not others: the median norm of a run
// without clipping.
double median_norm(tz::Config config, tz::Communicator* comm = nullptr) {
  config.gradient_clipping = 0;
  auto run = train_new(config, kPlacements[1], false, {.steps = kSteps}, comm);
  EXPECT_TRUE(run.ok()) << run.status().to_string();
  if (!run.ok()) return 1.0;
  return median_grad_norm(run->bits.grad_norms);
}

struct Tally {
  int clipped = 0, unclipped = 0;
  std::uint64_t kept = 0, redone = 0;
  double ahead_seconds = 0;
};

Tally tally(const AheadRun& run) {
  Tally t;
  for (const tz::StepReport& r : run.reports) {
    if (r.stepped) (r.clip_coef < 1.0 ? t.clipped : t.unclipped) += 1;
    t.kept += r.ahead_blocks;
    t.redone += r.ahead_redone;
    t.ahead_seconds += r.ahead_seconds;
    // A clipped step keeps nothing it stepped under backward.
    if (r.clip_coef < 1.0) {
      EXPECT_EQ(r.ahead_blocks, 0U) << "step " << r.step;
    }
  }
  return t;
}

TEST(StepAhead, EveryPlacementAndPrecisionIsBitIdenticalToSteppingAfterBackward) {
  struct Case {
    std::string precision;
    int gas;
    bool remainder;
    // bf16: stochastically rounded second moments, the same bits under backward;
    // int8: codes and block scales in one stored shard, on the second copy too.
    tz::MomentFormat moments = tz::MomentFormat::kFp32;
  };
  const Case cases[] = {{"bf16", 1, false}, {"fp16", 1, false}, {"fp32", 1, false}, {"bf16", 2, false},
                        {"bf16", 1, true},  {"bf16", 1, true, tz::MomentFormat::kBf16},
                        {"bf16", 1, true, tz::MomentFormat::kInt8}};
  for (const Case& c : cases) {
    TempDir nvme;
    tz::Config config = test_config(nvme.path(), 3, c.gas, c.precision);
    if (c.remainder) config.states.master = tz::MasterFormat::kRemainder;
    config.states.moments = c.moments;
    config.gradient_clipping = median_norm(config);
    for (const Placement& placement : kPlacements) {
      const std::string what = fmt::format("{}{}{}, gas {}, {}, max norm {:.4g}", c.precision,
                                           c.remainder ? " (remainder master)" : "",
                                           c.moments == tz::MomentFormat::kFp32
                                               ? std::string()
                                               : fmt::format(" ({} moments)", tz::moment_format_name(c.moments)),
                                           c.gas, placement_name(placement),
                                           config.gradient_clipping);
      SCOPED_TRACE(what);
      const Options o{.gas = c.gas};
      auto before = train_new(config, placement, false, o);
      ASSERT_TRUE(before.ok()) << before.status().to_string();
      auto ahead = train_new(config, placement, true, o);
      ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
      EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
      const Tally off = tally(*before), on = tally(*ahead);
      std::printf("[ ahead ] %-75s clipped %2d / %2d steps; blocks kept %3llu, redone %3llu\n", what.c_str(),
                  on.clipped, on.clipped + on.unclipped, static_cast<unsigned long long>(on.kept),
                  static_cast<unsigned long long>(on.redone));
      // Both kinds of step happened, and the speculation both held and was undone.
      EXPECT_GT(on.clipped, 0);
      EXPECT_GT(on.unclipped, 0);
      EXPECT_GT(on.kept, 0U);
      EXPECT_GT(on.redone, 0U);
      EXPECT_GT(on.ahead_seconds, 0.0);
      EXPECT_EQ(off.kept + off.redone, 0U);
      EXPECT_EQ(before->reports.front().ahead_off, "tierzero.step_under_backward is false");
      EXPECT_EQ(ahead->reports.front().ahead_off, "");
    }
  }
}

// The overflow lands in block 0, the last backward reaches: the blocks after
// it were stepped under backward by then, and are put back.
TEST(StepAhead, AnFp16OverflowUndoesTheStepsTakenUnderBackward) {
  for (const Placement& placement : {kPlacements[1], kInfinity}) {
    SCOPED_TRACE(placement_name(placement));
    TempDir nvme;
    tz::Config config = test_config(nvme.path(), 3, 1, "fp16");
    config.gradient_clipping = 0;  // nothing else stops the speculation
    const Options o{.overflow_steps = {4, 11}, .inf_block = 0};
    auto before = train_new(config, placement, false, o);
    ASSERT_TRUE(before.ok()) << before.status().to_string();
    auto ahead = train_new(config, placement, true, o);
    ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
    EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
    for (int step : {4, 11}) {
      const tz::StepReport& r = ahead->reports[step];
      EXPECT_TRUE(r.overflow) << "step " << step;
      EXPECT_FALSE(r.stepped) << "step " << step;
      EXPECT_EQ(r.ahead_blocks, 0U) << "step " << step;
      EXPECT_EQ(r.ahead_redone, static_cast<std::uint64_t>(kMlp.layers - 1)) << "step " << step;
    }
    EXPECT_GT(tally(*ahead).kept, 0U);
  }
}

// Every block kept, but on the `changed` steps every block redone, for a
// changed hyperparameter.
void expect_redone_only_on(const AheadRun& ahead, int steps, const std::set<int>& changed) {
  for (int step = 0; step < steps; ++step) {
    const tz::StepReport& r = ahead.reports[step];
    const bool redone = changed.count(step) != 0;
    EXPECT_EQ(r.ahead_blocks, redone ? 0U : static_cast<std::uint64_t>(kMlp.layers)) << "step " << step;
    EXPECT_EQ(r.ahead_redone, redone ? static_cast<std::uint64_t>(kMlp.layers) : 0U) << "step " << step;
    EXPECT_EQ(r.ahead_redo_reason, redone ? "hyperparameters" : "") << "step " << step;
  }
}

// set_learning_rate between backward and step: the steps taken under
// backward used the old rate, so every one is redone.
// The same bits as the switch-off engine, with every block redone on the
// `changed` steps and kept on the others.
void expect_exact_and_redone_only_on(const Placement& placement, const Options& o, const std::set<int>& changed) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  auto before = train_new(config, placement, false, o);
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  auto ahead = train_new(config, placement, true, o);
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
  EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
  expect_redone_only_on(*ahead, o.steps, changed);
}

TEST(StepAhead, ALearningRateSetAfterBackwardRedoesTheSteps) {
  expect_exact_and_redone_only_on(kInfinity, {.steps = 8, .new_lr_steps = {2, 5}}, {2, 5});
}

// An NVMe write that fails under backward (once): the block is put back,
// the step after backward takes it, and the run goes on to the same bits.
TEST(StepAhead, AnNvmeWriteFailingUnderBackwardIsRedoneAfterIt) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  auto before = train_new(config, kInfinity, false, {.steps = 6});
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  std::atomic<int> armed{0}, failed{0};
  auto faults = [&](const tz::nvme::PieceInfo& p) {
    if (p.op != tz::nvme::IoOp::kWrite || armed.load() == 0) return tz::nvme::Fault{};
    armed = 0;  // the first write once armed: a state of the first block stepped under backward
    ++failed;
    return tz::nvme::Fault{.error = EIO};
  };
  auto e = make(config, kInfinity, true, nullptr, faults);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  auto ahead = train(**e, {.steps = 6, .before_last_micro = [&](int step) { armed = step == 3 ? 1 : 0; }});
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
  EXPECT_EQ(failed.load(), 1);
  EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
  EXPECT_EQ(ahead->reports[3].ahead_blocks, 0U);
  EXPECT_GE(ahead->reports[3].ahead_redone, 1U);
  EXPECT_EQ(ahead->reports[4].ahead_blocks, static_cast<std::uint64_t>(kMlp.layers));
}

// Note [Committing steps under backward] (engine/src/optimizer_pass.cpp): a
// kept window's blocks commit together. With the 16-bit parameters on the
// (Host backend's) GPU tier, the commit's copies settle with one host wait,
// as run() settles its one sub-group's, so a kept step waits as often as
// the switch-off engine's (a wait per block before: 3 more here); on NVMe
// it writes the bytes the switch-off engine writes. Bits equal.
TEST(StepAhead, AKeptWindowCommitsItsBlocksTogetherAndWritesWhatStepsAfterBackwardWrite) {
  for (const Placement& placement : {kPlacements[1], kInfinity}) {
    SCOPED_TRACE(placement_name(placement));
    TempDir nvme;
    tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
    config.gradient_clipping = 0;
    const Options o{.steps = 6};
    auto before = train_new(config, placement, false, o);
    ASSERT_TRUE(before.ok()) << before.status().to_string();
    auto ahead = train_new(config, placement, true, o);
    ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
    EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
    std::vector<std::int64_t> more_waits;  // per step, on's host waits less off's
    for (int step = 1; step < o.steps; ++step) {  // step 0's report has the first fetches' waits
      const tz::StepReport &off = before->reports[step], &on = ahead->reports[step];
      ASSERT_EQ(on.ahead_blocks, static_cast<std::uint64_t>(kMlp.layers)) << "step " << step;
      EXPECT_EQ(on.nvme_write_bytes, off.nvme_write_bytes) << "step " << step;
      more_waits.push_back(static_cast<std::int64_t>(on.host_waits) - static_cast<std::int64_t>(off.host_waits));
    }
    // A fetch may wait once more or less where a prefetch is late (a loaded
    // machine), so the median step's count is the commit's.
    if (placement[0] != Tier::kGpu) continue;
    std::nth_element(more_waits.begin(), more_waits.begin() + more_waits.size() / 2, more_waits.end());
    EXPECT_EQ(more_waits[more_waits.size() / 2], 0) << "host waits a kept step adds to the switch-off engine's";
  }
}

// An NVMe write of the 16-bit parameters failing in a kept window's commit:
// step() fails naming the block; the other blocks are committed (the
// switch-off engine's bits after the step), and the failed block's new
// master and moments are taken with them, so what reads is the step's and
// its parameters read as an error, not as the old ones beside a new master.
TEST(StepAhead, AParameterWriteFailingInTheCommitIsReportedAndReadsAsAnError) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  constexpr int kFailStep = 3;
  auto before = train_new(config, kInfinity, false, {.steps = kFailStep + 1});
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  std::atomic<bool> armed{false};
  std::atomic<int> failed{0};
  std::uint64_t shard_numel = 0;  // the MLP's blocks are alike
  auto faults = [&](const tz::nvme::PieceInfo& p) {
    // A 16-bit shard's write (shorter than an fp32 master's), once armed.
    const bool param16 = p.length >= shard_numel * 2 && p.length < shard_numel * 4;
    if (p.op != tz::nvme::IoOp::kWrite || !param16 || !armed.exchange(false)) return tz::nvme::Fault{};
    ++failed;
    return tz::nvme::Fault{.error = EIO};
  };
  auto e = make(config, kInfinity, true, nullptr, faults);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  tz::ZeroEngine& engine = **e;
  shard_numel = engine.layout().blocks[0].shard_numel;
  auto first = train(engine, {.steps = kFailStep});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(tz::mlp::train_micro_batch(engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, kFailStep)).ok());
  armed = true;  // backward's writes are the master's and moments'; the commit's are the parameters'
  auto r = engine.step();
  ASSERT_FALSE(r.ok()) << "the step must fail";
  EXPECT_EQ(failed.load(), 1);
  EXPECT_EQ(r.status().code(), tz::ErrorCode::kIoError) << r.status().to_string();
  const std::string message = r.status().message();
  EXPECT_NE(message.find(fmt::format("1 of {} blocks stepped under backward", kMlp.layers)), std::string::npos)
      << message;
  std::size_t bad = kNoBlockFound;
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    if (message.find("(" + engine.layout().blocks[b].name + ")") != std::string::npos) bad = b;
  }
  ASSERT_NE(bad, kNoBlockFound) << "names the block: " << message;
  std::printf("[ commit ] %s\n", message.c_str());
  const std::vector<std::uint32_t>& want = before->bits.masters[kFailStep];
  std::size_t at = 0;
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    SCOPED_TRACE(engine.layout().blocks[b].name);
    auto master = engine.gather_master(b);
    ASSERT_TRUE(master.ok()) << master.status().to_string();
    EXPECT_EQ(std::memcmp(master->data(), want.data() + at, master->size() * 4), 0) << "the step's master";
    at += master->size();
  }
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    if (b == bad) continue;  // last: a failed fetch is the engine's failure from then on
    SCOPED_TRACE(engine.layout().blocks[b].name);
    auto params = engine.fetch(b, tz::FetchFor::kEvaluation);
    ASSERT_TRUE(params.ok()) << params.status().to_string();
    const std::vector<std::uint8_t>& bits = before->bits.params[b];
    EXPECT_EQ(std::memcmp(params->data(), bits.data(), bits.size()), 0) << "the step's parameters";
  }
  auto params = engine.fetch(bad, tz::FetchFor::kEvaluation);
  ASSERT_FALSE(params.ok()) << "the failed write's parameters read as an error";
  EXPECT_NE(params.status().message().find("last write failed"), std::string::npos) << params.status().to_string();
}

// A checkpoint saved between backward and step holds the states before the
// step (the speculation is undone first), and a run stopped under backward
// leaves its checkpoints loadable: both resume to the unbroken run's bits.
TEST(StepAhead, ARunStoppedUnderBackwardResumesFromItsCheckpointsBitForBit) {
  TempDir nvme, ckpt;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  auto unbroken = train_new(config, kInfinity, false, {.steps = 6});
  ASSERT_TRUE(unbroken.ok()) << unbroken.status().to_string();
  {
    auto e = make(config, kInfinity, true);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    auto first = train(**e, {.steps = 3});
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    ASSERT_TRUE((*e)->save_checkpoint(ckpt.path(), {.tag = "after-3"}).ok());
    // Step 4's backward: every block steps under backward; the save puts them back.
    ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 3)).ok());
    auto saved = (*e)->save_checkpoint(ckpt.path(), {.tag = "mid-backward"});
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
    auto r = (*e)->step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->ahead_blocks, 0U);
    EXPECT_EQ(r->ahead_redone, static_cast<std::uint64_t>(kMlp.layers));
    // Step 5's backward, then the run stops (the engine goes, no step).
    ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 4)).ok());
  }
  for (const std::string tag : {"after-3", "mid-backward"}) {
    SCOPED_TRACE(tag);
    auto e = make(config, kInfinity, true);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    auto loaded = (*e)->load_checkpoint(ckpt.path(), {.tag = tag});
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    ASSERT_EQ((*e)->optimizer_steps(), 3);
    // Steps 3..5 (data of steps 3, 4, 5), as the unbroken run took them.
    for (int step = 3; step < 6; ++step) {
      ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
      auto r = (*e)->step();
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ(r->ahead_blocks, static_cast<std::uint64_t>(kMlp.layers));
      const auto bits = master_bits(**e);
      ASSERT_TRUE(bits.ok()) << bits.status().to_string();
      EXPECT_TRUE(*bits == unbroken->bits.masters[step]) << "after step " << step + 1;
    }
  }
}


// Where the CPU tier's headroom holds no slot, the step runs after backward
// and the report says why, with the numbers.
TEST(StepAhead, WhereItDoesNotFitTheBudgetTheStepRunsAfterBackwardAndSaysWhy) {
  TempDir nvme;
  // The config's own placement (the plan's numbers are its): params and optimizer on NVMe.
  tz::Config config = deepspeed_nvme_config(nvme.path());
  auto create = [&](bool ahead) {
    config.step_under_backward = mode_of(ahead);
    return tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  };
  auto probe = create(true);
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  const tz::TierUsage& planned = (*probe)->plan().usage_of(Tier::kCpu);
  const auto item = std::find_if(planned.breakdown.begin(), planned.breakdown.end(), [](const tz::NeedItem& i) {
    return i.what.find("steps under backward") != std::string::npos;
  });
  ASSERT_NE(item, planned.breakdown.end()) << "the plan counts the steps under backward";
  const std::uint64_t ahead_bytes = item->bytes;  // the plan goes with the engine
  const std::uint64_t without = planned.need_bytes - ahead_bytes;
  probe->reset();
  ASSERT_GT(ahead_bytes, 256U * 1024) << "the test needs a first block dearer than the slack below";
  config.tiers.cpu = tz::ByteBudget::of(without + 128 * 1024);  // room for the engine, not for a block ahead
  auto e = create(true);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  auto run = train(**e, {.steps = 2});
  ASSERT_TRUE(run.ok()) << run.status().to_string();
  const std::string& why = run->reports[0].ahead_off;
  EXPECT_NE(why.find("headroom"), std::string::npos) << why;
  EXPECT_EQ(run->reports[0].ahead_blocks + run->reports[1].ahead_blocks, 0U);
}

// The planner (tierzero-estimate) counts what the engine adds to its plan for
// the steps under backward: the same second NVMe copy, and the same CPU
// memory but for the host pool's page rounding of each buffer.
TEST(StepAhead, ThePlannerCountsWhatTheEngineAddsToItsPlan) {
  TempDir nvme;
  tz::Config config = deepspeed_nvme_config(nvme.path());
  config.step_under_backward = kAlways;
  auto e = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const tz::Plan& engine_plan = (*e)->plan();
  const tz::ResolvedBudgets budgets = budgets_of(engine_plan);
  auto planned = tz::plan_placement(tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets));
  ASSERT_TRUE(planned.ok()) << planned.status().to_string();
  EXPECT_EQ(planned->tier, engine_plan.tier);
  EXPECT_EQ(planned->ahead_blocks, (*e)->layout().blocks.size());
  const auto item = [](const tz::Plan& plan, Tier t) -> std::uint64_t {
    for (const tz::NeedItem& i : plan.usage_of(t).breakdown) {
      if (i.what.find("steps under backward") != std::string::npos) return i.bytes;
    }
    return 0;
  };
  EXPECT_GT(item(*planned, Tier::kNvme), 0U);
  EXPECT_EQ(item(*planned, Tier::kNvme), item(engine_plan, Tier::kNvme));
  const std::uint64_t engine_cpu = item(engine_plan, Tier::kCpu), planned_cpu = item(*planned, Tier::kCpu);
  ASSERT_GT(planned_cpu, 0U);
  EXPECT_LE(planned_cpu, engine_cpu);
  const std::uint64_t buffers = (*e)->layout().blocks.size() + 3 * 3;  // a slot per block, three staging sets of three stores
  EXPECT_LT(engine_cpu - planned_cpu, buffers * 4096) << engine_cpu << " vs " << planned_cpu;
  // Off: neither counts it.
  config.step_under_backward = tz::StepUnderBackward::kOff;
  auto off = tz::plan_placement(tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets));
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(item(*off, Tier::kCpu) + item(*off, Tier::kNvme), 0U);
  // "auto" on this model, whose blocks are all under its floor: neither counts it either.
  config.step_under_backward = tz::StepUnderBackward::kAuto;
  auto e_auto = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  auto planned_auto = tz::plan_placement(tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets));
  ASSERT_TRUE(e_auto.ok() && planned_auto.ok());
  EXPECT_EQ(planned_auto->ahead_blocks, 0U);
  EXPECT_NE(planned_auto->ahead_off.find("\"auto\""), std::string::npos) << planned_auto->ahead_off;
  EXPECT_EQ(item(*planned_auto, Tier::kCpu) + item(*planned_auto, Tier::kNvme), 0U);
  EXPECT_EQ(item((*e_auto)->plan(), Tier::kCpu) + item((*e_auto)->plan(), Tier::kNvme), 0U);
}

// 2 ranks (processes): each steps its shards under backward; the global norm
// decides for both. A run with the switch off first, then on, in each rank.
TEST(StepAhead, TwoRanksAreBitIdenticalToSteppingAfterBackward) {
  TempDir dir;
  const std::vector<int> codes = run_engine_ranks(2, dir.path(), [&](const tz::RankInfo& info, tz::Communicator* comm, const std::string& nvme) {
    int code = 0;
    for (const std::string precision : {"bf16", "fp16"}) {
      tz::Config config = test_config(nvme, 3, 2, precision);
      config.gradient_clipping = median_norm(config, comm);
      for (const Placement& placement : {kPlacements[1], kInfinity}) {
        auto before = train_new(config, placement, false, {.gas = 2}, comm);
        auto ahead = train_new(config, placement, true, {.gas = 2}, comm);
        if (!before.ok() || !ahead.ok()) {
          std::fprintf(stderr, "rank %d: %s %s\n", info.rank, before.status().to_string().c_str(),
                       ahead.status().to_string().c_str());
          return 1;
        }
        const std::string diff = first_difference(before->bits, ahead->bits);
        const Tally t = tally(*ahead);
        std::printf("[ ahead ] rank %d, 2 ranks, %s, %-55s clipped %d/%d, kept %llu, redone %llu %s\n", info.rank,
                    precision.c_str(), placement_name(placement).c_str(), t.clipped, t.clipped + t.unclipped,
                    static_cast<unsigned long long>(t.kept), static_cast<unsigned long long>(t.redone), diff.c_str());
        if (!diff.empty()) code = 2;
        if (t.clipped == 0 || t.unclipped == 0 || t.kept == 0) code = 3;
      }
    }
    return code;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}


// ---- Note [When to speculate] and Note [What a redo costs] ------------------


// A max norm ten times the largest norm of a run without clipping: quiet
// steps stay far below it, loud ones (targets x kLoud) above it.
double roomy_max_norm(tz::Config config, const Options& o) {
  config.gradient_clipping = 0;
  Options quiet = o;
  quiet.loud_steps.clear();
  auto run = train_new(config, kPlacements[1], false, quiet);
  EXPECT_TRUE(run.ok()) << run.status().to_string();
  if (!run.ok()) return 1.0;
  return 10 * *std::max_element(run->bits.grad_norms.begin(), run->bits.grad_norms.end());
}

// "auto" under a roomy max norm, beside the switch-off engine: its run,
// checked bit for bit against the other's.
struct AutoRun {
  AheadRun run;
  double max_norm = 0;
};

tz::Expected<AutoRun> auto_beside_off(const Placement& placement, const Options& o) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = roomy_max_norm(config, o);
  TZ_ASSIGN_OR_RETURN(AheadRun before, train_new(config, placement, false, o));
  TZ_ASSIGN_OR_RETURN(AheadRun ahead, train_new(config, placement, kAuto, o));
  EXPECT_EQ(first_difference(before.bits, ahead.bits), "");
  return AutoRun{std::move(ahead), config.gradient_clipping};
}

std::uint64_t redone_bytes(const tz::StepReport& r) { return r.ahead_redone_read_bytes + r.ahead_redone_write_bytes; }

// The policy alone: calm windows, the margin, the back-off and its reset.
TEST(StepAhead, AheadPolicyWaitsForCalmWindowsAndBacksOffAfterRedos) {
  using tz::detail::AheadPolicy;
  using tz::detail::AheadRedo;
  std::string why;
  AheadPolicy always(true);
  always.record(true, false, 5.0, 1.0, true, AheadRedo::kClip);
  EXPECT_TRUE(always.speculate(why));
  AheadPolicy p(false);
  EXPECT_FALSE(p.speculate(why));  // no history yet
  p.record(true, false, 0.5, 1.0, false, AheadRedo::kNone);
  EXPECT_FALSE(p.speculate(why));
  p.record(true, false, 1.25, 1.0, false, AheadRedo::kNone);  // clipped: not calm
  EXPECT_FALSE(p.speculate(why));
  EXPECT_NE(why.find("norm 1.25 was above 1"), std::string::npos) << why;
  p.record(true, false, 1.0, 1.0, false, AheadRedo::kNone);  // at the max norm: calm
  p.record(false, true, INFINITY, 1.0, false, AheadRedo::kNone);  // an overflow
  EXPECT_FALSE(p.speculate(why));
  EXPECT_NE(why.find("overflowed"), std::string::npos) << why;
  p.record(true, false, 0.5, 0.0, false, AheadRedo::kNone);  // clipping off: every stepped window is calm
  p.record(true, false, 50, 0.0, false, AheadRedo::kNone);
  ASSERT_TRUE(p.speculate(why));
  // Redone for a changed learning rate: skip 1, then 3, then 7 windows; a cancel counts for nothing.
  std::vector<int> opened;
  for (int w = 0; w < 16; ++w) {
    const bool s = p.speculate(why);
    if (s) opened.push_back(w);
    p.record(true, false, 0.1, 1.0, s, s ? (w == 2 ? AheadRedo::kCancel : AheadRedo::kHyperparameters)
                                           : AheadRedo::kNone);
  }
  EXPECT_EQ(opened, (std::vector<int>{0, 2, 3, 7, 15}));
  p.record(true, false, 0.1, 1.0, true, AheadRedo::kNone);  // a kept window resets the back-off
  p.record(true, false, 0.1, 1.0, true, AheadRedo::kHyperparameters);
  EXPECT_FALSE(p.speculate(why));
  EXPECT_NE(why.find("1 more window"), std::string::npos) << why;
}

// Note [When to speculate], the measured pace: "auto" stops speculating
// where its kept windows were slower than those after backward, says so,
// and probes again kSlowSkip windows later; where they were not, it goes on.
TEST(StepAhead, AheadPolicyStopsWhereSpeculatingMeasuredSlower) {
  using tz::detail::AheadPolicy;
  using tz::detail::AheadRedo;
  std::string why;
  // One window of the run: what the policy decides, then `seconds` as its pace.
  auto window = [&](AheadPolicy& p, double after_s, double ahead_s) {
    const bool s = p.speculate(why);
    p.record(true, false, 0.5, 0.0, s, AheadRedo::kNone);
    p.record_pace(s ? ahead_s : after_s, true, s, AheadRedo::kNone);
    return s;
  };
  AheadPolicy slow(false);
  slow.record_pace(0, true, false, AheadRedo::kNone);  // the first window: no pace
  std::vector<bool> opened;
  for (int w = 0; w < 4; ++w) opened.push_back(window(slow, w == 0 ? 9.0 : 1.59, w == 2 ? 9.0 : 2.42));
  EXPECT_EQ(opened, (std::vector<bool>{false, false, true, true}));  // two calm windows, then the probe
  EXPECT_FALSE(slow.speculate(why));
  EXPECT_NE(why.find("measured slower here (2.420 s a step against 1.590 s after backward): 63 more"),
            std::string::npos) << why;
  int after = 0;
  while (!window(slow, 1.59, 2.42)) ++after;
  EXPECT_EQ(after, AheadPolicy::kSlowSkip);  // then it probes again, and finds it slower again
  EXPECT_TRUE(window(slow, 1.59, 2.42));
  EXPECT_FALSE(slow.speculate(why));
  // Faster, or within the margin: it keeps speculating.
  for (double ahead_s : {1.0, 1.59 * (1 + AheadPolicy::kSlowerMargin) * 0.999}) {
    AheadPolicy fast(false);
    int kept = 0;
    for (int w = 0; w < 12; ++w) kept += window(fast, 1.59, ahead_s) ? 1 : 0;
    EXPECT_EQ(kept, 12 - AheadPolicy::kCalmWindows) << ahead_s;
  }
  // Judged once a run of speculating windows: slower windows later on do not stop it.
  {
    AheadPolicy judged(false);
    for (int w = 0; w < 4; ++w) window(judged, 1.59, 1.6);
    EXPECT_TRUE(window(judged, 1.59, 5.0));
    EXPECT_TRUE(window(judged, 1.59, 5.0));
    EXPECT_TRUE(judged.speculate(why));
  }
  // A window that did not step (an overflow: no optimizer) is no baseline.
  {
    AheadPolicy overflowed(false);
    overflowed.record(true, false, 0.5, 0.0, false, AheadRedo::kNone);
    overflowed.record_pace(1.59, true, false, AheadRedo::kNone);
    overflowed.record(false, true, INFINITY, 0.0, false, AheadRedo::kNone);
    overflowed.record_pace(0.5, false, false, AheadRedo::kNone);
    for (int w = 0; w < 2; ++w) EXPECT_FALSE(window(overflowed, 1.59, 1.6));  // calm again
    for (int w = 0; w < 4; ++w) EXPECT_TRUE(window(overflowed, 1.59, 1.6)) << w;
  }
  // true speculates whatever the pace.
  AheadPolicy always(true);
  for (int w = 0; w < 6; ++w) EXPECT_TRUE(window(always, 1.0, 5.0));
}

// Steps that clip and steps that do not, alternating: "auto" never finds two
// calm windows in a row, so it never steps under backward and undoes
// nothing; the weights are the switch-off engine's.
TEST(StepAhead, AutoDoesNotSpeculateWhereStepsAlternateBetweenClippingAndNot) {
  Options o{.steps = 12};
  for (int step = 1; step < o.steps; step += 2) o.loud_steps.insert(step);
  auto ahead = auto_beside_off(kInfinity, o);
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
  for (int step = 0; step < o.steps; ++step) {
    const tz::StepReport& r = ahead->run.reports[step];
    // The sequence is what the test means: loud steps clip, quiet ones are calm.
    if (o.loud_steps.count(step) != 0) {
      ASSERT_LT(r.clip_coef, 1.0) << "step " << step;
    } else {
      ASSERT_LE(r.grad_norm, 0.5 * ahead->max_norm) << "step " << step;
    }
    EXPECT_EQ(r.ahead_blocks, 0U) << "step " << step;
    EXPECT_EQ(r.ahead_redone, 0U) << "step " << step;
    EXPECT_EQ(redone_bytes(r), 0U) << "step " << step;
    EXPECT_EQ(r.ahead_seconds, 0.0) << "step " << step;
    EXPECT_EQ(r.ahead_redo_reason, "") << "step " << step;
    EXPECT_EQ(r.ahead_off.rfind("auto: ", 0), 0U) << "step " << step << ": " << r.ahead_off;
  }
}

// Nothing clips: "auto" steps under backward from its third window on and
// keeps every block; the first two step after backward and say why.
TEST(StepAhead, AutoSpeculatesAndKeepsEveryBlockWhereNothingClips) {
  for (const Placement& placement : {kPlacements[1], kInfinity}) {
    SCOPED_TRACE(placement_name(placement));
    const Options o{.steps = 8};
    auto ahead = auto_beside_off(placement, o);
    ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
    for (int step = 0; step < o.steps; ++step) {
      const tz::StepReport& r = ahead->run.reports[step];
      const bool speculates = step >= tz::detail::AheadPolicy::kCalmWindows;
      EXPECT_EQ(r.ahead_blocks, speculates ? static_cast<std::uint64_t>(kMlp.layers) : 0U) << "step " << step;
      EXPECT_EQ(r.ahead_redone, 0U) << "step " << step;
      EXPECT_EQ(redone_bytes(r), 0U) << "step " << step;
      EXPECT_EQ(r.ahead_off.empty(), speculates) << "step " << step << ": " << r.ahead_off;
    }
  }
}

// A learning rate set after every backward undoes every speculation: "auto"
// backs off, speculating in windows 2, 4, 8 and 16 only (1, 3, 7 windows
// skipped after each failure), where true speculates in all 19. Each redone
// window's report counts what the speculation moved on NVMe: exactly the
// writes the switch-off engine did not make.
// With the default floor, "auto" leaves the test MLP's blocks (a few
// thousand elements) to after backward and says why; true steps them.
TEST(StepAhead, AutoLeavesBlocksBelowTheFloorToAfterBackwardAndSaysWhy) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  config.step_under_backward = kAuto;
  tz::ZeroOptions options{.config = config, .placement = kInfinity, .auto_ahead_by_pace = false};
  ASSERT_EQ(options.auto_ahead_min_block_numel, tz::ZeroOptions::kAutoAheadMinBlockNumel);
  auto e = tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  auto run = train(**e, {.steps = 6});
  ASSERT_TRUE(run.ok()) << run.status().to_string();
  for (const tz::StepReport& r : run->reports) {
    EXPECT_EQ(r.ahead_blocks, 0U);
    EXPECT_NE(r.ahead_off.find("steps blocks of at least 1048576 elements"), std::string::npos) << r.ahead_off;
  }
  // A floor at the blocks' shard size (the MLP's are all alike): every block steps under backward.
  std::uint64_t smallest = UINT64_MAX;
  for (const tz::BlockLayout& b : (*e)->layout().blocks) smallest = std::min(smallest, b.shard_numel);
  options.auto_ahead_min_block_numel = smallest;
  auto all = tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  auto kept_run = train(**all, {.steps = 6});
  ASSERT_TRUE(kept_run.ok()) << kept_run.status().to_string();
  EXPECT_EQ(first_difference(run->bits, kept_run->bits), "");
  std::uint64_t kept = 0;
  for (const tz::StepReport& r : kept_run->reports) {
    kept += r.ahead_blocks;
    EXPECT_EQ(r.ahead_off.find("steps blocks of at least"), std::string::npos) << r.ahead_off;  // the policy's waits may show
  }
  EXPECT_GT(kept, 0U);
}

TEST(StepAhead, AutoBacksOffWhenTheLearningRateChangesAfterEveryBackward) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  config.gradient_clipping = 0;
  Options o{.steps = 20};
  for (int step = 1; step < o.steps; ++step) o.new_lr_steps.insert(step);  // step 0's rate is the config's
  auto before = train_new(config, kInfinity, false, o);
  ASSERT_TRUE(before.ok()) << before.status().to_string();
  auto always = train_new(config, kInfinity, kAlways, o);
  ASSERT_TRUE(always.ok()) << always.status().to_string();
  auto ahead = train_new(config, kInfinity, kAuto, o);
  ASSERT_TRUE(ahead.ok()) << ahead.status().to_string();
  EXPECT_EQ(first_difference(before->bits, always->bits), "");
  EXPECT_EQ(first_difference(before->bits, ahead->bits), "");
  std::set<int> speculated;
  for (int step = 1; step < o.steps; ++step) {
    const tz::StepReport& off = before->reports[step];
    for (const tz::StepReport* r : {&always->reports[step], &ahead->reports[step]}) {
      EXPECT_EQ(r->ahead_blocks, 0U) << "step " << step;
      if (r->ahead_redone == 0) continue;
      EXPECT_EQ(r->ahead_redone, static_cast<std::uint64_t>(kMlp.layers)) << "step " << step;
      EXPECT_EQ(r->ahead_redo_reason, "hyperparameters") << "step " << step;
      EXPECT_GT(r->ahead_redone_seconds, 0.0) << "step " << step;
      EXPECT_GT(r->ahead_redone_write_bytes, 0U) << "step " << step;
      EXPECT_EQ(r->nvme_write_bytes - off.nvme_write_bytes, r->ahead_redone_write_bytes) << "step " << step;
      // It read the master and moments it wrote (when the reads land is the prefetcher's, so no difference here).
      EXPECT_EQ(r->ahead_redone_read_bytes, r->ahead_redone_write_bytes) << "step " << step;
    }
    EXPECT_EQ(always->reports[step].ahead_redone, static_cast<std::uint64_t>(kMlp.layers)) << "step " << step;
    if (ahead->reports[step].ahead_redone > 0) speculated.insert(step);
  }
  EXPECT_EQ(speculated, (std::set<int>{2, 4, 8, 16}));
}

// set_weight_decay between backward and step: the blocks stepped under
// backward took the old value, so they are undone (at once) and stepped
// after backward with the new one.
TEST(StepAhead, AWeightDecaySetAfterBackwardRedoesTheSteps) {
  for (const Placement& placement : {kPlacements[2], kInfinity}) {
    SCOPED_TRACE(placement_name(placement));
    expect_exact_and_redone_only_on(placement, {.steps = 8, .new_decay_steps = {2, 5}}, {2, 5});
  }
}

// The reasons the report gives: an overflow, a checkpoint saved mid-window.
TEST(StepAhead, TheReportSaysWhyTheStepsWereRedone) {
  TempDir nvme, ckpt;
  tz::Config config = test_config(nvme.path(), 3, 1, "fp16");
  config.gradient_clipping = 0;
  auto overflow = train_new(config, kInfinity, true, {.steps = 4, .overflow_steps = {2}, .inf_block = 0});
  ASSERT_TRUE(overflow.ok()) << overflow.status().to_string();
  EXPECT_EQ(overflow->reports[2].ahead_redo_reason, "overflow");
  EXPECT_GT(redone_bytes(overflow->reports[2]), 0U);
  EXPECT_EQ(overflow->reports[3].ahead_redo_reason, "");
  auto e = make(config, kInfinity, true);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  ASSERT_TRUE(tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 0)).ok());
  ASSERT_TRUE((*e)->save_checkpoint(ckpt.path(), {.tag = "mid-backward"}).ok());
  auto r = (*e)->step();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->ahead_redo_reason, "cancel");
  EXPECT_EQ(r->ahead_redone, static_cast<std::uint64_t>(kMlp.layers));
  EXPECT_GT(redone_bytes(*r), 0U);
}

}  // namespace
}  // namespace tzt
