// The compact Adam step (tierzero/kernels.h, adam_step_compact_*): its CPU
// twin against cpu_adam, the optimizer whose bits it must reproduce, on fresh
// random inputs over several steps for every format and every cpu_adam
// variant this CPU runs; the CUDA kernel against the twin where a GPU is
// present (it skips, saying why, elsewhere). Bit for bit throughout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tierzero/common/state_math.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/kernels.h"
#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace tz::kernels {
namespace {

struct Format {
  MasterFormat master;
  MomentFormat moments;
};
const Format kFormats[] = {{MasterFormat::kFp32, MomentFormat::kFp32},      {MasterFormat::kFp32, MomentFormat::kBf16},
                           {MasterFormat::kFp32, MomentFormat::kInt8},      {MasterFormat::kRemainder, MomentFormat::kFp32},
                           {MasterFormat::kRemainder, MomentFormat::kBf16}, {MasterFormat::kRemainder, MomentFormat::kInt8}};
constexpr std::size_t kB = kInt8MomentBlockNumel;

std::string describe(const Format& f) {
  return "master " + std::string(master_format_name(f.master)) + ", moments " +
         std::string(moment_format_name(f.moments));
}

// One shard's states in a format: what both optimizers read and write.
struct State {
  std::vector<float> master;          // fp32 master
  std::vector<std::uint16_t> param16; // bf16 copy-out, or the remainder master's bf16 half
  std::vector<std::int16_t> remainder;
  std::vector<std::uint8_t> ties;
  std::vector<float> m32, v32;
  std::vector<std::uint16_t> m16, v16;
  std::vector<std::uint8_t> m8, v8;  // int8 codes
  std::vector<float> ms, vs;         // int8 block scales
};

// Masters from a normal distribution, with every 97th set exactly on a tie
// above an even bf16 (the value the tie bit exists for, Note [Remainder
// masters]) and a few NaN, inf and zero.
State make_state(const Format& f, std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0F, 0.05F);
  State s;
  s.master.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    s.master[i] = d(rng);
    if (i % 97 == 5) {
      const std::uint32_t even_h = state_math::float_bits(s.master[i]) >> 16 & ~1U;
      s.master[i] = state_math::bits_float((even_h << 16) + state_math::kTie);
    }
  }
  s.master[3] = 0.0F;
  s.master[11] = -0.0F;
  s.param16.assign(n, 0);
  if (f.master == MasterFormat::kRemainder) {
    s.remainder.assign(n, 0);
    s.ties.assign((n + 7) / 8, 0xa5);  // the bits past n must survive
    EXPECT_TRUE(cpu_adam::encode_remainder_masters(s.master.data(), n, s.param16.data(), s.remainder.data(),
                                                   s.ties.data())
                    .ok());
    s.master.clear();
  }
  if (f.moments == MomentFormat::kBf16) {
    s.m16.assign(n, 0);
    s.v16.assign(n, 0);
  } else if (f.moments == MomentFormat::kInt8) {
    s.m8.assign(n, 0);
    s.v8.assign(n, 0);
    s.ms.assign((n + kB - 1) / kB, 0.0F);
    s.vs.assign((n + kB - 1) / kB, 0.0F);
  } else {
    s.m32.assign(n, 0);
    s.v32.assign(n, 0);
  }
  return s;
}

void* exp_avg_of(State& s) {
  return !s.m8.empty() ? static_cast<void*>(s.m8.data()) : !s.m16.empty() ? static_cast<void*>(s.m16.data()) : s.m32.data();
}
void* exp_avg_sq_of(State& s) {
  return !s.v8.empty() ? static_cast<void*>(s.v8.data()) : !s.v16.empty() ? static_cast<void*>(s.v16.data()) : s.v32.data();
}
std::size_t moment_bytes(const Format& f) {
  return f.moments == MomentFormat::kBf16 ? 2 : f.moments == MomentFormat::kInt8 ? 1 : 4;
}
Int8CodeTables tables_of(cpu_adam::Int8Moment which) {
  const cpu_adam::Int8CodeTables t = cpu_adam::int8_code_tables(which);
  return {t.decode, t.mid};
}

