// The GPT model description, its initialisation, the in-memory
// forward_backward, and GptTrainer driving it through ZeroEngine
// (tierzero/train/gpt.h).
//
// Note [Tied embedding]
// wte is used twice: by the lookup at the bottom and by the LM head at the
// top. Both uses live in one engine block ("embed": wte, wpe, ln_f), so the
// weight is stored, offloaded and stepped once. In a micro-batch the block is
// fetched twice: at the start (lookup) and after the last transformer block,
// when it is held through the final LayerNorm, the head, the loss and the
// head's backward. Its gradient must be reduced once per micro-batch (a
// block's gradients are one reduce-scatter and one accumulation; reducing it
// twice would also double its traffic and round twice), so the trainer keeps
// the embed block's gradient in its own fp32 buffer, laid out like the block:
// the head's backward writes d wte (head part) and d ln_f into it, the
// transformer blocks' backward runs, then the lookup's backward adds d wte
// (rows of the tokens seen) and d wpe. Only then does it ask the engine for
// the block's gradient buffer, store the sum in the gradient type (one
// rounding), and call reduce_grads. The lookup's backward needs no weights,
// so the block is not fetched a third time. The fp32 buffer costs
// (vocab + seq + 2) x hidden x 4 bytes of trainer memory, beside the
// activations.
#include "tierzero/train/gpt.h"

#include <fmt/ranges.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "passes.h"
#include "tierzero/kernels.h"
#include "trainer_backend.h"

