// The GPT on CUDA: GptTrainer's backend for CUDA engines, and
// forward_backward_cuda (tierzero/train/gpt.h). Same blocks, same order and
// the same Note [Tied embedding] protocol as gpt.cpp; the arithmetic is
// gpt_cuda_passes.cpp's.
//
// Note [CUDA block lifetimes]
// fetch() returns with the block's 16-bit parameters in device memory, ready;
// the trainer casts them into its fp32 copy on its own stream and waits for
// that stream before the GatheredBlock is released (the wait also covers the
// previous block's compute, which ran on the same stream), then enqueues this
// block's compute and returns to fetch the next block while the GPU works.
// A block's gradients are cast into the engine's GradBlock and the stream is
// waited for before reduce_grads takes the buffer. The embed block stays
// fetched through the head and its backward (head() waits for the loss).
#include <cuda_runtime.h>

#include <algorithm>

#include "gpt_cuda.h"
#include "trainer_backend.h"

namespace tz::train {
namespace {

using cuda::Context;
using cuda::DeviceArray;
using cuda::Workspace;

// The trainer's own GPU memory (activations, fp32 block copies) is cudaMalloc'd
// beside the engine's budgeted pool, not in it: when it does not fit, say so
// and what to change, instead of a bare cudaMalloc error.
Status explain_oom(Status s, std::string_view what) {
  if (s.ok() || s.code() != ErrorCode::kOutOfMemory) return s;
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
  return std::move(s).with_context(fmt::format(
      "{} does not fit on the GPU ({} of {} free): the CUDA GPT's activations and fp32 block copies live outside the "
      "engine's device budget (tierzero.tiers.gpu_bytes, --gpu-bytes), so leave them room: lower --gpu-bytes, or "
      "--batch or --seq",
      what, format_bytes(free), format_bytes(total)));
}

class CudaTrainer final : public detail::TrainerBackend {
 public:
  CudaTrainer(ZeroEngine& engine, const GptConfig& cfg, std::unique_ptr<Context> ctx)
      : engine_(engine), cfg_(cfg), ctx_(std::move(ctx)) {}

  // Sizes the weight and gradient copies for the largest block.
  Status init() {
    std::size_t largest = 0;
    for (const BlockLayout& b : engine_.layout().blocks) largest = std::max<std::size_t>(largest, b.used_numel);
    for (DeviceArray<float>* a : {&w_, &g_}) TZ_TRY(a->resize(largest));
    TZ_TRY(w_embed_.resize(block(0).used_numel));
    TZ_TRY(g_embed_.resize(block(0).used_numel));
    return ok_status();
  }

