// Checkpoints: resume is bit for bit, across placements; kill -9 during a save
// leaves the last checkpoint loadable; corrupt or mismatched checkpoints are
// refused before anything is replaced; the fp32 export is a valid safetensors
// file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "../../engine/src/checkpoint_files.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 64, .batch = 4, .seed = 5};
const Placement kNvme{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};
const Placement kCpu{Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu};

std::unique_ptr<tz::ZeroEngine> make(const std::string& nvme, const Placement& p, const std::string& optimizer = "AdamW",
                                     const tz::ParamInit& init = tz::mlp::init(kMlp)) {
  tz::Config config = test_config(nvme, 3, 1);
  config.optimizer.type = optimizer;
  auto e = tz::ZeroEngine::create({.config = config, .placement = p}, tz::mlp::model(kMlp), init);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

tz::Status train(tz::ZeroEngine& e, int from, int to) {
  for (int step = from; step < to; ++step) {
    TZ_TRY(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).status());
    TZ_TRY(e.step().status());
  }
  return tz::ok_status();
}

std::vector<std::vector<float>> masters(tz::ZeroEngine& e) {
  std::vector<std::vector<float>> out;
  for (std::size_t b = 0; b < e.layout().blocks.size(); ++b) out.push_back(e.gather_master(b).value());
  return out;
}

std::string read_latest(const std::string& dir) {
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  return name;
}

// What a folder holds, less the save lock's file (Note [One saver a folder]).
std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  out.erase(".tierzero-save.lock");
  return out;
}

TEST(Checkpoint, ResumeUnderAnotherPlacementIsBitIdenticalToAnUninterruptedRun) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kNvme);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 3).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  const auto at_save = masters(*a);
  ASSERT_TRUE(train(*a, 3, 5).ok());
  const auto uninterrupted = masters(*a);

  auto b = make(nvme.path(), kCpu);  // saved from NVMe, loaded into CPU memory
  ASSERT_TRUE(b);
  const tz::Status loaded = b->load_checkpoint(ckpt.path());
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  EXPECT_EQ(masters(*b), at_save);
  ASSERT_TRUE(train(*b, 3, 5).ok());
  EXPECT_EQ(masters(*b), uninterrupted) << "resume must continue bit for bit";
}

// An engine made with initial_values = kSetLater (no values written) takes
// every block's from a checkpoint, and goes on bit for bit; before the load
// it refuses to save.
TEST(Checkpoint, AnEngineMadeWithoutValuesTakesThemFromACheckpoint) {
  TempDir nvme, later_nvme, ckpt;
  auto a = make(nvme.path(), kNvme);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 2).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  const auto at_save = masters(*a);
  ASSERT_TRUE(train(*a, 2, 4).ok());
  const auto uninterrupted = masters(*a);

  auto b = tz::ZeroEngine::create({.config = test_config(later_nvme.path(), 3, 1), .placement = kNvme,
                                   .initial_values = tz::InitialValues::kSetLater},
                                  tz::mlp::model(kMlp), tz::ParamInit());
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const auto refused = (*b)->save_checkpoint(ckpt.path(), {.tag = "unset"});
  EXPECT_NE(refused.status().message().find("save_checkpoint: block 'layer0' has no values yet"), std::string::npos)
      << refused.status().to_string();
  EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/unset"));
  const auto loaded = (*b)->load_checkpoint(ckpt.path());
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  EXPECT_EQ(masters(**b), at_save);
  ASSERT_TRUE(train(**b, 2, 4).ok());
  EXPECT_EQ(masters(**b), uninterrupted);
}

// A rate set by the caller (a schedule of its own) comes back with the
// checkpoint; a manifest whose rate is not a rate is refused as corrupt.
TEST(Checkpoint, TheCallersLearningRateIsSavedAndAnImpossibleOneIsRefused) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kCpu);
  ASSERT_TRUE(a);
  ASSERT_TRUE(a->set_learning_rate(3.5e-4).ok());
  ASSERT_TRUE(train(*a, 0, 2).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  auto b = make(nvme.path(), kCpu);
  ASSERT_TRUE(b);
  ASSERT_NE(b->learning_rate(), 3.5e-4);
  ASSERT_TRUE(b->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ(b->learning_rate(), 3.5e-4);

  std::string name;
  std::ifstream(ckpt.path() + "/latest") >> name;
  const std::string manifest = ckpt.path() + "/" + name + "/rank-0.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
  ASSERT_EQ(m["lr"].get<double>(), 3.5e-4);
  m["lr"] = -1.0;
  std::ofstream(manifest, std::ios::trunc) << tz::detail::sealed_text(m);  // Note [Sealed manifests]
  auto c = make(nvme.path(), kCpu);
  ASSERT_TRUE(c);
  const tz::Status refused = c->load_checkpoint(ckpt.path());
  EXPECT_EQ(refused.code(), tz::ErrorCode::kDataCorruption) << refused.to_string();
  EXPECT_NE(refused.message().find("learning rate -1 is not finite and >= 0"), std::string::npos) << refused.message();
  EXPECT_EQ(c->optimizer_steps(), 0) << "nothing replaced";
}

// A run that never set a rate saves none: resuming under a config with a new
// lr (fine-tuning from a checkpoint) trains at the new one.
TEST(Checkpoint, WithoutACallersRateTheLoadingConfigsRateStands) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kCpu);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 2).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  tz::Config config = test_config(nvme.path(), 3, 1);
  config.optimizer.lr = 7e-4;
  ASSERT_NE(a->learning_rate(), 7e-4);
  auto b = tz::ZeroEngine::create({.config = config, .placement = kCpu}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_TRUE((*b)->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ((*b)->learning_rate(), 7e-4);
  EXPECT_EQ((*b)->optimizer_steps(), 2);
}

TEST(Checkpoint, RollingBackInTheSameEngineDropsPrefetchedParameters) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kNvme);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 3).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  ASSERT_TRUE(train(*a, 3, 5).ok());
  const auto uninterrupted = masters(*a);
  // After step 5 the next micro-batch's first blocks are already prefetched,
  // with step 5's parameters: the load must not let them through.
  ASSERT_TRUE(a->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ(a->optimizer_steps(), 3);
  ASSERT_TRUE(train(*a, 3, 5).ok());
  EXPECT_EQ(masters(*a), uninterrupted);
}

