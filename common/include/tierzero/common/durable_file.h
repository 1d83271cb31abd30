// Crash-safe file writing: after a crash or power loss a reader finds the old
// file or the new one whole, never a half-written one.
//
//   TZ_TRY(tz::write_file_durably(dir + "/latest", tag));
//
// write_file_durably writes `bytes` to path + ".tmp" (beside the target, so
// the rename stays on one file system), fsyncs it, renames it over `path` and
// fsyncs the directory, so the rename itself survives a power loss. On any
// failure the temporary file is removed and an existing `path` is left as it
// was; the Status names the path and the system's error text.
//
// A writer of its own (the checkpoint's O_DIRECT export streams gigabytes)
// writes and fsyncs durable_temp_path(path) itself and ends with
// replace_file_durably(temp, path).
//
// Thread safety: the functions touch no shared state, but two writers of the
// same path at once share the temporary name; the caller keeps them apart.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "tierzero/common/status.h"

namespace tz {

// The temporary name a durable write of `path` uses: "<path>.tmp".
std::string durable_temp_path(const std::string& path);

// Writes `bytes` to `path` through its temporary name, as above.
[[nodiscard]] Status write_file_durably(const std::string& path, std::string_view bytes);

// Renames the caller's written and fsynced `temp_path` over `path`, then
// fsyncs the directory holding `path`. On failure `temp_path` is removed.
[[nodiscard]] Status replace_file_durably(const std::string& temp_path, const std::string& path);

// Creates or truncates `path`, writes `bytes`, fsyncs and closes it; no
// temporary name. For files inside a directory that is itself published by a
// rename once every file in it is complete (a checkpoint's .partial/).
[[nodiscard]] Status write_file_synced(const std::string& path, std::string_view bytes);

// fsync of a directory: makes the creations and renames in it durable.
[[nodiscard]] Status sync_directory(const std::string& dir);

// write(2) of all `bytes` to `fd`, EINTR retried and short writes continued;
// the error names `path`.
[[nodiscard]] Status write_all(int fd, const void* data, std::size_t bytes, const std::string& path);

}  // namespace tz
