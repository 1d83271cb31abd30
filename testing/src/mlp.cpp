// The built-in MLP workload and its in-memory reference (tierzero/testing/mlp.h).
// Both run the same layer functions below on the same 16-bit-rounded
// weights, so they differ only where the engine's reductions and fp32
// optimizer round differently from the reference's double.
#include "tierzero/testing/mlp.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>

#include "tierzero/kernels.h"

namespace tz::mlp {
namespace {

// Counter-based (splitmix64), so any (rank, micro, step) batch is generated on
// its own without replaying the others.
float uniform(std::uint64_t key) {  // [-1, 1)
  return static_cast<float>(static_cast<double>(splitmix64(key) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

float to_float(const void* p, std::size_t i, DType type) {
  switch (type) {
    case DType::kFp32: return static_cast<const float*>(p)[i];
    case DType::kBf16: return kernels::bf16_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::kFp16: return kernels::fp16_to_fp32(static_cast<const std::uint16_t*>(p)[i]);
    default: break;  // the engine's parameters and gradients are fp32, bf16 or fp16
  }
  return 0;
}

void store_as(void* p, std::size_t i, float x, DType type) {
  switch (type) {
    case DType::kFp32: static_cast<float*>(p)[i] = x; break;
    case DType::kBf16: static_cast<std::uint16_t*>(p)[i] = kernels::fp32_to_bf16(x); break;
    case DType::kFp16: static_cast<std::uint16_t*>(p)[i] = kernels::fp32_to_fp16(x); break;
    default: break;  // the engine's parameters and gradients are fp32, bf16 or fp16
  }
}

struct Weights {
  std::vector<float> w, b;  // (H, H) row-major out x in, (H)
};

Weights weights_from(const void* w, const void* b, int h, DType type) {
  Weights out;
  out.w.resize(static_cast<std::size_t>(h) * h);
  out.b.resize(h);
  for (std::size_t i = 0; i < out.w.size(); ++i) out.w[i] = to_float(w, i, type);
  for (int i = 0; i < h; ++i) out.b[i] = to_float(b, i, type);
  return out;
}

// y (B, H) = act(x w^T + b).
void layer_forward(const std::vector<float>& x, const Weights& p, std::vector<float>& y, int batch, int h, bool act) {
  y.assign(static_cast<std::size_t>(batch) * h, 0.0F);
  for (int r = 0; r < batch; ++r) {
    const float* xr = x.data() + static_cast<std::size_t>(r) * h;
    for (int o = 0; o < h; ++o) {
      const float* wo = p.w.data() + static_cast<std::size_t>(o) * h;
      float acc = p.b[o];
      for (int i = 0; i < h; ++i) acc += xr[i] * wo[i];
      y[static_cast<std::size_t>(r) * h + o] = act ? std::tanh(acc) : acc;
    }
  }
}

// From dy (gradient at the layer's output y): dw, db (accumulated into) and dx.
void layer_backward(const std::vector<float>& x, const std::vector<float>& y, const Weights& p, std::vector<float> dy,
                    std::vector<float>& dw, std::vector<float>& db, std::vector<float>& dx, int batch, int h,
                    bool act) {
  if (act) {
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] *= 1.0F - y[i] * y[i];
  }
  dx.assign(static_cast<std::size_t>(batch) * h, 0.0F);
  for (int r = 0; r < batch; ++r) {
    const float* dr = dy.data() + static_cast<std::size_t>(r) * h;
    const float* xr = x.data() + static_cast<std::size_t>(r) * h;
    float* dxr = dx.data() + static_cast<std::size_t>(r) * h;
    for (int o = 0; o < h; ++o) {
      const float d = dr[o];
      db[o] += d;
      float* dwo = dw.data() + static_cast<std::size_t>(o) * h;
      const float* wo = p.w.data() + static_cast<std::size_t>(o) * h;
      for (int i = 0; i < h; ++i) {
        dwo[i] += d * xr[i];
        dxr[i] += d * wo[i];
      }
    }
  }
}

// The loss and its gradient at the output, times `scale`.
double loss_and_grad(const std::vector<float>& y, const std::vector<float>& target, int batch, double scale,
                     std::vector<float>& dy) {
  double loss = 0;
  dy.resize(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) {
    const float d = y[i] - target[i];
    loss += static_cast<double>(d) * d;
    dy[i] = static_cast<float>(d / batch * scale);
  }
  return loss / (2.0 * batch);
}

}  // namespace

std::vector<BlockSpec> model(const MlpConfig& cfg) {
  std::vector<BlockSpec> out;
  for (int l = 0; l < cfg.layers; ++l) {
    out.push_back({fmt::format("layer{}", l), {{"w", {cfg.hidden, cfg.hidden}}, {"b", {cfg.hidden}}}});
  }
  return out;
}

ParamInit init(const MlpConfig& cfg) {
  return [cfg](std::size_t block, std::size_t param, float* out, std::uint64_t numel) {
    const float bound = 1.0F / std::sqrt(static_cast<float>(cfg.hidden));
    for (std::uint64_t i = 0; i < numel; ++i) {
      out[i] = param == 0 ? bound * uniform(cfg.seed ^ (block << 40) ^ i) : 0.0F;
    }
  };
}

Batch make_batch(const MlpConfig& cfg, int rank, int micro, std::int64_t step) {
  const std::size_t n = static_cast<std::size_t>(cfg.batch) * cfg.hidden;
  const std::uint64_t base = splitmix64(cfg.seed ^ splitmix64(static_cast<std::uint64_t>(step) * 1000003 + micro * 1009 + rank));
  Batch b;
  b.x.resize(n);
  b.target.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    b.x[i] = uniform(base + 2 * i);
    b.target[i] = 0.5F * uniform(base + 2 * i + 1);
  }
  return b;
}

namespace {

// Device memory the CPU arithmetic can read and write: on the Host backend
// the engine's buffers themselves; on CUDA a host copy (the MLP computes on
// the CPU there too, so the engine's CUDA data path is checked against the
// same reference).
class HostStaging {
 public:
  static Expected<HostStaging> create(ZeroEngine& engine) {
    HostStaging s(engine.device());
    if (s.device_.kind() != BackendKind::kHost) {
      TZ_ASSIGN_OR_RETURN(s.stream_, s.device_.create_stream());
    }
    return s;
  }
  // Block p's parameters, readable on the host.
  Expected<const void*> params(const GatheredBlock& p, std::size_t bytes) {
    if (!stream_) return static_cast<const void*>(p.data());
    down_.resize(bytes);
    TZ_TRY(device_.copy_async(down_.data(), p.data(), bytes, *stream_));
    TZ_TRY(device_.synchronize_stream(*stream_));
    return static_cast<const void*>(down_.data());
  }
  // Where to write gradients for g: g itself, or a zeroed host buffer that
  // upload() copies into g.
  void* grads(const GradBlock& g, std::size_t bytes) {
    if (!stream_) return g.data();
    up_.assign(bytes, std::byte{0});
    return up_.data();
  }
  Status upload(const GradBlock& g) {
    if (!stream_) return ok_status();
    TZ_TRY(device_.copy_async(g.data(), up_.data(), up_.size(), *stream_));
    return device_.synchronize_stream(*stream_);
  }

