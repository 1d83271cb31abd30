// Helpers for the train tests: fresh random inputs, finite-difference
// gradient checks, comparing float results with double ones, and the GPT's
// initial weights and random token batches.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tierzero/train.h"

namespace tzt {

// A fresh seed per run (printed, so a failure can be replayed with TZ_TEST_SEED).
inline std::uint64_t fresh_seed() {
  if (const char* env = std::getenv("TZ_TEST_SEED"); env != nullptr) return std::strtoull(env, nullptr, 10);
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) | rd();
}

inline std::vector<double> random_vector(std::mt19937_64& rng, std::size_t n, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

struct FdResult {
  double max_rel = 0;       // largest |numeric - analytic| / max(|numeric|, |analytic|, floor)
  std::size_t checked = 0;
};

// Fourth-order central differences (f(x-2h) - 8 f(x-h) + 8 f(x+h) - f(x+2h)) / 12h
// of the scalar `objective` against `analytic` = its gradient with respect to x, on up to `max_coords` coordinates (all when x
// is that small, else an even spread). Relative errors use a floor of 1e-3
// of the largest analytic component, so components that are ~0 are judged
// against the gradient's scale rather than against themselves.
inline FdResult fd_check(std::vector<double>& x, const std::vector<double>& analytic,
                         const std::function<double()>& objective, std::size_t max_coords = 160, double h = 1e-3) {
  FdResult r;
  double scale = 0;
  for (double a : analytic) scale = std::max(scale, std::fabs(a));
  const double floor = std::max(scale * 1e-3, 1e-12);
  const std::size_t stride = std::max<std::size_t>(1, x.size() / max_coords);
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const double saved = x[i];
    auto at = [&](double offset) {
      x[i] = saved + offset;
      return objective();
    };
    const double numeric = (at(-2 * h) - 8 * at(-h) + 8 * at(h) - at(2 * h)) / (12 * h);
    x[i] = saved;
    const double denom = std::max({std::fabs(numeric), std::fabs(analytic[i]), floor});
    r.max_rel = std::max(r.max_rel, std::fabs(numeric - analytic[i]) / denom);
    ++r.checked;
  }
  return r;
}

// Largest |f - d| / max |d|: how far a float result is from the double one.
template <typename F>
double float_vs_double(const std::vector<F>& f, const std::vector<double>& d) {
  double worst = 0, scale = 1e-30;
  for (std::size_t i = 0; i < d.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(f[i]) - d[i]));
    scale = std::max(scale, std::fabs(d[i]));
  }
  return worst / scale;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline void report(const char* what, const FdResult& r) {
  std::printf("[ fd     ] %-44s largest relative error %.3g over %zu coordinates\n", what, r.max_rel, r.checked);
}

// Tolerances. The fourth-order stencil with h = 1e-3 in double has a
// truncation error ~h^4 and rounding ~1e-16 / h: ~1e-9 relative here; 1e-6
// leaves room and still catches any wrong term (those are O(1)). Float against double: fp32 rounding over sums of a few hundred terms.
inline constexpr double kFdTolerance = 1e-6;
inline constexpr double kFloatTolerance = 1e-4;

// The GPT's initial weights (tz::train::init), one flat vector per block.
template <typename T>
std::vector<std::vector<T>> initial_weights(const tz::train::GptConfig& cfg, const tz::ModelLayout& layout) {
  const tz::ParamInit init = tz::train::init(cfg);
  std::vector<std::vector<T>> out;
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    const tz::BlockLayout& block = layout.blocks[b];
    std::vector<float> flat(block.used_numel, 0.0F);
    for (std::size_t p = 0; p < block.params.size(); ++p) {
      init(b, p, flat.data() + block.params[p].offset, block.params[p].numel);
    }
    out.emplace_back(flat.begin(), flat.end());
  }
  return out;
}

// Uniformly random input and target tokens.
inline tz::train::TokenBatch random_batch(std::mt19937_64& rng, int batch, int seq, int vocab) {
  tz::train::TokenBatch b{batch, seq, std::vector<std::int32_t>(batch * seq), std::vector<std::int32_t>(batch * seq)};
  for (auto& t : b.inputs) t = static_cast<std::int32_t>(rng() % vocab);
  for (auto& t : b.targets) t = static_cast<std::int32_t>(rng() % vocab);
  return b;
}

}  // namespace tzt
