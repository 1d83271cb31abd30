// tierzero-train: trains a GPT-style decoder (tierzero/train/gpt.h) on the
// shipped byte-level corpus through ZeroEngine, with the model states on the
// tiers the config gives, and reports what the tiers did.
//
//   tierzero-train                                   # --preset cpu, examples/train_cpu_nvme.json
//   tierzero-train --config ds_config.json --layers 6 --hidden 384 --heads 6 --seq 128 --batch 4 --steps 300
//       --nvme-path /var/tmp/tz --out run1 --eval-every 50 --save ckpt --json run1/summary.json
//   tierzero-train --resume ckpt --steps 100         # continues where ckpt/latest left off
//
// Prints a progress line every --log-every steps and a summary at the end;
// writes (under --out unless given their own paths) summary.json, loss.csv,
// loss.png and trace.json (a Chrome trace of the second step: the first
// records the prefetch trace). Ranks start as for any tierzero program
// (torchrun / mpirun variables); rank 0 prints and writes.
//
// SIGINT or SIGTERM stops the run when the step under way ends: it writes the
// same files (the summary says which signal stopped it after which step),
// removes its swap files and ends by that signal (a shell reports 128 + N); a
// second signal aborts at once, removing the swap files first (Note
// [Stopping on a signal] in stop_signals.cpp).
//
// Where the GPT computes: --backend (default: the config's tierzero.backend,
// "auto" in the shipped config). "auto" takes the GPU when this build has
// CUDA and one is present, the CPU otherwise. On the CPU the engine runs on
// its Host backend ("device" memory is host memory, budgeted by
// tierzero.tiers.gpu_bytes as a GPU's would be); on CUDA the GPT runs as
// CUDA kernels and cuBLAS (TF32 unless --no-tf32) with the engine on the GPU.
// The shipped config offloads the optimizer states to NVMe; with none
// offloaded, on CUDA the engine's GPU optimizer steps them there (Adam and
// AdamW; Note [GPU optimizer] in engine/src/zero_engine.cpp).
#include <CLI/CLI.hpp>
#include <tbb/global_control.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "stop_signals.h"
#include "tierzero/train.h"
#include "train_report.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using tz::tool::EvalRecord;
using tz::tool::StepRecord;

struct Preset {
  const char* name;
  int layers, hidden, heads, seq;
  std::int64_t steps;
  const char* about;
};

// "cpu" is the default: with examples/train_cpu_nvme.json's 32 MiB device
// budget its model states (10.8M params x 16 B = 173 MB) are 5.1x the
// device, and 300 steps of 4 x 128 tokens take ~5 minutes on 2 cores.
constexpr Preset kPresets[] = {
    {"tiny", 2, 64, 4, 64, 60, "0.1M params: a smoke test, seconds"},
    {"cpu", 6, 384, 6, 128, 300, "10.8M params: the default on a machine without a GPU, minutes"},
    {"small", 8, 512, 8, 256, 1000, "25.4M params"},
    {"gpt2", 12, 768, 12, 1024, 1000, "GPT-2 small's shape with byte tokens: 86M params"},
};

struct Flags {
  std::string config_path, preset = "cpu", data_path, nvme_path, out_dir = "tierzero-train-out";
  std::string backend;   // "", "auto", "cuda", "host": empty follows the config
  std::string gpu_bytes; // "", "auto" or a size: replaces tierzero.tiers.gpu_bytes
  std::string master, moments;  // "" or a format name: replace tierzero.states.master / .moments
  std::string grad_accum_dtype;  // "" or fp32 | bf16 | fp16: replaces data_types.grad_accum_dtype
  bool tf32 = true;      // CUDA only
  std::optional<int> layers, hidden, heads, seq, batch;
  std::optional<std::int64_t> steps;
  std::optional<std::int64_t> until_step;  // --until-step: the step count to reach, resumed or not
  std::string json_path, csv_path, plot_path, trace_path, save_dir, resume_dir, io_log_path;
  int eval_every = 50, eval_batches = 4, save_every = 0, log_every = 10, threads = 0;
  double collective_timeout_s = 300;  // per collective and for the rendezvous
  bool resume_if_present = false;     // --resume DIR with nothing there yet starts fresh
  bool save_on_stop = false;          // a signal saves the last completed step under --save
  int keep_last = 0;                  // checkpoints kept under --save (0: all)
  std::optional<std::int64_t> warmup_steps;  // unset: tz::train::default_warmup_steps (Note [Default warm-up])
  std::uint64_t data_seed = 1234, init_seed = 1234;
  std::string command;
};

std::string exe_dir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : self.parent_path().string();
}

tz::Expected<std::string> default_config_path() {
  const std::string installed =
      (fs::path(exe_dir()) / ".." / TIERZERO_INSTALL_EXAMPLES_DIR / "train_cpu_nvme.json").string();
  if (fs::exists(installed)) return fs::weakly_canonical(installed).string();
  const std::string source = std::string(TIERZERO_EXAMPLES_DIR) + "/train_cpu_nvme.json";
  if (fs::exists(source)) return source;
  return tz::not_found("no --config given and the default train_cpu_nvme.json is in neither {} nor {}", installed,
                       source);
}

