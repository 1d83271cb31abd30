// A GPT-style decoder trained through ZeroEngine, on the CPU or on CUDA.
//
// The model (GPT-2's shape): token and position embeddings; `layers`
// pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP
// (4x wide), each with a residual connection; a final LayerNorm; the LM head
// tied to the token embedding; mean cross-entropy over every position.
//
// How it is registered with the engine (tz::train::model):
//   block 0       "embed": wte (vocab, hidden), wpe (seq, hidden), ln_f.w, ln_f.b (hidden)
//   block 1 + l   "h<l>":  ln1.w, ln1.b, attn.qkv.w (3h, h), attn.qkv.b, attn.proj.w (h, h),
//                          attn.proj.b, ln2.w, ln2.b, mlp.fc.w (4h, h), mlp.fc.b, mlp.proj.w (h, 4h),
//                          mlp.proj.b
// Linear weights are (out, in), as nn.Linear stores them, so the engine's
// safetensors export reads like a PyTorch GPT's state dict.
//
// One micro-batch (GptTrainer::train_micro_batch) fetches blocks in the order
// embed, h0 .. h<L-1>, embed (the head, kept through its backward),
// h<L-1> .. h0; see Note [Tied embedding] in gpt.cpp for how the two uses of
// wte share one gradient. Arithmetic is fp32 on the engine's parameters
// (bf16, fp16, or fp32 when the config enables neither), as tz::mlp does;
// the operators are in tierzero/train/ops.h.
//
//   tz::train::GptConfig cfg{.layers = 4, .hidden = 256, .heads = 4, .seq = 128, .batch = 8};
//   TZ_TRY(cfg.validate());
//   TZ_ASSIGN_OR_RETURN(auto engine, tz::ZeroEngine::create(opts, tz::train::model(cfg), tz::train::init(cfg)));
//   TZ_ASSIGN_OR_RETURN(auto gpt, tz::train::GptTrainer::create(*engine, cfg));
//   for (step ...) {
//     for (micro ...) {
//       TZ_ASSIGN_OR_RETURN(double loss, gpt->train_micro_batch(batch));
//       TZ_ASSIGN_OR_RETURN(tz::StepReport r, engine->step());
//     }
//   }
//
// Where it computes follows the engine's device: a Host-backend engine gets
// the CPU operators (fp32, oneTBB over the cores); a CUDA engine gets the CUDA
// twin (gpt_cuda*.{h,cpp,cu}: fp32 activations, cuBLAS SGEMMs, optionally on
// TF32 tensor cores, see CudaOptions), the same model, block order and
// protocol; forward_backward_cuda is its in-memory entry point, tested
// against forward_backward<double>.
//
// Threads: one training thread calls a GptTrainer (as for ZeroEngine); the
// CPU operators spread over the cores with oneTBB; the CUDA path uses one
// stream and one cuBLAS handle of its own, on the engine's device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tierzero/engine.h"
#include "tierzero/train/data.h"

namespace tz::train {

struct GptConfig {
  int layers = 2;
  int hidden = 64;
  int heads = 4;
  int seq = 32;             // context length (wpe rows); batches may be shorter
  int batch = 2;            // sequences per micro-batch per rank
  int vocab = kByteVocab;
  std::uint64_t seed = 1234;   // initial weights
  double init_std = 0.02;      // GPT-2's; residual projections get init_std / sqrt(2 layers)

  // Every size >= 1, hidden divisible by heads; the error names the value.
  Status validate() const;
  std::uint64_t param_count() const;   // what the engine's layout counts (no padding)
  // Training FLOPs per token (forward + backward): 6 x parameters (the tied
  // head's matmul counted once through wte) + 12 x layers x hidden x seq for
  // attention's score and value products, the usual estimate (PaLM, app. B).
  double flops_per_token() const;
  // Host memory the CPU trainer holds besides the engine for one micro-batch
  // of batch x seq tokens: its fp32 activations and backward scratch
  // (detail::Workspace, exactly) and its fp32 copies of the embedding block
  // and one transformer block's weights and gradients. tierzero-train refuses
  // a --batch or --seq whose activations do not fit in available memory.
  std::uint64_t activation_bytes() const;
  // What the CPU trainer's eval_loss holds besides activation_bytes() for
  // `batches` micro-batches of batch x seq tokens: a one-layer workspace,
  // each batch's residual stream, and one block's fp32 master as gathered.
  std::uint64_t evaluation_bytes(int batches) const;
};

// Parameter indices within the blocks.
enum EmbedParam : std::size_t { kWte = 0, kWpe, kLnfW, kLnfB, kNumEmbedParams };
enum LayerParam : std::size_t {
  kLn1W = 0, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFc2W, kFc2B, kNumLayerParams
};

std::vector<BlockSpec> model(const GptConfig& cfg);

// Note [Default warm-up]
// Adam's first update moves every weight by about the learning rate, all in
// the direction of its gradient's sign. At width h a linear layer's output
// then moves by about lr x h x |x| per layer, coherently, and the residual
// stream of GPT-2's initialisation is small: past a threshold the first step
// raises the loss instead of lowering it (bench/RESULTS.md, issue #25: at
// width 4096, layers x lr above ~1e-5 rises; 6 x 384 at 3e-4 falls). The
// threshold measured falls as layers x hidden^2, so the warm-up that keeps
// the first step's learning rate under it is
//     ceil(lr x layers x hidden^2 / kWarmupScale)  steps,
// none when that is 1 or less. kWarmupScale = 100 sits below the threshold
// measured at width 4096 (~168) so the first step falls with some margin.
inline constexpr double kWarmupScale = 100.0;
// The steps of the linear learning-rate warm-up tierzero-train uses when
// neither --warmup-steps nor a scheduler block says otherwise (0: none).
std::int64_t default_warmup_steps(const GptConfig& cfg, double lr);
// GPT-2's initialisation: linear and embedding weights normal(0, init_std),
// attn.proj.w and mlp.proj.w normal(0, init_std / sqrt(2 layers)), biases 0,
// LayerNorm weights 1. Counter-based, so every rank produces the same values.
ParamInit init(const GptConfig& cfg);

// How the CUDA GPT computes (ignored on the CPU).
struct CudaOptions {
  // cuBLAS runs the fp32 matmuls on TF32 tensor cores
  // (CUBLAS_TF32_TENSOR_OP_MATH): inputs rounded to 10-bit mantissas, fp32
  // accumulation; several times faster on A100/H100, ~1e-3 relative error in
  // the products. Off (the default): full fp32, what the tests compare.
  bool tf32 = false;
};

// Drives micro-batches of the GPT through an engine created from model(cfg).
class GptTrainer {
 public:
  // Checks that the engine's layout is model(cfg)'s (block and parameter
  // names and shapes); the error names the first difference. Computes on the
  // CPU for a Host-backend engine and on the GPU for a CUDA one (Unavailable
  // when this build has no CUDA GPT; a CUDA error names the call).
  static Expected<std::unique_ptr<GptTrainer>> create(ZeroEngine& engine, const GptConfig& cfg,
                                                      const CudaOptions& cuda = {});
  ~GptTrainer();

