#include "checkpoint_files.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc 2.28)
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tierzero/common/durable_file.h"
#include "tierzero/common/log.h"
#include "tierzero/common/units.h"
#include "tierzero/nvme.h"

namespace tz::detail {
namespace {

namespace fs = std::filesystem;

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

// Adam and AdamW keep the same moments; any other change of optimizer leaves
// states the new one cannot continue from.
bool same_optimizer_states(const std::string& a, const std::string& b) {
  auto family = [](const std::string& t) { return t == "AdamW" ? std::string("Adam") : t; };
  return family(a) == family(b);
}

}  // namespace

std::string hex(std::uint64_t x) { return fmt::format("{:016x}", x); }

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
Expected<FileWriter> FileWriter::open(const std::string& path) {
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

Status FileWriter::append(const void* data, std::size_t bytes) {
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

Status FileWriter::finish() {
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

// n floats (at least one) at a FileWriter::kAlign boundary, for O_DIRECT.
Expected<AlignedFloats> aligned_floats(std::uint64_t n) {
  const std::uint64_t bytes = align_up(std::max<std::uint64_t>(n, 1) * 4, FileWriter::kAlign);
  AlignedFloats memory(static_cast<float*>(std::aligned_alloc(FileWriter::kAlign, bytes)), &std::free);
  if (memory == nullptr) return out_of_memory("checkpoint: no memory for a {}-byte state buffer", bytes);
  return memory;
}

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
static Status exchange(const std::string& a, const std::string& b) {
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

// The checkpoint's own manifest, and the client state it lists (verified).
static Status read_manifest_json(const std::string& dir, std::optional<std::string>& client_state) {
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_json(dir + "/manifest.json"));
  if (m.value("format", "") != "tierzero-checkpoint" || m.value("version", 0) != kCheckpointFormatVersion) {
    return data_corruption("checkpoint {}: manifest.json is not a tierzero checkpoint's (format version {})", dir,
                           kCheckpointFormatVersion);
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

Status read_state(const RankFile& file, std::size_t b, int k, const std::string& block, float* out) {
  const SavedState& s = *file.states[b * 3 + k];
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

namespace {

Status check_rank_header(const std::string& dir, const nlohmann::json& m, const RankExpect& expect) {
  if (m.value("format", "") != "tierzero-checkpoint-rank" || m.value("version", 0) != kCheckpointFormatVersion) {
    return data_corruption("checkpoint {}: rank-{}.json is not a tierzero checkpoint (format version {})", dir,
                           expect.rank, kCheckpointFormatVersion);
  }
  if (m.value("world_size", 0) != expect.world_size) {
    return invalid_argument("checkpoint {} was saved by {} ranks; this run has {}", dir, m.value("world_size", 0),
                            expect.world_size);
  }
  const std::string saved_optimizer = m.value("optimizer", "");
  if (!expect.weights_only && !same_optimizer_states(saved_optimizer, expect.optimizer)) {
    return invalid_argument("checkpoint {} was saved by the {} optimizer; this engine's {} cannot continue from its "
                            "states (set optimizer.type \"{}\", or load the weights alone)",
                            dir, saved_optimizer, expect.optimizer, saved_optimizer);
  }
  const nlohmann::json& blocks = m["blocks"];
  if (!blocks.is_array() || blocks.size() != expect.layout->blocks.size()) {
    return invalid_argument("checkpoint {} has {} blocks; the model has {}", dir, blocks.size(),
                            expect.layout->blocks.size());
  }
  return ok_status();
}

// Opens the rank's states file (and again with O_DIRECT where allowed) and
// checks it holds the bytes its manifest says.
Status open_states_file(const std::string& dir, const nlohmann::json& m, RankFile& file) {
  file.bin = dir + "/" + m.value("file", "");
  const int fd = ::open(file.bin.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno == ENOENT ? data_corruption("checkpoint {}: its states file {} does not exist", dir, file.bin)
                           : errno_status(errno, "checkpoint: opening " + file.bin);
  }
  file.fd = UniqueFd(fd);
  const int direct = ::open(file.bin.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);  // where the file system allows it
  if (direct >= 0) file.direct_fd = UniqueFd(direct);
  struct stat info {};
  if (::fstat(file.fd.get(), &info) != 0) return errno_status(errno, "checkpoint: reading " + file.bin);
  if (!S_ISREG(info.st_mode)) return data_corruption("checkpoint: {} is not a regular file", file.bin);
  const std::uint64_t file_bytes = m.value("bytes", std::uint64_t{0});
  if (static_cast<std::uint64_t>(info.st_size) != file_bytes) {
    return data_corruption("checkpoint file {} holds {} bytes; its manifest says {} (truncated?)", file.bin,
                           info.st_size, file_bytes);
  }
  return ok_status();
}

// Block b's entry: the model's block, and the extents of the states the load needs.
Status read_block_entry(const std::string& dir, const nlohmann::json& entry, std::size_t b, const RankExpect& expect,
                        const nlohmann::json& m, RankFile& file) {
  const BlockLayout& want = expect.layout->blocks[b];
  if (entry.value("name", "") != want.name || entry.value("shard_numel", 0ULL) != want.shard_numel) {
    return invalid_argument("checkpoint {}: block {} is '{}' with {} elements per shard; the model has '{}' with {}",
                            dir, b, entry.value("name", ""), entry.value("shard_numel", 0ULL), want.name,
                            want.shard_numel);
  }
  TZ_TRY(check_saved_params(dir, entry, want));
  const bool needed[3] = {true, !expect.weights_only && expect.has_exp_avg,
                          !expect.weights_only && expect.has_exp_avg_sq};
  const std::uint64_t file_bytes = m.value("bytes", std::uint64_t{0});
  const nlohmann::json& saved_states = entry.at("states");
  for (int k = 0; k < 3; ++k) {
    if (!needed[k]) continue;
    if (!saved_states.contains(kStateNames[k])) {
      return data_corruption("checkpoint {}: block '{}' has no {} (saved by {})", file.bin, want.name, kStateNames[k],
                             m.value("optimizer", ""));
    }
    const nlohmann::json& saved = saved_states.at(kStateNames[k]);
    const std::uint64_t offset = saved.value("offset", 0ULL), bytes = saved.value("bytes", 0ULL);
    if (bytes != want.shard_numel * 4 || offset > file_bytes || bytes > file_bytes - offset) {
      return data_corruption("checkpoint {}: {} of {} has a bad extent ({} bytes at {})", file.bin, kStateNames[k],
                             want.name, bytes, offset);
    }
    file.states[b * 3 + k] = SavedState{offset, bytes, saved.value("xxh3", "")};
  }
  return ok_status();
}

// The optimizer's progress: step, the caller's learning rate, the loss scaler.
Status read_progress(const std::string& dir, const nlohmann::json& m, RankFile& file) {
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
  const LossScaler::State& scaler = file.scaler;
  if (!(scaler.scale > 0) || !std::isfinite(scaler.scale) || scaler.hysteresis_left < 1 || scaler.good_steps < 0) {
    return data_corruption("checkpoint {}: loss scaler {} is impossible (a scale must be finite and > 0, hysteresis "
                           ">= 1, good steps >= 0)",
                           dir, ls.dump());
  }
  if (file.step < 0 || file.step > (std::int64_t{1} << 53)) {
    return data_corruption("checkpoint {}: step {} is impossible", dir, file.step);
  }
  return ok_status();
}

Status read_rank_file_json(const std::string& dir, const RankExpect& expect, RankFile& file) {
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_json(fmt::format("{}/rank-{}.json", dir, expect.rank)));
  TZ_TRY(check_rank_header(dir, m, expect));
  TZ_TRY(open_states_file(dir, m, file));
  const ModelLayout& layout = *expect.layout;
  file.states.assign(layout.blocks.size() * 3, std::nullopt);
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) TZ_TRY(read_block_entry(dir, m["blocks"][b], b, expect, m, file));
  TZ_TRY(read_progress(dir, m, file));
  // Every state once, before anything is replaced (Note [Streamed checkpoints]).
  TZ_ASSIGN_OR_RETURN(AlignedFloats buffer, aligned_floats(layout.largest_shard_numel()));
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    for (int k = 0; k < 3; ++k) {
      if (file.states[b * 3 + k]) TZ_TRY(read_state(file, b, k, layout.blocks[b].name, buffer.get()));
    }
  }
  return ok_status();
}

}  // namespace

Status read_rank_file(const std::string& dir, const RankExpect& expect, RankFile& file) {
  return malformed_is_corrupt(fmt::format("checkpoint {}: rank-{}.json", dir, expect.rank),
                              [&] { return read_rank_file_json(dir, expect, file); });
}

}  // namespace tz::detail