// The backend the run computes on: --backend, else the config's; "auto"
// becomes CUDA when this build has the CUDA GPT and a GPU is present.
tz::Expected<tz::BackendChoice> choose_backend(const Flags& f, const tz::Config& config) {
  tz::BackendChoice choice = config.backend;
  if (f.backend == "cuda") choice = tz::BackendChoice::kCuda;
  if (f.backend == "host") choice = tz::BackendChoice::kHost;
  if (f.backend == "auto") choice = tz::BackendChoice::kAuto;
  const tz::CudaCapabilities& cuda = tz::capabilities().cuda;
  if (choice == tz::BackendChoice::kCuda && !tz::train::cuda_gpt_built()) {
    return tz::unavailable("{}: this tierzero-train was built without CUDA (TIERZERO_CUDA=OFF); use \"auto\" or "
                           "\"host\"", f.backend.empty() ? f.config_path + ": tierzero.backend \"cuda\"" : "--backend cuda");
  }
  if (choice == tz::BackendChoice::kAuto) {
    choice = tz::train::cuda_gpt_built() && cuda.device_count > 0 ? tz::BackendChoice::kCuda : tz::BackendChoice::kHost;
  }
  return choice;
}

// The config, with --nvme-path and the backend applied.
tz::Expected<tz::Config> load_train_config(Flags& f) {
  if (f.config_path.empty()) {
    TZ_ASSIGN_OR_RETURN(f.config_path, default_config_path());
  }
  TZ_ASSIGN_OR_RETURN(tz::Config config, tz::load_config(f.config_path));
  if (f.warmup_steps.value_or(0) > 0 && config.scheduler.type != tz::SchedulerType::kNone) {
    return tz::invalid_argument("--warmup-steps {} and the scheduler block of {} ({}) both set the learning rate; "
                                "use one of them", *f.warmup_steps, f.config_path,
                                tz::scheduler_name(config.scheduler.type));
  }
  TZ_ASSIGN_OR_RETURN(config.backend, choose_backend(f, config));
  if (f.gpu_bytes == "auto") config.tiers.gpu = tz::ByteBudget::automatic();
  if (!f.gpu_bytes.empty() && f.gpu_bytes != "auto") {
    TZ_ASSIGN_OR_RETURN(std::uint64_t bytes, tz::parse_bytes(f.gpu_bytes));
    config.tiers.gpu = tz::ByteBudget::of(bytes);
  }
  if (!f.master.empty()) TZ_TRY(tz::set_master_format(config, f.master));
  if (!f.moments.empty()) TZ_TRY(tz::set_moment_format(config, f.moments));
  if (!f.grad_accum_dtype.empty()) TZ_TRY(tz::set_grad_format(config, f.grad_accum_dtype));
  if (const tz::Status s = tz::check_state_formats(config); !s.ok()) {  // --master remainder on an fp16 config, say
    return tz::invalid_argument("{} (on the command line: --master, --grad-accum-dtype)", s.message());
  }
  if (!f.nvme_path.empty()) {  // one directory for everything on NVMe, replacing the config's
    config.tiers.nvme_paths = {f.nvme_path};
    config.zero.offload_param.nvme_path = f.nvme_path;
    config.zero.offload_optimizer.nvme_path = f.nvme_path;
  }
  for (const std::string& p : config.all_nvme_paths()) {
    std::error_code ec;
    fs::create_directories(p, ec);
    if (ec) return tz::io_error("creating the NVMe directory {}: {}", p, ec.message());
  }
  TZ_TRY(tz::check_paths(config));
  return config;
}

tz::Expected<tz::train::GptConfig> gpt_config(const Flags& f, const tz::Config& config) {
  const Preset* preset = nullptr;
  for (const Preset& p : kPresets) {
    if (f.preset == p.name) preset = &p;
  }
  if (preset == nullptr) return tz::invalid_argument("--preset {}: not one of tiny, cpu, small, gpt2", f.preset);
  tz::train::GptConfig cfg{.layers = f.layers.value_or(preset->layers), .hidden = f.hidden.value_or(preset->hidden),
                           .heads = f.heads.value_or(preset->heads), .seq = f.seq.value_or(preset->seq),
                           .batch = f.batch.value_or(static_cast<int>(config.train_micro_batch_size_per_gpu)),
                           .seed = f.init_seed};
  TZ_TRY_CTX(cfg.validate(), "--layers/--hidden/--heads/--seq/--batch");
  return cfg;
}

// The steps this run takes after `first` (the resumed step, or 0):
// --until-step's remainder (a restart loop's fixed command line), else
// --steps, else the preset's.
std::int64_t preset_steps(const Flags& f, std::int64_t first) {
  if (f.until_step) return std::max<std::int64_t>(0, *f.until_step - first);
  for (const Preset& p : kPresets) {
    if (f.preset == p.name) return f.steps.value_or(p.steps);
  }
  return f.steps.value_or(300);
}