TEST(Checkpoint, SavingTheSameStepTwiceKeepsBothComplete) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kCpu);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 2).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path()).ok());
  EXPECT_TRUE(std::filesystem::exists(ckpt.path() + "/step-2/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(ckpt.path() + "/step-2.1/manifest.json"));
  EXPECT_EQ(read_latest(ckpt.path()), "step-2.1");
  auto b = make(nvme.path(), kCpu);
  ASSERT_TRUE(b->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ(masters(*b), masters(*a));
}

// As DeepSpeed's save_checkpoint(dir, tag, client_state): the tag names the
// directory, saving under it again replaces it whole (Note [Replacing a
// checkpoint]), and the client state comes back on every load.
TEST(Checkpoint, ATagNamesTheCheckpointAndSavingUnderItAgainReplacesIt) {
  TempDir nvme, ckpt;
  auto a = make(nvme.path(), kCpu);
  ASSERT_TRUE(a);
  ASSERT_TRUE(train(*a, 0, 2).ok());
  auto saved = a->save_checkpoint(ckpt.path(), {.tag = "best", .client_state = "epoch 1"});
  ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  EXPECT_EQ(*saved, ckpt.path() + "/best");
  const auto first = masters(*a);
  ASSERT_TRUE(train(*a, 2, 3).ok());
  std::string binary("epoch 2\0\xff", 9);  // the bytes as given, zeros and all
  saved = a->save_checkpoint(ckpt.path(), {.tag = "best", .client_state = binary});
  ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  EXPECT_EQ(entries(ckpt.path()), (std::set<std::string>{"best", "latest"})) << "the replaced one is gone";
  EXPECT_EQ(read_latest(ckpt.path()), "best");

  auto b = make(nvme.path(), kCpu);
  ASSERT_TRUE(b);
  auto loaded = b->load_checkpoint(ckpt.path(), {.tag = "best"});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->path, ckpt.path() + "/best");
  EXPECT_EQ(loaded->step, 3);
  EXPECT_EQ(loaded->client_state, binary);
  EXPECT_EQ(masters(*b), masters(*a));
  EXPECT_NE(masters(*b), first);

  // save_latest = false leaves `latest` where it was; a checkpoint saved without a client state has none.
  ASSERT_TRUE(train(*a, 3, 4).ok());
  ASSERT_TRUE(a->save_checkpoint(ckpt.path(), {.tag = "step-4-eval", .save_latest = false}).ok());
  EXPECT_EQ(read_latest(ckpt.path()), "best");
  loaded = b->load_checkpoint(ckpt.path(), {.tag = ""});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->path, ckpt.path() + "/best");
  loaded = b->load_checkpoint(ckpt.path(), {.tag = "step-4-eval"});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->step, 4);
  EXPECT_FALSE(loaded->client_state.has_value());
  EXPECT_EQ(masters(*b), masters(*a));
}

// Another optimizer's checkpoint is refused by name (loading a Lion
// checkpoint into AdamW once read moments it does not have), unless only its
// weights are wanted: then the engine continues exactly as a fresh one
// started from those weights would. Adam and AdamW keep the same moments.
TEST(Checkpoint, AnotherOptimizersCheckpointIsRefusedOrLoadsItsWeightsAlone) {
  TempDir nvme, ckpt;
  auto lion = make(nvme.path(), kCpu, "Lion");
  ASSERT_TRUE(lion);
  ASSERT_TRUE(train(*lion, 0, 3).ok());
  ASSERT_TRUE(lion->save_checkpoint(ckpt.path()).ok());
  const auto weights = masters(*lion);

  auto adamw = make(nvme.path(), kCpu, "AdamW");
  ASSERT_TRUE(adamw);
  const auto before = masters(*adamw);
  const tz::Status refused = adamw->load_checkpoint(ckpt.path());
  EXPECT_EQ(refused.code(), tz::ErrorCode::kInvalidArgument) << refused.to_string();
  EXPECT_NE(refused.message().find("saved by the Lion optimizer; this engine's AdamW cannot continue"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(masters(*adamw), before) << "a refused load replaces nothing";

  const auto loaded = adamw->load_checkpoint(ckpt.path(), {.weights_only = true});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->step, 0) << "the engine's own step count stays";
  EXPECT_EQ(masters(*adamw), weights);
  // A fresh AdamW engine initialised with those weights takes the same steps.
  const auto layout = adamw->layout();
  auto fresh = make(nvme.path(), kCpu, "AdamW", [&](std::size_t b, std::size_t p, float* out, std::uint64_t numel) {
    const auto& param = layout.blocks[b].params[p];
    std::copy_n(weights[b].begin() + static_cast<std::ptrdiff_t>(param.offset), numel, out);
  });
  ASSERT_TRUE(fresh);
  ASSERT_TRUE(train(*adamw, 3, 5).ok());
  ASSERT_TRUE(train(*fresh, 3, 5).ok());
  EXPECT_EQ(masters(*adamw), masters(*fresh));

  // Adam continues from AdamW's moments.
  TempDir ckpt2;
  ASSERT_TRUE(adamw->save_checkpoint(ckpt2.path()).ok());
  auto adam = make(nvme.path(), kCpu, "Adam");
  ASSERT_TRUE(adam);
  const tz::Status s = adam->load_checkpoint(ckpt2.path());
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// Manifest fields of the wrong JSON type, or a state the optimizer needs and
// the file lacks, are corruption: refused by name, not a crash.
TEST(Checkpoint, AMalformedRankManifestIsRefusedAsCorrupt) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 1).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path()).ok());
  const std::string manifest = ckpt.path() + "/step-1/rank-0.json";
  nlohmann::json good;
  std::ifstream(manifest) >> good;
  auto refused_with = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& text) {
    nlohmann::json m = good;
    edit(m);
    std::ofstream(manifest, std::ios::trunc) << tz::detail::sealed_text(m);  // the checks behind the seal
    const tz::Status s = e->load_checkpoint(ckpt.path());
    EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
  };
  refused_with([](nlohmann::json& m) { m["loss_scaler"] = "big"; }, "rank-0.json is malformed");
  refused_with([](nlohmann::json& m) { m.erase("loss_scaler"); }, "rank-0.json is malformed");
  // Nothing missing is read as a default (a missing "step" once resumed at step 0).
  refused_with([](nlohmann::json& m) { m.erase("step"); }, "'step' not found");
  refused_with([](nlohmann::json& m) { m.erase("lr"); }, "'lr' not found");
  refused_with([](nlohmann::json& m) { m["blocks"][0]["states"]["master"].erase("xxh3"); }, "'xxh3' not found");
  refused_with([](nlohmann::json& m) { m["blocks"][0] = 7; }, "rank-0.json is malformed");
  refused_with([](nlohmann::json& m) { m["blocks"][1]["states"].erase("exp_avg_sq"); }, "has no exp_avg_sq");
  // An extent whose offset + bytes wraps past 2^64 once passed the bounds check and was read far outside the file.
  refused_with([](nlohmann::json& m) {
    auto& s = m["blocks"][0]["states"]["exp_avg"];
    s["offset"] = std::numeric_limits<std::uint64_t>::max() - s["bytes"].get<std::uint64_t>() + 1;
  }, "has a bad extent");
  refused_with([](nlohmann::json& m) { m["loss_scaler"]["scale"] = 0; }, "loss scaler");
  refused_with([](nlohmann::json& m) { m["loss_scaler"]["hysteresis_left"] = 0; }, "loss scaler");
  refused_with([](nlohmann::json& m) { m["step"] = -3; }, "step -3 is impossible");
  refused_with([](nlohmann::json& m) { m["step"] = std::numeric_limits<std::int64_t>::max(); }, "is impossible");
  std::ofstream(manifest, std::ios::trunc) << tz::detail::sealed_text(good);
  // `latest` written by hand: a trailing newline is fine; a path out of the directory, or a directory, is not.
  std::ofstream(ckpt.path() + "/latest", std::ios::trunc) << "step-1\n";
  tz::Status s = e->load_checkpoint(ckpt.path());
  EXPECT_TRUE(s.ok()) << s.to_string();
  std::ofstream(ckpt.path() + "/latest", std::ios::trunc) << "../elsewhere/step-1";
  s = e->load_checkpoint(ckpt.path());
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  EXPECT_NE(s.message().find("latest names '../elsewhere/step-1'"), std::string::npos) << s.message();
  std::filesystem::remove(ckpt.path() + "/latest");
  std::filesystem::create_directory(ckpt.path() + "/latest");
  s = e->load_checkpoint(ckpt.path());
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  EXPECT_NE(s.message().find("latest is not a regular file"), std::string::npos) << s.message();
  std::ofstream(ckpt.path() + "/step-1/manifest.json", std::ios::trunc) << "[1, 2]";
  s = e->load_checkpoint(ckpt.path() + "/step-1");
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
}

