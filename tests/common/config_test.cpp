#include "tierzero/common/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>

#include "tierzero/common/log.h"
#include "tierzero/common/units.h"
#include "tierzero/nvme/limits.h"

namespace tz {
namespace {

namespace fs = std::filesystem;

std::string fixture(std::string_view name) {
  return fmt::format("{}/tests/fixtures/configs/{}", TIERZERO_SOURCE_DIR, name);
}

// The shared copy is the reference; the tree carries a verbatim copy for
// checkouts without ../shared.
std::string zero_infinity_fixture() {
  std::string shared = TIERZERO_SHARED_DIR "/fixtures/ds_zero_infinity.json";
  return fs::exists(shared) ? shared : fixture("ds_zero_infinity.json");
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool contains(const std::vector<std::string>& items, std::string_view item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

std::size_t count_of(std::string_view haystack, std::string_view needle) {
  std::size_t n = 0;
  for (auto at = haystack.find(needle); at != std::string_view::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

Config parse_ok(std::string_view json) {
  Expected<Config> config = parse_config(json, "test.json");
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return config.ok() ? std::move(config).value() : Config{};
}

// The error is InvalidArgument, names the source, and contains every needle.
void expect_invalid(std::string_view json, std::initializer_list<std::string_view> needles) {
  Expected<Config> config = parse_config(json, "bad.json");
  ASSERT_FALSE(config.ok()) << "accepted: " << json;
  Status status = config.status();
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument) << status.to_string();
  const std::string& message = status.message();
  EXPECT_NE(message.find("bad.json"), std::string::npos) << message;
  for (std::string_view needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' missing from: " << message;
  }
}

// A fresh directory under the test temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string pattern = testing::TempDir() + "tz_config_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// ---- configs that load ------------------------------------------------------

TEST(Config, SharedZeroInfinityFixtureLoadsUnchanged) {
  Expected<Config> loaded = load_config(zero_infinity_fixture());
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const Config& c = *loaded;
  EXPECT_EQ(c.source, zero_infinity_fixture());
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_TRUE(c.precision.bf16);
  EXPECT_FALSE(c.precision.fp16);
  EXPECT_TRUE(c.optimizer.present);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  ASSERT_TRUE(c.zero.has_offload_param);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/local_nvme");
  EXPECT_TRUE(c.zero.offload_param.pin_memory);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1'000'000'000);
  ASSERT_TRUE(c.zero.has_offload_optimizer);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 1'048'576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_EQ(c.placement, PlacementMode::kDeepSpeed);
  EXPECT_EQ(c.backend, BackendChoice::kAuto);
  EXPECT_EQ(c.all_nvme_paths(), std::vector<std::string>{"/local_nvme"});
  for (std::string_view key : {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                               "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_max_reuse_distance",
                               "zero_optimization.offload_optimizer.fast_init",
                               "zero_optimization.offload_param.max_in_cpu",
                               "zero_optimization.offload_optimizer.pipeline_read"}) {
    EXPECT_TRUE(contains(c.ignored_keys, key)) << key;
  }
  EXPECT_EQ(c.ignored_keys.front(), "zero_optimization.contiguous_gradients") << "file order";
}

TEST(Config, IgnoredKeysAreLoggedOnceAsOneWarning) {
  ASSERT_TRUE(log::configure("info"));
  testing::internal::CaptureStderr();
  Expected<Config> loaded = load_config(zero_infinity_fixture());
  std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(count_of(err, "ignoring"), 1u) << err;
  EXPECT_EQ(count_of(err, "\n"), 1u) << err;
  EXPECT_NE(err.find("[tierzero:config]"), std::string::npos) << err;
  for (const std::string& key : loaded->ignored_keys) EXPECT_NE(err.find(key), std::string::npos) << key;

  testing::internal::CaptureStderr();
  Config quiet = parse_ok(R"({"zero_optimization": {"stage": 1}})");
  err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(quiet.ignored_keys.empty());
  EXPECT_EQ(err.find("ignoring"), std::string::npos) << err;
}

TEST(Config, CheckPathsNamesTheMissingNvmeMount) {
  Expected<Config> loaded = load_config(zero_infinity_fixture());
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  if (fs::exists("/local_nvme")) {
    // A machine with the fixture's mount: point the config at a path that cannot exist instead.
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    loaded->zero.offload_param.nvme_path = dir.path() + "/missing/local_nvme";
  }
  Status status = check_paths(*loaded);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), ErrorCode::kNotFound);
  EXPECT_NE(status.message().find(loaded->zero.offload_param.nvme_path), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("zero_optimization.offload_param.nvme_path"), std::string::npos)
      << status.message();
}

TEST(Config, CheckPathsPassesWhenNvmePathIsAWritableDirectory) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::string text = read_text(zero_infinity_fixture());
  for (auto at = text.find("/local_nvme"); at != std::string::npos; at = text.find("/local_nvme", at)) {
    text.replace(at, std::string_view("/local_nvme").size(), dir.path());
    at += dir.path().size();
  }
  Expected<Config> config = parse_config(text, "moved.json");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->all_nvme_paths(), std::vector<std::string>{dir.path()});
  Status status = check_paths(*config);
  EXPECT_TRUE(status.ok()) << status.to_string();
}

// One folder spelt twice ("/x", "/x/", a symlink to it) is one place to
// stripe over, not two drives sharing a disk.
TEST(Config, OneFolderSpeltTwiceIsOneNvmePath) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  fs::create_directories(dir.path() + "/a");
  fs::create_directories(dir.path() + "/b");
  fs::create_directory_symlink(dir.path() + "/a", dir.path() + "/link");
  Config c;
  c.tiers.nvme_paths = {dir.path() + "/a", dir.path() + "/a/", dir.path() + "/link", dir.path() + "/b"};
  EXPECT_EQ(c.all_nvme_paths(), (std::vector<std::string>{dir.path() + "/a", dir.path() + "/b"}));
}

TEST(Config, CheckPathsRejectsAFileAndNamesItsKey) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::string file = dir.path() + "/not_a_dir";
  std::ofstream(file) << "x";
  Config c;
  c.source = "striped.json";
  c.tiers.nvme_paths = {dir.path(), file};
  Status status = check_paths(c);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("tierzero.tiers.nvme_paths[1]"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find(file), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("not a directory"), std::string::npos) << status.message();
}

