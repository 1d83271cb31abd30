// tierzero-tiers: the tier demo, tierzero's main job until the trainer lands.
//
// 1. Plans where a model's states live (GPU / pinned CPU / NVMe) from a
//    DeepSpeed-style config, as the engine will.
// 2. Moves that model's blocks through the tiers the way a ZeRO-3 step does:
//    pinned staging -> device (H2D, the parameter path) and device -> pinned
//    (D2H, the gradient path) on separate streams handing off through events,
//    with buffers from fixed pools. Every byte is verified on arrival, and the
//    pools must allocate nothing after the first step.
// Prints a table and writes JSON (--json).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "bench_common.h"
#include "tierzero/engine.h"

namespace {

struct Options {
  std::string config_path;
  std::string json_path;
  double params = 1.3e9;
  int layers = 24;
  int steps = 6;
  int chunks = 8;
  double chunk_mib = 64;
};

struct StepResult {
  double seconds = 0;
  std::uint64_t bytes_each_way = 0;
  std::uint64_t new_allocations = 0;
};

using Clock = std::chrono::steady_clock;

// Blocks released on a stream come back to the pool when the stream finishes
// with them, so how many the first steps need depends on timing; by the third
// step every pool holds its high-water mark and must allocate nothing more.
constexpr int kWarmUpSteps = 2;

// Budgets for the exercise: the config's, with "auto" resolved; on the Host
// backend an "auto" device budget is a quarter of available memory, since the
// "device" there is host memory.
tz::Expected<tz::ResolvedBudgets> demo_budgets(const tz::Config& config, const tz::Device& device) {
  tz::TierConfig tiers = config.tiers;
  if (device.kind() == tz::BackendKind::kHost && tiers.gpu.is_auto) {
    TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading mem, tz::read_host_memory());
    tiers.gpu = tz::ByteBudget::of(mem.available_bytes / 4);
  }
  TZ_ASSIGN_OR_RETURN(tz::ResolvedBudgets budgets, tz::resolve_budgets(tiers, config.all_nvme_paths()));
  if (device.kind() == tz::BackendKind::kHost && config.tiers.gpu.is_auto) {
    budgets.gpu_source = "auto: host backend, 25% of MemAvailable";
  }
  return budgets;
}

void fill(void* dst, std::size_t bytes, std::uint64_t seed) {
  auto* words = static_cast<std::uint64_t*>(dst);
  for (std::size_t i = 0; i < bytes / 8; ++i) words[i] = seed * 0x9E3779B97F4A7C15ULL + i;
}

// One step: every chunk goes pinned -> device on the h2d stream, then, once its
// event fires, device -> pinned on the d2h stream; blocks return to their pools
// when their stream is done with them.
tz::Expected<StepResult> run_step(tz::Device& device, tz::MemoryPool& device_pool, tz::MemoryPool& host_pool,
                                  tz::Stream& h2d, tz::Stream& d2h, std::vector<std::unique_ptr<tz::Event>>& events,
                                  const Options& opt, int step) {
  const auto chunk_bytes = static_cast<std::size_t>(opt.chunk_mib * tz::kMiB);
  const std::uint64_t allocations_before = device_pool.stats().backend_allocations + host_pool.stats().backend_allocations;
  std::vector<tz::PoolBlock> staged, returned;
  // On an error part-way, copies may still be running: drain both streams
  // before the blocks above go back to their pools. (Declared after them, so
  // it runs first.)
  tz::Cleanup drain([&] {
    (void)device.synchronize_stream(h2d).ok();
    (void)device.synchronize_stream(d2h).ok();
  });
  for (int c = 0; c < opt.chunks; ++c) {
    TZ_ASSIGN_OR_RETURN(tz::PoolBlock h_param, host_pool.allocate(chunk_bytes));
    fill(h_param.data(), chunk_bytes, static_cast<std::uint64_t>(step) * 1000 + static_cast<std::uint64_t>(c));
    staged.push_back(std::move(h_param));
  }
  const auto start = Clock::now();
  for (int c = 0; c < opt.chunks; ++c) {
    TZ_ASSIGN_OR_RETURN(tz::PoolBlock d_block, device_pool.allocate(chunk_bytes));
    TZ_ASSIGN_OR_RETURN(tz::PoolBlock h_grad, host_pool.allocate(chunk_bytes));
    tz::Event& arrived = *events[static_cast<std::size_t>(c)];
    TZ_TRY(device.copy_async(d_block.data(), staged[static_cast<std::size_t>(c)].data(), chunk_bytes, h2d));
    TZ_TRY(device.record_event(arrived, h2d));
    TZ_TRY(device.stream_wait_event(d2h, arrived));
    TZ_TRY(device.copy_async(h_grad.data(), d_block.data(), chunk_bytes, d2h));
    TZ_TRY(device_pool.release_after(std::move(d_block), d2h));
    returned.push_back(std::move(h_grad));
  }
  TZ_TRY(device.synchronize_stream(d2h));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (int c = 0; c < opt.chunks; ++c) {
    if (std::memcmp(staged[static_cast<std::size_t>(c)].data(), returned[static_cast<std::size_t>(c)].data(), chunk_bytes) != 0) {
      return tz::data_corruption("step {} chunk {}: bytes changed on the way through the device tier", step, c);
    }
  }
  const std::uint64_t allocations_after = device_pool.stats().backend_allocations + host_pool.stats().backend_allocations;
  return StepResult{seconds, chunk_bytes * static_cast<std::uint64_t>(opt.chunks), allocations_after - allocations_before};
}

