#include "tierzero/common/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tierzero/common/handles.h"
#include "tierzero/common/log.h"
#include "tierzero/common/units.h"
#include "tierzero/nvme/limits.h"  // Note [Config key ranges]

namespace tz {

std::string_view offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
    case OffloadDevice::kNone: break;
  }
  return "none";
}

std::string_view step_under_backward_name(StepUnderBackward mode) {
  switch (mode) {
    case StepUnderBackward::kOff: return "false";
    case StepUnderBackward::kAlways: return "true";
    case StepUnderBackward::kAuto: break;
  }
  return "auto";
}

namespace {

// ordered_json keeps the file's key order, so ignored_keys and the first error
// follow the file.
using Json = nlohmann::ordered_json;

constexpr std::int64_t kMaxInt = std::numeric_limits<std::int64_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::int64_t kMaxNumaNode = 1023;  // Linux: at most 2^NODES_SHIFT = 1024 nodes

// Note [Config key ranges]
// A key's range belongs to the code that consumes the value: the I/O engine
// refuses an aio.queue_depth above its limit whatever the loader allowed, and
// a loader that allows more (it once took 32768 against the engine's 4096,
// and 1024 rings against 64) lets a config load and then fail at engine
// creation, far from the file. So the consumer declares each limit once, in
// a header of its own module that includes nothing (nvme/limits/tierzero/
// nvme/limits.h), its own checks use it, and this loader includes that
// header too, through a private include directory of just that folder.
// common thereby sees the constants and nothing else of nvme: it neither
// links against nor calls into a module above it. (A consumer registering
// its ranges with the loader at run time would keep even the include
// pointing down, but static registration in static libraries is dropped by
// the linker unless every binary references it.) tests/common/config_test.cpp
// checks that each limit is accepted and the next value refused.
//
// Note [Config schema]
// Every JSON object tierzero reads is a Block: a list of keys, each with a
// setter that checks the value and writes it into Config. A key without a
// setter is a DeepSpeed key we accept and ignore (recorded, never descended
// into, so an ignored block like "scheduler" is one entry). The same tables
// answer "did you mean ...?" and "it belongs in ...", so a key added here is
// known everywhere at once.
struct ParseState {
  Config config;
  bool placement_given = false;
  bool scheduler_given = false;
  std::vector<std::string> batch_auto;   // batch keys given as "auto" (Note [Auto values])
  std::optional<bool> adam_w_mode;       // optimizer.params.adam_w_mode as given
  std::string legacy_optimizer_offload;  // path of zero_optimization.cpu_offload: true
  std::string legacy_param_offload;      // path of zero_optimization.cpu_offload_param(s): true
};

using Setter = std::function<Status(ParseState&, const Json&, const std::string& path)>;

struct Key {
  std::string_view name;
  Setter set;  // empty: accepted and ignored
};

struct Block {
  std::vector<Key> keys;

  const Key* find(std::string_view name) const {
    for (const Key& key : keys) {
      if (key.name == name) return &key;
    }
    return nullptr;
  }
};

using Schema = const Block& (*)();

// ---- messages ---------------------------------------------------------------

std::string shown(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

Status key_error(const ParseState& st, std::string_view path, std::string_view what) {
  return invalid_argument("{}: {}: {}", st.config.source, path, what);
}

Status type_error(const ParseState& st, std::string_view path, const Json& value, std::string_view want) {
  return key_error(st, path, fmt::format("expected {}, got {} ({})", want, shown(value), value.type_name()));
}

Status range_error(const ParseState& st, std::string_view path, const Json& value, std::string_view allowed) {
  return key_error(st, path, fmt::format("{} is out of range (allowed: {})", shown(value), allowed));
}

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t above = row[j];
      std::size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({above + 1, row[j - 1] + 1, substitute});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// ---- value readers ----------------------------------------------------------

bool is_auto(const Json& value) { return value.is_string() && value.get_ref<const std::string&>() == "auto"; }

// Integers may be written 5e8 (a JSON float) when the value is whole.
Expected<std::int64_t> as_integer(const ParseState& st, const Json& value, std::string_view path,
                                  std::string_view want) {
  if (value.is_number_unsigned()) {
    auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(kMaxInt)) return range_error(st, path, value, "below 2^63");
    return static_cast<std::int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<std::int64_t>();
  if (value.is_number_float()) {
    double d = value.get<double>();
    if (d != std::floor(d)) {
      return key_error(st, path, fmt::format("expected a whole number, got {}", shown(value)));
    }
    if (d < -0x1p63 || d >= 0x1p63) return range_error(st, path, value, "below 2^63");
    return static_cast<std::int64_t>(d);
  }
  return type_error(st, path, value, want);
}

std::string int_range(std::int64_t lo, std::int64_t hi) {
  return hi == kMaxInt ? fmt::format(">= {}", lo) : fmt::format("{}..{}", lo, hi);
}

struct RealRange {
  double lo;
  bool lo_open;
  double hi;  // kInf: no upper bound
  bool hi_open;

  bool contains(double x) const {
    return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
  }
  std::string describe() const {
    if (std::isinf(hi)) return fmt::format("{} {}", lo_open ? ">" : ">=", lo);
    return fmt::format("{}{}, {}{}", lo_open ? '(' : '[', lo, hi, hi_open ? ')' : ']');
  }
};
constexpr RealRange kPositive{0, true, kInf, false};
constexpr RealRange kNonNegative{0, false, kInf, false};
constexpr RealRange kFraction{0, true, 1, false};  // (0, 1]
constexpr RealRange kBeta{0, false, 1, true};      // [0, 1)
constexpr RealRange kUnit{0, false, 1, false};     // [0, 1]

// Index of `value` in `names`, or an error listing them.
Expected<std::size_t> pick(const ParseState& st, const Json& value, std::string_view path,
                           const std::vector<std::string_view>& names, bool ignore_case) {
  std::vector<std::string> quoted;
  for (std::string_view name : names) quoted.push_back(fmt::format("\"{}\"", name));
  std::string allowed = fmt::format("one of {}", fmt::join(quoted, ", "));
  if (!value.is_string()) return type_error(st, path, value, allowed);
  const auto& text = value.get_ref<const std::string&>();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (text == names[i] || (ignore_case && lower(text) == lower(names[i]))) return i;
  }
  return key_error(st, path, fmt::format("{} is not allowed; use {}", shown(value), allowed));
}

// ---- key kinds --------------------------------------------------------------

enum class AutoOk : bool { kNo, kYes };  // "auto" (HF Trainer style) keeps tierzero's default

#define TZ_FIELD(member) [](Config& c) -> auto& { return c.member; }

template <typename Get>
Key int_key(std::string_view name, Get get, std::int64_t lo, std::int64_t hi = kMaxInt,
            AutoOk auto_ok = AutoOk::kYes) {
  using T = std::remove_reference_t<std::invoke_result_t<Get, Config&>>;
  hi = std::min<std::int64_t>(hi, std::numeric_limits<T>::max());
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            bool allow_auto = auto_ok == AutoOk::kYes;
            if (allow_auto && is_auto(v)) return ok_status();
            TZ_ASSIGN_OR_RETURN(std::int64_t n,
                                as_integer(st, v, path, allow_auto ? "an integer or \"auto\"" : "an integer"));
            if (n < lo || n > hi) return range_error(st, path, v, int_range(lo, hi));
            get(st.config) = static_cast<T>(n);
            return ok_status();
          }};
}

template <typename Get>
Key real_key(std::string_view name, Get get, RealRange range) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) return ok_status();
            if (!v.is_number()) return type_error(st, path, v, "a number or \"auto\"");
            double x = v.get<double>();
            if (!range.contains(x)) return range_error(st, path, v, range.describe());
            get(st.config) = x;
            return ok_status();
          }};
}

template <typename Get>
Key bool_key(std::string_view name, Get get, AutoOk auto_ok = AutoOk::kYes) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            bool allow_auto = auto_ok == AutoOk::kYes;
            if (allow_auto && is_auto(v)) return ok_status();
            if (!v.is_boolean()) {
              return type_error(st, path, v, allow_auto ? "true, false or \"auto\"" : "true or false");
            }
            get(st.config) = v.get<bool>();
            return ok_status();
          }};
}

template <typename T, typename Get>
Key choice_key(std::string_view name, Get get, std::vector<std::pair<std::string_view, T>> options,
               bool ignore_case = false) {
  std::vector<std::string_view> names;
  for (const auto& option : options) names.push_back(option.first);
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            TZ_ASSIGN_OR_RETURN(std::size_t i, pick(st, v, path, names, ignore_case));
            get(st.config) = options[i].second;
            return ok_status();
          }};
}

