// The compact state formats in the engine (issue #21, tierzero.states):
// - master "remainder" (Note [Remainder masters in the engine]): training is
//   bit for bit training with fp32 masters, on every placement, on 1 and 2
//   ranks, with gradient clipping biting; checkpoints and exports hold the
//   fp32 master, so a checkpoint of either format loads into the other and
//   goes on bit for bit;
// - moments "bf16" (Note [Moments in bf16]): every placement steps exactly as
//   the same formats in CPU memory, a checkpoint resumes bit for bit, and the
//   moments move half the bytes. (Their rounding error against a float64
//   reference is cpu_adam's: tests/cpu_adam/step_test.cpp.)
// - data_types.grad_accum_dtype "bf16" (Note [16-bit gradient accumulators]):
//   with one micro-batch a step, training on every placement and on 2 ranks
//   is bit for bit the fp32 accumulator's; with two it is not (the control),
//   and grads on NVMe move 2 B each way instead of 4. (The error over several
//   micro-batches against float64 is cpu_adam's: tests/cpu_adam/accumulate_test.cpp.)
// - moments "int8" (Note [Int8 moments in the engine]): likewise on every
//   placement and on 2 ranks; an int8 checkpoint resumes bit for bit, an fp32
//   one loads into an int8 run and an int8 one into an fp32 run; the stored
//   shards are moments_bytes() plus O_DIRECT padding. (Their error against a
//   float64 reference is cpu_adam's: tests/cpu_adam/int8_test.cpp.)
#include <gtest/gtest.h>

#include "tierzero/testing/engine.h"
#include "../nvme/nvme_test_util.h"

