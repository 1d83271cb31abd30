// tierzero-adam-bench: the CPU optimizers (cpu_adam) against the memory-bandwidth
// limit of their own access patterns, measured in the same run.
//
// For each size (--sizes) the arrays are mapped page-aligned, first-touched in
// parallel and filled with random data. For each thread count (--threads) and
// SIMD variant (--simd), every kernel is paired with a limit loop that reads
// and writes exactly the same arrays with no arithmetic (bench/adam_stream.h),
// run in a oneTBB arena of the same size over tiles of the same size. Limit and
// kernel runs alternate (limit, kernel, limit, kernel, ...): after a warm-up
// round, each of --repeats rounds runs every kernel's limit and then the
// kernel, so noise hits both alike; the fraction of the limit is the ratio of
// the two medians (the median of the per-round ratios is reported beside it).
// Bytes per parameter are counted as the kernel must move them (adam_stream.h
// lists them): AdamW 28, +2 for the 16-bit copy-out.
//
// Where python3 imports torch, torch.optim.AdamW (fused=True, and the default)
// is timed on the same sizes and thread counts and the ratio printed.
//
// Prints a table (stdout), a progress line (stderr), and writes JSON (--json).
//
//   tierzero-adam-bench --sizes 200M --threads 1,2 --repeats 5 --json /tmp/adam_bench.json
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "adam_stream.h"
#include "bench_common.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/offload.h"

namespace {

namespace ca = tz::cpu_adam;
using tzbench::Clock;
using tzbench::Pattern;
using tzbench::Progress;
using tzbench::build_summary;
using tzbench::cpu_model;
using tzbench::median;
using tzbench::seconds_since;
using tzbench::split_list;

// Gradients are stored as a mixed-precision run leaves them, scaled up by the
// loss scale; every kernel multiplies them by its inverse (the unscale).
constexpr double kGradScale = 1.0 / 4096;
// Headroom left in MemAvailable beyond the arrays.
constexpr std::uint64_t kHeadroomBytes = std::uint64_t{512} << 20;
// Bytes the bench maps per parameter: p, g (fp32), g (bf16), m, v, p16.
constexpr std::uint64_t kBytesPerParamMapped = 4 + 4 + 2 + 4 + 4 + 2;

struct Flags {
  std::string sizes = "200M";
  std::string threads = "1,all";
  std::string simd = "best";
  std::string kernels = "all";
  int repeats = 5;
  std::string json_path;
  std::size_t tile_elems = 0;
  bool hugepages = true;
  bool torch = true;
  std::string python = "python3";
  bool plain_copy_limit = false;
  bool whole_step = true;
  std::string layouts = "separate";  // more than "separate": the layout comparison (Note [Layout rows])
};

// ---------------------------------------------------------------- kernels

enum class Kind : std::uint8_t { kStep, kGradArrival };

struct KernelSpec {
  std::string name;
  Kind kind;
  ca::Algorithm algorithm;  // kStep
  bool copy_out;            // kStep: bf16 copy of the new parameter
  ca::DType grad_dtype;
  Pattern pattern;
};

std::vector<KernelSpec> all_kernels() {
  using A = ca::Algorithm;
  using D = ca::DType;
  return {
      {"adamw", Kind::kStep, A::kAdamW, false, D::kFp32, Pattern::kAdam},
      {"adamw+bf16", Kind::kStep, A::kAdamW, true, D::kFp32, Pattern::kAdamCopy},
      {"adam", Kind::kStep, A::kAdam, false, D::kFp32, Pattern::kAdam},
      {"adam+bf16", Kind::kStep, A::kAdam, true, D::kFp32, Pattern::kAdamCopy},
      {"adagrad", Kind::kStep, A::kAdagrad, false, D::kFp32, Pattern::kAdagrad},
      {"adagrad+bf16", Kind::kStep, A::kAdagrad, true, D::kFp32, Pattern::kAdagradCopy},
      {"lion", Kind::kStep, A::kLion, false, D::kFp32, Pattern::kLion},
      {"lion+bf16", Kind::kStep, A::kLion, true, D::kFp32, Pattern::kLionCopy},
      {"grad-fp32", Kind::kGradArrival, A::kAdamW, false, D::kFp32, Pattern::kAccFp32},
      {"grad-bf16", Kind::kGradArrival, A::kAdamW, false, D::kBf16, Pattern::kAccBf16},
  };
}

ca::Hyper hyper_for(ca::Algorithm algorithm) {
  switch (algorithm) {
    case ca::Algorithm::kAdamW: return {.algorithm = algorithm, .lr = 1e-3, .weight_decay = 0.01};
    case ca::Algorithm::kAdam: return {.algorithm = algorithm, .lr = 1e-3, .weight_decay = 0.0};
    case ca::Algorithm::kAdagrad: return {.algorithm = algorithm, .lr = 1e-2, .eps = 1e-10};
    case ca::Algorithm::kLion:
      return {.algorithm = algorithm, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.01};
  }
  return {};
}

// ---------------------------------------------------------------- flags

tz::Expected<std::vector<std::size_t>> parse_sizes(const std::string& text) {
  std::vector<std::size_t> sizes;
  for (const std::string& item : split_list(text)) {
    if (item.empty()) return tz::invalid_argument("--sizes '{}': empty item (use e.g. 100M,200M,1B)", text);
    tz::Expected<double> count = tz::parse_count(item);
    if (!count.ok()) return tz::invalid_argument("--sizes: {}", count.status().message());
    if (!(*count >= 1) || *count > 1e13 || std::floor(*count) != *count) {
      return tz::invalid_argument("--sizes: '{}' is not a whole number of parameters >= 1", item);
    }
    sizes.push_back(static_cast<std::size_t>(*count));
  }
  if (sizes.empty()) return tz::invalid_argument("--sizes: no sizes given (use e.g. 100M,200M,1B)");
  return sizes;
}

// Thread counts; 0 stands for "all" (every CPU of the NUMA node, as the library resolves it).
tz::Expected<std::vector<int>> parse_threads(const std::string& text) {
  std::vector<int> threads;
  for (const std::string& item : split_list(text)) {
    if (item == "all") {
      threads.push_back(0);
      continue;
    }
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || end == item.c_str() || *end != '\0' || errno != 0 || value < 1 || value > 4096) {
      return tz::invalid_argument("--threads: '{}' is not 'all' or a thread count in [1, 4096]", item);
    }
    threads.push_back(static_cast<int>(value));
  }
  if (threads.empty()) return tz::invalid_argument("--threads: no thread counts given (use e.g. 1,all)");
  return threads;
}

// SIMD variants; nullopt stands for "best" (the library's own choice). "all":
// every compiled variant this CPU runs.
tz::Expected<std::vector<std::optional<ca::Simd>>> parse_simd_list(const std::string& text) {
  std::vector<std::optional<ca::Simd>> out;
  for (const std::string& item : split_list(text)) {
    if (item == "best") {
      out.emplace_back(std::nullopt);
    } else if (item == "all") {
      for (ca::Simd s : ca::compiled_variants()) {
        if (ca::cpu_supports(s)) out.emplace_back(s);
      }
    } else {
      tz::Expected<ca::Simd> simd = ca::parse_simd(item);
      if (!simd.ok()) return tz::invalid_argument("--simd '{}': {} (or 'best', 'all')", item, simd.status().message());
      out.emplace_back(*simd);
    }
  }
  if (out.empty()) return tz::invalid_argument("--simd: no variant given");
  return out;
}

