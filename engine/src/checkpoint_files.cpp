#include "checkpoint_files.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc 2.28)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

// Note [Sealed manifests]
// The states in a rank's .bin file carry checksums, and so must what says
// how to use them: a step edited from 10 to 90 once resumed at step 90 with
// step 10's weights, and a misspelt "step" resumed at step 0. So every
// manifest holds "xxh3", the checksum of its own content: the compact dump of
// the object without that key (nlohmann::json keeps keys sorted and prints
// numbers so that they read back to the same value, so the dump is the same
// on reading). An edited, torn or unsealed manifest is refused as corrupt,
// and every field is then read as required: a missing one is an error, not a
// default. Changing a manifest on purpose (tests do) means sealing it again.
std::string seal_of(const nlohmann::json& m) {
  const std::string text = m.dump();
  return hex(nvme::checksum(text.data(), text.size()));
}

}  // namespace

std::string sealed_text(nlohmann::json m) {
  m.erase("xxh3");
  m["xxh3"] = seal_of(m);
  return m.dump(1);
}

Expected<nlohmann::json> read_sealed_json(const std::string& path) {
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_json(path));
  if (!m.is_object() || !m.contains("xxh3") || !m["xxh3"].is_string()) {
    return data_corruption("checkpoint: {} has no checksum of its own (\"xxh3\"): not a sealed tierzero manifest "
                           "(format version {})",
                           path, kCheckpointFormatVersion);
  }
  const std::string saved = m["xxh3"].get<std::string>();
  m.erase("xxh3");
  if (seal_of(m) != saved) {
    return data_corruption("checkpoint: checksum mismatch in {}: the manifest was changed or is torn", path);
  }
  return m;
}

namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("({})", fmt::join(shape, ", ")); }