// begin: a multiple of 256 with int8 moments.
AdamCompactTensors tensors_of(const Format& f, State& s, const std::vector<float>& grad, std::size_t begin,
                              std::uint32_t sr_key, std::uint32_t sr_base) {
  const bool rem = f.master == MasterFormat::kRemainder, int8 = f.moments == MomentFormat::kInt8;
  const std::size_t m_bytes = moment_bytes(f);
  return {.master_format = f.master,
          .master = rem ? nullptr : s.master.data() + begin,
          .param16 = s.param16.data() + begin,
          .remainder = rem ? s.remainder.data() + begin : nullptr,
          .tie_bits = rem ? s.ties.data() : nullptr,
          .tie_bit_offset = begin,
          .grad = grad.data() + begin,
          .moment_format = f.moments,
          .exp_avg = static_cast<char*>(exp_avg_of(s)) + begin * m_bytes,
          .exp_avg_sq = static_cast<char*>(exp_avg_sq_of(s)) + begin * m_bytes,
          .sr_key = sr_key,
          .sr_base = sr_base + static_cast<std::uint32_t>(begin),
          .exp_avg_scale = int8 ? s.ms.data() + begin / kB : nullptr,
          .exp_avg_sq_scale = int8 ? s.vs.data() + begin / kB : nullptr,
          .exp_avg_code = tables_of(cpu_adam::Int8Moment::kExpAvg),
          .exp_avg_sq_code = tables_of(cpu_adam::Int8Moment::kExpAvgSq)};
}

cpu_adam::Spans spans_of(const Format& f, State& s, const std::vector<float>& grad, std::uint64_t key,
                         std::uint64_t index) {
  const bool rem = f.master == MasterFormat::kRemainder;
  cpu_adam::Spans sp;
  sp.n = grad.size();
  sp.param = rem ? nullptr : s.master.data();
  sp.grad = grad.data();
  sp.exp_avg = exp_avg_of(s);
  sp.exp_avg_sq = exp_avg_sq_of(s);
  sp.moment_dtype = f.moments == MomentFormat::kBf16   ? DType::kBf16
                   : f.moments == MomentFormat::kInt8 ? DType::kUint8
                                                      : DType::kFp32;
  sp.exp_avg_scale = s.ms.empty() ? nullptr : s.ms.data();
  sp.exp_avg_sq_scale = s.vs.empty() ? nullptr : s.vs.data();
  sp.param16 = s.param16.data();
  sp.master_format = f.master;
  sp.remainder = rem ? s.remainder.data() : nullptr;
  sp.tie_bits = rem ? s.ties.data() : nullptr;
  sp.rounding_key = key;
  sp.rounding_index = index;
  return sp;
}

bool is_nan(float x) { return std::isnan(x); }
bool is_nan(std::uint16_t bf16) { return (bf16 & 0x7fffU) > 0x7f80U; }
template <typename T>
bool is_nan(T) { return false; }

// Which bits differ, for the failure message. Bit for bit except the sign and
// payload of a NaN (fp32 and bf16 values; a remainder master's remainder and
// tie bit where its bf16 half is NaN on both sides): those depend on which
// operand of an add the compiler put first when both are NaN (a NaN moment
// decoded from its int8 code and a master gone NaN), and tz::kernels.h leaves
// them open.
std::string first_difference(const State& a, const State& b) {
  const auto nan_master = [&](std::size_t i) {
    return i < a.param16.size() && is_nan(a.param16[i]) && is_nan(b.param16[i]) && !a.remainder.empty();
  };
  const auto check = [&](const char* what, const auto& x, const auto& y) -> std::string {
    const bool of_master = static_cast<const void*>(&x) == static_cast<const void*>(&a.remainder);
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (std::memcmp(&x[i], &y[i], sizeof(x[i])) == 0 || (is_nan(x[i]) && is_nan(y[i]))) continue;
      if (of_master && nan_master(i)) continue;
      std::uint64_t bx = 0, by = 0;
      std::memcpy(&bx, &x[i], sizeof(x[i]));
      std::memcpy(&by, &y[i], sizeof(y[i]));
      char bits[64];
      std::snprintf(bits, sizeof bits, " (bits %#llx vs %#llx)", static_cast<unsigned long long>(bx),
                    static_cast<unsigned long long>(by));
      return std::string(what) + "[" + std::to_string(i) + "]" + bits;
    }
    return "";
  };
  const auto check_ties = [&]() -> std::string {
    for (std::size_t bit = 0; bit < 8 * a.ties.size(); ++bit) {
      if (((a.ties[bit / 8] ^ b.ties[bit / 8]) >> (bit % 8) & 1U) == 0 || nan_master(bit)) continue;
      return "tie_bits[" + std::to_string(bit) + "]";
    }
    return "";
  };
  for (const std::string& s : {check("master", a.master, b.master), check("param16", a.param16, b.param16),
                               check("remainder", a.remainder, b.remainder), check_ties(),
                               check("exp_avg", a.m32, b.m32), check("exp_avg_sq", a.v32, b.v32),
                               check("exp_avg (bf16)", a.m16, b.m16), check("exp_avg_sq (bf16)", a.v16, b.v16),
                               check("exp_avg (int8)", a.m8, b.m8), check("exp_avg_sq (int8)", a.v8, b.v8),
                               check("exp_avg scales", a.ms, b.ms), check("exp_avg_sq scales", a.vs, b.vs)}) {
    if (!s.empty()) return s;
  }
  return "none";
}