TEST(Config, CpuOffloadWithFp16DynamicScalingAndSchedulerLoads) {
  Expected<Config> loaded = load_config(fixture("ds_zero_offload_cpu_fp16.json"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const Config& c = *loaded;
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_TRUE(c.precision.fp16);
  EXPECT_FALSE(c.precision.bf16);
  EXPECT_DOUBLE_EQ(c.precision.loss_scale, 0.0);
  EXPECT_EQ(c.precision.initial_scale_power, 32);
  EXPECT_EQ(c.precision.loss_scale_window, 500);
  EXPECT_EQ(c.precision.hysteresis, 2);
  EXPECT_DOUBLE_EQ(c.precision.min_loss_scale, 1.0);
  EXPECT_EQ(c.optimizer.type, "AdamW") << "DeepSpeed's \"adam\" with adam_w_mode: true runs AdamW";
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_FALSE(c.zero.has_offload_param);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  ASSERT_TRUE(c.zero.has_offload_optimizer);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(c.placement, PlacementMode::kDeepSpeed);
  EXPECT_TRUE(c.all_nvme_paths().empty());
  EXPECT_TRUE(check_paths(c).ok());
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 1e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(c.scheduler.total_num_steps, 100000);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLog);
  // Ignored blocks are one entry each; nothing inside them is listed.
  EXPECT_FALSE(contains(c.ignored_keys, "scheduler")) << "the scheduler is read now";
  EXPECT_TRUE(contains(c.ignored_keys, "activation_checkpointing"));
  EXPECT_TRUE(contains(c.ignored_keys, "tensorboard"));
  EXPECT_TRUE(contains(c.ignored_keys, "fp16.auto_cast")) << "false: the feature stays off";
  EXPECT_FALSE(contains(c.ignored_keys, "optimizer.params.adam_w_mode")) << "read now";
  EXPECT_FALSE(contains(c.ignored_keys, "optimizer.params.bias_correction")) << "true is what tierzero does";
  EXPECT_TRUE(c.unresolved_auto.empty());
  for (const std::string& key : c.ignored_keys) {
    EXPECT_FALSE(key.starts_with("scheduler.")) << key;
    EXPECT_FALSE(key.starts_with("tensorboard.")) << key;
  }
  EXPECT_FALSE(contains(c.ignored_keys, "train_batch_size")) << "read now (Note [Batch keys])";
  EXPECT_EQ(c.batch_given.train_batch_size, 256);
}

// Note [Batch keys]: the three batch keys resolve as DeepSpeed's do, for the
// number of ranks the engine runs on.
TEST(Config, BatchKeysResolveAsDeepSpeedsForTheRanks) {
  auto resolved = [](std::string_view keys, int ranks) -> Expected<Config> {
    TZ_ASSIGN_OR_RETURN(Config c, parse_config(fmt::format("{{{}}}", keys), "ds.json"));
    TZ_TRY(resolve_batch(c, ranks));
    return c;
  };
  auto pair = [](const Expected<Config>& c) {
    return c.ok() ? std::pair{c->train_micro_batch_size_per_gpu, c->gradient_accumulation_steps}
                  : std::pair<std::int64_t, std::int64_t>{-1, -1};
  };
  // Two given derive the third; one train_batch_size alone means no accumulation.
  EXPECT_EQ(pair(resolved(R"("train_batch_size": 256, "train_micro_batch_size_per_gpu": 8)", 4)), std::pair(8L, 8L));
  EXPECT_EQ(pair(resolved(R"("train_batch_size": 64, "gradient_accumulation_steps": 4)", 2)), std::pair(8L, 4L));
  EXPECT_EQ(pair(resolved(R"("train_batch_size": 64)", 4)), std::pair(16L, 1L));
  EXPECT_EQ(pair(resolved(R"("train_micro_batch_size_per_gpu": 4)", 8)), std::pair(4L, 1L));
  // Note [Auto values]: an "auto" batch key is derived from the other two, or left unresolved.
  EXPECT_EQ(pair(resolved(R"("train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2)", 2)), std::pair(4L, 2L));
  Config autos = parse_ok(R"({"train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                              "train_micro_batch_size_per_gpu": 2})");
  EXPECT_EQ(autos.unresolved_auto, (std::vector<std::string>{"train_batch_size", "gradient_accumulation_steps"}));
  // All three must agree.
  Expected<Config> fixture_config = load_config(fixture("ds_zero_offload_cpu_fp16.json"));  // 256 = 8 x 4 x 8
  ASSERT_TRUE(fixture_config.ok());
  Config c = *fixture_config;
  ASSERT_TRUE(resolve_batch(c, 8).ok());
  EXPECT_EQ(pair(c), std::pair(8L, 4L));
  ASSERT_TRUE(resolve_batch(c, 8).ok()) << "resolving again for the same ranks changes nothing";
  Status s = resolve_batch(c, 2);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("train_batch_size = 256, but train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                             "x ranks = 8 x 4 x 2 = 64"),
            std::string::npos)
      << s.message();
  // A value that would not be whole.
  s = resolved(R"("train_batch_size": 100, "train_micro_batch_size_per_gpu": 8)", 3).status();
  EXPECT_NE(s.message().find("ds.json: train_batch_size = 100 is not a multiple of train_micro_batch_size_per_gpu x "
                             "ranks = 24, so gradient_accumulation_steps cannot be derived"),
            std::string::npos)
      << s.message();
  s = resolved(R"("train_batch_size": 0)", 1).status();
  EXPECT_NE(s.message().find("train_batch_size"), std::string::npos) << s.message();
  // Keys beyond any batch are refused by name (their products once overflowed: SIGFPE in a division).
  s = parse_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4611686018427387904})", "ds.json")
          .status();
  EXPECT_NE(s.message().find("train_micro_batch_size_per_gpu"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("1..2147483647"), std::string::npos) << s.message();
  // A Config built in code, its fields set directly, keeps them.
  Config coded;
  coded.gradient_accumulation_steps = 4;
  coded.train_micro_batch_size_per_gpu = 2;
  ASSERT_TRUE(resolve_batch(coded, 2).ok());
  EXPECT_EQ(pair(coded), std::pair(2L, 4L));
  EXPECT_EQ(coded.batch_given.train_batch_size, 16);
  // A tool's --grad-accum replaces the config's, and the train_batch_size given with it no longer binds.
  Config o = *fixture_config;
  override_gradient_accumulation_steps(o, 2);
  ASSERT_TRUE(resolve_batch(o, 1).ok());
  EXPECT_EQ(pair(o), std::pair(8L, 2L));
}

// Note [Auto values]
TEST(Config, HfTrainerAutoValuesAreResolvedFromTheFileOrListedAsUnresolved) {
  Expected<Config> loaded = load_config(fixture("hf_trainer_zero3_auto.json"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const Config& c = *loaded;
  Config defaults;
  EXPECT_FALSE(c.precision.fp16);
  EXPECT_FALSE(c.precision.bf16);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, defaults.optimizer.lr);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, defaults.optimizer.beta2);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, defaults.train_micro_batch_size_per_gpu);
  EXPECT_EQ(c.gradient_accumulation_steps, defaults.gradient_accumulation_steps);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, defaults.gradient_clipping);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, defaults.zero.stage3_prefetch_bucket_size);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, defaults.zero.stage3_param_persistence_threshold);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.placement, PlacementMode::kDeepSpeed);
  EXPECT_TRUE(contains(c.ignored_keys, "zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(contains(c.ignored_keys, "zero_optimization.stage3_gather_16bit_weights_on_model_save"));
  // The scheduler template: min "auto" is 0, max "auto" the optimizer's lr,
  // and the step count is left for the engine to refuse (nothing fills it in).
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_TRUE(c.scheduler.warmup_max_lr_auto);
  // What would change the run without a source to fill it from: the engine refuses these by name.
  EXPECT_EQ(c.unresolved_auto,
            (std::vector<std::string>{"fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                                      "optimizer.params.eps", "optimizer.params.weight_decay",
                                      "scheduler.params.warmup_num_steps", "gradient_clipping",
                                      "gradient_accumulation_steps", "train_batch_size",
                                      "train_micro_batch_size_per_gpu"}));
}

// DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; its "AdamW" is AdamW whatever adam_w_mode says.
TEST(Config, AdamMeansWhatItMeansInDeepSpeed) {
  auto type = [](std::string_view optimizer) {
    return parse_ok(fmt::format(R"({{"optimizer": {}}})", optimizer)).optimizer.type;
  };
  EXPECT_EQ(type(R"({"type": "Adam", "params": {"weight_decay": 0.1}})"), "AdamW");
  EXPECT_EQ(type(R"({"type": "adam", "params": {"adam_w_mode": true}})"), "AdamW");
  EXPECT_EQ(type(R"({"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}})"), "Adam");
  EXPECT_EQ(type(R"({"type": "ADAMW", "params": {"adam_w_mode": false}})"), "AdamW");
  EXPECT_EQ(type(R"({"type": "adagrad"})"), "Adagrad");
  expect_invalid(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": 1}}})",
                 {"optimizer.params.adam_w_mode", "true or false"});
  expect_invalid(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})",
                 {"optimizer.params.bias_correction", "false turns on Adam without bias correction"});
  expect_invalid(R"({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})",
                 {"optimizer.params.max_grad_norm", "gradient_clipping"});
}

