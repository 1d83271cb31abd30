// fio version 2 I/O logs: what IoEngine::take_log() recorded, written so that
// fio's read_iolog and tierzero-nvme-bench --replay replay the same pattern.
//
// Note [I/O logs]
// A training step's NVMe traffic is not a sequential stream: the 16-bit
// parameters are read block by block twice (forward, backward), the master
// and moments of each sub-group are read and written back, the new 16-bit
// parameters written, all of different sizes in several swap files. The
// engine can record the requests it is given (IoEngine::record_log;
// tierzero-train --io-log records its traced step), and the bench replays the
// log through the engine and through fio on the same scratch files
// (--replay), so the comparison with fio is on the pattern training makes,
// not only on the sequential one. fio's version 2 format carries no times:
// both sides replay as fast as their queue depth allows.
#include <fstream>
#include <map>
#include <sstream>

#include "tierzero/nvme.h"

namespace tz::nvme {

Status write_fio_iolog(const std::string& path, const std::vector<IoLogEntry>& entries) {
  std::ostringstream out;
  out << "fio version 2 iolog\n";
  std::map<std::string, bool> opened;
  for (const IoLogEntry& e : entries) {
    if (!opened.emplace(e.path, true).second) continue;
    out << e.path << " add\n";
  }
  for (const auto& [file, unused] : opened) out << file << " open\n";
  for (const IoLogEntry& e : entries) {
    out << e.path << (e.op == IoOp::kRead ? " read " : " write ") << e.offset << ' ' << e.length << '\n';
  }
  for (const auto& [file, unused] : opened) out << file << " close\n";
  return write_file_durably(path, out.view()).with_context("writing the I/O log");
}

Expected<std::vector<IoLogEntry>> read_fio_iolog(const std::string& path) {
  std::ifstream in(path);
  if (!in) return errno_status(errno, fmt::format("opening the I/O log {}", path));
  std::string line;
  if (!std::getline(in, line) || line != "fio version 2 iolog") {
    return invalid_argument("{}: line 1 is '{}', not 'fio version 2 iolog' (a fio version 2 I/O log, as "
                            "tierzero-train --io-log writes)", path, line);
  }
  std::vector<IoLogEntry> entries;
  for (int number = 2; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    // PATH ACTION [OFFSET LENGTH]: the path may hold spaces, the rest not.
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string s; words >> s;) w.push_back(s);
    const bool io = w.size() >= 4 && (w[w.size() - 3] == "read" || w[w.size() - 3] == "write");
    if (!io) {
      const std::string& action = w.empty() ? line : w.back();
      if (action == "add" || action == "open" || action == "close") continue;
      if (w.size() >= 4 && (w[w.size() - 3] == "trim" || w[w.size() - 3] == "sync" || w[w.size() - 3] == "wait")) {
        return invalid_argument("{}: line {}: '{}': only reads and writes are replayed", path, number, line);
      }
      return invalid_argument("{}: line {}: '{}' is not 'PATH add|open|close' nor 'PATH read|write OFFSET LENGTH'",
                              path, number, line);
    }
    IoLogEntry e;
    e.op = w[w.size() - 3] == "read" ? IoOp::kRead : IoOp::kWrite;
    const std::size_t path_end = line.rfind(' ' + w[w.size() - 3] + ' ');
    e.path = line.substr(0, path_end);
    char* end = nullptr;
    e.offset = std::strtoull(w[w.size() - 2].c_str(), &end, 10);
    const bool offset_ok = *end == '\0' && w[w.size() - 2][0] != '-';
    e.length = std::strtoull(w.back().c_str(), &end, 10);
    if (!offset_ok || *end != '\0' || w.back()[0] == '-' || e.length == 0) {
      return invalid_argument("{}: line {}: '{}': offset and length must be whole numbers, the length above 0", path,
                              number, line);
    }
    entries.push_back(std::move(e));
  }
  if (entries.empty()) return invalid_argument("{}: no reads or writes in the I/O log", path);
  return entries;
}

}  // namespace tz::nvme
