// tierzero-nvme-bench --replay LOG: a recorded I/O pattern (a fio version 2
// I/O log, as tierzero-train --io-log writes one training step's NVMe
// requests; Note [I/O logs]) replayed through the engine and through fio's
// read_iolog on the same scratch files, alternating, as fast as each side's
// queue depth allows.
//
// Each file the log names becomes a scratch file under the --path
// directories (round-robin), as long as the log's furthest byte in it, written
// once before the pairs so reads reach the device. Both sides move the same
// pieces: the log's requests cut into --block-size pieces, in order (the
// engine cuts them so itself; fio is given the cut log, since fio's replay of
// one multi-MiB request moves fewer bytes than it names). Ours keeps
// --queue-depth x --rings pieces in flight through one engine; fio runs
// iodepth = the same count (registered buffers as ours; files unregistered,
// as fio refuses registered files for a read_iolog job). Each run replays the log --replay-loops times;
// the rate is the log's bytes x loops over the run's time (fio's job
// runtime; fio counts a replay's first few pieces out of its io_bytes, which
// is kept beside).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "nvme_bench_modes.h"

namespace tzbench {

tz::Expected<nlohmann::json> run_replay(Context& ctx, const std::string& log_path, int loops, bool compare_fio);

}  // namespace tzbench
