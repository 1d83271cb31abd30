#include "validate.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

namespace tz::cpu_adam::detail {
namespace {

bool is_adam(Algorithm a) { return a == Algorithm::kAdam || a == Algorithm::kAdamW; }

Status require_positive(std::string_view name, double value) {
  if (std::isfinite(value) && value > 0) return ok_status();
  return invalid_argument("{} = {} is out of range: must be finite and > 0", name, value);
}

Status require_non_negative(std::string_view name, double value) {
  if (std::isfinite(value) && value >= 0) return ok_status();
  return invalid_argument("{} = {} is out of range: must be finite and >= 0", name, value);
}

Status require_beta(std::string_view name, double value) {
  if (value >= 0 && value < 1) return ok_status();
  return invalid_argument("{} = {} is outside [0, 1)", name, value);
}

Status require_not_nan(const Hyper& h) {
  const struct {
    std::string_view name;
    double value;
  } fields[] = {{"lr", h.lr},   {"beta1", h.beta1},       {"beta2", h.beta2},
                {"eps", h.eps}, {"weight_decay", h.weight_decay}, {"lr_decay", h.lr_decay}};
  for (const auto& f : fields) {
    if (std::isnan(f.value)) return invalid_argument("{} = nan is not a number", f.name);
  }
  return ok_status();
}

struct SpanRange {
  std::string_view name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

Status check_span(std::string_view name, const void* ptr, std::size_t elem_bytes, std::size_t n,
                  std::vector<SpanRange>* ranges) {
  if (ptr == nullptr) return invalid_argument("{} is null (n = {})", name, n);
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  if (begin % elem_bytes != 0) {
    return invalid_argument("{} = {} is not aligned to its {}-byte elements", name, ptr, elem_bytes);
  }
  if (n > (UINTPTR_MAX - begin) / elem_bytes) {
    return invalid_argument("{}: n = {} runs past the end of the address space", name, n);
  }
  ranges->push_back({name, begin, begin + n * elem_bytes});
  return ok_status();
}

Status check_disjoint(const std::vector<SpanRange>& ranges) {
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    for (std::size_t j = i + 1; j < ranges.size(); ++j) {
      if (ranges[i].begin < ranges[j].end && ranges[j].begin < ranges[i].end) {
        return invalid_argument("{} and {} overlap", ranges[i].name, ranges[j].name);
      }
    }
  }
  return ok_status();
}

Status check_grad_dtype(std::string_view name, DType dtype) {
  if (dtype == DType::kFp32 || dtype == DType::kBf16 || dtype == DType::kFp16) return ok_status();
  return invalid_argument("{} = {} is not a dtype (fp32, bf16 or fp16)", name, static_cast<int>(dtype));
}

// The remainder format's own rules (Note [Remainder masters]); its spans are
// checked with the others.
Status check_master_format(const Spans& s) {
  if (s.master_format == MasterFormat::kFp32) return ok_status();
  if (s.master_format != MasterFormat::kRemainder) {
    return invalid_argument("spans.master_format = {} is not one of fp32, remainder", static_cast<int>(s.master_format));
  }
  if (s.param16 == nullptr) {
    return invalid_argument("spans.param16 is null, but master_format = remainder keeps the master's bf16 part there "
                            "(n = {})", s.n);
  }
  if (s.param16_dtype != DType::kBf16) {
    return invalid_argument("spans.param16_dtype = {} is not allowed with master_format = remainder (bf16 only): "
                            "fp16's narrower exponent cannot hold an fp32 master's range; use bf16 parameters or "
                            "master_format = fp32", dtype_name(s.param16_dtype));
  }
  if (s.param != nullptr) {
    return invalid_argument("spans.param = {} is set, but master_format = remainder keeps no fp32 master (it is "
                            "rebuilt from param16, remainder and tie_bits); pass null", static_cast<const void*>(s.param));
  }
  if (s.tie_bits == nullptr) {
    return invalid_argument("spans.tie_bits is null, but master_format = remainder needs ceil(n / 8) = {} bytes of them "
                            "(n = {})", (s.n + 7) / 8, s.n);
  }
  return ok_status();
}


}  // namespace

Status validate_hyper(const Hyper& h, const StepArgs& args) {
  if (h.algorithm != Algorithm::kAdam && h.algorithm != Algorithm::kAdamW && h.algorithm != Algorithm::kAdagrad &&
      h.algorithm != Algorithm::kLion) {
    return invalid_argument("algorithm = {} is not one of adam, adamw, adagrad, lion", static_cast<int>(h.algorithm));
  }
  TZ_TRY(require_not_nan(h));
  // 0 is allowed, as in torch.optim: a schedule's first warm-up step or last
  // decay step moves the moments but not the parameters.
  TZ_TRY(require_non_negative("lr", h.lr));
  TZ_TRY(require_non_negative("weight_decay", h.weight_decay));
  if (h.algorithm != Algorithm::kAdagrad) {
    TZ_TRY(require_beta("beta1", h.beta1));
    TZ_TRY(require_beta("beta2", h.beta2));
  }
  if (h.algorithm != Algorithm::kLion) TZ_TRY(require_positive("eps", h.eps));
  if (h.algorithm == Algorithm::kAdagrad) TZ_TRY(require_non_negative("lr_decay", h.lr_decay));
  if (h.amsgrad && !is_adam(h.algorithm)) {
    return invalid_argument("amsgrad is only for adam and adamw, not {}", algorithm_name(h.algorithm));
  }
  if (args.step < 1) return invalid_argument("step = {} is out of range: must be >= 1", args.step);
  TZ_TRY(require_positive("grad_scale", args.grad_scale));
  return ok_status();
}

Status validate_spans(const Hyper& h, const Spans& s) {
  TZ_TRY(check_grad_dtype("spans.grad_dtype", s.grad_dtype));
  if (s.moment_dtype != DType::kFp32 && s.moment_dtype != DType::kBf16 && s.moment_dtype != DType::kUint8) {
    return invalid_argument("spans.moment_dtype = {} is not allowed (fp32, bf16, or uint8: int8 block codes)",
                            dtype_name(s.moment_dtype));
  }
  if (s.param16 != nullptr && s.param16_dtype != DType::kBf16 && s.param16_dtype != DType::kFp16) {
    return invalid_argument("spans.param16_dtype = {} is not allowed (bf16 or fp16)", dtype_name(s.param16_dtype));
  }
  if (h.amsgrad && s.max_exp_avg_sq == nullptr) {
    return invalid_argument("spans.max_exp_avg_sq is null but amsgrad is set (n = {})", s.n);
  }
  TZ_TRY(check_master_format(s));
  const bool remainder = s.master_format == MasterFormat::kRemainder;
  std::vector<SpanRange> ranges;
  const std::size_t m = dtype_bytes(s.moment_dtype);
  if (!remainder) TZ_TRY(check_span("spans.param", s.param, 4, s.n, &ranges));
  TZ_TRY(check_span("spans.grad", s.grad, dtype_bytes(s.grad_dtype), s.n, &ranges));
  const bool int8 = s.moment_dtype == DType::kUint8;
  const std::size_t blocks = (s.n + kInt8Block - 1) / kInt8Block;
  if (h.algorithm != Algorithm::kAdagrad) {
    TZ_TRY(check_span("spans.exp_avg", s.exp_avg, m, s.n, &ranges));
    if (int8) TZ_TRY(check_span("spans.exp_avg_scale", s.exp_avg_scale, 4, blocks, &ranges));
  }
  if (h.algorithm != Algorithm::kLion) {
    TZ_TRY(check_span("spans.exp_avg_sq", s.exp_avg_sq, m, s.n, &ranges));
    if (int8) TZ_TRY(check_span("spans.exp_avg_sq_scale", s.exp_avg_sq_scale, 4, blocks, &ranges));
  }
  if (h.amsgrad) TZ_TRY(check_span("spans.max_exp_avg_sq", s.max_exp_avg_sq, 4, s.n, &ranges));
  if (s.param16 != nullptr) TZ_TRY(check_span("spans.param16", s.param16, 2, s.n, &ranges));
  if (remainder) {
    TZ_TRY(check_span("spans.remainder", s.remainder, 2, s.n, &ranges));
    TZ_TRY(check_span("spans.tie_bits", s.tie_bits, 1, (s.n + 7) / 8, &ranges));
  }
  return check_disjoint(ranges);
}

Status validate_segments(const Spans& s) {
  const std::span<const WeightDecaySegment> segs = s.weight_decay_segments;
  for (std::size_t k = 0; k < segs.size(); ++k) {
    const WeightDecaySegment& g = segs[k];
    if (!(std::isfinite(g.weight_decay) && g.weight_decay >= 0)) {
      return invalid_argument("weight_decay_segments[{}] = [{}, {}) has weight_decay = {}: must be finite and >= 0", k,
                              g.begin, g.end, g.weight_decay);
    }
    if (!(g.begin < g.end && g.end <= s.n)) {
      return invalid_argument("weight_decay_segments[{}] = [{}, {}) (weight_decay = {}) is out of range: must have "
                              "begin < end <= n = {}", k, g.begin, g.end, g.weight_decay, s.n);
    }
    if (k > 0 && g.begin < segs[k - 1].end) {
      const WeightDecaySegment& p = segs[k - 1];
      return invalid_argument("weight_decay_segments[{}] = [{}, {}) (weight_decay = {}) overlaps or precedes "
                              "weight_decay_segments[{}] = [{}, {}) (weight_decay = {}): segments must be sorted and "
                              "disjoint", k, g.begin, g.end, g.weight_decay, k - 1, p.begin, p.end, p.weight_decay);
    }
  }
  return ok_status();
}

Status validate_accumulate(const void* acc, DType acc_dtype, const void* grad, DType grad_dtype, std::size_t n,
                           double scale) {
  TZ_TRY(check_grad_dtype("acc_dtype", acc_dtype));
  TZ_TRY(check_grad_dtype("grad_dtype", grad_dtype));
  if (!std::isfinite(static_cast<float>(scale))) {
    return invalid_argument("scale = {} is out of range: must be finite in fp32", scale);
  }
  if (n == 0) return ok_status();
  std::vector<SpanRange> ranges;
  TZ_TRY(check_span("acc", acc, dtype_bytes(acc_dtype), n, &ranges));
  TZ_TRY(check_span("grad", grad, dtype_bytes(grad_dtype), n, &ranges));
  return check_disjoint(ranges);
}

Status validate_int8_arrays(const float* x, const std::uint8_t* codes, const float* scales, std::size_t n) {
  if (n == 0) return ok_status();
  std::vector<SpanRange> ranges;
  TZ_TRY(check_span("x", x, 4, n, &ranges));
  TZ_TRY(check_span("codes", codes, 1, n, &ranges));
  TZ_TRY(check_span("scales", scales, 4, (n + kInt8Block - 1) / kInt8Block, &ranges));
  return check_disjoint(ranges);
}

Status validate_master_arrays(const float* master, const void* bf16, const void* remainder, const void* tie_bits,
                              std::size_t n) {
  if (n == 0) return ok_status();
  std::vector<SpanRange> ranges;
  TZ_TRY(check_span("master", master, 4, n, &ranges));
  TZ_TRY(check_span("bf16", bf16, 2, n, &ranges));
  TZ_TRY(check_span("remainder", remainder, 2, n, &ranges));
  TZ_TRY(check_span("tie_bits", tie_bits, 1, (n + 7) / 8, &ranges));
  return check_disjoint(ranges);
}

Kind kind_of(const Hyper& h) {
  switch (h.algorithm) {
    case Algorithm::kAdam:
      if (h.weight_decay != 0) return h.amsgrad ? Kind::kAdamL2Ams : Kind::kAdamL2;
      return h.amsgrad ? Kind::kAdamWAms : Kind::kAdamW;
    case Algorithm::kAdamW: return h.amsgrad ? Kind::kAdamWAms : Kind::kAdamW;
    case Algorithm::kAdagrad: return Kind::kAdagrad;
    case Algorithm::kLion: return Kind::kLion;
  }
  return Kind::kAdamW;
}

ParamLayout param_layout_of(const Spans& s) {
  if (s.master_format == MasterFormat::kRemainder) return ParamLayout::kBf16Remainder;
  if (s.param16 == nullptr) return ParamLayout::kFp32;
  return s.param16_dtype == DType::kBf16 ? ParamLayout::kFp32CopyBf16 : ParamLayout::kFp32CopyFp16;
}

Expected<StepConsts> make_consts(const Hyper& h, const StepArgs& args) {
  const double t = static_cast<double>(args.step);
  StepConsts c;
  c.scale = static_cast<float>(args.grad_scale);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  const Kind kind = kind_of(h);
  if (kind == Kind::kAdamL2 || kind == Kind::kAdamL2Ams || kind == Kind::kAdagrad) {
    c.l2 = static_cast<float>(h.weight_decay);
  } else {
    c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  }
  if (is_adam(h.algorithm)) {
    c.neg_step = static_cast<float>(-h.lr / (1.0 - std::pow(h.beta1, t)));
    c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, t)));
  } else if (h.algorithm == Algorithm::kAdagrad) {
    c.neg_step = static_cast<float>(-h.lr / (1.0 + (t - 1.0) * h.lr_decay));
  } else {
    c.neg_step = static_cast<float>(-h.lr);
  }
  // Values that are fine in double but overflow fp32, or underflow to a zero
  // that would silence the gradient or divide by zero.
  bool fits = c.scale != 0 && (h.algorithm == Algorithm::kLion || c.eps != 0);
  for (float x : {c.scale, c.l2, c.decay, c.eps, c.neg_step, c.inv_sqrt_bc2}) fits = fits && std::isfinite(x);
  if (!fits) {
    return invalid_argument("hyperparameters out of fp32 range (lr = {}, eps = {}, weight_decay = {}, grad_scale = {})",
                            h.lr, h.eps, h.weight_decay, args.grad_scale);
  }
  return c;
}

}  // namespace tz::cpu_adam::detail