// A static loss scale, or none, is the loading run's: an fp16 checkpoint's
// 65536 carried into a bf16 run once divided every gradient by it.
TEST(Checkpoint, OnlyADynamicLossScaleIsRestored) {
  TempDir nvme, ckpt;
  auto fp16 = tz::ZeroEngine::create({.config = test_config(nvme.path(), 3, 1, "fp16"), .placement = kCpu},
                                     tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(fp16.ok()) << fp16.status().to_string();
  ASSERT_TRUE(train(**fp16, 0, 2).ok());
  ASSERT_GT((*fp16)->loss_scale(), 1.0);
  ASSERT_TRUE((*fp16)->save_checkpoint(ckpt.path()).ok());
  auto bf16 = make(nvme.path(), kCpu);
  ASSERT_TRUE(bf16);
  ASSERT_TRUE(bf16->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ(bf16->loss_scale(), 1.0);
  auto again = tz::ZeroEngine::create({.config = test_config(nvme.path(), 3, 1, "fp16"), .placement = kCpu},
                                      tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ((*again)->loss_scale(), (*fp16)->loss_scale()) << "a dynamic scale continues";
}

TEST(Checkpoint, BadTagsAndADirectoryThatIsNoCheckpointAreRefusedAndLeftAlone) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 1).ok());
  for (const std::string& tag : std::vector<std::string>{"a/b", "..", ".", "latest", "x.partial", std::string(201, 'x')}) {
    const auto s = e->save_checkpoint(ckpt.path(), {.tag = tag});
    EXPECT_EQ(s.status().code(), tz::ErrorCode::kInvalidArgument) << tag << ": " << s.status().to_string();
    EXPECT_NE(s.status().message().find("'" + tag + "'"), std::string::npos) << s.status().message();
  }
  EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/latest"));
  // A directory of the user's under that name is not replaced.
  std::filesystem::create_directories(ckpt.path() + "/notes");
  std::ofstream(ckpt.path() + "/notes/todo.txt") << "keep me";
  const auto s = e->save_checkpoint(ckpt.path(), {.tag = "notes"});
  EXPECT_EQ(s.status().code(), tz::ErrorCode::kAlreadyExists) << s.status().to_string();
  EXPECT_NE(s.status().message().find("is not a tierzero checkpoint"), std::string::npos) << s.status().message();
  EXPECT_EQ(entries(ckpt.path() + "/notes"), std::set<std::string>{"todo.txt"});
  EXPECT_EQ(entries(ckpt.path()), std::set<std::string>{"notes"});
  const auto missing = e->load_checkpoint(ckpt.path(), {.tag = "missing"});
  EXPECT_EQ(missing.status().code(), tz::ErrorCode::kNotFound) << missing.status().to_string();
  EXPECT_NE(missing.status().message().find("no checkpoint tagged 'missing'"), std::string::npos);
}

TEST(Checkpoint, ACorruptOrTruncatedClientStateIsRefusedAndNothingIsReplaced) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 2).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.client_state = std::string(5000, 'c')}).ok());
  ASSERT_TRUE(train(*e, 2, 3).ok());
  const auto before = masters(*e);
  const std::string file = ckpt.path() + "/step-2/client_state.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4000);
    f.write("d", 1);
  }
  auto s = e->load_checkpoint(ckpt.path(), {.tag = ""});
  EXPECT_EQ(s.status().code(), tz::ErrorCode::kDataCorruption) << s.status().to_string();
  EXPECT_NE(s.status().message().find("client_state.bin"), std::string::npos) << s.status().message();
  EXPECT_EQ(masters(*e), before) << "a refused load replaces nothing";
  std::filesystem::resize_file(file, 100);
  s = e->load_checkpoint(ckpt.path(), {.tag = ""});
  EXPECT_EQ(s.status().code(), tz::ErrorCode::kDataCorruption) << s.status().to_string();
  EXPECT_NE(s.status().message().find("truncated"), std::string::npos) << s.status().message();
  EXPECT_EQ(masters(*e), before);
}

