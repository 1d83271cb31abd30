// The GPT operators (tierzero/train/ops.h): each backward against central
// finite differences of its forward, in double, on fresh random inputs (the
// objective is a random projection sum(r * output), whose gradient at the
// output is r); the float versions against the double ones; matmul's tiled
// kernel against the plain loop, and independent of the thread count.
#include <tbb/global_control.h>

#include "tierzero/train.h"
#include "train_test_util.h"

namespace tzt {
namespace {

using tz::train::Trans;

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return {v.begin(), v.end()};
}

// ---------------------------------------------------------------- matmul

template <typename T>
std::vector<T> run_matmul(const std::vector<double>& a, Trans ta, const std::vector<double>& b, Trans tb,
                          const std::vector<double>& c0, int m, int n, int k, bool acc) {
  std::vector<T> c = cast<T>(c0);
  const std::vector<T> at = cast<T>(a), bt = cast<T>(b);
  tz::train::matmul(at.data(), ta, bt.data(), tb, c.data(), m, n, k, acc);
  return c;
}

TEST(Matmul, FloatKernelMatchesThePlainLoopOnEveryShapeAndTransposition) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  struct Dims { int m, n, k; };
  // Tile edges (6 x 16), k chunks of 256, and sizes that are none of those.
  const Dims shapes[] = {{1, 1, 1}, {7, 19, 5}, {6, 16, 256}, {13, 33, 300}, {64, 48, 17}, {5, 130, 513}};
  double worst = 0;
  for (const Dims& d : shapes) {
    for (Trans ta : {Trans::kNo, Trans::kYes}) {
      for (Trans tb : {Trans::kNo, Trans::kYes}) {
        for (bool acc : {false, true}) {
          const auto a = random_vector(rng, static_cast<std::size_t>(d.m) * d.k);
          const auto b = random_vector(rng, static_cast<std::size_t>(d.k) * d.n);
          const auto c0 = random_vector(rng, static_cast<std::size_t>(d.m) * d.n);
          const auto want = run_matmul<double>(a, ta, b, tb, c0, d.m, d.n, d.k, acc);
          const auto got = run_matmul<float>(a, ta, b, tb, c0, d.m, d.n, d.k, acc);
          const double err = float_vs_double(got, want);
          worst = std::max(worst, err);
          EXPECT_LE(err, kFloatTolerance) << d.m << "x" << d.n << "x" << d.k << " ta=" << (ta == Trans::kYes)
                                          << " tb=" << (tb == Trans::kYes) << " acc=" << acc << " seed " << seed;
        }
      }
    }
  }
  std::printf("[ matmul ] float kernel vs double loop: largest relative error %.3g (seed %llu)\n", worst,
              static_cast<unsigned long long>(seed));
}

TEST(Matmul, ResultIsTheSameBitsWhateverTheThreadCount) {
  std::mt19937_64 rng(fresh_seed());
  const int m = 150, n = 200, k = 300;
  const auto a = random_vector(rng, static_cast<std::size_t>(m) * k);
  const auto b = random_vector(rng, static_cast<std::size_t>(k) * n);
  const std::vector<double> c0(static_cast<std::size_t>(m) * n, 0.0);
  std::vector<float> one, many;
  {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
    one = run_matmul<float>(a, Trans::kNo, b, Trans::kYes, c0, m, n, k, false);
  }
  many = run_matmul<float>(a, Trans::kNo, b, Trans::kYes, c0, m, n, k, false);
  EXPECT_EQ(one, many);
}

// ---------------------------------------------------------------- LayerNorm

template <typename T>
struct LnOut {
  std::vector<T> y, dx, dg, db;
};

