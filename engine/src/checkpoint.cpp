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
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "host_collectives.h"
#include "tierzero/kernels.h"
#include "zero_engine_impl.h"

namespace tz {
namespace {

namespace fs = std::filesystem;

constexpr int kFormatVersion = 1;

Status write_all(int fd, const void* data, std::size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, "writing " + path);
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return ok_status();
}

// Writes `chunks` to path (created or truncated), fsyncs and closes it.
Status write_durably(const std::string& path, const std::vector<std::pair<const void*, std::size_t>>& chunks) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC));
  for (const auto& [data, bytes] : chunks) TZ_TRY(write_all(fd.get(), data, bytes, path));
  TZ_SYSCALL_CHECK(::fsync(fd.get()));
  return fd.close();
}

Status write_text_durably(const std::string& path, const std::string& text) {
  return write_durably(path, {{text.data(), text.size()}});
}

Status fsync_dir(const std::string& dir) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  TZ_SYSCALL_CHECK(::fsync(fd.get()));
  return fd.close();
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

}  // namespace

Status ZeroEngineImpl::barrier() { return comm_thread_->run([&] { return comm_->barrier(); }); }

// Every rank says whether it succeeded; all learn whether all did.
Status ZeroEngineImpl::agree(const Status& mine, std::string_view what) {
  std::int64_t failed = mine.ok() ? 0 : 1;
  TZ_TRY(comm_thread_->run([&] {
    return detail::all_reduce_host(*comm_, *device_, *device_pool_, &failed, 1, DataType::kInt64, ReduceOp::kSum);
  }));
  if (!mine.ok()) return mine;
  if (failed > 0) return io_error("{}: {} other rank(s) failed (see their errors)", what, failed);
  return ok_status();
}

Status ZeroEngineImpl::agree_on_name(const std::string& name, std::string_view what, std::string_view noun,
                                     std::string_view advice) {
  // The largest and the smallest of the ranks' hashes (as max of h and of -h): equal when all ranks agree.
  const auto h = static_cast<std::int64_t>(nvme::checksum(name.data(), name.size()) >> 2);
  std::int64_t extremes[2] = {h, -h};
  TZ_TRY(comm_thread_->run([&] {
    return detail::all_reduce_host(*comm_, *device_, *device_pool_, extremes, 2, DataType::kInt64, ReduceOp::kMax);
  }));
  if (extremes[0] != -extremes[1]) {
    return invalid_argument("{}: the ranks name different {} (this rank: '{}'); every rank must {}", what, noun, name,
                            advice);
  }
  return ok_status();
}

namespace {

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

Status ZeroEngineImpl::write_rank_files(const std::string& dir) {
  const int rank = comm_->rank();
  const std::string bin = fmt::format("{}/rank-{}.bin", dir, rank);
  nlohmann::json blocks = nlohmann::json::array();
  std::vector<std::vector<float>> buffers;
  std::vector<std::pair<const void*, std::size_t>> chunks;
  std::uint64_t offset = 0;
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    nlohmann::json states = nlohmann::json::object();
    for (const auto& [name, store] : {std::pair{"master", master_.get()}, std::pair{"exp_avg", exp_avg_.get()},
                                      std::pair{"exp_avg_sq", exp_avg_sq_.get()}}) {
      if (store == nullptr) continue;
      buffers.emplace_back(layout_.blocks[b].shard_numel);
      TZ_TRY_CTX(get(*store, b, buffers.back().data()), "reading {} of {} for the checkpoint", name,
                 layout_.blocks[b].name);
      const std::size_t bytes = buffers.back().size() * 4;
      states[name] = {{"offset", offset}, {"bytes", bytes}, {"xxh3", hex(nvme::checksum(buffers.back().data(), bytes))}};
      chunks.emplace_back(buffers.back().data(), bytes);
      offset += bytes;
    }
    nlohmann::json params = nlohmann::json::array();
    for (const ParamLayout& p : layout_.blocks[b].params) params.push_back({{"name", p.name}, {"shape", p.shape}});
    blocks.push_back({{"name", layout_.blocks[b].name}, {"shard_numel", layout_.blocks[b].shard_numel},
                      {"params", params}, {"states", states}});
  }
  TZ_TRY(write_durably(bin, chunks));
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
  return write_text_durably(fmt::format("{}/rank-{}.json", dir, rank), manifest.dump(1));
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
  TZ_TRY(fsync_dir(fs::path(final_dir).parent_path().string()));
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
  TZ_TRY(agree_on_name(final_dir, "checkpoint"));
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
        TZ_TRY(write_text_durably(partial + "/" + kClientStateFile, bytes));
        manifest["client_state"] = {{"file", kClientStateFile}, {"bytes", bytes.size()},
                                    {"xxh3", hex(nvme::checksum(bytes.data(), bytes.size()))}};
      }
      TZ_TRY(write_text_durably(partial + "/manifest.json", manifest.dump(1)));
      TZ_TRY(fsync_dir(partial));
      TZ_TRY(publish(partial, final_dir));  // Note [Replacing a checkpoint]
      if (options.save_latest) {
        TZ_TRY(write_text_durably(dir + "/latest.tmp", name));
        if (std::rename((dir + "/latest.tmp").c_str(), (dir + "/latest").c_str()) != 0) {
          return errno_status(errno, "checkpoint: pointing " + dir + "/latest at " + name);
        }
      }
      return fsync_dir(dir);
    }();
  }
  TZ_TRY(agree(published, "checkpoint " + final_dir));
  TZ_LOG_INFO("engine", "checkpoint saved: {}", final_dir);
  return final_dir;
}

