#include "tierzero/engine/reference.h"

#include <algorithm>
#include <cmath>

#include "tierzero/kernels.h"

namespace tz {

float round_through(float x, DType type) {
  switch (type) {
    case DType::kFp32: return x;
    case DType::kBf16: return kernels::bf16_to_fp32(kernels::fp32_to_bf16(x));
    case DType::kFp16: return kernels::fp16_to_fp32(kernels::fp32_to_fp16(x));
    default: break;  // not a state type: kept as it is
  }
  return x;
}

ReferenceStates::ReferenceStates(const std::vector<BlockSpec>& model, const ParamInit& init, const Config& config,
                                 int world_size)
    : config_(config) {
  param_type_ = config.precision.fp16 ? DType::kFp16 : config.precision.bf16 ? DType::kBf16 : DType::kFp32;
  layout_ = ModelLayout::make(model, world_size, 0).value();
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const BlockLayout& block = layout_.blocks[b];
    std::vector<float> whole(block.used_numel, 0.0F);
    for (std::size_t p = 0; p < block.params.size(); ++p) {
      init(b, p, whole.data() + block.params[p].offset, block.params[p].numel);
    }
    master_.push_back(whole);
    m_.emplace_back(whole.size(), 0.0);
    v_.emplace_back(whole.size(), 0.0);
  }
}

std::vector<float> ReferenceStates::master(std::size_t block) const {
  std::vector<float> out(layout_.blocks[block].whole_numel, 0.0F);
  std::copy(master_[block].begin(), master_[block].end(), out.begin());
  return out;
}

double ReferenceStates::loss_scale() const {
  return config_.precision.fp16 ? std::ldexp(1.0, config_.precision.initial_scale_power) : 1.0;
}

int ReferenceStates::gradient_accumulation_steps() const {
  return static_cast<int>(std::max<std::int64_t>(config_.gradient_accumulation_steps, 1));
}

void ReferenceStates::step(const std::vector<std::vector<float>>& acc) {
  const double scale = loss_scale();
  double ss = 0;
  for (const auto& a : acc) {
    for (float g : a) ss += static_cast<double>(g) * g;
  }
  const double norm = std::sqrt(ss) / scale;
  const double max_norm = config_.gradient_clipping;
  const double clip = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
  const OptimizerConfig& o = config_.optimizer;
  const bool adamw = o.type == "AdamW";
  ++steps_;
  const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(steps_));
  const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(steps_));
  for (std::size_t b = 0; b < acc.size(); ++b) {
    for (std::size_t i = 0; i < acc[b].size(); ++i) {
      double p = master_[b][i];
      double g = acc[b][i] * (clip / scale);
      if (adamw) {
        p *= 1 - o.lr * o.weight_decay;
      } else {
        g += o.weight_decay * p;
      }
      m_[b][i] = o.beta1 * m_[b][i] + (1 - o.beta1) * g;
      v_[b][i] = o.beta2 * v_[b][i] + (1 - o.beta2) * g * g;
      p -= o.lr / bc1 * m_[b][i] / (std::sqrt(v_[b][i]) / std::sqrt(bc2) + o.eps);
      master_[b][i] = static_cast<float>(p);
    }
  }
}

}  // namespace tz