template <typename T>
LnOut<T> run_layernorm(const std::vector<double>& x, const std::vector<double>& g, const std::vector<double>& b,
                       const std::vector<double>& r, int rows, int dim) {
  const auto xt = cast<T>(x), gt = cast<T>(g), bt = cast<T>(b), rt = cast<T>(r);
  LnOut<T> o{std::vector<T>(x.size()), std::vector<T>(x.size()), std::vector<T>(dim, 0), std::vector<T>(dim, 0)};
  std::vector<T> mean(rows), rstd(rows);
  tz::train::layernorm_forward(xt.data(), gt.data(), bt.data(), o.y.data(), mean.data(), rstd.data(), rows, dim);
  tz::train::layernorm_backward(xt.data(), gt.data(), mean.data(), rstd.data(), rt.data(), o.dx.data(), o.dg.data(),
                                o.db.data(), rows, dim);
  return o;
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(fresh_seed());
  const int rows = 5, dim = 24;
  auto x = random_vector(rng, rows * dim, 2.0);
  for (double& v : x) v += 3.0;  // a mean far from 0
  auto g = random_vector(rng, dim, 0.5);
  for (double& v : g) v += 1.0;
  auto b = random_vector(rng, dim);
  const auto r = random_vector(rng, rows * dim);
  const LnOut<double> d = run_layernorm<double>(x, g, b, r, rows, dim);
  auto objective = [&] { return dot(run_layernorm<double>(x, g, b, r, rows, dim).y, r); };
  const FdResult fx = fd_check(x, d.dx, objective), fg = fd_check(g, d.dg, objective), fb = fd_check(b, d.db, objective);
  report("LayerNorm dx", fx);
  report("LayerNorm dg", fg);
  report("LayerNorm db", fb);
  for (const FdResult& f : {fx, fg, fb}) EXPECT_LE(f.max_rel, kFdTolerance);
  const LnOut<float> f = run_layernorm<float>(x, g, b, r, rows, dim);
  EXPECT_LE(float_vs_double(f.y, d.y), kFloatTolerance);
  EXPECT_LE(float_vs_double(f.dx, d.dx), kFloatTolerance);
  EXPECT_LE(float_vs_double(f.dg, d.dg), kFloatTolerance);
}

// ---------------------------------------------------------------- attention

template <typename T>
struct AttnOut {
  std::vector<T> out, probs, dqkv;
};

template <typename T>
AttnOut<T> run_attention(const std::vector<double>& qkv, const std::vector<double>& r, const tz::train::AttentionShape& s) {
  const auto q = cast<T>(qkv), rt = cast<T>(r);
  const std::size_t n = static_cast<std::size_t>(s.batch) * s.seq;
  AttnOut<T> o{std::vector<T>(n * s.dim), std::vector<T>(static_cast<std::size_t>(s.batch) * s.heads * s.seq * s.seq),
               std::vector<T>(n * 3 * s.dim)};
  tz::train::attention_forward(q.data(), o.out.data(), o.probs.data(), s);
  tz::train::attention_backward(q.data(), o.probs.data(), rt.data(), o.dqkv.data(), s);
  return o;
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(fresh_seed());
  const tz::train::AttentionShape s{.batch = 2, .seq = 7, .heads = 3, .dim = 12};
  const std::size_t n = static_cast<std::size_t>(s.batch) * s.seq;
  auto qkv = random_vector(rng, n * 3 * s.dim);
  const auto r = random_vector(rng, n * s.dim);
  const AttnOut<double> d = run_attention<double>(qkv, r, s);
  const FdResult fd = fd_check(qkv, d.dqkv, [&] { return dot(run_attention<double>(qkv, r, s).out, r); }, 600);
  report("attention dqkv (q, k and v of every head)", fd);
  EXPECT_LE(fd.max_rel, kFdTolerance);
  const AttnOut<float> f = run_attention<float>(qkv, r, s);
  EXPECT_LE(float_vs_double(f.out, d.out), kFloatTolerance);
  EXPECT_LE(float_vs_double(f.dqkv, d.dqkv), kFloatTolerance);
}

