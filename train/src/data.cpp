// The corpus and the batch loader (tierzero/train/data.h).
#include "tierzero/train/data.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace tz::train {

Expected<Corpus> Corpus::from_bytes(std::string bytes, std::string name, double val_fraction) {
  if (!(val_fraction > 0 && val_fraction < 1)) {
    return invalid_argument("corpus {}: validation fraction {} is not in (0, 1)", name, val_fraction);
  }
  if (bytes.size() < 4) return invalid_argument("corpus {}: {} bytes is too small to split", name, bytes.size());
  Corpus c;
  c.bytes_.assign(bytes.begin(), bytes.end());
  c.split_at_ = static_cast<std::size_t>(static_cast<double>(c.bytes_.size()) * (1 - val_fraction));
  c.split_at_ = std::min(std::max<std::size_t>(c.split_at_, 1), c.bytes_.size() - 1);
  c.name_ = std::move(name);
  return c;
}

// The corpus is read whole: it must be a regular file (a folder once threw
// std::ios_failure, and /dev/urandom was read until std::bad_alloc).
Expected<Corpus> Corpus::load(const std::string& path, double val_fraction) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) return not_found("corpus {}: no such file", path);
  if (std::filesystem::is_directory(st)) return invalid_argument("corpus {}: is a folder; pass a text file", path);
  if (!std::filesystem::is_regular_file(st)) {
    return invalid_argument("corpus {}: is not a regular file (a device or a pipe is not read whole); pass a text file",
                            path);
  }
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return io_error("corpus {}: {}", path, ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("corpus {}: cannot open it", path);
  std::string bytes;
  try {
    bytes.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    return out_of_memory("corpus {}: {} bytes do not fit in memory (the corpus is read whole)", path, size);
  }
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (in.bad() || static_cast<std::uintmax_t>(in.gcount()) != size) {
    return io_error("corpus {}: read {} of its {} bytes", path, in.gcount(), size);
  }
  return from_bytes(std::move(bytes), path, val_fraction);
}

std::span<const std::uint8_t> Corpus::train() const { return {bytes_.data(), split_at_}; }

std::span<const std::uint8_t> Corpus::val() const {
  return {bytes_.data() + split_at_, bytes_.size() - split_at_};
}

Expected<TokenBatch> Corpus::batch(const BatchRequest& r) const {
  const std::span<const std::uint8_t> part = r.split == Split::kTrain ? train() : val();
  const char* split_name = r.split == Split::kTrain ? "train" : "validation";
  if (r.batch < 1 || r.seq < 1) return invalid_argument("batch of {} x {} tokens: both must be >= 1", r.batch, r.seq);
  if (part.size() < static_cast<std::size_t>(r.seq) + 1) {
    return invalid_argument("corpus {}: the {} split has {} bytes, fewer than seq + 1 = {}", name_, split_name,
                            part.size(), r.seq + 1);
  }
  const std::uint64_t starts = part.size() - static_cast<std::uint64_t>(r.seq);  // window starts in [0, starts)
  const std::uint64_t base =
      splitmix64(r.seed ^ splitmix64(static_cast<std::uint64_t>(r.split) + 0x51ED27ULL * static_cast<std::uint64_t>(r.step)) ^
          splitmix64(static_cast<std::uint64_t>(r.rank) * 1000003ULL + static_cast<std::uint64_t>(r.micro) * 7919ULL));
  TokenBatch b;
  b.batch = r.batch;
  b.seq = r.seq;
  b.inputs.resize(static_cast<std::size_t>(r.batch) * r.seq);
  b.targets.resize(b.inputs.size());
  for (int row = 0; row < r.batch; ++row) {
    const std::uint64_t start = splitmix64(base + static_cast<std::uint64_t>(row)) % starts;
    for (int t = 0; t < r.seq; ++t) {
      b.inputs[static_cast<std::size_t>(row) * r.seq + t] = part[start + t];
      b.targets[static_cast<std::size_t>(row) * r.seq + t] = part[start + t + 1];
    }
  }
  return b;
}

Expected<std::string> default_corpus_path(const std::string& exe_dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> tried;
  if (const char* env = std::getenv("TIERZERO_DATA_DIR"); env != nullptr && *env != '\0') {
    const std::string p = (fs::path(env) / "kjv.txt").string();
    if (fs::exists(p)) return p;
    tried.push_back(p + " ($TIERZERO_DATA_DIR)");
  }
  const std::string installed = (fs::path(exe_dir) / ".." / TIERZERO_TRAIN_INSTALL_DATA_DIR / "kjv.txt").string();
  if (!exe_dir.empty() && fs::exists(installed)) return fs::weakly_canonical(installed).string();
  tried.push_back(installed);
  const std::string source = std::string(TIERZERO_TRAIN_SOURCE_DATA_DIR) + "/kjv.txt";
  if (fs::exists(source)) return source;
  tried.push_back(source);
  std::string list;
  for (const std::string& t : tried) list += (list.empty() ? "" : ", ") + t;
  return not_found("the training corpus kjv.txt is in none of: {} (set TIERZERO_DATA_DIR or pass --data)", list);
}

}  // namespace tz::train