// Note [Checkpoints know their parameters]
// A block's shard is a flat run of floats: a model whose blocks have the
// same names and sizes but other parameters (a weight transposed, two
// parameters swapped, a renamed one) would load it without complaint and
// train on scrambled weights. So each block's entry in a rank manifest lists
// its parameters (name, shape), and a load refuses a model whose parameters
// differ, naming the first difference.
Status check_saved_params(const std::string& dir, const nlohmann::json& saved, const BlockLayout& want) {
  const nlohmann::json& params = saved.at("params");
  if (!params.is_array()) return data_corruption("checkpoint {}: block '{}' has a malformed parameter list", dir, want.name);
  if (params.size() != want.params.size()) {
    return invalid_argument("checkpoint {}: block '{}' was saved with {} parameters; the model's has {}", dir, want.name,
                            params.size(), want.params.size());
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = want.params[i];
    const auto name = params[i].at("name").get<std::string>();
    const auto shape = params[i].at("shape").get<std::vector<std::int64_t>>();
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

static Status check_format_version(const std::string& dir, const std::string& file, const nlohmann::json& m) {
  const int version = m.at("version").get<int>();
  if (version < kOldestReadableCheckpointVersion || version > kCheckpointFormatVersion) {
    return data_corruption("checkpoint {}: {} has format version {}; this tierzero reads versions {} to {}", dir, file,
                           version, kOldestReadableCheckpointVersion, kCheckpointFormatVersion);
  }
  return ok_status();
}

// The checkpoint's own manifest, and the client state it lists (verified).
static Status read_manifest_json(const std::string& dir, Manifest& out) {
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_sealed_json(dir + "/manifest.json"));
  if (m.at("format").get<std::string>() != "tierzero-checkpoint") {
    return data_corruption("checkpoint {}: manifest.json is not a tierzero checkpoint's", dir);
  }
  TZ_TRY(check_format_version(dir, "manifest.json", m));
  out.world_size = m.at("world_size").get<int>();
  out.step = m.at("step").get<std::int64_t>();
  if (!m.contains("client_state")) return ok_status();
  const nlohmann::json& c = m["client_state"];
  const std::string file = dir + "/" + c.at("file").get<std::string>();
  const auto want_bytes = c.at("bytes").get<std::uint64_t>();
  TZ_ASSIGN_OR_RETURN(std::string bytes, read_text(file));
  if (bytes.size() != want_bytes) {
    return data_corruption("checkpoint file {} holds {} bytes; its manifest says {} (truncated?)", file, bytes.size(),
                           want_bytes);
  }
  if (hex(nvme::checksum(bytes.data(), bytes.size())) != c.at("xxh3").get<std::string>()) {
    return data_corruption("checkpoint {}: checksum mismatch in {}: the file is corrupt", dir, file);
  }
  out.client_state = std::move(bytes);
  return ok_status();
}

Expected<Manifest> read_manifest(const std::string& dir) {
  Manifest out;
  TZ_TRY(malformed_is_corrupt(fmt::format("checkpoint {}: manifest.json", dir), [&] { return read_manifest_json(dir, out); }));
  return out;
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
    if (!fs::exists(dir + "/manifest.json")) {
      return not_found("checkpoint: {}/latest names '{}', which is not a complete checkpoint (no {}/manifest.json)",
                       path, name, dir);
    }
  }
  if (!fs::exists(dir + "/manifest.json")) {
    // The complete checkpoints under `path`, newest first, so the message says what could be loaded.
    std::vector<std::pair<fs::file_time_type, std::string>> complete;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
      if (e.is_directory(ec) && fs::exists(e.path() / "manifest.json", ec)) {
        complete.emplace_back(fs::last_write_time(e.path() / "manifest.json", ec), e.path().filename().string());
      }
    }
    std::sort(complete.rbegin(), complete.rend());
    std::vector<std::string> names;
    for (const auto& [time, name] : complete) names.push_back(name);
    if (dir == path && !names.empty()) {
      return not_found("checkpoint: {} has no 'latest' (and no manifest.json of its own); its complete checkpoints, "
                       "newest first: {}; pass a tag",
                       dir, fmt::join(names, ", "));
    }
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
  if (m.at("format").get<std::string>() != "tierzero-checkpoint-rank") {
    return data_corruption("checkpoint {}: rank-{}.json is not a tierzero checkpoint's", dir, expect.rank);
  }
  TZ_TRY(check_format_version(dir, fmt::format("rank-{}.json", expect.rank), m));
  if (m.at("version").get<int>() >= 3) {
    const nlohmann::json& states = m.at("states");  // the run's formats: required, and what they say is known
    const auto master = states.at("master").get<std::string>(), moments = states.at("moments").get<std::string>();
    auto known = [](const auto& formats, auto name_of, const std::string& name) {
      return std::any_of(std::begin(formats), std::end(formats), [&](auto f) { return name_of(f) == name; });
    };
    if (!known(kMasterFormats, master_format_name, master) || !known(kMomentFormats, moment_format_name, moments)) {
      return data_corruption("checkpoint {}: rank-{}.json says the run trained in master {}, moments {}: formats "
                             "this tierzero does not know",
                             dir, expect.rank, master, moments);
    }
  }
  if (m.at("rank").get<int>() != expect.rank) {
    return data_corruption("checkpoint {}: rank-{}.json holds rank {}'s states", dir, expect.rank, m.at("rank").get<int>());
  }
  if (const int saved = m.at("world_size").get<int>(); saved != expect.world_size) {
    return invalid_argument("checkpoint {} was saved by {} ranks; this run has {}", dir, saved, expect.world_size);
  }
  const std::string saved_optimizer = m.at("optimizer").get<std::string>();
  if (!expect.weights_only && !same_optimizer_states(saved_optimizer, expect.optimizer)) {
    return invalid_argument("checkpoint {} was saved by the {} optimizer; this engine's {} cannot continue from its "
                            "states (set optimizer.type \"{}\", or load the weights alone)",
                            dir, saved_optimizer, expect.optimizer, saved_optimizer);
  }
  const nlohmann::json& blocks = m.at("blocks");
  if (!blocks.is_array() || blocks.size() != expect.layout->blocks.size()) {
    return invalid_argument("checkpoint {} has {} blocks; the model has {}", dir, blocks.size(),
                            expect.layout->blocks.size());
  }
  return ok_status();
}