  // Where the GPT computes: BackendKind::kHost (the CPU) or kCuda.
  BackendKind backend() const;
  // One line for logs: "CPU (fp32, N threads)" or the CUDA device and math mode.
  std::string describe() const;

  // Forward, loss, backward and reduce_grads for every block; not step().
  // The loss is multiplied by engine.loss_scale() for backward (fp16); the
  // returned loss is the unscaled mean cross-entropy. Tokens must lie in
  // [0, vocab) and batch.seq <= cfg.seq (an InvalidArgument otherwise).
  Expected<double> train_micro_batch(const TokenBatch& batch);

  // The mean loss over `batches` without training. It reads the fp32 master
  // weights (ZeroEngine::gather_master, rounded to the parameter type, which
  // is exactly what fetch would hand out: bf16, fp16, or fp32 itself) instead of fetching, so an
  // evaluation between steps leaves the prefetch trace alone; each block is
  // read once for all the batches (4 B/param from the master's tier). A
  // collective: every rank calls it at the same point, between steps.
  Expected<double> eval_loss(const std::vector<TokenBatch>& batches);

 private:
  struct State;
  explicit GptTrainer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The whole model on in-memory weights: weights[b] is block b's parameters
// laid out as layout.blocks[b] lays them (used_numel elements). Returns the
// mean loss; when `grads` is given, grads[b] (same layout) gets d(loss *
// loss_scale) added. float runs exactly the arithmetic GptTrainer runs; double
// is what the finite-difference tests check against.
template <typename T>
double forward_backward(const GptConfig& cfg, const ModelLayout& layout, const std::vector<std::vector<T>>& weights,
                        const TokenBatch& batch, double loss_scale, std::vector<std::vector<T>>* grads);

// True when this build has the CUDA GPT (TIERZERO_CUDA=ON).
bool cuda_gpt_built();

// forward_backward<float> on the current CUDA device: uploads the weights
// (weights[b] at least used_numel long), runs the same model with CUDA
// kernels and cuBLAS, and downloads; grads[b] (when given) gets d(loss *
// loss_scale) added. Returns the mean loss. Allocates and frees its own
// device memory per call (a test and debugging entry point, not a hot path).
// Unavailable in builds without CUDA; InvalidArgument for a bad batch or
// block sizes; a CUDA/cuBLAS failure names the call.
Expected<double> forward_backward_cuda(const GptConfig& cfg, const ModelLayout& layout,
                                       const std::vector<std::vector<float>>& weights, const TokenBatch& batch,
                                       double loss_scale, std::vector<std::vector<float>>* grads,
                                       const CudaOptions& options = {});

// Micro-batch `micro` of rank `rank` in optimizer step `step`.
using BatchFn = std::function<TokenBatch(int rank, int micro, std::int64_t step)>;

// The same training with every state in memory, like tz::mlp::Reference:
// fp32 master weights, the 16-bit parameters rounded from them, each rank's
// gradients rounded to the gradient type and summed over ranks in it, the
// mean over ranks and micro-batches in fp32, global-norm clipping, and a
// plain Adam/AdamW in double (torch.optim semantics).
class Reference {
 public:
  // grad_type: the engine's (ZeroOptions::grad_type; default the parameter type).
  Reference(const GptConfig& cfg, const Config& config, int world_size, BatchFn batches,
            std::optional<DType> grad_type = {});
  // One optimizer step over world_size ranks x gradient_accumulation_steps
  // micro-batches. Returns the mean loss.
  double train_step(std::int64_t step);
  // Block b's fp32 master weights in the engine's layout (whole, padded).
  std::vector<float> master(std::size_t block) const { return states_.master(block); }
  const ModelLayout& layout() const { return states_.layout(); }

 private:
  GptConfig cfg_;
  int world_ = 1;
  BatchFn batches_;
  DType grad_type_ = DType::kBf16;
  ReferenceStates states_;
};

}  // namespace tz::train