// The warm-up a run uses and how it was chosen (printed at the start).
struct Warmup {
  std::int64_t steps = 0;
  std::string about;
};

// The client state tierzero-train saves with its checkpoints: the warm-up a
// resumed run must keep (its default depends on the flags of the first run).
std::string client_state(const Warmup& warmup) {
  return nlohmann::json{{"tierzero_train", {{"warmup_steps", warmup.steps}}}}.dump();
}

// The warm-up of the checkpoint --resume loads, as its run saved it.
// --resume-if-present: a restart loop's first run finds nothing to resume
// and starts fresh; anything there (a `latest`, a complete checkpoint, a
// manifest) is resumed or refused as --resume alone would: a broken
// checkpoint is never taken for "nothing yet".
bool nothing_to_resume(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return true;
  if (fs::exists(fs::path(dir) / "latest", ec) || fs::exists(fs::path(dir) / "manifest.json", ec)) return false;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (e.is_directory(ec) && fs::exists(e.path() / "manifest.json", ec)) return false;
  }
  return true;
}

tz::Expected<std::int64_t> saved_warmup(const std::string& dir) {
  TZ_ASSIGN_OR_RETURN(std::optional<std::string> state, tz::read_checkpoint_client_state(dir, ""));
  const std::string advice = "give --warmup-steps N (0: none, as tierzero-train did by default before it saved one)";
  if (!state) return tz::invalid_argument("--resume {}: the checkpoint records no learning-rate warm-up; {}", dir, advice);
  const nlohmann::json j = nlohmann::json::parse(*state, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("tierzero_train") || !j["tierzero_train"].contains("warmup_steps") ||
      !j["tierzero_train"]["warmup_steps"].is_number_integer()) {
    return tz::invalid_argument("--resume {}: the checkpoint's client state holds no tierzero_train.warmup_steps "
                                "(not saved by tierzero-train?); {}", dir, advice);
  }
  return j["tierzero_train"]["warmup_steps"].get<std::int64_t>();
}

// In order: the config's scheduler block, --warmup-steps, the warm-up of the
// run --resume continues, the default for the model.
tz::Expected<Warmup> resolve_warmup(const Flags& f, const tz::Config& config, const tz::train::GptConfig& gpt) {
  const double lr = config.optimizer.lr;
  if (config.scheduler.type != tz::SchedulerType::kNone) {  // --warmup-steps is then 0 or absent (checked)
    return Warmup{0, fmt::format("set by the config's scheduler block ({})", tz::scheduler_name(config.scheduler.type))};
  }
  if (f.warmup_steps) {
    return Warmup{*f.warmup_steps, *f.warmup_steps > 0 ? fmt::format("{:.3g}, warmed up linearly over {} steps "
                                                                     "(--warmup-steps)", lr, *f.warmup_steps)
                                                       : fmt::format("{:.3g} from the first step (--warmup-steps 0)", lr)};
  }
  if (!f.resume_dir.empty()) {  // a resumed run keeps the warm-up it started with, not this run's default
    TZ_ASSIGN_OR_RETURN(const std::int64_t saved, saved_warmup(f.resume_dir));
    return Warmup{saved, saved > 0 ? fmt::format("{:.3g}, warmed up linearly over {} steps (as the resumed run was)",
                                                 lr, saved)
                                   : fmt::format("{:.3g}, no warm-up (as the resumed run had none)", lr)};
  }
  const std::int64_t steps = tz::train::default_warmup_steps(gpt, lr);
  if (steps == 0) return Warmup{0, fmt::format("{:.3g} from the first step (no warm-up needed at this width and depth)", lr)};
  return Warmup{steps, fmt::format("{:.3g}, warmed up linearly over {} steps, the default for {} layers x {} hidden at "
                             "this lr (ceil(lr x layers x hidden^2 / {:g}); --warmup-steps N to choose)",
                             lr, steps, gpt.layers, gpt.hidden, tz::train::kWarmupScale)};
}

// Note [A loss that rises at the start]: the first steps of a run at width
// raise the loss when the learning rate starts too high for the width and
// depth (Note [Default warm-up] in tierzero/train/gpt.h). The trainer says so
// once, naming what to change, when a step in the first kRiseWindow raises the
// loss above kRiseFactor x the first step's.
constexpr std::int64_t kRiseWindow = 20;
constexpr double kRiseFactor = 1.25;

class Run {
 public:
  explicit Run(Flags f) : f_(std::move(f)) {}
  tz::Status setup();
  tz::Status check_activations_fit() const;
  void print_header() const;
  tz::Status train();
  tz::Status finish();
  // Set when a signal stopped the run (this rank's or another's).
  const std::string& stopped_by() const { return info_.stopped_by; }

 private:
  tz::Status train_step(std::int64_t step);
  tz::Expected<bool> stop_now(std::int64_t steps_done);
  void check_rise();
  tz::Status evaluate(std::int64_t after_step);
  tz::Status save(std::int64_t after_step);
  std::string out(const std::string& flag_path, const char* name) const {
    return flag_path.empty() ? (fs::path(f_.out_dir) / name).string() : flag_path;
  }
  bool leader() const { return engine_->rank() == 0; }

