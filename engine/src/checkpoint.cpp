// Checkpoints and the fp32 export.
//
// Note [Checkpoint atomicity]
// dir/<name>.partial/ (name: the caller's tag, or step-<N>) is filled by
// every rank (rank-<r>.bin with its shards, rank-<r>.json with their sizes and
// XXH3 checksums), each file written, fsynced and closed before it counts.
// Only when every rank reports success (an all-reduce of a failure flag) does
// rank 0 write the client state and manifest.json (the client state's
// checksum in it), move the directory to <name> (a rename, or an exchange with
// the checkpoint it replaces: Note [Replacing a checkpoint]), and replace
// dir/latest by renaming a fsynced latest.tmp over it. A crash anywhere
// before that last rename leaves the old latest pointing at the old, complete
// checkpoint; a crash after it leaves the new one. A .partial directory is
// never read.
#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc 2.28)
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tierzero/comm/host_collectives.h"
#include "tierzero/common/units.h"
#include "tierzero/kernels.h"
#include "zero_engine_impl.h"

namespace tz {
namespace {

namespace fs = std::filesystem;

constexpr int kFormatVersion = 1;

// A block's fp32 states, in the order the rank file holds them.
const char* const kStateNames[3] = {"master", "exp_avg", "exp_avg_sq"};

// Note [Checkpoint files bypass the page cache]
// A checkpoint's states are gigabytes written once and not read back soon.
// Written through the page cache, the kernel's copy into it set the pace: on
// the CI machine a 3 GiB save ran at 0.3-0.5 GB/s, two thirds of its CPU time
// in copy_folio_from_iter_atomic, against 6 GB/s for O_DIRECT writes to the
// same disk (bench/RESULTS.md). So FileWriter writes with O_DIRECT, whole 4 KiB
// blocks from aligned memory: the caller's where it is aligned, else through
// an aligned buffer. The last partial block goes through the page cache (O_DIRECT
// cleared with fcntl) before the fsync. A file system that refuses O_DIRECT
// (tmpfs) gets plain buffered writes.
class FileWriter {
 public:
  static constexpr std::size_t kAlign = 4096;

  static Expected<FileWriter> open(const std::string& path) {
    FileWriter w;
    w.path_ = path;
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (Expected<UniqueFd> direct = open_file(path, flags | O_DIRECT); direct.ok()) {
      w.fd_ = std::move(*direct);
      w.buffer_.reset(static_cast<char*>(std::aligned_alloc(kAlign, kBuffer)));
      if (w.buffer_ == nullptr) return out_of_memory("checkpoint: no memory for a {} write buffer", kBuffer);
    } else {
      TZ_ASSIGN_OR_RETURN(w.fd_, open_file(path, flags));
    }
    return w;
  }

  Status append(const void* data, std::size_t bytes) {
    if (buffer_ == nullptr) return write_all(fd_.get(), data, bytes, path_);
    const char* p = static_cast<const char*>(data);
    if (used_ == 0 && reinterpret_cast<std::uintptr_t>(p) % kAlign == 0) {  // straight from the caller's memory
      const std::size_t whole = bytes / kAlign * kAlign;
      TZ_TRY(write_all(fd_.get(), p, whole, path_));
      p += whole;
      bytes -= whole;
    }
    while (bytes > 0) {
      const std::size_t n = std::min(bytes, kBuffer - used_);
      std::memcpy(buffer_.get() + used_, p, n);
      used_ += n;
      p += n;
      bytes -= n;
      if (used_ == kBuffer) {
        TZ_TRY(write_all(fd_.get(), buffer_.get(), kBuffer, path_));
        used_ = 0;
      }
    }
    return ok_status();
  }

  // Writes what is buffered, fsyncs and closes: the file is then complete.
  Status finish() {
    if (buffer_ != nullptr && used_ > 0) {
      const std::size_t whole = used_ / kAlign * kAlign;
      TZ_TRY(write_all(fd_.get(), buffer_.get(), whole, path_));
      if (whole < used_) {
        const int flags = ::fcntl(fd_.get(), F_GETFL);
        if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags & ~O_DIRECT) != 0) {
          return errno_status(errno, "writing " + path_);
        }
        TZ_TRY(write_all(fd_.get(), buffer_.get() + whole, used_ - whole, path_));
      }
      used_ = 0;
    }
    if (::fsync(fd_.get()) != 0) return errno_status(errno, "syncing " + path_);
    return fd_.close();
  }

 private:
  static constexpr std::size_t kBuffer = 8 << 20;

  std::string path_;
  UniqueFd fd_;
  std::unique_ptr<char, decltype(&std::free)> buffer_{nullptr, &std::free};  // set when writing O_DIRECT
  std::size_t used_ = 0;
};

using AlignedFloats = std::unique_ptr<float, decltype(&std::free)>;