namespace tz::train {
namespace {

// Two independent standard normals from a counter: Box-Muller on two hashed
// uniforms, both its outputs (one logarithm and one sincos a pair, the cost
// of initialising billions of weights at start-up).
struct NormalPair {
  double a, b;
};
NormalPair normal_pair(std::uint64_t key) {
  const double u1 = (static_cast<double>(splitmix64(key) >> 11) + 0.5) * 0x1p-53;
  const double u2 = static_cast<double>(splitmix64(key ^ 0xA5A5A5A5A5A5A5A5ULL) >> 11) * 0x1p-53;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * std::numbers::pi * u2;
  return {r * std::cos(theta), r * std::sin(theta)};
}

}  // namespace

// ---------------------------------------------------------------- the model

Status GptConfig::validate() const {
  auto positive = [](const char* name, long long v) -> Status {
    if (v < 1) return invalid_argument("GPT config: {} = {} must be >= 1", name, v);
    return ok_status();
  };
  TZ_TRY(positive("layers", layers));
  TZ_TRY(positive("hidden", hidden));
  TZ_TRY(positive("heads", heads));
  TZ_TRY(positive("seq", seq));
  TZ_TRY(positive("batch", batch));
  TZ_TRY(positive("vocab", vocab));
  if (hidden % heads != 0) return invalid_argument("GPT config: hidden = {} is not divisible by heads = {}", hidden, heads);
  if (!(init_std > 0)) return invalid_argument("GPT config: init_std = {} must be > 0", init_std);
  return ok_status();
}

std::uint64_t GptConfig::param_count() const {
  const auto h = static_cast<std::uint64_t>(hidden);
  const std::uint64_t embed = static_cast<std::uint64_t>(vocab) * h + static_cast<std::uint64_t>(seq) * h + 2 * h;
  return embed + static_cast<std::uint64_t>(layers) * (12 * h * h + 13 * h);
}

namespace {

// Floats a detail::Workspace<float> holds once resized for batch x seq tokens
// and `layers` layers.
std::uint64_t workspace_floats(const GptConfig& c, std::uint64_t layers) {
  const auto n = static_cast<std::uint64_t>(c.batch) * static_cast<std::uint64_t>(c.seq);
  const auto h = static_cast<std::uint64_t>(c.hidden), v = static_cast<std::uint64_t>(c.vocab);
  const std::uint64_t probs = static_cast<std::uint64_t>(c.batch) * c.heads * static_cast<std::uint64_t>(c.seq) * c.seq;
  // Per layer (LayerActs): x_in, ln1, att, x_mid, ln2 (N x H), four (N) statistics,
  // qkv (N x 3H), probs, fc and gelu (N x 4H each).
  const std::uint64_t per_layer = 5 * n * h + 4 * n + 3 * n * h + probs + 8 * n * h;
  // Once: x_final, lnf, dx, dx_next, d_mid, d_tmp, d_att (N x H), two (N),
  // logits and dlogits (N x V), d_qkv (N x 3H), d_ffn (N x 4H).
  const std::uint64_t once = 7 * n * h + 2 * n + 2 * n * v + 3 * n * h + 4 * n * h;
  return layers * per_layer + once;
}

std::uint64_t embed_numel(const GptConfig& c) {
  const auto h = static_cast<std::uint64_t>(c.hidden);
  return static_cast<std::uint64_t>(c.vocab) * h + static_cast<std::uint64_t>(c.seq) * h + 2 * h;
}

std::uint64_t layer_numel(const GptConfig& c) {
  const auto h = static_cast<std::uint64_t>(c.hidden);
  return 12 * h * h + 13 * h;
}

}  // namespace

std::uint64_t GptConfig::activation_bytes() const {
  // The trainer's fp32 block copies: the embedding block (weights and, Note
  // [Tied embedding], gradients) and one transformer block (weights, gradients).
  const std::uint64_t copies = 2 * embed_numel(*this) + 2 * layer_numel(*this);
  return 4 * (workspace_floats(*this, static_cast<std::uint64_t>(layers)) + copies);
}

std::uint64_t GptConfig::evaluation_bytes(int batches) const {
  if (batches <= 0) return 0;
  const std::uint64_t streams = static_cast<std::uint64_t>(batches) * static_cast<std::uint64_t>(batch) *
                                static_cast<std::uint64_t>(seq) * static_cast<std::uint64_t>(hidden);
  const std::uint64_t master = std::max(embed_numel(*this), layer_numel(*this));
  return 4 * (workspace_floats(*this, 1) + streams + master);
}

double GptConfig::flops_per_token() const {
  return 6.0 * static_cast<double>(param_count()) + 12.0 * layers * hidden * static_cast<double>(seq);
}

std::int64_t default_warmup_steps(const GptConfig& cfg, double lr) {
  const double h = cfg.hidden;
  const double steps = std::ceil(lr * cfg.layers * h * h / kWarmupScale);
  if (!(steps > 1)) return 0;  // also NaN and a non-positive lr
  return steps > 1e9 ? std::int64_t{1000000000} : static_cast<std::int64_t>(steps);
}

std::vector<BlockSpec> model(const GptConfig& cfg) {
  const std::int64_t h = cfg.hidden;
  std::vector<BlockSpec> out;
  out.push_back({"embed", {{"wte", {cfg.vocab, h}}, {"wpe", {cfg.seq, h}}, {"ln_f.w", {h}}, {"ln_f.b", {h}}}});
  for (int l = 0; l < cfg.layers; ++l) {
    out.push_back({fmt::format("h{}", l),
                   {{"ln1.w", {h}}, {"ln1.b", {h}}, {"attn.qkv.w", {3 * h, h}}, {"attn.qkv.b", {3 * h}},
                    {"attn.proj.w", {h, h}}, {"attn.proj.b", {h}}, {"ln2.w", {h}}, {"ln2.b", {h}},
                    {"mlp.fc.w", {4 * h, h}}, {"mlp.fc.b", {4 * h}}, {"mlp.proj.w", {h, 4 * h}},
                    {"mlp.proj.b", {h}}}});
  }
  return out;
}

ParamInit init(const GptConfig& cfg) {
  return [cfg](std::size_t block, std::size_t p, float* out, std::uint64_t numel) {
    double std_dev = 0;  // 0: a bias
    bool one = false;    // a LayerNorm weight
    if (block == 0) {
      std_dev = p == kWte || p == kWpe ? cfg.init_std : 0;
      one = p == kLnfW;
    } else {
      one = p == kLn1W || p == kLn2W;
      if (p == kQkvW || p == kFcW) std_dev = cfg.init_std;
      if (p == kProjW || p == kFc2W) std_dev = cfg.init_std / std::sqrt(2.0 * cfg.layers);
    }
    const std::uint64_t key = splitmix64(cfg.seed ^ splitmix64((block << 20) + p));
    if (one || std_dev == 0) {
      std::fill(out, out + numel, one ? 1.0F : 0.0F);
      return;
    }
    // Counter-based, so the cores can share the work: elements 2k and 2k+1
    // are pair k's two normals, whoever computes them.
    const std::uint64_t pairs = (numel + 1) / 2;
    tbb::parallel_for(tbb::blocked_range<std::uint64_t>(0, pairs, 1 << 15), [&](const auto& r) {
      for (std::uint64_t k = r.begin(); k < r.end(); ++k) {
        const NormalPair z = normal_pair(key + k);
        out[2 * k] = static_cast<float>(std_dev * z.a);
        if (2 * k + 1 < numel) out[2 * k + 1] = static_cast<float>(std_dev * z.b);
      }
    });
  };
}

namespace detail {

Status check_batch(const GptConfig& cfg, const TokenBatch& b) {
  if (b.batch < 1 || b.seq < 1 || b.seq > cfg.seq) {
    return invalid_argument("batch of {} x {} tokens: need batch >= 1 and 1 <= seq <= {} (the model's context)",
                            b.batch, b.seq, cfg.seq);
  }
  const std::size_t n = static_cast<std::size_t>(b.batch) * b.seq;
  if (b.inputs.size() != n || b.targets.size() != n) {
    return invalid_argument("batch of {} x {} tokens has {} inputs and {} targets", b.batch, b.seq, b.inputs.size(),
                            b.targets.size());
  }
  for (std::size_t i = 0; i < n; ++i) {
    for (std::int32_t t : {b.inputs[i], b.targets[i]}) {
      if (t < 0 || t >= cfg.vocab) return invalid_argument("token {} at position {} is outside [0, {})", t, i, cfg.vocab);
    }
  }
  return ok_status();
}

}  // namespace detail

template <typename T>
double forward_backward(const GptConfig& cfg, const ModelLayout& layout, const std::vector<std::vector<T>>& weights,
                        const TokenBatch& batch, double loss_scale, std::vector<std::vector<T>>* grads) {
  const detail::Shape s = detail::shape_of(cfg, batch.batch, batch.seq);
  const BlockLayout& embed = layout.blocks[0];
  detail::Workspace<T> ws;
  ws.resize(s, cfg.layers);
  detail::embed_forward(s, embed, weights[0].data(), batch.inputs.data(), ws.stream(0));
  for (std::size_t l = 0; l < static_cast<std::size_t>(cfg.layers); ++l) {
    detail::layer_forward(s, layout.blocks[1 + l], weights[1 + l].data(), ws, l);
  }
  T* g_embed = grads != nullptr ? (*grads)[0].data() : nullptr;
  const double loss = detail::head(s, embed, weights[0].data(), batch.targets.data(), loss_scale, ws, g_embed);
  if (grads == nullptr) return loss;
  for (std::size_t l = static_cast<std::size_t>(cfg.layers); l-- > 0;) {
    detail::layer_backward(s, layout.blocks[1 + l], weights[1 + l].data(), ws, l, (*grads)[1 + l].data());
  }
  detail::embed_backward(s, embed, batch.inputs.data(), ws.dx.data(), g_embed);
  return loss;
}

template double forward_backward<float>(const GptConfig&, const ModelLayout&, const std::vector<std::vector<float>>&,
                                        const TokenBatch&, double, std::vector<std::vector<float>>*);
template double forward_backward<double>(const GptConfig&, const ModelLayout&, const std::vector<std::vector<double>>&,
                                         const TokenBatch&, double, std::vector<std::vector<double>>*);

// ---------------------------------------------------------------- GptTrainer

struct GptTrainer::State {
  ZeroEngine& engine;
  GptConfig cfg;
  DType param_type, grad_type;
  std::unique_ptr<detail::TrainerBackend> device;  // a CUDA engine's GPT; null: the CPU one below
  detail::Workspace<float> ws;
  std::vector<float> w;        // (used_numel,) of the block being computed, fp32
  std::vector<float> w_embed;  // the embed block's weights, for the head
  std::vector<float> g;        // (used_numel,) the block's gradients, fp32
  std::vector<float> g_embed;  // Note [Tied embedding]