bool same_bits(const State& a, const State& b) { return first_difference(a, b) == "none"; }

struct Algo {
  cpu_adam::Algorithm algorithm;
  double weight_decay;
};
const Algo kAlgos[] = {{cpu_adam::Algorithm::kAdamW, 0.01}, {cpu_adam::Algorithm::kAdam, 0.01},
                       {cpu_adam::Algorithm::kAdam, 0.0}};

// Weight-decay segments as the engine's (no decay for a bias, a norm): one
// inside an int8 block, one across blocks, one to the end.
const cpu_adam::WeightDecaySegment kSegments[] = {{100, 130, 0.0}, {300, 700, 0.05}, {9000, 10'007, 0.0}};

std::vector<WeightDecayRun> runs_of(const cpu_adam::WeightDecaySegment* segs, std::size_t count) {
  std::vector<WeightDecayRun> runs;
  for (std::size_t k = 0; k < count; ++k) runs.push_back({segs[k].begin, segs[k].end, segs[k].weight_decay});
  return runs;
}

// Step `step`'s gradients: normal, zero at step 3, and in every step zero over
// int8 block 5 (its moments stay a zero block, scale 0); at step 2 a NaN and
// two infinities (their moments become the NaN code, their blocks' other
// elements stay finite).
std::vector<float> gradients(std::size_t n, std::int64_t step, std::mt19937_64& rng) {
  std::normal_distribution<float> gd(0.0F, 0.3F);
  std::vector<float> grad(n);
  for (float& g : grad) g = step == 3 ? 0.0F : gd(rng);
  for (std::size_t i = 5 * kB; i < 6 * kB && i < n; ++i) grad[i] = 0.0F;
  if (step == 2) {
    grad[7] = std::numeric_limits<float>::quiet_NaN();
    grad[600] = std::numeric_limits<float>::infinity();
    grad[n - 2] = -std::numeric_limits<float>::infinity();
  }
  return grad;
}

TEST(AdamStepCompact, CpuTwinMatchesCpuAdamBitForBitOnEveryVariantAndFormat) {
  const std::size_t n = 10'007;  // not a multiple of 8 (the last tie-bit byte) nor of 256 (the last int8 block)
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<WeightDecayRun> runs = runs_of(kSegments, std::size(kSegments));
  int variants = 0;
  for (cpu_adam::Simd simd : cpu_adam::compiled_variants()) {
    if (!cpu_adam::cpu_supports(simd)) continue;
    ++variants;
    auto opt = cpu_adam::CpuOptimizer::create({.threads = 2, .simd = simd});
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    const bool fused = simd == cpu_adam::Simd::kAvx2 || simd == cpu_adam::Simd::kAvx512;
    for (const Format& f : kFormats) {
      for (const Algo& a : kAlgos) {
        State twin = make_state(f, n, rng);
        State ref = twin;
        const std::uint64_t key = rng(), index = rng();
        const cpu_adam::Hyper hyper{.algorithm = a.algorithm, .lr = 1e-2, .weight_decay = a.weight_decay};
        for (std::int64_t step = 1; step <= 5; ++step) {
          const std::vector<float> grad = gradients(n, step, rng);
          const double grad_scale = 0.5 + 0.1 * static_cast<double>(step);
          cpu_adam::Spans spans = spans_of(f, ref, grad, key, index);
          spans.weight_decay_segments = kSegments;
          ASSERT_TRUE((*opt)->step(hyper, {.step = step, .grad_scale = grad_scale}, spans).ok());
          const AdamHyper h{.lr = hyper.lr, .beta1 = hyper.beta1, .beta2 = hyper.beta2, .eps = hyper.eps,
                            .weight_decay = hyper.weight_decay,
                            .adamw = a.algorithm == cpu_adam::Algorithm::kAdamW, .step = step,
                            .grad_scale = grad_scale};
          AdamCompactTensors t = tensors_of(f, twin, grad, 0, state_math::sr_step_key(key, step, index),
                                            static_cast<std::uint32_t>(index));
          t.weight_decay_runs = runs.data();
          t.weight_decay_run_count = runs.size();
          ASSERT_TRUE(adam_step_compact_cpu(t, n, h, {.fused_multiply_add = fused}).ok());
          ASSERT_TRUE(same_bits(twin, ref))
              << cpu_adam::simd_name(simd) << ", " << describe(f) << ", " << cpu_adam::algorithm_name(a.algorithm)
              << " wd " << a.weight_decay << ", step " << step << ": first difference " << first_difference(twin, ref);
        }
        if (f.moments == MomentFormat::kInt8) {  // the cases the gradients set up are there
          const bool l2 = a.algorithm == cpu_adam::Algorithm::kAdam && a.weight_decay != 0;
          if (!l2) {  // (Adam's L2 term makes block 5's gradients non-zero)
            ASSERT_EQ(twin.ms[5], 0.0F);
          }
          ASSERT_EQ(twin.m8[7], 0x80);
          ASSERT_EQ(twin.v8[600], 0xff);
          ASSERT_NE(twin.ms[2], 0.0F);
          ASSERT_TRUE(std::isfinite(twin.ms[2]));
        }
      }
    }
  }
  std::printf("[ compact] CPU twin = cpu_adam bit for bit: %d variants x %zu formats x 3 algorithms x 5 steps\n",
              variants, std::size(kFormats));
}

TEST(AdamStepCompact, Int8TiesOnTheMidpointsGoToTheLowerLevelAsInCpuAdam) {
  // beta1 = beta2 = 0: m = g and v = g * g (sqrt(v) = |g| exactly), so with
  // each block's largest element 1 (scale 1) a gradient on a midpoint puts y
  // exactly on it: every midpoint of both codes, the signed one both ways.
  const cpu_adam::Int8CodeTables m_code = cpu_adam::int8_code_tables(cpu_adam::Int8Moment::kExpAvg);
  const cpu_adam::Int8CodeTables v_code = cpu_adam::int8_code_tables(cpu_adam::Int8Moment::kExpAvgSq);
  const std::size_t n = 2 * kB + 100;
  std::vector<float> grad(n, 0.0F);
  grad[0] = grad[kB] = 1.0F;
  for (std::size_t k = 0; k < 127; ++k) {
    grad[1 + k] = m_code.mid[k];
    grad[128 + k] = -m_code.mid[k];
  }
  for (std::size_t k = 0; k < 254; ++k) grad[kB + 1 + k] = v_code.mid[k];
  const Format f{MasterFormat::kRemainder, MomentFormat::kInt8};
  std::mt19937_64 rng(std::random_device{}());
  for (cpu_adam::Simd simd : cpu_adam::compiled_variants()) {
    if (!cpu_adam::cpu_supports(simd)) continue;
    auto opt = cpu_adam::CpuOptimizer::create({.threads = 1, .simd = simd});
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    State twin = make_state(f, n, rng);
    State ref = twin;
    const cpu_adam::Hyper hyper{.algorithm = cpu_adam::Algorithm::kAdamW, .lr = 1e-3, .beta1 = 0, .beta2 = 0};
    ASSERT_TRUE((*opt)->step(hyper, {.step = 1}, spans_of(f, ref, grad, 0, 0)).ok());
    const AdamHyper h{.lr = 1e-3, .beta1 = 0, .beta2 = 0, .step = 1};
    const bool fused = simd == cpu_adam::Simd::kAvx2 || simd == cpu_adam::Simd::kAvx512;
    ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, twin, grad, 0, 0, 0), n, h, {.fused_multiply_add = fused}).ok());
    ASSERT_TRUE(same_bits(twin, ref)) << cpu_adam::simd_name(simd) << ": first difference " << first_difference(twin, ref);
    ASSERT_EQ(twin.ms[0], 1.0F);
    ASSERT_EQ(twin.vs[1], 1.0F);
    for (std::size_t k = 0; k < 127; ++k) {
      ASSERT_EQ(twin.m8[1 + k], k) << "exp_avg on midpoint " << k;
      ASSERT_EQ(twin.m8[128 + k], k == 0 ? 0U : (0x80U | k)) << "exp_avg on minus midpoint " << k;
    }
    for (std::size_t k = 0; k < 254; ++k) {
      ASSERT_EQ(twin.v8[kB + 1 + k], k == 0 ? 1U : k) << "exp_avg_sq on midpoint " << k << " (never 0)";
    }
  }
}