 private:
  explicit HostStaging(Device& device) : device_(device) {}
  Device& device_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::byte> down_, up_;
};

}  // namespace

Expected<double> train_micro_batch(ZeroEngine& engine, const MlpConfig& cfg, const Batch& batch,
                                   const ComputeHook& hook, bool inject_inf, int inf_block) {
  const int h = cfg.hidden, layers = cfg.layers;
  const DType pt = engine.param_type(), gt = engine.grad_type();
  const ModelLayout& layout = engine.layout();
  TZ_ASSIGN_OR_RETURN(HostStaging staging, HostStaging::create(engine));
  // Parameter i of block l, as the host sees it.
  auto param_at = [&](const void* base, std::size_t l, std::size_t i) {
    return static_cast<const char*>(base) + layout.blocks[l].params[i].offset * dtype_bytes(pt);
  };
  std::vector<std::vector<float>> acts(layers + 1);
  acts[0] = batch.x;
  for (int l = 0; l < layers; ++l) {
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine.fetch(l));
    if (hook) hook(l, false);
    TZ_ASSIGN_OR_RETURN(const void* w, staging.params(p, layout.blocks[l].whole_numel * dtype_bytes(pt)));
    layer_forward(acts[l], weights_from(param_at(w, l, 0), param_at(w, l, 1), h, pt), acts[l + 1], cfg.batch, h,
                  l + 1 < layers);
  }
  std::vector<float> dy;
  const double loss = loss_and_grad(acts[layers], batch.target, cfg.batch, engine.loss_scale(), dy);
  for (int l = layers - 1; l >= 0; --l) {
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine.fetch(l));
    if (hook) hook(l, true);
    TZ_ASSIGN_OR_RETURN(const void* pw, staging.params(p, layout.blocks[l].whole_numel * dtype_bytes(pt)));
    const Weights w = weights_from(param_at(pw, l, 0), param_at(pw, l, 1), h, pt);
    std::vector<float> dw(static_cast<std::size_t>(h) * h, 0.0F), db(h, 0.0F), dx;
    layer_backward(acts[l], acts[l + 1], w, dy, dw, db, dx, cfg.batch, h, l + 1 < layers);
    TZ_ASSIGN_OR_RETURN(GradBlock g, engine.grad_buffer(l));
    char* gbase = static_cast<char*>(staging.grads(g, layout.blocks[l].whole_numel * dtype_bytes(gt)));
    void* gw = gbase + layout.blocks[l].params[0].offset * dtype_bytes(gt);
    void* gb = gbase + layout.blocks[l].params[1].offset * dtype_bytes(gt);
    for (std::size_t i = 0; i < dw.size(); ++i) store_as(gw, i, dw[i], gt);
    for (int i = 0; i < h; ++i) store_as(gb, i, db[i], gt);
    if (inject_inf && l == (inf_block < 0 ? layers - 1 : inf_block)) store_as(gw, 0, std::numeric_limits<float>::infinity(), gt);
    TZ_TRY(staging.upload(g));
    TZ_TRY(engine.reduce_grads(std::move(g)));
    dy = std::move(dx);
  }
  return loss;
}