TEST(Attention, IsCausalAndItsRowsAreDistributions) {
  std::mt19937_64 rng(fresh_seed());
  const tz::train::AttentionShape s{.batch = 1, .seq = 6, .heads = 2, .dim = 8};
  auto qkv = random_vector(rng, static_cast<std::size_t>(s.seq) * 3 * s.dim);
  const std::vector<double> r(static_cast<std::size_t>(s.seq) * s.dim, 0.0);
  const AttnOut<double> before = run_attention<double>(qkv, r, s);
  for (int i = 0; i < s.heads * s.seq; ++i) {
    double sum = 0;
    for (int j = 0; j < s.seq; ++j) {
      const double p = before.probs[static_cast<std::size_t>(i) * s.seq + j];
      if (j > i % s.seq) {
        EXPECT_EQ(p, 0.0) << "row " << i << " attends to the future position " << j;
      }
      sum += p;
    }
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
  // Changing the last position's q, k and v leaves every earlier output alone.
  for (int c = 0; c < 3 * s.dim; ++c) qkv[static_cast<std::size_t>(s.seq - 1) * 3 * s.dim + c] += 1.0;
  const AttnOut<double> after = run_attention<double>(qkv, r, s);
  for (std::size_t i = 0; i < static_cast<std::size_t>(s.seq - 1) * s.dim; ++i) EXPECT_EQ(after.out[i], before.out[i]);
}

// ---------------------------------------------------------------- GELU MLP

struct MlpParams {
  std::vector<double> x, w1, b1, w2, b2;
};

template <typename T>
struct MlpOut {
  std::vector<T> y, dx, dw1, db1, dw2, db2;
};

// y = fc2(gelu(fc1(x))), fc1: dim -> 4 dim, fc2: 4 dim -> dim.
template <typename T>
MlpOut<T> run_mlp(const MlpParams& p, const std::vector<double>& r, int rows, int dim) {
  const int wide = 4 * dim;
  const auto x = cast<T>(p.x), w1 = cast<T>(p.w1), b1 = cast<T>(p.b1), w2 = cast<T>(p.w2), b2 = cast<T>(p.b2);
  const auto rt = cast<T>(r);
  std::vector<T> h(static_cast<std::size_t>(rows) * wide), a(h.size()), dh(h.size());
  MlpOut<T> o{std::vector<T>(x.size()), std::vector<T>(x.size()), std::vector<T>(w1.size(), 0),
              std::vector<T>(b1.size(), 0), std::vector<T>(w2.size(), 0), std::vector<T>(b2.size(), 0)};
  tz::train::linear_forward(x.data(), w1.data(), b1.data(), h.data(), rows, dim, wide);
  tz::train::gelu_forward(h.data(), a.data(), h.size());
  tz::train::linear_forward(a.data(), w2.data(), b2.data(), o.y.data(), rows, wide, dim);
  tz::train::linear_backward(a.data(), w2.data(), rt.data(), dh.data(), o.dw2.data(), o.db2.data(), rows, wide, dim);
  tz::train::gelu_backward(h.data(), dh.data(), dh.data(), dh.size());  // in place, as the model runs it
  tz::train::linear_backward(x.data(), w1.data(), dh.data(), o.dx.data(), o.dw1.data(), o.db1.data(), rows, dim, wide);
  return o;
}

TEST(GeluMlp, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(fresh_seed());
  const int rows = 6, dim = 10;
  MlpParams p{random_vector(rng, rows * dim), random_vector(rng, 4 * dim * dim, 0.4), random_vector(rng, 4 * dim, 0.5),
              random_vector(rng, 4 * dim * dim, 0.3), random_vector(rng, dim)};
  const auto r = random_vector(rng, rows * dim);
  const MlpOut<double> d = run_mlp<double>(p, r, rows, dim);
  auto objective = [&] { return dot(run_mlp<double>(p, r, rows, dim).y, r); };
  const FdResult results[] = {fd_check(p.x, d.dx, objective), fd_check(p.w1, d.dw1, objective),
                              fd_check(p.b1, d.db1, objective), fd_check(p.w2, d.dw2, objective),
                              fd_check(p.b2, d.db2, objective)};
  const char* names[] = {"GELU MLP dx", "GELU MLP d fc.w", "GELU MLP d fc.b", "GELU MLP d proj.w", "GELU MLP d proj.b"};
  for (int i = 0; i < 5; ++i) {
    report(names[i], results[i]);
    EXPECT_LE(results[i].max_rel, kFdTolerance) << names[i];
  }
  const MlpOut<float> f = run_mlp<float>(p, r, rows, dim);
  EXPECT_LE(float_vs_double(f.y, d.y), kFloatTolerance);
  EXPECT_LE(float_vs_double(f.dx, d.dx), kFloatTolerance);
  EXPECT_LE(float_vs_double(f.dw1, d.dw1), kFloatTolerance);
}

// ---------------------------------------------------------------- cross-entropy

TEST(CrossEntropy, GradientMatchesFiniteDifferencesAndUniformLogitsCostLogVocab) {
  std::mt19937_64 rng(fresh_seed());
  const int rows = 9, vocab = 13;
  auto logits = random_vector(rng, rows * vocab, 3.0);
  std::vector<std::int32_t> targets(rows);
  for (auto& t : targets) t = static_cast<std::int32_t>(rng() % vocab);
  const double scale = 3.0;  // the loss scale multiplies the gradient only
  std::vector<double> dlogits(logits.size());
  const double loss = tz::train::cross_entropy(logits.data(), targets.data(), dlogits.data(), rows, vocab, scale);
  auto objective = [&] {
    return scale * tz::train::cross_entropy<double>(logits.data(), targets.data(), nullptr, rows, vocab, 1.0);
  };
  EXPECT_EQ(loss * scale, objective());
  const FdResult fd = fd_check(logits, dlogits, objective);
  report("cross-entropy dlogits (scaled)", fd);
  EXPECT_LE(fd.max_rel, kFdTolerance);
  const std::vector<double> flat(static_cast<std::size_t>(rows) * vocab, 0.25);
  EXPECT_NEAR(tz::train::cross_entropy<double>(flat.data(), targets.data(), nullptr, rows, vocab, 1.0),
              std::log(static_cast<double>(vocab)), 1e-12);
}

// ---------------------------------------------------------------- embedding + tied head

struct HeadParams {
  std::vector<double> wte, wpe, g, b;
};

template <typename T>
struct HeadOut {
  double loss = 0;
  std::vector<T> dwte, dwpe, dg, db;
};

// loss = CE(layernorm(wte[tokens] + wpe) wte^T): wte is used by the lookup
// and the head, and its gradient is the sum of both.
template <typename T>
HeadOut<T> run_head(const HeadParams& p, const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets,
                    int batch, int seq, int dim, int vocab) {
  const int rows = batch * seq;
  const auto wte = cast<T>(p.wte), wpe = cast<T>(p.wpe), g = cast<T>(p.g), b = cast<T>(p.b);
  std::vector<T> x(static_cast<std::size_t>(rows) * dim), y(x.size()), dy(x.size()), dx(x.size());
  std::vector<T> mean(rows), rstd(rows), logits(static_cast<std::size_t>(rows) * vocab), dlogits(logits.size());
  HeadOut<T> o{0, std::vector<T>(wte.size(), 0), std::vector<T>(wpe.size(), 0), std::vector<T>(dim, 0),
               std::vector<T>(dim, 0)};
  tz::train::embedding_forward(tokens.data(), wte.data(), wpe.data(), x.data(), batch, seq, dim);
  tz::train::layernorm_forward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), rows, dim);
  tz::train::linear_forward<T>(y.data(), wte.data(), nullptr, logits.data(), rows, dim, vocab);
  o.loss = tz::train::cross_entropy(logits.data(), targets.data(), dlogits.data(), rows, vocab, 1.0);
  tz::train::linear_backward<T>(y.data(), wte.data(), dlogits.data(), dy.data(), o.dwte.data(), nullptr, rows, dim, vocab);
  tz::train::layernorm_backward(x.data(), g.data(), mean.data(), rstd.data(), dy.data(), dx.data(), o.dg.data(),
                                o.db.data(), rows, dim);
  tz::train::embedding_backward(tokens.data(), dx.data(), o.dwte.data(), o.dwpe.data(), batch, seq, dim);
  return o;
}