TEST(AdamStepCompact, CpuTwinInPiecesAtAnyElementIsTheWholeCall) {
  // A call may be cut anywhere (int8 moments: at a block), and a piece's
  // weight decay given by a launch of its own or by a run of one call gives
  // the same bits.
  const std::size_t n = 1000, cuts[] = {0, 3, 13, 16, 501, 1000}, int8_cuts[] = {0, 256, 512, 768, 1000};
  std::mt19937_64 rng(std::random_device{}());
  for (const Format& f : kFormats) {
    const bool int8 = f.moments == MomentFormat::kInt8;
    std::vector<std::size_t> at(int8 ? std::begin(int8_cuts) : std::begin(cuts), int8 ? std::end(int8_cuts) : std::end(cuts));
    State whole = make_state(f, n, rng);
    State pieces = whole, runs = whole;
    std::vector<float> grad(n);
    std::normal_distribution<float> gd(0.0F, 0.3F);
    for (float& g : grad) g = gd(rng);
    const AdamHyper h{.lr = 1e-2, .weight_decay = 0.1, .adamw = false, .step = 2};
    std::vector<WeightDecayRun> wd_runs;
    for (std::size_t k = 0; k + 1 < at.size(); ++k) {
      AdamHyper piece = h;
      piece.weight_decay = k % 2 == 0 ? 0.1 : 0.0;
      if (k % 2 == 1) wd_runs.push_back({at[k], at[k + 1], 0.0});
      ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, pieces, grad, at[k], 77, 5), at[k + 1] - at[k], piece).ok());
    }
    AdamCompactTensors t = tensors_of(f, runs, grad, 0, 77, 5);
    t.weight_decay_runs = wd_runs.data();
    t.weight_decay_run_count = wd_runs.size();
    ASSERT_TRUE(adam_step_compact_cpu(t, n, h).ok());
    EXPECT_TRUE(same_bits(runs, pieces)) << describe(f) << ": first difference " << first_difference(runs, pieces);
    ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, whole, grad, 0, 77, 5), n, h).ok());
    EXPECT_FALSE(same_bits(whole, pieces)) << describe(f) << ": the runs changed nothing";
  }
}