// Note [DeepSpeed features tierzero lacks]: never "unknown key" for a key DeepSpeed knows.
TEST(Config, DeepSpeedFeaturesTierzeroLacksAreRefusedAsSuch) {
  for (const char* json : {
           R"({"expert_parallel": {"enabled": true, "autoep_size": 2}})",
           R"({"sequence_parallel_size": 2})",
           R"({"tensor_parallel": {"autotp_size": 4}})",
           R"({"gradient_allreduce_op": "SUM"})",
           R"({"managed_gradient_accumulation": false})",
           R"({"optimizer": {"type": "AdamW", "params": {"maximize": true}}})",
           R"({"torch_autocast": {"enabled": true}})",
           R"({"amp": {"enabled": true, "opt_level": "O1"}})",
           R"({"elasticity": {"enabled": true}})",
           R"({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})",
           R"({"fp16": {"enabled": true, "auto_cast": true}})",
           R"({"bf16": {"enabled": true, "bf16_optimizer_states": true}})",
       }) {
    Expected<Config> c = parse_config(json, "ds.json");
    ASSERT_FALSE(c.ok()) << json;
    EXPECT_NE(c.status().message().find("a DeepSpeed feature tierzero does not support"), std::string::npos)
        << c.status().message();
    EXPECT_EQ(c.status().message().find("unknown key"), std::string::npos) << c.status().message();
  }
  // The same keys leaving the feature off load, listed as ignored.
  Config off = parse_ok(R"({"expert_parallel": {"enabled": false}, "sequence_parallel_size": 1,
      "tensor_parallel": {"autotp_size": 1}, "torch_autocast": {"enabled": false}, "amp": {"enabled": false},
      "elasticity": {"enabled": false}, "fp16": {"auto_cast": false}, "log_level": "info"})");
  for (const char* key : {"expert_parallel", "sequence_parallel_size", "tensor_parallel", "torch_autocast", "amp",
                          "elasticity", "fp16.auto_cast", "log_level"}) {
    EXPECT_TRUE(contains(off.ignored_keys, key)) << key;
  }
  // Read with their meaning, which is tierzero's: not listed.
  Config same = parse_ok(R"({"gradient_allreduce_op": "mean", "managed_gradient_accumulation": true,
      "zero_optimization": {"stage": 3, "enable_sanity_checks": true}, "dataloader_drop_last": true})");
  EXPECT_TRUE(same.dataloader_drop_last);
  EXPECT_FALSE(contains(same.ignored_keys, "gradient_allreduce_op"));
  EXPECT_TRUE(contains(same.ignored_keys, "zero_optimization.enable_sanity_checks"));
}

// DeepSpeed's older form: "zero_optimization": true is stage 1, false stage 0.
TEST(Config, ZeroOptimizationAsABooleanIsStageOneOrZero) {
  EXPECT_EQ(parse_ok(R"({"zero_optimization": true, "allgather_size": 5e8})").zero.stage, 1);
  EXPECT_EQ(parse_ok(R"({"zero_optimization": false})").zero.stage, 0);
  expect_invalid(R"({"zero_optimization": 3})", {"zero_optimization", "an object (or true/false"});
}

