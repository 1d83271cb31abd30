#include "tierzero/common/state_format.h"

namespace tz {
namespace {

std::uint64_t ceil_div(std::uint64_t n, std::uint64_t d) { return n / d + (n % d != 0 ? 1 : 0); }

constexpr std::uint64_t kTieBitsPerByte = 8;  // Note [Master remainder]

}  // namespace

std::string_view master_format_name(MasterFormat format) {
  switch (format) {
    case MasterFormat::kFp32: return "fp32";
    case MasterFormat::kRemainder: return "remainder";
  }
  return "?";
}

std::string_view moment_format_name(MomentFormat format) {
  switch (format) {
    case MomentFormat::kFp32: return "fp32";
    case MomentFormat::kBf16: return "bf16";
    case MomentFormat::kInt8: return "int8";
  }
  return "?";
}

std::string_view grad_format_name(GradFormat format) {
  switch (format) {
    case GradFormat::kFp32: return "fp32";
    case GradFormat::kBf16: return "bf16";
    case GradFormat::kFp16: return "fp16";
  }
  return "?";
}

std::uint64_t grad_bytes_per_elem(GradFormat format) { return format == GradFormat::kFp32 ? 4 : 2; }

std::uint64_t master_bytes(MasterFormat format, std::uint64_t numel) {
  switch (format) {
    case MasterFormat::kFp32: return 4 * numel;
    case MasterFormat::kRemainder: return 2 * numel + ceil_div(numel, kTieBitsPerByte);
  }
  return 0;
}

std::uint64_t stored_master_bytes(MasterFormat format, std::uint64_t numel) {
  const std::uint64_t bytes = master_bytes(format, numel);
  return ceil_div(bytes, kStoredShardAlign) * kStoredShardAlign;
}

std::uint64_t moments_bytes(MomentFormat format, std::uint64_t numel) {
  switch (format) {
    case MomentFormat::kFp32: return 2 * 4 * numel;
    case MomentFormat::kBf16: return 2 * 2 * numel;
    case MomentFormat::kInt8:
      return 2 * (numel + kInt8MomentScaleBytes * ceil_div(numel, kInt8MomentBlockNumel));
  }
  return 0;
}

std::uint64_t stored_moment_bytes(MomentFormat format, std::uint64_t numel) {
  const std::uint64_t bytes = moments_bytes(format, numel) / 2;
  if (format != MomentFormat::kInt8) return bytes;
  return ceil_div(bytes, kStoredShardAlign) * kStoredShardAlign;
}

double master_bytes_per_elem(MasterFormat format) {
  return format == MasterFormat::kFp32 ? 4.0 : 2.0 + 1.0 / static_cast<double>(kTieBitsPerByte);
}

double moments_bytes_per_elem(MomentFormat format) {
  switch (format) {
    case MomentFormat::kFp32: return 8.0;
    case MomentFormat::kBf16: return 4.0;
    case MomentFormat::kInt8:
      return 2.0 * (1.0 + static_cast<double>(kInt8MomentScaleBytes) / static_cast<double>(kInt8MomentBlockNumel));
  }
  return 0.0;
}

}  // namespace tz