  Expected<double> train_micro_batch(const TokenBatch& batch) override {
    const detail::Shape s = detail::shape_of(cfg_, batch.batch, batch.seq);
    const auto layers = static_cast<std::size_t>(cfg_.layers);
    TZ_TRY(explain_oom(ws_.resize(s, cfg_.layers),
                       fmt::format("the activations of {} x {} tokens through {} layers", batch.batch, batch.seq,
                                   cfg_.layers)));
    TZ_TRY(cuda::upload_tokens(*ctx_, batch, ws_));
    {
      TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine_.fetch(0));
      TZ_TRY(load(p, w_));
    }
    TZ_TRY(cuda::embed_forward(*ctx_, s, block(0), w_.data(), ws_.tokens.data(), ws_.stream(0)));
    for (std::size_t l = 0; l < layers; ++l) {
      {
        TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine_.fetch(1 + l));
        TZ_TRY(load(p, w_));
      }
      TZ_TRY_CTX(cuda::layer_forward(*ctx_, s, block(1 + l), w_.data(), ws_, l), "forward of {}", block(1 + l).name);
    }
    double loss = 0;
    {  // Note [Tied embedding]: the head, fetched again and held through its backward.
      TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine_.fetch(0));
      TZ_TRY(load(p, w_embed_));
      TZ_TRY(zero(g_embed_, 0));
      TZ_ASSIGN_OR_RETURN(loss, cuda::head(*ctx_, s, block(0), w_embed_.data(), engine_.loss_scale(), ws_,
                                           g_embed_.data()));
    }
    for (std::size_t l = layers; l-- > 0;) {
      {
        TZ_ASSIGN_OR_RETURN(GatheredBlock p, engine_.fetch(1 + l));
        TZ_TRY(load(p, w_));
      }
      TZ_TRY(zero(g_, 1 + l));
      TZ_TRY_CTX(cuda::layer_backward(*ctx_, s, block(1 + l), w_.data(), ws_, l, g_.data()), "backward of {}",
                 block(1 + l).name);
      TZ_TRY_CTX(reduce(1 + l, g_), "reducing the gradients of {}", block(1 + l).name);
    }
    TZ_TRY(cuda::embed_backward(*ctx_, s, block(0), ws_.tokens.data(), ws_.dx.data(), g_embed_.data()));
    TZ_TRY_CTX(reduce(0, g_embed_), "reducing the gradients of {}", block(0).name);
    return loss;
  }

  // gpt.cpp's eval_loss on the GPU: block by block over every batch, each
  // batch's residual stream kept on the device between blocks.
  Expected<double> eval_loss(const std::vector<TokenBatch>& batches) override {
    auto shape = [&](const TokenBatch& b) { return detail::shape_of(cfg_, b.batch, b.seq); };
    if (eval_streams_.size() < batches.size()) eval_streams_.resize(batches.size());
    TZ_TRY_CTX(load_master(0, w_embed_), "evaluating");
    for (std::size_t i = 0; i < batches.size(); ++i) {
      const detail::Shape s = shape(batches[i]);
      TZ_TRY(eval_streams_[i].resize(s.rows() * static_cast<std::size_t>(cfg_.hidden)));
      TZ_TRY(eval_ws_.resize(s, 1));
      TZ_TRY(cuda::upload_tokens(*ctx_, batches[i], eval_ws_));
      TZ_TRY(cuda::embed_forward(*ctx_, s, block(0), w_embed_.data(), eval_ws_.tokens.data(), eval_streams_[i].data()));
    }
    for (std::size_t l = 0; l < static_cast<std::size_t>(cfg_.layers); ++l) {
      TZ_TRY_CTX(load_master(1 + l, w_), "evaluating");
      for (std::size_t i = 0; i < batches.size(); ++i) {
        TZ_TRY(eval_ws_.resize(shape(batches[i]), 1));
        TZ_TRY(copy(eval_streams_[i], eval_ws_.layers[0].x_in.data()));
        TZ_TRY(cuda::layer_forward(*ctx_, shape(batches[i]), block(1 + l), w_.data(), eval_ws_, 0));
        TZ_TRY(copy(eval_ws_.x_final, eval_streams_[i].data()));
      }
    }
    double sum = 0;
    for (std::size_t i = 0; i < batches.size(); ++i) {
      TZ_TRY(eval_ws_.resize(shape(batches[i]), 1));
      TZ_TRY(cuda::upload_tokens(*ctx_, batches[i], eval_ws_));
      TZ_TRY(copy(eval_streams_[i], eval_ws_.x_final.data()));
      TZ_ASSIGN_OR_RETURN(double loss,
                          cuda::head(*ctx_, shape(batches[i]), block(0), w_embed_.data(), 1.0, eval_ws_, nullptr));
      sum += loss;
    }
    return sum / static_cast<double>(batches.size());
  }

  std::string describe() const override {
    return fmt::format("{}, fp32 activations, cuBLAS {}", engine_.device().name(),
                       ctx_->tf32() ? "TF32 tensor-op math" : "full fp32 math");
  }

 private:
  const BlockLayout& block(std::size_t b) const { return engine_.layout().blocks[b]; }

  // w = the gathered block's parameters as fp32; waits (Note [CUDA block lifetimes]).
  Status load(const GatheredBlock& p, DeviceArray<float>& w) {
    TZ_TRY(cuda::to_fp32(*ctx_, p.data(), p.type(), w.data(), block(p.block()).used_numel));
    return ctx_->synchronize();
  }

  // w = block b's fp32 master weights rounded to the parameter type, as fetch would hand them out.
  Status load_master(std::size_t b, DeviceArray<float>& w) {
    TZ_ASSIGN_OR_RETURN(std::vector<float> master, engine_.gather_master(b));
    const std::size_t n = block(b).used_numel;
    TZ_CUDA_CHECK(cudaMemcpyAsync(w.data(), master.data(), n * sizeof(float), cudaMemcpyHostToDevice, ctx_->stream()));
    TZ_TRY(cuda::round_through(*ctx_, w.data(), engine_.param_type(), n));
    return ctx_->synchronize();  // `master` goes away on return
  }

  Status zero(DeviceArray<float>& g, std::size_t b) {
    TZ_CUDA_CHECK(cudaMemsetAsync(g.data(), 0, block(b).used_numel * sizeof(float), ctx_->stream()));
    return ok_status();
  }

  Status copy(const DeviceArray<float>& src, float* d_dst) {
    TZ_CUDA_CHECK(cudaMemcpyAsync(d_dst, src.data(), src.bytes(), cudaMemcpyDeviceToDevice, ctx_->stream()));
    return ok_status();
  }

  // Hands block b's fp32 gradients to the engine in its gradient type (Note [CUDA block lifetimes]).
  Status reduce(std::size_t b, const DeviceArray<float>& g) {
    TZ_ASSIGN_OR_RETURN(GradBlock gb, engine_.grad_buffer(b));
    TZ_TRY(cuda::from_fp32(*ctx_, g.data(), gb.type(), gb.data(), block(b).used_numel));
    TZ_TRY(ctx_->synchronize());
    return engine_.reduce_grads(std::move(gb));
  }

  ZeroEngine& engine_;
  GptConfig cfg_;
  std::unique_ptr<Context> ctx_;
  Workspace ws_, eval_ws_;                       // training (every layer); evaluation (one layer)
  std::vector<DeviceArray<float>> eval_streams_; // (rows, H) per evaluation batch
  DeviceArray<float> w_;        // (used_numel,) fp32 weights of the block being computed
  DeviceArray<float> w_embed_;  // the embed block's, for the head
  DeviceArray<float> g_;        // (used_numel,) fp32 gradients of the block
  DeviceArray<float> g_embed_;  // Note [Tied embedding]
};