TEST(Config, SchedulerBlocksReadTheirTypesParameters) {
  Config cosine = parse_ok(R"({"scheduler": {"params": {"total_num_steps": 5e4, "warmup_num_steps": 100,
      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear", "last_batch_iteration": -1},
      "type": "WarmupCosineLR"}})");
  EXPECT_EQ(cosine.scheduler.type, SchedulerType::kWarmupCosineLR) << "type may follow params";
  EXPECT_EQ(cosine.scheduler.total_num_steps, 50000);
  EXPECT_EQ(cosine.scheduler.warmup_num_steps, 100);
  EXPECT_DOUBLE_EQ(cosine.scheduler.warmup_min_ratio, 0.1);
  EXPECT_DOUBLE_EQ(cosine.scheduler.cos_min_ratio, 0.01);
  EXPECT_EQ(cosine.scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_TRUE(contains(cosine.ignored_keys, "scheduler.params.last_batch_iteration"));
  Config warmup = parse_ok(R"({"scheduler": {"type": "WarmupLR"}})");
  EXPECT_EQ(warmup.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_DOUBLE_EQ(warmup.scheduler.warmup_max_lr, 0.001) << "DeepSpeed's default";
  EXPECT_EQ(warmup.scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(parse_ok("{}").scheduler.type, SchedulerType::kNone);
  EXPECT_EQ(parse_ok(R"({"scheduler": null})").scheduler.type, SchedulerType::kNone);
}

TEST(Config, SchedulerMistakesNameTheKeyAndWhatIsAllowed) {
  expect_invalid(R"({"scheduler": {"params": {"warmup_num_steps": 10}}})",
                 {"scheduler.type", "missing", "\"WarmupLR\"", "\"WarmupCosineLR\""});
  expect_invalid(R"({"scheduler": {"type": "OneCycle"}})",
                 {"scheduler.type", "\"OneCycle\" is a DeepSpeed scheduler tierzero does not support", "\"WarmupLR\"",
                  "\"WarmupDecayLR\"", "\"WarmupCosineLR\"", "initialize(lr_scheduler=...)"});
  expect_invalid(R"({"scheduler": {"type": "StepLR"}})", {"scheduler.type", "torch.optim.lr_scheduler.StepLR"});
  expect_invalid(R"({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}})",
                 {"scheduler.params.cos_min_ratio", "not a parameter of WarmupLR", "warmup_max_lr"});
  expect_invalid(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 0.1, "total_num_steps": 9}}})",
                 {"scheduler.params.warmup_max_lr", "not a parameter of WarmupCosineLR", "cos_min_ratio"});
  expect_invalid(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})",
                 {"scheduler.params.total_num_steps", "missing", "WarmupDecayLR"});
  expect_invalid(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 100}}})",
                 {"scheduler.params.total_num_steps", "100 leaves no steps after the warm-up (100 steps)"});
  expect_invalid(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.001}}})",
                 {"scheduler.params.warmup_max_lr", "0.001 is below warmup_min_lr = 0.01"});
  expect_invalid(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.01, "total_num_steps": 9}}})",
                 {"scheduler.params.warmup_max_lr", "0.001 (the default) is below warmup_min_lr = 0.01"});
  expect_invalid(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})",
                 {"scheduler.params.warmup_type", "\"log\"", "\"linear\""});
  expect_invalid(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 1.5}}})",
                 {"scheduler.params.cos_min_ratio", "1.5", "[0, 1]"});
  expect_invalid(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}})",
                 {"scheduler.params.warmup_num_steps", "-1", ">= 0"});
  expect_invalid(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_stepz": 10}}})",
                 {"scheduler.params.warmup_num_stepz", "did you mean 'warmup_num_steps'?"});
  expect_invalid(R"({"scheduler": "WarmupLR"})", {"scheduler", "an object"});
}

TEST(Config, TierzeroBlockWithStripedNvmePathsAndByteStrings) {
  Expected<Config> loaded = load_config(fixture("tierzero_striped_nvme.json"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const Config& c = *loaded;
  EXPECT_EQ(c.backend, BackendChoice::kCuda);
  EXPECT_EQ(c.placement, PlacementMode::kAuto) << "explicit placement wins over the offload blocks";
  EXPECT_FALSE(c.tiers.gpu.is_auto);
  EXPECT_EQ(c.tiers.gpu.bytes, 72 * kGiB);
  EXPECT_EQ(c.tiers.cpu.bytes, 480'000'000'000ULL);
  EXPECT_EQ(c.tiers.nvme.bytes, 6'000'000'000'000ULL);
  EXPECT_EQ(c.tiers.numa_node, 1);
  std::vector<std::string> stripes = {"/mnt/nvme0/tz", "/mnt/nvme1/tz", "/mnt/nvme2/tz"};
  EXPECT_EQ(c.tiers.nvme_paths, stripes);
  EXPECT_EQ(c.all_nvme_paths(), stripes);
  EXPECT_EQ(c.optimizer.type, "Lion");
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.99);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_TRUE(c.zero.offload_param.nvme_path.empty()) << "the stripes serve it";
  EXPECT_EQ(c.zero.offload_param.buffer_count, 8);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 0);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 6);
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_EQ(c.zero.sub_group_size, 500'000'000);
  EXPECT_EQ(c.aio.block_size, 8 * 1'048'576);
  EXPECT_EQ(c.aio.queue_depth, 64);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(c.aio.sqpoll);
  EXPECT_TRUE(c.aio.fixed_buffers);
  EXPECT_FALSE(c.aio.allow_buffered_io);
  // Note [Inert keys]: read and checked, but nothing in tierzero uses them, and the warning says so.
  EXPECT_EQ(c.ignored_keys,
            (std::vector<std::string>{"zero_optimization.stage3_max_live_parameters",
                                      "zero_optimization.offload_param.buffer_count",
                                      "zero_optimization.offload_param.buffer_size",
                                      "zero_optimization.offload_param.max_in_cpu",
                                      "zero_optimization.offload_optimizer.buffer_count",
                                      "zero_optimization.offload_optimizer.pipeline_read",
                                      "zero_optimization.offload_optimizer.pipeline_write",
                                      "zero_optimization.offload_optimizer.ratio"}));
}

TEST(Config, EmptyConfigGivesDefaultsAndAutoPlacement) {
  Config c = parse_ok("{}");
  EXPECT_EQ(c.source, "test.json");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.placement, PlacementMode::kAuto);
  EXPECT_TRUE(c.tiers.gpu.is_auto);
  EXPECT_TRUE(c.tiers.cpu.is_auto);
  EXPECT_FALSE(c.tiers.numa_node.has_value());
  EXPECT_FALSE(c.optimizer.present);
  EXPECT_TRUE(c.ignored_keys.empty());
}