tz::Expected<std::vector<KernelSpec>> parse_kernels(const std::string& text) {
  const std::vector<KernelSpec> all = all_kernels();
  if (text == "all") return all;
  std::vector<KernelSpec> out;
  for (const std::string& item : split_list(text)) {
    auto it = std::find_if(all.begin(), all.end(), [&](const KernelSpec& k) { return k.name == item; });
    if (it == all.end()) {
      std::string names;
      for (const KernelSpec& k : all) names += (names.empty() ? "" : ", ") + k.name;
      return tz::invalid_argument("--kernels: unknown kernel '{}' (known: {}, or all)", item, names);
    }
    out.push_back(*it);
  }
  if (out.empty()) return tz::invalid_argument("--kernels: no kernel given");
  return out;
}

// ---------------------------------------------------------------- memory

// An anonymous mapping, aligned to 2 MiB (so transparent huge pages can back
// it when asked), unmapped on destruction.
class Buffer {
 public:
  Buffer() = default;
  static tz::Expected<Buffer> map(std::size_t bytes, bool hugepages) {
    constexpr std::size_t kAlign = std::size_t{2} << 20;
    Buffer b;
    b.mapped_ = tz::align_up(std::max<std::size_t>(bytes, 1), kAlign) + kAlign;
    void* base = ::mmap(nullptr, b.mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return tz::errno_status(errno, fmt::format("mmap of {}", tz::format_bytes(bytes)));
    b.base_ = base;
    b.data_ = reinterpret_cast<void*>(tz::align_up(reinterpret_cast<std::uintptr_t>(base), kAlign));
    if (hugepages) (void)::madvise(b.data_, b.mapped_ - kAlign, MADV_HUGEPAGE);  // advice only
    return b;
  }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(data_, o.data_);
    std::swap(mapped_, o.mapped_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (base_ != nullptr) ::munmap(base_, mapped_);
  }
  // An exact, page-aligned mapping of `bytes`, as a plain mmap places it
  // (the engine's host allocator before Note [Coloured arrays]).
  static tz::Expected<Buffer> map_plain(std::size_t bytes) {
    Buffer b;
    b.mapped_ = tz::align_up(std::max<std::size_t>(bytes, 1), std::size_t{4096});
    void* base = ::mmap(nullptr, b.mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return tz::errno_status(errno, fmt::format("mmap of {}", tz::format_bytes(bytes)));
    b.base_ = b.data_ = base;
    return b;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* base_ = nullptr;
  void* data_ = nullptr;
  std::size_t mapped_ = 0;
};

struct ArrayPtr {
  void* ptr = nullptr;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

// Note [Layout rows]
// Where the arrays lie relative to each other decides which cache sets and
// DRAM banks a kernel's streams share (Note [Coloured arrays] in
// tierzero/offload/pool.h). --layouts compares, for the same size and in
// alternating rounds:
//   separate           each array its own 2 MiB-aligned mapping, 2 MiB apart
//                      beyond its size (the bench's own layout, the baseline)
//   aliased            one mapping, the arrays exact multiples of 128 MiB apart
//   engine             the engine's host pool with its colours (what the CPU
//                      tier and the staging sets get)
//   engine-uncoloured  the same pool, every array colour 0: 2 MiB-aligned alone
//   plain-mmap         one exact mmap per array, as the engine's allocator made
//                      them before colours: adjacent, their sizes apart
// The fraction of the limit cannot show aliasing (the limit loop walks the same
// arrays); the row's time against the separate layout's can.
constexpr const char* kLayouts[] = {"separate", "aliased", "engine", "engine-uncoloured", "plain-mmap"};
constexpr std::size_t kAliasBytes = std::size_t{128} << 20;

// One size's arrays in one layout. The gradient-arrival kernels accumulate
// into `m` (its values stay small and finite), so 1B parameters fit in 20 GB.
struct Arrays {
  std::size_t n = 0;
  std::string layout = "separate";
  ArrayPtr p, g, g16, m, v, p16;
  std::vector<Buffer> owned;
  std::unique_ptr<tz::Device> device;  // engine layouts: blocks of a host pool
  std::unique_ptr<tz::MemoryPool> pool;
  std::vector<tz::PoolBlock> blocks;

  tzbench::StreamArrays stream() const {
    return {.p = p.as<std::uint32_t>(), .g = g.as<const std::uint32_t>(), .g16 = g16.as<const std::uint16_t>(),
            .m = m.as<std::uint32_t>(), .v = v.as<std::uint32_t>(), .p16 = p16.as<std::uint16_t>(),
            .acc = m.as<std::uint32_t>()};
  }
};

// xorshift64*: fast, plenty random for benchmark data.
struct Rng {
  std::uint64_t s;
  explicit Rng(std::uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL) {}
  float uniform() {  // [0, 1)
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<float>((s * 0x2545F4914F6CDD1DULL) >> 40) * 0x1p-24f;
  }
};

std::uint16_t bf16_truncate(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<std::uint16_t>(bits >> 16);
}

std::size_t tile_count(std::size_t n, std::size_t tile) { return (n + tile - 1) / tile; }

// Bytes of distinct arrays per element a pattern touches (what the library
// sizes its tiles by: p, g, each state, the copy).
std::size_t distinct_bytes(Pattern pattern) {
  switch (pattern) {
    case Pattern::kAdam: return 16;
    case Pattern::kAdamCopy: return 18;
    case Pattern::kAdagrad:
    case Pattern::kLion: return 12;
    case Pattern::kAdagradCopy:
    case Pattern::kLionCopy: return 14;
    case Pattern::kAccFp32: return 8;
    case Pattern::kAccBf16: return 6;
  }
  return 16;
}

// The limit loops' tile: --tile-elems when given (the kernels get it too),
// else the library's own rule for Options::tile_elems = 0 (cpu_adam/src/
// optimizer.cpp, tile_for): half of L2 over the pattern's distinct bytes per
// element, a multiple of 64 elements, clamped to [16 Ki, 64 Ki].
std::size_t limit_tile(Pattern pattern, std::size_t tile_flag) {
  if (tile_flag != 0) return tile_flag;
  const long l2_sys = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  const std::size_t l2 = l2_sys > 0 ? static_cast<std::size_t>(l2_sys) : std::size_t{1} << 20;
  const std::size_t t = l2 / 2 / distinct_bytes(pattern) / 64 * 64;
  return std::clamp<std::size_t>(t, 16 * 1024, 64 * 1024);
}

// Maps the arrays and fills them in parallel, tile by tile in `arena`, so each
// page is first touched by a worker of the arena that will stream it. Values
// keep every kernel away from denormals, infinities and NaN over many steps:
// p in [-1, 1), g (loss-scaled) in [-4, 4) (about 1e-3 once unscaled),
// m in [-1e-4, 1e-4), v in [1e-8, 1e-6 + 1e-8).
tz::Status map_layout(Arrays& a, bool hugepages) {
  const std::size_t n = a.n;
  ArrayPtr* arrays[] = {&a.p, &a.g, &a.g16, &a.m, &a.v, &a.p16};
  const std::size_t bytes[] = {n * 4, n * 4, n * 2, n * 4, n * 4, n * 2};
  if (a.layout == "separate" || a.layout == "plain-mmap") {
    for (std::size_t i = 0; i < 6; ++i) {
      TZ_ASSIGN_OR_RETURN(Buffer b, a.layout == "separate" ? Buffer::map(bytes[i], hugepages) : Buffer::map_plain(bytes[i]));
      arrays[i]->ptr = b.as<void>();
      a.owned.push_back(std::move(b));
    }
    return tz::ok_status();
  }
  if (a.layout == "aliased") {
    const std::size_t stride = tz::align_up(n * 4, kAliasBytes);
    TZ_ASSIGN_OR_RETURN(Buffer b, Buffer::map(6 * stride, hugepages));
    for (std::size_t i = 0; i < 6; ++i) arrays[i]->ptr = b.as<char>() + i * stride;
    a.owned.push_back(std::move(b));
    return tz::ok_status();
  }
  // engine, engine-uncoloured: through the CPU tier's pool, coloured as the engine colours them.
  using tz::Colour;
  const Colour colours[] = {Colour::kMaster, Colour::kGrad, Colour::kArrivingGrad, Colour::kExpAvg, Colour::kExpAvgSq,
                            Colour::kParam16};
  a.device = tz::create_host_device();
  TZ_ASSIGN_OR_RETURN(a.pool, tz::make_host_pool(*a.device, 20 * n + (std::uint64_t{64} << 20),
                                                 {.pinned = false, .huge_pages = hugepages}));
  for (std::size_t i = 0; i < 6; ++i) {
    TZ_ASSIGN_OR_RETURN(tz::PoolBlock block,
                        a.pool->allocate(bytes[i], a.layout == "engine" ? colours[i] : Colour::kMaster));
    arrays[i]->ptr = block.data();
    a.blocks.push_back(std::move(block));
  }
  return tz::ok_status();
}

tz::Expected<Arrays> make_arrays(std::size_t n, const std::string& layout, bool hugepages, tbb::task_arena& arena,
                                 std::size_t tile) {
  Arrays a;
  a.n = n;
  a.layout = layout;
  TZ_TRY_CTX(map_layout(a, hugepages), "layout {}", layout);
  float* p = a.p.as<float>();
  float* g = a.g.as<float>();
  std::uint16_t* g16 = a.g16.as<std::uint16_t>();
  float* m = a.m.as<float>();
  float* v = a.v.as<float>();
  std::uint16_t* p16 = a.p16.as<std::uint16_t>();
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, tile_count(n, tile), 1),
        [&](const tbb::blocked_range<std::size_t>& r) {
          for (std::size_t t = r.begin(); t != r.end(); ++t) {
            Rng rng(t + 1);
            const std::size_t end = std::min(n, (t + 1) * tile);
            for (std::size_t i = t * tile; i < end; ++i) {
              p[i] = 2 * rng.uniform() - 1;
              g[i] = 8 * rng.uniform() - 4;
              g16[i] = bf16_truncate(8 * rng.uniform() - 4);
              m[i] = (2 * rng.uniform() - 1) * 1e-4f;
              v[i] = rng.uniform() * 1e-6f + 1e-8f;
              p16[i] = 0;
            }
          }
        },
        tbb::simple_partitioner());
  });
  return a;
}