// The CUDA device the engine computes on becomes this thread's current one,
// so the trainer's stream, handle and buffers live beside the engine's.
Status use_engine_device(ZeroEngine& engine) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Stream> probe, engine.device().create_stream());
  int ordinal = 0;
  TZ_CUDA_CHECK(cudaStreamGetDevice(static_cast<cudaStream_t>(probe->native_handle()), &ordinal));
  TZ_CUDA_CHECK(cudaSetDevice(ordinal));
  return ok_status();
}

Status check_blocks(const char* what, const ModelLayout& layout, std::size_t blocks, auto size_of) {
  if (blocks != layout.blocks.size()) {
    return invalid_argument("forward_backward_cuda: {} has {} blocks; the layout has {}", what, blocks,
                            layout.blocks.size());
  }
  for (std::size_t b = 0; b < blocks; ++b) {
    if (size_of(b) < layout.blocks[b].used_numel) {
      return invalid_argument("forward_backward_cuda: {}[{}] ({}) has {} elements; it needs {}", what, b,
                              layout.blocks[b].name, size_of(b), layout.blocks[b].used_numel);
    }
  }
  return ok_status();
}

}  // namespace

namespace detail {

Expected<std::unique_ptr<TrainerBackend>> make_cuda_trainer(ZeroEngine& engine, const GptConfig& cfg,
                                                            const CudaOptions& options) {
  TZ_TRY_CTX(use_engine_device(engine), "binding the CUDA GPT to the engine's device");
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Context> ctx, Context::create({.tf32 = options.tf32}));
  auto trainer = std::make_unique<CudaTrainer>(engine, cfg, std::move(ctx));
  TZ_TRY(explain_oom(trainer->init(), "the CUDA GPT's fp32 weight and gradient copies of the largest block"));
  return std::unique_ptr<TrainerBackend>(std::move(trainer));
}

}  // namespace detail

