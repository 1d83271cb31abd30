// Note [The next forward's fetches under the optimizer] (engine/src/prefetch.h):
// the next forward's first fetches are issued as the CPU optimizer pass
// writes their blocks' new parameters. Training with it is training without
// it, bit for bit (masters after every step, the gathered 16-bit parameters,
// the gradient norms) on every placement, with and without steps under
// backward, gradient accumulation, clipping that bites on some steps, fp16
// with an overflow, a remainder master, and on 2 ranks; each arm must also
// have issued fetches while the pass still had sub-groups to step, or it
// tested nothing. A read that overtook its block's write would fetch the
// last step's parameters, and the forward would differ.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 6, .hidden = 64, .batch = 6, .seed = 91};
constexpr int kSteps = 20;

struct Arm {
  Placement placement;
  int gas = 1;
  tz::StepUnderBackward ahead = tz::StepUnderBackward::kOff;
  tz::MasterFormat master = tz::MasterFormat::kFp32;
  std::string precision = "bf16";
  double clip = 1.0;  // gradient_clipping (0: off)
};

std::string describe(const Arm& a) {
  return fmt::format("{}, {} micro-batches, step_under_backward {}, master {}, {}, clip {}",
                     placement_name(a.placement), a.gas, tz::step_under_backward_name(a.ahead),
                     a.master == tz::MasterFormat::kRemainder ? "remainder" : "fp32", a.precision, a.clip);
}

tz::Config config_for(const std::string& nvme, const Arm& a) {
  tz::Config config = test_config(nvme, 3, a.gas, a.precision);
  config.gradient_clipping = a.clip;
  config.states.master = a.master;
  config.zero.sub_group_size = 4200;  // one block (4160 elements) a sub-group
  config.step_under_backward = a.ahead;
  return config;
}

struct Run {
  RunBits bits;
  std::uint64_t under_step = 0;  // next_fetches_under_step, summed
  int overflows = 0;
  int clipped = 0;
  std::uint64_t ahead = 0;  // blocks stepped under backward and kept (skipped by the pass, told first)
};

tz::Expected<Run> train(const std::string& nvme, const Arm& a, bool under, tz::Communicator* comm = nullptr) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> e,
                      tz::ZeroEngine::create({.config = config_for(nvme, a), .comm = comm, .placement = a.placement,
                                              .next_fetches_under_step = under},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    for (int micro = 0; micro < a.gas; ++micro) {
      // fp16: an inf in block 2's gradient on step 7 overflows it (the step is skipped).
      const bool inf = a.precision == "fp16" && step == 7 && micro + 1 == a.gas;
      TZ_TRY(tz::mlp::train_micro_batch(*e, kMlp, tz::mlp::make_batch(kMlp, e->rank(), micro, step), {}, inf, 2)
                 .status());
      TZ_ASSIGN_OR_RETURN(tz::StepReport report, e->step());
      if (report.stepped) run.bits.grad_norms.push_back(report.grad_norm);
      run.under_step += report.next_fetches_under_step;
      run.overflows += report.overflow ? 1 : 0;
      run.clipped += report.stepped && report.clip_coef < 1.0 ? 1 : 0;
      run.ahead += report.ahead_blocks;
    }
    TZ_ASSIGN_OR_RETURN(run.bits.masters.emplace_back(), master_bits(*e));
  }
  TZ_ASSIGN_OR_RETURN(run.bits.params, gathered_params(*e));
  return run;
}

// "" when the two runs are the same bits and the one with the switch on
// issued fetches under the pass (and the other none); else what is wrong.
std::string compare(const Run& on, const Run& off, const Arm& a) {
  std::string diff = first_difference(on.bits, off.bits);
  if (!diff.empty()) return diff;
  if (on.under_step == 0 || off.under_step != 0) {
    return fmt::format("next fetches under the step: {} with the switch on, {} off", on.under_step, off.under_step);
  }
  if (a.precision == "fp16" && on.overflows == 0) return "no step overflowed";
  if (a.ahead == tz::StepUnderBackward::kAlways && on.ahead == 0) return "no block's step under backward was kept";
  if (a.clip > 0 && (on.clipped == 0 || on.clipped == static_cast<int>(on.bits.grad_norms.size()))) {
    return fmt::format("clipping bit on {} of {} steps", on.clipped, on.bits.grad_norms.size());
  }
  return "";
}

