#include "reference.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace tzt {
namespace {

constexpr double kU = 0x1p-24;        // fp32 unit roundoff
constexpr double kBf16Ulp = 0x1p-7;   // bf16 spacing relative to the value, at most

struct Scaled {
  double g;
  double err;
};

// g * grad_scale as the kernel computes it: two roundings (scale to fp32, product).
Scaled scaled(double g, double scale) { return {g * scale, 2 * kU * std::fabs(g * scale)}; }

// Bound on |sqrt(d') - sqrt(d)| when |d' - d| <= ed, plus sqrt's own rounding.
double sqrt_err(double d, double ed) {
  const double s = std::sqrt(d);
  const double spread = d > 0 ? std::min(std::sqrt(ed), ed / s) : std::sqrt(ed);
  return spread + kU * s;
}

// Bound on |a'/b' - a/b| for |a' - a| <= ea, |b' - b| <= eb, b > 0, plus the division's rounding.
double quot_err(double a, double ea, double b, double eb) {
  const double q = std::fabs(a / b);
  return (ea + q * eb) / std::max(b - eb, 0.5 * b) + kU * q;
}

// The reference's store of a moment: rounded to bf16 like the kernel's, and
// the two roundings may differ by one bf16 ulp.
void store_moment(double* x, double* err, bool bf16) {
  if (!bf16) return;
  *err += kBf16Ulp * (std::fabs(*x) + *err);
  *x = round_to_bf16(*x);
}

}  // namespace

std::mt19937_64& rng() {
  static std::mt19937_64 engine = [] {
    std::uint64_t seed;
    if (const char* s = std::getenv("TIERZERO_TEST_SEED"); s != nullptr && *s != '\0') {
      seed = std::strtoull(s, nullptr, 10);
    } else {
      std::random_device rd;
      seed = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    }
    std::printf("[cpu_adam tests] random seed %" PRIu64 " (TIERZERO_TEST_SEED=%" PRIu64 " repeats this run)\n", seed,
                seed);
    std::fflush(stdout);
    return std::mt19937_64(seed);
  }();
  return engine;
}

double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng()); }

double log_uniform_signed(double lo_exp, double hi_exp) {
  const double mag = std::pow(10.0, uniform(lo_exp, hi_exp));
  return uniform(0, 1) < 0.5 ? -mag : mag;
}

double round_to_bf16(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  if (std::fabs(x) < 0x1p-126) return std::nearbyint(x * 0x1p133) * 0x1p-133;  // bf16 subnormals
  int e = 0;
  const double f = std::frexp(x, &e);  // x = f 2^e, 0.5 <= |f| < 1: 8 significant bits kept
  return std::ldexp(std::nearbyint(std::ldexp(f, 8)), e - 8);
}

std::uint16_t bf16_rne(float x) {
  const std::uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const double r = round_to_bf16(x);
  if (std::fabs(r) >= 0x1p128) return static_cast<std::uint16_t>(((u >> 16) & 0x8000) | 0x7f80);
  return static_cast<std::uint16_t>(bits_of(static_cast<float>(r)) >> 16);
}

float bf16_to_float(std::uint16_t h) { return float_of(static_cast<std::uint32_t>(h) << 16); }

std::uint16_t fp16_rne(float x) {
  const auto h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

float fp16_to_float(std::uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof(x));
  return static_cast<float>(x);
}

std::size_t elem_bytes(DType dtype) { return dtype_bytes(dtype); }

Buffer::Buffer(DType dtype, std::size_t n, bool unaligned)
    : dtype_(dtype), n_(n), offset_(unaligned ? elem_bytes(dtype) : 0), bytes_((n + 1) * elem_bytes(dtype)) {}

std::uint16_t Buffer::bits16(std::size_t i) const {
  std::uint16_t h;
  std::memcpy(&h, bytes_.data() + offset_ + i * 2, 2);
  return h;
}

float Buffer::get_f32(std::size_t i) const {
  float x;
  std::memcpy(&x, bytes_.data() + offset_ + i * 4, 4);
  return x;
}

double Buffer::get(std::size_t i) const {
  if (dtype_ == DType::kFp32) return get_f32(i);
  return dtype_ == DType::kBf16 ? bf16_to_float(bits16(i)) : fp16_to_float(bits16(i));
}

void Buffer::set(std::size_t i, double value) {
  const auto x = static_cast<float>(value);
  if (dtype_ == DType::kFp32) {
    std::memcpy(bytes_.data() + offset_ + i * 4, &x, 4);
  } else {
    set_bits16(i, dtype_ == DType::kBf16 ? bf16_rne(x) : fp16_rne(x));
  }
}