bool cuda_gpt_built() { return true; }

Expected<double> forward_backward_cuda(const GptConfig& cfg, const ModelLayout& layout,
                                       const std::vector<std::vector<float>>& weights, const TokenBatch& batch,
                                       double loss_scale, std::vector<std::vector<float>>* grads,
                                       const CudaOptions& options) {
  TZ_TRY(cfg.validate());
  TZ_TRY(detail::check_batch(cfg, batch));
  TZ_TRY(check_blocks("weights", layout, weights.size(), [&](std::size_t b) { return weights[b].size(); }));
  if (grads != nullptr) {
    TZ_TRY(check_blocks("grads", layout, grads->size(), [&](std::size_t b) { return (*grads)[b].size(); }));
  }
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Context> ctx, Context::create({.tf32 = options.tf32}));
  const std::size_t blocks = layout.blocks.size();
  std::vector<DeviceArray<float>> d_w(blocks), d_g(blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t n = layout.blocks[b].used_numel;
    TZ_TRY(d_w[b].resize(n));
    TZ_CUDA_CHECK(cudaMemcpy(d_w[b].data(), weights[b].data(), n * sizeof(float), cudaMemcpyHostToDevice));
    if (grads != nullptr) {
      TZ_TRY(d_g[b].resize(n));
      TZ_CUDA_CHECK(cudaMemset(d_g[b].data(), 0, n * sizeof(float)));
    }
  }
  const detail::Shape s = detail::shape_of(cfg, batch.batch, batch.seq);
  Workspace ws;
  TZ_TRY(ws.resize(s, cfg.layers));
  TZ_TRY(cuda::upload_tokens(*ctx, batch, ws));
  TZ_TRY(cuda::embed_forward(*ctx, s, layout.blocks[0], d_w[0].data(), ws.tokens.data(), ws.stream(0)));
  for (std::size_t l = 0; l < static_cast<std::size_t>(cfg.layers); ++l) {
    TZ_TRY(cuda::layer_forward(*ctx, s, layout.blocks[1 + l], d_w[1 + l].data(), ws, l));
  }
  float* g_embed = grads != nullptr ? d_g[0].data() : nullptr;
  TZ_ASSIGN_OR_RETURN(double loss, cuda::head(*ctx, s, layout.blocks[0], d_w[0].data(), loss_scale, ws, g_embed));
  if (grads == nullptr) return loss;
  for (std::size_t l = static_cast<std::size_t>(cfg.layers); l-- > 0;) {
    TZ_TRY(cuda::layer_backward(*ctx, s, layout.blocks[1 + l], d_w[1 + l].data(), ws, l, d_g[1 + l].data()));
  }
  TZ_TRY(cuda::embed_backward(*ctx, s, layout.blocks[0], ws.tokens.data(), ws.dx.data(), g_embed));
  TZ_TRY(ctx->synchronize());
  for (std::size_t b = 0; b < blocks; ++b) {  // added to, as forward_backward does
    const std::size_t n = layout.blocks[b].used_numel;
    std::vector<float> host(n);
    TZ_CUDA_CHECK(cudaMemcpy(host.data(), d_g[b].data(), n * sizeof(float), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < n; ++i) (*grads)[b][i] += host[i];
  }
  return loss;
}

}  // namespace tz::train