// ---------------------------------------------------------------- machine

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return static_cast<int>(std::thread::hardware_concurrency());
  return CPU_COUNT(&set);
}

// ---------------------------------------------------------------- measuring

// The limit loops' arena: `threads` slots. On a machine with several NUMA
// nodes it is kept to the first node, as the library pins its workers to the
// node of CPU 0 by default; on one node neither pins.
std::unique_ptr<tbb::task_arena> make_arena(int threads) {
  const std::vector<tbb::numa_node_id> nodes = tbb::info::numa_nodes();
  if (nodes.size() > 1) {
    return std::make_unique<tbb::task_arena>(tbb::task_arena::constraints(nodes.front(), threads));
  }
  return std::make_unique<tbb::task_arena>(threads);
}

// One optimizer configuration: the library's optimizer and a limit arena of the same size.
struct Config {
  int threads_requested = 0;           // 0 = all
  std::optional<ca::Simd> simd_requested;
  std::unique_ptr<ca::CpuOptimizer> opt;
  std::unique_ptr<tbb::task_arena> arena;
  int threads = 0;                     // as the optimizer resolved it
};

struct Row {
  KernelSpec kernel;
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::size_t tile = 0;  // limit-loop tile, elements
  std::vector<double> kernel_s, limit_s;
  double kernel_median = 0, limit_median = 0;
  double pair_ratio_median = 0;  // median over repetitions of limit/kernel, for the record

  double bytes() const { return tzbench::pattern_bytes_per_param(kernel.pattern) * static_cast<double>(n); }
  double ns_per_param() const { return kernel_median / static_cast<double>(n) * 1e9; }
  double gbps() const { return bytes() / kernel_median / 1e9; }
  double limit_gbps() const { return bytes() / limit_median / 1e9; }
  double fraction() const { return limit_median / kernel_median; }
};

// As the library runs its tiles (optimizer.cpp, run_tiles): in the calling
// thread, in order, with one thread; else one task per tile in the arena.
double time_limit(Config& c, Pattern pattern, const tzbench::StreamArrays& s, std::size_t n, std::size_t tile,
                  bool plain_copy) {
  const auto start = Clock::now();
  if (c.threads == 1 || tile_count(n, tile) == 1) {
    for (std::size_t t = 0; t < tile_count(n, tile); ++t) {
      tzbench::stream_range(pattern, s, t * tile, std::min(n, (t + 1) * tile), plain_copy);
    }
    return seconds_since(start);
  }
  c.arena->execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, tile_count(n, tile), 1),
        [&](const tbb::blocked_range<std::size_t>& r) {
          for (std::size_t t = r.begin(); t != r.end(); ++t) {
            tzbench::stream_range(pattern, s, t * tile, std::min(n, (t + 1) * tile), plain_copy);
          }
        },
        tbb::simple_partitioner());
  });
  return seconds_since(start);
}

tz::Expected<double> time_kernel(Config& c, const KernelSpec& k, const Arrays& a, std::int64_t& step) {
  const auto start = Clock::now();
  if (k.kind == Kind::kStep) {
    ca::Spans spans{.n = a.n, .param = a.p.as<float>(), .grad = a.g.as<const void>(), .grad_dtype = ca::DType::kFp32};
    switch (k.algorithm) {
      case ca::Algorithm::kAdam:
      case ca::Algorithm::kAdamW:
        spans.exp_avg = a.m.as<void>();
        spans.exp_avg_sq = a.v.as<void>();
        break;
      case ca::Algorithm::kAdagrad: spans.exp_avg_sq = a.v.as<void>(); break;
      case ca::Algorithm::kLion: spans.exp_avg = a.m.as<void>(); break;
    }
    if (k.copy_out) {
      spans.param16 = a.p16.as<void>();
      spans.param16_dtype = ca::DType::kBf16;
    }
    TZ_TRY_CTX(c.opt->step(hyper_for(k.algorithm), {.step = ++step, .grad_scale = kGradScale}, spans), "{}", k.name);
  } else {
    const void* grad = k.grad_dtype == ca::DType::kFp32 ? a.g.as<const void>() : a.g16.as<const void>();
    tz::Expected<ca::GradStats> stats =
        c.opt->accumulate_grad(a.m.as<float>(), grad, k.grad_dtype, a.n, /*overwrite=*/false, kGradScale);
    TZ_TRY_CTX(stats, "{}", k.name);
    if (stats->non_finite) return tz::internal_error("{}: the accumulated gradient went non-finite", k.name);
  }
  return seconds_since(start);
}