// The median gradient norm of the arm's run without clipping: as the max
// norm it clips about half the steps.
tz::Expected<Arm> clipping_half(Arm a, tz::Communicator* comm = nullptr) {
  TempDir nvme;
  a.clip = 0;
  TZ_ASSIGN_OR_RETURN(Run run, train(nvme.path(), a, false, comm));
  a.clip = median_grad_norm(run.bits.grad_norms);
  return a;
}

const Placement kMainJob = {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};

TEST(NextFetches, UnderTheOptimizerTrainBitForBitAsAfterIt) {
  std::vector<Arm> arms = {
      {kMainJob, 1},
      {kMainJob, 2},
      {{Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme}, 1},
      {{Tier::kNvme, Tier::kCpu, Tier::kCpu, Tier::kCpu}, 1},  // the optimizer in CPU memory
      {{Tier::kCpu, Tier::kCpu, Tier::kNvme, Tier::kNvme}, 2},  // parameters stepped in place
      {{Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu}, 1},    // parameters on the device tier
      {kMainJob, 1, tz::StepUnderBackward::kAlways},            // committed under backward, or redone
      {kMainJob, 1, tz::StepUnderBackward::kOff, tz::MasterFormat::kRemainder},
      {kMainJob, 1, tz::StepUnderBackward::kOff, tz::MasterFormat::kFp32, "fp16"},
  };
  for (const Arm& unclipped : arms) {
    SCOPED_TRACE(describe(unclipped));
    const auto clipping = clipping_half(unclipped);
    ASSERT_TRUE(clipping.ok()) << clipping.status().to_string();
    const Arm& a = *clipping;
    TempDir nvme;
    const auto on = train(nvme.path(), a, true);
    const auto off = train(nvme.path(), a, false);
    ASSERT_TRUE(on.ok() && off.ok()) << (on.ok() ? off.status() : on.status()).to_string();
    EXPECT_EQ(compare(*on, *off, a), "");
    std::printf("[ next fetches ] %s: %llu fetches issued under the optimizer in %d steps\n", describe(a).c_str(),
                static_cast<unsigned long long>(on->under_step), kSteps);
  }
}

// Every NVMe write failing from the third step's pass on: the step fails with
// the drive's error (not a hang, not a read refused for a write in flight),
// and the engine goes away cleanly with nothing in flight (the sanitizer
// build checks the memory).
TEST(NextFetches, WritesFailingUnderThePassFailTheStepWithTheDrivesError) {
  TempDir nvme;
  std::atomic<bool> armed{false};
  tz::ZeroOptions options{.config = config_for(nvme.path(), Arm{kMainJob, 1}), .placement = kMainJob};
  options.nvme_fault_injector = [&armed](const tz::nvme::PieceInfo& p) {
    return armed.load() && p.op == tz::nvme::IoOp::kWrite ? tz::nvme::Fault{.error = EIO} : tz::nvme::Fault{};
  };
  auto e = tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  for (int step = 0; step < 3; ++step) {
    auto loss = tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step));
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    armed = step == 2;
    auto r = (*e)->step();
    if (step < 2) {
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_GT(r->next_fetches_under_step, 0u);
      continue;
    }
    ASSERT_FALSE(r.ok());
    std::printf("[ next fetches ] the failed step: %s\n", r.status().to_string().c_str());
    EXPECT_NE(r.status().message().find("Input/output error"), std::string::npos) << r.status().to_string();
    EXPECT_EQ(r.status().message().find("in flight"), std::string::npos) << r.status().to_string();
  }
  armed = false;
  e->reset();
}

TEST(NextFetches, TwoRanksTrainBitForBitAsAfterTheStep) {
  TempDir dir;
  const std::vector<int> codes =
      run_engine_ranks(2, dir.path(), [&](const tz::RankInfo& info, tz::Communicator* comm, const std::string& nvme) {
        int code = 0;
        for (const Arm& unclipped : {Arm{kMainJob, 2}, Arm{kMainJob, 1, tz::StepUnderBackward::kAlways}}) {
          const auto clipping = clipping_half(unclipped, comm);
          if (!clipping.ok()) return 1;
          const auto on = train(nvme, *clipping, true, comm);
          const auto off = train(nvme, *clipping, false, comm);
          if (!on.ok() || !off.ok()) {
            std::fprintf(stderr, "rank %d: %s\n", info.rank, (on.ok() ? off.status() : on.status()).to_string().c_str());
            return 1;
          }
          const std::string diff = compare(*on, *off, *clipping);
          std::printf("[ next fetches ] rank %d of 2, %s: %s\n", info.rank, describe(*clipping).c_str(),
                      diff.empty() ? "same bits" : diff.c_str());
          if (!diff.empty()) code = 2;
        }
        return code;
      });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace tzt