// n floats (at least one) at a FileWriter::kAlign boundary, for O_DIRECT.
Expected<AlignedFloats> aligned_floats(std::uint64_t n) {
  const std::uint64_t bytes = align_up(std::max<std::uint64_t>(n, 1) * 4, FileWriter::kAlign);
  AlignedFloats memory(static_cast<float*>(std::aligned_alloc(FileWriter::kAlign, bytes)), &std::free);
  if (memory == nullptr) return out_of_memory("checkpoint: no memory for a {}-byte state buffer", bytes);
  return memory;
}

// A whole file. Errors name the path (a directory where a file should be is
// one, not an exception from the stream library).
Expected<std::string> read_text(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno == ENOENT ? not_found("checkpoint: {} does not exist", path)
                           : errno_status(errno, "checkpoint: opening " + path);
  }
  UniqueFd owned(fd);
  struct stat info {};
  if (::fstat(fd, &info) != 0) return errno_status(errno, "checkpoint: reading " + path);
  if (!S_ISREG(info.st_mode)) return data_corruption("checkpoint: {} is not a regular file", path);
  std::string text(static_cast<std::size_t>(info.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, "checkpoint: reading " + path);
    if (n == 0) break;  // shorter than it was a moment ago
    done += static_cast<std::size_t>(n);
  }
  text.resize(done);
  return text;
}

// fn(), reading a manifest: one whose fields have the wrong JSON types (the
// library throws) is corrupt, not a crash. `what` names the file.
template <typename Fn>
Status malformed_is_corrupt(const std::string& what, Fn&& fn) {
  try {
    return fn();
  } catch (const nlohmann::json::exception& e) {
    return data_corruption("{} is malformed ({})", what, e.what());
  }
}

Expected<nlohmann::json> read_json(const std::string& path) {
  TZ_ASSIGN_OR_RETURN(std::string text, read_text(path));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_corruption("checkpoint: {} is not valid JSON", path);
  return j;
}

std::string hex(std::uint64_t x) { return fmt::format("{:016x}", x); }

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("({})", fmt::join(shape, ", ")); }

// Note [Checkpoints know their parameters]
// A block's shard is a flat run of floats: a model whose blocks have the
// same names and sizes but other parameters (a weight transposed, two
// parameters swapped, a renamed one) would load it without complaint and
// train on scrambled weights. So each block's entry in a rank manifest lists
// its parameters (name, shape), and a load refuses a model whose parameters
// differ, naming the first difference. Manifests written before this have no
// list; those load as before, checked by block name and size only.
Status check_saved_params(const std::string& dir, const nlohmann::json& saved, const BlockLayout& want) {
  if (!saved.contains("params")) return ok_status();
  const nlohmann::json& params = saved["params"];
  if (!params.is_array()) return data_corruption("checkpoint {}: block '{}' has a malformed parameter list", dir, want.name);
  if (params.size() != want.params.size()) {
    return invalid_argument("checkpoint {}: block '{}' was saved with {} parameters; the model's has {}", dir, want.name,
                            params.size(), want.params.size());
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = want.params[i];
    const std::string name = params[i].value("name", "");
    std::vector<std::int64_t> shape;
    if (params[i].contains("shape") && params[i]["shape"].is_array()) {
      for (const auto& d : params[i]["shape"]) shape.push_back(d.is_number_integer() ? d.get<std::int64_t>() : -1);
    }
    if (name != p.name || shape != p.shape) {
      return invalid_argument("checkpoint {}: parameter {} of block '{}' was saved as '{}' {}; the model has '{}' {}",
                              dir, i, want.name, name, shape_text(shape), p.name, shape_text(p.shape));
    }
  }
  return ok_status();
}

}  // namespace