// Every kernel of one configuration. One warm-up round (limit, kernel for each
// kernel), then `repeats` rounds of the same; the rounds are the outer loop so
// that slow drifts of the machine's bandwidth (this is a VM with neighbours)
// spread over every kernel alike, and comparisons across kernels (the copy-out
// cost) see the same conditions, not only each kernel and its limit.
tz::Status measure(Config& c, const std::vector<KernelSpec>& kernels, const Arrays& a, const Flags& flags,
                   std::int64_t& step, Progress& progress, const std::string& where, std::vector<Row>& out) {
  std::vector<Row> rows;
  for (const KernelSpec& k : kernels) {
    rows.push_back(Row{.kernel = k, .n = a.n, .threads = c.threads, .simd = std::string(ca::simd_name(c.opt->simd())),
                       .tile = limit_tile(k.pattern, flags.tile_elems)});
  }
  const tzbench::StreamArrays s = a.stream();
  for (int r = -1; r < flags.repeats; ++r) {  // -1: the warm-up
    for (Row& row : rows) {
      if (r < 0) {
        progress.show("{}: warm-up {}", where, row.kernel.name);
      } else if (progress.tty()) {
        progress.show("{}: round {}/{} {}", where, r + 1, flags.repeats, row.kernel.name);
      }
      const double limit = time_limit(c, row.kernel.pattern, s, a.n, row.tile, flags.plain_copy_limit);
      TZ_ASSIGN_OR_RETURN(double kernel, time_kernel(c, row.kernel, a, step));
      if (r < 0) continue;
      row.limit_s.push_back(limit);
      row.kernel_s.push_back(kernel);
    }
    if (r >= 0 && !progress.tty()) progress.show("{}: round {}/{} done", where, r + 1, flags.repeats);
  }
  for (Row& row : rows) {
    row.kernel_median = median(row.kernel_s);
    row.limit_median = median(row.limit_s);
    std::vector<double> ratios;
    for (std::size_t i = 0; i < row.kernel_s.size(); ++i) ratios.push_back(row.limit_s[i] / row.kernel_s[i]);
    row.pair_ratio_median = median(ratios);
    out.push_back(std::move(row));
  }
  return tz::ok_status();
}

// ---------------------------------------------------------------- layouts

struct LayoutRow {
  std::string layout;
  KernelSpec kernel;
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::vector<double> kernel_s, limit_s;
  double kernel_median = 0, limit_median = 0;
  double vs_separate = 0;  // the separate layout's kernel median / this one's (>= 0.9: within 10%)
};

tz::Expected<std::vector<std::string>> parse_layouts(const std::string& text) {
  std::vector<std::string> out;
  for (const std::string& item : split_list(text)) {
    if (std::find(std::begin(kLayouts), std::end(kLayouts), item) == std::end(kLayouts)) {
      return tz::invalid_argument("--layouts: '{}' is not one of separate, aliased, engine, engine-uncoloured, "
                                  "plain-mmap", item);
    }
    if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
  }
  if (std::find(out.begin(), out.end(), "separate") == out.end()) out.insert(out.begin(), "separate");
  return out;
}

// Note [Layout rows]: every layout's arrays held at once, the rounds
// alternating over the layouts (limit, kernel for each), so drift hits all alike.
tz::Status measure_layouts(Config& c, const std::vector<KernelSpec>& kernels, const std::vector<Arrays>& layouts,
                           const Flags& flags, std::int64_t& step, Progress& progress, std::vector<LayoutRow>& out) {
  std::vector<LayoutRow> rows;
  for (const KernelSpec& k : kernels) {
    for (const Arrays& a : layouts) {
      rows.push_back({.layout = a.layout, .kernel = k, .n = a.n, .threads = c.threads,
                      .simd = std::string(ca::simd_name(c.opt->simd()))});
    }
  }
  for (int r = -1; r < flags.repeats; ++r) {
    progress.show("layouts, {} thread(s): round {}/{}", c.threads, r + 1, flags.repeats);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Arrays& a = layouts[i % layouts.size()];
      LayoutRow& row = rows[i];
      const std::size_t tile = limit_tile(row.kernel.pattern, flags.tile_elems);
      const double limit = time_limit(c, row.kernel.pattern, a.stream(), a.n, tile, flags.plain_copy_limit);
      TZ_ASSIGN_OR_RETURN(double kernel, time_kernel(c, row.kernel, a, step));
      if (r < 0) continue;
      row.limit_s.push_back(limit);
      row.kernel_s.push_back(kernel);
    }
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    rows[i].kernel_median = median(rows[i].kernel_s);
    rows[i].limit_median = median(rows[i].limit_s);
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const LayoutRow& base = rows[i - i % layouts.size()];  // "separate" comes first
    rows[i].vs_separate = base.kernel_median / rows[i].kernel_median;
    out.push_back(rows[i]);
  }
  return tz::ok_status();
}

nlohmann::json print_layouts(const std::vector<LayoutRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  std::printf("\nlayouts (Note [Layout rows]): the same kernels on arrays placed differently, rounds alternating; "
              "vs separate = the separate layout's time / this one's (>= 0.90: within 10%%)\n");
  std::printf("%-18s %-11s %7s %7s %-7s %9s %8s %11s %9s %12s\n", "layout", "kernel", "size", "threads", "simd",
              "ns/param", "GB/s", "limit GB/s", "fraction", "vs separate");
  for (const LayoutRow& r : rows) {
    const double n = static_cast<double>(r.n), bytes = tzbench::pattern_bytes_per_param(r.kernel.pattern) * n;
    std::printf("%-18s %-11s %7s %7d %-7s %9.3f %8.2f %11.2f %9.3f %12.3f\n", r.layout.c_str(), r.kernel.name.c_str(),
                tz::format_count(n).c_str(), r.threads, r.simd.c_str(), r.kernel_median / n * 1e9,
                bytes / r.kernel_median / 1e9, bytes / r.limit_median / 1e9, r.limit_median / r.kernel_median,
                r.vs_separate);
    out.push_back({{"layout", r.layout}, {"kernel", r.kernel.name}, {"size", r.n}, {"threads", r.threads},
                   {"simd", r.simd}, {"kernel_seconds", r.kernel_s}, {"limit_seconds", r.limit_s},
                   {"kernel_median_s", r.kernel_median}, {"limit_median_s", r.limit_median},
                   {"fraction_of_limit", r.limit_median / r.kernel_median}, {"vs_separate", r.vs_separate},
                   {"within_10_percent", r.vs_separate >= 0.9}});
  }
  return out;
}

// ---------------------------------------------------------------- whole step

// The whole per-step optimizer work of a bf16 mixed-precision step, as the
// engine runs it: the bf16 gradient (loss-scaled) arrives and is unscaled into
// the fp32 gradient buffer in the pass that also yields its squared norm; the
// clip coefficient follows from the norm (max norm 1, torch's formula); one
// fused AdamW pass applies it and writes the bf16 copy. 6 + 30 = 36 B/param.
// torch's "whole" variant (kTorchScript) does the same work its own way.
constexpr double kMaxGradNorm = 1.0;

struct WholeRow {
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::vector<double> seconds;
  double median_s = 0;
  double clip = 0;  // the last clip coefficient, for the record
};

tz::Expected<double> time_whole_step(Config& c, const Arrays& a, std::int64_t& step, double& clip) {
  const auto start = Clock::now();
  TZ_ASSIGN_OR_RETURN(const ca::GradStats stats,
                      c.opt->accumulate_grad(a.g.as<float>(), a.g16.as<const void>(), ca::DType::kBf16, a.n,
                                             /*overwrite=*/true, kGradScale));
  if (stats.non_finite) return tz::internal_error("whole step: the gradient went non-finite");
  clip = std::min(1.0, kMaxGradNorm / (std::sqrt(stats.sum_squares) + 1e-6));
  ca::Spans spans{.n = a.n, .param = a.p.as<float>(), .grad = a.g.as<const void>(), .grad_dtype = ca::DType::kFp32,
                  .exp_avg = a.m.as<void>(), .exp_avg_sq = a.v.as<void>(), .param16 = a.p16.as<void>(),
                  .param16_dtype = ca::DType::kBf16};
  TZ_TRY_CTX(c.opt->step(hyper_for(ca::Algorithm::kAdamW), {.step = ++step, .grad_scale = clip}, spans),
             "whole step");
  return seconds_since(start);
}

