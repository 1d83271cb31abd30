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
#include "checkpoint_files.h"
#include "zero_engine_impl.h"

namespace tz {
namespace {

namespace fs = std::filesystem;
using detail::AlignedFloats;
using detail::aligned_floats;
using detail::FileWriter;
using detail::hex;
using detail::kStateNames;

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
  TZ_ASSIGN_OR_RETURN(AlignedFloats memory, aligned_floats(layout_.largest_shard_numel()));
  float* const buffer = memory.get();
  const TieredStore* const stores[3] = {master_.get(), exp_avg_.get(), exp_avg_sq_.get()};
  std::uint64_t offset = 0;
  TZ_ASSIGN_OR_RETURN(FileWriter out, FileWriter::open(bin));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    nlohmann::json states = nlohmann::json::object();
    for (int k = 0; k < 3; ++k) {
      if (stores[k] == nullptr) continue;
      TZ_TRY_CTX(k == 0 ? get_master(b, buffer) : get_moment(k - 1, b, buffer), "reading {} of {} for the checkpoint",
                 kStateNames[k], layout_.blocks[b].name);
      const std::size_t bytes = layout_.blocks[b].shard_numel * 4;
      states[kStateNames[k]] = {{"offset", offset}, {"bytes", bytes}, {"dtype", detail::kStoredStateDtype},
                                {"xxh3", hex(nvme::checksum(buffer, bytes))}};
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
  const nlohmann::json manifest = {{"format", "tierzero-checkpoint-rank"}, {"version", detail::kCheckpointFormatVersion},
                                   {"rank", rank}, {"world_size", comm_->size()}, {"step", step_},
                                   {"optimizer", options_.config.optimizer.type},
                                   // what the run trained in; the file holds fp32 states whatever these are
                                   {"states", {{"master", master_format_name(options_.config.states.master)},
                                               {"moments", moment_format_name(options_.config.states.moments)}}},
                                   // set_learning_rate()'s (null when never set), so a schedule of
                                   // the caller's resumes; the config's derives its rate from `step`
                                   {"lr", lr_set_by_caller_ ? nlohmann::json(base_lr_) : nlohmann::json()},
                                   {"loss_scaler", {{"scale", ls.scale}, {"hysteresis_left", ls.hysteresis_left},
                                                    {"good_steps", ls.good_steps}}},
                                   {"file", fs::path(bin).filename().string()}, {"bytes", offset},
                                   {"blocks", blocks}};
  return write_file_synced(fmt::format("{}/rank-{}.json", dir, rank), detail::sealed_text(manifest));  // Note [Sealed manifests]
}

// Note [One saver a folder]
// Two runs saving into one folder (two jobs given the same --save, a restart
// while the old run still lives) used to remove each other's .partial
// directories and publish checkpoints the other had half written. A save
// now holds an advisory lock on dir/.tierzero-save.lock (common/file_lock.h)
// from before it picks its .partial until it is published, on rank 0, which
// alone removes, renames and points `latest`; a second saver fails at once,
// naming the folder and the holder (its PID and host, as it wrote them into
// the file, for the message only). The lock is held per save, not for the
// engine's life: an engine that saved into a folder does not stop another
// engine of the same program saving there later (a resumed run in a
// notebook). An untagged save picks a name no checkpoint has before it locks,
// so under the lock it checks the name is still free: if not, another run
// saved meanwhile. keep_last prunes under the lock too. A save that fails
// removes its own .partial (it holds the lock, so the .partial is its own); a
// process killed mid-save leaves it to the next save of that name, as before.
static Expected<LockFile> lock_save_folder(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("checkpoint: creating {}: {}", dir, ec.message());
  return LockFile::acquire(dir + "/.tierzero-save.lock",
                           fmt::format("checkpoint: another run is saving into {}; give each run its own folder", dir));
}

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
  // errno_status: a full disk is kNoSpace, as the writes' own failures are.
  if (ec) return errno_status(ec.value(), fmt::format("checkpoint: preparing {}", partial));
  return replacing ? detail::probe_exchange(final_dir) : ok_status();
}

Expected<std::string> ZeroEngineImpl::save_checkpoint(const std::string& dir, const CheckpointSave& options) {
  TZ_TRY(comm_thread_->wait_idle());
  TZ_TRY(grad_thread_->wait_idle());
  TZ_TRY(cancel_step_ahead());  // Note [Stepping under backward]: the states as the last step left them
  if (micro_ != 0) {
    return failed_precondition("save_checkpoint: in the middle of gradient accumulation ({} of {} micro-batches); "
                               "save after a step",
                               micro_, gas_);
  }
  TZ_TRY(blocks_.check_all_set("save_checkpoint"));
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
    TZ_TRY(detail::check_tag(name));
  }
  const std::string final_dir = dir + "/" + name, partial = final_dir + ".partial";
  TZ_TRY(ranks_->agree_on(final_dir, "checkpoint", "checkpoints", "pass the same directory and tag"));
  TZ_TRY(agree(options.refusal, "checkpoint " + final_dir));  // before anything is written
  // Note [One saver a folder]: rank 0 holds the folder's lock until the save is published.
  LockFile folder_lock;
  Cleanup drop_partial([&] {
    std::error_code ec;
    if (folder_lock.held()) fs::remove_all(partial, ec);  // ours: nothing half-written stays
  });
  const Status prepared = comm_->rank() != 0 ? ok_status() : [&]() -> Status {
    TZ_ASSIGN_OR_RETURN(folder_lock, lock_save_folder(dir));
    if (options.tag.empty() && fs::exists(final_dir)) {  // chosen fresh before the lock: another saver was first
      return already_exists("checkpoint: {} appeared while this save was starting: another run saves into {} too; "
                            "give each run its own folder", final_dir, dir);
    }
    return prepare_save(dir, final_dir, partial);
  }();
  TZ_TRY(agree(prepared, "checkpoint " + final_dir));
  TZ_TRY(agree(write_rank_files(partial), "checkpoint " + final_dir));
  Status published;
  if (comm_->rank() == 0) {
    published = [&]() -> Status {
      nlohmann::json manifest = {{"format", "tierzero-checkpoint"}, {"version", detail::kCheckpointFormatVersion},
                                 {"world_size", comm_->size()}, {"step", step_},
                                 {"blocks", layout_.blocks.size()}, {"stage", stage_}};
      if (options.client_state) {
        const std::string& bytes = *options.client_state;
        TZ_TRY(write_file_synced(partial + "/" + detail::kClientStateFile, bytes));
        manifest["client_state"] = {{"file", detail::kClientStateFile}, {"bytes", bytes.size()},
                                    {"xxh3", hex(nvme::checksum(bytes.data(), bytes.size()))}};
      }
      TZ_TRY(write_file_synced(partial + "/manifest.json", detail::sealed_text(manifest)));
      TZ_TRY(sync_directory(partial));
      TZ_TRY(detail::publish(partial, final_dir));  // Note [Replacing a checkpoint]
      if (options.save_latest) {
        TZ_TRY_CTX(write_file_durably(dir + "/latest", name), "checkpoint: pointing latest at {}", name);
      } else {
        TZ_TRY(sync_directory(dir));
      }
      if (options.keep_last <= 0) return ok_status();
      std::vector<std::string> keep_too = {name};
      if (Expected<std::string> latest = detail::checkpoint_dir(dir, ""); latest.ok()) {
        keep_too.push_back(fs::path(*latest).filename().string());
      }
      TZ_ASSIGN_OR_RETURN(std::vector<std::string> removed,
                          detail::prune_checkpoints(dir, options.keep_last, keep_too));
      if (!removed.empty()) {
        TZ_LOG_INFO("engine", "checkpoint: keep_last {} removed {}", options.keep_last, fmt::join(removed, ", "));
      }
      return ok_status();
    }();
  }
  TZ_TRY(agree(published, "checkpoint " + final_dir));
  drop_partial.cancel();
  TZ_LOG_INFO("engine", "checkpoint saved: {}", final_dir);
  return final_dir;
}