TEST(EmbeddingTiedHead, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(fresh_seed());
  const int batch = 2, seq = 5, dim = 8, vocab = 11;
  HeadParams p{random_vector(rng, vocab * dim), random_vector(rng, seq * dim, 0.5), random_vector(rng, dim, 0.3),
               random_vector(rng, dim, 0.3)};
  for (double& v : p.g) v += 1.0;
  std::vector<std::int32_t> tokens(batch * seq), targets(batch * seq);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 4);  // repeats: rows that share a wte row
  for (auto& t : targets) t = static_cast<std::int32_t>(rng() % vocab);
  const HeadOut<double> d = run_head<double>(p, tokens, targets, batch, seq, dim, vocab);
  auto objective = [&] { return run_head<double>(p, tokens, targets, batch, seq, dim, vocab).loss; };
  const FdResult results[] = {fd_check(p.wte, d.dwte, objective), fd_check(p.wpe, d.dwpe, objective),
                              fd_check(p.g, d.dg, objective), fd_check(p.b, d.db, objective)};
  const char* names[] = {"tied wte (lookup + head)", "wpe", "ln_f.w", "ln_f.b"};
  for (int i = 0; i < 4; ++i) {
    report(names[i], results[i]);
    EXPECT_LE(results[i].max_rel, kFdTolerance) << names[i];
  }
  const HeadOut<float> f = run_head<float>(p, tokens, targets, batch, seq, dim, vocab);
  EXPECT_NEAR(f.loss, d.loss, kFloatTolerance * d.loss);
  EXPECT_LE(float_vs_double(f.dwte, d.dwte), kFloatTolerance);
}

}  // namespace
}  // namespace tzt
