// The optimizer kernels (tierzero/kernels.h): the CPU twins against plain
// references in higher precision on fresh random inputs, and the CUDA kernels
// against the twins where a GPU is present (they skip, saying why, elsewhere).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tierzero/kernels.h"
#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace tz::kernels {
namespace {

std::vector<float> normal_floats(std::size_t n, float scale, std::uint64_t salt = 0) {
  std::mt19937_64 rng(std::random_device{}() ^ salt);
  std::normal_distribution<float> d(0.0F, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(Unscale, CpuTwinScalesExactlyByAPowerOfTwoAndFlagsInfAndNan) {
  std::vector<float> g = normal_floats(10'000, 1000.0F);
  const std::vector<float> before = g;
  EXPECT_FALSE(unscale_cpu(g.data(), g.size(), 0x1p-12F));
  for (std::size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], std::ldexp(before[i], -12)) << i;
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> h = before;
    h[1234] = bad;
    EXPECT_TRUE(unscale_cpu(h.data(), h.size(), 0x1p-12F)) << bad;
  }
  std::vector<float> big = {1e38F, 1.0F};
  EXPECT_TRUE(unscale_cpu(big.data(), big.size(), 0x1p+10F)) << "overflow while scaling is caught too";
}

TEST(SquaredNorms, CpuTwinMatchesALongDoubleSumPerTensor) {
  const std::size_t sizes[] = {0, 1, 1000, 65537, 200'003};
  std::vector<std::vector<float>> data;
  std::vector<TensorRef> refs;
  for (std::size_t i = 0; i < std::size(sizes); ++i) data.push_back(normal_floats(sizes[i], 0.5F + i, i));
  for (const auto& d : data) refs.push_back({d.data(), d.size()});
  std::vector<double> out(refs.size(), -1);
  squared_norms_cpu(refs.data(), refs.size(), out.data());
  double worst = 0;
  for (std::size_t t = 0; t < refs.size(); ++t) {
    long double want = 0;
    for (float x : data[t]) want += static_cast<long double>(x) * x;
    const double rel = want == 0 ? std::fabs(out[t]) : std::fabs(out[t] - static_cast<double>(want)) / static_cast<double>(want);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-12) << "tensor " << t;
  }
  std::printf("[ norms  ] CPU twin vs long double: largest relative error %.3g\n", worst);
}

// The update in double, with the formulas of the header, for reference.
// Marks in `ill` the elements where Adam's L2 term nearly cancels the
// gradient (|g + wd p| < 1e-3 |g|): there fp32's rounding of the sum is a
// large relative change of what Adam normalises, and no fp32 implementation
// can follow the exact result to fp32 rounding.
void adam_reference(std::vector<double>& p, const std::vector<float>& g, std::vector<double>& m, std::vector<double>& v,
                    const AdamHyper& h, std::vector<bool>& ill) {
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  for (std::size_t i = 0; i < p.size(); ++i) {
    double gi = g[i] * h.grad_scale;
    if (h.adamw) {
      p[i] *= 1 - h.lr * h.weight_decay;
    } else {
      const double raw = gi;
      gi += h.weight_decay * p[i];
      if (std::fabs(gi) < 1e-3 * std::fabs(raw)) ill[i] = true;
    }
    m[i] = h.beta1 * m[i] + (1 - h.beta1) * gi;
    v[i] = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
    p[i] -= h.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
  }
}

TEST(AdamStep, CpuTwinFollowsADoubleReferenceOverSeveralSteps) {
  const std::size_t n = 20'000;
  for (bool adamw : {true, false}) {
    std::vector<float> p = normal_floats(n, 0.1F, 1), m(n, 0), v(n, 0);  // weights of a typical scale
    std::vector<std::uint16_t> p16(n);
    std::vector<double> pd(p.begin(), p.end()), md(n, 0), vd(n, 0);
    std::vector<bool> ill(n, false);
    double worst = 0;
    for (std::int64_t step = 1; step <= 6; ++step) {
      const std::vector<float> g = normal_floats(n, 0.01F, 100 + step);
      const AdamHyper h{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .adamw = adamw,
                        .step = step, .grad_scale = 0.5};
      ASSERT_TRUE(adam_step_cpu({p.data(), g.data(), m.data(), v.data(), p16.data()}, n, h).ok());
      adam_reference(pd, g, md, vd, h, ill);
      for (std::size_t i = 0; i < n; ++i) {
        if (!ill[i]) worst = std::max(worst, std::fabs(p[i] - pd[i]));
        ASSERT_EQ(p16[i], fp32_to_bf16(p[i])) << "the bf16 copy-out is the rounded master";
      }
    }
    std::printf("[ adam   ] %s CPU twin vs double after 6 steps: largest |p - p_ref| %.3g (%zu of %zu elements "
                "ill-conditioned, not compared)\n", adamw ? "AdamW" : "Adam", worst,
                static_cast<std::size_t>(std::count(ill.begin(), ill.end(), true)), n);
    // Each step moves a weight by up to lr = 1e-3; fp32 rounding of weights
    // ~0.1 is ~1e-8 a step. A wrong term would be off by ~1e-4 or more.
    EXPECT_LE(worst, 2e-6) << (adamw ? "AdamW" : "Adam");
  }
}

TEST(AdamStep, BadHyperParametersAreRefusedNamingTheValue) {
  float p = 1, g = 1, m = 0, v = 0;
  Status s = adam_step_cpu({&p, &g, &m, &v, nullptr}, 1, {.beta2 = 1.0});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("beta2 = 1"), std::string::npos) << s.message();
  s = adam_step_cpu({&p, &g, &m, &v, nullptr}, 1, {.step = 0});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("step 0"), std::string::npos) << s.message();
  EXPECT_EQ(p, 1.0F) << "a refused step changes nothing";
}

