// Helpers for the tests that train the GPT through ZeroEngine (CPU and CUDA):
// corpus batches, the engine's master weights against the reference's, and
// the step-by-step comparison of a GptTrainer with tz::train::Reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tierzero/train.h"

namespace tzt {

inline const tz::train::Corpus& corpus() {
  static const tz::train::Corpus c = tz::train::Corpus::load(tz::train::default_corpus_path("").value()).value();
  return c;
}

// Training batches of the shipped corpus for (rank, micro-batch, step).
inline tz::train::BatchFn corpus_batches(const tz::train::GptConfig& cfg) {
  return [cfg](int rank, int micro, std::int64_t step) {
    return corpus().batch({.batch = cfg.batch, .seq = cfg.seq, .step = step, .rank = rank, .micro = micro}).value();
  };
}

// The largest |engine - reference| over every block's master weights, and
// where (a collective on several ranks: every rank calls it).
struct MasterDiff {
  double worst = 0;
  std::string where;
};
inline MasterDiff master_diff(tz::ZeroEngine& engine, const tz::train::Reference& ref) {
  MasterDiff d;
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    auto got = engine.gather_master(b);
    EXPECT_TRUE(got.ok()) << got.status().to_string();
    if (!got.ok()) return {INFINITY, "gather_master failed"};
    const std::vector<float> want = ref.master(b);
    EXPECT_EQ(got->size(), want.size());
    for (std::size_t i = 0; i < std::min(got->size(), want.size()); ++i) {
      const double diff = std::fabs(static_cast<double>((*got)[i]) - want[i]);
      if (diff > d.worst) {
        d.worst = diff;
        d.where = fmt::format("{}[{}]: engine {} vs reference {}", engine.layout().blocks[b].name, i, (*got)[i],
                              want[i]);
      }
    }
  }
  return d;
}

struct RunAgainstReference {
  double worst_loss = 0;           // relative
  MasterDiff worst_master;
  double first_loss = 0, last_loss = 0;
};

// `steps` optimizer steps of `gas` micro-batches (rank 0's batches) through
// the trainer and the reference side by side, expecting each step's loss
// within loss_tol (relative) and the master weights within master_tol.
inline RunAgainstReference run_against_reference(tz::ZeroEngine& engine, tz::train::GptTrainer& gpt,
                                                 tz::train::Reference& ref, const tz::train::BatchFn& batches,
                                                 int steps, int gas, double loss_tol, double master_tol,
                                                 const std::string& what) {
  RunAgainstReference run;
  for (int step = 0; step < steps; ++step) {
    double loss = 0;
    for (int micro = 0; micro < gas; ++micro) {
      auto l = gpt.train_micro_batch(batches(0, micro, step));
      EXPECT_TRUE(l.ok()) << what << ": " << l.status().to_string();
      if (!l.ok()) return run;
      loss += *l / gas;
      auto r = engine.step();
      EXPECT_TRUE(r.ok()) << what << ": " << r.status().to_string();
      if (!r.ok()) return run;
      EXPECT_EQ(r->stepped, micro == gas - 1);
    }
    const double ref_loss = ref.train_step(step);
    run.worst_loss = std::max(run.worst_loss, std::fabs(loss - ref_loss) / ref_loss);
    EXPECT_NEAR(loss, ref_loss, loss_tol * ref_loss) << what << ", step " << step;
    const MasterDiff diff = master_diff(engine, ref);
    EXPECT_LE(diff.worst, master_tol) << what << ", step " << step << ": " << diff.where;
    if (diff.worst > run.worst_master.worst) run.worst_master = diff;
    (step == 0 ? run.first_loss : run.last_loss) = loss;
  }
  return run;
}

// Four steps with an evaluation of each step's batch before training on it:
// the evaluation equals the training loss of the same batch (to the bit when
// rel_tol is 0, else within rel_tol relative), and the steps after the first
// are still all prefetched (evaluation must not break the prefetch trace).
inline void expect_evaluation_matches_training(tz::ZeroEngine& engine, tz::train::GptTrainer& gpt,
                                               const tz::train::GptConfig& cfg, double rel_tol, const char* what) {
  const tz::train::BatchFn batches = corpus_batches(cfg);
  for (int step = 0; step < 4; ++step) {
    auto eval = gpt.eval_loss({batches(0, 0, step)});
    ASSERT_TRUE(eval.ok()) << eval.status().to_string();
    auto train = gpt.train_micro_batch(batches(0, 0, step));
    ASSERT_TRUE(train.ok()) << train.status().to_string();
    std::printf("[ gpt    ] %s step %d: evaluation %.9g, training %.9g\n", what, step, *eval, *train);
    if (rel_tol == 0) {
      EXPECT_EQ(*eval, *train) << "step " << step;
    } else {
      EXPECT_NEAR(*eval, *train, rel_tol * *train) << "step " << step;
    }
    auto r = engine.step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    if (step >= 1) {  // step 0 records the trace: embed, h0 .. h<L-1>, embed, h<L-1> .. h0
      EXPECT_EQ(r->fetches, 2U * cfg.layers + 2);
      EXPECT_EQ(r->prefetched, r->fetches) << "step " << step << ": evaluation broke the prefetch trace";
    }
  }
}

}  // namespace tzt