tz::Status measure_whole_step(Config& c, const Arrays& a, int repeats, std::int64_t& step, Progress& progress,
                              const std::string& where, std::vector<WholeRow>& out) {
  WholeRow row{.n = a.n, .threads = c.threads, .simd = std::string(ca::simd_name(c.opt->simd()))};
  progress.show("{}: whole step", where);
  for (int r = -1; r < repeats; ++r) {  // -1: the warm-up
    TZ_ASSIGN_OR_RETURN(const double s, time_whole_step(c, a, step, row.clip));
    if (r >= 0) row.seconds.push_back(s);
  }
  row.median_s = median(row.seconds);
  out.push_back(std::move(row));
  return tz::ok_status();
}

// ---------------------------------------------------------------- torch

constexpr const char* kTorchScript = R"PY(
# tierzero-adam-bench's torch side. argv: n, thread counts (comma list), repeats.
# "fused" and "default": median time of optimizer.step() over one flat fp32
# parameter. "whole": the whole per-step optimizer work of a bf16
# mixed-precision step as a torch user writes it: the bf16 gradient (scaled by
# 4096) lands in the fp32 .grad, GradScaler.unscale_ (unscale + inf check),
# clip_grad_norm_(1.0), scaler.step with fused AdamW, and the bf16 copy of the
# new parameter.
import json, statistics, sys, time
import torch
n, threads, repeats = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
print(json.dumps({"torch_version": torch.__version__}), flush=True)
g = torch.Generator().manual_seed(0)
for variant in ("fused", "default", "whole"):
    for t in threads:
        torch.set_num_threads(t)
        try:
            p = torch.nn.Parameter(torch.rand(n, generator=g) * 2 - 1)
            p.grad = (torch.rand(n, generator=g) * 2 - 1) * 1e-3
            kw = {} if variant == "default" else {"fused": True}
            opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)
            if variant == "whole":
                g16 = ((torch.rand(n, generator=g) * 8 - 4)).bfloat16()
                p16 = torch.empty(n, dtype=torch.bfloat16)
                scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=10**9)
                def work():
                    scaler.scale(torch.ones(()))  # what scaler.scale(loss) does before backward
                    p.grad.copy_(g16)
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)
                    scaler.step(opt)
                    scaler.update()
                    p16.copy_(p.detach())
            else:
                work = opt.step
            work()  # warm-up: creates and touches the state
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                work()
                times.append(time.perf_counter() - start)
            print(json.dumps({"variant": variant, "threads": t, "seconds": times,
                              "median_s": statistics.median(times)}), flush=True)
            del opt, p, work
        except Exception as e:  # e.g. fused=True unsupported on CPU in this torch
            print(json.dumps({"variant": variant, "threads": t, "error": f"{type(e).__name__}: {e}"}), flush=True)
)PY";

// "" when `python -c "import torch"` works, else why not.
std::string torch_unavailable_reason(const std::string& python) {
  const std::string command = python + " -c 'import torch' >/dev/null 2>&1";
  const int rc = std::system(command.c_str());
  if (rc == 0) return "";
  return fmt::format("'{} -c \"import torch\"' failed (exit status {})", python,
                     WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
}

// Runs the script for one size; returns its JSON lines (one per variant and
// thread count, plus the version line).
tz::Expected<std::vector<nlohmann::json>> run_torch(const std::string& python, std::size_t n,
                                                    const std::vector<int>& threads, int repeats) {
  char path[] = "/tmp/tierzero-adam-bench-torch-XXXXXX.py";
  const int fd = ::mkstemps(path, 3);
  if (fd < 0) return tz::errno_status(errno, "creating the torch script");
  const std::size_t len = std::strlen(kTorchScript);
  const bool written = ::write(fd, kTorchScript, len) == static_cast<ssize_t>(len);
  ::close(fd);
  if (!written) {
    ::unlink(path);
    return tz::io_error("writing the torch script {}", path);
  }
  std::string thread_list;
  for (int t : threads) thread_list += (thread_list.empty() ? "" : ",") + std::to_string(t);
  const std::string command = fmt::format("{} {} {} {} {}", python, path, n, thread_list, repeats);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ::unlink(path);
    return tz::errno_status(errno, "starting " + command);
  }
  std::vector<nlohmann::json> lines;
  std::string line;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    line += buf;
    if (line.empty() || line.back() != '\n') continue;
    if (line.front() == '{') {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) lines.push_back(std::move(j));
    }
    line.clear();
  }
  const int rc = ::pclose(pipe);
  ::unlink(path);
  if (rc != 0 && lines.size() <= 1) return tz::internal_error("'{}' failed (status {})", command, rc);
  return lines;
}

// ---------------------------------------------------------------- output

struct TorchMedians {  // of one (size, threads); 0 where not measured
  double fused = 0, dflt = 0, whole = 0;
};

// The whole-step table; returns its JSON. With torch, the speedup is
// torch's time over ours (> 1: tierzero faster).
nlohmann::json print_whole_step(const std::vector<WholeRow>& rows,
                                const std::map<std::pair<std::size_t, int>, TorchMedians>& torch) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  std::printf("\nwhole optimizer step, bf16 mixed precision (gradient arrival + unscale, norm, clip to %.0f, AdamW, "
              "bf16 copy; ours: 2 passes, 36 B/param); torch: GradScaler.unscale_, clip_grad_norm_, fused AdamW, "
              "copy_\n",
              kMaxGradNorm);
  std::printf("%7s %7s %-7s %12s %9s %13s %9s\n", "size", "threads", "simd", "ours ns/p", "GB/s", "torch ns/p",
              "speedup");
  for (const WholeRow& r : rows) {
    auto it = torch.find({r.n, r.threads});
    const double t = it == torch.end() ? 0 : it->second.whole;
    const double n = static_cast<double>(r.n);
    std::printf("%7s %7d %-7s %12.3f %9.2f %13s %9s\n", tz::format_count(n).c_str(), r.threads, r.simd.c_str(),
                r.median_s / n * 1e9, 36 * n / r.median_s / 1e9,
                t > 0 ? fmt::format("{:.3f}", t / n * 1e9).c_str() : "-",
                t > 0 ? fmt::format("{:.2f}x", t / r.median_s).c_str() : "-");
    out.push_back({{"size", r.n}, {"threads", r.threads}, {"simd", r.simd}, {"seconds", r.seconds},
                   {"median_s", r.median_s}, {"last_clip_coefficient", r.clip},
                   {"torch_median_s", t > 0 ? nlohmann::json(t) : nlohmann::json(nullptr)},
                   {"speedup_over_torch", t > 0 ? nlohmann::json(t / r.median_s) : nlohmann::json(nullptr)}});
  }
  return out;
}

const Row* find_row(const std::vector<Row>& rows, std::size_t n, int threads, const std::string& simd,
                    const std::string& kernel) {
  for (const Row& r : rows) {
    if (r.n == n && r.threads == threads && r.simd == simd && r.kernel.name == kernel) return &r;
  }
  return nullptr;
}

void print_table(const std::vector<Row>& rows) {
  std::printf("%-13s %7s %7s %-7s %9s %8s %11s %9s %9s\n", "kernel", "size", "threads", "simd", "ns/param", "GB/s",
              "limit GB/s", "fraction", "pairwise");
  for (const Row& r : rows) {
    std::printf("%-13s %7s %7d %-7s %9.3f %8.2f %11.2f %9.3f %9.3f\n", r.kernel.name.c_str(),
                tz::format_count(static_cast<double>(r.n)).c_str(), r.threads, r.simd.c_str(), r.ns_per_param(),
                r.gbps(), r.limit_gbps(), r.fraction(), r.pair_ratio_median);
  }
  std::printf("fraction = limit median / kernel median; pairwise = median over rounds of limit / kernel "
              "(robust to drift)\n");
}