// Note [Streamed checkpoints]
// A rank's states may be larger than its memory (that is what the NVMe tier
// is for), so a save, a load and an export hold one state of one block at a
// time, never the rank's whole: a save reads each state into a buffer of the
// largest shard, checksums it and appends it to the rank's file; an export
// writes each block as it is gathered. A load reads and verifies every state
// it needs once before replacing any (a corrupt checkpoint replaces nothing),
// then reads each again, verifying it, as it puts it back: the second read
// costs time, not memory, and the page cache serves it where the file fits.
// If the second read finds a state changed (the file rewritten under the
// load) or a put fails, some blocks hold the checkpoint's values and some the
// old ones: every rank then marks every block unset (Note [Initial values]),
// so nothing trains on the mixture until a load or set_master succeeds.
Status ZeroEngineImpl::write_rank_files(const std::string& dir) {
  const int rank = comm_->rank();
  const std::string bin = fmt::format("{}/rank-{}.bin", dir, rank);
  nlohmann::json blocks = nlohmann::json::array();
  // Aligned, so the writer takes the states straight from it (Note [Checkpoint files bypass the page cache]).
  TZ_ASSIGN_OR_RETURN(AlignedFloats memory, aligned_floats(largest_shard_numel()));
  float* const buffer = memory.get();
  const TieredStore* const stores[3] = {master_.get(), exp_avg_.get(), exp_avg_sq_.get()};
  std::uint64_t offset = 0;
  TZ_ASSIGN_OR_RETURN(FileWriter out, FileWriter::open(bin));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    nlohmann::json states = nlohmann::json::object();
    for (int k = 0; k < 3; ++k) {
      if (stores[k] == nullptr) continue;
      TZ_TRY_CTX(get(*stores[k], b, buffer), "reading {} of {} for the checkpoint", kStateNames[k],
                 layout_.blocks[b].name);
      const std::size_t bytes = layout_.blocks[b].shard_numel * 4;
      states[kStateNames[k]] = {{"offset", offset}, {"bytes", bytes}, {"xxh3", hex(nvme::checksum(buffer, bytes))}};
      TZ_TRY(out.append(buffer, bytes));
      offset += bytes;
    }
    nlohmann::json params = nlohmann::json::array();
    for (const ParamLayout& p : layout_.blocks[b].params) params.push_back({{"name", p.name}, {"shape", p.shape}});
    blocks.push_back({{"name", layout_.blocks[b].name}, {"shard_numel", layout_.blocks[b].shard_numel},
                      {"params", params}, {"states", states}});
  }
  TZ_TRY(out.finish());
  const detail::LossScaler::State ls = scaler_.state();
  const nlohmann::json manifest = {{"format", "tierzero-checkpoint-rank"}, {"version", kFormatVersion},
                                   {"rank", rank}, {"world_size", comm_->size()}, {"step", step_},
                                   {"optimizer", options_.config.optimizer.type},
                                   // set_learning_rate()'s (null when never set), so a schedule of
                                   // the caller's resumes; the config's derives its rate from `step`
                                   {"lr", lr_set_by_caller_ ? nlohmann::json(base_lr_) : nlohmann::json()},
                                   {"loss_scaler", {{"scale", ls.scale}, {"hysteresis_left", ls.hysteresis_left},
                                                    {"good_steps", ls.good_steps}}},
                                   {"file", fs::path(bin).filename().string()}, {"bytes", offset},
                                   {"blocks", blocks}};
  return write_file_synced(fmt::format("{}/rank-{}.json", dir, rank), manifest.dump(1));
}

std::uint64_t ZeroEngineImpl::largest_shard_numel() const {
  std::uint64_t n = 0;
  for (const BlockLayout& b : layout_.blocks) n = std::max(n, b.shard_numel);
  return n;
}

namespace {

constexpr const char* kClientStateFile = "client_state.bin";

// A tag is one directory name under the checkpoint directory, and not one of
// the names the directory uses itself.
Status check_tag(const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
      tag.find('\0') != std::string::npos || tag.size() > 200) {
    return invalid_argument("checkpoint tag '{}' is not a directory name (1 to 200 characters, no '/', not '.' or '..')",
                            tag);
  }
  if (tag == "latest" || tag == "latest.tmp" || tag.ends_with(".partial")) {
    return invalid_argument("checkpoint tag '{}' is a name the checkpoint directory uses itself ('latest', "
                            "'latest.tmp', '*.partial')",
                            tag);
  }
  return ok_status();
}

// Note [Replacing a checkpoint]
// Saving under an existing tag must not leave a moment with no complete
// checkpoint there: `latest` may point at it, and a crash would leave it
// dangling. So the new one is written beside it (<tag>.partial) and the two
// directories swap names in one renameat2(RENAME_EXCHANGE); the old one, now
// <tag>.partial, is then removed (or, after a crash, by the next save of that
// tag). A file system without the exchange gets an error, not a replacement
// that could lose both.
Status exchange(const std::string& a, const std::string& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return ok_status();
  const int err = errno;
  if (err == EINVAL || err == ENOSYS || err == ENOTSUP) {
    return failed_precondition("checkpoint: replacing {} needs an atomic exchange of directories (renameat2 "
                               "RENAME_EXCHANGE), which this file system refuses; save under a new tag",
                               b);
  }
  return errno_status(err, "checkpoint: exchanging " + a + " with " + b);
}

Status publish(const std::string& partial, const std::string& final_dir) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    fs::rename(partial, final_dir, ec);
    if (ec) return io_error("checkpoint: renaming {} to {}: {}", partial, final_dir, ec.message());
    return ok_status();
  }
  TZ_TRY(exchange(partial, final_dir));
  // The exchange is durable before the replaced checkpoint's files go: after
  // a power loss <tag> is the new checkpoint or the whole old one.
  TZ_TRY(sync_directory(fs::path(final_dir).parent_path().string()));
  fs::remove_all(partial, ec);  // the replaced checkpoint
  if (ec) TZ_LOG_WARN("engine", "checkpoint: the replaced checkpoint {} could not be removed: {}", partial, ec.message());
  return ok_status();
}

