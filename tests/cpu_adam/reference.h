// Test helpers for cpu_adam: a float64 reference of every optimizer, straight
// from the formulas in tierzero/cpu_adam.h, with a running bound on how far an
// fp32 implementation may drift from it; independent 16-bit conversions; and
// buffers that can be deliberately misaligned.
//
// Tolerance. Each reference step also propagates, per element and per state
// (param, moments), an absolute error bound: every fp32 operation the kernel
// does contributes a few units of fp32 rounding (u = 2^-24) times the
// magnitudes of its operands (not of its result, so cancellation is covered),
// the hyperparameters' rounding to fp32 is counted, and errors already in the
// state are carried through the formulas (|d sqrt(x)| <= min(sqrt(dx), dx /
// sqrt(x)), |d(a/b)| <= (|da| + |a/b| |db|) / (b - |db|), and for Lion a sign
// that may flip where |b1 m + (1-b1) g| is within its bound costs 2 lr). With
// bf16 moments the reference stores its moments rounded to bf16 like the
// kernel, and the bound gains one bf16 ulp (2^-7 relative) per store where the
// two roundings may land on different sides of a rounding boundary. A kernel
// value passes when |kernel - reference| <= 2 * bound.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tierzero/cpu_adam.h"

namespace tzt {

using tz::cpu_adam::Algorithm;
using tz::DType;
using tz::cpu_adam::Hyper;
using tz::cpu_adam::Simd;
using tz::cpu_adam::Spans;
using tz::cpu_adam::StepArgs;

// Seeded once per process from std::random_device; the seed is printed.
std::mt19937_64& rng();
double uniform(double lo, double hi);
// sign * 10^uniform(lo_exp, hi_exp): spans fp16 subnormals up to a few units.
double log_uniform_signed(double lo_exp, double hi_exp);

inline std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }
inline float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

// Independent conversions (bit manipulation for bf16, _Float16 for fp16).
std::uint16_t bf16_rne(float x);  // RNE; NaN -> (bits >> 16) | 0x40
float bf16_to_float(std::uint16_t h);
std::uint16_t fp16_rne(float x);  // IEEE RNE via _Float16
float fp16_to_float(std::uint16_t h);
// x rounded to bf16 precision, to nearest even, in double (the reference's storage).
double round_to_bf16(double x);

// n elements of one dtype; `unaligned` moves the data one element past the
// allocation's (16-byte) alignment.
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, std::size_t n, bool unaligned);

  void* data() { return n_ == 0 ? nullptr : bytes_.data() + offset_; }
  const void* data() const { return n_ == 0 ? nullptr : bytes_.data() + offset_; }
  float* f32() { return static_cast<float*>(data()); }
  std::uint16_t bits16(std::size_t i) const;
  std::size_t size() const { return n_; }
  DType dtype() const { return dtype_; }
  double get(std::size_t i) const;          // the stored value, decoded
  float get_f32(std::size_t i) const;       // fp32 buffers: the stored bits as a float
  void set(std::size_t i, double value);    // rounds to the dtype (RNE)
  void set_bits16(std::size_t i, std::uint16_t bits);
  std::vector<std::uint8_t> snapshot() const;  // the bytes, to check nothing was written

 private:
  DType dtype_ = DType::kFp32;
  std::size_t n_ = 0;
  std::size_t offset_ = 0;
  std::vector<std::uint8_t> bytes_;
};

std::size_t elem_bytes(DType dtype);

// One optimizer configuration the tests step.
struct StepSetup {
  Hyper hyper;
  DType grad_dtype = DType::kFp32;
  DType moment_dtype = DType::kFp32;
  std::optional<DType> copy;  // param16 dtype, none when empty
  std::size_t n = 0;
  bool unaligned = false;
  std::int64_t first_step = 1;
  double grad_scale = 1.0;
};

// One algorithm configuration the tests step.
struct AlgorithmConfig {
  Algorithm algorithm;
  bool amsgrad;
  double weight_decay;
};
// One per element loop of the kernels: Adam with and without its L2 term
// (without, it runs AdamW's loop), amsgrad, decoupled decay, Adagrad with and
// without L2, Lion.
inline constexpr AlgorithmConfig kEveryElementLoop[] = {
    {Algorithm::kAdam, false, 0.0},    {Algorithm::kAdam, false, 0.01},   {Algorithm::kAdam, true, 0.01},
    {Algorithm::kAdamW, false, 0.1},   {Algorithm::kAdamW, true, 0.01},   {Algorithm::kAdagrad, false, 0.0},
    {Algorithm::kAdagrad, false, 0.01}, {Algorithm::kLion, false, 0.1},
};

// Thread counts and tile sizes (0: the optimizer's choice) that results must not depend on.
struct ThreadsAndTile {
  int threads;
  std::size_t tile;
};
inline constexpr ThreadsAndTile kThreadsAndTiles[] = {{1, 0}, {2, 16}, {3, 48}, {4, 1024}, {2, 0}};

// Random hyperparameters for an algorithm (lr, betas, weight decay drawn so
// every term matters; weight_decay as given).
Hyper random_hyper(Algorithm algorithm, bool amsgrad, double weight_decay);
std::string describe(const StepSetup& setup);

struct CheckResult {
  double max_ratio = 0;      // max |kernel - reference| / bound over every state
  double max_param_err = 0;  // max |kernel - reference| of the parameters
  double max_rel_err = 0;    // ... relative to |reference param|, where that is >= 0.01
  std::string worst_state;   // the state with max_ratio
  std::size_t failures = 0;
  std::string first_failure;
  void merge(const CheckResult& other);
};

// The spans, their contents, and the reference state beside them.
class StepProblem {
 public:
  explicit StepProblem(const StepSetup& setup);

  Spans spans();
  void fresh_grads();                      // new random gradients (kernel and reference)
  void reference_step(std::int64_t step);  // advances the reference by one step
  CheckResult check() const;               // kernel buffers against the reference

  Buffer param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param16;

 private:
  struct Elem {
    double p = 0, m = 0, v = 0, vmax = 0;      // reference state
    double ep = 0, em = 0, ev = 0, evmax = 0;  // error bounds of the kernel's state
  };
  void check_copy(std::size_t i, CheckResult* r) const;

  StepSetup setup_;
  std::vector<Elem> ref_;
};

// The compiled variants this CPU runs, narrowest first.
std::vector<Simd> runnable_variants();
// An optimizer that must be creatable (throws, failing the test, otherwise).
std::unique_ptr<tz::cpu_adam::CpuOptimizer> make_optimizer(Simd simd, int threads, std::size_t tile_elems = 0);

// Builds a problem, runs `steps` steps through `opt` (fresh gradients each
// step) and the reference beside it, checking after every step.
CheckResult run_steps(tz::cpu_adam::CpuOptimizer& opt, const StepSetup& setup, int steps);

}  // namespace tzt