// Opens the rank's states file (and again with O_DIRECT where allowed) and
// checks it holds the bytes its manifest says.
Status open_states_file(const std::string& dir, const nlohmann::json& m, RankFile& file) {
  file.bin = dir + "/" + m.at("file").get<std::string>();
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
  const auto file_bytes = m.at("bytes").get<std::uint64_t>();
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
  const auto name = entry.at("name").get<std::string>();
  const auto shard_numel = entry.at("shard_numel").get<std::uint64_t>();
  if (name != want.name || shard_numel != want.shard_numel) {
    return invalid_argument("checkpoint {}: block {} is '{}' with {} elements per shard; the model has '{}' with {}",
                            dir, b, name, shard_numel, want.name, want.shard_numel);
  }
  TZ_TRY(check_saved_params(dir, entry, want));
  const bool needed[3] = {true, !expect.weights_only && expect.has_exp_avg,
                          !expect.weights_only && expect.has_exp_avg_sq};
  const auto file_bytes = m.at("bytes").get<std::uint64_t>();
  const nlohmann::json& saved_states = entry.at("states");
  for (int k = 0; k < 3; ++k) {
    if (!needed[k]) continue;
    if (!saved_states.contains(kStateNames[k])) {
      return data_corruption("checkpoint {}: block '{}' has no {} (saved by {})", file.bin, want.name, kStateNames[k],
                             m.at("optimizer").get<std::string>());
    }
    const nlohmann::json& saved = saved_states.at(kStateNames[k]);
    // Version 2 stored fp32 alone; from version 3 each state says (and must say) what it holds.
    const std::string dtype = m.at("version").get<int>() >= 3 ? saved.at("dtype").get<std::string>() : "fp32";
    if (dtype != kStoredStateDtype) {
      return data_corruption("checkpoint {}: {} of {} is stored as \"{}\"; this tierzero reads {} states", file.bin,
                             kStateNames[k], want.name, dtype, kStoredStateDtype);
    }
    const auto offset = saved.at("offset").get<std::uint64_t>(), bytes = saved.at("bytes").get<std::uint64_t>();
    if (bytes != want.shard_numel * 4 || offset > file_bytes || bytes > file_bytes - offset) {
      return data_corruption("checkpoint {}: {} of {} has a bad extent ({} bytes at {})", file.bin, kStateNames[k],
                             want.name, bytes, offset);
    }
    file.states[b * 3 + k] = SavedState{offset, bytes, saved.at("xxh3").get<std::string>()};
  }
  return ok_status();
}

// The optimizer's progress: step, the caller's learning rate, the loss scaler.
Status read_progress(const std::string& dir, const nlohmann::json& m, RankFile& file) {
  const nlohmann::json& ls = m.at("loss_scaler");
  file.step = m.at("step").get<std::int64_t>();
  if (!m.at("lr").is_null()) {
    if (!m["lr"].is_number()) return data_corruption("checkpoint {}: learning rate {} is not a number", dir, m["lr"].dump());
    const double lr = m["lr"].get<double>();
    if (!(lr >= 0) || !std::isfinite(lr)) {
      return data_corruption("checkpoint {}: learning rate {} is not finite and >= 0", dir, lr);
    }
    file.saved_lr = lr;
  }
  file.scaler = {ls.at("scale").get<double>(), ls.at("hysteresis_left").get<int>(), ls.at("good_steps").get<std::int64_t>()};
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
  TZ_ASSIGN_OR_RETURN(nlohmann::json m, read_sealed_json(fmt::format("{}/rank-{}.json", dir, expect.rank)));
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