// The 16-bit gradient as bits, and its exact fp32 value.
std::vector<std::uint16_t> to_16bit(const std::vector<float>& x, DType f) {
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = f == DType::kBf16 ? fp32_to_bf16(x[i]) : fp32_to_fp16(x[i]);
  return out;
}

TEST(AccumulateGrad, CpuTwinMatchesADoubleReferenceForEveryFormat) {
  const std::size_t n = 100'003;
  for (DType f : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    const std::vector<float> g1 = normal_floats(n, 3.0F, 11), g2 = normal_floats(n, 3.0F, 12);
    std::vector<std::uint16_t> b1 = to_16bit(g1, f), b2 = to_16bit(g2, f);
    const void* p1 = f == DType::kFp32 ? static_cast<const void*>(g1.data()) : b1.data();
    const void* p2 = f == DType::kFp32 ? static_cast<const void*>(g2.data()) : b2.data();
    auto value = [&](const std::vector<float>& g, const std::vector<std::uint16_t>& b, std::size_t i) -> double {
      return f == DType::kFp32 ? g[i] : f == DType::kBf16 ? bf16_to_fp32(b[i]) : fp16_to_fp32(b[i]);
    };
    std::vector<float> acc(n, 12345.0F);  // overwritten by the first call
    accumulate_grad_cpu(acc.data(), p1, f, n, true, 0.25F);
    accumulate_grad_cpu(acc.data(), p2, f, n, false, 0.25F);
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double want = 0.25 * value(g1, b1, i) + 0.25 * value(g2, b2, i);
      worst = std::max(worst, std::fabs(acc[i] - want) / std::max(1e-30, std::fabs(want) + 1e-3));
    }
    EXPECT_LE(worst, 1e-6) << "format " << static_cast<int>(f);
  }
}

#if defined(TIERZERO_WITH_CUDA)
// Skips the test unless a CUDA device is present.
#define TZ_REQUIRE_GPU()                                                             \
  do {                                                                               \
    int count_ = 0;                                                                  \
    if (cudaGetDeviceCount(&count_) != cudaSuccess || count_ == 0) {                 \
      GTEST_SKIP() << "no CUDA device: " << cudaGetErrorString(cudaGetLastError());  \
    }                                                                                \
  } while (0)

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<std::size_t>(host.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}
#endif

TEST(OptimCuda, UnscaleMatchesTheCpuTwin) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  TZ_REQUIRE_GPU();
  std::vector<float> g = normal_floats(1 << 20, 100.0F);
  float* d_g = to_device(g);
  int* d_found = to_device(std::vector<int>{0});
  ASSERT_TRUE(unscale_cuda(d_g, g.size(), 0x1p-7F, d_found, nullptr).ok());
  const bool cpu_found = unscale_cpu(g.data(), g.size(), 0x1p-7F);
  EXPECT_EQ(to_host(d_g, g.size()), g);
  EXPECT_EQ(to_host(d_found, 1)[0], cpu_found ? 1 : 0);
  g[777] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(cudaMemcpy(d_g, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(unscale_cuda(d_g, g.size(), 1.0F, d_found, nullptr).ok());
  EXPECT_EQ(to_host(d_found, 1)[0], 1);
  cudaFree(d_g);
  cudaFree(d_found);
#endif
}

TEST(OptimCuda, SquaredNormsMatchTheCpuTwinAndRepeatBitForBit) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  TZ_REQUIRE_GPU();
  const std::size_t sizes[] = {0, 1, 65536, 65537, 3'000'001};
  std::vector<std::vector<float>> host;
  std::vector<float*> dev;
  std::vector<TensorRef> h_refs, d_refs;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    host.push_back(normal_floats(sizes[i], 1.0F, i));
    dev.push_back(to_device(host.back()));
    h_refs.push_back({host.back().data(), sizes[i]});
    d_refs.push_back({dev.back(), sizes[i]});
  }
  double* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, std::size(sizes) * sizeof(double)), cudaSuccess);
  ASSERT_TRUE(squared_norms_cuda(d_refs.data(), d_refs.size(), d_out, nullptr).ok());
  const std::vector<double> first = to_host(d_out, std::size(sizes));
  ASSERT_TRUE(squared_norms_cuda(d_refs.data(), d_refs.size(), d_out, nullptr).ok());
  EXPECT_EQ(to_host(d_out, std::size(sizes)), first) << "Note [Deterministic norms]";
  std::vector<double> cpu(std::size(sizes));
  squared_norms_cpu(h_refs.data(), h_refs.size(), cpu.data());
  for (std::size_t t = 0; t < cpu.size(); ++t) EXPECT_NEAR(first[t], cpu[t], 1e-6 * cpu[t]) << "tensor " << t;
  for (float* d : dev) cudaFree(d);
  cudaFree(d_out);
