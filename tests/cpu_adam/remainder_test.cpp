// The remainder master format (Note [Remainder masters] in cpu_adam/src/
// remainder.h): the count of masters behind each bf16 value, the conversions
// bit for bit, and the kernels' step bit-identical to the fp32 master's on
// every algorithm, dtype, variant, thread count, tile, length and offset.
// Any differing bit fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "reference.h"

namespace tzt {
namespace {

using tz::cpu_adam::decode_remainder_masters;
using tz::cpu_adam::encode_remainder_masters;
using tz::cpu_adam::MasterFormat;
using tz::cpu_adam::simd_name;

// The format straight from its definition, with the test's own bf16 rounding.
struct Split {
  std::uint16_t h;
  std::int16_t r;
  bool tie;
};

Split split_ref(std::uint32_t bits) {
  const std::uint16_t h = bf16_rne(float_of(bits));
  if (std::isnan(float_of(bits))) return {h, 0, false};
  const std::uint32_t d = bits - (static_cast<std::uint32_t>(h) << 16);
  return {h, static_cast<std::int16_t>(d & 0xffffU), d == 0x8000U};
}

std::uint32_t join_ref(std::uint16_t h, std::int16_t r, bool tie) {
  return (static_cast<std::uint32_t>(h) << 16) + static_cast<std::uint32_t>(static_cast<std::int32_t>(r)) +
         (tie ? 0x10000U : 0U);
}

bool tie_bit(const Buffer& ties, std::size_t i) {
  return ((static_cast<const std::uint8_t*>(ties.data())[i / 8] >> (i % 8)) & 1U) != 0;
}

// A master format's arrays beside an fp32 master array of the same length.
struct RemainderArrays {
  RemainderArrays(std::size_t n, bool unaligned)
      : bf16(DType::kBf16, n, unaligned), remainder(DType::kBf16, n, unaligned),
        ties(DType::kUint8, (n + 7) / 8, unaligned) {}
  std::uint16_t* h() { return static_cast<std::uint16_t*>(bf16.data()); }
  std::int16_t* r() { return static_cast<std::int16_t*>(remainder.data()); }
  std::uint8_t* t() { return static_cast<std::uint8_t*>(ties.data()); }
  std::int16_t r_at(std::size_t i) const { return static_cast<std::int16_t>(remainder.bits16(i)); }
  std::uint32_t joined(std::size_t i) const { return join_ref(bf16.bits16(i), r_at(i), tie_bit(ties, i)); }

