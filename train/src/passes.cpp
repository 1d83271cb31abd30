// The GPT's pieces on plain weights (passes.h).
#include "passes.h"

#include <algorithm>

namespace tz::train::detail {
namespace {

template <typename T>
void add_into(T* out, const T* a, const T* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

template <typename T>
void Workspace<T>::resize(const Shape& s, int num_layers) {
  shape = s;
  const std::size_t n = s.rows(), h = static_cast<std::size_t>(s.hidden);
  layers.resize(static_cast<std::size_t>(num_layers));
  for (LayerActs<T>& a : layers) {
    for (auto* v : {&a.x_in, &a.ln1, &a.att, &a.x_mid, &a.ln2}) v->resize(n * h);
    for (auto* v : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) v->resize(n);
    a.qkv.resize(n * 3 * h);
    a.probs.resize(static_cast<std::size_t>(s.batch) * s.heads * s.seq * s.seq);
    a.fc.resize(n * 4 * h);
    a.gelu.resize(n * 4 * h);
  }
  for (auto* v : {&x_final, &lnf, &dx, &dx_next, &d_mid, &d_tmp, &d_att}) v->resize(n * h);
  lnf_mean.resize(n);
  lnf_rstd.resize(n);
  logits.resize(n * s.vocab);
  dlogits.resize(n * s.vocab);
  d_qkv.resize(n * 3 * h);
  d_ffn.resize(n * 4 * h);
}

template <typename T>
void embed_forward(const Shape& s, const BlockLayout& embed, const T* w, const std::int32_t* tokens, T* x) {
  embedding_forward(tokens, param(w, embed, kWte), param(w, embed, kWpe), x, s.batch, s.seq, s.hidden);
}

template <typename T>
void embed_backward(const Shape& s, const BlockLayout& embed, const std::int32_t* tokens, const T* dx, T* g) {
  embedding_backward(tokens, dx, param(g, embed, kWte), param(g, embed, kWpe), s.batch, s.seq, s.hidden);
}

template <typename T>
void layer_forward(const Shape& s, const BlockLayout& block, const T* w, Workspace<T>& ws, std::size_t l) {
  LayerActs<T>& a = ws.layers[l];
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  auto p = [&](std::size_t i) { return param(w, block, i); };
  layernorm_forward(a.x_in.data(), p(kLn1W), p(kLn1B), a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), n, h);
  linear_forward(a.ln1.data(), p(kQkvW), p(kQkvB), a.qkv.data(), n, h, 3 * h);
  attention_forward(a.qkv.data(), a.att.data(), a.probs.data(), {s.batch, s.seq, s.heads, h});
  linear_forward(a.att.data(), p(kProjW), p(kProjB), a.x_mid.data(), n, h, h);
  add_into(a.x_mid.data(), a.x_mid.data(), a.x_in.data(), a.x_mid.size());
  layernorm_forward(a.x_mid.data(), p(kLn2W), p(kLn2B), a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), n, h);
  linear_forward(a.ln2.data(), p(kFcW), p(kFcB), a.fc.data(), n, h, 4 * h);
  gelu_forward(a.fc.data(), a.gelu.data(), a.fc.size());
  T* out = ws.stream(l + 1);
  linear_forward(a.gelu.data(), p(kFc2W), p(kFc2B), out, n, 4 * h, h);
  add_into(out, out, a.x_mid.data(), a.x_mid.size());
}

template <typename T>
void layer_backward(const Shape& s, const BlockLayout& block, const T* w, Workspace<T>& ws, std::size_t l, T* g) {
  const LayerActs<T>& a = ws.layers[l];
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  const std::size_t nh = s.rows() * h;
  auto p = [&](std::size_t i) { return param(w, block, i); };
  auto d = [&](std::size_t i) { return param(g, block, i); };
  // MLP: out = x_mid + fc2(gelu(fc(ln2(x_mid)))).
  linear_backward(a.gelu.data(), p(kFc2W), ws.dx.data(), ws.d_ffn.data(), d(kFc2W), d(kFc2B), n, 4 * h, h);
  gelu_backward(a.fc.data(), ws.d_ffn.data(), ws.d_ffn.data(), ws.d_ffn.size());
  linear_backward(a.ln2.data(), p(kFcW), ws.d_ffn.data(), ws.d_tmp.data(), d(kFcW), d(kFcB), n, h, 4 * h);
  layernorm_backward(a.x_mid.data(), p(kLn2W), a.ln2_mean.data(), a.ln2_rstd.data(), ws.d_tmp.data(),
                     ws.d_att.data(), d(kLn2W), d(kLn2B), n, h);
  add_into(ws.d_mid.data(), ws.dx.data(), ws.d_att.data(), nh);
  // Attention: x_mid = x_in + proj(attention(qkv(ln1(x_in)))).
  linear_backward(a.att.data(), p(kProjW), ws.d_mid.data(), ws.d_att.data(), d(kProjW), d(kProjB), n, h, h);
  attention_backward(a.qkv.data(), a.probs.data(), ws.d_att.data(), ws.d_qkv.data(), {s.batch, s.seq, s.heads, h});
  linear_backward(a.ln1.data(), p(kQkvW), ws.d_qkv.data(), ws.d_tmp.data(), d(kQkvW), d(kQkvB), n, h, 3 * h);
  layernorm_backward(a.x_in.data(), p(kLn1W), a.ln1_mean.data(), a.ln1_rstd.data(), ws.d_tmp.data(),
                     ws.d_att.data(), d(kLn1W), d(kLn1B), n, h);
  add_into(ws.dx.data(), ws.d_mid.data(), ws.d_att.data(), nh);
}

template <typename T>
double head(const Shape& s, const BlockLayout& embed, const T* w, const std::int32_t* targets, double scale,
            Workspace<T>& ws, T* g) {
  const int n = static_cast<int>(s.rows()), h = s.hidden;
  layernorm_forward(ws.x_final.data(), param(w, embed, kLnfW), param(w, embed, kLnfB), ws.lnf.data(),
                    ws.lnf_mean.data(), ws.lnf_rstd.data(), n, h);
  // The tied head: logits = lnf wte^T, wte (vocab, hidden) being nn.Linear's (out, in).
  linear_forward<T>(ws.lnf.data(), param(w, embed, kWte), nullptr, ws.logits.data(), n, h, s.vocab);
  const double loss = cross_entropy(ws.logits.data(), targets, g != nullptr ? ws.dlogits.data() : nullptr, n, s.vocab,
                                    scale);
  if (g == nullptr) return loss;
  linear_backward<T>(ws.lnf.data(), param(w, embed, kWte), ws.dlogits.data(), ws.d_tmp.data(), param(g, embed, kWte),
                     nullptr, n, h, s.vocab);
  layernorm_backward(ws.x_final.data(), param(w, embed, kLnfW), ws.lnf_mean.data(), ws.lnf_rstd.data(),
                     ws.d_tmp.data(), ws.dx.data(), param(g, embed, kLnfW), param(g, embed, kLnfB), n, h);
  return loss;
}

#define TZ_TRAIN_INSTANTIATE(T)                                                                                     \
  template struct Workspace<T>;                                                                                     \
  template void embed_forward<T>(const Shape&, const BlockLayout&, const T*, const std::int32_t*, T*);              \
  template void embed_backward<T>(const Shape&, const BlockLayout&, const std::int32_t*, const T*, T*);             \
  template void layer_forward<T>(const Shape&, const BlockLayout&, const T*, Workspace<T>&, std::size_t);           \
  template void layer_backward<T>(const Shape&, const BlockLayout&, const T*, Workspace<T>&, std::size_t, T*);      \
  template double head<T>(const Shape&, const BlockLayout&, const T*, const std::int32_t*, double, Workspace<T>&, T*);
TZ_TRAIN_INSTANTIATE(float)
TZ_TRAIN_INSTANTIATE(double)
#undef TZ_TRAIN_INSTANTIATE

}  // namespace tz::train::detail
