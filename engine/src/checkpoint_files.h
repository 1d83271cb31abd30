// The files of a checkpoint, apart from the engine that writes and reads
// them: the streaming writer, the checkpoint directory's names (tags,
// latest, the exchange that replaces one), the manifests and the verified
// reading of a rank's states. checkpoint.cpp drives them from the engine;
// tests/engine/checkpoint_files_test.cpp checks them on their own.
//
// Layout of a checkpoint directory (Note [Checkpoint atomicity] in checkpoint.cpp):
//   <dir>/latest                  the name of the newest complete checkpoint
//   <dir>/<tag>/manifest.json     format, world size, step, the client state's size and XXH3
//   <dir>/<tag>/client_state.bin  the caller's bytes (optional)
//   <dir>/<tag>/rank-<r>.json     this rank's blocks: names, parameters, each state's extent and XXH3
//   <dir>/<tag>/rank-<r>.bin      this rank's fp32 states, block after block
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loss_scaler.h"
#include "tierzero/common/handles.h"
#include "tierzero/engine/model.h"

namespace tz::detail {

// 2: manifests are sealed (Note [Sealed manifests]) and every field is required.
// 3: each state records the dtype it is stored in ("fp32": the rebuilt master
//    and the moments widened, whatever the run's tierzero.states: Note
//    [Remainder masters in the engine], Note [Moments in bf16]), and the rank
//    manifest the formats the run trained in ("states"). Version 2 files are
//    read as what they are: every state fp32 (nothing else was written).
inline constexpr int kCheckpointFormatVersion = 3;
inline constexpr int kOldestReadableCheckpointVersion = 2;
// The dtype every state is stored in by this version.
inline constexpr const char* kStoredStateDtype = "fp32";
inline constexpr const char* kClientStateFile = "client_state.bin";
// A block's fp32 states, in the order the rank file holds them.
inline constexpr const char* kStateNames[3] = {"master", "exp_avg", "exp_avg_sq"};

std::string hex(std::uint64_t x);

// Note [Sealed manifests] (checkpoint_files.cpp): `m` with its own checksum
// added as "xxh3", as the text a manifest file holds; and a manifest file
// read back with its seal checked and removed (DataCorruption naming the file
// when it is missing or does not match).
std::string sealed_text(nlohmann::json m);
Expected<nlohmann::json> read_sealed_json(const std::string& path);

// Note [Checkpoint files bypass the page cache] (checkpoint_files.cpp).
class FileWriter {
 public:
  static constexpr std::size_t kAlign = 4096;
  static Expected<FileWriter> open(const std::string& path);
  Status append(const void* data, std::size_t bytes);
  // Writes what is buffered, fsyncs and closes: the file is then complete.
  Status finish();

 private:
  static constexpr std::size_t kBuffer = 8 << 20;
  std::string path_;
  UniqueFd fd_;
  std::unique_ptr<char, decltype(&std::free)> buffer_{nullptr, &std::free};  // set when writing O_DIRECT
  std::size_t used_ = 0;
};

using AlignedFloats = std::unique_ptr<float, decltype(&std::free)>;
// n floats (at least one) at a FileWriter::kAlign boundary, for O_DIRECT.
Expected<AlignedFloats> aligned_floats(std::uint64_t n);

// A tag is one directory name under the checkpoint directory, and not one of
// the names the directory uses itself.
Status check_tag(const std::string& tag);
// Note [Replacing a checkpoint]: `partial` becomes `final_dir`, by a rename or
// by exchanging the two and removing the replaced one.
Status publish(const std::string& partial, const std::string& final_dir);
// Removes the complete checkpoints under `dir` beyond the newest `keep` (by
// their manifest's step, then time), never those in `keep_too` (the one just
// saved, the one `latest` names). Each goes manifest first. Returns the names removed.
Expected<std::vector<std::string>> prune_checkpoints(const std::string& dir, int keep,
                                                     const std::vector<std::string>& keep_too);
// Whether the file system can exchange two directories (tried on two empty ones beside final_dir).
Status probe_exchange(const std::string& final_dir);
// The checkpoint directory `path` and `tag` name: path/<tag>, or what
// path/latest names, or path itself; NotFound without a manifest.json there.
Expected<std::string> checkpoint_dir(const std::string& path, const std::string& tag);
// manifest.json checked, and the client state it lists, verified (none when it lists none).
struct Manifest {
  int world_size = 0;
  std::int64_t step = 0;
  std::optional<std::string> client_state;
};
Expected<Manifest> read_manifest(const std::string& dir);

// This rank's part of a checkpoint, checked against the model and verified
// (Note [Streamed checkpoints]).
struct SavedState {
  std::uint64_t offset = 0, bytes = 0;  // in the rank's .bin file
  std::string xxh3;
};
struct RankFile {
  std::string bin;                                // rank-<r>.bin
  UniqueFd fd;                                    // open for reading
  UniqueFd direct_fd;                             // and with O_DIRECT, where the file system allows it
  std::vector<std::optional<SavedState>> states;  // [b * 3 + k]: master, exp_avg, exp_avg_sq; set where loaded
  std::int64_t step = 0;
  LossScaler::State scaler{};
  std::optional<double> saved_lr;  // set_learning_rate()'s before the save; none when never called
};

// What a load expects of a rank's manifest.
struct RankExpect {
  int rank = 0;
  int world_size = 1;
  const ModelLayout* layout = nullptr;
  std::string optimizer;        // the loading engine's optimizer.type
  bool weights_only = false;    // the masters alone are needed (and the optimizer may differ)
  bool has_exp_avg = true;      // the loading optimizer keeps the moments (Adagrad: no exp_avg; Lion: no exp_avg_sq)
  bool has_exp_avg_sq = true;
};
// Reads rank-<r>.json under `dir`, checks it against `expect`, opens the
// states file and verifies every state the load needs (its checksum). A
// malformed manifest is DataCorruption naming the file, a different model or
// world size InvalidArgument naming both.
Status read_rank_file(const std::string& dir, const RankExpect& expect, RankFile& file);
// State k of block b (named `block`) from the rank's file into `out`, checked
// against the checksum its manifest gave.
Status read_state(const RankFile& file, std::size_t b, int k, const std::string& block, float* out);

}  // namespace tz::detail