// A file system that cannot exchange (NFS, some FUSE ones) is found out on two
// empty directories before anything is written, not after every rank has
// written its shards.
Status probe_exchange(const std::string& final_dir) {
  const std::string a = final_dir + ".exchange-a.partial", b = final_dir + ".exchange-b.partial";
  std::error_code ec;
  fs::create_directories(a, ec);
  if (!ec) fs::create_directories(b, ec);
  if (ec) return io_error("checkpoint: preparing {}: {}", a, ec.message());
  const Status exchanged = exchange(a, b);
  fs::remove_all(a, ec);
  fs::remove_all(b, ec);
  return exchanged;
}

}  // namespace

Status ZeroEngineImpl::prepare_save(const std::string& dir, const std::string& final_dir, const std::string& partial) {
  std::error_code ec;
  const bool replacing = fs::exists(final_dir, ec);
  if (replacing && !fs::exists(final_dir + "/manifest.json", ec)) {
    return already_exists("checkpoint: {} exists and is not a tierzero checkpoint (no manifest.json); not replacing it",
                          final_dir);
  }
  fs::create_directories(dir, ec);
  fs::remove_all(partial, ec);  // a crashed earlier save of this name, or a replaced one left behind
  if (!ec) fs::create_directories(partial, ec);
  if (ec) return io_error("checkpoint: preparing {}: {}", partial, ec.message());
  return replacing ? probe_exchange(final_dir) : ok_status();
}

Expected<std::string> ZeroEngineImpl::save_checkpoint(const std::string& dir, const CheckpointSave& options) {
  TZ_TRY(comm_thread_->wait_idle());
  TZ_TRY(grad_thread_->wait_idle());
  if (micro_ != 0) {
    return failed_precondition("save_checkpoint: in the middle of gradient accumulation ({} of {} micro-batches); "
                               "save after a step",
                               micro_, gas_);
  }
  TZ_TRY(check_all_values_set("save_checkpoint"));
  TZ_TRY(check_path(dir, "save_checkpoint"));
  // Without a tag, a fresh name even when this step was saved before (an
  // fp16-skipped step does not advance it), so no complete checkpoint is
  // ever moved or overwritten. Every rank sees `dir` (one directory for all
  // ranks), so all pick the same name.
  std::string name = options.tag;
  if (name.empty()) {
    name = fmt::format("step-{}", step_);
    for (int k = 1; fs::exists(dir + "/" + name); ++k) name = fmt::format("step-{}.{}", step_, k);
  } else {
    TZ_TRY(check_tag(name));
  }
  const std::string final_dir = dir + "/" + name, partial = final_dir + ".partial";
  TZ_TRY(ranks_->agree_on(final_dir, "checkpoint", "checkpoints", "pass the same directory and tag"));
  TZ_TRY(agree(options.refusal, "checkpoint " + final_dir));  // before anything is written
  TZ_TRY(agree(comm_->rank() == 0 ? prepare_save(dir, final_dir, partial) : ok_status(), "checkpoint " + final_dir));
  TZ_TRY(agree(write_rank_files(partial), "checkpoint " + final_dir));
  Status published;
  if (comm_->rank() == 0) {
    published = [&]() -> Status {
      nlohmann::json manifest = {{"format", "tierzero-checkpoint"}, {"version", kFormatVersion},
                                 {"world_size", comm_->size()}, {"step", step_},
                                 {"blocks", layout_.blocks.size()}, {"stage", stage_}};
      if (options.client_state) {
        const std::string& bytes = *options.client_state;
        TZ_TRY(write_file_synced(partial + "/" + kClientStateFile, bytes));
        manifest["client_state"] = {{"file", kClientStateFile}, {"bytes", bytes.size()},
                                    {"xxh3", hex(nvme::checksum(bytes.data(), bytes.size()))}};
      }
      TZ_TRY(write_file_synced(partial + "/manifest.json", manifest.dump(1)));
      TZ_TRY(sync_directory(partial));
      TZ_TRY(publish(partial, final_dir));  // Note [Replacing a checkpoint]
      if (options.save_latest) {
        return write_file_durably(dir + "/latest", name).with_context("checkpoint: pointing latest at " + name);
      }
      return sync_directory(dir);
    }();
  }
  TZ_TRY(agree(published, "checkpoint " + final_dir));
  TZ_LOG_INFO("engine", "checkpoint saved: {}", final_dir);
  return final_dir;
}

Status ZeroEngineImpl::read_rank_files(const std::string& dir, bool weights_only, detail::RankFile& file) {
  return malformed_is_corrupt(fmt::format("checkpoint {}: rank-{}.json", dir, comm_->rank()),
                              [&] { return read_rank_files_json(dir, weights_only, file); });
}