constexpr std::int64_t kMaxBatchKey = std::numeric_limits<std::int32_t>::max();

// One of DeepSpeed's batch keys (Note [Batch keys]): kept as given, and, for
// the micro batch and the accumulation steps, in effect until resolve_batch()
// derives the rest; "auto" leaves it to be derived.
Key batch_key(std::string_view name, std::optional<std::int64_t> BatchKeys::*given) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) {  // Note [Auto values]: derived from the other two, or unresolved
              st.batch_auto.push_back(path);
              return ok_status();
            }
            TZ_ASSIGN_OR_RETURN(std::int64_t n, as_integer(st, v, path, "an integer or \"auto\""));
            // 2^31: no batch is larger, and products of three such values with the ranks stay in 64 bits.
            if (n < 1 || n > kMaxBatchKey) return range_error(st, path, v, int_range(1, kMaxBatchKey));
            st.config.batch_given.*given = n;
            if (given == &BatchKeys::train_micro_batch_size_per_gpu) st.config.train_micro_batch_size_per_gpu = n;
            if (given == &BatchKeys::gradient_accumulation_steps) st.config.gradient_accumulation_steps = n;
            return ok_status();
          }};
}

// Note [Auto values]
// "auto" is the Hugging Face Trainer's word for "fill this in from my
// TrainingArguments", which it does before DeepSpeed reads the file. Where
// DeepSpeed itself reads a block through pydantic (zero_optimization, its
// offload blocks, fp16, bf16) it drops "auto" values, so they mean DeepSpeed's
// default, and tierzero's defaults there are DeepSpeed's: such keys keep the
// default. Where a default would train another run than the one meant (the
// batch, fp16/bf16 "enabled", gradient_clipping, the optimizer's
// hyperparameters, the scheduler's steps and ratios), "auto" is resolved
// from the file where the file says it (a batch key from the other two, the
// scheduler's warmup_max_lr from the optimizer's lr, its warmup_min_lr as
// the Trainer fills it, 0), and is otherwise listed in
// Config::unresolved_auto: the config loads, so the estimator and
// tierzero-info read Trainer templates, and the engine refuses to train with
// it, naming every such key. Before, they silently became lr 1e-3 and fp32.
Key needs_value(Key key) {
  key.set = [set = std::move(key.set)](ParseState& st, const Json& v, const std::string& path) -> Status {
    if (!is_auto(v)) return set(st, v, path);
    st.config.unresolved_auto.push_back(path);
    return ok_status();
  };
  return key;
}

// Note [DeepSpeed features tierzero lacks]
// A DeepSpeed key is never "unknown": it is read with its meaning, accepted
// and listed as ignored (the loader's one warning names it), or, where it
// turns on a DeepSpeed feature tierzero does not have (mixture-of-experts
// expert parallelism, sequence parallelism, ZenFlow, summed gradients, Apex
// AMP, torch.autocast, elastic batch sizes, ...), refused as such. A value
// that leaves the feature off loads and is listed as ignored, so configs
// that spell out the defaults keep working.
Status unsupported_feature(const ParseState& st, std::string_view path, const Json& value, std::string_view what) {
  return key_error(st, path,
                   fmt::format("{} turns on {}, a DeepSpeed feature tierzero does not support; remove the key (or "
                               "turn it off) to train with tierzero",
                               shown(value), what));
}

Key feature_key(std::string_view name, std::string_view what, bool (*off)(const Json&)) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!off(v)) return unsupported_feature(st, path, v, what);
            st.config.ignored_keys.push_back(path);
            return ok_status();
          }};
}

bool is_false(const Json& v) { return v.is_null() || (v.is_boolean() && !v.get<bool>()); }
// A DeepSpeed feature block whose "enabled" defaults to false.
bool is_disabled(const Json& v) {
  if (is_false(v)) return true;
  return v.is_object() && (!v.contains("enabled") || is_false(v["enabled"]));
}
bool is_at_most_one(const Json& v) { return v.is_null() || (v.is_number() && v.get<double>() <= 1); }
bool has_no_autotp(const Json& v) { return !v.is_object() || !v.contains("autotp_size") || is_at_most_one(v["autotp_size"]); }

// A DeepSpeed key whose only value tierzero has is `expected`: that value is
// read with its meaning (it is what tierzero does), the other turns on `what`.
Key fixed_bool_key(std::string_view name, bool expected, std::string_view what) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v) || v.is_null()) return ok_status();
            if (!v.is_boolean()) return type_error(st, path, v, "true or false");
            if (v.get<bool>() == expected) return ok_status();
            return unsupported_feature(st, path, v, what);
          }};
}

// Runs `after` once `key` has accepted its value.
Key then(Key key, void (*after)(ParseState&)) {
  return {key.name, [set = std::move(key.set), after](ParseState& st, const Json& v, const std::string& path) {
            Status status = set(st, v, path);
            if (status.ok()) after(st);
            return status;
          }};
}

Status parse_block(ParseState& st, const Json& object, const std::string& path, const Block& block);

// A nested object; JSON null means absent, as in DeepSpeed.
Key block_key(std::string_view name, Schema schema, void (*on_present)(Config&) = nullptr) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (v.is_null()) return ok_status();
            if (!v.is_object()) return type_error(st, path, v, "an object");
            if (on_present != nullptr) on_present(st.config);
            return parse_block(st, v, path, schema());
          }};
}

template <typename Get>
Key device_key(Get get) {
  Key choose = choice_key<OffloadDevice>(
      "device", get,
      {{"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}});
  return {"device", [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (v.is_null()) {
              get(st.config) = OffloadDevice::kNone;
              return ok_status();
            }
            return choose.set(st, v, path);
          }};
}

template <typename Get>
Key path_key(std::string_view name, Get get) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (v.is_null()) return ok_status();
            if (!v.is_string()) return type_error(st, path, v, "a directory path (string) or null");
            std::string dir = v.get<std::string>();
            if (dir.find('\0') != std::string::npos) return key_error(st, path, "the path has a NUL character");
            get(st.config) = std::move(dir);
            return ok_status();
          }};
}

Key block_size_key() {
  return {"block_size", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) return ok_status();
            TZ_ASSIGN_OR_RETURN(std::int64_t n, as_integer(st, v, path, "an integer or \"auto\""));
            constexpr auto kAlign = static_cast<std::int64_t>(nvme::kBlockSizeAlignBytes);
            constexpr auto kMax = static_cast<std::int64_t>(nvme::kMaxBlockSizeBytes);  // Note [Config key ranges]
            if (n <= 0 || n % kAlign != 0 || n > kMax) {
              return range_error(st, path, v,
                                 fmt::format("a positive multiple of {}, at most {} GiB = {}", kAlign, kMax / kGiB, kMax));
            }
            st.config.aio.block_size = n;
            return ok_status();
          }};
}

Key betas_key() {
  return {"betas", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) return ok_status();
            if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
              return type_error(st, path, v, "an array of 2 numbers [beta1, beta2] or \"auto\"");
            }
            for (std::size_t i = 0; i < 2; ++i) {
              if (!kBeta.contains(v[i].get<double>())) {
                return range_error(st, fmt::format("{}[{}]", path, i), v[i], kBeta.describe());
              }
            }
            st.config.optimizer.beta1 = v[0].get<double>();
            st.config.optimizer.beta2 = v[1].get<double>();
            return ok_status();
          }};
}

template <typename Get>
Key budget_key(std::string_view name, Get get) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) {
              get(st.config) = ByteBudget::automatic();
            } else if (v.is_string()) {
              Expected<std::uint64_t> bytes = parse_bytes(v.get_ref<const std::string&>());
              if (!bytes.ok()) return key_error(st, path, bytes.status().message());
              get(st.config) = ByteBudget::of(*bytes);
            } else if (v.is_number()) {
              TZ_ASSIGN_OR_RETURN(std::int64_t n, as_integer(st, v, path, "a number of bytes"));
              if (n < 0) return range_error(st, path, v, ">= 0 bytes");
              get(st.config) = ByteBudget::of(static_cast<std::uint64_t>(n));
            } else {
              return type_error(st, path, v, "a number of bytes, a size such as \"80GB\" or \"64GiB\", or \"auto\"");
            }
            return ok_status();
          }};
}

Key numa_key() {
  return {"numa_node", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) {
              st.config.tiers.numa_node.reset();
              return ok_status();
            }
            TZ_ASSIGN_OR_RETURN(std::int64_t n, as_integer(st, v, path, "a NUMA node number or \"auto\""));
            if (n < 0 || n > kMaxNumaNode) {
              return range_error(st, path, v, fmt::format("\"auto\" or a node number 0..{}", kMaxNumaNode));
            }
            st.config.tiers.numa_node = static_cast<int>(n);
            return ok_status();
          }};
}