TEST(Config, LegacyCpuOffloadMeansOptimizerOffloadToCpu) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})");
  EXPECT_TRUE(c.zero.has_offload_optimizer);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.placement, PlacementMode::kDeepSpeed);
  expect_invalid(R"({"zero_optimization": {"cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})",
                 {"zero_optimization.cpu_offload", "offload_optimizer"});
}

TEST(Config, BfloatAliasAndNullDeviceAndNumaNumbers) {
  Config c = parse_ok(R"({"bfloat16": {"enabled": true},
                          "zero_optimization": {"offload_param": {"device": null, "nvme_path": null}},
                          "tierzero": {"tiers": {"numa_node": 0, "gpu_bytes": 8e10, "cpu_bytes": "auto"}}})");
  EXPECT_TRUE(c.precision.bf16);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.tiers.numa_node, 0);
  EXPECT_EQ(c.tiers.gpu.bytes, 80'000'000'000ULL);
  EXPECT_TRUE(c.tiers.cpu.is_auto);
}

// Note [Host memory on huge pages]: on unless the config says false; no "auto".
TEST(Config, HugePagesAreOnUnlessTurnedOff) {
  EXPECT_TRUE(parse_ok(R"({})").tiers.huge_pages);
  EXPECT_FALSE(parse_ok(R"({"tierzero": {"tiers": {"huge_pages": false}}})").tiers.huge_pages);
  EXPECT_TRUE(parse_ok(R"({"tierzero": {"tiers": {"huge_pages": true}}})").tiers.huge_pages);
  expect_invalid(R"({"tierzero": {"tiers": {"huge_pages": "auto"}}})", {"tierzero.tiers.huge_pages", "true or false"});
  expect_invalid(R"({"tierzero": {"tiers": {"huge_pages": 1}}})", {"tierzero.tiers.huge_pages"});
}

TEST(Config, WholeFloatsAreAcceptedForIntegerKeys) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3.0, "sub_group_size": 5e8,
                          "offload_param": {"device": "cpu", "buffer_count": 4e0}}})");
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.sub_group_size, 500'000'000);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 4);
}

TEST(Config, AllNvmePathsIsStripesThenOffloadPathsWithoutDuplicates) {
  Config c = parse_ok(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/b"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}},
      "tierzero": {"tiers": {"nvme_paths": ["/a", "/c"]}}})");
  EXPECT_EQ(c.all_nvme_paths(), (std::vector<std::string>{"/a", "/c", "/b"}));
  Config cpu = parse_ok(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_path": "/x"}}})");
  EXPECT_TRUE(cpu.all_nvme_paths().empty()) << "an nvme_path beside device cpu is unused";
}

TEST(Config, DeepSpeedAliasesSetTheSameFields) {
  Config c = parse_ok(R"({"aio": {"thread_count": 3},
      "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "max_live_parameters": 8,
                            "param_persistence_threshold": 9, "cpu_offload_param": true}})");
  EXPECT_EQ(c.aio.intra_op_parallelism, 3);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 7);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 8);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 9);
  EXPECT_TRUE(c.zero.has_offload_param);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  // Note [Inert keys]: checked and set, but the engine does not use it.
  EXPECT_EQ(c.ignored_keys, std::vector<std::string>{"zero_optimization.max_live_parameters"});
}

// ---- configs that are refused -----------------------------------------------

TEST(Config, MisspeltKeySuggestsTheNearestKey) {
  expect_invalid(R"({"zero_optimization": {"offload_param": {"device": "cpu", "nvme_pth": "/x"}}})",
                 {"zero_optimization.offload_param.nvme_pth", "did you mean 'nvme_path'?"});
  expect_invalid(R"({"zero_optimisation": {}})", {"zero_optimisation", "did you mean 'zero_optimization'?"});
}

TEST(Config, MisspeltKeyInTierzeroBlockSuggestsTheNearestKey) {
  expect_invalid(R"({"tierzero": {"tiers": {"cpu_byte": "1GB"}}})",
                 {"tierzero.tiers.cpu_byte", "did you mean 'cpu_bytes'?"});
  expect_invalid(R"({"tierzero": {"aio": {"sq_poll": true}}})", {"tierzero.aio.sq_poll", "'sqpoll'"});
}

TEST(Config, KeyAtTheWrongLevelSaysWhereItBelongs) {
  expect_invalid(R"({"zero_optimization": {"nvme_path": "/local_nvme"}})",
                 {"zero_optimization.nvme_path", "it belongs in zero_optimization.offload_param"});
  expect_invalid(R"({"stage": 3})", {"bad.json: stage: unknown key", "it belongs in zero_optimization"});
  expect_invalid(R"({"tierzero": {"block_size": 4096}})", {"tierzero.block_size", "belongs in aio"});
  expect_invalid(R"({"tierzero": {"tiers": {"nvme_path": "/x"}}})",
                 {"tierzero.tiers.nvme_path", "did you mean 'nvme_paths'?", "belongs in zero_optimization"});
}

TEST(Config, UnknownKeyFarFromAnyListsTheKnownKeys) {
  expect_invalid(R"({"tierzero": {"frobnicate": 1}})",
                 {"tierzero.frobnicate", "backend", "placement", "tiers", "aio"});
}

TEST(Config, WrongTypeNamesKeyValueAndExpectedType) {
  expect_invalid(R"({"aio": {"queue_depth": "8"}})", {"aio.queue_depth", "\"8\"", "an integer"});
  expect_invalid(R"({"zero_optimization": {"stage": {"value": 3}}})",
                 {"zero_optimization.stage", "{\"value\":3}", "expected an integer"});
  expect_invalid(R"({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}})",
                 {"zero_optimization.offload_param.pin_memory", "\"yes\"", "true, false"});
  expect_invalid(R"({"zero_optimization": "yes"})", {"zero_optimization", "expected an object"});
}

