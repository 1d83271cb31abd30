// Spans::weight_decay_segments (Note [Weight-decay segments] in
// cpu_adam/src/optimizer.cpp): one step() with a segment table is bit for bit
// one step() per run of elements with that run's weight decay, for every
// element loop, master format, moment dtype, SIMD variant and thread count;
// bad tables are refused by segment index and values before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "reference.h"
#include "tierzero/common.h"

namespace tzt {
namespace {

using tz::MasterFormat;
using tz::cpu_adam::WeightDecaySegment;
using tz::cpu_adam::algorithm_name;
using tz::cpu_adam::simd_name;

// One shard's state in plain vectors (fp32 or bf16 moments; fp32 or remainder master).
struct State {
  std::size_t n = 0;
  DType grad_dtype = DType::kFp32, moment_dtype = DType::kFp32;
  bool remainder = false;
  bool copy = false;  // fp32 master: a bf16 copy-out
  std::vector<float> param, vmax;
  std::vector<std::uint8_t> grad, m, v;  // raw bytes of their dtypes
  std::vector<std::uint16_t> p16;
  std::vector<std::int16_t> rem;
  std::vector<std::uint8_t> ties;

  Spans spans() {
    Spans s{.n = n, .param = remainder ? nullptr : param.data(), .grad = grad.data(), .grad_dtype = grad_dtype,
            .exp_avg = m.data(), .exp_avg_sq = v.data(), .moment_dtype = moment_dtype,
            .max_exp_avg_sq = vmax.data(), .param16 = (remainder || copy) ? p16.data() : nullptr};
    if (remainder) {
      s.master_format = MasterFormat::kRemainder;
      s.remainder = rem.data();
      s.tie_bits = ties.data();
    }
    return s;
  }

  // Elements [b, e) as a state of their own (tie bits repacked from bit 0).
  State slice(std::size_t b, std::size_t e) const {
    State t = *this;
    t.n = e - b;
    const std::size_t gb = elem_bytes(grad_dtype), mb = elem_bytes(moment_dtype);
    t.param.assign(param.begin() + static_cast<std::ptrdiff_t>(b), param.begin() + static_cast<std::ptrdiff_t>(e));
    t.vmax.assign(vmax.begin() + static_cast<std::ptrdiff_t>(b), vmax.begin() + static_cast<std::ptrdiff_t>(e));
    t.grad.assign(grad.begin() + static_cast<std::ptrdiff_t>(b * gb), grad.begin() + static_cast<std::ptrdiff_t>(e * gb));
    t.m.assign(m.begin() + static_cast<std::ptrdiff_t>(b * mb), m.begin() + static_cast<std::ptrdiff_t>(e * mb));
    t.v.assign(v.begin() + static_cast<std::ptrdiff_t>(b * mb), v.begin() + static_cast<std::ptrdiff_t>(e * mb));
    t.p16.assign(p16.begin() + static_cast<std::ptrdiff_t>(b), p16.begin() + static_cast<std::ptrdiff_t>(e));
    t.rem.assign(rem.begin() + static_cast<std::ptrdiff_t>(b), rem.begin() + static_cast<std::ptrdiff_t>(e));
    t.ties.assign((t.n + 7) / 8, 0);
    for (std::size_t i = b; i < e; ++i) {
      if ((ties[i / 8] >> (i % 8)) & 1U) t.ties[(i - b) / 8] |= static_cast<std::uint8_t>(1U << ((i - b) % 8));
    }
    return t;
  }