#endif
}

TEST(OptimCuda, AdamMatchesTheCpuTwin) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  TZ_REQUIRE_GPU();
  const std::size_t n = 1 << 20;
  std::vector<float> p = normal_floats(n, 0.1F, 1), g = normal_floats(n, 0.01F, 2), m(n, 0), v(n, 0);
  std::vector<std::uint16_t> p16(n);
  float *d_p = to_device(p), *d_g = to_device(g), *d_m = to_device(m), *d_v = to_device(v);
  std::uint16_t* d_p16 = to_device(p16);
  double worst = 0;
  for (std::int64_t step = 1; step <= 3; ++step) {
    const AdamHyper h{.lr = 1e-3, .weight_decay = 0.01, .step = step};
    ASSERT_TRUE(adam_step_cuda({d_p, d_g, d_m, d_v, d_p16}, n, h, nullptr).ok());
    ASSERT_TRUE(adam_step_cpu({p.data(), g.data(), m.data(), v.data(), p16.data()}, n, h).ok());
  }
  const std::vector<float> gp = to_host(d_p, n);
  const std::vector<std::uint16_t> gp16 = to_host(d_p16, n);
  std::size_t p16_mismatch = 0;
  for (std::size_t i = 0; i < n; ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(gp[i] - p[i])));
    p16_mismatch += gp16[i] != fp32_to_bf16(gp[i]);
  }
  std::printf("[ adam   ] CUDA vs CPU twin after 3 steps: largest |difference| %.3g\n", worst);
  EXPECT_LE(worst, 1e-6) << "FMA contraction may differ; the operations are the same";
  EXPECT_EQ(p16_mismatch, 0U);
  for (void* d : {static_cast<void*>(d_p), static_cast<void*>(d_g), static_cast<void*>(d_m), static_cast<void*>(d_v),
                  static_cast<void*>(d_p16)}) {
    cudaFree(d);
  }
#endif
}

TEST(OptimCuda, AccumulateGradMatchesTheCpuTwinBitForBit) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  TZ_REQUIRE_GPU();
  const std::size_t n = (1 << 20) + 17;
  for (DType f : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    const std::vector<float> g1 = normal_floats(n, 2.0F, 21), g2 = normal_floats(n, 2.0F, 22);
    const std::vector<std::uint16_t> b1 = to_16bit(g1, f), b2 = to_16bit(g2, f);
    std::vector<float> acc = normal_floats(n, 1.0F, 23);
    float* d_acc = to_device(acc);
    float *d_g1 = to_device(g1), *d_g2 = to_device(g2);
    std::uint16_t *d_b1 = to_device(b1), *d_b2 = to_device(b2);
    const bool fp32 = f == DType::kFp32;
    const void* h1 = fp32 ? static_cast<const void*>(g1.data()) : b1.data();
    const void* h2 = fp32 ? static_cast<const void*>(g2.data()) : b2.data();
    const void* dv1 = fp32 ? static_cast<const void*>(d_g1) : d_b1;
    const void* dv2 = fp32 ? static_cast<const void*>(d_g2) : d_b2;
    ASSERT_TRUE(accumulate_grad_cuda(d_acc, dv1, f, n, true, 0.125F, nullptr).ok());
    ASSERT_TRUE(accumulate_grad_cuda(d_acc, dv2, f, n, false, 0.125F, nullptr).ok());
    accumulate_grad_cpu(acc.data(), h1, f, n, true, 0.125F);
    accumulate_grad_cpu(acc.data(), h2, f, n, false, 0.125F);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = to_host(d_acc, n);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < n; ++i) differ += got[i] != acc[i];
    EXPECT_EQ(differ, 0U) << "format " << static_cast<int>(f) << ": one fma per element on both sides";
    for (void* d : {static_cast<void*>(d_acc), static_cast<void*>(d_g1), static_cast<void*>(d_g2),
                    static_cast<void*>(d_b1), static_cast<void*>(d_b2)}) {
      cudaFree(d);
    }
  }
#endif
}

}  // namespace
}  // namespace tz::kernels