TEST(Config, OutOfRangeValuesNameTheAllowedRange) {
  expect_invalid(R"({"zero_optimization": {"stage": 4}})", {"zero_optimization.stage", "4", "0..3"});
  expect_invalid(R"({"aio": {"block_size": 1000}})", {"aio.block_size", "1000", "multiple of 4096"});
  expect_invalid(R"({"aio": {"block_size": 2147483648}})", {"aio.block_size", "1 GiB"});
  expect_invalid(R"({"aio": {"queue_depth": 0}})", {"aio.queue_depth", "0", "1..4096"});
  expect_invalid(R"({"aio": {"intra_op_parallelism": 2000}})", {"aio.intra_op_parallelism", "1..64"});
  expect_invalid(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})",
                 {"zero_optimization.offload_optimizer.ratio", "1.5", "(0, 1]"});
  expect_invalid(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0}}})", {"optimizer.params.lr", "> 0"});
  expect_invalid(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}})",
                 {"optimizer.params.betas[1]", "[0, 1)"});
  expect_invalid(R"({"train_micro_batch_size_per_gpu": 0})", {"train_micro_batch_size_per_gpu", "1..2147483647"});
  expect_invalid(R"({"gradient_clipping": -1})", {"gradient_clipping", "-1", ">= 0"});
  expect_invalid(R"({"zero_optimization": {"offload_param": {"buffer_count": 0}}})",
                 {"zero_optimization.offload_param.buffer_count", ">= 1"});
  expect_invalid(R"({"fp16": {"hysteresis": 1e10}})", {"fp16.hysteresis", "1..2147483647"});
  expect_invalid(R"({"zero_optimization": {"stage3_max_live_parameters": -1}})",
                 {"zero_optimization.stage3_max_live_parameters", "-1", ">= 0"});
}

// Note [Config key ranges]: each limit is the consuming code's own constant,
// so the loader takes the limit itself and refuses the next value, naming the
// key, the value and the range.
TEST(Config, AioRangesAreTheIoEnginesLimits) {
  const struct {
    std::string_view key;
    std::int64_t limit;
    std::int64_t step;  // the next value a key of this kind could take
  } limits[] = {
      {"queue_depth", nvme::kMaxQueueDepth, 1},
      {"intra_op_parallelism", nvme::kMaxRings, 1},
      {"thread_count", nvme::kMaxRings, 1},
      {"block_size", static_cast<std::int64_t>(nvme::kMaxBlockSizeBytes),
       static_cast<std::int64_t>(nvme::kBlockSizeAlignBytes)},
  };
  for (const auto& l : limits) {
    SCOPED_TRACE(l.key);
    EXPECT_TRUE(parse_config(fmt::format(R"({{"aio": {{"{}": {}}}}})", l.key, l.limit), "ok.json").ok());
    const std::string over = std::to_string(l.limit + l.step);
    expect_invalid(fmt::format(R"({{"aio": {{"{}": {}}}}})", l.key, over),
                   {fmt::format("aio.{}", l.key), over, std::to_string(l.limit)});
  }
}

TEST(Config, AutoTuneTrueIsRefusedNamingTheTuneSweepToRun) {
  expect_invalid(R"({"tierzero": {"aio": {"auto_tune": true}}})",
                 {"tierzero.aio.auto_tune", "not supported", "tierzero-nvme-bench --path DIR --tune"});
  expect_invalid(R"({"tierzero": {"aio": {"auto_tune": "auto"}}})", {"tierzero.aio.auto_tune", "true or false"});
  Config c = parse_ok(R"({"tierzero": {"aio": {"auto_tune": false}}})");
  EXPECT_TRUE(c.ignored_keys.empty());
}

// Note [Overlap events]: DeepSpeed's false (submit a batch, wait for all of
// it) is not what the rings do; it loads, with a warning naming the key.
TEST(Config, OverlapEventsFalseLoadsWithAWarningNamingTheKey) {
  ASSERT_TRUE(log::configure("info"));
  testing::internal::CaptureStderr();
  Config off = parse_ok(R"({"aio": {"overlap_events": false}})");
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("aio.overlap_events: false is not honoured"), std::string::npos) << err;
  EXPECT_NE(err.find("lower aio.queue_depth"), std::string::npos) << err;
  testing::internal::CaptureStderr();
  Config on = parse_ok(R"({"aio": {"overlap_events": true}})");
  parse_ok(R"({"aio": {"overlap_events": "auto"}})");
  err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("overlap_events"), std::string::npos) << err;
  expect_invalid(R"({"aio": {"overlap_events": 0}})", {"aio.overlap_events", "true, false"});
}

TEST(Config, BetasMustBeAPair) {
  expect_invalid(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95, 0.99]}}})",
                 {"optimizer.params.betas", "[0.9,0.95,0.99]", "2 numbers"});
}

TEST(Config, Fp16AndBf16TogetherAreRefused) {
  expect_invalid(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {"fp16.enabled", "bf16.enabled"});
}

TEST(Config, NvmeDeviceNeedsAPath) {
  expect_invalid(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
                 {"zero_optimization.offload_param.device", "nvme_path", "tierzero.tiers.nvme_paths"});
  expect_invalid(R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
                 {"zero_optimization.offload_optimizer.device", "\"disk\"", "\"none\", \"cpu\", \"nvme\""});
}

TEST(Config, FractionalIntegerIsRefused) {
  expect_invalid(R"({"zero_optimization": {"offload_param": {"buffer_count": 1.5}}})",
                 {"zero_optimization.offload_param.buffer_count", "whole number", "1.5"});
}

TEST(Config, MalformedJsonReportsLineAndColumn) {
  expect_invalid("{\n  \"aio\": {\n    \"queue_depth\": 8,\n  }\n}", {"malformed JSON", "line 4", "column 3"});
  expect_invalid("[1, 2]", {"JSON object"});
}

// Note [Parsing names the key]: a number beyond a double once aborted the
// trainer and the estimator (an uncaught out_of_range); two equal keys kept the
// last without a word.
TEST(Config, ANumberBeyondADoubleOrAKeyGivenTwiceNamesTheKey) {
  expect_invalid(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}})",
                 {"optimizer.params.lr", "number overflow", "1e400"});
  expect_invalid(R"({"zero_optimization": {"stage": 3}, "x": [1, {"y": -1e999}]})", {"x[].y", "number overflow"});
  expect_invalid(R"({"optimizer": {"params": {"lr": 1e-3, "eps": 1e-8, "lr": 2e-3}}})",
                 {"optimizer.params.lr is given twice"});
  expect_invalid(R"({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.5})",
                 {"gradient_clipping is given twice"});
  // The same key in two objects is two keys.
  EXPECT_TRUE(parse_config(R"({"zero_optimization": {"offload_param": {"device": "cpu"},
                                                      "offload_optimizer": {"device": "cpu"}}})").ok());
}

TEST(Config, BadByteStringNamesKeyAndText) {
  expect_invalid(R"({"tierzero": {"tiers": {"cpu_bytes": "80 gigs"}}})",
                 {"tierzero.tiers.cpu_bytes", "80 gigs", "GiB"});
  expect_invalid(R"({"tierzero": {"tiers": {"nvme_bytes": true}}})", {"tierzero.tiers.nvme_bytes", "\"auto\""});
}