  const BlockLayout& block(std::size_t b) const { return engine.layout().blocks[b]; }

  // The block's parameters (bf16, fp16, or fp32 without mixed precision) as fp32, into out.
  void load(const GatheredBlock& p, std::vector<float>& out) const {
    const std::size_t n = block(p.block()).used_numel;
    out.resize(n);
    const auto* src = static_cast<const std::uint16_t*>(p.data());
    switch (param_type) {
      case DType::kFp32: std::memcpy(out.data(), p.data(), n * sizeof(float)); break;
      case DType::kBf16:
        for (std::size_t i = 0; i < n; ++i) {
          const std::uint32_t bits = static_cast<std::uint32_t>(src[i]) << 16;
          std::memcpy(&out[i], &bits, sizeof(float));
        }
        break;
      case DType::kFp16:
        for (std::size_t i = 0; i < n; ++i) out[i] = kernels::fp16_to_fp32(src[i]);
        break;
      default: break;  // the engine's parameters are fp32, bf16 or fp16
    }
  }

  // Hands block b's fp32 gradients to the engine in its gradient type.
  Status reduce(std::size_t b, const std::vector<float>& grads) {
    TZ_ASSIGN_OR_RETURN(GradBlock gb, engine.grad_buffer(b));
    const std::size_t n = block(b).used_numel;
    switch (grad_type) {
      case DType::kFp32: std::memcpy(gb.data(), grads.data(), n * sizeof(float)); break;
      case DType::kBf16: kernels::cast_fp32_to_bf16_cpu(grads.data(), static_cast<std::uint16_t*>(gb.data()), n); break;
      case DType::kFp16: kernels::cast_fp32_to_fp16_cpu(grads.data(), static_cast<std::uint16_t*>(gb.data()), n); break;
      default: return invalid_argument("gradients in {}: fp32, bf16 or fp16 only", dtype_name(grad_type));
    }
    return engine.reduce_grads(std::move(gb));
  }