// Reads and verifies this rank's files; states[b * 3 + k] = master, exp_avg,
// exp_avg_sq of block b (empty where the optimizer has no such state).
Status ZeroEngineImpl::read_rank_files(const std::string& dir, bool weights_only,
                                       std::vector<std::vector<float>>& states, std::int64_t& step,
                                       detail::LossScaler::State& scaler, std::optional<double>& saved_lr) {
  return malformed_is_corrupt(fmt::format("checkpoint {}: rank-{}.json", dir, comm_->rank()), [&] {
    return read_rank_files_json(dir, weights_only, states, step, scaler, saved_lr);
  });
}

namespace {

// Adam and AdamW keep the same moments; any other change of optimizer leaves
// states the new one cannot continue from.
bool same_optimizer_states(const std::string& a, const std::string& b) {
  auto family = [](const std::string& t) { return t == "AdamW" ? std::string("Adam") : t; };
  return family(a) == family(b);
}

}  // namespace

Status ZeroEngineImpl::read_rank_files_json(const std::string& dir, bool weights_only,
                                            std::vector<std::vector<float>>& states, std::int64_t& step,
                                            detail::LossScaler::State& scaler, std::optional<double>& saved_lr) {
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
  const std::string bin = dir + "/" + m.value("file", "");
  TZ_ASSIGN_OR_RETURN(std::string data, read_text(bin));
  if (data.size() != m.value("bytes", std::uint64_t{0})) {
    return data_corruption("checkpoint file {} holds {} bytes; its manifest says {} (truncated?)", bin, data.size(),
                           m.value("bytes", std::uint64_t{0}));
  }
  states.assign(layout_.blocks.size() * 3, {});
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const BlockLayout& want = layout_.blocks[b];
    if (blocks[b].value("name", "") != want.name || blocks[b].value("shard_numel", 0ULL) != want.shard_numel) {
      return invalid_argument("checkpoint {}: block {} is '{}' with {} elements per shard; the model has '{}' with {}",
                              dir, b, blocks[b].value("name", ""), blocks[b].value("shard_numel", 0ULL), want.name,
                              want.shard_numel);
    }
    TZ_TRY(check_saved_params(dir, blocks[b], want));
    const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
    const bool needed[3] = {true, !weights_only && exp_avg_ != nullptr, !weights_only && exp_avg_sq_ != nullptr};
    const nlohmann::json& saved_states = blocks[b].at("states");
    for (int k = 0; k < 3; ++k) {
      if (!needed[k]) continue;
      if (!saved_states.contains(names[k])) {
        return data_corruption("checkpoint {}: block '{}' has no {} (saved by {})", bin, want.name, names[k],
                               saved_optimizer);
      }
      const nlohmann::json& s = saved_states.at(names[k]);
      const std::uint64_t offset = s.value("offset", 0ULL), bytes = s.value("bytes", 0ULL);
      if (bytes != want.shard_numel * 4 || offset > data.size() || bytes > data.size() - offset) {
        return data_corruption("checkpoint {}: {} of {} has a bad extent ({} bytes at {})", bin, names[k], want.name,
                               bytes, offset);
      }
      if (hex(nvme::checksum(data.data() + offset, bytes)) != s.value("xxh3", "")) {
        return data_corruption("checkpoint {}: checksum mismatch in {} of {} (bytes {}..{}): the file is corrupt", bin,
                               names[k], want.name, offset, offset + bytes);
      }
      std::vector<float>& out = states[b * 3 + k];
      out.resize(want.shard_numel);
      std::memcpy(out.data(), data.data() + offset, bytes);
    }
  }
  const nlohmann::json& ls = m.at("loss_scaler");
  step = m.value("step", std::int64_t{0});
  if (m.contains("lr") && !m["lr"].is_null()) {
    if (!m["lr"].is_number()) return data_corruption("checkpoint {}: learning rate {} is not a number", dir, m["lr"].dump());
    const double lr = m["lr"].get<double>();
    if (!(lr >= 0) || !std::isfinite(lr)) {
      return data_corruption("checkpoint {}: learning rate {} is not finite and >= 0", dir, lr);
    }
    saved_lr = lr;
  }
  scaler = {ls.value("scale", 1.0), ls.value("hysteresis_left", 1), ls.value("good_steps", std::int64_t{0})};
  if (!(scaler.scale > 0) || !std::isfinite(scaler.scale) || scaler.hysteresis_left < 1 || scaler.good_steps < 0) {
    return data_corruption("checkpoint {}: loss scaler {} is impossible (a scale must be finite and > 0, hysteresis "
                           ">= 1, good steps >= 0)",
                           dir, ls.dump());
  }
  if (step < 0 || step > (std::int64_t{1} << 53)) {
    return data_corruption("checkpoint {}: step {} is impossible", dir, step);
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
  std::vector<std::vector<float>> states;
  std::int64_t step = 0;
  detail::LossScaler::State scaler{};
  std::optional<double> saved_lr;
  std::optional<std::string> client_state;
  // Everything is read and verified on every rank before any state is replaced.
  TZ_TRY(agree_on_name(dir, "loading checkpoint"));
  TZ_TRY(agree(options.refusal, "loading checkpoint " + dir));
  const Status read = [&]() -> Status {
    TZ_TRY(read_manifest(dir, client_state));
    TZ_TRY(read_rank_files(dir, options.weights_only, states, step, scaler, saved_lr));
    if (options.check_client_state) TZ_TRY_CTX(options.check_client_state(client_state), "checkpoint {}", dir);
    return ok_status();
  }();
  TZ_TRY(agree(read, "loading checkpoint " + dir));
  // Prefetched blocks hold the old parameters, and their reads would race
  // the replacement: drop them first.
  prefetcher_->reset();
  Status loaded = [&]() -> Status {
    if (!options.weights_only) restore_progress(step, scaler, saved_lr);
    for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
      TZ_TRY(put_weights(b, states[b * 3].data()));
      if (exp_avg_ && !options.weights_only) TZ_TRY(put(*exp_avg_, b, states[b * 3 + 1].data()));
      if (exp_avg_sq_ && !options.weights_only) TZ_TRY(put(*exp_avg_sq_, b, states[b * 3 + 2].data()));
    }
    std::fill(grad_fresh_.begin(), grad_fresh_.end(), false);
    micro_ = 0;
    TZ_TRY(gather_persistent(/*unset_too=*/true));
    return prefetcher_->prefetching() ? prefetcher_->prefetch_next() : ok_status();
  }();
  TZ_TRY(agree(loaded, "loading checkpoint " + dir));
  // Note [Initial values]: set only once every rank has loaded every block, so
  // a load that failed anywhere leaves every rank with the same unset blocks.
  unset_.assign(layout_.blocks.size(), false);
  nvme_read_bytes_ = 0;
  nvme_write_bytes_ = 0;
  TZ_LOG_INFO("engine", "checkpoint loaded: {} (step {}{})", dir, step_, options.weights_only ? ", weights only" : "");
  return LoadedCheckpoint{dir, step_, std::move(client_state)};
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
  // Header: {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::vector<std::vector<float>> tensors;
  std::uint64_t offset = 0;
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    TZ_ASSIGN_OR_RETURN(std::vector<float> whole, gather_master(b));  // every rank takes part
    for (std::size_t i = 0; i < layout_.blocks[b].params.size(); ++i) {
      const ParamLayout& p = layout_.blocks[b].params[i];
      const std::uint64_t bytes = p.numel * 4;
      header[(*tensor_names)[b][i]] = {{"dtype", "F32"}, {"shape", p.shape}, {"data_offsets", {offset, offset + bytes}}};
      tensors.emplace_back(whole.begin() + static_cast<std::ptrdiff_t>(p.offset),
                           whole.begin() + static_cast<std::ptrdiff_t>(p.offset + p.numel));
      offset += bytes;
    }
  }
  Status written;
  if (comm_->rank() == 0) {
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    const std::uint64_t header_len = text.size();  // little-endian u64, as on every machine we run on
    std::vector<std::pair<const void*, std::size_t>> chunks = {{&header_len, 8}, {text.data(), text.size()}};
    for (const auto& t : tensors) chunks.emplace_back(t.data(), t.size() * 4);
    const std::string tmp = path + ".tmp";
    written = write_durably(tmp, chunks);
    if (written.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
      written = errno_status(errno, "renaming " + tmp + " to " + path);
    }
    if (!written.ok()) ::unlink(tmp.c_str());  // nothing partial left behind
  }
  return agree(written, "exporting " + path);
}

}  // namespace tz