  // Writes a slice back at b.
  void put(std::size_t b, const State& t) {
    const std::size_t gb = elem_bytes(grad_dtype), mb = elem_bytes(moment_dtype);
    std::copy(t.param.begin(), t.param.end(), param.begin() + static_cast<std::ptrdiff_t>(b));
    std::copy(t.vmax.begin(), t.vmax.end(), vmax.begin() + static_cast<std::ptrdiff_t>(b));
    std::copy(t.m.begin(), t.m.end(), m.begin() + static_cast<std::ptrdiff_t>(b * mb));
    std::copy(t.v.begin(), t.v.end(), v.begin() + static_cast<std::ptrdiff_t>(b * mb));
    std::copy(t.p16.begin(), t.p16.end(), p16.begin() + static_cast<std::ptrdiff_t>(b));
    std::copy(t.rem.begin(), t.rem.end(), rem.begin() + static_cast<std::ptrdiff_t>(b));
    (void)gb;
    for (std::size_t i = 0; i < t.n; ++i) {
      const auto bit = static_cast<std::uint8_t>(1U << ((b + i) % 8));
      const bool set = ((t.ties[i / 8] >> (i % 8)) & 1U) != 0;
      ties[(b + i) / 8] = static_cast<std::uint8_t>(set ? ties[(b + i) / 8] | bit : ties[(b + i) / 8] & ~bit);
    }
  }
};

void put_value(std::vector<std::uint8_t>& bytes, DType dtype, std::size_t i, double x) {
  if (dtype == DType::kFp32) {
    const float f = static_cast<float>(x);
    std::memcpy(bytes.data() + 4 * i, &f, 4);
  } else {
    const std::uint16_t h = bf16_rne(static_cast<float>(x));
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  }
}

State random_state(std::size_t n, DType grad_dtype, DType moment_dtype, bool remainder, bool copy) {
  State s;
  s.n = n;
  s.grad_dtype = grad_dtype;
  s.moment_dtype = moment_dtype;
  s.remainder = remainder;
  s.copy = copy;
  s.param.resize(n);
  s.vmax.resize(n);
  s.grad.resize(n * elem_bytes(grad_dtype));
  s.m.resize(n * elem_bytes(moment_dtype));
  s.v.resize(n * elem_bytes(moment_dtype));
  s.p16.resize(n);
  s.rem.resize(n);
  s.ties.assign((n + 7) / 8, 0);
  for (std::size_t i = 0; i < n; ++i) {
    s.param[i] = static_cast<float>(log_uniform_signed(-3, 0.5));
    const double v = std::pow(10.0, uniform(-8, -2));
    s.vmax[i] = static_cast<float>(v * uniform(1, 2));
    put_value(s.grad, grad_dtype, i, log_uniform_signed(-4, -1));
    put_value(s.m, moment_dtype, i, log_uniform_signed(-5, -2));
    put_value(s.v, moment_dtype, i, v);
  }
  if (remainder) {
    EXPECT_TRUE(tz::cpu_adam::encode_remainder_masters(s.param.data(), n, s.p16.data(), s.rem.data(),
                                                       s.ties.data()).ok());
    std::fill(s.param.begin(), s.param.end(), 0.0f);
  }
  return s;
}

// Sorted disjoint segments with gaps (sometimes none) and odd, mid-tile bounds.
std::vector<WeightDecaySegment> random_segments(std::size_t n) {
  std::vector<std::size_t> cuts;
  const std::size_t k = 2 + static_cast<std::size_t>(uniform(0, 12));
  for (std::size_t i = 0; i < k; ++i) cuts.push_back(static_cast<std::size_t>(uniform(0, static_cast<double>(n))));
  cuts.push_back(0);
  cuts.push_back(n);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<WeightDecaySegment> segs;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (uniform(0, 1) < 0.3) continue;  // a gap: Hyper::weight_decay
    const double wd = uniform(0, 1) < 0.3 ? 0.0 : uniform(0.001, 0.2);
    segs.push_back({cuts[i], cuts[i + 1], wd});
  }
  return segs;
}

std::string first_difference(const State& a, const State& b) {
  const auto differ = [](const auto& x, const auto& y) {
    return x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) != 0;
  };
  const auto where = [](const auto& x, const auto& y) {
    std::size_t i = 0;
    while (i < x.size() && std::memcmp(&x[i], &y[i], sizeof(x[0])) == 0) ++i;
    return std::to_string(i);
  };
  if (differ(a.param, b.param)) return "param at element " + where(a.param, b.param);
  if (differ(a.m, b.m)) return "exp_avg at byte " + where(a.m, b.m);
  if (differ(a.v, b.v)) return "exp_avg_sq at byte " + where(a.v, b.v);
  if (differ(a.vmax, b.vmax)) return "max_exp_avg_sq at element " + where(a.vmax, b.vmax);
  if (differ(a.p16, b.p16)) return "param16 at element " + where(a.p16, b.p16);
  if (differ(a.rem, b.rem)) return "remainder at element " + where(a.rem, b.rem);
  if (differ(a.ties, b.ties)) return "tie_bits at byte " + where(a.ties, b.ties);
  return {};
}