// Three times: forks a child that trains and saves with `save` after every
// step, forever, and kills it (SIGKILL) at a random moment once a first
// checkpoint exists. Returns whether every child died by the signal.
::testing::AssertionResult kill_saving_children(const std::string& nvme, const std::string& ckpt, const Placement& p,
                                                const std::function<tz::Status(tz::ZeroEngine&, int)>& save) {
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 3; ++round) {
    const pid_t child = ::fork();
    if (child == 0) {
      auto e = make(nvme, p);
      if (!e) ::_exit(3);
      for (int step = 0;; ++step) {
        if (!train(*e, step, step + 1).ok() || !save(*e, step + 1).ok()) ::_exit(4);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(ckpt + "/latest") && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 400));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (!WIFSIGNALED(status)) {
      return ::testing::AssertionFailure() << "the child should have been killed, not exited (" << status << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(Checkpoint, KillDashNineDuringASaveLeavesTheLastCheckpointLoadable) {
  TempDir nvme, ckpt;
  ASSERT_TRUE(kill_saving_children(nvme.path(), ckpt.path(), kNvme,
                                   [&](tz::ZeroEngine& e, int) { return e.save_checkpoint(ckpt.path()); }));
  // Whatever the kill interrupted, `latest` names a complete checkpoint ...
  auto loaded = make(nvme.path(), kCpu);
  ASSERT_TRUE(loaded);
  const tz::Status s = loaded->load_checkpoint(ckpt.path());
  ASSERT_TRUE(s.ok()) << s.to_string();
  const std::string name = read_latest(ckpt.path());
  const int step = std::stoi(name.substr(5));
  std::printf("[ engine ] after 3 kills, latest = %s\n", name.c_str());
  // ... equal to an uninterrupted run of the same number of steps.
  auto fresh = make(nvme.path(), kCpu);
  ASSERT_TRUE(train(*fresh, 0, step).ok());
  EXPECT_EQ(masters(*loaded), masters(*fresh));
}

// Note [Replacing a checkpoint]: killed while saving over the same tag again
// and again, the tag always holds one complete checkpoint.
TEST(Checkpoint, KillDashNineWhileReplacingATaggedCheckpointLeavesOneComplete) {
  TempDir nvme, ckpt;
  ASSERT_TRUE(kill_saving_children(nvme.path(), ckpt.path(), kCpu, [&](tz::ZeroEngine& e, int step) {
    return e.save_checkpoint(ckpt.path(), {.tag = "rolling", .client_state = std::to_string(step)}).status();
  }));
  auto loaded = make(nvme.path(), kCpu);
  ASSERT_TRUE(loaded);
  const auto l = loaded->load_checkpoint(ckpt.path(), {.tag = "rolling"});
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  ASSERT_TRUE(l->client_state.has_value());
  const int step = std::stoi(*l->client_state);
  EXPECT_EQ(l->step, step) << "the client state is the one saved with these weights";
  std::printf("[ engine ] after 3 kills, 'rolling' holds step %d\n", step);
  auto fresh = make(nvme.path(), kCpu);
  ASSERT_TRUE(train(*fresh, 0, step).ok());
  EXPECT_EQ(masters(*loaded), masters(*fresh));
}

TEST(Checkpoint, CorruptTruncatedOrMismatchedCheckpointsAreRefusedAndNothingIsReplaced) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 2).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path()).ok());
  ASSERT_TRUE(train(*e, 2, 3).ok());
  const auto before = masters(*e);
  const std::string bin = ckpt.path() + "/step-2/rank-0.bin";
  {  // one flipped bit
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(1000);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x04;
    f.seekp(1000);
    f.write(&c, 1);
  }
  tz::Status s = e->load_checkpoint(ckpt.path());
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  EXPECT_NE(s.message().find("rank-0.bin"), std::string::npos) << s.message();
  EXPECT_EQ(masters(*e), before) << "a refused load replaces nothing";
  std::filesystem::resize_file(bin, 4096);
  s = e->load_checkpoint(ckpt.path());
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
  // A model of another shape.
  const tz::mlp::MlpConfig other{.layers = 3, .hidden = 32, .batch = 4};
  auto o = tz::ZeroEngine::create({.config = test_config(nvme.path(), 3, 1)}, tz::mlp::model(other), tz::mlp::init(other));
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE((*o)->save_checkpoint(ckpt.path() + "/other").ok());
  s = e->load_checkpoint(ckpt.path() + "/other");
  EXPECT_EQ(s.code(), tz::ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("layer0"), std::string::npos) << s.message();
  s = e->load_checkpoint(ckpt.path() + "/nothing-here");
  EXPECT_EQ(s.code(), tz::ErrorCode::kNotFound) << s.to_string();
}

// Note [Checkpoints know their parameters]: blocks of the same names and
// sizes whose parameters differ (a weight reshaped, a renamed parameter)
// are refused, naming the parameter; nothing is replaced. A manifest from
// before the parameter lists still loads.
TEST(Checkpoint, AModelWithOtherParametersInBlocksOfTheSameSizeIsRefused) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 2).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path()).ok());

  auto load_into = [&](std::vector<tz::BlockSpec> model) {
    auto o = tz::ZeroEngine::create({.config = test_config(nvme.path(), 3, 1)}, std::move(model), tz::mlp::init(kMlp));
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    const auto before = masters(**o);
    const tz::Status s = (*o)->load_checkpoint(ckpt.path());
    if (!s.ok()) {
      EXPECT_EQ(masters(**o), before) << "a refused load replaces nothing";
    } else {
      EXPECT_EQ(masters(**o), masters(*e)) << "a load gives the saved weights";
    }
    return s;
  };
  const std::vector<tz::BlockSpec> model = tz::mlp::model(kMlp);
  ASSERT_GE(model[1].params.size(), 1u);
  ASSERT_EQ(model[1].params[0].shape.size(), 2u);
  auto reshaped = model;  // the same elements in another shape: (r, c) -> (r / 2, 2c)
  auto& shape = reshaped[1].params[0].shape;
  ASSERT_EQ(shape[0] % 2, 0);
  shape = {shape[0] / 2, shape[1] * 2};
  tz::Status s = load_into(reshaped);
  EXPECT_EQ(s.code(), tz::ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("parameter 0 of block '" + model[1].name + "'"), std::string::npos) << s.message();
  auto renamed = model;
  renamed[2].params.back().name = "renamed";
  s = load_into(renamed);
  EXPECT_EQ(s.code(), tz::ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("the model has 'renamed'"), std::string::npos) << s.message();
  EXPECT_TRUE(load_into(model).ok());  // the same model loads

  // The parameter lists are required: without them a reshaped model would load.
  const std::string manifest = ckpt.path() + "/step-2/rank-0.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
  for (auto& block : m["blocks"]) block.erase("params");
  std::ofstream(manifest, std::ios::trunc) << tz::detail::sealed_text(m);
  s = load_into(reshaped);
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  EXPECT_NE(s.message().find("'params' not found"), std::string::npos) << s.message();
}