nlohmann::json pool_json(const tz::PoolStats& s) {
  return {{"budget_bytes", s.budget_bytes},           {"peak_in_use_bytes", s.peak_in_use_bytes},
          {"peak_reserved_bytes", s.peak_reserved_bytes}, {"backend_allocations", s.backend_allocations},
          {"requests", s.requests},                   {"cache_hits", s.cache_hits}};
}

tz::Status run(const Options& opt) {
  std::printf("%s\n", tz::build_summary().c_str());
  tz::Config config;
  if (!opt.config_path.empty()) {
    TZ_ASSIGN_OR_RETURN(config, tz::load_config(opt.config_path));
  }
  TZ_TRY(tz::check_paths(config));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::Device> device, tz::create_device({.backend = config.backend}));
  std::printf("device: %s\n\n", device->name().c_str());

  // 1. The plan.
  TZ_ASSIGN_OR_RETURN(tz::ResolvedBudgets budgets, demo_budgets(config, *device));
  std::vector<std::uint64_t> blocks(static_cast<std::size_t>(opt.layers),
                                    static_cast<std::uint64_t>(opt.params / opt.layers));
  tz::PlanInput input = tz::PlanInput::from_config(config, blocks, 1, 1, budgets);
  tz::Expected<tz::Plan> plan = tz::plan_placement(input);
  if (plan.ok()) {
    std::printf("%s\n", tz::format_plan(*plan, input).c_str());
  } else {
    std::printf("placement: %s\n\n", plan.status().message().c_str());
  }

  // 2. The tiers at work.
  const auto chunk_bytes = static_cast<std::uint64_t>(opt.chunk_mib * tz::kMiB);
  const std::uint64_t per_step = chunk_bytes * static_cast<std::uint64_t>(opt.chunks);
  bool pinned = config.zero.offload_param.pin_memory || config.zero.offload_optimizer.pin_memory ||
                device->kind() == tz::BackendKind::kCuda;
  const std::uint64_t host_budget = std::min(budgets.cpu_bytes, 2 * per_step);
  if (pinned && device->kind() == tz::BackendKind::kHost && !tz::has_cap_ipc_lock() &&
      host_budget > tz::memlock_limit_bytes()) {
    // The library refuses such a pool (with the advice); the demo says so and goes on unpinned.
    std::printf("note: %s of pinned memory exceeds this process's memlock limit (%s); using pageable memory. "
                "Raise it with `ulimit -l unlimited` to demo pinned memory.\n",
                tz::format_bytes(host_budget).c_str(), tz::format_bytes(tz::memlock_limit_bytes()).c_str());
    pinned = false;
  }
  TZ_ASSIGN_OR_RETURN(int numa_node, tz::resolve_numa_node(*device, config.tiers.numa_node));
  TZ_ASSIGN_OR_RETURN(auto device_pool, tz::make_device_pool(*device, std::min(budgets.gpu_bytes, per_step)));
  TZ_ASSIGN_OR_RETURN(auto host_pool, tz::make_host_pool(*device, host_budget, {.pinned = pinned, .numa_node = numa_node}));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::Stream> h2d, device->create_stream());
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::Stream> d2h, device->create_stream());
  std::vector<std::unique_ptr<tz::Event>> events;
  for (int c = 0; c < opt.chunks; ++c) {
    TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::Event> e, device->create_event());
    events.push_back(std::move(e));
  }
  std::printf("tier exercise: %d steps x %d chunks of %s, %s host memory\n", opt.steps, opt.chunks,
              tz::format_bytes(chunk_bytes).c_str(), pinned ? "pinned" : "pageable");
  std::printf("%6s %10s %14s %16s\n", "step", "ms", "GB/s each way", "new allocations");
  nlohmann::json steps = nlohmann::json::array();
  std::uint64_t steady_allocations = 0;
  for (int step = 0; step < opt.steps; ++step) {
    TZ_ASSIGN_OR_RETURN(StepResult r, run_step(*device, *device_pool, *host_pool, *h2d, *d2h, events, opt, step));
    const double gbps = static_cast<double>(r.bytes_each_way) / r.seconds / 1e9;
    std::printf("%6d %10.2f %14.2f %16llu\n", step, r.seconds * 1e3, gbps, static_cast<unsigned long long>(r.new_allocations));
    if (step >= kWarmUpSteps) steady_allocations += r.new_allocations;
    steps.push_back({{"step", step}, {"seconds", r.seconds}, {"gbps_each_way", gbps}, {"new_allocations", r.new_allocations}});
  }
  const tz::PoolStats dev = device_pool->stats(), host = host_pool->stats();
  std::printf("\n%-24s %12s %12s %12s %12s\n", "pool", "budget", "peak in use", "allocations", "cache hits");
  for (const auto& [name, s] : {std::pair{device_pool->options().tier, dev}, std::pair{host_pool->options().tier, host}}) {
    std::printf("%-24s %12s %12s %12llu %12llu\n", name.c_str(), tz::format_bytes(s.budget_bytes).c_str(),
                tz::format_bytes(s.peak_in_use_bytes).c_str(), static_cast<unsigned long long>(s.backend_allocations),
                static_cast<unsigned long long>(s.cache_hits));
  }
  std::printf("verified %d x %s each way; allocations after %d warm-up steps: %llu\n", opt.steps,
              tz::format_bytes(per_step).c_str(), kWarmUpSteps, static_cast<unsigned long long>(steady_allocations));
  if (!opt.json_path.empty()) {
    nlohmann::json out = {{"build", tz::build_summary()}, {"device", device->name()}, {"steps", steps},
                          {"device_pool", pool_json(dev)}, {"host_pool", pool_json(host)},
                          {"steady_state_allocations", steady_allocations},
                          {"plan", plan.ok() ? plan->summary : plan.status().message()}};
    TZ_TRY(tz::write_file_durably(opt.json_path, out.dump(2) + "\n"));
  }
  if (steady_allocations != 0) return tz::internal_error("pools allocated {} times after warm-up", steady_allocations);
  return tz::ok_status();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-tiers: plan a model's placement and move its blocks through the memory tiers"};
  Options opt;
  app.add_option("--config", opt.config_path, "tierzero / DeepSpeed JSON config")->check(CLI::ExistingFile);
  app.add_option("--params", opt.params, "model parameters for the plan")->check(CLI::PositiveNumber);
  app.add_option("--layers", opt.layers, "blocks the model is split into")->check(CLI::Range(1, 100000));
  app.add_option("--steps", opt.steps, "steps to run (the first 2 are warm-up)")->check(CLI::Range(3, 10000));
  app.add_option("--chunks", opt.chunks, "chunks moved per step")->check(CLI::Range(1, 4096));
  app.add_option("--chunk-mib", opt.chunk_mib, "chunk size, MiB")->check(CLI::Range(0.0625, 4096.0));
  app.add_option("--json", opt.json_path, "write results as JSON to this file")
      ->check(CLI::Validator(tzbench::writable_file, "FILE"));
  CLI11_PARSE(app, argc, argv);
  tz::Status status = run(opt);
  if (!status.ok()) {
    std::fprintf(stderr, "tierzero-tiers: %s\n", status.message().c_str());
    return 1;
  }
  return 0;
}
