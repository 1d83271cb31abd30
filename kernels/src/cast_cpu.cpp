#include <bit>
#include <cstring>

#include "tierzero/kernels.h"

namespace tz::kernels {

std::uint16_t fp32_to_bf16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);  // quiet NaN
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit.
  const std::uint32_t rounding = 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

float bf16_to_fp32(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t fp32_to_fp16(float value) {
  // _Float16 conversion is IEEE round-to-nearest-even in GCC on x86-64.
  const _Float16 half = static_cast<_Float16>(value);
  std::uint16_t out;
  std::memcpy(&out, &half, sizeof(out));
  return out;
}

float fp16_to_fp32(std::uint16_t bits) {
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return static_cast<float>(half);
}

void cast_fp32_to_bf16_cpu(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = fp32_to_bf16(src[i]);
}

void cast_fp32_to_fp16_cpu(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

#if !defined(TIERZERO_WITH_CUDA)
bool cuda_kernels_built() { return false; }
Status cast_fp32_to_bf16_cuda(const float*, std::uint16_t*, std::size_t, void*) {
  return unavailable("cast_fp32_to_bf16_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status cast_fp32_to_fp16_cuda(const float*, std::uint16_t*, std::size_t, void*) {
  return unavailable("cast_fp32_to_fp16_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
#endif

}  // namespace tz::kernels