Key nvme_paths_key() {
  return {"nvme_paths", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!v.is_array()) return type_error(st, path, v, "an array of directory paths");
            std::vector<std::string> paths;
            for (std::size_t i = 0; i < v.size(); ++i) {
              std::string item_path = fmt::format("{}[{}]", path, i);
              if (!v[i].is_string() || v[i].get_ref<const std::string&>().empty()) {
                return type_error(st, item_path, v[i], "a non-empty directory path");
              }
              const auto& dir = v[i].get_ref<const std::string&>();
              if (dir.find('\0') != std::string::npos) return key_error(st, item_path, "the path has a NUL character");
              if (std::find(paths.begin(), paths.end(), dir) != paths.end()) {
                return key_error(st, item_path, fmt::format("'{}' is listed twice", dir));
              }
              paths.push_back(dir);
            }
            st.config.tiers.nvme_paths = std::move(paths);
            return ok_status();
          }};
}

// DeepSpeed's deprecated booleans: `true` means an offload block with device
// cpu, as DeepSpeed itself maps them. Applied after the whole block is read.
Key legacy_offload_key(std::string_view name, std::string ParseState::*slot) {
  return {name, [=](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!v.is_boolean()) return type_error(st, path, v, "true or false");
            if (v.get<bool>()) st.*slot = path;
            return ok_status();
          }};
}

// Note [Overlap events]
// DeepSpeed's aio.overlap_events: true (its default) refills the queue as
// each request completes; false submits queue_depth requests and waits for
// all of them before submitting more. tierzero's rings always refill as
// requests complete: the first behaviour, never less busy than the second.
// false is accepted, so a DeepSpeed config loads as it is, with a warning
// that names the key and what to lower instead; nothing stores it.
Key overlap_events_key() {
  return {"overlap_events", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (is_auto(v)) return ok_status();
            if (!v.is_boolean()) return type_error(st, path, v, "true, false or \"auto\"");
            if (!v.get<bool>()) {
              TZ_LOG_WARN("config",
                          "{}: {}: false is not honoured: tierzero's I/O rings always submit a new request as one "
                          "completes (DeepSpeed's overlap_events: true); to keep fewer requests in flight, lower "
                          "aio.queue_depth",
                          st.config.source, path);
            }
            return ok_status();
          }};
}

// tierzero.aio.auto_tune: nothing tunes the I/O at start-up (the sweep is a
// benchmark run, minutes long, that belongs before training, not in it), so
// true is refused with what to run instead; false is what tierzero does.
Key auto_tune_key() {
  return {"auto_tune", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!v.is_boolean()) return type_error(st, path, v, "true or false");
            if (!v.get<bool>()) return ok_status();
            return key_error(st, path,
                             "true is not supported: tierzero does not tune its I/O at start-up; run "
                             "`tierzero-nvme-bench --path DIR --tune` once for each NVMe path and put the aio block "
                             "it prints (block_size, queue_depth, intra_op_parallelism) into the config");
          }};
}

// zero_optimization: an object, or DeepSpeed's older form: true is stage 1,
// false stage 0 (with the top-level allgather_size as its bucket, which
// tierzero has no use for), read as DeepSpeed reads it, with its warning.
Key zero_optimization_key(Schema schema) {
  return {"zero_optimization", [schema](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (v.is_null()) return ok_status();
            if (v.is_boolean()) {
              st.config.zero.stage = v.get<bool>() ? 1 : 0;
              TZ_LOG_WARN("config", "{}: {}: {} is DeepSpeed's deprecated form of {{\"stage\": {}}}; read as that",
                          st.config.source, path, shown(v), st.config.zero.stage);
              return ok_status();
            }
            if (!v.is_object()) return type_error(st, path, v, "an object (or true/false, DeepSpeed's older form)");
            return parse_block(st, v, path, schema());
          }};
}

// DeepSpeed's gradient_allreduce_op (case-insensitive): "mean", what tierzero
// does (gradients are averaged over ranks), or "sum".
Key allreduce_op_key() {
  return {"gradient_allreduce_op", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            TZ_ASSIGN_OR_RETURN(std::size_t i, pick(st, v, path, {"mean", "sum"}, /*ignore_case=*/true));
            if (i == 1) return unsupported_feature(st, path, v, "summed (not averaged) gradients over ranks");
            return ok_status();
          }};
}

// optimizer.type, case-insensitive as in DeepSpeed. DeepSpeed's other
// optimizers and the torch.optim classes it builds for names it does not know
// are refused as what they are.
Key optimizer_type_key() {
  return {"type", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            constexpr std::string_view kSteps = "tierzero's engine steps \"Adam\", \"AdamW\", \"Adagrad\" or \"Lion\"";
            if (!v.is_string()) return type_error(st, path, v, "an optimizer name (\"Adam\", \"AdamW\", \"Adagrad\", \"Lion\")");
            const std::string name = lower(v.get_ref<const std::string&>());
            for (std::string_view known : {"Adam", "AdamW", "Adagrad", "Lion"}) {
              if (name == lower(known)) {
                st.config.optimizer.type = std::string(known);
                return ok_status();
              }
            }
            for (std::string_view theirs : {"lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw",
                                            "musgd", "muon"}) {
              if (name == theirs) {
                return key_error(st, path, fmt::format("{} is a DeepSpeed optimizer tierzero does not support; {}",
                                                       shown(v), kSteps));
              }
            }
            return key_error(st, path, fmt::format("{} is not an optimizer tierzero has (DeepSpeed would look for "
                                                   "torch.optim.{}); {}",
                                                   shown(v), v.get_ref<const std::string&>(), kSteps));
          }};
}

Key adam_w_mode_key() {
  return {"adam_w_mode", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!v.is_boolean()) return type_error(st, path, v, "true or false");
            st.adam_w_mode = v.get<bool>();
            return ok_status();
          }};
}

void ignore(Block& block, std::initializer_list<std::string_view> names) {
  for (std::string_view name : names) block.keys.push_back({name, nullptr});
}

// ---- schema (Note [Config schema]) -----------------------------------------

const Block& fp16_block();
const Block& bf16_block();
const Block& optimizer_block();
const Block& optimizer_params_block();
const Block& scheduler_block();
const Block& scheduler_params_block();
const Block& zero_block();
const Block& offload_param_block();
const Block& offload_optimizer_block();
const Block& aio_block();
const Block& data_types_block();
const Block& tierzero_block();
const Block& tiers_block();
const Block& tierzero_aio_block();
const Block& states_block();

const Block& top_block() {
  static const Block block = [] {
    Block b{{
        batch_key("train_batch_size", &BatchKeys::train_batch_size),
        batch_key("train_micro_batch_size_per_gpu", &BatchKeys::train_micro_batch_size_per_gpu),
        batch_key("gradient_accumulation_steps", &BatchKeys::gradient_accumulation_steps),
        needs_value(real_key("gradient_clipping", TZ_FIELD(gradient_clipping), kNonNegative)),
        block_key("fp16", fp16_block),
        block_key("bf16", bf16_block),
        block_key("bfloat16", bf16_block),  // DeepSpeed's older spelling
        block_key("optimizer", optimizer_block, [](Config& c) { c.optimizer.present = true; }),
        {"scheduler",
         [](ParseState& st, const Json& v, const std::string& path) -> Status {
           if (v.is_null()) return ok_status();
           if (!v.is_object()) return type_error(st, path, v, "an object");
           st.scheduler_given = true;
           return parse_block(st, v, path, scheduler_block());
         }},
        zero_optimization_key(zero_block),
        block_key("aio", aio_block),
        block_key("data_types", data_types_block),
        block_key("tierzero", tierzero_block),
        bool_key("dataloader_drop_last", TZ_FIELD(dataloader_drop_last), AutoOk::kNo),
        // Note [DeepSpeed features tierzero lacks]
        fixed_bool_key("managed_gradient_accumulation", true,
                       "accumulation boundaries managed by the caller (tierzero counts micro-batches itself, as "
                       "DeepSpeed's true does: call engine.step() after every micro-batch)"),
        allreduce_op_key(),
        feature_key("expert_parallel", "mixture-of-experts expert parallelism (AutoEP)", is_disabled),
        feature_key("sequence_parallel_size", "sequence parallelism", is_at_most_one),
        feature_key("tensor_parallel", "tensor parallelism (AutoTP)", has_no_autotp),
        feature_key("amp", "Apex AMP", is_disabled),
        feature_key("torch_autocast", "torch.autocast around the forward", is_disabled),
        feature_key("elasticity", "elastic batch sizes", is_disabled),
        feature_key("progressive_layer_drop", "progressive layer dropping", is_disabled),
        feature_key("curriculum_learning", "curriculum learning", is_disabled),
        feature_key("data_efficiency", "data efficiency (data sampling and routing)", is_disabled),
        feature_key("hybrid_engine", "the hybrid (RLHF) engine", is_disabled),
        feature_key("quantize_training", "quantization-aware training (MoQ)", is_disabled),
    }};
    ignore(b, {"steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
               "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp32_allreduce",
               "disable_allgather", "communication_data_type", "seq_parallel_communication_data_type",
               "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
               "activation_checkpointing", "sparse_attention", "flops_profiler", "tensorboard", "wandb",
               "csv_monitor", "comet", "monitor_config", "comms_logger", "autotuning", "compression_training",
               "eigenvalue", "checkpoint", "load_universal_checkpoint",
               "use_node_local_storage", "nebula", "pipeline", "hybrid_engine", "weight_quantization", "compile",
               "timers", "vocabulary_size", "graph_harvesting", "use_data_before_expert_parallelism",
               "data_parallel_size", "log_level", "datastates_ckpt", "allgather_size"});
    return b;
  }();
  return block;
}