struct CopyCost {
  std::string algorithm;
  std::size_t n;
  int threads;
  std::string simd;
  double plain_s, copy_s, cost, limit_cost;
  double pairwise;  // median over rounds of (copy - plain) / plain, the two measured in the same round
};

std::vector<CopyCost> copy_costs(const std::vector<Row>& rows) {
  std::vector<CopyCost> out;
  for (const Row& plain : rows) {
    if (plain.kernel.kind != Kind::kStep || plain.kernel.copy_out) continue;
    const Row* copy = find_row(rows, plain.n, plain.threads, plain.simd, plain.kernel.name + "+bf16");
    if (copy == nullptr) continue;
    std::vector<double> per_round;
    for (std::size_t i = 0; i < std::min(plain.kernel_s.size(), copy->kernel_s.size()); ++i) {
      per_round.push_back((copy->kernel_s[i] - plain.kernel_s[i]) / plain.kernel_s[i]);
    }
    out.push_back({plain.kernel.name, plain.n, plain.threads, plain.simd, plain.kernel_median, copy->kernel_median,
                   (copy->kernel_median - plain.kernel_median) / plain.kernel_median,
                   (copy->limit_median - plain.limit_median) / plain.limit_median, median(per_round)});
  }
  return out;
}

nlohmann::json row_json(const Row& r) {
  return {{"kernel", r.kernel.name},
          {"kind", r.kernel.kind == Kind::kStep ? "step" : "grad_arrival"},
          {"algorithm", r.kernel.kind == Kind::kStep ? nlohmann::json(ca::algorithm_name(r.kernel.algorithm))
                                                     : nlohmann::json(nullptr)},
          {"copy_out", r.kernel.copy_out ? "bf16" : "none"},
          {"grad_dtype", ca::dtype_name(r.kernel.grad_dtype)},
          {"size", r.n},
          {"threads", r.threads},
          {"simd", r.simd},
          {"bytes_per_param", tzbench::pattern_bytes_per_param(r.kernel.pattern)},
          {"limit_tile_elems", r.tile},
          {"kernel_seconds", r.kernel_s},
          {"limit_seconds", r.limit_s},
          {"kernel_median_s", r.kernel_median},
          {"limit_median_s", r.limit_median},
          {"ns_per_param", r.ns_per_param()},
          {"gbps", r.gbps()},
          {"limit_gbps", r.limit_gbps()},
          {"fraction_of_limit", r.fraction()},
          {"fraction_of_limit_pairwise_median", r.pair_ratio_median}};
}

// ---------------------------------------------------------------- run