  Flags f_;
  tz::Config config_;
  tz::train::GptConfig gpt_;
  std::optional<tz::train::Corpus> corpus_;
  std::unique_ptr<tz::Communicator> comm_;
  std::unique_ptr<tz::ZeroEngine> engine_;
  std::unique_ptr<tz::train::GptTrainer> trainer_;
  tz::tool::RunInfo info_;
  std::vector<StepRecord> steps_;
  std::vector<EvalRecord> evals_;
  Clock::time_point start_;
  bool eval_pending_ = false;
  Warmup warmup_;
  bool warned_rise_ = false;
};

tz::Status Run::setup() {
  TZ_ASSIGN_OR_RETURN(config_, load_train_config(f_));
  TZ_ASSIGN_OR_RETURN(tz::RankInfo ranks, tz::rank_info_from_env());
  // --batch is the micro batch; the accumulation steps may then be derived from train_batch_size (Note [Batch
  // keys]), and the GPT is built for the micro batch.
  if (f_.batch) {
    config_.train_micro_batch_size_per_gpu = *f_.batch;
    config_.batch_given.train_micro_batch_size_per_gpu = *f_.batch;
  }
  TZ_TRY_CTX(tz::resolve_batch(config_, ranks.world_size), "--batch and the config's batch keys");
  TZ_ASSIGN_OR_RETURN(gpt_, gpt_config(f_, config_));
  TZ_ASSIGN_OR_RETURN(warmup_, resolve_warmup(f_, config_, gpt_));
  if (f_.data_path.empty()) {
    TZ_ASSIGN_OR_RETURN(f_.data_path, tz::train::default_corpus_path(exe_dir()));
  }
  TZ_ASSIGN_OR_RETURN(corpus_, tz::train::Corpus::load(f_.data_path));
  if (ranks.world_size > 1) {
    const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(f_.collective_timeout_s * 1000));
    TZ_ASSIGN_OR_RETURN(comm_, tz::create_communicator({.ranks = ranks, .timeout = timeout}));
  }
  TZ_ASSIGN_OR_RETURN(engine_, tz::ZeroEngine::create({.config = config_, .comm = comm_.get()}, tz::train::model(gpt_),
                                                      tz::train::init(gpt_)));
  TZ_TRY(check_activations_fit());
  info_.activation_bytes = gpt_.activation_bytes();
  TZ_ASSIGN_OR_RETURN(trainer_, tz::train::GptTrainer::create(*engine_, gpt_, {.tf32 = f_.tf32}));
  if (!f_.io_log_path.empty()) {  // refused on every rank now, not on rank 0 after step 2
    bool nvme = false;
    for (tz::Tier t : engine_->plan().tier) nvme = nvme || t == tz::Tier::kNvme;
    if (!nvme) {
      return tz::invalid_argument("--io-log {}: no state lives on NVMe with {} ({}), so there is no NVMe I/O to log",
                                  f_.io_log_path, f_.config_path, engine_->describe());
    }
  }
  if (!f_.resume_dir.empty()) {
    auto loaded = engine_->load_checkpoint(f_.resume_dir, tz::CheckpointLoad{});
    TZ_TRY_CTX(loaded.status(), "--resume {}", f_.resume_dir);
    info_.first_step = loaded->step;
  }
  info_.steps = preset_steps(f_, info_.first_step);
  info_.params = engine_->layout().param_numel;
  info_.state_bytes = 16 * info_.params;
  info_.gpu_budget_bytes = config_.tiers.gpu.is_auto ? 0 : config_.tiers.gpu.bytes;
  info_.flops_per_token = gpt_.flops_per_token();
  info_.engine = engine_->describe();
  info_.model = fmt::format("{} layers x {} hidden, {} heads, seq {}", gpt_.layers, gpt_.hidden, gpt_.heads, gpt_.seq);
  info_.corpus = fmt::format("{} ({} train, {} validation bytes)", corpus_->name(), corpus_->train().size(),
                             corpus_->val().size());
  info_.batch = gpt_.batch;
  info_.seq = gpt_.seq;
  info_.ranks = engine_->world_size();
  info_.gas = static_cast<int>(engine_->config().gradient_accumulation_steps);
  info_.config_path = f_.config_path;
  info_.command = f_.command;
  if (leader()) {
    std::error_code ec;
    fs::create_directories(f_.out_dir, ec);
    print_header();
  }
  return tz::ok_status();
}

// Activations were neither budgeted nor estimated: a large --batch or --seq
// ended in std::bad_alloc or the OOM killer. The CPU trainer's are known
// exactly (GptConfig::activation_bytes); after the engine's pools are made,
// they must fit in what is left.
tz::Status Run::check_activations_fit() const {
  if (engine_->device().kind() == tz::BackendKind::kHost) {
    TZ_ASSIGN_OR_RETURN(const tz::HostMemoryReading mem, tz::read_host_memory());
    const std::uint64_t need = gpt_.activation_bytes();
    if (need > mem.available_bytes) {
      return tz::out_of_memory("the activations of {} x {} tokens through {} layers x {} hidden (with the trainer's "
                               "block copies) need {}, but {} of host memory is available after the engine's pools; "
                               "lower --batch or --seq, or the CPU budget (tierzero.tiers.cpu_bytes)",
                               gpt_.batch, gpt_.seq, gpt_.layers, gpt_.hidden, tz::format_bytes(need),
                               tz::format_bytes(mem.available_bytes));
    }
  }
  return tz::ok_status();
}