const Block& fp16_block() {
  static const Block block = [] {
    Block b{{
        needs_value(bool_key("enabled", TZ_FIELD(precision.fp16))),
        real_key("loss_scale", TZ_FIELD(precision.loss_scale), kNonNegative),
        int_key("initial_scale_power", TZ_FIELD(precision.initial_scale_power), 0, 63),
        int_key("loss_scale_window", TZ_FIELD(precision.loss_scale_window), 1),
        int_key("hysteresis", TZ_FIELD(precision.hysteresis), 1),
        real_key("min_loss_scale", TZ_FIELD(precision.min_loss_scale), kPositive),
    }};
    b.keys.push_back(feature_key("auto_cast", "casting the model's inputs to fp16 (cast them yourself)", is_false));
    b.keys.push_back(feature_key("consecutive_hysteresis", "refilling the hysteresis on every step without overflow",
                                 is_false));
    b.keys.push_back(feature_key("fp16_master_weights_and_grads", "fp16 master weights (tierzero keeps fp32 masters)",
                                 is_false));
    ignore(b, {"immediate_grad_update"});
    return b;
  }();
  return block;
}

const Block& bf16_block() {
  static const Block block = [] {
    Block b{{needs_value(bool_key("enabled", TZ_FIELD(precision.bf16)))}};
    b.keys.push_back(feature_key("bf16_master_weights_and_grads",
                                 "bf16 master weights (tierzero keeps fp32 masters, or exact 16-bit remainders: "
                                 "tierzero.states)",
                                 is_false));
    b.keys.push_back(feature_key("bf16_optimizer_states",
                                 "bf16 optimizer states (tierzero's are set by tierzero.states)", is_false));
    ignore(b, {"immediate_grad_update", "check_grad_overflow"});
    return b;
  }();
  return block;
}

const Block& optimizer_block() {
  static const Block block = [] {
    Block b{{
        optimizer_type_key(),
        block_key("params", optimizer_params_block),
    }};
    ignore(b, {"legacy_fusion"});
    return b;
  }();
  return block;
}

// scheduler.type: DeepSpeed's other schedules, and the torch.optim.lr_scheduler
// classes it builds for names it does not know, are refused as what they are.
Key scheduler_type_key() {
  Key choose = choice_key<SchedulerType>("type", TZ_FIELD(scheduler.type),
                                         {{"WarmupLR", SchedulerType::kWarmupLR},
                                          {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
                                          {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}});
  return {"type", [set = std::move(choose.set)](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (!v.is_string()) return set(st, v, path);
            const std::string& name = v.get_ref<const std::string&>();
            constexpr std::string_view kOurs =
                "tierzero runs \"WarmupLR\", \"WarmupDecayLR\" and \"WarmupCosineLR\"; or build a torch scheduler on "
                "the optimizer initialize() returns (tierzero.torch.initialize(lr_scheduler=...))";
            if (name == "OneCycle" || name == "LRRangeTest") {
              return key_error(st, path, fmt::format("{} is a DeepSpeed scheduler tierzero does not support; {}",
                                                     shown(v), kOurs));
            }
            if (name != "WarmupLR" && name != "WarmupDecayLR" && name != "WarmupCosineLR") {
              return key_error(st, path, fmt::format("{} is not a schedule tierzero has (DeepSpeed would look for "
                                                     "torch.optim.lr_scheduler.{}); {}",
                                                     shown(v), name, kOurs));
            }
            return set(st, v, path);
          }};
}

const Block& scheduler_block() {
  static const Block block{{
      scheduler_type_key(),
      block_key("params", scheduler_params_block),
  }};
  return block;
}

// Records that the file set a scheduler parameter (check_scheduler checks
// each against the type, which may come after params in the file).
Key scheduler_param(Key key) {
  return {key.name, [name = key.name, set = std::move(key.set)](ParseState& st, const Json& v,
                                                                 const std::string& path) -> Status {
            TZ_TRY(set(st, v, path));
            st.config.scheduler.params_given.emplace_back(name);
            return ok_status();
          }};
}

// A step count: "auto" is unresolved (Note [Auto values]).
template <typename Get>
Key scheduler_steps_key(std::string_view name, Get get, std::int64_t lo) {
  return scheduler_param(needs_value(int_key(name, get, lo, kMaxInt, AutoOk::kNo)));
}

const Block& scheduler_params_block() {
  static const Block block = [] {
    Block b{{
        scheduler_param(real_key("warmup_min_lr", TZ_FIELD(scheduler.warmup_min_lr), kNonNegative)),
        scheduler_param({"warmup_max_lr",
                         [](ParseState& st, const Json& v, const std::string& path) -> Status {
                           if (is_auto(v)) {
                             st.config.scheduler.warmup_max_lr_auto = true;  // the optimizer's lr
                             return ok_status();
                           }
                           if (!v.is_number()) return type_error(st, path, v, "a number or \"auto\"");
                           if (!kPositive.contains(v.get<double>())) {
                             return range_error(st, path, v, kPositive.describe());
                           }
                           st.config.scheduler.warmup_max_lr = v.get<double>();
                           return ok_status();
                         }}),
        scheduler_steps_key("warmup_num_steps", TZ_FIELD(scheduler.warmup_num_steps), 0),
        scheduler_param(choice_key<WarmupType>("warmup_type", TZ_FIELD(scheduler.warmup_type),
                                               {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}})),
        scheduler_steps_key("total_num_steps", TZ_FIELD(scheduler.total_num_steps), 1),
        scheduler_param(needs_value(real_key("warmup_min_ratio", TZ_FIELD(scheduler.warmup_min_ratio), kUnit))),
        scheduler_param(needs_value(real_key("cos_min_ratio", TZ_FIELD(scheduler.cos_min_ratio), kUnit))),
    }};
    // The schedule's position comes from the engine's optimizer step count
    // (restored by load_checkpoint), not from the file.
    ignore(b, {"last_batch_iteration"});
    return b;
  }();
  return block;
}

const Block& optimizer_params_block() {
  static const Block block = [] {
    Block b{{
        needs_value(real_key("lr", TZ_FIELD(optimizer.lr), kPositive)),
        needs_value(betas_key()),
        needs_value(real_key("eps", TZ_FIELD(optimizer.eps), kPositive)),
        needs_value(real_key("weight_decay", TZ_FIELD(optimizer.weight_decay), kNonNegative)),
        bool_key("amsgrad", TZ_FIELD(optimizer.amsgrad)),
        adam_w_mode_key(),  // applied once the type is known (apply_adam_w_mode)
        fixed_bool_key("bias_correction", true, "Adam without bias correction (tierzero's always corrects it)"),
        fixed_bool_key("maximize", false, "maximising the loss (negate the loss instead)"),
        {"max_grad_norm",
         [](ParseState& st, const Json&, const std::string& path) -> Status {
           return key_error(st, path, "not an optimizer parameter here, as in DeepSpeed; use the top-level "
                                      "\"gradient_clipping\"");
         }},
    }};
    ignore(b, {"torch_adam", "fused", "set_grad_none", "freeze_step", "cuda_aware", "comm_backend_name", "foreach",
               "capturable", "differentiable", "fp32_optimizer_states"});
    return b;
  }();
  return block;
}