TEST(CpuAdamSegments, OneStepWithSegmentsIsOneStepPerRunBitForBit) {
  std::size_t cases = 0;
  for (Simd simd : runnable_variants()) {
    const auto reference = make_optimizer(simd, 1);
    for (const ThreadsAndTile tt : {ThreadsAndTile{1, 0}, ThreadsAndTile{2, 64}, ThreadsAndTile{2, 1024}}) {
      const auto opt = make_optimizer(simd, tt.threads, tt.tile);
      for (const AlgorithmConfig& c : kEveryElementLoop) {
        for (const bool remainder : {false, true}) {
          for (const DType moments : {DType::kFp32, DType::kBf16}) {
            const std::size_t n = 200 + static_cast<std::size_t>(uniform(0, 4000));
            const DType grads = uniform(0, 1) < 0.5 ? DType::kFp32 : DType::kBf16;
            const bool copy = !remainder && uniform(0, 1) < 0.5;
            Hyper hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
            const std::vector<WeightDecaySegment> segs = random_segments(n);
            const State start = random_state(n, grads, moments, remainder, copy);
            const StepArgs args{.step = 3, .grad_scale = 0.5};

            State whole = start;
            Spans s = whole.spans();
            s.weight_decay_segments = segs;
            ASSERT_TRUE(opt->step(hyper, args, s).ok());

            State runs = start;
            std::size_t at = 0;
            const auto step_run = [&](std::size_t b, std::size_t e, double wd) {
              State part = runs.slice(b, e);
              Hyper h = hyper;
              h.weight_decay = wd;
              Spans ps = part.spans();
              ps.rounding_index = b;  // the slice's place in the whole (stochastically rounded bf16 second moments)
              ASSERT_TRUE(reference->step(h, args, ps).ok());
              runs.put(b, part);
            };
            for (const WeightDecaySegment& g : segs) {
              if (at < g.begin) step_run(at, g.begin, hyper.weight_decay);
              step_run(g.begin, g.end, g.weight_decay);
              at = g.end;
            }
            if (at < n) step_run(at, n, hyper.weight_decay);
            const std::string diff = first_difference(whole, runs);
            EXPECT_EQ(diff, "") << simd_name(simd) << " " << tt.threads << " threads, tile " << tt.tile << ", "
                                << algorithm_name(c.algorithm) << (c.amsgrad ? " amsgrad" : "") << " wd "
                                << c.weight_decay << (remainder ? " remainder" : " fp32") << " master, "
                                << tz::dtype_name(moments) << " moments, n " << n << ", " << segs.size()
                                << " segments:" << [&] {
                                     std::string t;
                                     for (const auto& g : segs) t += fmt::format(" [{}, {}) {}", g.begin, g.end, g.weight_decay);
                                     return t;
                                   }();
            ++cases;
          }
        }
      }
    }
  }
  std::printf("[ cpu_adam ] weight-decay segments: %zu cases bit-identical to per-run steps\n", cases);
}

TEST(CpuAdamSegments, SegmentsChangeTheStep) {
  // A control: a segment with another weight decay moves its elements
  // differently, and only them.
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 64);
  const State start = random_state(1000, DType::kFp32, DType::kFp32, false, false);
  const Hyper hyper = random_hyper(Algorithm::kAdamW, false, 0.1);
  State plain = start, seg = start;
  ASSERT_TRUE(opt->step(hyper, {.step = 1}, plain.spans()).ok());
  const WeightDecaySegment segs[] = {{301, 517, 0.0}};
  Spans s = seg.spans();
  s.weight_decay_segments = segs;
  ASSERT_TRUE(opt->step(hyper, {.step = 1}, s).ok());
  for (std::size_t i = 0; i < 1000; ++i) {
    const bool inside = i >= 301 && i < 517;
    EXPECT_EQ(plain.param[i] != seg.param[i], inside) << "element " << i;
  }
}

