// A checkpoint's files on their own, without an engine: the streaming writer
// byte for byte; tags; publishing a directory over another; resolving a
// checkpoint directory from a tag or `latest`; a rank's manifest read against
// a model, with each refusal and corruption it must catch.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>

#include "../../engine/src/checkpoint_files.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/nvme.h"

namespace tz::detail {
namespace {

namespace fs = std::filesystem;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void spit(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// Appends of odd sizes and alignments, past the writer's 8 MiB buffer, read back equal.
TEST(CheckpointFiles, TheWriterWritesEveryByteWhateverTheAlignment) {
  tzt::TempDir dir;
  std::mt19937_64 rng(5);
  std::string want;
  auto writer = FileWriter::open(dir.file("out.bin"));
  ASSERT_TRUE(writer.ok()) << writer.status().to_string();
  auto aligned = aligned_floats(3 << 20);  // 12 MiB, aligned: taken straight from it
  ASSERT_TRUE(aligned.ok());
  for (std::size_t i = 0; i < (3u << 20); ++i) aligned->get()[i] = static_cast<float>(rng() % 1000);
  for (std::size_t bytes : {std::size_t{13}, std::size_t{4096}, std::size_t{(3u << 20) * 4}, std::size_t{70001}}) {
    std::string chunk(bytes, '\0');
    if (bytes == (3u << 20) * 4) {
      std::memcpy(chunk.data(), aligned->get(), bytes);
      ASSERT_TRUE(writer->append(aligned->get(), bytes).ok());
    } else {
      for (char& c : chunk) c = static_cast<char>(rng());
      ASSERT_TRUE(writer->append(chunk.data(), bytes).ok());
    }
    want += chunk;
  }
  ASSERT_TRUE(writer->finish().ok());
  EXPECT_EQ(slurp(dir.file("out.bin")), want);
}

TEST(CheckpointFiles, TagsAreOneDirectoryNameNotTheDirectorysOwn) {
  EXPECT_TRUE(check_tag("step-10").ok());
  EXPECT_TRUE(check_tag("best").ok());
  for (const std::string& bad : std::vector<std::string>{"", ".", "..", "a/b", "latest", "latest.tmp", "x.partial",
                                                        std::string(201, 'a')}) {
    const Status s = check_tag(bad);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << "'" << bad << "'";
  }
}

// A new directory is renamed into place; over an existing one the two are
// exchanged and the replaced one removed.
TEST(CheckpointFiles, PublishRenamesOrReplacesWholly) {
  tzt::TempDir dir;
  const std::string final_dir = dir.file("best"), partial = final_dir + ".partial";
  fs::create_directories(partial);
  spit(partial + "/manifest.json", "first");
  ASSERT_TRUE(publish(partial, final_dir).ok());
  EXPECT_EQ(slurp(final_dir + "/manifest.json"), "first");
  EXPECT_FALSE(fs::exists(partial));
  fs::create_directories(partial);
  spit(partial + "/manifest.json", "second");
  const Status probed = probe_exchange(final_dir);  // $TMPDIR's file system must exchange (ext4, tmpfs, xfs do)
  ASSERT_TRUE(probed.ok()) << probed.to_string();
  ASSERT_TRUE(publish(partial, final_dir).ok());
  EXPECT_EQ(slurp(final_dir + "/manifest.json"), "second");
  EXPECT_FALSE(fs::exists(partial));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);  // nothing else left
}

TEST(CheckpointFiles, ACheckpointDirectoryIsFoundByTagOrLatest) {
  tzt::TempDir dir;
  fs::create_directories(dir.file("step-3"));
  spit(dir.file("step-3/manifest.json"), "{}");
  EXPECT_EQ(checkpoint_dir(dir.path(), "step-3").value(), dir.file("step-3"));
  EXPECT_EQ(checkpoint_dir(dir.file("step-3"), "").value(), dir.file("step-3"));
  EXPECT_EQ(checkpoint_dir(dir.path(), "step-4").status().code(), ErrorCode::kNotFound);
  // No latest and no manifest: the complete checkpoints beside it are named, newest first.
  fs::create_directories(dir.file("step-5"));
  spit(dir.file("step-5/manifest.json"), "{}");
  fs::last_write_time(dir.file("step-3/manifest.json"), fs::file_time_type::clock::now() - std::chrono::hours(1));
  fs::create_directories(dir.file("step-6.partial"));  // not complete: not named
  const auto none = checkpoint_dir(dir.path(), "");
  EXPECT_EQ(none.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(none.status().message().find("no 'latest'"), std::string::npos) << none.status().to_string();
  EXPECT_NE(none.status().message().find("newest first: step-5, step-3; pass a tag"), std::string::npos)
      << none.status().to_string();
  spit(dir.file("latest"), "step-3\n");  // a hand-written one ends in a newline
  EXPECT_EQ(checkpoint_dir(dir.path(), "").value(), dir.file("step-3"));
  spit(dir.file("latest"), "../elsewhere");
  const auto bad = checkpoint_dir(dir.path(), "");
  EXPECT_EQ(bad.status().code(), ErrorCode::kDataCorruption);
  EXPECT_NE(bad.status().message().find("latest names '../elsewhere'"), std::string::npos) << bad.status().to_string();
}

// One rank's file of a two-block model, written the way the engine writes it.
struct SavedRank {
  tzt::TempDir dir;
  ModelLayout layout = ModelLayout::make({{"a", {{"w", {64, 64}}}}, {"b", {{"w", {32}}, {"bias", {32}}}}}, 1, 0).value();
  nlohmann::json manifest;

  SavedRank() {
    nlohmann::json blocks = nlohmann::json::array();
    std::string bin;
    for (const BlockLayout& b : layout.blocks) {
      nlohmann::json states = nlohmann::json::object();
      for (int k = 0; k < 3; ++k) {
        std::string bytes(b.shard_numel * 4, static_cast<char>('a' + k));
        states[kStateNames[k]] = {{"offset", bin.size()}, {"bytes", bytes.size()}, {"dtype", "fp32"},
                                  {"xxh3", hex(nvme::checksum(bytes.data(), bytes.size()))}};
        bin += bytes;
      }
      nlohmann::json params = nlohmann::json::array();
      for (const ParamLayout& p : b.params) params.push_back({{"name", p.name}, {"shape", p.shape}});
      blocks.push_back({{"name", b.name}, {"shard_numel", b.shard_numel}, {"params", params}, {"states", states}});
    }
    spit(dir.file("rank-0.bin"), bin);
    manifest = {{"format", "tierzero-checkpoint-rank"}, {"version", kCheckpointFormatVersion}, {"rank", 0},
                {"world_size", 1}, {"step", 7}, {"optimizer", "AdamW"},
                {"states", {{"master", "remainder"}, {"moments", "bf16"}}}, {"lr", nullptr},
                {"loss_scaler", {{"scale", 1.0}, {"hysteresis_left", 1}, {"good_steps", 0}}},
                {"file", "rank-0.bin"}, {"bytes", bin.size()}, {"blocks", blocks}};
  }
  Status read(const RankExpect& tweak = {}) {
    spit(dir.file("rank-0.json"), sealed_text(manifest));
    RankExpect expect = tweak;
    expect.layout = &layout;
    if (expect.optimizer.empty()) expect.optimizer = "Adam";
    RankFile file;
    return read_rank_file(dir.path(), expect, file);
  }
};

TEST(CheckpointFiles, ARankFileMatchingTheModelReadsAndVerifies) {
  SavedRank saved;
  ASSERT_TRUE(saved.read().ok()) << saved.read().to_string();
  RankFile file;
  RankExpect expect{.layout = &saved.layout, .optimizer = "AdamW"};
  ASSERT_TRUE(read_rank_file(saved.dir.path(), expect, file).ok());
  EXPECT_EQ(file.step, 7);
  EXPECT_FALSE(file.saved_lr.has_value());
  for (std::size_t i = 0; i < 6; ++i) EXPECT_TRUE(file.states[i].has_value()) << i;
}

TEST(CheckpointFiles, ARankFileThatDoesNotFitIsRefusedNamingWhy) {
  auto expect_error = [](SavedRank& saved, const RankExpect& expect, ErrorCode code, const std::string& text) {
    const Status s = saved.read(expect);
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.to_string();
  };
  {
    SavedRank saved;
    expect_error(saved, {.world_size = 2}, ErrorCode::kInvalidArgument, "saved by 1 ranks; this run has 2");
  }
  {
    SavedRank saved;
    expect_error(saved, {.optimizer = "Lion"}, ErrorCode::kInvalidArgument, "saved by the AdamW optimizer");
    EXPECT_TRUE(saved.read({.optimizer = "Lion", .weights_only = true}).ok());  // the masters alone
  }
  {
    SavedRank saved;
    saved.manifest["blocks"][1]["params"][0]["shape"] = {16, 2};
    expect_error(saved, {}, ErrorCode::kInvalidArgument, "parameter 0 of block 'b' was saved as 'w' (16, 2)");
  }
  {
    SavedRank saved;
    saved.manifest["blocks"][0]["states"]["exp_avg"]["xxh3"] = "0000000000000000";
    expect_error(saved, {}, ErrorCode::kDataCorruption, "checksum mismatch in exp_avg of a");
  }
  {
    SavedRank saved;
    saved.manifest["step"] = "seven";
    expect_error(saved, {}, ErrorCode::kDataCorruption, "rank-0.json is malformed");
  }
  {
    SavedRank saved;
    saved.manifest["lr"] = -1.0;
    expect_error(saved, {}, ErrorCode::kDataCorruption, "learning rate -1 is not finite and >= 0");
  }
  {
    SavedRank saved;
    fs::resize_file(saved.dir.file("rank-0.bin"), fs::file_size(saved.dir.file("rank-0.bin")) - 4);
    expect_error(saved, {}, ErrorCode::kDataCorruption, "(truncated?)");
  }
  {
    SavedRank saved;
    saved.manifest["blocks"][1]["states"].erase("exp_avg_sq");
    expect_error(saved, {}, ErrorCode::kDataCorruption, "block 'b' has no exp_avg_sq");
    EXPECT_TRUE(saved.read({.has_exp_avg_sq = false}).ok());  // an optimizer without it does not need it
  }
}

}  // namespace
}  // namespace tz::detail