void Buffer::set_bits16(std::size_t i, std::uint16_t bits) { std::memcpy(bytes_.data() + offset_ + i * 2, &bits, 2); }

std::vector<std::uint8_t> Buffer::snapshot() const { return bytes_; }

Hyper random_hyper(Algorithm algorithm, bool amsgrad, double weight_decay) {
  Hyper h;
  h.algorithm = algorithm;
  h.amsgrad = amsgrad;
  h.weight_decay = weight_decay;
  const double pick = uniform(0, 1);
  switch (algorithm) {
    case Algorithm::kAdam:
    case Algorithm::kAdamW:
      h.lr = std::pow(10.0, uniform(-4, -2));
      h.beta1 = pick < 0.1 ? 0.0 : (pick < 0.5 ? 0.9 : uniform(0.5, 0.99));
      h.beta2 = pick < 0.5 ? 0.999 : uniform(0.9, 0.9999);
      h.eps = std::pow(10.0, uniform(-8, -6));
      break;
    case Algorithm::kAdagrad:
      h.lr = std::pow(10.0, uniform(-3, -1));
      h.lr_decay = pick < 0.5 ? 0.0 : uniform(0, 0.01);
      h.eps = std::pow(10.0, uniform(-10, -8));
      break;
    case Algorithm::kLion:
      h.lr = std::pow(10.0, uniform(-5, -3));
      h.beta1 = pick < 0.5 ? 0.9 : uniform(0.5, 0.99);
      h.beta2 = pick < 0.5 ? 0.99 : uniform(0.9, 0.999);
      break;
  }
  return h;
}

std::string describe(const StepSetup& s) {
  return fmt::format("{}{} wd={} grad={} moments={} copy={} n={}{} step={} scale={}",
                     tz::cpu_adam::algorithm_name(s.hyper.algorithm), s.hyper.amsgrad ? "+amsgrad" : "",
                     s.hyper.weight_decay, tz::dtype_name(s.grad_dtype),
                     tz::dtype_name(s.moment_dtype), s.copy ? tz::dtype_name(*s.copy) : "none",
                     s.n, s.unaligned ? " unaligned" : "", s.first_step, s.grad_scale);
}

void CheckResult::merge(const CheckResult& o) {
  if (o.max_ratio > max_ratio) worst_state = o.worst_state;
  max_ratio = std::max(max_ratio, o.max_ratio);
  max_param_err = std::max(max_param_err, o.max_param_err);
  max_rel_err = std::max(max_rel_err, o.max_rel_err);
  if (failures == 0 && o.failures != 0) first_failure = o.first_failure;
  failures += o.failures;
}

StepProblem::StepProblem(const StepSetup& setup) : setup_(setup), ref_(setup.n) {
  const Algorithm a = setup.hyper.algorithm;
  const std::size_t n = setup.n;
  param = Buffer(DType::kFp32, n, setup.unaligned);
  grad = Buffer(setup.grad_dtype, n, setup.unaligned);
  if (a != Algorithm::kAdagrad) exp_avg = Buffer(setup.moment_dtype, n, setup.unaligned);
  if (a != Algorithm::kLion) exp_avg_sq = Buffer(setup.moment_dtype, n, setup.unaligned);
  if (setup.hyper.amsgrad) max_exp_avg_sq = Buffer(DType::kFp32, n, setup.unaligned);
  if (setup.copy) param16 = Buffer(*setup.copy, n, setup.unaligned);
  for (std::size_t i = 0; i < n; ++i) {
    Elem& e = ref_[i];
    param.set(i, uniform(-2, 2));
    e.p = param.get(i);
    if (exp_avg.size() != 0) {
      exp_avg.set(i, uniform(-0.05, 0.05));
      e.m = exp_avg.get(i);
    }
    if (exp_avg_sq.size() != 0) {
      exp_avg_sq.set(i, a == Algorithm::kAdagrad ? std::pow(10.0, uniform(-4, 0)) : std::pow(10.0, uniform(-8, -2)));
      e.v = exp_avg_sq.get(i);
    }
    if (max_exp_avg_sq.size() != 0) {
      max_exp_avg_sq.set(i, e.v * uniform(0.5, 1.5));
      e.vmax = max_exp_avg_sq.get(i);
    }
  }
}

Spans StepProblem::spans() {
  Spans s;
  s.n = setup_.n;
  s.param = param.f32();
  s.grad = grad.data();
  s.grad_dtype = setup_.grad_dtype;
  s.exp_avg = exp_avg.data();
  s.exp_avg_sq = exp_avg_sq.data();
  s.moment_dtype = setup_.moment_dtype;
  s.max_exp_avg_sq = max_exp_avg_sq.f32();
  s.param16 = param16.data();
  s.param16_dtype = setup_.copy.value_or(DType::kBf16);
  return s;
}