TEST(Config, UnknownOptimizerTypeListsTheSupportedOnes) {
  expect_invalid(R"({"optimizer": {"type": "OneBitAdam"}})",
                 {"optimizer.type", "\"OneBitAdam\" is a DeepSpeed optimizer tierzero does not support", "\"Adam\"",
                  "\"AdamW\"", "\"Adagrad\"", "\"Lion\""});
  expect_invalid(R"({"optimizer": {"type": "SGD"}})", {"optimizer.type", "torch.optim.SGD", "\"AdamW\""});
}

TEST(Config, NegativeNumaNodeIsRefused) {
  expect_invalid(R"({"tierzero": {"tiers": {"numa_node": -1}}})", {"tierzero.tiers.numa_node", "-1", "\"auto\""});
}

TEST(Config, TierzeroEnumsAndPathListsAreChecked) {
  expect_invalid(R"({"tierzero": {"backend": "rocm"}})", {"tierzero.backend", "\"rocm\"", "\"host\""});
  expect_invalid(R"({"tierzero": {"placement": "manual"}})", {"tierzero.placement", "\"deepspeed\""});
  expect_invalid(R"({"tierzero": {"tiers": {"nvme_paths": ["/a", "/a"]}}})",
                 {"tierzero.tiers.nvme_paths[1]", "listed twice"});
  expect_invalid(R"({"tierzero": {"tiers": {"nvme_paths": "/a"}}})", {"tierzero.tiers.nvme_paths", "array"});
  expect_invalid(R"({"tierzero": {"aio": {"sqpoll": "auto"}}})", {"tierzero.aio.sqpoll", "true or false"});
}

// Note [When to speculate] (engine/src/step_ahead.h): "auto" by default,
// true speculates in every window, false never; nothing else.
TEST(Config, StepUnderBackwardTakesTrueFalseOrAuto) {
  EXPECT_EQ(parse_ok("{}").step_under_backward, StepUnderBackward::kAuto);
  EXPECT_EQ(parse_ok(R"({"tierzero": {"step_under_backward": "auto"}})").step_under_backward,
            StepUnderBackward::kAuto);
  EXPECT_EQ(parse_ok(R"({"tierzero": {"step_under_backward": true}})").step_under_backward,
            StepUnderBackward::kAlways);
  EXPECT_EQ(parse_ok(R"({"tierzero": {"step_under_backward": false}})").step_under_backward,
            StepUnderBackward::kOff);
  EXPECT_TRUE(parse_ok(R"({"tierzero": {"step_under_backward": "auto"}})").unresolved_auto.empty());
  for (const char* bad : {R"("always")", "1", R"("true")", R"(["auto"])"}) {
    expect_invalid(fmt::format(R"({{"tierzero": {{"step_under_backward": {}}}}})", bad),
                   {"tierzero.step_under_backward", "true, false or \"auto\""});
  }
}

// ---- tierzero.states (Note [State formats]) ----------------------------------

TEST(Config, StatesDefaultToFp32MasterAndMoments) {
  const Config c = parse_ok("{}");
  EXPECT_EQ(c.states.master, MasterFormat::kFp32);
  EXPECT_EQ(c.states.moments, MomentFormat::kFp32);
  EXPECT_TRUE(c.states.is_default());
  EXPECT_TRUE(parse_ok(R"({"tierzero": {"states": {}}})").states.is_default());
  EXPECT_TRUE(parse_ok(R"({"tierzero": {"states": null}})").states.is_default());
}

TEST(Config, StatesReadEachFormatByItsName) {
  for (const auto& [name, format] : {std::pair{"fp32", MomentFormat::kFp32}, std::pair{"bf16", MomentFormat::kBf16},
                                     std::pair{"int8", MomentFormat::kInt8}}) {
    const Config c = parse_ok(fmt::format(R"({{"tierzero": {{"states": {{"moments": "{}"}}}}}})", name));
    EXPECT_EQ(c.states.moments, format) << name;
    EXPECT_EQ(c.states.master, MasterFormat::kFp32) << name;
  }
  // The bf16 block may come after the tierzero block.
  const Config c = parse_ok(R"({"tierzero": {"states": {"master": "remainder", "moments": "int8"}},
                                "bf16": {"enabled": true}})");
  EXPECT_EQ(c.states.master, MasterFormat::kRemainder);
  EXPECT_EQ(c.states.moments, MomentFormat::kInt8);
  EXPECT_FALSE(c.states.is_default());
}

TEST(Config, BadStateFormatNamesTheKeyTheValueAndTheAllowedOnes) {
  expect_invalid(R"({"tierzero": {"states": {"master": "fp16"}}})",
                 {"tierzero.states.master", "\"fp16\"", "\"fp32\", \"remainder\""});
  expect_invalid(R"({"tierzero": {"states": {"moments": "fp8"}}})",
                 {"tierzero.states.moments", "\"fp8\"", "\"fp32\", \"bf16\", \"int8\""});
  expect_invalid(R"({"tierzero": {"states": {"moments": "INT8"}}})", {"tierzero.states.moments", "\"INT8\""});
  expect_invalid(R"({"tierzero": {"states": {"moments": 8}}})", {"tierzero.states.moments", "8", "\"int8\""});
  expect_invalid(R"({"tierzero": {"states": {"masters": "fp32"}}})", {"tierzero.states.masters", "'master'"});
  expect_invalid(R"({"tierzero": {"states": "int8"}})", {"tierzero.states", "an object"});
}

TEST(Config, RemainderMasterNeedsBf16AndSaysWhatToUse) {
  expect_invalid(R"({"fp16": {"enabled": true}, "tierzero": {"states": {"master": "remainder"}}})",
                 {"tierzero.states.master", "\"remainder\"", "bf16 parameters", "fp16.enabled is true", "exponent",
                  "train in bf16", "\"master\": \"fp32\""});
  expect_invalid(R"({"tierzero": {"states": {"master": "remainder", "moments": "bf16"}}})",
                 {"tierzero.states.master", "\"remainder\"", "fp32 training", "no 16-bit parameter",
                  "enable bf16", "\"master\": \"fp32\""});
  // The compact moments need no particular precision.
  EXPECT_EQ(parse_ok(R"({"fp16": {"enabled": true}, "tierzero": {"states": {"moments": "int8"}}})").states.moments,
            MomentFormat::kInt8);
  EXPECT_EQ(parse_ok(R"({"tierzero": {"states": {"moments": "bf16"}}})").states.moments, MomentFormat::kBf16);
}