// ---------------------------------------------------------------- reference

Reference::Reference(const MlpConfig& cfg, const Config& config, int world_size, std::optional<DType> grad_type)
    : cfg_(cfg), world_(world_size), states_(model(cfg), init(cfg), config, world_size) {
  grad_type_ = grad_type.value_or(states_.param_type());
}

double Reference::train_step(std::int64_t step) {
  const int h = cfg_.hidden, layers = cfg_.layers;
  const auto hh = static_cast<std::size_t>(h) * h;
  const double loss_scale = states_.loss_scale();
  const int gas = states_.gradient_accumulation_steps();
  const ModelLayout& layout = states_.layout();
  const DType param_type = states_.param_type();
  // The weights as the engine hands them out: fp32 master rounded to 16 bits.
  std::vector<Weights> weights(layers);
  for (int l = 0; l < layers; ++l) {
    const std::vector<float>& p = states_.masters()[l];
    const std::size_t b_off = layout.blocks[l].params[1].offset;
    weights[l].w.resize(hh);
    weights[l].b.resize(h);
    for (std::size_t i = 0; i < hh; ++i) weights[l].w[i] = round_through(p[i], param_type);
    for (int i = 0; i < h; ++i) weights[l].b[i] = round_through(p[b_off + i], param_type);
  }
  std::vector<std::vector<float>> acc(layers);
  for (int l = 0; l < layers; ++l) acc[l].assign(states_.masters()[l].size(), 0.0F);
  const float scale = static_cast<float>(1.0 / (static_cast<double>(world_) * gas));
  double loss_sum = 0;
  for (int micro = 0; micro < gas; ++micro) {
    std::vector<std::vector<float>> sum(layers);
    for (int l = 0; l < layers; ++l) sum[l].assign(states_.masters()[l].size(), 0.0F);
    for (int rank = 0; rank < world_; ++rank) {
      const Batch batch = make_batch(cfg_, rank, micro, step);
      std::vector<std::vector<float>> acts(layers + 1);
      acts[0] = batch.x;
      for (int l = 0; l < layers; ++l) layer_forward(acts[l], weights[l], acts[l + 1], cfg_.batch, h, l + 1 < layers);
      std::vector<float> dy;
      loss_sum += loss_and_grad(acts[layers], batch.target, cfg_.batch, loss_scale, dy);
      for (int l = layers - 1; l >= 0; --l) {
        std::vector<float> dw(hh, 0.0F), db(h, 0.0F), dx;
        layer_backward(acts[l], acts[l + 1], weights[l], dy, dw, db, dx, cfg_.batch, h, l + 1 < layers);
        const std::size_t b_off = layout.blocks[l].params[1].offset;
        // The sum over ranks, in the gradient type (as the reduction stores it).
        for (std::size_t i = 0; i < hh; ++i) sum[l][i] = round_through(sum[l][i] + round_through(dw[i], grad_type_), grad_type_);
        for (int i = 0; i < h; ++i) {
          sum[l][b_off + i] = round_through(sum[l][b_off + i] + round_through(db[i], grad_type_), grad_type_);
        }
        dy = std::move(dx);
      }
    }
    for (int l = 0; l < layers; ++l) {
      for (std::size_t i = 0; i < acc[l].size(); ++i) acc[l][i] += scale * sum[l][i];
    }
  }
  states_.step(acc);
  return loss_sum / (static_cast<double>(world_) * gas);
}

}  // namespace tz::mlp
