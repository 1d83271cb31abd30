// The corpus and the batch loader (tierzero/train/data.h).
#include <set>

#include "../nvme/nvme_test_util.h"
#include "tierzero/train.h"
#include "train_test_util.h"

namespace tzt {
namespace {

using tz::train::BatchRequest;
using tz::train::Corpus;
using tz::train::Split;

TEST(Corpus, TheShippedTextIsFoundLoadedAndSplitContiguously) {
  auto path = tz::train::default_corpus_path("");
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  auto corpus = Corpus::load(*path, 0.1);
  ASSERT_TRUE(corpus.ok()) << corpus.status().to_string();
  EXPECT_GT(corpus->size_bytes(), 500'000U) << *path;
  EXPECT_EQ(corpus->train().size() + corpus->val().size(), corpus->size_bytes());
  EXPECT_NEAR(static_cast<double>(corpus->val().size()) / corpus->size_bytes(), 0.1, 1e-3);
  EXPECT_EQ(corpus->train().data() + corpus->train().size(), corpus->val().data()) << "validation follows training";
  for (std::uint8_t byte : corpus->train()) ASSERT_LT(byte, 128) << "the shipped corpus is plain ASCII";
  std::printf("[ data   ] %s: %llu bytes, %zu train, %zu validation\n", path->c_str(),
              static_cast<unsigned long long>(corpus->size_bytes()), corpus->train().size(), corpus->val().size());
}

TEST(Corpus, BatchesAreWindowsOfTheirSplitWithTargetsShiftedByOne) {
  std::string text;
  for (int i = 0; i < 4000; ++i) text += static_cast<char>('a' + (i * 7 + i / 26) % 26);
  auto corpus = Corpus::from_bytes(text, "letters", 0.25);
  ASSERT_TRUE(corpus.ok());
  for (Split split : {Split::kTrain, Split::kVal}) {
    const auto part = split == Split::kTrain ? corpus->train() : corpus->val();
    const std::string part_text(part.begin(), part.end());
    auto b = corpus->batch({.split = split, .batch = 5, .seq = 33, .step = 3});
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    ASSERT_EQ(b->inputs.size(), 5U * 33);
    for (int row = 0; row < 5; ++row) {
      std::string window;
      for (int t = 0; t < 33; ++t) window += static_cast<char>(b->inputs[row * 33 + t]);
      window += static_cast<char>(b->targets[row * 33 + 32]);
      EXPECT_NE(part_text.find(window), std::string::npos) << "row " << row << " is not a window of its split";
      for (int t = 0; t + 1 < 33; ++t) EXPECT_EQ(b->targets[row * 33 + t], b->inputs[row * 33 + t + 1]);
    }
  }
}

TEST(Corpus, BatchesAreDeterministicAndDifferByStepRankMicroAndSplit) {
  std::string text;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) text += static_cast<char>(rng() % 256);
  auto corpus = Corpus::from_bytes(text, "random");
  ASSERT_TRUE(corpus.ok());
  const BatchRequest base{.batch = 4, .seq = 16, .step = 10, .rank = 1, .micro = 2, .seed = 5};
  auto again = [&](BatchRequest r) { return corpus->batch(r).value().inputs; };
  const auto reference = again(base);
  EXPECT_EQ(again(base), reference) << "the same request gives the same batch";
  std::set<std::vector<std::int32_t>> distinct{reference};
  BatchRequest r = base;
  r.step = 11;
  distinct.insert(again(r));
  r = base;
  r.rank = 0;
  distinct.insert(again(r));
  r = base;
  r.micro = 0;
  distinct.insert(again(r));
  r = base;
  r.seed = 6;
  distinct.insert(again(r));
  r = base;
  r.split = Split::kVal;
  distinct.insert(again(r));
  EXPECT_EQ(distinct.size(), 6U) << "step, rank, micro-batch, seed and split each change the batch";
}

TEST(Corpus, ErrorsNameThePathOrTheSizes) {
  auto missing = Corpus::load("/nonexistent/tierzero/corpus.txt");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), tz::ErrorCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/tierzero/corpus.txt"), std::string::npos);
  auto small = Corpus::from_bytes(std::string(100, 'x'), "tiny", 0.1);
  ASSERT_TRUE(small.ok());
  auto b = small->batch({.split = Split::kVal, .batch = 1, .seq = 20});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("validation split has 10 bytes"), std::string::npos) << b.status().message();
  EXPECT_FALSE(Corpus::from_bytes("abcdefgh", "bad fraction", 1.5).ok());
  // A folder once threw std::ios_failure, and /dev/urandom was read until std::bad_alloc.
  auto folder = Corpus::load("/tmp");
  ASSERT_FALSE(folder.ok());
  EXPECT_EQ(folder.status().code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_NE(folder.status().message().find("corpus /tmp: is a folder"), std::string::npos) << folder.status().message();
  auto device = Corpus::load("/dev/urandom");
  ASSERT_FALSE(device.ok());
  EXPECT_NE(device.status().message().find("/dev/urandom: is not a regular file"), std::string::npos)
      << device.status().message();
}

TEST(Corpus, DataDirFromTheEnvironmentComesFirst) {
  TempDir dir;
  {
    std::FILE* f = std::fopen(dir.file("kjv.txt").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("In the beginning", f);
    std::fclose(f);
  }
  ::setenv("TIERZERO_DATA_DIR", dir.path().c_str(), 1);
  auto path = tz::train::default_corpus_path("");
  ::unsetenv("TIERZERO_DATA_DIR");
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  EXPECT_EQ(*path, dir.file("kjv.txt"));
}

}  // namespace
}  // namespace tzt