  Buffer bf16, remainder, ties;
};

// Every fp32 pattern within two bf16 steps of h << 16 that rounds to h.
std::vector<std::uint32_t> masters_of(std::uint16_t h) {
  std::vector<std::uint32_t> out;
  const std::uint32_t centre = static_cast<std::uint32_t>(h) << 16;
  for (std::uint32_t k = 0; k <= 0x20000U; ++k) {
    const std::uint32_t bits = centre - 0x10000U + k;  // wraps around zero like the format
    if (!std::isnan(float_of(bits)) && bf16_rne(float_of(bits)) == h) out.push_back(bits);
  }
  return out;
}

// What a round trip through the conversions saw.
struct RoundTrip {
  std::size_t ties = 0, nans = 0;
};

// Encodes the first n masters and decodes them back (odd offsets), checking
// every element against the definition: every bit, but a NaN's payload
// (a NaN comes back as its bf16 NaN widened); the bits past n in the last
// tie byte stay as they were.
void check_round_trip(const std::vector<std::uint32_t>& masters, std::size_t n, RoundTrip* seen) {
  RemainderArrays a(n, true);
  Buffer fp32(DType::kFp32, n, false), back(DType::kFp32, n, true);
  for (std::size_t i = 0; i < n; ++i) std::memcpy(fp32.f32() + i, &masters[i], 4);
  a.t()[(n - 1) / 8] = 0xff;
  ASSERT_TRUE(encode_remainder_masters(fp32.f32(), n, a.h(), a.r(), a.t()).ok());
  ASSERT_TRUE(decode_remainder_masters(a.h(), a.r(), a.t(), n, back.f32()).ok());
  if (n % 8 != 0) {
    EXPECT_EQ(a.t()[(n - 1) / 8] >> (n % 8), 0xff >> (n % 8)) << "bits past n";
  }
  for (std::size_t i = 0; i < n; ++i) {
    const Split want = split_ref(masters[i]);
    ASSERT_EQ(a.bf16.bits16(i), want.h) << std::hex << masters[i];
    ASSERT_EQ(a.r_at(i), want.r) << std::hex << masters[i];
    ASSERT_EQ(tie_bit(a.ties, i), want.tie) << std::hex << masters[i];
    const bool nan = std::isnan(float_of(masters[i]));
    const std::uint32_t rebuilt = nan ? static_cast<std::uint32_t>(want.h) << 16 : masters[i];
    ASSERT_EQ(a.joined(i), rebuilt) << std::hex << masters[i];
    ASSERT_EQ(bits_of(back.get_f32(i)), rebuilt) << std::hex << masters[i];
    seen->ties += want.tie ? 1 : 0;
    seen->nans += nan ? 1 : 0;
  }
}

TEST(CpuAdamRemainder, AnEvenBf16HasTwoMoreMastersThanAnOddOneAndEveryOneRoundTrips) {
  const struct {
    std::uint16_t h;
    std::size_t masters;
  } cases[] = {
      {0x3f80, 65537}, {0x3f81, 65535},  // 1.0 and the next bf16
      {0xc2f6, 65537}, {0xc2f7, 65535},  // negatives
      {0x0002, 65537}, {0x0001, 65535},  // subnormals
      {0x7f7e, 65537}, {0x7f7f, 65535},  // the largest finite: its upper masters round to inf
      {0x0000, 32769}, {0x8000, 32769},  // +-0: beyond them lie the other sign's
      {0x7f80, 32769}, {0xff80, 32769},  // +-inf: finite masters below, NaNs above
  };
  for (const auto& c : cases) {
    const std::vector<std::uint32_t> masters = masters_of(c.h);
    ASSERT_EQ(masters.size(), c.masters) << std::hex << c.h;
    if (c.masters != 32769) {  // the whole window: (h << 16) -+ 0x8000 (even) or 0x7fff (odd)
      const std::uint32_t half = c.h % 2 == 0 ? 0x8000U : 0x7fffU, centre = static_cast<std::uint32_t>(c.h) << 16;
      EXPECT_EQ(masters.front(), centre - half) << std::hex << c.h;
      EXPECT_EQ(masters.back(), centre + half) << std::hex << c.h;
    }
    RoundTrip seen;
    ASSERT_NO_FATAL_FAILURE(check_round_trip(masters, masters.size(), &seen)) << std::hex << c.h;
    // Only the tie above an even h needs the bit (at +-inf it is a NaN).
    EXPECT_EQ(seen.ties, c.h % 2 == 0 && (c.h & 0x7fff) != 0x7f80 ? 1U : 0U) << std::hex << c.h;
  }
}

// Special values and random patterns of every kind.
std::vector<std::uint32_t> interesting_masters() {
  std::vector<std::uint32_t> out = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000,  // zeros, infinities
      0x7fc00000, 0xffc00000, 0x7fc12345, 0x7f812345,  // NaNs (quiet, signalling, payloads)
      0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0xff7f8000,  // finite masters that round to inf
      0x7f7f7fff, 0x00000001, 0x807fffff, 0x00008000,  // just below; subnormals and a tie among them
      0x3f808000, 0x3f818000, 0xbf808000, 0x3f807fff,  // ties above an even and below an odd h
  };
  for (int i = 0; i < 30000; ++i) {
    const auto r = static_cast<std::uint32_t>(rng()());
    out.push_back(r);
    out.push_back((r & 0xffff0000U) | 0x8000U);  // a tie
    out.push_back(r & 0x807fffffU);              // a subnormal
  }
  return out;
}

TEST(CpuAdamRemainder, ConversionsRoundTripEveryPatternButNanPayloads) {
  const std::vector<std::uint32_t> masters = interesting_masters();
  RoundTrip seen;
  check_round_trip(masters, masters.size() - 3, &seen);  // not a whole number of tie bytes
  EXPECT_GT(seen.nans, 0U);
  EXPECT_GT(seen.ties, 0U);
}

// One problem stepped in both formats: `fp32` with its bf16 copy-out, `rem`
// (the same state, its master split into `arrays`) in the remainder format.
struct FormatPair {
  FormatPair(const StepSetup& setup_in, const StepProblem& start)
      : setup(setup_in), fp32(start), rem(start), arrays(setup.n, setup.unaligned) {
    EXPECT_TRUE(encode_remainder_masters(fp32.param.f32(), setup.n, arrays.h(), arrays.r(), arrays.t()).ok());
  }
  explicit FormatPair(const StepSetup& setup_in) : FormatPair(setup_in, StepProblem(setup_in)) {}