TEST(CpuAdamSegments, BadTablesAreRefusedByIndexAndValueBeforeAnyWrite) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 1);
  const struct {
    std::vector<WeightDecaySegment> segs;
    const char* expect;
  } cases[] = {
      {{{10, 20, 0.1}, {5, 8, 0.0}}, "weight_decay_segments[1] = [5, 8) (weight_decay = 0) overlaps or precedes "
                                     "weight_decay_segments[0] = [10, 20) (weight_decay = 0.1)"},
      {{{10, 20, 0.1}, {19, 30, 0.0}}, "weight_decay_segments[1] = [19, 30)"},
      {{{0, 101, 0.1}}, "weight_decay_segments[0] = [0, 101) (weight_decay = 0.1) is out of range: must have begin < "
                        "end <= n = 100"},
      {{{7, 7, 0.1}}, "weight_decay_segments[0] = [7, 7)"},
      {{{0, 10, 0.0}, {10, 20, -0.5}}, "weight_decay_segments[1] = [10, 20) has weight_decay = -0.5: must be finite "
                                       "and >= 0"},
      {{{0, 10, std::nan("")}}, "weight_decay_segments[0] = [0, 10) has weight_decay = nan"},
      {{{0, 10, 1e300}}, "weight_decay_segments[0] = [0, 10) with weight_decay = 1e+300"},
  };
  for (const auto& c : cases) {
    State st = random_state(100, DType::kFp32, DType::kFp32, false, false);
    const State before = st;
    Spans s = st.spans();
    s.weight_decay_segments = c.segs;
    const tz::Status status = opt->step(random_hyper(Algorithm::kAdamW, false, 0.1), {.step = 1}, s);
    ASSERT_FALSE(status.ok()) << c.expect;
    EXPECT_EQ(status.code(), tz::ErrorCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.expect), std::string::npos) << status.message();
    EXPECT_EQ(first_difference(st, before), "") << "written despite " << status.message();
  }
  // With n == 0 every segment is past n.
  const WeightDecaySegment one[] = {{0, 1, 0.0}};
  Spans empty;
  empty.weight_decay_segments = one;
  EXPECT_FALSE(opt->step(Hyper{}, StepArgs{}, empty).ok());
}

// A run may start at any element, so an element's lane in its vector (or in a
// padded part-vector) changes with the segment table: its arithmetic must not.
// Every loop on every variant: one element alone (a part-vector) and the same
// element copied into 37 (whole vectors and a tail) give the same bits.
TEST(CpuAdamSegments, AnElementsBitsDoNotDependOnItsLane) {
  for (Simd simd : runnable_variants()) {
    const auto opt = make_optimizer(simd, 1);
    for (const AlgorithmConfig& c : kEveryElementLoop) {
      for (const DType moments : {DType::kFp32, DType::kBf16}) {
        std::size_t bad = 0;
        for (int trial = 0; trial < 200; ++trial) {
          State one = random_state(1, DType::kFp32, moments, false, true);
          State many = random_state(37, DType::kFp32, moments, false, true);
          const std::size_t mb = elem_bytes(moments);
          for (std::size_t i = 0; i < many.n; ++i) {
            many.param[i] = one.param[0];
            many.vmax[i] = one.vmax[0];
            std::memcpy(many.grad.data() + 4 * i, one.grad.data(), 4);
            std::memcpy(many.m.data() + mb * i, one.m.data(), mb);
            std::memcpy(many.v.data() + mb * i, one.v.data(), mb);
          }
          const Hyper hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
          ASSERT_TRUE(opt->step(hyper, {.step = 3, .grad_scale = 0.5}, many.spans()).ok());
          const State fresh = one;
          for (std::size_t i = 0; i < many.n; ++i) {
            // The element alone, as element i of its tensor: bf16 second moments
            // are rounded stochastically by index (Note [Stochastic rounding of
            // bf16 second moments]), so lane i's twin is stepped as index i.
            one = fresh;
            Spans alone = one.spans();
            alone.rounding_index = i;
            ASSERT_TRUE(opt->step(hyper, {.step = 3, .grad_scale = 0.5}, alone).ok());
            const bool same = bits_of(many.param[i]) == bits_of(one.param[0]) && many.p16[i] == one.p16[0] &&
                              std::memcmp(many.m.data() + mb * i, one.m.data(), mb) == 0 &&
                              std::memcmp(many.v.data() + mb * i, one.v.data(), mb) == 0 &&
                              bits_of(many.vmax[i]) == bits_of(one.vmax[0]);
            if (!same && bad++ == 0) {
              ADD_FAILURE() << simd_name(simd) << " " << algorithm_name(c.algorithm) << (c.amsgrad ? " amsgrad" : "")
                            << " wd " << c.weight_decay << ", " << tz::dtype_name(moments) << " moments: lane " << i
                            << " param " << many.param[i] << ", alone " << one.param[0];
            }
          }
        }
        EXPECT_EQ(bad, 0U);
      }
    }
  }
}

}  // namespace
}  // namespace tzt