// keep_last: the newest N complete checkpoints stay (by step); older ones go,
// never the one `latest` names nor the one just saved, and nothing that is not
// a tierzero checkpoint.
// A save onto a full disk (issue #23: "a full disk never corrupted latest"):
// it fails naming ENOSPC, removes its own .partial, and leaves `latest` and the
// checkpoint it names loadable; with room again the next save succeeds.
TEST(Checkpoint, ASaveOntoAFullDiskFailsAndLeavesLatestAndNoPartial) {
  TempDir nvme, dir;
  LoopMount disk(dir, 16);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  const std::string ckpt = disk.path() + "/ckpt";
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 1).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt).ok());
  const std::vector<std::vector<float>> saved = masters(*e);
  ASSERT_TRUE(train(*e, 1, 2).ok());
  // Fill the disk: chunks ever smaller until not even 4 KiB more fits.
  const std::string filler = disk.path() + "/filler";
  {
    const int fd = ::open(filler.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    off_t end = 0;
    for (off_t chunk = off_t{1} << 20; chunk >= 4096;) {
      if (::posix_fallocate(fd, end, chunk) == 0) {
        end += chunk;
      } else {
        chunk /= 2;
      }
    }
    ::close(fd);
  }
  const tz::Status full = e->save_checkpoint(ckpt);
  ASSERT_FALSE(full.ok()) << "a save onto a full disk succeeded";
  EXPECT_EQ(full.code(), tz::ErrorCode::kNoSpace) << full.to_string();
  EXPECT_NE(full.message().find(ckpt), std::string::npos) << full.message();
  EXPECT_EQ(read_latest(ckpt), "step-1");
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "step-1"})) << "no .partial, no latest.tmp";
  auto loaded = make(nvme.path(), kCpu);
  ASSERT_TRUE(loaded);
  ASSERT_TRUE(loaded->load_checkpoint(ckpt).ok());
  EXPECT_EQ(masters(*loaded), saved);
  std::filesystem::remove(filler);
  ASSERT_TRUE(e->save_checkpoint(ckpt).ok()) << "with room again";
  EXPECT_EQ(read_latest(ckpt), "step-2");
}

TEST(Checkpoint, KeepLastRemovesTheOldestCompleteCheckpoints) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  namespace fs = std::filesystem;
  fs::create_directories(ckpt.path() + "/notes");  // the user's: no manifest
  for (int step = 1; step <= 4; ++step) {
    ASSERT_TRUE(train(*e, step - 1, step).ok());
    ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.keep_last = 2}).ok());
  }
  auto names = [&] {
    std::set<std::string> out;
    for (const auto& entry : fs::directory_iterator(ckpt.path())) out.insert(entry.path().filename().string());
    return out;
  };
  // .tierzero-save.lock: Note [One saver a folder].
  EXPECT_EQ(names(), (std::set<std::string>{".tierzero-save.lock", "latest", "notes", "step-3", "step-4"}));
  // A tagged save of the latest step without moving `latest`: step-4 stays (latest names it), the tag too.
  ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.tag = "snapshot", .save_latest = false, .keep_last = 1}).ok());
  EXPECT_EQ(names(), (std::set<std::string>{".tierzero-save.lock", "latest", "notes", "snapshot", "step-4"}));
  EXPECT_TRUE(e->load_checkpoint(ckpt.path()).ok());
}

// Note [Sealed manifests]: a manifest edited by hand (the step of rank-0.json
// from 1 to 9 once resumed at step 9 with step 1's weights, exit 0), an
// unsealed one, or a rank file and manifest.json from two saves are refused.
TEST(Checkpoint, AnEditedOrMismatchedManifestIsRefused) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 1).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.tag = "one"}).ok());
  ASSERT_TRUE(train(*e, 1, 2).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.tag = "two"}).ok());
  const std::string one = ckpt.path() + "/one", two = ckpt.path() + "/two";
  auto expect_corrupt = [&](const std::string& dir, const std::string& text) {
    const tz::Status s = e->load_checkpoint(dir);
    EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
  };
  auto rewrite = [](const std::string& path, const std::function<void(std::string&)>& edit) {
    std::stringstream text;
    text << std::ifstream(path).rdbuf();
    std::string s = text.str();
    edit(s);
    std::ofstream(path, std::ios::trunc) << s;
  };
  for (const char* file : {"/rank-0.json", "/manifest.json"}) {
    SCOPED_TRACE(file);
    const std::string path = one + file;
    std::stringstream saved;
    saved << std::ifstream(path).rdbuf();
    rewrite(path, [](std::string& s) {
      const auto at = s.find("\"step\": 1");
      ASSERT_NE(at, std::string::npos) << s;
      s.replace(at, 9, "\"step\": 9");
    });
    expect_corrupt(one, "checksum mismatch in " + path);
    nlohmann::json m = nlohmann::json::parse(saved.str());
    m.erase("xxh3");
    std::ofstream(path, std::ios::trunc) << m.dump(1);
    expect_corrupt(one, "has no checksum of its own");
    std::ofstream(path, std::ios::trunc) << saved.str();
    EXPECT_TRUE(e->load_checkpoint(one).ok());
  }
  // Each file sealed, but from different saves.
  std::filesystem::copy_file(two + "/manifest.json", one + "/manifest.json",
                             std::filesystem::copy_options::overwrite_existing);
  expect_corrupt(one, "manifest.json says step 2 by 1 ranks, but rank-0.json says step 1");
  // A format-1 checkpoint (unsealed) names the versions.
  nlohmann::json m = nlohmann::json::parse(std::ifstream(two + "/manifest.json"));
  m["version"] = 1;
  std::ofstream(two + "/manifest.json", std::ios::trunc) << tz::detail::sealed_text(m);
  expect_corrupt(two, "format version 1; this tierzero reads versions 2 to 3");
  e.reset();
  EXPECT_EQ(nvme.files(), std::vector<std::string>{}) << "the refused loads leave no swap file once the engine goes";
  for (const std::string& f : ckpt.files()) EXPECT_EQ(f.find(".partial"), std::string::npos) << f;
}