namespace {

// Reads state k of block b (named `block`) from the rank's file into `out`
// and checks it against the checksum its manifest gave.
Status read_state(const detail::RankFile& file, std::size_t b, int k, const std::string& block, float* out) {
  const detail::SavedState& s = *file.states[b * 3 + k];
  auto* p = reinterpret_cast<char*>(out);
  // Extents the saving engine wrote are whole 4 KiB blocks (shards are 8 KiB
  // multiples): those are read past the page cache; any other goes through it.
  const std::uint64_t a = FileWriter::kAlign;
  const bool direct = file.direct_fd.valid() && s.offset % a == 0 && s.bytes % a == 0 &&
                      reinterpret_cast<std::uintptr_t>(p) % a == 0;
  const int fd = direct ? file.direct_fd.get() : file.fd.get();
  std::uint64_t done = 0;
  while (done < s.bytes) {
    const ssize_t n = ::pread(fd, p + done, s.bytes - done, static_cast<off_t>(s.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, "checkpoint: reading " + file.bin);
    if (n == 0) {
      return data_corruption("checkpoint file {} ends inside {} of {} (truncated?)", file.bin, kStateNames[k], block);
    }
    done += static_cast<std::uint64_t>(n);
  }
  if (hex(nvme::checksum(out, s.bytes)) != s.xxh3) {
    return data_corruption("checkpoint {}: checksum mismatch in {} of {} (bytes {}..{}): the file is corrupt", file.bin,
                           kStateNames[k], block, s.offset, s.offset + s.bytes);
  }
  return ok_status();
}

// Adam and AdamW keep the same moments; any other change of optimizer leaves
// states the new one cannot continue from.
bool same_optimizer_states(const std::string& a, const std::string& b) {
  auto family = [](const std::string& t) { return t == "AdamW" ? std::string("Adam") : t; };
  return family(a) == family(b);
}

}  // namespace

Status ZeroEngineImpl::read_rank_files_json(const std::string& dir, bool weights_only, detail::RankFile& file) {
  const int rank = comm_->rank();
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_json(fmt::format("{}/rank-{}.json", dir, rank)));
  if (m.value("format", "") != "tierzero-checkpoint-rank" || m.value("version", 0) != kFormatVersion) {
    return data_corruption("checkpoint {}: rank-{}.json is not a tierzero checkpoint (format version {})", dir, rank,
                           kFormatVersion);
  }
  if (m.value("world_size", 0) != comm_->size()) {
    return invalid_argument("checkpoint {} was saved by {} ranks; this run has {}", dir, m.value("world_size", 0),
                            comm_->size());
  }
  const std::string saved_optimizer = m.value("optimizer", "");
  if (!weights_only && !same_optimizer_states(saved_optimizer, options_.config.optimizer.type)) {
    return invalid_argument("checkpoint {} was saved by the {} optimizer; this engine's {} cannot continue from its "
                            "states (set optimizer.type \"{}\", or load the weights alone)",
                            dir, saved_optimizer, options_.config.optimizer.type, saved_optimizer);
  }
  const nlohmann::json& blocks = m["blocks"];
  if (!blocks.is_array() || blocks.size() != layout_.blocks.size()) {
    return invalid_argument("checkpoint {} has {} blocks; the model has {}", dir, blocks.size(), layout_.blocks.size());
  }
  file.bin = dir + "/" + m.value("file", "");
  const std::uint64_t file_bytes = m.value("bytes", std::uint64_t{0});
  {
    const int fd = ::open(file.bin.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return errno == ENOENT ? data_corruption("checkpoint {}: its states file {} does not exist", dir, file.bin)
                             : errno_status(errno, "checkpoint: opening " + file.bin);
    }
    file.fd = UniqueFd(fd);
    const int direct = ::open(file.bin.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // where the file system allows it
    if (direct >= 0) file.direct_fd = UniqueFd(direct);
  }
  struct stat info {};
  if (::fstat(file.fd.get(), &info) != 0) return errno_status(errno, "checkpoint: reading " + file.bin);
  if (!S_ISREG(info.st_mode)) return data_corruption("checkpoint: {} is not a regular file", file.bin);
  if (static_cast<std::uint64_t>(info.st_size) != file_bytes) {
    return data_corruption("checkpoint file {} holds {} bytes; its manifest says {} (truncated?)", file.bin,
                           info.st_size, file_bytes);
  }
  file.states.assign(layout_.blocks.size() * 3, std::nullopt);
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const BlockLayout& want = layout_.blocks[b];
    if (blocks[b].value("name", "") != want.name || blocks[b].value("shard_numel", 0ULL) != want.shard_numel) {
      return invalid_argument("checkpoint {}: block {} is '{}' with {} elements per shard; the model has '{}' with {}",
                              dir, b, blocks[b].value("name", ""), blocks[b].value("shard_numel", 0ULL), want.name,
                              want.shard_numel);
    }
    TZ_TRY(check_saved_params(dir, blocks[b], want));
    const bool needed[3] = {true, !weights_only && exp_avg_ != nullptr, !weights_only && exp_avg_sq_ != nullptr};
    const nlohmann::json& saved_states = blocks[b].at("states");
    for (int k = 0; k < 3; ++k) {
      if (!needed[k]) continue;
      if (!saved_states.contains(kStateNames[k])) {
        return data_corruption("checkpoint {}: block '{}' has no {} (saved by {})", file.bin, want.name, kStateNames[k],
                               saved_optimizer);
      }
      const nlohmann::json& saved = saved_states.at(kStateNames[k]);
      const std::uint64_t offset = saved.value("offset", 0ULL), bytes = saved.value("bytes", 0ULL);
      if (bytes != want.shard_numel * 4 || offset > file_bytes || bytes > file_bytes - offset) {
        return data_corruption("checkpoint {}: {} of {} has a bad extent ({} bytes at {})", file.bin, kStateNames[k],
                               want.name, bytes, offset);
      }
      file.states[b * 3 + k] = detail::SavedState{offset, bytes, saved.value("xxh3", "")};
    }
  }
  const nlohmann::json& ls = m.at("loss_scaler");
  file.step = m.value("step", std::int64_t{0});
  if (m.contains("lr") && !m["lr"].is_null()) {
    if (!m["lr"].is_number()) return data_corruption("checkpoint {}: learning rate {} is not a number", dir, m["lr"].dump());
    const double lr = m["lr"].get<double>();
    if (!(lr >= 0) || !std::isfinite(lr)) {
      return data_corruption("checkpoint {}: learning rate {} is not finite and >= 0", dir, lr);
    }
    file.saved_lr = lr;
  }
  file.scaler = {ls.value("scale", 1.0), ls.value("hysteresis_left", 1), ls.value("good_steps", std::int64_t{0})};
  const detail::LossScaler::State& scaler = file.scaler;
  if (!(scaler.scale > 0) || !std::isfinite(scaler.scale) || scaler.hysteresis_left < 1 || scaler.good_steps < 0) {
    return data_corruption("checkpoint {}: loss scaler {} is impossible (a scale must be finite and > 0, hysteresis "
                           ">= 1, good steps >= 0)",
                           dir, ls.dump());
  }
  if (file.step < 0 || file.step > (std::int64_t{1} << 53)) {
    return data_corruption("checkpoint {}: step {} is impossible", dir, file.step);
  }
  // Every state once, before anything is replaced (Note [Streamed checkpoints]).
  TZ_ASSIGN_OR_RETURN(AlignedFloats buffer, aligned_floats(largest_shard_numel()));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    for (int k = 0; k < 3; ++k) {
      if (file.states[b * 3 + k]) TZ_TRY(read_state(file, b, k, layout_.blocks[b].name, buffer.get()));
    }
  }
  return ok_status();
}