// What runs, where its states live and what it reads: the leader's first lines.
void Run::print_header() const {
  std::printf("tierzero-train: GPT %s = %s params; model states %s (16 B/param)", info_.model.c_str(),
              tz::format_count(static_cast<double>(info_.params)).c_str(),
              tz::tool::format_bytes_si(static_cast<double>(info_.state_bytes)).c_str());
  if (info_.gpu_budget_bytes > 0) {
    std::printf(" = %.1f x the device budget (tierzero.tiers.gpu_bytes = %s)",
                static_cast<double>(info_.state_bytes) / static_cast<double>(info_.gpu_budget_bytes),
                tz::tool::format_bytes_si(static_cast<double>(info_.gpu_budget_bytes)).c_str());
  }
  std::printf("\nconfig %s; data %s; %d x %d tokens per micro-batch, %d micro-batch(es) per step, %d rank(s)\n",
              f_.config_path.c_str(), info_.corpus.c_str(), gpt_.batch, gpt_.seq, info_.gas, info_.ranks);
  std::printf("the GPT computes on: %s; activations and its block copies %s per micro-batch\n",
              trainer_->describe().c_str(), tz::tool::format_bytes_si(static_cast<double>(info_.activation_bytes)).c_str());
  std::printf("where the states live: %s\n", info_.engine.c_str());
  std::printf("learning rate: %s\n", warmup_.about.c_str());
  if (!f_.resume_dir.empty()) std::printf("resumed from %s at step %lld\n", f_.resume_dir.c_str(),
                                          static_cast<long long>(info_.first_step));
  std::fflush(stdout);
}