// Version 3 records each state's stored dtype (always fp32) and the run's
// formats; a version-2 checkpoint (neither) still loads, as fp32 states; a
// stored dtype this tierzero does not read is refused, naming the state.
TEST(Checkpoint, VersionThreeRecordsTheFormatsAndVersionTwoStillLoads) {
  TempDir nvme, ckpt;
  auto e = make(nvme.path(), kCpu);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 2).ok());
  ASSERT_TRUE(e->save_checkpoint(ckpt.path(), {.tag = "v"}).ok());
  const std::string dir = ckpt.path() + "/v";
  auto read = [](const std::string& path) {
    nlohmann::json m = nlohmann::json::parse(std::ifstream(path));
    m.erase("xxh3");
    return m;
  };
  const nlohmann::json rank = read(dir + "/rank-0.json"), top = read(dir + "/manifest.json");
  EXPECT_EQ(rank["version"], 3);
  EXPECT_EQ(rank["states"], (nlohmann::json{{"master", "fp32"}, {"moments", "fp32"}}));
  EXPECT_EQ(rank["blocks"][0]["states"]["exp_avg"]["dtype"], "fp32");
  const auto masters_before = masters(*e);
  // As version 2 wrote it.
  nlohmann::json v2 = rank, v2_top = top;
  v2["version"] = v2_top["version"] = 2;
  v2.erase("states");
  for (auto& block : v2["blocks"]) {
    for (auto& state : block["states"]) state.erase("dtype");
  }
  std::ofstream(dir + "/rank-0.json", std::ios::trunc) << tz::detail::sealed_text(v2);
  std::ofstream(dir + "/manifest.json", std::ios::trunc) << tz::detail::sealed_text(v2_top);
  ASSERT_TRUE(train(*e, 2, 3).ok());
  const tz::Status old = e->load_checkpoint(dir);
  ASSERT_TRUE(old.ok()) << old.to_string();
  EXPECT_EQ(masters(*e), masters_before);
  // A version-3 state stored as something else is refused by name, not read as fp32.
  nlohmann::json other = rank;
  other["blocks"][1]["states"]["exp_avg_sq"]["dtype"] = "int8";
  std::ofstream(dir + "/rank-0.json", std::ios::trunc) << tz::detail::sealed_text(other);
  std::ofstream(dir + "/manifest.json", std::ios::trunc) << tz::detail::sealed_text(top);
  const tz::Status refused = e->load_checkpoint(dir);
  EXPECT_EQ(refused.code(), tz::ErrorCode::kDataCorruption) << refused.to_string();
  EXPECT_NE(refused.message().find("exp_avg_sq of " + e->layout().blocks[1].name + " is stored as \"int8\"; this "
                                   "tierzero reads fp32 states"),
            std::string::npos)
      << refused.message();
  // A version-3 rank file without the run's formats is refused (every field required).
  nlohmann::json missing = rank;
  missing.erase("states");
  std::ofstream(dir + "/rank-0.json", std::ios::trunc) << tz::detail::sealed_text(missing);
  EXPECT_FALSE(e->load_checkpoint(dir).ok());
}