  void zero(std::vector<float>& grads, std::size_t b) const { grads.assign(block(b).used_numel, 0.0F); }
};

GptTrainer::GptTrainer(std::unique_ptr<State> state) : state_(std::move(state)) {}
GptTrainer::~GptTrainer() = default;

BackendKind GptTrainer::backend() const {
  return state_->device != nullptr ? BackendKind::kCuda : BackendKind::kHost;
}

std::string GptTrainer::describe() const {
  if (state_->device != nullptr) return state_->device->describe();
  return fmt::format("CPU, fp32 ({} threads)", tbb::this_task_arena::max_concurrency());
}

Expected<std::unique_ptr<GptTrainer>> GptTrainer::create(ZeroEngine& engine, const GptConfig& cfg,
                                                         const CudaOptions& cuda) {
  TZ_TRY(cfg.validate());
  const std::vector<BlockSpec> want = model(cfg);
  const ModelLayout& have = engine.layout();
  if (have.blocks.size() != want.size()) {
    return invalid_argument("the engine has {} blocks; a GPT of {} layers has {}", have.blocks.size(), cfg.layers,
                            want.size());
  }
  for (std::size_t b = 0; b < want.size(); ++b) {
    const BlockLayout& hb = have.blocks[b];
    if (hb.name != want[b].name || hb.params.size() != want[b].params.size()) {
      return invalid_argument("engine block {} is \"{}\" with {} parameters; the GPT's is \"{}\" with {}", b, hb.name,
                              hb.params.size(), want[b].name, want[b].params.size());
    }
    for (std::size_t p = 0; p < hb.params.size(); ++p) {
      if (hb.params[p].name != want[b].params[p].name || hb.params[p].shape != want[b].params[p].shape) {
        return invalid_argument("engine block {} parameter {} ({}) does not match the GPT's {} of shape [{}]", hb.name,
                                p, hb.params[p].name, want[b].params[p].name, fmt::join(want[b].params[p].shape, ", "));
      }
    }
  }
  auto state = std::make_unique<State>(State{.engine = engine, .cfg = cfg, .param_type = engine.param_type(),
                                             .grad_type = engine.grad_type()});
  if (engine.device().kind() == BackendKind::kCuda) {
    TZ_ASSIGN_OR_RETURN(state->device, detail::make_cuda_trainer(engine, cfg, cuda));
  }
  return std::unique_ptr<GptTrainer>(new GptTrainer(std::move(state)));
}

Expected<double> GptTrainer::train_micro_batch(const TokenBatch& batch) {
  State& st = *state_;
  TZ_TRY(detail::check_batch(st.cfg, batch));
  if (st.device != nullptr) return st.device->train_micro_batch(batch);
  const detail::Shape s = detail::shape_of(st.cfg, batch.batch, batch.seq);
  const auto layers = static_cast<std::size_t>(st.cfg.layers);
  st.ws.resize(s, st.cfg.layers);
  {
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, st.engine.fetch(0));
    st.load(p, st.w);
    detail::embed_forward(s, st.block(0), st.w.data(), batch.inputs.data(), st.ws.stream(0));
  }
  for (std::size_t l = 0; l < layers; ++l) {
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, st.engine.fetch(1 + l));
    st.load(p, st.w);
    detail::layer_forward(s, st.block(1 + l), st.w.data(), st.ws, l);
  }
  double loss = 0;
  {  // Note [Tied embedding]: the head, fetched again and held through its backward.
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, st.engine.fetch(0));
    st.load(p, st.w_embed);
    st.zero(st.g_embed, 0);
    loss = detail::head(s, st.block(0), st.w_embed.data(), batch.targets.data(), st.engine.loss_scale(), st.ws,
                        st.g_embed.data());
  }
  for (std::size_t l = layers; l-- > 0;) {
    TZ_ASSIGN_OR_RETURN(GatheredBlock p, st.engine.fetch(1 + l));
    st.load(p, st.w);
    st.zero(st.g, 1 + l);
    detail::layer_backward(s, st.block(1 + l), st.w.data(), st.ws, l, st.g.data());
    TZ_TRY_CTX(st.reduce(1 + l, st.g), "reducing the gradients of {}", st.block(1 + l).name);
  }
  detail::embed_backward(s, st.block(0), batch.inputs.data(), st.ws.dx.data(), st.g_embed.data());
  TZ_TRY_CTX(st.reduce(0, st.g_embed), "reducing the gradients of {}", st.block(0).name);
  return loss;
}

