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
// lists them): AdamW 28, +2 for the 16-bit copy-out; 28.25 with the remainder
// master (adamw+rem: bf16 parameters, remainders and tie bits in place of the
// fp32 master and the copy).
//
// Where python3 imports torch, torch.optim.AdamW (fused=True, and the default)
// is timed on the same sizes and thread counts and the ratio printed
// (adam_bench_torch.cpp).
//
// The remainder-master conversions (fp32 <-> bf16 + remainder + tie bit) are
// timed once per size on one thread (adam_bench_conversions.cpp), and the
// copies a step under backward makes of a block's old states once per size
// and thread count (adam_bench_copies.cpp).
//
// Prints a table (stdout), a progress line (stderr), and writes JSON (--json);
// the tables and the JSON are adam_bench_report.cpp's.
//
//   tierzero-adam-bench --sizes 200M --threads 1,2 --repeats 5 --json /tmp/adam_bench.json
#include <CLI/CLI.hpp>
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
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "adam_bench.h"
#include "adam_bench_report.h"
#include "adam_bench_torch.h"

namespace tzbench::adam {
namespace {

// Bytes the bench maps per parameter: p, g (fp32), g (bf16), m, v, p16, and
// the remainder master's bf16 parameters, remainders and tie bits.
constexpr double kBytesPerParamMapped = 4 + 4 + 2 + 4 + 4 + 2 + 2 + 2 + 0.125 + 2 + 8.0 / 256;

std::uint64_t mapped_bytes(std::size_t n) { return static_cast<std::uint64_t>(std::ceil(kBytesPerParamMapped * n)); }

// ---------------------------------------------------------------- kernels

std::vector<KernelSpec> all_kernels() {
  using A = ca::Algorithm;
  using D = tz::DType;
  return {
      {"adamw", Kind::kStep, A::kAdamW, false, D::kFp32, Pattern::kAdam},
      {"adamw+bf16", Kind::kStep, A::kAdamW, true, D::kFp32, Pattern::kAdamCopy},
      {"adamw+rem", Kind::kStep, A::kAdamW, false, D::kFp32, Pattern::kAdamRemainder, ca::MasterFormat::kRemainder},
      {"adamw+int8", Kind::kStep, A::kAdamW, false, D::kFp32, Pattern::kAdamInt8, ca::MasterFormat::kFp32, true},
      {"adamw+rem+int8", Kind::kStep, A::kAdamW, false, D::kFp32, Pattern::kAdamRemainderInt8,
       ca::MasterFormat::kRemainder, true},
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
  ArrayPtr pb, rem, ties;  // the remainder master; separate layout only
  ArrayPtr m8, v8, ms, vs;  // int8 moments (codes, block scales); separate layout only
  std::vector<Buffer> owned;
  std::unique_ptr<tz::Device> device;  // engine layouts: blocks of a host pool
  std::unique_ptr<tz::MemoryPool> pool;
  std::vector<tz::PoolBlock> blocks;

  tzbench::StreamArrays stream() const {
    return {.p = p.as<std::uint32_t>(), .g = g.as<const std::uint32_t>(), .g16 = g16.as<const std::uint16_t>(),
            .m = m.as<std::uint32_t>(), .v = v.as<std::uint32_t>(), .p16 = p16.as<std::uint16_t>(),
            .acc = m.as<std::uint32_t>(), .pb = pb.as<std::uint16_t>(), .rem = rem.as<std::uint16_t>(),
            .ties = ties.as<std::uint8_t>(), .m8 = m8.as<std::uint8_t>(), .v8 = v8.as<std::uint8_t>(),
            .ms = ms.as<std::uint32_t>(), .vs = vs.as<std::uint32_t>()};
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
    case Pattern::kAdamRemainder: return 17;  // g m v, bf16 + remainder, tie bits as the library counts them (1)
    case Pattern::kAdamInt8: return 10;            // p g, two code bytes
    case Pattern::kAdamRemainderInt8: return 11;   // g, bf16 + remainder + tie byte, two code bytes
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
    if (a.layout == "plain-mmap") return tz::ok_status();
    ArrayPtr* remainder_arrays[] = {&a.pb, &a.rem, &a.ties};
    const std::size_t remainder_bytes[] = {n * 2, n * 2, (n + 7) / 8};
    for (std::size_t i = 0; i < 3; ++i) {
      TZ_ASSIGN_OR_RETURN(Buffer b, Buffer::map(remainder_bytes[i], hugepages));
      remainder_arrays[i]->ptr = b.as<void>();
      a.owned.push_back(std::move(b));
    }
    ArrayPtr* int8_arrays[] = {&a.m8, &a.v8, &a.ms, &a.vs};
    const std::size_t blocks = (n + 255) / 256;
    const std::size_t int8_bytes[] = {n, n, 4 * blocks, 4 * blocks};
    for (std::size_t i = 0; i < 4; ++i) {
      TZ_ASSIGN_OR_RETURN(Buffer b, Buffer::map(int8_bytes[i], hugepages));
      int8_arrays[i]->ptr = b.as<void>();
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
            // The remainder master holds the same masters (tiles start at multiples of 8: whole tie bytes).
            if (a.pb.ptr != nullptr) {
              const std::size_t begin = t * tile;
              (void)ca::encode_remainder_masters(p + begin, end - begin, a.pb.as<std::uint16_t>() + begin,
                                                 a.rem.as<std::int16_t>() + begin, a.ties.as<std::uint8_t>() + begin / 8);
            }
            // The int8 moments hold the same moments, encoded (tiles start at multiples of 64: blocks of 256
            // may straddle two tiles, so they are encoded after the fill).
          }
        },
        tbb::simple_partitioner());
  });
  if (a.m8.ptr != nullptr) {
    TZ_TRY(ca::encode_int8_moment(ca::Int8Moment::kExpAvg, m, n, a.m8.as<std::uint8_t>(), a.ms.as<float>()));
    TZ_TRY(ca::encode_int8_moment(ca::Int8Moment::kExpAvgSq, v, n, a.v8.as<std::uint8_t>(), a.vs.as<float>()));
  }
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
    ca::Spans spans{.n = a.n, .param = a.p.as<float>(), .grad = a.g.as<const void>(), .grad_dtype = tz::DType::kFp32};
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
      spans.param16_dtype = tz::DType::kBf16;
    }
    if (k.master == ca::MasterFormat::kRemainder) {
      spans.param = nullptr;
      spans.param16 = a.pb.as<void>();
      spans.master_format = ca::MasterFormat::kRemainder;
      spans.remainder = a.rem.as<std::int16_t>();
      spans.tie_bits = a.ties.as<std::uint8_t>();
    }
    if (k.int8) {
      spans.exp_avg = a.m8.as<void>();
      spans.exp_avg_sq = a.v8.as<void>();
      spans.moment_dtype = tz::DType::kUint8;
      spans.exp_avg_scale = a.ms.as<float>();
      spans.exp_avg_sq_scale = a.vs.as<float>();
    }
    TZ_TRY_CTX(c.opt->step(hyper_for(k.algorithm), {.step = ++step, .grad_scale = kGradScale}, spans), "{}", k.name);
  } else {
    const void* grad = k.grad_dtype == tz::DType::kFp32 ? a.g.as<const void>() : a.g16.as<const void>();
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

// ---------------------------------------------------------------- whole step

// The whole per-step optimizer work of a bf16 mixed-precision step, as the
// engine runs it: the bf16 gradient (loss-scaled) arrives and is unscaled into
// the fp32 gradient buffer in the pass that also yields its squared norm; the
// clip coefficient follows from the norm (max norm 1, torch's formula); one
// fused AdamW pass applies it and writes the bf16 copy. 6 + 30 = 36 B/param.
// torch's "whole" variant (kTorchScript, adam_bench_torch.cpp) does the same work its own way.

tz::Expected<double> time_whole_step(Config& c, const Arrays& a, std::int64_t& step, double& clip) {
  const auto start = Clock::now();
  TZ_ASSIGN_OR_RETURN(const ca::GradStats stats,
                      c.opt->accumulate_grad(a.g.as<float>(), a.g16.as<const void>(), tz::DType::kBf16, a.n,
                                             /*overwrite=*/true, kGradScale));
  if (stats.non_finite) return tz::internal_error("whole step: the gradient went non-finite");
  clip = std::min(1.0, kMaxGradNorm / (std::sqrt(stats.sum_squares) + 1e-6));
  ca::Spans spans{.n = a.n, .param = a.p.as<float>(), .grad = a.g.as<const void>(), .grad_dtype = tz::DType::kFp32,
                  .exp_avg = a.m.as<void>(), .exp_avg_sq = a.v.as<void>(), .param16 = a.p16.as<void>(),
                  .param16_dtype = tz::DType::kBf16};
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

// ---------------------------------------------------------------- run

// What the flags ask for, parsed and checked against each other.
struct Plan {
  std::vector<std::size_t> sizes;
  std::vector<int> threads;  // 0 = all
  std::vector<std::optional<ca::Simd>> simd;
  std::vector<KernelSpec> kernels;
  std::vector<std::string> layouts;        // "separate" first
  std::vector<KernelSpec> layout_kernels;  // the Adam steps among --kernels
};

tz::Expected<Plan> parse_plan(const Flags& flags) {
  Plan plan;
  TZ_ASSIGN_OR_RETURN(plan.sizes, parse_sizes(flags.sizes));
  TZ_ASSIGN_OR_RETURN(plan.threads, parse_threads(flags.threads));
  TZ_ASSIGN_OR_RETURN(plan.simd, parse_simd_list(flags.simd));
  TZ_ASSIGN_OR_RETURN(plan.kernels, parse_kernels(flags.kernels));
  TZ_ASSIGN_OR_RETURN(plan.layouts, parse_layouts(flags.layouts));
  for (const KernelSpec& k : plan.kernels) {
    if (k.kind == Kind::kStep && k.master == ca::MasterFormat::kFp32 && !k.int8 &&
        (k.algorithm == ca::Algorithm::kAdamW || k.algorithm == ca::Algorithm::kAdam)) {
      plan.layout_kernels.push_back(k);
    }
  }
  if (plan.layouts.size() > 1 && plan.layout_kernels.empty()) {
    return tz::invalid_argument("--layouts compares the Adam kernels; --kernels {} has none", flags.kernels);
  }
  if (flags.tile_elems % 16 != 0) {
    return tz::invalid_argument("--tile-elems {}: must be a multiple of 16 (64 bytes of fp32)", flags.tile_elems);
  }
  return plan;
}

// Refuses what does not fit before touching anything.
tz::Status check_sizes_fit(const std::vector<std::size_t>& sizes, const tz::HostMemoryReading& mem) {
  for (std::size_t n : sizes) {
    const std::uint64_t need = mapped_bytes(n);
    if (need + kHeadroomBytes > mem.available_bytes) {
      return tz::out_of_memory(
          "--sizes {}: {} parameters need {} of arrays ({} B/param: p, g fp32, g bf16, m, v, bf16 copy, and the "
          "remainder master's bf16, remainder, tie bits) plus {} headroom, but MemAvailable is {}",
          tz::format_count(static_cast<double>(n)), n, tz::format_bytes(need), kBytesPerParamMapped,
          tz::format_bytes(kHeadroomBytes), tz::format_bytes(mem.available_bytes));
    }
  }
  return tz::ok_status();
}

// TBB's workers, as many as the largest arena asks for (by default TBB caps
// them at the CPU count; this applies to the library's arenas and ours alike).
std::size_t max_workers(const std::vector<int>& thread_list) {
  int max_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int t : thread_list) max_threads = std::max(max_threads, t);
  return static_cast<std::size_t>(max_threads);
}

// One optimizer and one limit arena per (threads, simd), each pair once as resolved.
tz::Expected<std::vector<Config>> make_configs(const Flags& flags, const Plan& plan) {
  std::vector<Config> configs;
  std::vector<std::pair<int, std::string>> seen;
  for (int t : plan.threads) {
    for (const std::optional<ca::Simd>& simd : plan.simd) {
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
  return configs;
}

std::vector<int> resolved_threads(const std::vector<Config>& configs) {
  std::vector<int> out;
  for (const Config& c : configs) {
    if (std::find(out.begin(), out.end(), c.threads) == out.end()) out.push_back(c.threads);
  }
  return out;
}

// The configuration with the most threads: its arena maps and fills the arrays.
const Config& widest(const std::vector<Config>& configs) {
  return *std::max_element(configs.begin(), configs.end(),
                           [](const Config& a, const Config& b) { return a.threads < b.threads; });
}

Machine read_machine(const tz::HostMemoryReading& mem) {
  return {.cpu_model = cpu_model(),
          .thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
          .affinity_cpus = affinity_cpus(),
          .mem = mem};
}

void print_header(const Flags& flags, const Machine& machine) {
  std::printf("%s\n", build_summary().c_str());
  std::printf("cpu: %s, %d CPUs online (%d in affinity), MemAvailable %s, THP %s%s\n", machine.cpu_model.c_str(),
              static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)), machine.affinity_cpus,
              tz::format_bytes(machine.mem.available_bytes).c_str(), machine.thp.c_str(),
              flags.hugepages ? " (arrays madvise'd)" : " (no madvise)");
  std::printf("limit loops: %s, %s stores for the 16-bit copy, tiles as the library's (%s); %d timed repeats after "
              "1 warm-up, medians; grad scale 1/%g\n\n",
              std::string(tzbench::stream_isa()).c_str(), flags.plain_copy_limit ? "plain" : "non-temporal",
              flags.tile_elems != 0 ? fmt::format("{} elements", flags.tile_elems).c_str() : "L2-sized",
              flags.repeats, 1 / kGradScale);
  std::fflush(stdout);
}

// The kernels (and the whole step) of every configuration on one size's
// arrays, which are unmapped on return, before torch runs on the same size.
tz::Status measure_size(std::size_t n, const Flags& flags, const Plan& plan, std::vector<Config>& configs,
                        std::int64_t& step, Progress& progress, Results& out) {
  const std::string size_name = tz::format_count(static_cast<double>(n));
  const Config& filler = widest(configs);
  progress.show("size {}: mapping and filling {} with {} threads", size_name,
                tz::format_bytes(mapped_bytes(n)), filler.threads);
  TZ_ASSIGN_OR_RETURN(Arrays arrays, make_arrays(n, "separate", flags.hugepages, *filler.arena,
                                                 limit_tile(Pattern::kAdam, flags.tile_elems)));
  for (Config& c : configs) {
    const std::string where = fmt::format("size {}, {} thread{}, {}", size_name, c.threads,
                                          c.threads == 1 ? "" : "s", ca::simd_name(c.opt->simd()));
    TZ_TRY(measure(c, plan.kernels, arrays, flags, step, progress, where, out.rows));
    if (flags.whole_step) TZ_TRY(measure_whole_step(c, arrays, flags.repeats, step, progress, where, out.whole_rows));
  }
  progress.show("size {}: remainder-master conversions", size_name);
  TZ_TRY(measure_conversions(n, flags.repeats, out.conversion_rows));
  for (Config& c : configs) {
    progress.show("size {}: old-state copies, {} thread(s)", size_name, c.threads);
    TZ_TRY(measure_copies(n, *c.opt, flags.repeats, out.copy_rows));
  }
  return tz::ok_status();
}

// Note [Layout rows] for one size: every layout's arrays at once (aliased
// ones rounded up to 128 MiB each), refused where they do not fit.
tz::Status measure_layouts_of_size(std::size_t n, const Flags& flags, const Plan& plan, std::vector<Config>& configs,
                                   std::int64_t& step, Progress& progress, std::vector<LayoutRow>& out) {
  TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading now, tz::read_host_memory());
  const std::uint64_t need = plan.layouts.size() * (6 * tz::align_up(n * 4, kAliasBytes));
  if (need + kHeadroomBytes > now.available_bytes) {
    return tz::out_of_memory("--layouts at size {}: {} layouts need up to {} of arrays, MemAvailable is {}; use a "
                             "smaller --sizes", n, plan.layouts.size(), tz::format_bytes(need),
                             tz::format_bytes(now.available_bytes));
  }
  std::vector<Arrays> placed;
  for (const std::string& layout : plan.layouts) {
    progress.show("size {}: mapping and filling the {} layout", tz::format_count(static_cast<double>(n)), layout);
    TZ_ASSIGN_OR_RETURN(Arrays a, make_arrays(n, layout, flags.hugepages, *widest(configs).arena,
                                              limit_tile(Pattern::kAdam, flags.tile_elems)));
    placed.push_back(std::move(a));
  }
  for (Config& c : configs) TZ_TRY(measure_layouts(c, plan.layout_kernels, placed, flags, step, progress, out));
  return tz::ok_status();
}