tz::Status Run::train_step(std::int64_t step) {
  const int rank = engine_->rank();
  StepRecord r{.step = step, .after_eval = std::exchange(eval_pending_, false)};
  if (warmup_.steps > 0) {
    // Linear warm-up to the config's learning rate over the first steps (GPT-style).
    const double ramp = std::min(1.0, static_cast<double>(step + 1) / static_cast<double>(warmup_.steps));
    TZ_TRY(engine_->set_learning_rate(config_.optimizer.lr * ramp));
  }
  const auto begin = Clock::now();
  for (int micro = 0; micro < info_.gas; ++micro) {
    TZ_ASSIGN_OR_RETURN(tz::train::TokenBatch batch,
                        corpus_->batch({.split = tz::train::Split::kTrain, .batch = gpt_.batch, .seq = gpt_.seq,
                                        .step = step, .rank = rank, .micro = micro, .seed = f_.data_seed}));
    TZ_ASSIGN_OR_RETURN(double loss, trainer_->train_micro_batch(batch));
    r.loss += loss / info_.gas;
    TZ_ASSIGN_OR_RETURN(r.report, engine_->step());
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  r.compute_seconds = r.seconds - r.report.optimizer_seconds;
  r.tokens = static_cast<std::uint64_t>(gpt_.batch) * gpt_.seq * info_.gas * info_.ranks;
  // The stepping micro-batch's report covers the whole step (the engine
  // reports bytes and waits since the last report that stepped).
  r.nvme_read_bytes = r.report.nvme_read_bytes;
  r.nvme_write_bytes = r.report.nvme_write_bytes;
  r.h2d_bytes = r.report.h2d_bytes;
  r.gather_bytes = r.report.gather_bytes;
  r.wait_nvme_seconds = r.report.wait_nvme_seconds;
  r.nvme_read_busy_seconds = r.report.nvme_read_busy_seconds;
  r.nvme_write_busy_seconds = r.report.nvme_write_busy_seconds;
  r.wait_h2d_seconds = r.report.wait_h2d_seconds;
  r.wait_gather_seconds = r.report.wait_gather_seconds;
  if (info_.gpu_budget_bytes == 0) info_.gpu_budget_bytes = r.report.gpu_budget_bytes;
  steps_.push_back(r);
  return tz::ok_status();
}

void Run::check_rise() {
  // A fresh run's first steps only: a resumed one is past the start.
  if (warned_rise_ || info_.first_step != 0 || steps_.size() < 2 || steps_.back().step >= kRiseWindow) return;
  const StepRecord& first = steps_.front();
  const StepRecord& now = steps_.back();
  if (!(now.loss > kRiseFactor * first.loss)) return;
  warned_rise_ = true;
  const std::string what = config_.scheduler.type != tz::SchedulerType::kNone
                               ? fmt::format("warm it up over more steps in the config's scheduler block ({})",
                                             tz::scheduler_name(config_.scheduler.type))
                               : fmt::format("warm it up over more steps (--warmup-steps, now {})", warmup_.steps);
  std::fprintf(stderr, "tierzero-train: warning: the loss rose from %.4f (step %lld) to %.4f (step %lld), more than "
                       "%.2fx, in the first %lld steps: the learning rate (%.3g at step %lld, config %.3g) is too high "
                       "for %d layers x %d hidden this early; %s or lower optimizer.params.lr\n",
               first.loss, static_cast<long long>(first.step + 1), now.loss, static_cast<long long>(now.step + 1),
               kRiseFactor, static_cast<long long>(kRiseWindow), now.report.lr, static_cast<long long>(now.step + 1),
               config_.optimizer.lr, gpt_.layers, gpt_.hidden, what.c_str());
}

tz::Status Run::evaluate(std::int64_t after_step) {
  std::vector<tz::train::TokenBatch> batches;
  for (int i = 0; i < f_.eval_batches; ++i) {
    TZ_ASSIGN_OR_RETURN(tz::train::TokenBatch batch,
                        corpus_->batch({.split = tz::train::Split::kVal, .batch = gpt_.batch, .seq = gpt_.seq,
                                        .step = i, .rank = engine_->rank(), .seed = f_.data_seed}));
    batches.push_back(std::move(batch));
  }
  TZ_ASSIGN_OR_RETURN(double loss, trainer_->eval_loss(batches));
  evals_.push_back({after_step, loss});
  eval_pending_ = true;  // its master reads show up in the next step's report
  if (leader()) tz::tool::print_eval(evals_.back());
  return tz::ok_status();
}

tz::Status Run::save(std::int64_t after_step) {
  const auto begin = Clock::now();
  TZ_TRY_CTX(engine_->save_checkpoint(f_.save_dir, tz::CheckpointSave{.client_state = client_state(warmup_), .keep_last = f_.keep_last}).status(),
             "--save {}", f_.save_dir);
  info_.checkpoint_dir = f_.save_dir;
  if (leader()) {
    std::printf("saved the checkpoint of step %lld to %s (%.2f s)\n", static_cast<long long>(after_step),
                f_.save_dir.c_str(), std::chrono::duration<double>(Clock::now() - begin).count());
  }
  return tz::ok_status();
}

// Whether to stop now, after `steps_done` steps: a SIGINT or SIGTERM was
// received (Note [Stopping on a signal]). With several ranks every rank asks
// at the same points, and all stop if any was signalled: each names "stop" or
// "go", and names that differ are a stop too (agree_on fails with
// InvalidArgument only for that; any other failure is the collective's own).
tz::Expected<bool> Run::stop_now(std::int64_t steps_done) {
  const int sig = tz::tool::StopSignals::requested();
  bool stop = sig != 0;
  if (engine_->world_size() > 1) {
    const tz::Status agreed = engine_->ranks().agree_on(stop ? "stop" : "go", "tierzero-train: stopping on a signal");
    if (!agreed.ok() && agreed.code() != tz::ErrorCode::kInvalidArgument) return agreed;
    stop = stop || !agreed.ok();
  }
  if (!stop) return false;
  info_.stopped_by = sig != 0 ? tz::tool::StopSignals::name(sig) : "a signal to another rank";
  info_.stopped_after_step = steps_done;
  return true;
}

tz::Status Run::train() {
  start_ = Clock::now();
  const std::int64_t first = info_.first_step, last = first + info_.steps;
  const std::int64_t traced = first + std::min<std::int64_t>(1, info_.steps - 1);
  TZ_ASSIGN_OR_RETURN(bool stop, stop_now(first));  // a signal while the engine was being made
  if (f_.eval_every > 0 && !stop) TZ_TRY(evaluate(first));
  for (std::int64_t step = first; step < last && !stop; ++step) {
    engine_->record_timeline(step == traced);
    if (!f_.io_log_path.empty()) engine_->record_io_log(step == traced);
    TZ_TRY_CTX(train_step(step), "step {}", step + 1);
    if (leader()) check_rise();
    if (step == traced) {
      engine_->record_timeline(false);
      info_.trace_path = out(f_.trace_path, "trace.json");
      if (leader()) TZ_TRY(engine_->write_timeline(info_.trace_path));
      engine_->clear_timeline();
      if (!f_.io_log_path.empty()) {
        engine_->record_io_log(false);
        if (leader()) TZ_TRY_CTX(engine_->write_io_log(f_.io_log_path), "--io-log");
      }
    }
    const std::int64_t done = step + 1;
    TZ_ASSIGN_OR_RETURN(stop, stop_now(done));
    if (leader() && (f_.log_every <= 1 || done % f_.log_every == 0 || step == first || done == last || stop)) {
      tz::tool::print_progress(steps_.back(), last, info_.flops_per_token);
    }
    if (stop) {  // the evaluations and saves still due are skipped, except --save-on-stop's
      if (f_.save_on_stop) {
        if (leader()) std::printf("saving step %lld before stopping (--save-on-stop)\n", static_cast<long long>(done));
        TZ_TRY_CTX(save(done), "--save-on-stop");
      }
      break;
    }
    if (f_.eval_every > 0 && (done % f_.eval_every == 0 || done == last)) TZ_TRY(evaluate(done));
    if (!f_.save_dir.empty() && ((f_.save_every > 0 && done % f_.save_every == 0) || done == last)) TZ_TRY(save(done));
  }
  info_.wall_seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  return tz::ok_status();
}

tz::Status Run::finish() {
  if (!leader()) return tz::ok_status();
  tz::tool::print_summary(info_, steps_, evals_);
  std::printf("where the states lived: %s\n", info_.engine.c_str());
  const std::string json = out(f_.json_path, "summary.json"), csv = out(f_.csv_path, "loss.csv"),
                    png = out(f_.plot_path, "loss.png");
  if (!info_.stopped_by.empty()) {
    std::printf("stopped by %s after step %lld of %lld\n", info_.stopped_by.c_str(),
                static_cast<long long>(info_.stopped_after_step),
                static_cast<long long>(info_.first_step + info_.steps));
  }
  TZ_TRY(tz::tool::write_json(json, info_, steps_, evals_));
  TZ_TRY(tz::tool::write_csv(csv, steps_, evals_));
  if (!steps_.empty()) TZ_TRY(tz::tool::write_plot(png, info_, steps_, evals_));  // no points, no chart
  std::printf("wrote %s, %s%s%s", json.c_str(), csv.c_str(), steps_.empty() ? "" : ", ",
              steps_.empty() ? "" : png.c_str());
  if (!info_.trace_path.empty()) {
    std::printf("; Chrome trace of step %lld: %s", static_cast<long long>(info_.first_step + std::min<std::int64_t>(2, info_.steps)),
                info_.trace_path.c_str());
  }
  std::printf("\n");
  if (steps_.size() >= 8) {  // the verdict the CI test looks for
    const std::size_t n = std::max<std::size_t>(1, std::min<std::size_t>(10, steps_.size() / 4));
    double head = 0, tail = 0;
    for (std::size_t i = 0; i < n; ++i) head += steps_[i].loss / n, tail += steps_[steps_.size() - 1 - i].loss / n;
    std::printf("%s: %.4f -> %.4f\n", tail < head ? "the loss fell" : "the loss did NOT fall", head, tail);
  }
  return tz::ok_status();
}

void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--config", f.config_path, "DeepSpeed-style JSON config (default: examples/train_cpu_nvme.json)");
  app.add_option("--backend", f.backend, "where the GPT computes: auto (CUDA when a GPU is present), cuda, host "
                 "(default: the config's tierzero.backend)")->check(CLI::IsMember({"auto", "cuda", "host"}));
  app.add_option("--gpu-bytes", f.gpu_bytes, "device budget, replacing the config's tierzero.tiers.gpu_bytes: a size "
                 "(\"8GiB\") or auto (e.g. for a GPU run with the shipped 32 MiB CPU-demo config)");
  app.add_flag("--tf32,!--no-tf32", f.tf32, "CUDA: cuBLAS matmuls on TF32 tensor cores (default: on; --no-tf32 for "
               "full fp32)");
  app.add_option("--master", f.master, "the master weights' format, replacing the config's tierzero.states.master: "
                                       "fp32, or remainder (bf16 parameters; exact, 2.125 B instead of 4)");
  app.add_option("--moments", f.moments, "the Adam moments' format, replacing the config's tierzero.states.moments: "
                                         "fp32, bf16, or int8 (8-bit codes + a scale per 256 elements: 2.03 B for both)");
  app.add_option("--grad-accum-dtype", f.grad_accum_dtype,
                 "the gradient accumulator's dtype, replacing the config's data_types.grad_accum_dtype: fp32, or the "
                 "16-bit training dtype (bf16 or fp16; 2 B instead of 4)");
  app.add_option("--preset", f.preset, "model size: tiny, cpu (default), small, gpt2")->capture_default_str();
  app.add_option("--layers", f.layers, "transformer blocks (overrides the preset)")->check(CLI::Range(1, 1000));
  app.add_option("--hidden", f.hidden, "model width")->check(CLI::Range(1, 65536));
  app.add_option("--heads", f.heads, "attention heads (must divide --hidden)")->check(CLI::Range(1, 1024));
  app.add_option("--seq", f.seq, "context length in bytes")->check(CLI::Range(1, 65536));
  app.add_option("--batch", f.batch, "sequences per micro-batch per rank (default: the config's "
                                     "train_micro_batch_size_per_gpu)")->check(CLI::Range(1, 65536));
  CLI::Option* steps = app.add_option("--steps", f.steps, "optimizer steps this run takes (default: the preset's)")
                           ->check(CLI::Range(1, 100000000));
  app.add_option("--until-step", f.until_step, "train until the step count reaches N, counting the steps of the "
                 "checkpoint --resume loads (a restart loop's command line stays the same; a run resumed at N "
                 "takes no step)")->check(CLI::Range(std::int64_t{1}, std::int64_t{100000000}))->excludes(steps);
  app.add_option("--nvme-path", f.nvme_path, "directory for the swap files, replacing the config's NVMe paths");
  app.add_option("--data", f.data_path, "training text (default: the shipped data/kjv.txt)");
  app.add_option("--out", f.out_dir, "directory for the outputs below")->capture_default_str();
  app.add_option("--json", f.json_path, "summary JSON (default: OUT/summary.json)");
  app.add_option("--csv", f.csv_path, "loss curve CSV (default: OUT/loss.csv)");
  app.add_option("--plot", f.plot_path, "loss curve PNG (default: OUT/loss.png)");
  app.add_option("--trace", f.trace_path, "Chrome trace of one step (default: OUT/trace.json)");
  app.add_option("--io-log", f.io_log_path, "write the NVMe requests of the same step as a fio version 2 I/O log, "
                 "for tierzero-nvme-bench --replay (and fio --read_iolog)");
  CLI::Option* save = app.add_option("--save", f.save_dir, "checkpoint directory, written at the end (and every "
                                     "--save-every steps)");
  app.add_option("--save-every", f.save_every, "also save every N steps (0: only at the end)");
  app.add_option("--resume", f.resume_dir, "continue from this checkpoint directory's latest checkpoint");
  app.add_flag("--resume-if-present", f.resume_if_present, "with --resume: start fresh when the directory holds no "
               "checkpoint yet (a restart loop's first run); a broken one is still an error");
  app.add_flag("--save-on-stop", f.save_on_stop, "with --save: when SIGINT or SIGTERM stops the run, save the last "
               "completed step's checkpoint before exiting (as Slurm preemption expects)")->needs(save);
  app.add_option("--keep-last", f.keep_last, "keep the newest N checkpoints under --save (0: all)")
      ->capture_default_str()->check(CLI::Range(0, 1000000));
  app.add_option("--eval-every", f.eval_every, "validation loss every N steps (0: never)")->capture_default_str();
  app.add_option("--eval-batches", f.eval_batches, "validation batches per evaluation")->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--warmup-steps", f.warmup_steps, "raise the learning rate linearly to the config's over the first N "
                 "steps (0: none; default: ceil(lr x layers x hidden^2 / 100), see train/README.md); the config's "
                 "scheduler block is the other way, not both")->check(CLI::Range(std::int64_t{0}, std::int64_t{1000000000}));
  app.add_option("--log-every", f.log_every, "progress line every N steps")->capture_default_str();
  app.add_option("--data-seed", f.data_seed, "seed of the batch sampler")->capture_default_str();
  app.add_option("--init-seed", f.init_seed, "seed of the initial weights")->capture_default_str();
  app.add_option("--threads", f.threads, "CPU compute threads (0: all cores)")->capture_default_str();
  app.add_option("--collective-timeout", f.collective_timeout_s, "seconds a collective (and the rendezvous) may wait "
                 "for a silent peer before the run fails naming the call")->capture_default_str()
      ->check(CLI::Range(0.1, 86400.0));
}