TEST(Checkpoint, AnNvmeErrorMidStepFailsTheStepAndLeavesTheSavedStateIntact) {
  TempDir nvme, ckpt;
  std::atomic<bool> armed{false};
  tz::ZeroOptions options{.config = test_config(nvme.path(), 3, 1), .placement = kNvme};
  options.nvme_fault_injector = [&](const tz::nvme::PieceInfo& p) {
    // EIO on every write once armed: the optimizer's write-back fails.
    return armed.load() && p.op == tz::nvme::IoOp::kWrite ? tz::nvme::Fault{.error = EIO} : tz::nvme::Fault{};
  };
  auto e = tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  ASSERT_TRUE(train(**e, 0, 2).ok());
  ASSERT_TRUE((*e)->save_checkpoint(ckpt.path()).ok());
  const auto saved = masters(**e);
  armed = true;
  const tz::Status failed = train(**e, 2, 3);
  ASSERT_FALSE(failed.ok()) << "the step must fail, not go on with half-written states";
  EXPECT_EQ(failed.code(), tz::ErrorCode::kIoError) << failed.to_string();
  EXPECT_NE(failed.message().find("Input/output error"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find(nvme.path()), std::string::npos) << "names the swap file: " << failed.message();
  // The checkpoint on disk is untouched and loads into a fresh engine.
  auto fresh = make(nvme.path(), kCpu);
  ASSERT_TRUE(fresh);
  ASSERT_TRUE(fresh->load_checkpoint(ckpt.path()).ok());
  EXPECT_EQ(masters(*fresh), saved);
}

// Note [Streamed checkpoints]: a load verifies the file, then reads each
// state again as it puts it. A state changed between the two reads, or a put
// that fails, leaves some blocks loaded and some not: every block is then
// unset, and the engine refuses to train or save until a load succeeds.
TEST(Checkpoint, AFileChangedDuringALoadOrAFailedPutLeavesEveryBlockUnsetUntilALoadSucceeds) {
  TempDir nvme, ckpt;
  enum Mode { kNone, kFailWrites, kCorruptOnFirstWrite };
  std::atomic<int> mode{kNone};
  std::string bin;
  std::uint64_t corrupt_at = 0;
  const auto flip = [&] {
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(corrupt_at));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(corrupt_at));
    f.write(&c, 1);
  };
  tz::ZeroOptions options{.config = test_config(nvme.path(), 3, 1), .placement = kNvme};
  options.nvme_fault_injector = [&](const tz::nvme::PieceInfo& p) {
    if (p.op != tz::nvme::IoOp::kWrite) return tz::nvme::Fault{};
    if (mode.load() == kFailWrites) return tz::nvme::Fault{.error = EIO};
    int armed = kCorruptOnFirstWrite;
    if (mode.compare_exchange_strong(armed, kNone)) flip();  // the load has verified the file and begun putting
    return tz::nvme::Fault{};
  };
  auto e = tz::ZeroEngine::create(options, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  tz::ZeroEngine& engine = **e;
  ASSERT_TRUE(train(engine, 0, 2).ok());
  ASSERT_TRUE(engine.save_checkpoint(ckpt.path()).ok());
  ASSERT_TRUE(train(engine, 2, 3).ok());
  const auto after_step_3 = masters(engine);
  bin = ckpt.path() + "/step-2/rank-0.bin";
  const nlohmann::json m = nlohmann::json::parse(std::ifstream(ckpt.path() + "/step-2/rank-0.json"));
  const nlohmann::json& last = m["blocks"].back()["states"]["exp_avg_sq"];  // the last state the load puts
  corrupt_at = last["offset"].get<std::uint64_t>() + last["bytes"].get<std::uint64_t>() / 2;
  const std::string last_block = engine.layout().blocks.back().name;

  const auto expect_all_unset = [&](const char* after) {
    for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) EXPECT_FALSE(engine.has_values(b)) << after << b;
    const tz::Status step = train(engine, 3, 4);
    EXPECT_EQ(step.code(), tz::ErrorCode::kFailedPrecondition) << step.to_string();
    const tz::Status save = engine.save_checkpoint(ckpt.path(), {.tag = "mixed"}).status();
    EXPECT_EQ(save.code(), tz::ErrorCode::kFailedPrecondition) << save.to_string();
    EXPECT_FALSE(std::filesystem::exists(ckpt.path() + "/mixed"));
  };
  mode = kCorruptOnFirstWrite;
  tz::Status s = engine.load_checkpoint(ckpt.path());
  EXPECT_EQ(mode.load(), kNone) << "the load wrote to NVMe";
  std::printf("[ load ] %s\n", s.to_string().c_str());
  EXPECT_EQ(s.code(), tz::ErrorCode::kDataCorruption) << s.to_string();
  for (const std::string& part : {std::string("checksum mismatch in exp_avg_sq of ") + last_block, bin,
                                  std::string("reading it again"), std::string("loaded in part")}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " in " << s.message();
  }
  expect_all_unset("after a changed file, block ");

  flip();  // the file as saved again; now every NVMe write fails
  mode = kFailWrites;
  s = engine.load_checkpoint(ckpt.path());
  EXPECT_EQ(s.code(), tz::ErrorCode::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("writing master of layer0"), std::string::npos) << s.message();
  mode = kNone;
  expect_all_unset("after a failed put, block ");

  ASSERT_TRUE(engine.load_checkpoint(ckpt.path()).ok());
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) EXPECT_TRUE(engine.has_values(b)) << b;
  ASSERT_TRUE(train(engine, 2, 3).ok());
  EXPECT_EQ(masters(engine), after_step_3) << "resumed from the checkpoint as if nothing had failed";
}

TEST(Checkpoint, TwoRanksSaveAndResumeBitIdentically) {
  TempDir dir;
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    const std::string nvme = dir.path() + "/nvme" + std::to_string(info.rank);
    std::filesystem::create_directories(nvme);
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    auto make_ranked = [&](const Placement& p) {
      return tz::ZeroEngine::create({.config = test_config(nvme, 3, 1), .comm = comm->get(), .placement = p},
                                    tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    };
    auto a = make_ranked(kNvme);
    if (!a.ok()) return 2;
    auto train_ranked = [&](tz::ZeroEngine& e, int from, int to) {
      for (int step = from; step < to; ++step) {
        if (!tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, info.rank, 0, step)).ok()) return false;
        if (!e.step().ok()) return false;
      }
      return true;
    };
    if (!train_ranked(**a, 0, 2) || !(*a)->save_checkpoint(dir.path() + "/ckpt").ok()) return 3;
    if (!train_ranked(**a, 2, 4)) return 4;
    const auto uninterrupted = masters(**a);
    auto b = make_ranked(kCpu);
    if (!b.ok()) return 5;
    const tz::Status loaded = (*b)->load_checkpoint(dir.path() + "/ckpt");
    if (!loaded.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", info.rank, loaded.to_string().c_str());
      return 6;
    }
    if (!train_ranked(**b, 2, 4)) return 7;
    return masters(**b) == uninterrupted ? 0 : 8;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// Over two ranks: a tag is replaced as on one; a refusal on one rank (its