namespace tzt {
namespace {

using tz::MasterFormat;
using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 41};
constexpr int kSteps = 20;
// Small enough that clipping scales most steps' gradients (checked below).
constexpr double kClip = 0.05;

const Placement kPlacements[] = {
    {Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu},
    {Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
    {Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
    {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},
    {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme},
    {Tier::kGpu, Tier::kCpu, Tier::kNvme, Tier::kCpu},  // masters alone on NVMe, parameters on the device
};

tz::Config config_for(const std::string& nvme, tz::StateFormats states, int gas = 2) {
  tz::Config config = test_config(nvme, 3, gas);
  config.gradient_clipping = kClip;
  config.states = states;
  // Several sub-groups, so the optimizer pipeline stages remainder shards one after another.
  config.zero.sub_group_size = 12000;
  return config;
}

tz::Expected<RunBits> run(const std::string& nvme, tz::StateFormats states, const Placement& placement,
                          tz::Communicator* comm = nullptr, int gas = 2) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create({.config = config_for(nvme, states, gas), .comm = comm, .placement = placement},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  return train_for_bits(*engine, kMlp, kSteps, gas);
}

int clipped_steps(const RunBits& r) {
  int n = 0;
  for (double norm : r.grad_norms) n += norm > kClip;
  return n;
}

// One run's formats and placement.
struct Arm {
  tz::StateFormats states;
  Placement placement;
};

// On 2 ranks, each rank trains `a` and then `b` (gas micro-batches a step):
// they must step bit for bit alike, and with clipping_bites, clipping must
// scale at least half of a's steps.
void expect_two_ranks_train_alike(const Arm& a, const Arm& b, int gas, bool clipping_bites) {
  TempDir dir;
  const auto codes = run_engine_ranks(2, dir.path(), [&](const tz::RankInfo& info, tz::Communicator* comm, const std::string& nvme) {
    const auto ra = run(nvme, a.states, a.placement, comm, gas);
    const auto rb = run(nvme, b.states, b.placement, comm, gas);
    if (!ra.ok() || !rb.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", info.rank, (ra.ok() ? rb.status() : ra.status()).to_string().c_str());
      return 1;
    }
    const std::string diff = first_difference(*ra, *rb);
    if (!diff.empty()) std::fprintf(stderr, "rank %d: %s\n", info.rank, diff.c_str());
    if (clipping_bites && clipped_steps(*ra) < kSteps / 2) return 3;
    return diff.empty() ? 0 : 2;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ", " << placement_name(a.placement) << " / " << placement_name(b.placement);
  }
}

// The NVMe bytes of the third step (one micro-batch a step) of a run in these
// formats with params, master and moments on NVMe, and the run's block layout.
struct StepBytes {
  std::uint64_t read = 0, written = 0;
  std::vector<tz::BlockLayout> blocks;
};
tz::Expected<StepBytes> third_step_bytes(tz::StateFormats states, const Placement& placement = kPlacements[3],
                                         bool keep_fetched_params = true) {
  TempDir nvme;
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create({.config = config_for(nvme.path(), states, 1), .placement = placement,
                                              .keep_fetched_params = keep_fetched_params},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  tz::StepReport last;
  for (int step = 0; step < 3; ++step) {
    TZ_TRY(tz::mlp::train_micro_batch(*engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).status());
    TZ_ASSIGN_OR_RETURN(last, engine->step());
  }
  return StepBytes{last.nvme_read_bytes, last.nvme_write_bytes, engine->layout().blocks};
}

// Trains 3 steps in the `saved` formats and saves a checkpoint, loads it into
// a fresh engine of the `loaded` formats, then trains 4 more steps on each:
// the first run going on, and the one resumed from its checkpoint.
struct Resumed {
  RunBits going_on, resumed;
};
tz::Expected<Resumed> save_and_resume(tz::StateFormats saved, tz::StateFormats loaded, const Placement& placement) {
  TempDir nvme, ckpt;
  auto make = [&](tz::StateFormats states) {
    return tz::ZeroEngine::create({.config = config_for(nvme.path(), states), .placement = placement},
                                  tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  };
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> a, make(saved));
  TZ_TRY(train_for_bits(*a, kMlp, 3, 2).status());
  TZ_TRY(a->save_checkpoint(ckpt.path()));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> b, make(loaded));
  TZ_TRY(b->load_checkpoint(ckpt.path()));
  Resumed out;
  TZ_ASSIGN_OR_RETURN(out.going_on, train_for_bits(*a, kMlp, 4, 2));
  TZ_ASSIGN_OR_RETURN(out.resumed, train_for_bits(*b, kMlp, 4, 2));
  return out;
}

TEST(RemainderMasters, TrainBitForBitAsFp32MastersOnEveryPlacement) {
  for (const Placement& placement : kPlacements) {
    SCOPED_TRACE(placement_name(placement));
    TempDir nvme;
    const auto fp32 = run(nvme.path(), {MasterFormat::kFp32}, placement);
    ASSERT_TRUE(fp32.ok()) << fp32.status().to_string();
    const auto remainder = run(nvme.path(), {MasterFormat::kRemainder}, placement);
    ASSERT_TRUE(remainder.ok()) << remainder.status().to_string();
    ASSERT_EQ(fp32->masters.size(), static_cast<std::size_t>(kSteps));
    EXPECT_GE(clipped_steps(*fp32), kSteps / 2) << "clipping must bite for this test to mean anything";
    EXPECT_EQ(first_difference(*fp32, *remainder), "");
    // The control: a different run is told apart (one more step's masters differ from the last's).
    EXPECT_NE(fp32->masters[kSteps - 1], fp32->masters[kSteps - 2]);
  }
}

TEST(RemainderMasters, TrainBitForBitAsFp32MastersOnTwoRanks) {
  for (const Placement& placement : {kPlacements[1], kPlacements[3]}) {
    expect_two_ranks_train_alike({{MasterFormat::kFp32}, placement}, {{MasterFormat::kRemainder}, placement}, 2, true);
  }
}

// A checkpoint holds the fp32 master whatever the run's format, so it loads
// into either format and training goes on as if never stopped.
TEST(RemainderMasters, ACheckpointOfEitherFormatLoadsIntoTheOtherBitForBit) {
  for (MasterFormat saved : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    const MasterFormat loaded = saved == MasterFormat::kFp32 ? MasterFormat::kRemainder : MasterFormat::kFp32;
    SCOPED_TRACE(fmt::format("saved {}, loaded {}", tz::master_format_name(saved), tz::master_format_name(loaded)));
    const auto runs = save_and_resume({saved}, {loaded}, kPlacements[3]);
    ASSERT_TRUE(runs.ok()) << runs.status().to_string();
    EXPECT_EQ(first_difference(runs->going_on, runs->resumed), "");
  }
}

// The export rebuilds the fp32 master: a remainder run exports the very
// file an fp32-master run of the same steps exports.
TEST(RemainderMasters, TheSafetensorsExportIsTheFp32RunsByteForByte) {
  const Placement placement = kPlacements[4];
  std::string files[2];
  for (MasterFormat master : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    TempDir nvme, out;
    auto file = exported_after_training({.config = config_for(nvme.path(), {master}), .placement = placement}, kMlp, 3,
                                        2, out.path());
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    files[static_cast<int>(master)] = std::move(*file);
  }
  ASSERT_GT(files[0].size(), 1000u);
  EXPECT_TRUE(files[0] == files[1]);
}

// Note [Remainder traffic]: the remainder master moves 2.125 B (padded to
// whole 4 KiB a shard) each way instead of 4, and the 16-bit parameters on
// NVMe are read once more by the optimizer, unless it kept them from
// backward's fetch (Note [The step keeps backward's parameter shards]): the
// step report counts exactly that.
TEST(RemainderMasters, TheStepReportCountsTheRemainderBytes) {
  const auto fp32 = third_step_bytes({});
  const auto remainder = third_step_bytes({MasterFormat::kRemainder}, kPlacements[3], /*keep_fetched_params=*/false);
  const auto kept = third_step_bytes({MasterFormat::kRemainder});
  ASSERT_TRUE(fp32.ok() && remainder.ok() && kept.ok())
      << (fp32.ok() ? (remainder.ok() ? kept.status() : remainder.status()) : fp32.status()).to_string();
  std::uint64_t param_bytes = 0, master_fp32 = 0, master_rem = 0;
  for (const tz::BlockLayout& b : fp32->blocks) {
    param_bytes += b.shard_numel * 2;
    master_fp32 += b.shard_numel * 4;
    master_rem += tz::stored_master_bytes(MasterFormat::kRemainder, b.shard_numel);
  }
  // Reads: the master shrinks from 4 B to its stored remainder, and the parameters are read once more.
  EXPECT_EQ(remainder->read, fp32->read - master_fp32 + master_rem + param_bytes);
  EXPECT_EQ(remainder->written, fp32->written - master_fp32 + master_rem);
  EXPECT_EQ(kept->read, fp32->read - master_fp32 + master_rem);
  EXPECT_EQ(kept->written, remainder->written);
}

// Every placement trained in `formats` steps as `base` (the same formats in
// CPU memory, or any run of the same steps), bit for bit.
void expect_every_placement_steps_as(const RunBits& base, tz::StateFormats formats, int gas = 2) {
  for (const Placement& placement : kPlacements) {
    SCOPED_TRACE(fmt::format("master {}, grads {}, {}", tz::master_format_name(formats.master),
                             tz::grad_format_name(formats.grads), placement_name(placement)));
    TempDir nvme;
    const auto got = run(nvme.path(), formats, placement, nullptr, gas);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(first_difference(base, *got), "");
  }
}

TEST(Bf16Moments, EveryPlacementStepsAsTheSameFormatsInCpuMemoryBitForBit) {
  using tz::MomentFormat;
  const Placement in_memory = kPlacements[2];
  TempDir base_dir;
  const auto fp32 = run(base_dir.path(), {}, in_memory);
  const auto base = run(base_dir.path(), {MasterFormat::kFp32, MomentFormat::kBf16}, in_memory);
  ASSERT_TRUE(fp32.ok() && base.ok()) << (fp32.ok() ? base.status() : fp32.status()).to_string();
  // The control: bf16 moments are really in effect.
  EXPECT_NE(first_difference(*fp32, *base), "");
  for (MasterFormat master : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    expect_every_placement_steps_as(*base, {master, MomentFormat::kBf16});
  }
}

TEST(Bf16Moments, ACheckpointResumesBitForBitAndAnFp32OneLoadsRounded) {
  const tz::StateFormats bf16{MasterFormat::kRemainder, tz::MomentFormat::kBf16};
  const auto same = save_and_resume(bf16, bf16, kPlacements[3]);
  ASSERT_TRUE(same.ok()) << same.status().to_string();
  EXPECT_EQ(first_difference(same->going_on, same->resumed), "");
  // An fp32 run's checkpoint loads into a bf16 run, its moments rounded: the
  // next steps are a bf16 run's (not refused, and not the fp32 run's).
  const auto rounded = save_and_resume({}, bf16, kPlacements[3]);
  ASSERT_TRUE(rounded.ok()) << rounded.status().to_string();
  EXPECT_EQ(rounded->going_on.masters.size(), rounded->resumed.masters.size());
  EXPECT_NE(first_difference(rounded->going_on, rounded->resumed), "");
}

// Both moments on NVMe move 2 B each instead of 4, each way, and nothing else changes.
TEST(Bf16Moments, TheStepReportCountsHalfTheMomentBytes) {
  const auto fp32 = third_step_bytes({});
  const auto bf16 = third_step_bytes({MasterFormat::kFp32, tz::MomentFormat::kBf16});
  ASSERT_TRUE(fp32.ok() && bf16.ok()) << (fp32.ok() ? bf16.status() : fp32.status()).to_string();
  std::uint64_t numel = 0;
  for (const tz::BlockLayout& b : fp32->blocks) numel += b.shard_numel;
  EXPECT_EQ(fp32->read - bf16->read, 4 * numel);
  EXPECT_EQ(fp32->written - bf16->written, 4 * numel);
}

TEST(Int8Moments, EveryPlacementStepsAsTheSameFormatsInCpuMemoryBitForBit) {
  using tz::MomentFormat;
  const Placement in_memory = kPlacements[2];
  TempDir base_dir;
  const auto bf16 = run(base_dir.path(), {MasterFormat::kFp32, MomentFormat::kBf16}, in_memory);
  ASSERT_TRUE(bf16.ok()) << bf16.status().to_string();
  for (MasterFormat master : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    const auto base = run(base_dir.path(), {master, MomentFormat::kInt8}, in_memory);
    ASSERT_TRUE(base.ok()) << base.status().to_string();
    // The control: int8 moments are really in effect.
    EXPECT_NE(first_difference(*bf16, *base), "");
    expect_every_placement_steps_as(*base, {master, MomentFormat::kInt8});
  }
}

TEST(Int8Moments, TwoRanksStepAsTheSameFormatsInCpuMemoryBitForBit) {
  const tz::StateFormats int8{MasterFormat::kRemainder, tz::MomentFormat::kInt8};
  expect_two_ranks_train_alike({int8, kPlacements[2]}, {int8, kPlacements[4]}, 2, false);
}

TEST(Int8Moments, ACheckpointResumesBitForBitAndLoadsIntoAndFromFp32) {
  const tz::StateFormats int8{MasterFormat::kRemainder, tz::MomentFormat::kInt8};
  const auto same = save_and_resume(int8, int8, kPlacements[3]);
  ASSERT_TRUE(same.ok()) << same.status().to_string();
  EXPECT_EQ(first_difference(same->going_on, same->resumed), "");
  // fp32 -> int8: the moments encoded, the next steps an int8 run's.
  const auto encoded = save_and_resume({}, int8, kPlacements[3]);
  ASSERT_TRUE(encoded.ok()) << encoded.status().to_string();
  EXPECT_EQ(encoded->going_on.masters.size(), encoded->resumed.masters.size());
  EXPECT_NE(first_difference(encoded->going_on, encoded->resumed), "");
  // int8 -> fp32: loads (decoded moments), and trains on.
  const auto decoded = save_and_resume(int8, {}, kPlacements[2]);
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->going_on.masters.size(), decoded->resumed.masters.size());
  EXPECT_NE(first_difference(decoded->going_on, decoded->resumed), "");
}

// Both moments on NVMe move their stored int8 shards (codes, scales, padding)
// instead of 4 B an element each, each way; the unpadded part is moments_bytes().
TEST(Int8Moments, TheStepReportCountsTheStoredShards) {
  const auto fp32 = third_step_bytes({});
  const auto int8 = third_step_bytes({MasterFormat::kFp32, tz::MomentFormat::kInt8});
  ASSERT_TRUE(fp32.ok() && int8.ok()) << (fp32.ok() ? int8.status() : fp32.status()).to_string();
  std::uint64_t fp32_moments = 0, stored = 0, unpadded = 0;
  for (const tz::BlockLayout& b : fp32->blocks) {
    fp32_moments += 8 * b.shard_numel;
    stored += 2 * tz::stored_moment_bytes(tz::MomentFormat::kInt8, b.shard_numel);
    unpadded += tz::moments_bytes(tz::MomentFormat::kInt8, b.shard_numel);
    EXPECT_EQ(tz::moments_bytes(tz::MomentFormat::kInt8, b.shard_numel),
              2 * (b.shard_numel + 4 * ((b.shard_numel + 255) / 256)));
  }
  EXPECT_EQ(fp32->read - int8->read, fp32_moments - stored);
  EXPECT_EQ(fp32->written - int8->written, fp32_moments - stored);
  EXPECT_LE(stored - unpadded, 2 * 4096 * fp32->blocks.size());
}

TEST(Bf16GradAccumulators, WithOneMicroBatchEveryPlacementTrainsBitForBitAsFp32Accumulators) {
  const Placement in_memory = kPlacements[2];
  for (tz::StateFormats fp32 : {tz::StateFormats{}, tz::StateFormats{MasterFormat::kRemainder, tz::MomentFormat::kInt8}}) {
    tz::StateFormats bf16 = fp32;
    bf16.grads = tz::GradFormat::kBf16;
    TempDir base_dir;
    const auto base = run(base_dir.path(), fp32, in_memory, nullptr, 1);
    ASSERT_TRUE(base.ok()) << base.status().to_string();
    EXPECT_GE(clipped_steps(*base), kSteps / 2) << "clipping must bite for this test to mean anything";
    expect_every_placement_steps_as(*base, bf16, 1);
    // The control: with two micro-batches the second one's sum is rounded to bf16.
    const auto fp32_two = run(base_dir.path(), fp32, in_memory);
    const auto bf16_two = run(base_dir.path(), bf16, in_memory);
    ASSERT_TRUE(fp32_two.ok() && bf16_two.ok()) << (fp32_two.ok() ? bf16_two.status() : fp32_two.status()).to_string();
    EXPECT_NE(first_difference(*fp32_two, *bf16_two), "");
  }
}

TEST(Bf16GradAccumulators, WithOneMicroBatchTwoRanksTrainBitForBitAsFp32Accumulators) {
  const tz::StateFormats fp32{MasterFormat::kRemainder, tz::MomentFormat::kInt8};
  tz::StateFormats bf16 = fp32;
  bf16.grads = tz::GradFormat::kBf16;
  for (const Placement& placement : {kPlacements[2], kPlacements[4]}) {
    expect_two_ranks_train_alike({fp32, placement}, {bf16, placement}, 1, true);
  }
}

// Grads on NVMe: one micro-batch a step writes the accumulator once and the
// step reads it once, 2 B an element each way instead of 4.
TEST(Bf16GradAccumulators, TheStepReportCountsHalfTheGradBytes) {
  tz::StateFormats bf16;
  bf16.grads = tz::GradFormat::kBf16;
  const auto fp32 = third_step_bytes({}, kPlacements[4]);
  const auto half = third_step_bytes(bf16, kPlacements[4]);
  ASSERT_TRUE(fp32.ok() && half.ok()) << (fp32.ok() ? half.status() : fp32.status()).to_string();
  std::uint64_t numel = 0;
  for (const tz::BlockLayout& b : fp32->blocks) numel += b.shard_numel;
  EXPECT_EQ(fp32->read - half->read, 2 * numel);
  EXPECT_EQ(fp32->written - half->written, 2 * numel);
}

}  // namespace
}  // namespace tzt