Expected<double> GptTrainer::eval_loss(const std::vector<TokenBatch>& batches) {
  State& st = *state_;
  if (batches.empty()) return invalid_argument("eval_loss: no batches");
  for (const TokenBatch& b : batches) TZ_TRY(detail::check_batch(st.cfg, b));
  if (st.device != nullptr) return st.device->eval_loss(batches);
  auto load_master = [&](std::size_t b, std::vector<float>& out) -> Status {
    TZ_ASSIGN_OR_RETURN(std::vector<float> master, st.engine.gather_master(b));
    out.resize(st.block(b).used_numel);
    for (std::size_t i = 0; i < out.size(); ++i) {
      switch (st.param_type) {
        case DType::kFp32: out[i] = master[i]; break;
        case DType::kBf16: out[i] = kernels::bf16_to_fp32(kernels::fp32_to_bf16(master[i])); break;
        case DType::kFp16: out[i] = kernels::fp16_to_fp32(kernels::fp32_to_fp16(master[i])); break;
        default: out[i] = master[i]; break;  // the engine's parameters are fp32, bf16 or fp16
      }
    }
    return ok_status();
  };
  // Block by block over every batch: only each batch's residual stream is
  // kept between blocks, and a one-layer workspace computes each block.
  std::vector<std::vector<float>> streams(batches.size());
  TZ_TRY_CTX(load_master(0, st.w_embed), "evaluating");
  detail::Workspace<float> ws;
  auto shape = [&](const TokenBatch& b) { return detail::shape_of(st.cfg, b.batch, b.seq); };
  for (std::size_t i = 0; i < batches.size(); ++i) {
    streams[i].resize(shape(batches[i]).rows() * st.cfg.hidden);
    detail::embed_forward(shape(batches[i]), st.block(0), st.w_embed.data(), batches[i].inputs.data(), streams[i].data());
  }
  for (std::size_t l = 0; l < static_cast<std::size_t>(st.cfg.layers); ++l) {
    TZ_TRY_CTX(load_master(1 + l, st.w), "evaluating");
    for (std::size_t i = 0; i < batches.size(); ++i) {
      ws.resize(shape(batches[i]), 1);
      std::copy(streams[i].begin(), streams[i].end(), ws.layers[0].x_in.begin());
      detail::layer_forward(shape(batches[i]), st.block(1 + l), st.w.data(), ws, 0);
      std::copy(ws.x_final.begin(), ws.x_final.end(), streams[i].begin());
    }
  }
  double sum = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    ws.resize(shape(batches[i]), 0);
    std::copy(streams[i].begin(), streams[i].end(), ws.x_final.begin());
    sum += detail::head<float>(shape(batches[i]), st.block(0), st.w_embed.data(), batches[i].targets.data(), 1.0, ws,
                               nullptr);
  }
  return sum / static_cast<double>(batches.size());
}

}  // namespace tz::train
