// checksum(): XXH3-64 by the widest build this CPU runs, picked once and
// logged. The builds are xxh3_<isa>.cpp (xxh3_variants.h); the choice uses the
// process's one CPU probe (tz::capabilities), whose flags also say whether the
// OS saves the vector registers.
#include "tierzero/nvme/io_engine.h"
#include "xxh3_variants.h"

namespace tz::nvme {
namespace {

using Hash = std::uint64_t (*)(const void*, std::size_t);

struct Variant {
  std::string_view name;
  Hash hash;
};

// Narrowest first.
std::vector<Variant> runnable_variants() {
  std::vector<Variant> out{{"scalar", detail::xxh3_64_scalar}};
#if defined(TZ_NVME_X86)
  const CpuCapabilities& cpu = capabilities().cpu;
  out.push_back({"sse2", detail::xxh3_64_sse2});
  if (cpu.avx2) out.push_back({"avx2", detail::xxh3_64_avx2});
  if (cpu.avx512f) out.push_back({"avx512", detail::xxh3_64_avx512});
#endif
  return out;
}

std::string joined_names(const std::vector<Variant>& variants) {
  std::string out;
  for (const Variant& v : variants) out += (out.empty() ? "" : ", ") + std::string(v.name);
  return out;
}

const Variant& chosen() {
  static const Variant variant = [] {
    const std::vector<Variant> all = runnable_variants();
    TZ_LOG_INFO("nvme", "checksums: XXH3-64, {} build (this CPU runs: {})", all.back().name, joined_names(all));
    return all.back();
  }();
  return variant;
}

}  // namespace

std::uint64_t checksum(const void* data, std::size_t bytes) {
  static const Hash hash = chosen().hash;
  return hash(data, bytes);
}

std::string_view checksum_variant() { return chosen().name; }

std::vector<std::string_view> checksum_variants() {
  std::vector<std::string_view> out;
  for (const Variant& v : runnable_variants()) out.push_back(v.name);
  return out;
}

Expected<std::uint64_t> checksum_with(std::string_view variant, const void* data, std::size_t bytes) {
  const std::vector<Variant> all = runnable_variants();
  for (const Variant& v : all) {
    if (v.name == variant) return v.hash(data, bytes);
  }
  return invalid_argument("checksum variant \"{}\" is not compiled in or not runnable on this CPU (runnable: {})",
                          variant, joined_names(all));
}

}  // namespace tz::nvme