tz::Status run(const Flags& flags) {
  TZ_ASSIGN_OR_RETURN(const Plan plan, parse_plan(flags));
  TZ_ASSIGN_OR_RETURN(const tz::HostMemoryReading mem, tz::read_host_memory());
  TZ_TRY(check_sizes_fit(plan.sizes, mem));
  tbb::global_control workers(tbb::global_control::max_allowed_parallelism, max_workers(plan.threads));
  TZ_ASSIGN_OR_RETURN(std::vector<Config> configs, make_configs(flags, plan));
  const Machine machine = read_machine(mem);
  print_header(flags, machine);

  Results results{.sizes = plan.sizes,
                  .threads = resolved_threads(configs),
                  .torch_reason = flags.torch ? torch_unavailable_reason(flags.python) : "disabled by --no-torch"};
  Progress progress;
  std::int64_t step = 0;  // every kernel's step count, across sizes and configurations
  for (std::size_t n : plan.sizes) {
    TZ_TRY(measure_size(n, flags, plan, configs, step, progress, results));
    if (results.torch_reason.empty()) {
      TZ_TRY(time_torch(flags.python, n, results.threads, flags.repeats, progress, results.torch));
    }
  }
  if (plan.layouts.size() > 1) {
    for (std::size_t n : plan.sizes) {
      TZ_TRY(measure_layouts_of_size(n, flags, plan, configs, step, progress, results.layout_rows));
    }
  }
  progress.done();
  return report(flags, machine, results);
}

}  // namespace
}  // namespace tzbench::adam

int main(int argc, char** argv) {
  CLI::App app{"tierzero-adam-bench: the CPU optimizers against the memory-bandwidth limit of their access patterns"};
  tzbench::adam::Flags flags;
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
                 "kernels to run: all, or a comma list of adamw, adamw+bf16, adamw+rem, adamw+int8, adamw+rem+int8, "
                 "adam, adam+bf16, adagrad, "
                 "adagrad+bf16, lion, lion+bf16, grad-fp32, grad-bf16")
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
  tz::Status status = tzbench::adam::run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "tierzero-adam-bench: %s\n", status.message().c_str());
    return status.code() == tz::ErrorCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