  // Both formats take step `step`, on fresh gradients unless told otherwise.
  tz::Status step(tz::cpu_adam::CpuOptimizer& opt, std::int64_t step, bool fresh_grads = true) {
    if (fresh_grads) {
      fp32.fresh_grads();
      rem.grad = fp32.grad;
    }
    const StepArgs args{.step = step, .grad_scale = setup.grad_scale};
    TZ_TRY(opt.step(setup.hyper, args, fp32.spans()));
    Spans s = rem.spans();
    s.param = nullptr;
    s.param16 = arrays.h();
    s.master_format = MasterFormat::kRemainder;
    s.remainder = arrays.r();
    s.tie_bits = arrays.t();
    return opt.step(setup.hyper, args, s);
  }

  // Empty when every bit agrees: the rebuilt master is the fp32 master (NaN:
  // a NaN with remainder 0, no tie), the bf16 parameters are the copy-out, and
  // the moments are the same.
  std::string first_difference() const {
    for (std::size_t i = 0; i < setup.n; ++i) {
      const float master = fp32.param.get_f32(i);
      const std::uint32_t rebuilt = arrays.joined(i);
      const bool same = std::isnan(master)
                            ? std::isnan(float_of(rebuilt)) && arrays.r_at(i) == 0 && !tie_bit(arrays.ties, i)
                            : rebuilt == bits_of(master);
      if (!same || arrays.bf16.bits16(i) != fp32.param16.bits16(i)) {
        return fmt::format("element {}: fp32 master {:08x} and copy {:04x}, remainder format {:04x} {:04x} tie {} "
                           "rebuilt {:08x}", i, bits_of(master), fp32.param16.bits16(i), arrays.bf16.bits16(i),
                           arrays.remainder.bits16(i), tie_bit(arrays.ties, i), rebuilt);
      }
    }
    if (fp32.exp_avg.snapshot() != rem.exp_avg.snapshot()) return "exp_avg differs";
    if (fp32.exp_avg_sq.snapshot() != rem.exp_avg_sq.snapshot()) return "exp_avg_sq differs";
    if (fp32.max_exp_avg_sq.snapshot() != rem.max_exp_avg_sq.snapshot()) return "max_exp_avg_sq differs";
    return {};
  }

  std::size_t ties() const {
    std::size_t count = 0;
    for (std::size_t i = 0; i < setup.n; ++i) count += tie_bit(arrays.ties, i) ? 1 : 0;
    return count;
  }