void StepProblem::fresh_grads() {
  for (std::size_t i = 0; i < setup_.n; ++i) grad.set(i, log_uniform_signed(-6, 0.5));
}

namespace {

// Lion: p *= 1 - lr wd;  p -= lr sign(b1 m + (1-b1) g);  m = b2 m + (1-b2) g.
void lion_elem(const Hyper& h, Scaled g, bool bf16, double* p, double* ep, double* m, double* em) {
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2;
  const double decay = 1 - lr * h.weight_decay;
  const double p1 = *p * decay, ep1 = *ep * decay + 2 * kU * std::fabs(p1);
  const double c = b1 * *m + (1 - b1) * g.g;
  const double ec = b1 * *em + (1 - b1) * g.err + 4 * kU * (b1 * std::fabs(*m) + (1 - b1) * std::fabs(g.g));
  const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
  *p = p1 - lr * sign;
  *ep = ep1 + (std::fabs(c) <= ec ? 2 * lr : 0.0) + 2 * kU * (std::fabs(p1) + lr);  // a sign within ec may flip
  *em = b2 * *em + (1 - b2) * g.err + 4 * kU * (b2 * std::fabs(*m) + (1 - b2) * std::fabs(g.g));
  *m = b2 * *m + (1 - b2) * g.g;
  store_moment(m, em, bf16);
}

struct Update {
  double q = 0, eq = 0, step_size = 0;  // p -= step_size * q, q known to within eq
};

// Adagrad: s += g^2;  q = g / (sqrt(s) + eps);  step_size = lr / (1 + (t-1) lr_decay).
Update adagrad_update(const Hyper& h, Scaled g, double t, double* s, double* es) {
  *es += 2 * std::fabs(g.g) * g.err + g.err * g.err + 3 * kU * (*s + g.g * g.g);
  *s += g.g * g.g;
  const double den = std::sqrt(*s) + h.eps;
  return {g.g / den, quot_err(g.g, g.err, den, sqrt_err(*s, *es) + 2 * kU * den),
          h.lr / (1 + (t - 1) * h.lr_decay)};
}

// Adam: m, v (and vmax) moments;  q = m / (sqrt(v) / sqrt(bc2) + eps);  step_size = lr / bc1.
Update adam_update(const Hyper& h, Scaled g, double t, double* m, double* em, double* v, double* ev, double* vmax,
                   double* evmax) {
  const double b1 = h.beta1, b2 = h.beta2;
  *em = b1 * *em + (1 - b1) * g.err + 4 * kU * (b1 * std::fabs(*m) + (1 - b1) * std::fabs(g.g));
  *m = b1 * *m + (1 - b1) * g.g;
  *v = b2 * *v + (1 - b2) * g.g * g.g;
  *ev = b2 * *ev + (1 - b2) * (2 * std::fabs(g.g) * g.err + g.err * g.err) + 5 * kU * *v;
  double d = *v, ed = *ev;
  if (h.amsgrad) {
    *vmax = std::max(*vmax, *v);
    *evmax = std::max(*evmax, *ev);
    d = *vmax;
    ed = *evmax;
  }
  const double inv_sqrt_bc2 = 1 / std::sqrt(1 - std::pow(b2, t));
  const double den = std::sqrt(d) * inv_sqrt_bc2 + h.eps;
  return {*m / den, quot_err(*m, *em, den, sqrt_err(d, ed) * inv_sqrt_bc2 + 3 * kU * den),
          h.lr / (1 - std::pow(b1, t))};
}

}  // namespace

void StepProblem::reference_step(std::int64_t step) {
  const Hyper& h = setup_.hyper;
  const bool bf16 = setup_.moment_dtype == DType::kBf16;
  const double t = static_cast<double>(step);
  const double wd = h.weight_decay;
  for (std::size_t i = 0; i < setup_.n; ++i) {
    Elem& e = ref_[i];
    Scaled g = scaled(grad.get(i), setup_.grad_scale);
    if (h.algorithm == Algorithm::kLion) {
      lion_elem(h, g, bf16, &e.p, &e.ep, &e.m, &e.em);
      continue;
    }
    double p = e.p, ep = e.ep;
    if (h.algorithm == Algorithm::kAdamW) {  // decoupled: p *= 1 - lr wd
      p = e.p * (1 - h.lr * wd);
      ep = e.ep * (1 - h.lr * wd) + 2 * kU * std::fabs(p);
    } else {  // L2: g += wd p
      g.err += wd * e.ep + 4 * kU * (std::fabs(g.g) + wd * std::fabs(e.p));
      g.g += wd * e.p;
    }
    Update u;
    if (h.algorithm == Algorithm::kAdagrad) {
      u = adagrad_update(h, g, t, &e.v, &e.ev);
    } else {
      u = adam_update(h, g, t, &e.m, &e.em, &e.v, &e.ev, &e.vmax, &e.evmax);
      store_moment(&e.m, &e.em, bf16);
    }
    store_moment(&e.v, &e.ev, bf16);
    e.p = p - u.step_size * u.q;
    e.ep = ep + u.step_size * u.eq + 3 * kU * (std::fabs(p) + u.step_size * std::fabs(u.q));
  }
}