// Note [Inert keys]
// DeepSpeed keys whose values are checked as DeepSpeed checks them (a bad one
// is an error naming it) but which change nothing in tierzero: the engine
// stages parameters read from NVMe through its CPU pool, one shard per block
// in flight, with no cache (offload_param's buffer_count, buffer_size,
// max_in_cpu); its optimizer pass always reads, steps and writes sub-groups
// in a pipeline through its own staging (offload_optimizer's buffer_count,
// pipeline_read, pipeline_write); it offloads all of the optimizer states
// or none (offload_optimizer.ratio, DeepSpeed's partial offload); and its
// gather window is the block in use plus the prefetch window
// (stage3_prefetch_bucket_size, at least one block), with no cap of
// stage3_max_live_parameters, which the planner used to apply (so with
// blocks over half of it the engine held more than planned). The planner
// plans what the engine does. They are listed with the ignored keys,
// so the warning names them: before, tierzero's estimate counted 5 x 1e8
// elements of staging and a 1e9-element cache by default that the engine
// never allocated (3 GB at bf16), and a budget check could refuse a model
// for it.
Key inert(Key key) {
  key.set = [set = std::move(key.set)](ParseState& st, const Json& v, const std::string& path) -> Status {
    TZ_TRY(set(st, v, path));
    st.config.ignored_keys.push_back(path);
    return ok_status();
  };
  return key;
}

const Block& zero_block() {
  static const Block block = [] {
    Block b{{
        int_key("stage", TZ_FIELD(zero.stage), 0, 3, AutoOk::kNo),
        block_key("offload_param", offload_param_block, [](Config& c) { c.zero.has_offload_param = true; }),
        block_key("offload_optimizer", offload_optimizer_block,
                  [](Config& c) { c.zero.has_offload_optimizer = true; }),
        int_key("sub_group_size", TZ_FIELD(zero.sub_group_size), 1),
        int_key("stage3_prefetch_bucket_size", TZ_FIELD(zero.stage3_prefetch_bucket_size), 0),
        inert(int_key("stage3_max_live_parameters", TZ_FIELD(zero.stage3_max_live_parameters), 0)),
        int_key("stage3_param_persistence_threshold", TZ_FIELD(zero.stage3_param_persistence_threshold), 0),
        // DeepSpeed also takes its pydantic field names for the stage3_ keys.
        int_key("prefetch_bucket_size", TZ_FIELD(zero.stage3_prefetch_bucket_size), 0),
        inert(int_key("max_live_parameters", TZ_FIELD(zero.stage3_max_live_parameters), 0)),
        int_key("param_persistence_threshold", TZ_FIELD(zero.stage3_param_persistence_threshold), 0),
        legacy_offload_key("cpu_offload", &ParseState::legacy_optimizer_offload),
        legacy_offload_key("cpu_offload_param", &ParseState::legacy_param_offload),
        legacy_offload_key("cpu_offload_params", &ParseState::legacy_param_offload),
    }};
    ignore(b, {"contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
               "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
               "load_from_fp32_weights", "elastic_checkpoint", "stage3_max_reuse_distance", "max_reuse_distance",
               "stage3_model_persistence_threshold", "model_persistence_threshold",
               "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
               "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
               "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
               "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
               "pipeline_loading_checkpoint", "override_module_apply", "cpu_offload_use_pin_memory",
               "log_trace_cache_warnings", "stage3_module_granularity_threshold", "module_granularity_threshold",
               "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
               "stage3_allgather_sequential", "allgather_sequential", "enable_sanity_checks",
               "save_muon_momentum_buffer_in_memory", "leaf_module"});
    // Note [DeepSpeed features tierzero lacks]
    b.keys.push_back(feature_key("zenflow", "ZenFlow (stale-gradient CPU optimizer steps)",
                                 [](const Json& v) { return v.is_null(); }));
    return b;
  }();
  return block;
}

const Block& offload_param_block() {
  static const Block block{{
      device_key(TZ_FIELD(zero.offload_param.device)),
      path_key("nvme_path", TZ_FIELD(zero.offload_param.nvme_path)),
      bool_key("pin_memory", TZ_FIELD(zero.offload_param.pin_memory)),
      inert(int_key("buffer_count", TZ_FIELD(zero.offload_param.buffer_count), 1)),
      inert(int_key("buffer_size", TZ_FIELD(zero.offload_param.buffer_size), 1)),
      inert(int_key("max_in_cpu", TZ_FIELD(zero.offload_param.max_in_cpu), 0)),
  }};
  return block;
}

const Block& offload_optimizer_block() {
  static const Block block = [] {
    Block b{{
        device_key(TZ_FIELD(zero.offload_optimizer.device)),
        path_key("nvme_path", TZ_FIELD(zero.offload_optimizer.nvme_path)),
        bool_key("pin_memory", TZ_FIELD(zero.offload_optimizer.pin_memory)),
        inert(int_key("buffer_count", TZ_FIELD(zero.offload_optimizer.buffer_count), 1)),
        inert(bool_key("pipeline_read", TZ_FIELD(zero.offload_optimizer.pipeline_read))),
        inert(bool_key("pipeline_write", TZ_FIELD(zero.offload_optimizer.pipeline_write))),
        inert(real_key("ratio", TZ_FIELD(zero.offload_optimizer.ratio), kFraction)),
    }};
    ignore(b, {"fast_init", "super_offload", "cpuadam_cores_perc"});
    return b;
  }();
  return block;
}

const Block& aio_block() {
  static const Block block = [] {
    Block b{{
        block_size_key(),
        // Note [Config key ranges]
        int_key("queue_depth", TZ_FIELD(aio.queue_depth), 1, nvme::kMaxQueueDepth),
        int_key("intra_op_parallelism", TZ_FIELD(aio.intra_op_parallelism), 1, nvme::kMaxRings),
        int_key("thread_count", TZ_FIELD(aio.intra_op_parallelism), 1, nvme::kMaxRings),  // older DeepSpeed name
        bool_key("single_submit", TZ_FIELD(aio.single_submit)),
        overlap_events_key(),  // Note [Overlap events]
    }};
    ignore(b, {"use_gds"});
    return b;
  }();
  return block;
}

// tierzero.step_under_backward: true, false or "auto" (tierzero's own
// policy, Note [When to speculate]; not an "auto" for a trainer to resolve).
Key step_under_backward_key() {
  return {"step_under_backward", [](ParseState& st, const Json& v, const std::string& path) -> Status {
            if (v.is_boolean()) {
              st.config.step_under_backward = v.get<bool>() ? StepUnderBackward::kAlways : StepUnderBackward::kOff;
            } else if (is_auto(v)) {
              st.config.step_under_backward = StepUnderBackward::kAuto;
            } else {
              return type_error(st, path, v, "true, false or \"auto\"");
            }
            return ok_status();
          }};
}

const Block& tierzero_block() {
  static const Block block{{
      choice_key<BackendChoice>(
          "backend", TZ_FIELD(backend),
          {{"auto", BackendChoice::kAuto}, {"cuda", BackendChoice::kCuda}, {"host", BackendChoice::kHost}}),
      then(choice_key<PlacementMode>("placement", TZ_FIELD(placement),
                                     {{"auto", PlacementMode::kAuto}, {"deepspeed", PlacementMode::kDeepSpeed}}),
           [](ParseState& st) { st.placement_given = true; }),
      block_key("tiers", tiers_block),
      block_key("aio", tierzero_aio_block),
      block_key("states", states_block),
      step_under_backward_key(),
  }};
  return block;
}

const Block& tiers_block() {
  static const Block block{{
      budget_key("gpu_bytes", TZ_FIELD(tiers.gpu)),
      budget_key("cpu_bytes", TZ_FIELD(tiers.cpu)),
      budget_key("nvme_bytes", TZ_FIELD(tiers.nvme)),
      nvme_paths_key(),
      numa_key(),
      bool_key("huge_pages", TZ_FIELD(tiers.huge_pages), AutoOk::kNo),
  }};
  return block;
}

const Block& tierzero_aio_block() {
  static const Block block{{
      auto_tune_key(),
      bool_key("sqpoll", TZ_FIELD(aio.sqpoll), AutoOk::kNo),
      bool_key("fixed_buffers", TZ_FIELD(aio.fixed_buffers), AutoOk::kNo),
      bool_key("allow_buffered_io", TZ_FIELD(aio.allow_buffered_io), AutoOk::kNo),
  }};
  return block;
}

// Note [State formats] (tierzero/common/state_format.h): the names are the
// formats' own; check_state_formats() checks them against the precision once
// the whole file is read (the bf16 block may come after this one).
template <typename Format, std::size_t N>
std::vector<std::pair<std::string_view, Format>> format_options(const Format (&formats)[N],
                                                                std::string_view (*name)(Format)) {
  std::vector<std::pair<std::string_view, Format>> out;
  for (Format f : formats) out.emplace_back(name(f), f);
  return out;
}

