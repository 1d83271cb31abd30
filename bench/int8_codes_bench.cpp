// tierzero-int8-codes-bench: the int8 moment codes alone (Note [Int8 moments],
// Note [Int8 codes in registers]): ns per element to encode and to decode
// blocks of 256 held in L1/L2, per instruction-set variant, without Adam or
// memory traffic. With the fp32 step's own compute time this bounds the fused
// int8 step from below (bench/RESULTS.md "The fused int8 kernel, made fast").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "../cpu_adam/src/dispatch.h"

namespace {

namespace ca = tz::cpu_adam;
using ca::detail::Int8Code;
constexpr std::size_t kB = ca::detail::kInt8Block;

struct Timing {
  double encode_ns = 1e300, decode_ns = 1e300;  // best over the repeats, per element
};

// Encodes then decodes x block by block, `repeats` times; keeps the fastest pass of each.
Timing time_codes(const ca::detail::KernelTable& table, const Int8Code& code, const std::vector<float>& x,
                  int repeats) {
  const std::size_t n = x.size();
  std::vector<std::uint8_t> codes(n);
  std::vector<float> scales((n + kB - 1) / kB), out(n);
  Timing t;
  using Clock = std::chrono::steady_clock;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    for (std::size_t b = 0; b < n; b += kB) scales[b / kB] = table.int8_encode(code, x.data() + b, codes.data() + b, std::min(kB, n - b));
    const auto t1 = Clock::now();
    for (std::size_t b = 0; b < n; b += kB) table.int8_decode(code, codes.data() + b, scales[b / kB], out.data() + b, std::min(kB, n - b));
    const auto t2 = Clock::now();
    t.encode_ns = std::min(t.encode_ns, std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
    t.decode_ns = std::min(t.decode_ns, std::chrono::duration<double, std::nano>(t2 - t1).count() / n);
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-int8-codes-bench: int8 moment encode/decode alone, per SIMD variant, cache-resident"};
  std::size_t elems = 16384;
  int repeats = 50;
  std::string simd_list = "all";
  app.add_option("--elems", elems, "elements per pass (cache-resident: 16384 is 64 KiB of fp32)");
  app.add_option("--repeats", repeats, "passes; the fastest is reported")->check(CLI::Range(1, 100000));
  app.add_option("--simd", simd_list, "all, or a comma list of scalar, sse4.2, avx2, avx512");
  CLI11_PARSE(app, argc, argv);

  std::vector<ca::Simd> variants;
  for (ca::Simd s : ca::compiled_variants()) {
    if (!ca::cpu_supports(s)) continue;
    if (simd_list == "all" || ("," + simd_list + ",").find("," + std::string(ca::simd_name(s)) + ",") != std::string::npos) {
      variants.push_back(s);
    }
  }
  // The adam bench's moments (tzbench map_layout): m in [-1e-4, 1e-4), v in [1e-8, 1e-6 + 1e-8).
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0, 1);
  std::vector<float> m(elems), v(elems);
  for (std::size_t i = 0; i < elems; ++i) {
    m[i] = (2 * u(rng) - 1) * 1e-4f;
    v[i] = u(rng) * 1e-6f + 1e-8f;
  }
  std::printf("%-8s %12s %12s %12s %12s %14s\n", "simd", "enc m ns/el", "dec m ns/el", "enc v ns/el", "dec v ns/el",
              "all four ns/el");
  for (ca::Simd s : variants) {
    const ca::detail::KernelTable& table = ca::detail::kernel_table(s);
    const Timing tm = time_codes(table, ca::detail::int8_code_exp_avg(), m, repeats);
    const Timing tv = time_codes(table, ca::detail::int8_code_exp_avg_sq(), v, repeats);
    std::printf("%-8s %12.3f %12.3f %12.3f %12.3f %14.3f\n", std::string(ca::simd_name(s)).c_str(), tm.encode_ns,
                tm.decode_ns, tv.encode_ns, tv.decode_ns, tm.encode_ns + tm.decode_ns + tv.encode_ns + tv.decode_ns);
  }
  return 0;
}