void StepProblem::check_copy(std::size_t i, CheckResult* r) const {
  const float p = param.get_f32(i);
  std::uint16_t want;
  const std::uint32_t pb = bits_of(p);
  if (*setup_.copy == DType::kBf16) {
    want = bf16_rne(p);
  } else {
    // NaN: quiet, sign and top payload bits kept (what F16C's vcvtps2ph does).
    want = std::isnan(p) ? static_cast<std::uint16_t>(((pb >> 16) & 0x8000) | 0x7e00 | ((pb >> 13) & 0x3ff))
                         : fp16_rne(p);
  }
  const std::uint16_t got = param16.bits16(i);
  if (got != want) {
    if (r->failures++ == 0) {
      r->first_failure = fmt::format("param16[{}] = {:#06x}, want {:#06x} (param {} = {:#010x})", i, got, want, p, pb);
    }
  }
}

CheckResult StepProblem::check() const {
  CheckResult r;
  auto compare = [&](const char* what, std::size_t i, double got, double want, double bound) {
    const double err = std::fabs(got - want);
    const double allowed = 2 * bound + 1e-37;
    if (err / allowed > r.max_ratio) {
      r.max_ratio = err / allowed;
      r.worst_state = what;
    }
    if (!(err <= allowed) && r.failures++ == 0) {
      r.first_failure = fmt::format("{}[{}] = {:.9g}, reference {:.9g}: error {:.3g} > allowed {:.3g}", what, i, got,
                                    want, err, allowed);
    }
    return err;
  };
  for (std::size_t i = 0; i < setup_.n; ++i) {
    const Elem& e = ref_[i];
    const double err = compare("param", i, param.get(i), e.p, e.ep);
    r.max_param_err = std::max(r.max_param_err, err);
    if (std::fabs(e.p) >= 0.01) r.max_rel_err = std::max(r.max_rel_err, err / std::fabs(e.p));
    if (exp_avg.size() != 0) compare("exp_avg", i, exp_avg.get(i), e.m, e.em);
    if (exp_avg_sq.size() != 0) compare("exp_avg_sq", i, exp_avg_sq.get(i), e.v, e.ev);
    if (max_exp_avg_sq.size() != 0) compare("max_exp_avg_sq", i, max_exp_avg_sq.get(i), e.vmax, e.evmax);
    if (setup_.copy) check_copy(i, &r);
  }
  return r;
}

std::vector<Simd> runnable_variants() {
  std::vector<Simd> out;
  for (Simd s : tz::cpu_adam::compiled_variants()) {
    if (tz::cpu_adam::cpu_supports(s)) out.push_back(s);
  }
  return out;
}

std::unique_ptr<tz::cpu_adam::CpuOptimizer> make_optimizer(Simd simd, int threads, std::size_t tile_elems) {
  return tz::cpu_adam::CpuOptimizer::create({.threads = threads, .simd = simd, .tile_elems = tile_elems}).value();
}

CheckResult run_steps(tz::cpu_adam::CpuOptimizer& opt, const StepSetup& setup, int steps) {
  StepProblem problem(setup);
  CheckResult total;
  for (int k = 0; k < steps; ++k) {
    problem.fresh_grads();
    const StepArgs args{.step = setup.first_step + k, .grad_scale = setup.grad_scale};
    const tz::Status status = opt.step(setup.hyper, args, problem.spans());
    if (!status.ok()) {
      total.failures++;
      total.first_failure = status.to_string();
      return total;
    }
    problem.reference_step(args.step);
    CheckResult r = problem.check();
    if (r.failures != 0) r.first_failure = fmt::format("step {} of {}: {}", k + 1, steps, r.first_failure);
    total.merge(r);
    if (total.failures != 0) break;
  }
  return total;
}

}  // namespace tzt