namespace {

// The checkpoint's own manifest, and the client state it lists (verified).
Status read_manifest_json(const std::string& dir, std::optional<std::string>& client_state) {
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_json(dir + "/manifest.json"));
  if (m.value("format", "") != "tierzero-checkpoint" || m.value("version", 0) != kFormatVersion) {
    return data_corruption("checkpoint {}: manifest.json is not a tierzero checkpoint's (format version {})", dir,
                           kFormatVersion);
  }
  if (!m.contains("client_state")) return ok_status();
  const nlohmann::json& c = m["client_state"];
  if (!c.is_object() || c.value("file", "").empty()) {
    return data_corruption("checkpoint {}: manifest.json has a malformed client_state entry", dir);
  }
  const std::string file = dir + "/" + c.value("file", "");
  TZ_ASSIGN_OR_RETURN(std::string bytes, read_text(file));
  if (bytes.size() != c.value("bytes", std::uint64_t{0})) {
    return data_corruption("checkpoint file {} holds {} bytes; its manifest says {} (truncated?)", file, bytes.size(),
                           c.value("bytes", std::uint64_t{0}));
  }
  if (hex(nvme::checksum(bytes.data(), bytes.size())) != c.value("xxh3", "")) {
    return data_corruption("checkpoint {}: checksum mismatch in {}: the file is corrupt", dir, file);
  }
  client_state = std::move(bytes);
  return ok_status();
}

Status read_manifest(const std::string& dir, std::optional<std::string>& client_state) {
  return malformed_is_corrupt(fmt::format("checkpoint {}: manifest.json", dir),
                              [&] { return read_manifest_json(dir, client_state); });
}