// client state would not pack, a check of the loaded client state fails)
// fails the save or load on both, writing or replacing nothing; ranks that
// name different checkpoints are refused before anything is written.
TEST(Checkpoint, TwoRanksReplaceATagAndOneRanksRefusalFailsBoth) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  const auto codes = run_ranks(2, dir.path(), [&](const tz::RankInfo& info) -> int {
    const std::string nvme = dir.path() + "/nvme" + std::to_string(info.rank);
    std::filesystem::create_directories(nvme);
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    auto e = tz::ZeroEngine::create({.config = test_config(nvme, 3, 1), .comm = comm->get(), .placement = kCpu},
                                    tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    if (!e.ok()) return 2;
    auto step = [&](int s) {
      return tz::mlp::train_micro_batch(**e, kMlp, tz::mlp::make_batch(kMlp, info.rank, 0, s)).ok() && (*e)->step().ok();
    };
    auto fails_with = [&](const tz::Status& s, const std::string& text) {
      if (s.ok() || s.message().find(text) == std::string::npos) {
        std::fprintf(stderr, "rank %d: want an error with '%s', got: %s\n", info.rank, text.c_str(),
                     s.to_string().c_str());
        return false;
      }
      return true;
    };
    if (!step(0) || !(*e)->save_checkpoint(ckpt, {.tag = "t", .client_state = "one"}).ok()) return 3;
    if (!step(1) || !(*e)->save_checkpoint(ckpt, {.tag = "t", .client_state = "two"}).ok()) return 4;
    const auto at_save = masters(**e);
    // Rank 1 refuses: both fail, rank 0 saying the other rank did.
    const tz::Status refused = (*e)->save_checkpoint(ckpt, {.tag = "u", .refusal = info.rank == 1
                                                                             ? tz::invalid_argument("rank 1 says no")
                                                                             : tz::Status()})
                                   .status();
    if (!fails_with(refused, info.rank == 1 ? "rank 1 says no" : "1 other rank(s) failed")) return 5;
    // Different tags on the two ranks.
    const tz::Status split = (*e)->save_checkpoint(ckpt, {.tag = "r" + std::to_string(info.rank)}).status();
    if (!fails_with(split, "the ranks name different checkpoints")) return 6;
    if (!step(2)) return 7;
    // A check of the client state that fails on rank 0 only: nothing is replaced on either rank.
    const auto before = masters(**e);
    const tz::Status unchecked =
        (*e)->load_checkpoint(ckpt, {.tag = "t",
                                     .check_client_state = [&](const std::optional<std::string>& state) {
                                       return info.rank == 0 ? tz::invalid_argument("rank 0 dislikes '{}'",
                                                                                    state.value_or(""))
                                                             : tz::ok_status();
                                     }})
            .status();
    if (!fails_with(unchecked, info.rank == 0 ? "rank 0 dislikes 'two'" : "1 other rank(s) failed")) return 8;
    if (masters(**e) != before) return 9;
    const auto loaded = (*e)->load_checkpoint(ckpt, {.tag = "t"});
    if (!loaded.ok() || loaded->client_state != "two" || loaded->step != 2) return 10;
    return masters(**e) == at_save ? 0 : 11;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
  EXPECT_EQ(entries(ckpt), (std::set<std::string>{"latest", "t"})) << "the refused saves wrote nothing";
}

// A safetensors file parsed as the format says: u64 header length, JSON
// header, data.
struct Safetensors {
  explicit Safetensors(const std::string& path) : in(path, std::ios::binary) {
    in.read(reinterpret_cast<char*>(&header_len), 8);
    std::string text(header_len, '\0');
    in.read(text.data(), static_cast<std::streamsize>(header_len));
    header = nlohmann::json::parse(text);
  }
  // The fp32 tensor `name`, checked against the parameter's shape.
  std::vector<float> tensor(const std::string& name, const tz::ParamLayout& p) {
    const auto& t = header.at(name);
    EXPECT_EQ(t["dtype"], "F32") << name;
    EXPECT_EQ(t["shape"].get<std::vector<std::int64_t>>(), p.shape) << name;
    const auto offsets = t["data_offsets"].get<std::vector<std::uint64_t>>();
    std::vector<float> data(p.numel);
    in.seekg(static_cast<std::streamoff>(8 + header_len + offsets[0]));
    in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(p.numel * 4));
    return data;
  }
  std::ifstream in;
  std::uint64_t header_len = 0;
  nlohmann::json header;
};

// The exported tensors are the master weights: names[b][p] each.
void expect_export_holds_the_masters(tz::ZeroEngine& e, const std::string& path,
                                     const std::vector<std::vector<std::string>>& names) {
  Safetensors file(path);
  const auto m = masters(e);
  std::size_t tensors = 0;
  for (std::size_t b = 0; b < e.layout().blocks.size(); ++b) {
    for (std::size_t i = 0; i < e.layout().blocks[b].params.size(); ++i, ++tensors) {
      const tz::ParamLayout& p = e.layout().blocks[b].params[i];
      const std::vector<float> data = file.tensor(names[b][i], p);
      EXPECT_TRUE(std::equal(data.begin(), data.end(), m[b].begin() + static_cast<std::ptrdiff_t>(p.offset)))
          << names[b][i];
    }
  }
  EXPECT_EQ(file.header.size(), tensors);  // nothing else in the file
}

TEST(Checkpoint, ExportIsASafetensorsFileOfTheFullFp32Weights) {
  TempDir nvme, out;
  auto e = make(nvme.path(), kNvme);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 2).ok());
  const std::string path = out.file("model.safetensors");
  ASSERT_TRUE(e->export_safetensors(path).ok());
  std::vector<std::vector<std::string>> names;
  for (const tz::BlockLayout& b : e->layout().blocks) {
    names.emplace_back();
    for (const tz::ParamLayout& p : b.params) names.back().push_back(b.name + "." + p.name);
  }
  expect_export_holds_the_masters(*e, path, names);
  // And the safetensors package reads it (CI installs it; see scripts/setup.sh).
  const std::string cmd = "python3 -c \"from safetensors.numpy import load_file; t = load_file('" + path +
                          "'); assert t['layer1.w'].shape == (64, 64), t['layer1.w'].shape; print(len(t))\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// A framework's own names replace "<block>.<param>"; bad name lists are
// refused by what is wrong with them, before anything is written.
TEST(Checkpoint, ExportTakesTheCallersTensorNames) {
  TempDir nvme, out;
  auto e = make(nvme.path(), kNvme);
  ASSERT_TRUE(e);
  ASSERT_TRUE(train(*e, 0, 1).ok());
  const auto& blocks = e->layout().blocks;
  std::vector<std::vector<std::string>> names(blocks.size());
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    for (const tz::ParamLayout& p : blocks[b].params) names[b].push_back("model.layers." + std::to_string(b) + "." + p.name);
  }
  const std::string path = out.file("named.safetensors");
  ASSERT_TRUE(e->export_safetensors(path, names).ok());
  expect_export_holds_the_masters(*e, path, names);  // and no "<block>.<param>" names besides

  const std::string bad_path = out.file("bad.safetensors");
  auto refused = [&](std::vector<std::vector<std::string>> bad, const std::string& says) {
    const tz::Status s = e->export_safetensors(bad_path, bad);
    EXPECT_EQ(s.code(), tz::ErrorCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(says), std::string::npos) << s.message();
    EXPECT_FALSE(std::filesystem::exists(bad_path));
    EXPECT_FALSE(std::filesystem::exists(bad_path + ".tmp"));
  };
  auto fewer = names;
  fewer.pop_back();
  refused(fewer, "names has " + std::to_string(blocks.size() - 1) + " lists");
  auto short_block = names;
  short_block[0].pop_back();
  refused(short_block, "names[0] has");
  auto empty = names;
  empty[1][0].clear();
  refused(empty, "names[1][0]");
  auto twice = names;
  twice[1][0] = names[0][0];
  refused(twice, "two tensors are named '" + names[0][0] + "'");
}

}  // namespace
}  // namespace tzt