TEST(Config, ToolOverridesOfTheStatesAreCheckedAgain) {
  Config c = parse_ok(R"({"bf16": {"enabled": true}, "tierzero": {"states": {"master": "remainder"}}})");
  EXPECT_TRUE(check_state_formats(c).ok());
  ASSERT_TRUE(set_training_precision(c, "fp16").ok());
  const Status refused = check_state_formats(c);
  EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("test.json: tierzero.states.master"), std::string::npos) << refused.message();
  ASSERT_TRUE(set_master_format(c, "fp32").ok());
  EXPECT_TRUE(check_state_formats(c).ok());
  ASSERT_TRUE(set_moment_format(c, "bf16").ok());
  EXPECT_EQ(c.states.moments, MomentFormat::kBf16);
  const Status bad = set_moment_format(c, "int4");
  EXPECT_EQ(bad.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("tierzero.states.moments 'int4': expected fp32, bf16, int8"), std::string::npos)
      << bad.message();
  EXPECT_EQ(c.states.moments, MomentFormat::kBf16) << "a refused name changes nothing";
  EXPECT_FALSE(set_master_format(c, "bf16").ok());
  Config no_source;  // built in code: the message starts with the key
  no_source.states.master = MasterFormat::kRemainder;
  EXPECT_TRUE(check_state_formats(no_source).message().starts_with("tierzero.states.master"))
      << check_state_formats(no_source).message();
}

// ---- data_types.grad_accum_dtype (Note [16-bit gradient accumulators]) -------

TEST(Config, GradAccumDtypeDefaultsToFp32AndReadsDeepSpeedsSpellings) {
  EXPECT_EQ(parse_ok("{}").states.grads, GradFormat::kFp32);
  EXPECT_EQ(parse_ok(R"({"data_types": {}})").states.grads, GradFormat::kFp32);
  EXPECT_EQ(parse_ok(R"({"data_types": null})").states.grads, GradFormat::kFp32);
  EXPECT_EQ(parse_ok(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": null}})").states.grads,
            GradFormat::kFp32);
  for (const char* name : {"bf16", "bfloat16", "torch.bfloat16"}) {
    // The bf16 block may come after data_types.
    const Config c = parse_ok(fmt::format(R"({{"data_types": {{"grad_accum_dtype": "{}"}}, "bf16": {{"enabled": true}}}})", name));
    EXPECT_EQ(c.states.grads, GradFormat::kBf16) << name;
    EXPECT_FALSE(c.states.is_default()) << name;
    EXPECT_TRUE(c.ignored_keys.empty()) << name << ": " << fmt::format("{}", fmt::join(c.ignored_keys, ", "));
  }
  for (const char* name : {"fp16", "float16", "half", "torch.float16"}) {
    const Config c = parse_ok(fmt::format(R"({{"fp16": {{"enabled": true}}, "data_types": {{"grad_accum_dtype": "{}"}}}})", name));
    EXPECT_EQ(c.states.grads, GradFormat::kFp16) << name;
  }
  for (const char* name : {"fp32", "float32", "float", "torch.float32"}) {
    const Config c = parse_ok(fmt::format(R"({{"data_types": {{"grad_accum_dtype": "{}"}}}})", name));
    EXPECT_EQ(c.states.grads, GradFormat::kFp32) << name;
  }
}

TEST(Config, GradAccumDtypeOtherThanFp32OrTheTrainingDtypeIsRefusedNamingTheKey) {
  expect_invalid(R"({"fp16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}})",
                 {"data_types.grad_accum_dtype", "\"bf16\"", "fp16 training", "\"fp32\"", "\"fp16\""});
  expect_invalid(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp16"}})",
                 {"data_types.grad_accum_dtype", "\"fp16\"", "bf16 training", "\"fp32\"", "\"bf16\""});
  expect_invalid(R"({"data_types": {"grad_accum_dtype": "bf16"}})",
                 {"data_types.grad_accum_dtype", "\"bf16\"", "fp32 training"});
  expect_invalid(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "int8"}})",
                 {"data_types.grad_accum_dtype", "\"int8\"", "\"fp32\"", "\"bf16\""});
  expect_invalid(R"({"data_types": {"grad_accum_dtype": "BF16"}})", {"data_types.grad_accum_dtype", "\"BF16\""});
  expect_invalid(R"({"data_types": {"grad_accum_dtype": 16}})", {"data_types.grad_accum_dtype", "16"});
  expect_invalid(R"({"data_types": {"grad_acum_dtype": "bf16"}})", {"data_types.grad_acum_dtype", "'grad_accum_dtype'"});
  expect_invalid(R"({"data_types": "bf16"})", {"data_types", "an object"});
}

TEST(Config, ToolOverridesOfTheGradAccumDtypeAreCheckedAgain) {
  Config c = parse_ok(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}})");
  EXPECT_TRUE(check_state_formats(c).ok());
  ASSERT_TRUE(set_training_precision(c, "fp16").ok());
  const Status refused = check_state_formats(c);
  EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("test.json: data_types.grad_accum_dtype"), std::string::npos) << refused.message();
  ASSERT_TRUE(set_grad_format(c, "fp16").ok());
  EXPECT_TRUE(check_state_formats(c).ok());
  const Status bad = set_grad_format(c, "int8");
  EXPECT_NE(bad.message().find("data_types.grad_accum_dtype 'int8': expected fp32, bf16, fp16"), std::string::npos)
      << bad.message();
  EXPECT_EQ(c.states.grads, GradFormat::kFp16) << "a refused name changes nothing";
}

TEST(Config, PartialOptimizerOffloadNeedsStage3) {
  expect_invalid(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})",
                 {"zero_optimization.offload_optimizer.ratio", "stage 3"});
}

TEST(Config, LoadConfigOnAMissingFileIsNotFound) {
  Expected<Config> loaded = load_config("/nonexistent/tz/ds_config.json");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(loaded.status().message().find("/nonexistent/tz/ds_config.json"), std::string::npos)
      << loaded.status().message();
}

TEST(Config, LoadConfigErrorsNameTheFile) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::string path = dir.path() + "/ds_config.json";
  std::ofstream(path) << R"({"aio": {"queue_depth": -3}})";
  Expected<Config> loaded = load_config(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find(path), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("aio.queue_depth"), std::string::npos) << loaded.status().message();
}

}  // namespace
}  // namespace tz