// The checkpoint directory `path` and `tag` name: path/<tag>, or what
// path/latest names, or path itself.
Expected<std::string> checkpoint_dir(const std::string& path, const std::string& tag) {
  TZ_TRY(check_path(path, "load_checkpoint"));
  std::string dir = path;
  if (!tag.empty()) {
    TZ_TRY(check_tag(tag));
    dir = path + "/" + tag;
    if (!fs::exists(dir + "/manifest.json")) {
      return not_found("checkpoint: no checkpoint tagged '{}' under {} ({} has no manifest.json)", tag, path, dir);
    }
  } else if (fs::exists(path + "/latest")) {
    TZ_ASSIGN_OR_RETURN(std::string name, read_text(path + "/latest"));
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();  // hand-written
    if (!check_tag(name).ok()) {
      return data_corruption("checkpoint: {}/latest names '{}', which is not a checkpoint directory beside it", path,
                             name);
    }
    dir = path + "/" + name;
  }
  if (!fs::exists(dir + "/manifest.json")) {
    return not_found("checkpoint: {} has no manifest.json (not a complete checkpoint, and no 'latest' beside it)", dir);
  }
  return dir;
}

}  // namespace

Expected<std::optional<std::string>> read_checkpoint_client_state(const std::string& dir, const std::string& tag) {
  TZ_ASSIGN_OR_RETURN(std::string resolved, checkpoint_dir(dir, tag));
  std::optional<std::string> client_state;
  TZ_TRY(read_manifest(resolved, client_state));
  return client_state;
}

Expected<LoadedCheckpoint> ZeroEngineImpl::load_checkpoint(const std::string& path, const CheckpointLoad& options) {
  TZ_TRY(comm_thread_->wait_idle());
  TZ_TRY(grad_thread_->wait_idle());
  TZ_ASSIGN_OR_RETURN(const std::string dir, checkpoint_dir(path, options.tag));
  detail::RankFile file;
  std::optional<std::string> client_state;
  // Everything is read and verified on every rank before any state is replaced.
  TZ_TRY(ranks_->agree_on(dir, "loading checkpoint", "checkpoints", "pass the same directory and tag"));
  TZ_TRY(agree(options.refusal, "loading checkpoint " + dir));
  const Status read = [&]() -> Status {
    TZ_TRY(read_manifest(dir, client_state));
    TZ_TRY(read_rank_files(dir, options.weights_only, file));
    if (options.check_client_state) TZ_TRY_CTX(options.check_client_state(client_state), "checkpoint {}", dir);
    return ok_status();
  }();
  TZ_TRY(agree(read, "loading checkpoint " + dir));
  // Prefetched blocks hold the old parameters, and their reads would race
  // the replacement: drop them first.
  prefetcher_->reset();
  if (!options.weights_only) restore_progress(file.step, file.scaler, file.saved_lr);
  std::fill(grad_fresh_.begin(), grad_fresh_.end(), false);
  micro_ = 0;
  // The puts are agreed before the persistent blocks' gathers: a rank whose
  // put failed must not leave the others alone in those collectives.
  Status loaded = agree(put_rank_file(file), "loading checkpoint " + dir);
  if (loaded.ok()) {
    loaded = agree([&]() -> Status {
      TZ_TRY(gather_persistent(/*unset_too=*/true));
      return prefetcher_->prefetching() ? prefetcher_->prefetch_next() : ok_status();
    }(), "loading checkpoint " + dir);
  }
  if (!loaded.ok()) {  // Note [Streamed checkpoints]: part old, part new
    unset_.assign(layout_.blocks.size(), true);
    return std::move(loaded).with_context(fmt::format(
        "checkpoint {} was loaded in part, so every block is now without values (fetch, step and saves are refused "
        "until a load_checkpoint or set_master succeeds)",
        dir));
  }
  // Note [Initial values]: set only once every rank has loaded every block, so
  // a load that failed anywhere leaves every rank with the same unset blocks.
  unset_.assign(layout_.blocks.size(), false);
  reset_io_counters();
  TZ_LOG_INFO("engine", "checkpoint loaded: {} (step {}{})", dir, step_, options.weights_only ? ", weights only" : "");
  return LoadedCheckpoint{dir, step_, std::move(client_state)};
}

Status ZeroEngineImpl::put_rank_file(const detail::RankFile& file) {
  TZ_ASSIGN_OR_RETURN(AlignedFloats buffer, aligned_floats(largest_shard_numel()));
  TieredStore* const stores[3] = {master_.get(), exp_avg_.get(), exp_avg_sq_.get()};
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const std::string& name = layout_.blocks[b].name;
    for (int k = 0; k < 3; ++k) {
      if (!file.states[b * 3 + k]) continue;
      TZ_TRY_CTX(read_state(file, b, k, name, buffer.get()), "reading it again to load it (it was verified a moment ago)");
      TZ_TRY_CTX(k == 0 ? put_weights(b, buffer.get()) : put(*stores[k], b, buffer.get()), "writing {} of {}",
                 kStateNames[k], name);
    }
  }
  return ok_status();
}

