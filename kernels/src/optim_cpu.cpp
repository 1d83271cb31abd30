// The optimizer kernels' CPU twins (tierzero/kernels.h), and the CUDA entry
// points of builds without CUDA.
#include <algorithm>
#include <cmath>
#include <vector>

#include "adam_math.h"
#include "int8_math.h"
#include "optim_coef.h"
#include "tierzero/kernels.h"

namespace tz::kernels {

bool unscale_cpu(float* g, std::size_t n, float inv_scale) {
  bool non_finite = false;
  for (std::size_t i = 0; i < n; ++i) {
    non_finite |= !std::isfinite(g[i]);
    g[i] *= inv_scale;
    non_finite |= !std::isfinite(g[i]);
  }
  return non_finite;
}

void squared_norms_cpu(const TensorRef* tensors, std::size_t count, double* out) {
  for (std::size_t t = 0; t < count; ++t) {
    double sum = 0;
    for (std::size_t i = 0; i < tensors[t].numel; ++i) {
      const double x = tensors[t].data[i];
      sum += x * x;
    }
    out[t] = sum;
  }
}

Status adam_step_cpu(const AdamTensors& t, std::size_t n, const AdamHyper& h) {
  TZ_ASSIGN_OR_RETURN(detail::AdamCoef c, detail::adam_coef(h));
  for (std::size_t i = 0; i < n; ++i) {
    detail::adam_element(t.param[i], t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], c);
    if (t.param16 != nullptr) t.param16[i] = fp32_to_bf16(t.param[i]);
  }
  return ok_status();
}

namespace {

// Element i's tie bit in the packed array.
bool tie_at(const detail::CompactStep& s, std::size_t i) {
  const std::uint64_t bit = s.tie_bit_offset + i;
  return ((s.tie_bits[bit / 8] >> (bit % 8)) & 1U) != 0;
}

void set_tie(const detail::CompactStep& s, std::size_t i, bool tie) {
  const std::uint64_t bit = s.tie_bit_offset + i;
  std::uint8_t& byte = s.tie_bits[bit / 8];
  const auto mask = static_cast<std::uint8_t>(1U << (bit % 8));
  byte = static_cast<std::uint8_t>(tie ? byte | mask : byte & ~mask);
}

// Note [Int8 moments on the GPU]: decode the block, step it in fp32, encode it
// with its new scale; the CUDA kernel's per-block work, one block at a time.
void step_int8_block(const detail::CompactStep& s, std::size_t q, std::size_t count) {
  constexpr std::size_t kB = detail::kInt8BlockNumel;
  auto* m_codes = static_cast<std::uint8_t*>(s.exp_avg) + q * kB;
  auto* v_codes = static_cast<std::uint8_t*>(s.exp_avg_sq) + q * kB;
  float m[kB], v[kB];
  float m_max = 0.0F, v_max = 0.0F;
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t i = q * kB + j;
    m[j] = detail::int8_decode(s.exp_avg_code, m_codes[j], s.exp_avg_scale[q]);
    v[j] = detail::int8_decode(s.exp_avg_sq_code, v_codes[j], s.exp_avg_sq_scale[q]);
    const bool tie = detail::adam_compact_update(s, i, m[j], v[j], s.remainder_master && tie_at(s, i));
    if (s.remainder_master) set_tie(s, i, tie);
    m_max = detail::int8_max(m_max, detail::int8_finite_abs(m[j]));
    v_max = detail::int8_max(v_max, detail::int8_finite_abs(v[j]));
  }
  const float m_scale = detail::int8_scale(s.exp_avg_code, m_max);
  const float v_scale = detail::int8_scale(s.exp_avg_sq_code, v_max);
  for (std::size_t j = 0; j < count; ++j) {
    m_codes[j] = detail::int8_encode(s.exp_avg_code, m[j], m_scale);
    v_codes[j] = detail::int8_encode(s.exp_avg_sq_code, v[j], v_scale);
  }
  s.exp_avg_scale[q] = m_scale;
  s.exp_avg_sq_scale[q] = v_scale;
}

}  // namespace

Status adam_step_compact_cpu(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                             const AdamCompactCpuOptions& options) {
  std::vector<detail::DecayRun> runs;
  TZ_ASSIGN_OR_RETURN(detail::CompactStep s, detail::compact_step_of(t, n, h, options.fused_multiply_add, runs));
  if (s.int8_moments) {
    constexpr std::size_t kB = detail::kInt8BlockNumel;
    for (std::size_t q = 0; q * kB < n; ++q) step_int8_block(s, q, std::min(kB, n - q * kB));
    return ok_status();
  }
  for (std::size_t i = 0; i < n; ++i) {
    const bool tie = detail::adam_compact_element(s, i, s.remainder_master && tie_at(s, i));
    if (s.remainder_master) set_tie(s, i, tie);
  }
  return ok_status();
}

void accumulate_grad_cpu(float* acc, const void* grad, DType format, std::size_t n, bool overwrite, float scale) {
  const auto* g16 = static_cast<const std::uint16_t*>(grad);
  for (std::size_t i = 0; i < n; ++i) {
    const float g = format == DType::kFp32   ? static_cast<const float*>(grad)[i]
                    : format == DType::kBf16 ? bf16_to_fp32(g16[i])
                                                  : fp16_to_fp32(g16[i]);
    acc[i] = overwrite ? scale * g : std::fma(scale, g, acc[i]);  // cpu_adam's: -0 stays -0 on overwrite
  }
}

#if !defined(TIERZERO_WITH_CUDA)
Status accumulate_grad_cuda(float*, const void*, DType, std::size_t, bool, float, void*) {
  return unavailable("accumulate_grad_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status unscale_cuda(float*, std::size_t, float, int*, void*) {
  return unavailable("unscale_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status squared_norms_cuda(const TensorRef*, std::size_t, double*, void*) {
  return unavailable("squared_norms_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status adam_step_cuda(const AdamTensors&, std::size_t, const AdamHyper&, void*) {
  return unavailable("adam_step_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status adam_step_compact_cuda(const AdamCompactTensors&, std::size_t, const AdamHyper&, void*) {
  return unavailable("adam_step_compact_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
#endif

}  // namespace tz::kernels