tz::Status run(const Flags& flags) {
  TZ_ASSIGN_OR_RETURN(std::vector<std::size_t> sizes, parse_sizes(flags.sizes));
  TZ_ASSIGN_OR_RETURN(std::vector<int> thread_list, parse_threads(flags.threads));
  TZ_ASSIGN_OR_RETURN(auto simd_list, parse_simd_list(flags.simd));
  TZ_ASSIGN_OR_RETURN(std::vector<KernelSpec> kernels, parse_kernels(flags.kernels));
  TZ_ASSIGN_OR_RETURN(std::vector<std::string> layouts, parse_layouts(flags.layouts));
  std::vector<KernelSpec> layout_kernels;  // the Adam steps among --kernels
  for (const KernelSpec& k : kernels) {
    if (k.kind == Kind::kStep && (k.algorithm == ca::Algorithm::kAdamW || k.algorithm == ca::Algorithm::kAdam)) {
      layout_kernels.push_back(k);
    }
  }
  if (layouts.size() > 1 && layout_kernels.empty()) {
    return tz::invalid_argument("--layouts compares the Adam kernels; --kernels {} has none", flags.kernels);
  }
  if (flags.tile_elems % 16 != 0) {
    return tz::invalid_argument("--tile-elems {}: must be a multiple of 16 (64 bytes of fp32)", flags.tile_elems);
  }

  // Refuse what does not fit before touching anything.
  TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading mem, tz::read_host_memory());
  for (std::size_t n : sizes) {
    const std::uint64_t need = kBytesPerParamMapped * n;
    if (need + kHeadroomBytes > mem.available_bytes) {
      return tz::out_of_memory(
          "--sizes {}: {} parameters need {} of arrays ({} B/param: p, g fp32, g bf16, m, v, bf16 copy) plus {} "
          "headroom, but MemAvailable is {}",
          tz::format_count(static_cast<double>(n)), n, tz::format_bytes(need), kBytesPerParamMapped,
          tz::format_bytes(kHeadroomBytes), tz::format_bytes(mem.available_bytes));
    }
  }

  // TBB's workers, as many as the largest arena asks for (by default TBB caps
  // them at the CPU count; this applies to the library's arenas and ours alike).
  int max_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int t : thread_list) max_threads = std::max(max_threads, t);
  tbb::global_control workers(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(max_threads));

  // One optimizer and one limit arena per (threads, simd).
  std::vector<Config> configs;
  std::vector<std::pair<int, std::string>> seen;
  for (int t : thread_list) {
    for (const std::optional<ca::Simd>& simd : simd_list) {
      Config c;
      c.threads_requested = t;
      c.simd_requested = simd;
      ca::Options options{.threads = t, .simd = simd, .tile_elems = flags.tile_elems};
      TZ_ASSIGN_OR_RETURN(c.opt, ca::CpuOptimizer::create(options));
      c.threads = c.opt->threads();
      const std::string simd_name(ca::simd_name(c.opt->simd()));
      if (std::find(seen.begin(), seen.end(), std::pair{c.threads, simd_name}) != seen.end()) continue;  // "2,all"
      seen.emplace_back(c.threads, simd_name);
      c.arena = make_arena(c.threads);
      configs.push_back(std::move(c));
    }
  }
  std::vector<int> resolved_threads;
  for (const Config& c : configs) {
    if (std::find(resolved_threads.begin(), resolved_threads.end(), c.threads) == resolved_threads.end()) {
      resolved_threads.push_back(c.threads);
    }
  }
  auto widest = std::max_element(configs.begin(), configs.end(),
                                 [](const Config& a, const Config& b) { return a.threads < b.threads; });

  const std::string model = cpu_model();
  const std::string thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  std::printf("%s\n", build_summary().c_str());
  std::printf("cpu: %s, %d CPUs online (%d in affinity), MemAvailable %s, THP %s%s\n", model.c_str(),
              static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), affinity_cpus(),
              tz::format_bytes(mem.available_bytes).c_str(), thp.c_str(),
              flags.hugepages ? " (arrays madvise'd)" : " (no madvise)");
  std::printf("limit loops: %s, %s stores for the 16-bit copy, tiles as the library's (%s); %d timed repeats after "
              "1 warm-up, medians; grad scale 1/%g\n\n",
              std::string(tzbench::stream_isa()).c_str(), flags.plain_copy_limit ? "plain" : "non-temporal",
              flags.tile_elems != 0 ? fmt::format("{} elements", flags.tile_elems).c_str() : "L2-sized",
              flags.repeats, 1 / kGradScale);
  std::fflush(stdout);

  const std::string torch_reason = flags.torch ? torch_unavailable_reason(flags.python) : "disabled by --no-torch";
  nlohmann::json torch_json = nullptr;
  nlohmann::json torch_runs = nlohmann::json::array();

  Progress progress;
  std::vector<Row> rows;
  std::int64_t step = 0;
  std::map<std::pair<std::size_t, int>, TorchMedians> torch_medians;  // (n, threads)
  std::vector<WholeRow> whole_rows;
  for (std::size_t n : sizes) {
    const std::string size_name = tz::format_count(static_cast<double>(n));
    {
      progress.show("size {}: mapping and filling {} with {} threads", size_name,
                    tz::format_bytes(kBytesPerParamMapped * n), widest->threads);
      TZ_ASSIGN_OR_RETURN(Arrays arrays, make_arrays(n, "separate", flags.hugepages, *widest->arena,
                                                     limit_tile(Pattern::kAdam, flags.tile_elems)));
      for (Config& c : configs) {
        const std::string where = fmt::format("size {}, {} thread{}, {}", size_name, c.threads,
                                              c.threads == 1 ? "" : "s", ca::simd_name(c.opt->simd()));
        TZ_TRY(measure(c, kernels, arrays, flags, step, progress, where, rows));
        if (flags.whole_step) TZ_TRY(measure_whole_step(c, arrays, flags.repeats, step, progress, where, whole_rows));
      }
    }  // arrays unmapped before torch runs
    if (torch_reason.empty()) {
      TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading now, tz::read_host_memory());
      // p, grad, two moments, and the default implementation's temporaries.
      if (std::uint64_t{24} * n + kHeadroomBytes > now.available_bytes) {
        torch_runs.push_back({{"size", n}, {"error", "skipped: not enough MemAvailable for 24 B/param"}});
        continue;
      }
      progress.show("size {}: torch.optim.AdamW", size_name);
      tz::Expected<std::vector<nlohmann::json>> lines = run_torch(flags.python, n, resolved_threads, flags.repeats);
      if (!lines.ok()) {
        torch_runs.push_back({{"size", n}, {"error", lines.status().message()}});
        continue;
      }
      for (nlohmann::json& j : *lines) {
        if (j.contains("torch_version")) {
          torch_json["version"] = j["torch_version"];
          continue;
        }
        j["size"] = n;
        if (j.contains("median_s")) {
          auto& slot = torch_medians[{n, j["threads"].get<int>()}];
          const double median_s = j["median_s"].get<double>();
          if (j["variant"] == "fused") slot.fused = median_s;
          if (j["variant"] == "default") slot.dflt = median_s;
          if (j["variant"] == "whole") slot.whole = median_s;
        }
        torch_runs.push_back(j);
      }
    }
  }
  std::vector<LayoutRow> layout_rows;
  for (std::size_t n : layouts.size() > 1 ? sizes : std::vector<std::size_t>{}) {
    // Every layout's arrays at once (aliased ones rounded up to 128 MiB each).
    TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading now, tz::read_host_memory());
    const std::uint64_t need = layouts.size() * (6 * tz::align_up(n * 4, kAliasBytes));
    if (need + kHeadroomBytes > now.available_bytes) {
      return tz::out_of_memory("--layouts at size {}: {} layouts need up to {} of arrays, MemAvailable is {}; use a "
                               "smaller --sizes", n, layouts.size(), tz::format_bytes(need),
                               tz::format_bytes(now.available_bytes));
    }
    std::vector<Arrays> placed;
    for (const std::string& layout : layouts) {
      progress.show("size {}: mapping and filling the {} layout", tz::format_count(static_cast<double>(n)), layout);
      TZ_ASSIGN_OR_RETURN(Arrays a, make_arrays(n, layout, flags.hugepages, *widest->arena,
                                                limit_tile(Pattern::kAdam, flags.tile_elems)));
      placed.push_back(std::move(a));
    }
    for (Config& c : configs) TZ_TRY(measure_layouts(c, layout_kernels, placed, flags, step, progress, layout_rows));
  }
  progress.done();

  // The tables.
  print_table(rows);
  const std::vector<CopyCost> costs = copy_costs(rows);
  if (!costs.empty()) {
    std::printf("\nbf16 copy-out cost, (t_copy - t_plain) / t_plain of the medians; pairwise: median over rounds; "
                "limit: the same for the limit loops (Adam 30 vs 28 B: +7.1%%; Adagrad, Lion 22 vs 20 B: +10%%)\n");
    std::printf("%-9s %7s %7s %-7s %14s %14s %8s %9s %8s\n", "algorithm", "size", "threads", "simd", "plain ns/param",
                "copy ns/param", "cost", "pairwise", "limit");
    for (const CopyCost& c : costs) {
      std::printf("%-9s %7s %7d %-7s %14.3f %14.3f %7.1f%% %8.1f%% %7.1f%%\n", c.algorithm.c_str(),
                  tz::format_count(static_cast<double>(c.n)).c_str(), c.threads, c.simd.c_str(),
                  c.plain_s / static_cast<double>(c.n) * 1e9, c.copy_s / static_cast<double>(c.n) * 1e9,
                  100 * c.cost, 100 * c.pairwise, 100 * c.limit_cost);
    }
  }

  // torch.
  nlohmann::json torch_compare = nlohmann::json::array();
  if (!torch_reason.empty()) {
    std::printf("\nPyTorch: not importable, torch.optim.AdamW not timed (%s)\n", torch_reason.c_str());
  } else {
    std::printf("\ntorch.optim.AdamW (torch %s) vs tierzero adamw, fp32, same size and threads; ours/torch = time "
                "ratio (< 1: tierzero faster)\n",
                torch_json.value("version", std::string("?")).c_str());
    std::printf("%7s %7s %-7s %12s %12s %12s %11s %13s\n", "size", "threads", "simd", "ours ns/p", "fused ns/p",
                "default ns/p", "ours/fused", "ours/default");
    for (const Row& r : rows) {
      if (r.kernel.name != "adamw") continue;
      auto it = torch_medians.find({r.n, r.threads});
      const double fused = it == torch_medians.end() ? 0 : it->second.fused;
      const double dflt = it == torch_medians.end() ? 0 : it->second.dflt;
      auto ns = [&](double s) { return s > 0 ? fmt::format("{:.3f}", s / static_cast<double>(r.n) * 1e9) : "-"; };
      auto ratio = [&](double s) { return s > 0 ? fmt::format("{:.3f}", r.kernel_median / s) : "-"; };
      std::printf("%7s %7d %-7s %12.3f %12s %12s %11s %13s\n", tz::format_count(static_cast<double>(r.n)).c_str(),
                  r.threads, r.simd.c_str(), r.ns_per_param(), ns(fused).c_str(), ns(dflt).c_str(),
                  ratio(fused).c_str(), ratio(dflt).c_str());
      torch_compare.push_back({{"size", r.n}, {"threads", r.threads}, {"simd", r.simd},
                               {"ours_median_s", r.kernel_median},
                               {"torch_fused_median_s", fused > 0 ? nlohmann::json(fused) : nlohmann::json(nullptr)},
                               {"torch_default_median_s", dflt > 0 ? nlohmann::json(dflt) : nlohmann::json(nullptr)},
                               {"ours_over_fused", fused > 0 ? nlohmann::json(r.kernel_median / fused) : nlohmann::json(nullptr)},
                               {"ours_over_default", dflt > 0 ? nlohmann::json(r.kernel_median / dflt) : nlohmann::json(nullptr)}});
    }
    torch_json["runs"] = torch_runs;
    torch_json["compare"] = torch_compare;
  }

  const nlohmann::json whole_json = print_whole_step(whole_rows, torch_medians);
  const nlohmann::json layouts_json = print_layouts(layout_rows);

  // Issue #4's targets, at 2 threads where measured (else the most threads measured).
  const int target_threads = std::find(resolved_threads.begin(), resolved_threads.end(), 2) != resolved_threads.end()
                                 ? 2
                                 : *std::max_element(resolved_threads.begin(), resolved_threads.end());
  nlohmann::json targets = nlohmann::json::array();
  std::printf("\ntargets (issue #4) at %d thread%s:\n", target_threads, target_threads == 1 ? "" : "s");
  for (const Row& r : rows) {
    if (r.threads != target_threads) continue;
    if (r.kernel.name == "adamw" || r.kernel.kind == Kind::kGradArrival) {
      const bool met = r.fraction() >= 0.9;
      std::printf("  %-10s size %-6s %-7s fraction of limit %.3f (pairwise %.3f), target >= 0.90: %s\n",
                  r.kernel.name.c_str(), tz::format_count(static_cast<double>(r.n)).c_str(), r.simd.c_str(),
                  r.fraction(), r.pair_ratio_median, met ? "met" : "MISSED");
      targets.push_back({{"target", r.kernel.name + " fraction_of_limit >= 0.9"}, {"size", r.n}, {"threads", r.threads},
                         {"simd", r.simd}, {"value", r.fraction()}, {"met", met}});
    }
  }
  for (const CopyCost& c : costs) {
    if (c.threads != target_threads || c.algorithm != "adamw") continue;
    const bool met = c.cost <= 0.08;
    std::printf("  %-10s size %-6s %-7s bf16 copy-out cost %+.1f%% (pairwise %+.1f%%), target <= 8%%: %s\n",
                "adamw+bf16", tz::format_count(static_cast<double>(c.n)).c_str(), c.simd.c_str(), 100 * c.cost,
                100 * c.pairwise, met ? "met" : "MISSED");
    targets.push_back({{"target", "adamw bf16 copy-out cost <= 0.08"}, {"size", c.n}, {"threads", c.threads},
                       {"simd", c.simd}, {"value", c.cost}, {"met", met}});
  }
  for (const nlohmann::json& w : whole_json) {
    if (w["threads"] != target_threads || w["speedup_over_torch"].is_null()) continue;
    const double speedup = w["speedup_over_torch"].get<double>();
    const bool met = speedup >= 1.3;
    std::printf("  %-10s size %-6s %-7s %.2fx torch's whole step, aim >= 1.3x: %s\n", "whole-step",
                tz::format_count(static_cast<double>(w["size"].get<std::size_t>())).c_str(),
                w["simd"].get<std::string>().c_str(), speedup, met ? "met" : "MISSED");
    targets.push_back({{"target", "whole step speedup over torch >= 1.3"}, {"size", w["size"]},
                       {"threads", w["threads"]}, {"simd", w["simd"]}, {"value", speedup}, {"met", met}});
  }

  if (!flags.json_path.empty()) {
    nlohmann::json cost_json = nlohmann::json::array();
    for (const CopyCost& c : costs) {
      cost_json.push_back({{"algorithm", c.algorithm}, {"size", c.n}, {"threads", c.threads}, {"simd", c.simd},
                           {"plain_median_s", c.plain_s}, {"copy_median_s", c.copy_s}, {"cost", c.cost},
                           {"cost_pairwise_median", c.pairwise}, {"limit_cost", c.limit_cost}});
    }
    nlohmann::json result_json = nlohmann::json::array();
    for (const Row& r : rows) result_json.push_back(row_json(r));
    nlohmann::json variants = nlohmann::json::array();
    for (ca::Simd s : ca::compiled_variants()) {
      variants.push_back({{"simd", ca::simd_name(s)}, {"cpu_supports", ca::cpu_supports(s)}});
    }
    if (!torch_reason.empty()) torch_json = nullptr;
    nlohmann::json out = {
        {"benchmark", "tierzero-adam-bench"},
        {"build", build_summary()},
        {"machine",
         {{"cpu_model", model},
          {"nproc", ::sysconf(_SC_NPROCESSORS_ONLN)},
          {"affinity_cpus", affinity_cpus()},
          {"mem_total_bytes", mem.total_bytes},
          {"mem_available_bytes", mem.available_bytes},
          {"transparent_hugepage", thp},
          {"simd_best_supported", ca::simd_name(ca::best_supported())},
          {"simd_compiled", variants},
          {"limit_loop_isa", tzbench::stream_isa()}}},
        {"config",
         {{"sizes", sizes},
          {"threads_requested", flags.threads},
          {"threads", resolved_threads},
          {"simd_requested", flags.simd},
          {"kernels", flags.kernels},
          {"repeats", flags.repeats},
          {"warmup", 1},
          {"tile_elems_flag", flags.tile_elems},
          {"limit_copy_stores", flags.plain_copy_limit ? "plain" : "non-temporal"},
          {"tbb_numa_nodes", tbb::info::numa_nodes().size()},
          {"hugepages_madvise", flags.hugepages},
          {"grad_scale", kGradScale},
          {"statistic",
           "1 warm-up round, then `repeats` rounds; each round runs limit, kernel for every kernel in turn; "
           "fraction_of_limit = limit median / kernel median; *_pairwise_median: median over rounds of the "
           "per-round ratio"}}},
        {"results", result_json},
        {"copy_out_cost", cost_json},
        {"whole_step", whole_json},
        {"layouts", layouts_json},
        {"torch", torch_json},
        {"torch_unavailable_reason", torch_reason.empty() ? nlohmann::json(nullptr) : nlohmann::json(torch_reason)},
        {"targets", targets}};
    TZ_TRY(tz::write_file_durably(flags.json_path, out.dump(2) + "\n"));
    std::printf("\nwrote %s\n", flags.json_path.c_str());
  }
  return tz::ok_status();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-adam-bench: the CPU optimizers against the memory-bandwidth limit of their access patterns"};
  Flags flags;
  app.add_option("--sizes", flags.sizes, "parameter counts, comma-separated (e.g. 100M,200M,1B)")
      ->capture_default_str();
  app.add_option("--threads", flags.threads, "thread counts, comma-separated; 'all' = every CPU of the NUMA node")
      ->capture_default_str();
  app.add_option("--repeats", flags.repeats, "timed repetitions after 1 warm-up (the median is reported)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--simd", flags.simd,
                 "SIMD variant(s) for the kernels: best, all, or a comma list of scalar, sse4.2, avx2, avx512")
      ->capture_default_str();
  app.add_option("--kernels", flags.kernels,
                 "kernels to run: all, or a comma list of adamw, adamw+bf16, adam, adam+bf16, adagrad, adagrad+bf16, "
                 "lion, lion+bf16, grad-fp32, grad-bf16")
      ->capture_default_str();
  app.add_option("--tile-elems", flags.tile_elems,
                 "elements per tile for the kernels and the limit loops (multiple of 16); 0: the library's choice")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30))
      ->capture_default_str();
  app.add_option("--json", flags.json_path, "write the results as JSON to this file")
      ->check(CLI::Validator(tzbench::writable_file, "FILE"));
  app.add_flag("!--no-hugepages", flags.hugepages, "do not madvise(MADV_HUGEPAGE) the arrays");
  app.add_flag("!--no-torch", flags.torch, "do not time torch.optim.AdamW even if torch is importable");
  app.add_flag("--plain-copy-limit", flags.plain_copy_limit,
               "limit loops store the 16-bit copy with plain stores instead of non-temporal ones (for comparison)");
  app.add_option("--layouts", flags.layouts,
                 "array placements to compare on the Adam kernels (Note [Layout rows]): separate (the default, the "
                 "baseline), aliased (128 MiB apart), engine (the CPU tier's coloured pool), engine-uncoloured, "
                 "plain-mmap; e.g. --sizes 33554432 --layouts separate,aliased,engine")
      ->capture_default_str();
  app.add_flag("!--no-whole-step", flags.whole_step,
               "do not time the whole mixed-precision optimizer step (gradient arrival, norm, clip, step, bf16 copy)");
  app.add_option("--python", flags.python, "Python interpreter for the torch comparison")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  tz::Status status = run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "tierzero-adam-bench: %s\n", status.message().c_str());
    return status.code() == tz::ErrorCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