// The optimizer's progress from a checkpoint: step count, learning rate, loss scale.
void ZeroEngineImpl::restore_progress(std::int64_t step, const detail::LossScaler::State& scaler,
                                      const std::optional<double>& saved_lr) {
  step_ = step;
  if (saved_lr) {
    if (*saved_lr != base_lr_) {
      TZ_LOG_INFO("engine", "learning rate {} from the checkpoint (set_learning_rate before it was saved), not {}",
                  *saved_lr, base_lr_);
    }
    base_lr_ = *saved_lr;
    lr_set_by_caller_ = true;
  }
  scaler_.restore(scaler);
}

namespace {

// The tensor names of an export: names[b][p], or "<block>.<param>" without
// `names`; every one non-empty and unique.
Expected<std::vector<std::vector<std::string>>> export_names(const ModelLayout& layout,
                                                             const std::vector<std::vector<std::string>>& names) {
  if (!names.empty() && names.size() != layout.blocks.size()) {
    return invalid_argument("export_safetensors: names has {} lists, but the model has {} blocks", names.size(),
                            layout.blocks.size());
  }
  std::vector<std::vector<std::string>> out(layout.blocks.size());
  std::set<std::string> seen;
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    const BlockLayout& block = layout.blocks[b];
    if (!names.empty() && names[b].size() != block.params.size()) {
      return invalid_argument("export_safetensors: names[{}] has {} names, but block '{}' has {} parameters", b,
                              names[b].size(), block.name, block.params.size());
    }
    for (std::size_t p = 0; p < block.params.size(); ++p) {
      std::string name = names.empty() ? block.name + "." + block.params[p].name : names[b][p];
      if (name.empty()) {
        return invalid_argument("export_safetensors: names[{}][{}] (for {}.{}) is empty", b, p, block.name,
                                block.params[p].name);
      }
      if (name == "__metadata__") {
        return invalid_argument("export_safetensors: names[{}][{}] is '__metadata__', which the safetensors format "
                                "reserves for its metadata",
                                b, p);
      }
      if (!seen.insert(name).second) {
        return invalid_argument("export_safetensors: two tensors are named '{}'", name);
      }
      out[b].push_back(std::move(name));
    }
  }
  return out;
}

}  // namespace

Status ZeroEngineImpl::export_safetensors(const std::string& path, const std::vector<std::vector<std::string>>& names) {
  // Every rank takes part in the gathers below, or none does.
  TZ_TRY(check_all_values_set("export_safetensors"));  // the same on every rank
  Expected<std::vector<std::vector<std::string>>> tensor_names = export_names(layout_, names);
  const Status checked = tensor_names.ok() ? check_path(path, "export_safetensors") : tensor_names.status();
  TZ_TRY(agree(checked, "exporting " + path));
  // Header: {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}, all
  // known from the layout, so each block is written as it is gathered (Note [Streamed checkpoints]).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::uint64_t offset = 0;
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    for (std::size_t i = 0; i < layout_.blocks[b].params.size(); ++i) {
      const ParamLayout& p = layout_.blocks[b].params[i];
      const std::uint64_t bytes = p.numel * 4;
      header[(*tensor_names)[b][i]] = {{"dtype", "F32"}, {"shape", p.shape}, {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
  }
  // Rank 0 writes path.tmp; after a failure of its own it stops writing but
  // goes on gathering, so the other ranks are not left in a collective alone.
  const bool writer = comm_->rank() == 0;
  const std::string tmp = durable_temp_path(path);
  Cleanup remove_tmp([&] {
    if (writer) ::unlink(tmp.c_str());  // nothing partial left behind
  });
  Status written;
  std::optional<FileWriter> out;
  if (writer) {
    written = [&]() -> Status {
      TZ_ASSIGN_OR_RETURN(out, FileWriter::open(tmp));
      std::string text = header.dump();
      text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
      const std::uint64_t header_len = text.size();  // little-endian u64, as on every machine we run on
      TZ_TRY(out->append(&header_len, 8));
      return out->append(text.data(), text.size());
    }();
  }
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    TZ_ASSIGN_OR_RETURN(std::vector<float> whole, gather_master(b));  // every rank takes part
    for (const ParamLayout& p : layout_.blocks[b].params) {
      if (!writer || !written.ok()) break;
      written = out->append(whole.data() + p.offset, p.numel * 4);
    }
  }
  if (writer && written.ok()) {
    written = [&]() -> Status {
      TZ_TRY(out->finish());
      remove_tmp.cancel();  // replace_file_durably removes it on failure
      return replace_file_durably(tmp, path);
    }();
  }
  return agree(written, "exporting " + path);
}

}  // namespace tz