// The run, start to end; its engine (and so its swap files) is gone when
// this returns.
int run_main(Flags f) {
  std::optional<tbb::global_control> threads;
  if (f.threads > 0) threads.emplace(tbb::global_control::max_allowed_parallelism, f.threads);
  // Note [Foreign exceptions stop at the edge]: the engine reports failures
  // as Status; anything a library still throws (std::bad_alloc, a parser's)
  // ends here as an error naming it, not as std::terminate's abort.
  tz::Status s;
  std::string stopped_by;
  try {
    Run run(std::move(f));
    s = run.setup();
    if (s.ok()) s = run.train();
    if (s.ok()) s = run.finish();
    stopped_by = run.stopped_by();
  } catch (const std::bad_alloc&) {
    s = tz::out_of_memory("out of host memory (std::bad_alloc); lower --batch or --seq, or the CPU budget");
  } catch (const std::exception& e) {
    s = tz::internal_error("an unexpected exception: {}", e.what());
  }
  if (!s.ok()) {
    std::fprintf(stderr, "tierzero-train: %s\n", s.message().c_str());
    return s.code() == tz::ErrorCode::kInvalidArgument ? 2 : 1;
  }
  if (!stopped_by.empty() && tz::tool::StopSignals::requested() == 0) {
    std::fprintf(stderr, "tierzero-train: stopped early: %s\n", stopped_by.c_str());
    return 1;  // not a finished run, and not one this rank's signal ended
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-train: a GPT trained through ZeroEngine with its states tiered over device, CPU and NVMe"};
  Flags f;
  add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (f.resume_if_present && !f.resume_dir.empty() && nothing_to_resume(f.resume_dir)) {
    std::printf("--resume %s: no checkpoint there yet, starting fresh (--resume-if-present)\n", f.resume_dir.c_str());
    f.resume_dir.clear();
  }
  for (int i = 0; i < argc; ++i) f.command += (i ? " " : "") + std::string(argv[i]);
  tz::tool::StopSignals::install();  // Note [Stopping on a signal]
  const int rc = run_main(std::move(f));
  return tz::tool::StopSignals::exit_as_signalled(rc);
}
