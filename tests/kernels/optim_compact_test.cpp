// The compact Adam step (tierzero/kernels.h, adam_step_compact_*): its CPU
// twin against cpu_adam, the optimizer whose bits it must reproduce, on fresh
// random inputs over several steps for every format and every cpu_adam
// variant this CPU runs; the CUDA kernel against the twin where a GPU is
// present (it skips, saying why, elsewhere). Bit for bit throughout.
#include <gtest/gtest.h>

#include <cstring>
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
const Format kFormats[] = {{MasterFormat::kFp32, MomentFormat::kFp32},
                           {MasterFormat::kFp32, MomentFormat::kBf16},
                           {MasterFormat::kRemainder, MomentFormat::kFp32},
                           {MasterFormat::kRemainder, MomentFormat::kBf16}};

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
  } else {
    s.m32.assign(n, 0);
    s.v32.assign(n, 0);
  }
  return s;
}

void* exp_avg_of(State& s) { return s.m16.empty() ? static_cast<void*>(s.m32.data()) : s.m16.data(); }
void* exp_avg_sq_of(State& s) { return s.v16.empty() ? static_cast<void*>(s.v32.data()) : s.v16.data(); }

AdamCompactTensors tensors_of(const Format& f, State& s, const std::vector<float>& grad, std::size_t begin,
                              std::uint32_t sr_key, std::uint32_t sr_base) {
  const bool rem = f.master == MasterFormat::kRemainder;
  const std::size_t m_bytes = f.moments == MomentFormat::kBf16 ? 2 : 4;
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
          .sr_base = sr_base + static_cast<std::uint32_t>(begin)};
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
  sp.moment_dtype = f.moments == MomentFormat::kBf16 ? DType::kBf16 : DType::kFp32;
  sp.param16 = s.param16.data();
  sp.master_format = f.master;
  sp.remainder = rem ? s.remainder.data() : nullptr;
  sp.tie_bits = rem ? s.ties.data() : nullptr;
  sp.rounding_key = key;
  sp.rounding_index = index;
  return sp;
}

// Which bits differ, for the failure message.
std::string first_difference(const State& a, const State& b) {
  const auto check = [](const char* what, const auto& x, const auto& y) -> std::string {
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (std::memcmp(&x[i], &y[i], sizeof(x[i])) != 0) return std::string(what) + "[" + std::to_string(i) + "]";
    }
    return "";
  };
  for (const std::string& s : {check("master", a.master, b.master), check("param16", a.param16, b.param16),
                               check("remainder", a.remainder, b.remainder), check("tie_bits", a.ties, b.ties),
                               check("exp_avg", a.m32, b.m32), check("exp_avg_sq", a.v32, b.v32),
                               check("exp_avg (bf16)", a.m16, b.m16), check("exp_avg_sq (bf16)", a.v16, b.v16)}) {
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

TEST(AdamStepCompact, CpuTwinMatchesCpuAdamBitForBitOnEveryVariantAndFormat) {
  const std::size_t n = 10'007;  // not a multiple of 8: the last tie-bit byte is shared with nothing
  std::mt19937_64 rng(std::random_device{}());
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
          std::normal_distribution<float> gd(0.0F, 0.3F);
          std::vector<float> grad(n);
          for (float& g : grad) g = step == 3 ? 0.0F : gd(rng);  // step 3: a zero gradient
          const double grad_scale = 0.5 + 0.1 * static_cast<double>(step);
          ASSERT_TRUE((*opt)->step(hyper, {.step = step, .grad_scale = grad_scale},
                                   spans_of(f, ref, grad, key, index)).ok());
          const AdamHyper h{.lr = hyper.lr, .beta1 = hyper.beta1, .beta2 = hyper.beta2, .eps = hyper.eps,
                            .weight_decay = hyper.weight_decay,
                            .adamw = a.algorithm == cpu_adam::Algorithm::kAdamW, .step = step,
                            .grad_scale = grad_scale};
          const AdamCompactTensors t = tensors_of(f, twin, grad, 0, state_math::sr_step_key(key, step, index),
                                                  static_cast<std::uint32_t>(index));
          ASSERT_TRUE(adam_step_compact_cpu(t, n, h, {.fused_multiply_add = fused}).ok());
          ASSERT_TRUE(same_bits(twin, ref))
              << cpu_adam::simd_name(simd) << ", " << describe(f) << ", " << cpu_adam::algorithm_name(a.algorithm)
              << " wd " << a.weight_decay << ", step " << step << ": first difference " << first_difference(twin, ref);
        }
      }
    }
  }
  std::printf("[ compact] CPU twin = cpu_adam bit for bit: %d variants x %zu formats x 3 algorithms x 5 steps\n",
              variants, std::size(kFormats));
}