Status ZeroEngineImpl::read_rank_files(const std::string& dir, bool weights_only, detail::RankFile& file) {
  return detail::read_rank_file(dir,
                                {.rank = comm_->rank(), .world_size = comm_->size(), .layout = &layout_,
                                 .optimizer = options_.config.optimizer.type, .weights_only = weights_only,
                                 .has_exp_avg = exp_avg_ != nullptr, .has_exp_avg_sq = exp_avg_sq_ != nullptr},
                                file);
}

Expected<std::optional<std::string>> read_checkpoint_client_state(const std::string& dir, const std::string& tag) {
  TZ_ASSIGN_OR_RETURN(std::string resolved, detail::checkpoint_dir(dir, tag));
  TZ_ASSIGN_OR_RETURN(detail::Manifest manifest, detail::read_manifest(resolved));
  return std::move(manifest.client_state);
}

Expected<LoadedCheckpoint> ZeroEngineImpl::load_checkpoint(const std::string& path, const CheckpointLoad& options) {
  TZ_TRY(comm_thread_->wait_idle());
  TZ_TRY(grad_thread_->wait_idle());
  TZ_TRY(cancel_step_ahead());
  TZ_ASSIGN_OR_RETURN(const std::string dir, detail::checkpoint_dir(path, options.tag));
  detail::RankFile file;
  detail::Manifest manifest;
  // Everything is read and verified on every rank before any state is replaced.
  TZ_TRY(ranks_->agree_on(dir, "loading checkpoint", "checkpoints", "pass the same directory and tag"));
  TZ_TRY(agree(options.refusal, "loading checkpoint " + dir));
  const Status read = [&]() -> Status {
    TZ_ASSIGN_OR_RETURN(manifest, detail::read_manifest(dir));
    TZ_TRY(read_rank_files(dir, options.weights_only, file));
    // Both are sealed; a pair that disagrees was assembled from two saves.
    if (manifest.step != file.step || manifest.world_size != comm_->size()) {
      return data_corruption("checkpoint {}: manifest.json says step {} by {} ranks, but rank-{}.json says step {} by "
                             "{} ranks: the files are from different saves",
                             dir, manifest.step, manifest.world_size, comm_->rank(), file.step, comm_->size());
    }
    if (options.check_client_state) {
      TZ_TRY_CTX(options.check_client_state(manifest.client_state), "checkpoint {}", dir);
    }
    return ok_status();
  }();
  TZ_TRY(agree(read, "loading checkpoint " + dir));
  // Prefetched blocks hold the old parameters, and their reads would race
  // the replacement: drop them first.
  prefetcher_->reset();
  if (!options.weights_only) restore_progress(file.step, file.scaler, file.saved_lr);
  blocks_.end_window();
  grads_->discard_window();
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
    blocks_.unset_all();
    return std::move(loaded).with_context(fmt::format(
        "checkpoint {} was loaded in part, so every block is now without values (fetch, step and saves are refused "
        "until a load_checkpoint or set_master succeeds)",
        dir));
  }
  // Note [Initial values]: set only once every rank has loaded every block, so
  // a load that failed anywhere leaves every rank with the same unset blocks.
  blocks_.loaded();
  reset_io_counters();
  TZ_LOG_INFO("engine", "checkpoint loaded: {} (step {}{})", dir, step_, options.weights_only ? ", weights only" : "");
  return LoadedCheckpoint{dir, step_, std::move(manifest.client_state)};
}

Status ZeroEngineImpl::put_rank_file(const detail::RankFile& file) {
  TZ_ASSIGN_OR_RETURN(AlignedFloats buffer, aligned_floats(layout_.largest_shard_numel()));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const std::string& name = layout_.blocks[b].name;
    for (int k = 0; k < 3; ++k) {
      if (!file.states[b * 3 + k]) continue;
      TZ_TRY_CTX(detail::read_state(file, b, k, name, buffer.get()), "reading it again to load it (it was verified a moment ago)");
      TZ_TRY_CTX(k == 0 ? put_weights(b, buffer.get()) : put_moment(k - 1, b, buffer.get()), "writing {} of {}",
                 kStateNames[k], name);
    }
  }
  return ok_status();
}

// The optimizer's progress from a checkpoint: step count, learning rate, loss scale.
void ZeroEngineImpl::restore_progress(std::int64_t step, const detail::LossScaler::State& scaler,
                                      const std::optional<double>& saved_lr) {
  step_ = step;
  comm_->note_step(step_ + 1);
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
  TZ_TRY(blocks_.check_all_set("export_safetensors"));
  TZ_TRY(cancel_step_ahead());  // the same on every rank
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