  StepSetup setup;
  StepProblem fp32, rem;
  RemainderArrays arrays;
};

// Odd lengths, a vector of each width and its neighbours, several tiles.
constexpr std::size_t kLengths[] = {1, 3, 7, 8, 9, 15, 17, 33, 63, 65, 1001, 4093};

TEST(CpuAdamRemainder, TwentyStepsAreBitIdenticalToTheFp32MasterEverywhere) {
  constexpr int kSteps = 20;
  for (Simd simd : runnable_variants()) {
    std::unique_ptr<tz::cpu_adam::CpuOptimizer> opts[] = {make_optimizer(simd, 1), make_optimizer(simd, 2, 16),
                                                          make_optimizer(simd, 3, 48), make_optimizer(simd, 4, 256)};
    std::size_t runs = 0, failed = 0;
    for (const AlgorithmConfig& c : kEveryElementLoop) {
      for (DType grad : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (DType moment : {DType::kFp32, DType::kBf16}) {
          for (std::size_t n : kLengths) {
            StepSetup setup;
            setup.hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
            setup.grad_dtype = grad;
            setup.moment_dtype = moment;
            setup.copy = DType::kBf16;
            setup.n = n;
            setup.unaligned = runs % 2 == 1;
            setup.grad_scale = uniform(0.25, 2.0);
            const int threads = static_cast<int>(runs % 4) + 1;
            FormatPair pair(setup);
            std::string diff;
            for (int k = 1; k <= kSteps && diff.empty(); ++k) {
              const tz::Status status = pair.step(*opts[threads - 1], k);
              diff = status.ok() ? pair.first_difference() : status.to_string();
              if (!diff.empty()) diff = fmt::format("step {}: {}", k, diff);
            }
            ++runs;
            if (!diff.empty() && ++failed <= 10) {
              ADD_FAILURE() << simd_name(simd) << ", " << threads << " threads, " << describe(setup) << ": " << diff;
            }
          }
        }
      }
    }
    std::printf("[ cpu_adam ] remainder vs fp32 master, %-7s %zu runs of %d steps: %zu differ\n",
                std::string(simd_name(simd)).c_str(), runs, kSteps, failed);
  }
}

// A step that leaves every master as it is (zero gradients and moments, no
// weight decay) runs the kernels' split and join alone: on every master of an
// even and an odd bf16 and on the special patterns, the kernels keep the
// bits (NaN: the widened bf16 NaN) and agree with the fp32 format.
TEST(CpuAdamRemainder, KernelsSplitAndJoinEveryMasterLikeTheConversions) {
  std::vector<std::uint32_t> masters = masters_of(0x3f80);
  for (std::uint16_t h : {0x3f81, 0x7f7f, 0x7f80, 0x0000}) {
    const std::vector<std::uint32_t> more = masters_of(h);
    masters.insert(masters.end(), more.begin(), more.end());
  }
  const std::vector<std::uint32_t> special = interesting_masters();
  masters.insert(masters.end(), special.begin(), special.begin() + 2000);
  for (Simd simd : runnable_variants()) {
    StepSetup setup;
    setup.hyper = random_hyper(Algorithm::kAdamW, false, 0.0);
    setup.copy = DType::kBf16;
    setup.n = masters.size();
    setup.unaligned = true;
    StepProblem zero(setup);
    for (std::size_t i = 0; i < setup.n; ++i) {
      std::memcpy(zero.param.f32() + i, &masters[i], 4);
      zero.exp_avg.set(i, 0);
      zero.exp_avg_sq.set(i, 0);
      zero.grad.set(i, 0);
    }
    FormatPair pair(setup, zero);
    ASSERT_TRUE(pair.step(*make_optimizer(simd, 2, 1024), 3, /*fresh_grads=*/false).ok());
    EXPECT_EQ(pair.first_difference(), "") << simd_name(simd);
    for (std::size_t i = 0; i < setup.n; ++i) {
      if (std::isnan(float_of(masters[i]))) continue;
      ASSERT_EQ(pair.arrays.joined(i), masters[i]) << simd_name(simd) << " " << std::hex << masters[i];
    }
    EXPECT_GE(pair.ties(), 3U) << simd_name(simd);
  }
}

// Lion moves each master by exactly lr (no decay), so masters placed lr away
// from a tie land on it: ties above an even h (tie bit) and below one (none).
TEST(CpuAdamRemainder, MastersThatLandOnTiesStepLikeTheFp32Master) {
  constexpr std::size_t kN = 4099;
  for (Simd simd : runnable_variants()) {
    StepSetup setup;
    setup.hyper = random_hyper(Algorithm::kLion, false, 0.0);
    setup.hyper.lr = 0x1p-12;
    setup.copy = DType::kBf16;
    setup.n = kN;
    setup.unaligned = true;
    StepProblem start(setup);
    std::size_t upper = 0;
    for (std::size_t i = 0; i < kN; ++i) {
      // An even h in [1, 2) (bf16 step 2^-7) and the tie above (+0x8000) or below it.
      const std::uint32_t h = 0x3f80U + 2 * static_cast<std::uint32_t>(uniform(0, 63));
      const bool above = i % 2 == 0;
      upper += above ? 1 : 0;
      const float tie = float_of((h << 16) + (above ? 0x8000U : static_cast<std::uint32_t>(-0x8000)));
      const double g = uniform(0, 1) < 0.5 ? -1e-3 : 1e-3;
      start.exp_avg.set(i, 0);
      start.grad.set(i, g);
      start.param.set(i, tie + (g > 0 ? 0x1p-12f : -0x1p-12f));  // exact: tie +- lr
    }
    FormatPair pair(setup, start);
    const auto opt = make_optimizer(simd, 3, 64);
    ASSERT_TRUE(pair.step(*opt, 1, /*fresh_grads=*/false).ok());
    EXPECT_EQ(pair.first_difference(), "") << simd_name(simd);
    EXPECT_EQ(pair.ties(), upper) << simd_name(simd) << ": every master should have landed on its tie";
    for (int k = 2; k <= 5; ++k) ASSERT_TRUE(pair.step(*opt, k).ok());
    EXPECT_EQ(pair.first_difference(), "") << simd_name(simd) << " after 5 steps";
  }
}

// Every element gets the same arithmetic wherever its tile starts and
// whichever thread runs it, tie-bit bytes included.
TEST(CpuAdamRemainder, ResultsDoNotDependOnThreadsOrTiles) {
  for (Simd simd : runnable_variants()) {
    StepSetup setup;
    setup.hyper = random_hyper(Algorithm::kAdam, true, 0.01);
    setup.grad_dtype = DType::kBf16;
    setup.moment_dtype = DType::kBf16;
    setup.copy = DType::kBf16;
    setup.n = 100'003;
    setup.unaligned = true;
    FormatPair original(setup);
    original.fp32.fresh_grads();
    original.rem.grad = original.fp32.grad;
    std::vector<std::vector<std::uint8_t>> first;
    for (const ThreadsAndTile& c : kThreadsAndTiles) {
      FormatPair p = original;
      ASSERT_TRUE(p.step(*make_optimizer(simd, c.threads, c.tile), 7, /*fresh_grads=*/false).ok());
      const std::vector<std::vector<std::uint8_t>> out = {p.arrays.bf16.snapshot(), p.arrays.remainder.snapshot(),
                                                          p.arrays.ties.snapshot(), p.rem.exp_avg.snapshot(),
                                                          p.rem.exp_avg_sq.snapshot(), p.rem.max_exp_avg_sq.snapshot()};
      EXPECT_EQ(p.first_difference(), "") << simd_name(simd) << ": " << c.threads << " threads, tile " << c.tile;
      if (first.empty()) {
        first = out;
      } else {
        EXPECT_TRUE(out == first) << simd_name(simd) << ": " << c.threads << " threads, tile " << c.tile;
      }
    }
  }
}

TEST(CpuAdamRemainder, ConversionsRefuseBadArraysByName) {
  constexpr std::size_t kN = 100;
  // bf16, remainder and the 13 bytes of tie bits packed end to end.
  Buffer packed(DType::kUint8, 4 * kN + 13, false), fp32(DType::kFp32, kN, false);
  auto* h = static_cast<std::uint16_t*>(packed.data());
  auto* r = reinterpret_cast<std::int16_t*>(h + kN);
  auto* t = reinterpret_cast<std::uint8_t*>(r + kN);
  const struct {
    const char* what;
    const float* master;
    std::uint16_t* h;
    std::int16_t* r;
    std::uint8_t* t;
    std::string expect;
  } cases[] = {
      {"null master", nullptr, h, r, t, "master is null (n = 100)"},
      {"null bf16", fp32.f32(), nullptr, r, t, "bf16 is null (n = 100)"},
      {"null remainder", fp32.f32(), h, nullptr, t, "remainder is null (n = 100)"},
      {"null tie bits", fp32.f32(), h, r, nullptr, "tie_bits is null (n = 13)"},
      {"remainder inside bf16", fp32.f32(), h, reinterpret_cast<std::int16_t*>(h + 99), t,
       "bf16 and remainder overlap"},
      {"tie bits from the remainder's last byte", fp32.f32(), h, r, t - 1, "remainder and tie_bits overlap"},
      {"misaligned bf16", fp32.f32(), reinterpret_cast<std::uint16_t*>(reinterpret_cast<char*>(h) + 1), r, t,
       "is not aligned to its 2-byte elements"},
  };
  for (const auto& c : cases) {
    const tz::Status encoded = encode_remainder_masters(c.master, kN, c.h, c.r, c.t);
    ASSERT_FALSE(encoded.ok()) << c.what;
    EXPECT_EQ(encoded.code(), tz::ErrorCode::kInvalidArgument) << c.what;
    EXPECT_NE(encoded.message().find(c.expect), std::string::npos) << c.what << ": " << encoded.message();
    EXPECT_NE(encoded.message().find("encode_remainder_masters"), std::string::npos) << encoded.message();
    const tz::Status decoded = decode_remainder_masters(c.h, c.r, c.t, kN, const_cast<float*>(c.master));
    ASSERT_FALSE(decoded.ok()) << c.what;
    EXPECT_NE(decoded.message().find(c.expect), std::string::npos) << c.what << ": " << decoded.message();
  }
  // The tie bits are ceil(n / 8) bytes: packed end to end, nothing overlaps.
  EXPECT_TRUE(encode_remainder_masters(fp32.f32(), kN, h, r, t).ok());
  EXPECT_TRUE(decode_remainder_masters(h, r, t, kN, fp32.f32()).ok());
  EXPECT_TRUE(encode_remainder_masters(nullptr, 0, nullptr, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace tzt