const Block& states_block() {
  static const Block block{{
      choice_key<MasterFormat>("master", TZ_FIELD(states.master), format_options(kMasterFormats, master_format_name)),
      choice_key<MomentFormat>("moments", TZ_FIELD(states.moments),
                               format_options(kMomentFormats, moment_format_name)),
  }};
  return block;
}

// Note [16-bit gradient accumulators]: DeepSpeed's data_types.grad_accum_dtype
// (its one data_types key) takes its DtypeEnum's spellings. null keeps the
// default, as DeepSpeed's None does; but DeepSpeed's default under ZeRO is the
// model's dtype, tierzero's stays fp32 (docs/configuration.md says so). The
// 16-bit values must be the training dtype: check_state_formats() checks that
// once the whole file is read (the bf16 block may come later). "int8", which
// DeepSpeed's enum spells too, is refused here.
const Block& data_types_block() {
  static const std::vector<std::pair<std::string_view, GradFormat>> options = {
      {"fp32", GradFormat::kFp32},           {"float32", GradFormat::kFp32},  {"float", GradFormat::kFp32},
      {"torch.float32", GradFormat::kFp32},  {"bf16", GradFormat::kBf16},     {"bfloat16", GradFormat::kBf16},
      {"torch.bfloat16", GradFormat::kBf16}, {"fp16", GradFormat::kFp16},     {"float16", GradFormat::kFp16},
      {"half", GradFormat::kFp16},           {"torch.float16", GradFormat::kFp16},
  };
  static const Block block = [] {
    Key choose = choice_key<GradFormat>("grad_accum_dtype", TZ_FIELD(states.grads), options);
    choose.set = [set = std::move(choose.set)](ParseState& st, const Json& v, const std::string& path) -> Status {
      return v.is_null() ? ok_status() : set(st, v, path);
    };
    return Block{{std::move(choose)}};
  }();
  return block;
}

#undef TZ_FIELD

// Every block with where it lives, for "it belongs in ...".
const std::vector<std::pair<std::string_view, const Block*>>& all_blocks() {
  static const std::vector<std::pair<std::string_view, const Block*>> blocks = {
      {"the top level", &top_block()}, {"fp16", &fp16_block()}, {"bf16", &bf16_block()},
      {"optimizer", &optimizer_block()}, {"optimizer.params", &optimizer_params_block()},
      {"scheduler", &scheduler_block()}, {"scheduler.params", &scheduler_params_block()},
      {"zero_optimization", &zero_block()}, {"zero_optimization.offload_param", &offload_param_block()},
      {"zero_optimization.offload_optimizer", &offload_optimizer_block()}, {"aio", &aio_block()},
      {"tierzero", &tierzero_block()}, {"tierzero.tiers", &tiers_block()}, {"tierzero.aio", &tierzero_aio_block()},
      {"tierzero.states", &states_block()}, {"data_types", &data_types_block()},
  };
  return blocks;
}

// ---- parsing ----------------------------------------------------------------

// The key in `block` nearest to `name` by edit distance, if near enough to be
// a likely typo.
const Key* nearest_key(const Block& block, std::string_view name) {
  const Key* best = nullptr;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const Key& key : block.keys) {
    std::size_t d = edit_distance(lower(name), lower(key.name));
    if (d < best_distance) {
      best = &key;
      best_distance = d;
    }
  }
  return best_distance <= std::max<std::size_t>(2, name.size() / 3) ? best : nullptr;
}

std::string unknown_key_hint(const Block& block, std::string_view name) {
  std::vector<std::string_view> homes;
  for (const auto& [where, other] : all_blocks()) {
    if (other != &block && other->find(name) != nullptr) homes.push_back(where);
  }
  const Key* near = nearest_key(block, name);
  if (near != nullptr && !homes.empty()) {
    return fmt::format("did you mean '{}'? ('{}' belongs in {})", near->name, name, fmt::join(homes, " or "));
  }
  if (near != nullptr) return fmt::format("did you mean '{}'?", near->name);
  if (!homes.empty()) return fmt::format("it belongs in {}", fmt::join(homes, " or "));
  std::vector<std::string_view> used;
  for (const Key& key : block.keys) {
    if (key.set) used.push_back(key.name);
  }
  return fmt::format("keys tierzero reads here: {}", fmt::join(used, ", "));
}

Status parse_block(ParseState& st, const Json& object, const std::string& path, const Block& block) {
  for (const auto& item : object.items()) {
    const std::string& name = item.key();
    std::string key_path = path.empty() ? name : path + "." + name;
    const Key* key = block.find(name);
    if (key == nullptr) return key_error(st, key_path, "unknown key; " + unknown_key_hint(block, name));
    if (!key->set) {
      st.config.ignored_keys.push_back(std::move(key_path));
      continue;
    }
    TZ_TRY(key->set(st, item.value(), key_path));
  }
  return ok_status();
}

// zero_optimization.cpu_offload / cpu_offload_param(s): true, DeepSpeed's
// deprecated spellings of an offload block with device "cpu".
Status apply_legacy_offload(ParseState& st, const std::string& legacy_path, std::string_view block,
                            bool& has_block, OffloadDevice& device) {
  if (legacy_path.empty()) return ok_status();
  if (has_block) {
    return key_error(st, legacy_path,
                     fmt::format("deprecated DeepSpeed key; remove it when zero_optimization.{} is given", block));
  }
  has_block = true;
  device = OffloadDevice::kCpu;
  return ok_status();
}

// Note [Auto values]: a batch key given as "auto" is derived (Note [Batch
// keys]) when the other two are numbers; otherwise nothing says what it is.
void resolve_batch_autos(ParseState& st) {
  const BatchKeys& given = st.config.batch_given;
  const int numbers = int{given.train_batch_size.has_value()} + int{given.train_micro_batch_size_per_gpu.has_value()} +
                      int{given.gradient_accumulation_steps.has_value()};
  if (numbers < 2) {
    st.config.unresolved_auto.insert(st.config.unresolved_auto.end(), st.batch_auto.begin(), st.batch_auto.end());
  }
}

// DeepSpeed runs "Adam" as AdamW (decoupled weight decay) unless
// optimizer.params.adam_w_mode is false (its default is true), and "AdamW"
// as AdamW whatever adam_w_mode says; the Config holds what runs.
void apply_adam_w_mode(ParseState& st) {
  OptimizerConfig& o = st.config.optimizer;
  if (o.type == "Adam" && st.adam_w_mode.value_or(true)) {
    o.type = "AdamW";
    if (o.weight_decay != 0 && !st.adam_w_mode.has_value()) {
      TZ_LOG_INFO("config",
                  "{}: optimizer.type \"Adam\" with weight_decay {} runs AdamW (decoupled weight decay), as "
                  "DeepSpeed's does (its adam_w_mode defaults to true); \"adam_w_mode\": false in "
                  "optimizer.params runs Adam with L2 weight decay",
                  st.config.source, o.weight_decay);
    }
  }
}

Status check_nvme_target(const ParseState& st, std::string_view block, OffloadDevice device,
                         const std::string& nvme_path) {
  if (device != OffloadDevice::kNvme || !nvme_path.empty() || !st.config.tiers.nvme_paths.empty()) {
    return ok_status();
  }
  return key_error(st, fmt::format("zero_optimization.{}.device", block),
                   fmt::format("\"nvme\" needs zero_optimization.{}.nvme_path (or tierzero.tiers.nvme_paths)", block));
}

