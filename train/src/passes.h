// The GPT's pieces, forward and backward, on plain weights: what
// GptTrainer runs between engine fetches and what forward_backward runs on
// in-memory weights (the reference and the finite-difference tests), so the
// two cannot drift apart.
//
// A block's weights and gradients are flat arrays in its engine layout
// (BlockLayout::params[i].offset); gradients are accumulated into.
#pragma once

#include <cstdint>
#include <vector>

#include "tierzero/engine/model.h"
#include "tierzero/train/gpt.h"
#include "tierzero/train/ops.h"

namespace tz::train::detail {

struct Shape {
  int batch = 1, seq = 1, hidden = 1, heads = 1, vocab = 1;
  std::size_t rows() const { return static_cast<std::size_t>(batch) * seq; }
};

inline Shape shape_of(const GptConfig& cfg, int batch, int seq) {
  return {.batch = batch, .seq = seq, .hidden = cfg.hidden, .heads = cfg.heads, .vocab = cfg.vocab};
}

// What one transformer block saves in forward for its backward.
template <typename T>
struct LayerActs {
  std::vector<T> x_in;                       // (N, H) the block's input (residual stream)
  std::vector<T> ln1, ln1_mean, ln1_rstd;    // (N, H), (N), (N)
  std::vector<T> qkv;                        // (N, 3H)
  std::vector<T> probs;                      // (B, heads, T, T)
  std::vector<T> att;                        // (N, H) heads' outputs, before attn.proj
  std::vector<T> x_mid;                      // (N, H) x_in + attn.proj(att)
  std::vector<T> ln2, ln2_mean, ln2_rstd;    // (N, H), (N), (N)
  std::vector<T> fc;                         // (N, 4H) before GELU
  std::vector<T> gelu;                       // (N, 4H)
};

// Every activation and scratch buffer of one micro-batch; resized (not
// reallocated) when the shape repeats.
template <typename T>
struct Workspace {
  Shape shape;
  std::vector<LayerActs<T>> layers;
  std::vector<T> x_final;                    // (N, H) the last block's output
  std::vector<T> lnf, lnf_mean, lnf_rstd;    // (N, H), (N), (N)
  std::vector<T> logits, dlogits;            // (N, V)
  std::vector<T> dx, dx_next;                // (N, H) gradient of the residual stream
  std::vector<T> d_mid, d_tmp, d_att;        // (N, H)
  std::vector<T> d_qkv;                      // (N, 3H)
  std::vector<T> d_ffn;                      // (N, 4H)

  void resize(const Shape& s, int layers);
  // The residual stream entering block l (l == layers: the final one).
  T* stream(std::size_t l) { return l < layers.size() ? layers[l].x_in.data() : x_final.data(); }
};

// Tokens in [0, vocab), 1 <= seq <= cfg.seq, sizes matching; InvalidArgument naming the first fault.
Status check_batch(const GptConfig& cfg, const TokenBatch& b);

template <typename T>
const T* param(const T* flat, const BlockLayout& block, std::size_t i) {
  return flat + block.params[i].offset;
}
template <typename T>
T* param(T* flat, const BlockLayout& block, std::size_t i) {
  return flat + block.params[i].offset;
}

// x (N, H) = wte[tokens] + wpe[positions].
template <typename T>
void embed_forward(const Shape& s, const BlockLayout& embed, const T* w, const std::int32_t* tokens, T* x);
// d wte, d wpe += the lookup's gradient from dx (N, H).
template <typename T>
void embed_backward(const Shape& s, const BlockLayout& embed, const std::int32_t* tokens, const T* dx, T* g);

// Block l: ws.stream(l) -> ws.stream(l + 1), saving ws.layers[l].
template <typename T>
void layer_forward(const Shape& s, const BlockLayout& block, const T* w, Workspace<T>& ws, std::size_t l);
// From ws.dx (gradient at the block's output) to ws.dx (at its input); g += the block's gradients.
template <typename T>
void layer_backward(const Shape& s, const BlockLayout& block, const T* w, Workspace<T>& ws, std::size_t l, T* g);

// Final LayerNorm, tied head and cross-entropy on ws.x_final. With g
// non-null, also backward: ws.dx = d(loss * scale) / d x_final, and g (the
// embed block's gradients: wte, ln_f) is added to. Returns the mean loss.
template <typename T>
double head(const Shape& s, const BlockLayout& embed, const T* w, const std::int32_t* targets, double scale,
            Workspace<T>& ws, T* g);

}  // namespace tz::train::detail
