// Text data for the GPT workload: a corpus of bytes (byte-level tokens, vocab
// 256), split into train and validation parts, and a deterministic batch
// loader.
//
// The split is contiguous: the first (1 - val_fraction) of the bytes train,
// the rest validates, so no validation text is ever seen in training. A batch
// is `batch` windows of `seq + 1` bytes (inputs are the first seq, targets
// the last seq: the next byte at every position). Where a window starts is a
// hash of (seed, split, step, rank, micro-batch, row), so any batch of any
// step is made on its own, every rank draws different windows, and a run and
// its resumption (or the in-memory reference) see exactly the same data.
//
//   TZ_ASSIGN_OR_RETURN(tz::train::Corpus corpus, tz::train::Corpus::load("data/kjv.txt"));
//   TZ_ASSIGN_OR_RETURN(tz::train::TokenBatch b,
//                       corpus.batch({.split = tz::train::Split::kTrain, .batch = 8, .seq = 128,
//                                     .step = step, .rank = rank, .micro = micro}));
//
// The repository ships its corpus as data/kjv.txt (see data/README.md);
// default_corpus_path() finds it in a source tree or an installed one.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tierzero/common.h"

namespace tz::train {

inline constexpr int kByteVocab = 256;

// Token windows: (batch, seq) each, row-major.
struct TokenBatch {
  int batch = 0;
  int seq = 0;
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;  // inputs shifted by one: the next token
};

enum class Split : std::uint8_t { kTrain, kVal };

struct BatchRequest {
  Split split = Split::kTrain;
  int batch = 1;
  int seq = 1;
  std::int64_t step = 0;       // optimizer step (or evaluation batch index)
  int rank = 0;
  int micro = 0;               // micro-batch within the step
  std::uint64_t seed = 1234;
};

class Corpus {
 public:
  // Reads a file; errors name the path. val_fraction in (0, 1).
  static Expected<Corpus> load(const std::string& path, double val_fraction = 0.1);
  // From bytes in memory (tests); `name` stands for the path in messages.
  static Expected<Corpus> from_bytes(std::string bytes, std::string name, double val_fraction = 0.1);

  std::span<const std::uint8_t> train() const;
  std::span<const std::uint8_t> val() const;
  const std::string& name() const { return name_; }
  std::uint64_t size_bytes() const { return bytes_.size(); }

  // One deterministic batch (see the top of this header). An error names the
  // split and its size when it is shorter than seq + 1 bytes.
  Expected<TokenBatch> batch(const BatchRequest& request) const;

 private:
  std::vector<std::uint8_t> bytes_;
  std::size_t split_at_ = 0;   // first validation byte
  std::string name_;
};

// Where the shipped corpus is: $TIERZERO_DATA_DIR/kjv.txt if set, else the
// source tree's data/kjv.txt, else <prefix>/share/tierzero/data/kjv.txt next to
// an installed program (`exe_dir` is the directory of the running program).
// NotFound lists every place it looked.
Expected<std::string> default_corpus_path(const std::string& exe_dir);

}  // namespace tz::train