template <typename List>
bool listed(const List& list, std::string_view item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

// The scheduler block as a whole: a type, only that type's parameters, and
// the steps it needs.
Status check_scheduler(const ParseState& st) {
  const SchedulerConfig& s = st.config.scheduler;
  if (!st.scheduler_given) return ok_status();
  if (s.type == SchedulerType::kNone) {
    return key_error(st, "scheduler.type",
                     "missing; use one of \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\"");
  }
  std::vector<std::string_view> allowed = {"warmup_num_steps", "warmup_type"};
  if (s.type == SchedulerType::kWarmupCosineLR) {
    allowed.insert(allowed.end(), {"total_num_steps", "warmup_min_ratio", "cos_min_ratio"});
  } else {
    allowed.insert(allowed.end(), {"warmup_min_lr", "warmup_max_lr"});
    if (s.type == SchedulerType::kWarmupDecayLR) allowed.push_back("total_num_steps");
  }
  for (const std::string& key : s.params_given) {
    if (!listed(allowed, key)) {
      return key_error(st, "scheduler.params." + key,
                       fmt::format("not a parameter of {} (its parameters: {})", scheduler_name(s.type),
                                   fmt::join(allowed, ", ")));
    }
  }
  if (s.type != SchedulerType::kWarmupCosineLR && !s.warmup_max_lr_auto && s.warmup_max_lr < s.warmup_min_lr) {
    return key_error(st, "scheduler.params.warmup_max_lr",
                     fmt::format("{}{} is below warmup_min_lr = {}", s.warmup_max_lr,
                                 listed(s.params_given, "warmup_max_lr") ? "" : " (the default)", s.warmup_min_lr));
  }
  if (s.type == SchedulerType::kWarmupLR) return ok_status();
  const std::vector<std::string>& autos = st.config.unresolved_auto;
  if (listed(autos, "scheduler.params.total_num_steps") || listed(autos, "scheduler.params.warmup_num_steps")) {
    return ok_status();  // the engine refuses them
  }
  if (s.total_num_steps == 0) {
    return key_error(st, "scheduler.params.total_num_steps",
                     fmt::format("missing; {} needs the number of optimizer steps it spans", scheduler_name(s.type)));
  }
  if (const std::int64_t warmup = warmup_length(s); s.total_num_steps <= warmup) {
    return key_error(st, "scheduler.params.total_num_steps",
                     fmt::format("{} leaves no steps after the warm-up ({} steps{}); it must be larger",
                                 s.total_num_steps, warmup,
                                 s.warmup_num_steps < 2 ? ", warmup_num_steps below 2 counts as 2" : ""));
  }
  return ok_status();
}

// Rules that involve more than one key.
Status check_consistency(const ParseState& st) {
  const Config& c = st.config;
  TZ_TRY(check_scheduler(st));
  if (c.precision.fp16 && c.precision.bf16) {
    return invalid_argument("{}: fp16.enabled and bf16.enabled are both true; enable at most one", c.source);
  }
  TZ_TRY(check_state_formats(c));
  TZ_TRY(check_nvme_target(st, "offload_param", c.zero.offload_param.device, c.zero.offload_param.nvme_path));
  TZ_TRY(check_nvme_target(st, "offload_optimizer", c.zero.offload_optimizer.device,
                           c.zero.offload_optimizer.nvme_path));
  if (c.zero.offload_optimizer.ratio < 1.0 && c.zero.stage != 3) {
    return key_error(st, "zero_optimization.offload_optimizer.ratio",
                     fmt::format("{} (partial offload) needs zero_optimization.stage 3, not {}",
                                 c.zero.offload_optimizer.ratio, c.zero.stage));
  }
  return ok_status();
}

// nlohmann's message starts with "[json.exception.parse_error.101] "; the rest
// carries the line and column.
std::string_view parser_message(std::string_view what) {
  auto end = what.find("] ");
  return what.starts_with("[json.exception.") && end != std::string_view::npos ? what.substr(end + 2) : what;
}

// (config key, directory) for each NVMe path, without duplicates.
std::vector<std::pair<std::string, std::string>> nvme_path_sources(const Config& config) {
  std::vector<std::pair<std::string, std::string>> out;
  // One folder is one place to stripe over, however it is spelt ("/x",
  // "/x/", a symlink to it): it once became two "drives" sharing one disk.
  auto same_folder = [](const std::string& a, const std::string& b) {
    struct stat sa {}, sb {};
    if (a == b) return true;
    return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  };
  auto add = [&](std::string key, const std::string& dir) {
    if (dir.empty()) return;
    for (const auto& seen : out) {
      if (same_folder(seen.second, dir)) {
        if (seen.second != dir) {
          TZ_LOG_ONCE_WARN("config", "{} ('{}') is the folder {} names ('{}'): it is used once", key, dir,
                           seen.first, seen.second);
        }
        return;
      }
    }
    out.emplace_back(std::move(key), dir);
  };
  for (std::size_t i = 0; i < config.tiers.nvme_paths.size(); ++i) {
    add(fmt::format("tierzero.tiers.nvme_paths[{}]", i), config.tiers.nvme_paths[i]);
  }
  // An nvme_path beside device "cpu" is common in the wild and DeepSpeed never
  // touches it; neither do we.
  if (config.zero.offload_param.device == OffloadDevice::kNvme) {
    add("zero_optimization.offload_param.nvme_path", config.zero.offload_param.nvme_path);
  }
  if (config.zero.offload_optimizer.device == OffloadDevice::kNvme) {
    add("zero_optimization.offload_optimizer.nvme_path", config.zero.offload_optimizer.nvme_path);
  }
  return out;
}

}  // namespace

std::vector<std::string> Config::all_nvme_paths() const {
  std::vector<std::string> paths;
  for (auto& source_and_path : nvme_path_sources(*this)) paths.push_back(std::move(source_and_path.second));
  return paths;
}

// Note [Parsing names the key]
// The JSON parser throws on a number beyond a double ("lr": 1e400) and keeps
// the last of two equal keys without a word. The callback below follows the
// path of keys as the parser goes, so the overflow's error names the key it
// was parsing, and it records the first key given twice in one object, which
// is refused (which of the two was meant is not ours to guess).
namespace {

struct KeyPath {
  std::vector<std::string> keys;                 // the path to the value being parsed
  std::vector<std::set<std::string>> seen;       // keys of each open object, by depth
  std::string duplicate;                         // the first key given twice, as a path

  std::string text() const {
    std::string out;
    for (const std::string& k : keys) out += (out.empty() || k == "[]" ? "" : ".") + k;
    return out;
  }
  bool on(int depth, Json::parse_event_t event, const Json& parsed) {
    const auto d = static_cast<std::size_t>(depth);
    switch (event) {
      case Json::parse_event_t::object_start:
        keys.resize(std::min(keys.size(), d));
        seen.resize(d + 1);
        seen[d].clear();
        break;
      case Json::parse_event_t::array_start:
        keys.resize(std::min(keys.size(), d));
        keys.push_back("[]");
        break;
      case Json::parse_event_t::key: {
        keys.resize(d - 1 < keys.size() ? d - 1 : keys.size());
        const auto& name = parsed.get_ref<const std::string&>();
        keys.push_back(name);
        if (d >= 1 && d - 1 < seen.size() && !seen[d - 1].insert(name).second && duplicate.empty()) duplicate = text();
        break;
      }
      default:
        break;
    }
    return true;
  }
};

}  // namespace

Expected<Config> parse_config(std::string_view json_text, std::string_view source) {
  ParseState st;
  st.config.source = std::string(source);
  Json root;
  KeyPath path;
  try {
    root = Json::parse(json_text.begin(), json_text.end(),
                       [&](int depth, Json::parse_event_t event, Json& parsed) { return path.on(depth, event, parsed); });
  } catch (const Json::parse_error& e) {
    return invalid_argument("{}: malformed JSON: {}", source, parser_message(e.what()));
  } catch (const Json::exception& e) {  // out_of_range.406: a number beyond a double
    return invalid_argument("{}: {}: {}", source, path.text().empty() ? "a value" : path.text(), parser_message(e.what()));
  }
  if (!path.duplicate.empty()) {
    return invalid_argument("{}: {} is given twice in one object; give it once", source, path.duplicate);
  }
  if (!root.is_object()) {
    return invalid_argument("{}: expected a JSON object at the top level, got {} ({})", source, shown(root),
                            root.type_name());
  }
  TZ_TRY(parse_block(st, root, "", top_block()));
  ZeroConfig& zero = st.config.zero;
  TZ_TRY(apply_legacy_offload(st, st.legacy_optimizer_offload, "offload_optimizer", zero.has_offload_optimizer,
                              zero.offload_optimizer.device));
  TZ_TRY(apply_legacy_offload(st, st.legacy_param_offload, "offload_param", zero.has_offload_param,
                              zero.offload_param.device));
  resolve_batch_autos(st);
  apply_adam_w_mode(st);
  TZ_TRY(check_consistency(st));
  Config& config = st.config;
  if (!st.placement_given) {
    bool has_offload = config.zero.has_offload_param || config.zero.has_offload_optimizer;
    config.placement = has_offload ? PlacementMode::kDeepSpeed : PlacementMode::kAuto;
  }
  if (!config.ignored_keys.empty()) {
    TZ_LOG_WARN("config", "{}: ignoring {} DeepSpeed key(s) tierzero has no use for: {}", config.source,
                config.ignored_keys.size(), fmt::join(config.ignored_keys, ", "));
  }
  return std::move(st.config);
}

Expected<Config> load_config(const std::string& path) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_RDONLY));
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, fmt::format("reading config {}", path));
    if (n == 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
  }
  return parse_config(text, path);
}