TEST(AdamStepCompact, Int8CallsWithoutScalesOrTablesOrAtATieBitInsideAByteAreRefusedByName) {
  std::mt19937_64 rng(1);
  const Format f{MasterFormat::kRemainder, MomentFormat::kInt8};
  State s = make_state(f, 512, rng);
  std::vector<float> grad(512, 0.1F);
  AdamCompactTensors t = tensors_of(f, s, grad, 0, 0, 0);
  t.exp_avg_sq_scale = nullptr;
  Status st = adam_step_compact_cpu(t, 512, {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("exp_avg_sq_scale"), std::string::npos) << st.to_string();
  t = tensors_of(f, s, grad, 0, 0, 0);
  t.exp_avg_code.mid = nullptr;
  st = adam_step_compact_cpu(t, 512, {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("int8_code_tables"), std::string::npos) << st.to_string();
  t = tensors_of(f, s, grad, 0, 0, 0);
  t.tie_bit_offset = 4;
  st = adam_step_compact_cpu(t, 256, {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tie_bit_offset = 4"), std::string::npos) << st.to_string();
  const WeightDecayRun bad[] = {{10, 20, 0.0}, {15, 30, 0.0}};
  t = tensors_of(f, s, grad, 0, 0, 0);
  t.weight_decay_runs = bad;
  t.weight_decay_run_count = 2;
  st = adam_step_compact_cpu(t, 512, {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("weight_decay_runs[1] = [15, 30)"), std::string::npos) << st.to_string();
}

TEST(AdamStepCompact, MissingArraysAreRefusedByName) {
  std::vector<float> x(8);
  const AdamCompactTensors no_ties{.master_format = MasterFormat::kRemainder,
                                   .param16 = reinterpret_cast<std::uint16_t*>(x.data()),
                                   .remainder = reinterpret_cast<std::int16_t*>(x.data() + 4),
                                   .grad = x.data(),
                                   .exp_avg = x.data(),
                                   .exp_avg_sq = x.data()};
  Status s = adam_step_compact_cpu(no_ties, 4, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tie_bits"), std::string::npos) << s.to_string();
#if defined(TIERZERO_WITH_CUDA)
  s = adam_step_compact_cuda(no_ties, 4, {}, nullptr);  // refused before any launch
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tie_bits"), std::string::npos) << s.to_string();
#endif
}

#if defined(TIERZERO_WITH_CUDA)
template <typename T>
T* to_device(const std::vector<T>& host) {
  if (host.empty()) return nullptr;
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
void to_host(std::vector<T>& host, const T* d) {
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(host.data(), d, host.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
}

// A State's arrays in device memory.
struct DeviceState {
  explicit DeviceState(const State& s)
      : master(to_device(s.master)), param16(to_device(s.param16)), remainder(to_device(s.remainder)),
        ties(to_device(s.ties)), m32(to_device(s.m32)), v32(to_device(s.v32)), m16(to_device(s.m16)),
        v16(to_device(s.v16)), m8(to_device(s.m8)), v8(to_device(s.v8)), ms(to_device(s.ms)), vs(to_device(s.vs)) {}
  ~DeviceState() {
    for (void* p : {static_cast<void*>(master), static_cast<void*>(param16), static_cast<void*>(remainder),
                    static_cast<void*>(ties), static_cast<void*>(m32), static_cast<void*>(v32),
                    static_cast<void*>(m16), static_cast<void*>(v16), static_cast<void*>(m8), static_cast<void*>(v8),
                    static_cast<void*>(ms), static_cast<void*>(vs)}) {
      cudaFree(p);
    }
  }
  State read(const State& shape) const {
    State s = shape;
    to_host(s.master, master);
    to_host(s.param16, param16);
    to_host(s.remainder, remainder);
    to_host(s.ties, ties);
    to_host(s.m32, m32);
    to_host(s.v32, v32);
    to_host(s.m16, m16);
    to_host(s.v16, v16);
    to_host(s.m8, m8);
    to_host(s.v8, v8);
    to_host(s.ms, ms);
    to_host(s.vs, vs);
    return s;
  }
  float* master;
  std::uint16_t* param16;
  std::int16_t* remainder;
  std::uint8_t* ties;
  float *m32, *v32;
  std::uint16_t *m16, *v16;
  std::uint8_t *m8, *v8;
  float *ms, *vs;
};

// One code's tables in device memory, as the engine uploads them.
struct DeviceTables {
  explicit DeviceTables(cpu_adam::Int8Moment which) {
    const cpu_adam::Int8CodeTables t = cpu_adam::int8_code_tables(which);
    decode = to_device(std::vector<float>(t.decode, t.decode + 256));
    mid = to_device(std::vector<float>(t.mid, t.mid + 256));
  }
  ~DeviceTables() {
    cudaFree(decode);
    cudaFree(mid);
  }
  Int8CodeTables ref() const { return {decode, mid}; }
  float* decode;
  float* mid;
};
#endif

TEST(OptimCuda, AdamCompactMatchesTheCpuTwinBitForBit) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no CUDA device: " << cudaGetErrorString(cudaGetLastError());
  }
  // Pieces starting inside tie-bit bytes and warps, a piece shorter than a
  // warp, a long one (int8 moments: pieces of whole blocks, and in each a
  // weight-decay run across blocks, inside one block, at its end).
  const std::size_t n = (1 << 20) + 13, cuts[] = {0, 5, 21, 40, 70'001, n}, int8_cuts[] = {0, 256, 70'144, n};
  const WeightDecayRun runs[] = {{100, 700, 0.0}, {1000, 1001, 0.3}, {5000, 6000, 0.0}};
  const DeviceTables m_code(cpu_adam::Int8Moment::kExpAvg), v_code(cpu_adam::Int8Moment::kExpAvgSq);
  std::mt19937_64 rng(std::random_device{}());
  for (const Format& f : kFormats) {
    const bool int8 = f.moments == MomentFormat::kInt8;
    const std::vector<std::size_t> at(int8 ? std::begin(int8_cuts) : std::begin(cuts),
                                      int8 ? std::end(int8_cuts) : std::end(cuts));
    State host = make_state(f, n, rng);
    DeviceState dev(host);
    for (std::int64_t step = 1; step <= 3; ++step) {
      const std::vector<float> grad = gradients(n, step, rng);
      float* d_grad = to_device(grad);
      const std::uint32_t key = state_math::sr_step_key(1234, step, 0xffff'fff0ULL);  // indices wrap past 2^32
      for (std::size_t k = 0; k + 1 < at.size(); ++k) {
        const AdamHyper h{.lr = 1e-2, .weight_decay = k % 2 == 0 ? 0.1 : 0.0, .adamw = step != 2, .step = step};
        const std::size_t len = at[k + 1] - at[k];
        AdamCompactTensors on_host = tensors_of(f, host, grad, at[k], key, 0xffff'fff0U);
        on_host.weight_decay_runs = runs;
        on_host.weight_decay_run_count = at[k] == 256 ? std::size(runs) : 0;
        ASSERT_TRUE(adam_step_compact_cpu(on_host, len, h).ok());
        AdamCompactTensors t = on_host;  // device pointers at the same offsets as the host arrays
        const auto rebase = [&](auto* h_ptr, auto* h_base, auto* d_base) {
          return h_ptr == nullptr ? nullptr : d_base + (h_ptr - h_base);
        };
        t.master = rebase(t.master, host.master.data(), dev.master);
        t.param16 = rebase(t.param16, host.param16.data(), dev.param16);
        t.remainder = rebase(t.remainder, host.remainder.data(), dev.remainder);
        t.tie_bits = rebase(t.tie_bits, host.ties.data(), dev.ties);
        t.grad = d_grad + at[k];
        const bool bf16 = f.moments == MomentFormat::kBf16;
        t.exp_avg = int8 ? static_cast<void*>(dev.m8 + at[k]) : bf16 ? static_cast<void*>(dev.m16 + at[k]) : dev.m32 + at[k];
        t.exp_avg_sq = int8 ? static_cast<void*>(dev.v8 + at[k]) : bf16 ? static_cast<void*>(dev.v16 + at[k]) : dev.v32 + at[k];
        t.exp_avg_scale = int8 ? dev.ms + at[k] / kB : nullptr;
        t.exp_avg_sq_scale = int8 ? dev.vs + at[k] / kB : nullptr;
        t.exp_avg_code = m_code.ref();
        t.exp_avg_sq_code = v_code.ref();
        ASSERT_TRUE(adam_step_compact_cuda(t, len, h, nullptr).ok());
      }
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaFree(d_grad);
      const State got = dev.read(host);
      ASSERT_TRUE(same_bits(got, host)) << describe(f) << ", step " << step << ": first difference "
                                        << first_difference(got, host);
    }
    std::printf("[ compact] CUDA = CPU twin bit for bit, %s, 3 steps of %zu elements\n", describe(f).c_str(), n);
  }
#endif
}

}  // namespace
}  // namespace tz::kernels