TEST(AdamStepCompact, CpuTwinInPiecesAtAnyElementIsTheWholeCall) {
  // The engine launches once per weight-decay run, which may start inside a
  // tie-bit byte; the pieces must give the one call's bits.
  const std::size_t n = 1000, cuts[] = {0, 3, 13, 16, 501, 1000};
  std::mt19937_64 rng(std::random_device{}());
  for (const Format& f : kFormats) {
    State whole = make_state(f, n, rng);
    State pieces = whole;
    std::vector<float> grad(n);
    std::normal_distribution<float> gd(0.0F, 0.3F);
    for (float& g : grad) g = gd(rng);
    const AdamHyper h{.lr = 1e-2, .weight_decay = 0.1, .step = 2};
    ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, whole, grad, 0, 77, 5), n, h).ok());
    for (std::size_t k = 0; k + 1 < std::size(cuts); ++k) {
      ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, pieces, grad, cuts[k], 77, 5), cuts[k + 1] - cuts[k], h).ok());
    }
    EXPECT_TRUE(same_bits(whole, pieces)) << describe(f) << ": first difference " << first_difference(whole, pieces);
  }
}

TEST(AdamStepCompact, Int8MomentsAndMissingArraysAreRefusedByName) {
  std::vector<float> x(8);
  const AdamCompactTensors int8{.master = x.data(), .grad = x.data(), .moment_format = MomentFormat::kInt8,
                                .exp_avg = x.data(), .exp_avg_sq = x.data()};
  Status s = adam_step_compact_cpu(int8, 8, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("int8"), std::string::npos) << s.to_string();
  const AdamCompactTensors no_ties{.master_format = MasterFormat::kRemainder,
                                   .param16 = reinterpret_cast<std::uint16_t*>(x.data()),
                                   .remainder = reinterpret_cast<std::int16_t*>(x.data() + 4),
                                   .grad = x.data(),
                                   .exp_avg = x.data(),
                                   .exp_avg_sq = x.data()};
  s = adam_step_compact_cpu(no_ties, 4, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tie_bits"), std::string::npos) << s.to_string();
#if defined(TIERZERO_WITH_CUDA)
  s = adam_step_compact_cuda(int8, 8, {}, nullptr);  // refused before any launch
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("int8"), std::string::npos) << s.to_string();
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
        v16(to_device(s.v16)) {}
  ~DeviceState() {
    for (void* p : {static_cast<void*>(master), static_cast<void*>(param16), static_cast<void*>(remainder),
                    static_cast<void*>(ties), static_cast<void*>(m32), static_cast<void*>(v32),
                    static_cast<void*>(m16), static_cast<void*>(v16)}) {
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
    return s;
  }
  float* master;
  std::uint16_t* param16;
  std::int16_t* remainder;
  std::uint8_t* ties;
  float *m32, *v32;
  std::uint16_t *m16, *v16;
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
  // Pieces as the engine's weight-decay runs launch them: starts inside
  // tie-bit bytes and warps, a piece shorter than a warp, a long one.
  const std::size_t n = (1 << 20) + 13, cuts[] = {0, 5, 21, 40, 70'001, n};
  std::mt19937_64 rng(std::random_device{}());
  for (const Format& f : kFormats) {
    State host = make_state(f, n, rng);
    DeviceState dev(host);
    for (std::int64_t step = 1; step <= 3; ++step) {
      std::vector<float> grad(n);
      std::normal_distribution<float> gd(0.0F, 0.3F);
      for (float& g : grad) g = gd(rng);
      float* d_grad = to_device(grad);
      const std::uint32_t key = state_math::sr_step_key(1234, step, 0xffff'fff0ULL);  // indices wrap past 2^32
      for (std::size_t k = 0; k + 1 < std::size(cuts); ++k) {
        const AdamHyper h{.lr = 1e-2, .weight_decay = k % 2 == 0 ? 0.1 : 0.0, .adamw = step != 2, .step = step};
        const std::size_t len = cuts[k + 1] - cuts[k];
        ASSERT_TRUE(adam_step_compact_cpu(tensors_of(f, host, grad, cuts[k], key, 0xffff'fff0U), len, h).ok());
        State shape = host;  // device pointers at the same offsets as the host arrays
        AdamCompactTensors t = tensors_of(f, shape, grad, cuts[k], key, 0xffff'fff0U);
        const auto rebase = [&](auto* h_ptr, auto* h_base, auto* d_base) {
          return h_ptr == nullptr ? nullptr : d_base + (h_ptr - h_base);
        };
        t.master = rebase(t.master, shape.master.data(), dev.master);
        t.param16 = rebase(t.param16, shape.param16.data(), dev.param16);
        t.remainder = rebase(t.remainder, shape.remainder.data(), dev.remainder);
        t.tie_bits = rebase(t.tie_bits, shape.ties.data(), dev.ties);
        t.grad = d_grad + cuts[k];
        const bool bf16 = f.moments == MomentFormat::kBf16;
        t.exp_avg = bf16 ? static_cast<void*>(dev.m16 + cuts[k]) : dev.m32 + cuts[k];
        t.exp_avg_sq = bf16 ? static_cast<void*>(dev.v16 + cuts[k]) : dev.v32 + cuts[k];
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