Status check_paths(const Config& config) {
  for (const auto& [key, dir] : nvme_path_sources(config)) {
    std::string what = fmt::format("{}: {} '{}'", config.source, key, dir);
    struct stat info {};
    if (::stat(dir.c_str(), &info) != 0) return errno_status(errno, what);
    if (!S_ISDIR(info.st_mode)) return invalid_argument("{}: not a directory", what);
    if (::access(dir.c_str(), W_OK) != 0) return errno_status(errno, fmt::format("{}: not writable", what));
  }
  return ok_status();
}

// Note [Batch keys]
// DeepSpeed reads train_batch_size, train_micro_batch_size_per_gpu and
// gradient_accumulation_steps as one relation, train_batch_size = micro batch
// x accumulation steps x data-parallel ranks, and derives whichever are
// missing: train_batch_size 256 with a micro batch of 4 on 8 ranks means 8
// accumulation steps. A config written that way and read as "accumulation
// steps absent, so 1" would train with an 8 times smaller batch and say
// nothing, so the engine resolves the keys as DeepSpeed does once it knows
// the ranks: all three given must agree; two given derive the third; a
// train_batch_size alone means no accumulation; no train_batch_size leaves a
// missing micro batch or step count at 1 (DeepSpeed refuses a config with
// neither batch size; tierzero keeps accepting it, its micro batch size only
// informs). A derived value must be whole.
namespace {

// micro x gas x ranks; none past 2^63.
std::optional<std::int64_t> batch_product(std::int64_t micro, std::int64_t gas, std::int64_t ranks) {
  std::int64_t per_rank = 0, total = 0;
  if (__builtin_mul_overflow(micro, gas, &per_rank) || __builtin_mul_overflow(per_rank, ranks, &total)) {
    return std::nullopt;
  }
  return total;
}

}  // namespace

Status resolve_batch(Config& config, int ranks) {
  if (ranks < 1) return invalid_argument("ranks is {}: the batch keys resolve for 1 or more", ranks);
  const BatchKeys& given = config.batch_given;
  const std::int64_t n = ranks;
  // What a key not given means: the field's value (1, or what a caller building a Config in code set).
  std::int64_t micro = given.train_micro_batch_size_per_gpu.value_or(config.train_micro_batch_size_per_gpu);
  std::int64_t gas = given.gradient_accumulation_steps.value_or(config.gradient_accumulation_steps);
  for (const auto& [key, value] : {std::pair{"train_micro_batch_size_per_gpu", micro},
                                   std::pair{"gradient_accumulation_steps", gas}}) {
    if (value < 1 || value > kMaxBatchKey) {
      return invalid_argument("{}: {} = {} is out of range 1..{}", config.source, key, value, kMaxBatchKey);
    }
  }
  if (const auto& total = given.train_batch_size) {
    const bool has_micro = given.train_micro_batch_size_per_gpu.has_value();
    const bool has_gas = given.gradient_accumulation_steps.has_value();
    if (has_micro && has_gas) {
      if (batch_product(micro, gas, n) != *total) {
        return invalid_argument("{}: train_batch_size = {}, but train_micro_batch_size_per_gpu x "
                                "gradient_accumulation_steps x ranks = {} x {} x {} = {}; they must agree (or give "
                                "two of the three and the third is derived)",
                                config.source, *total, micro, gas, n, static_cast<double>(micro) * gas * n);
      }
    } else {
      // The one missing (the accumulation steps when both are: a train_batch_size alone means none).
      const std::int64_t per_rank_known = has_micro ? micro * n : has_gas ? gas * n : n;
      const char* known = has_micro ? "train_micro_batch_size_per_gpu x ranks" : has_gas
                                                                                  ? "gradient_accumulation_steps x ranks"
                                                                                  : "the ranks";
      if (*total % per_rank_known != 0) {
        return invalid_argument("{}: train_batch_size = {} is not a multiple of {} = {}, so {} cannot be derived",
                                config.source, *total, known, per_rank_known,
                                has_micro ? "gradient_accumulation_steps" : "train_micro_batch_size_per_gpu");
      }
      if (has_micro) {
        gas = *total / per_rank_known;
      } else {
        micro = *total / per_rank_known;
      }
    }
  }
  config.train_micro_batch_size_per_gpu = micro;
  config.gradient_accumulation_steps = gas;
  const std::optional<std::int64_t> total = batch_product(micro, gas, n);
  if (!total) {
    return invalid_argument("{}: train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks = {} x {} x {} "
                            "is beyond any batch",
                            config.source, micro, gas, n);
  }
  config.batch_given = {*total, micro, gas};
  return ok_status();
}

void override_gradient_accumulation_steps(Config& config, std::int64_t steps) {
  config.gradient_accumulation_steps = steps;
  config.batch_given.gradient_accumulation_steps = steps;
  config.batch_given.train_batch_size.reset();
}

// Note [16-bit gradient accumulators] (engine/src/gradient_path.h): a 16-bit
// accumulator holds the arriving gradient's own dtype, so it is the training
// dtype. DeepSpeed's ZeRO would also take the other 16-bit dtype, or a 16-bit
// one under fp32 training (a copy that rounds each micro-batch's gradient);
// tierzero refuses those rather than add a second rounding.
namespace {
Status check_grad_format(const Config& config) {
  const GradFormat g = config.states.grads;
  if (g == GradFormat::kFp32 || (g == GradFormat::kBf16 && config.precision.bf16) ||
      (g == GradFormat::kFp16 && config.precision.fp16)) {
    return ok_status();
  }
  const std::string_view training = config.precision.bf16 ? "bf16" : config.precision.fp16 ? "fp16" : "fp32";
  const std::string where = config.source.empty() ? "" : config.source + ": ";
  return invalid_argument("{}data_types.grad_accum_dtype: \"{}\" with {} training is not supported; allowed are \"fp32\" "
                          "and the 16-bit training dtype ({})",
                          where, grad_format_name(g), training,
                          training == "fp32" ? "none: fp32 training has none" : fmt::format("\"{}\"", training));
}
}  // namespace

// Note [Master remainder] (tierzero/common/state_format.h): the remainder
// rebuilds an fp32 master from its round-to-nearest-even bf16 parameter,
// which has the fp32 exponent. An fp16 parameter has 5 exponent bits: a
// master outside its range (or in its subnormals) differs from it by more
// than any 16-bit remainder can say. fp32 training keeps its parameter in
// fp32 already: there is no 16-bit parameter to build on.
Status check_state_formats(const Config& config) {
  TZ_TRY(check_grad_format(config));
  if (config.states.master != MasterFormat::kRemainder || config.precision.bf16) return ok_status();
  const std::string_view why =
      config.precision.fp16
          ? "but fp16.enabled is true: an fp16 parameter's 5-bit exponent cannot hold the fp32 master's range, so no "
            "16-bit remainder rebuilds it; train in bf16 (\"bf16\": {\"enabled\": true} instead of fp16) or keep "
            "\"master\": \"fp32\""
          : "but neither bf16 nor fp16 is enabled (fp32 training): there is no 16-bit parameter to build the master "
            "on; enable bf16 (\"bf16\": {\"enabled\": true}) or keep \"master\": \"fp32\"";
  const std::string where = config.source.empty() ? "" : config.source + ": ";
  return invalid_argument("{}tierzero.states.master: \"remainder\" needs bf16 parameters, {}", where, why);
}

namespace {

template <typename Format, std::size_t N>
Status set_format(Format& out, std::string_view key, std::string_view name, const Format (&formats)[N],
                  std::string_view (*name_of)(Format)) {
  std::vector<std::string_view> names;
  for (Format f : formats) {
    if (name_of(f) == name) {
      out = f;
      return ok_status();
    }
    names.push_back(name_of(f));
  }
  return invalid_argument("{} '{}': expected {}", key, name, fmt::join(names, ", "));
}

}  // namespace

Status set_master_format(Config& config, std::string_view name) {
  return set_format(config.states.master, "tierzero.states.master", name, kMasterFormats, master_format_name);
}

Status set_moment_format(Config& config, std::string_view name) {
  return set_format(config.states.moments, "tierzero.states.moments", name, kMomentFormats, moment_format_name);
}

Status set_grad_format(Config& config, std::string_view name) {
  return set_format(config.states.grads, "data_types.grad_accum_dtype", name, kGradFormats, grad_format_name);
}

Status set_training_precision(Config& config, std::string_view precision) {
  if (precision != "bf16" && precision != "fp16" && precision != "fp32") {
    return invalid_argument("precision '{}': expected bf16, fp16 or fp32", precision);
  }
  config.precision.bf16 = precision == "bf16";
  config.precision.fp16 = precision == "fp16";
  return ok_status();
}

}  // namespace tz
