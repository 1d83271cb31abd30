// docs/configuration.md against the loader: every key the docs' tables list
// is a key the loader knows and one whose value reaches Config (or is on the
// short, commented list of keys that are accepted and then warned about),
// and every key the docs list as ignored is accepted and reported ignored.
// A documented key that is parsed and read by nothing fails here.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tierzero/common/config.h"
#include "tierzero/common/log.h"

namespace tz {
namespace {

using Json = nlohmann::json;

struct DocKey {
  std::string block;  // dotted path of its block, "" for the top level
  std::string name;
  std::string type;   // the table's Type column
  std::string allowed;
  int line;
};

struct Docs {
  std::vector<DocKey> keys;                                   // from the tables
  std::vector<std::pair<std::string, std::string>> ignored;  // (block, name) from the "Ignored:" lists
};

std::vector<std::string> backticked(const std::string& text) {
  std::vector<std::string> out;
  static const std::regex quoted("`([^`]+)`");
  for (std::sregex_iterator it(text.begin(), text.end(), quoted), end; it != end; ++it) out.push_back((*it)[1]);
  return out;
}

std::vector<std::string> cells(const std::string& row) {
  std::vector<std::string> out;
  std::stringstream in(row.substr(1));
  for (std::string cell; std::getline(in, cell, '|');) out.push_back(cell);
  return out;
}

// Sections are the headings: "## `aio`" is the block aio, "## Top level" the
// top level, "## Keys accepted and ignored at the top level" the top level's
// ignored keys; a heading without a block (Values, Placement, NVMe paths)
// holds no keys. A row's first column names the key (with its aliases); the
// "Ignored:" paragraph after a table lists the block's ignored keys.
Docs read_docs(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  Docs docs;
  std::optional<std::string> block;
  std::string ignored_paragraph;
  bool in_ignored = false;
  auto flush_ignored = [&] {
    if (block && in_ignored) {
      const std::string list = ignored_paragraph.substr(0, ignored_paragraph.find("`."));
      for (const std::string& name : backticked(list + "`")) docs.ignored.emplace_back(*block, name);
    }
    in_ignored = false;
    ignored_paragraph.clear();
  };
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.starts_with("#")) {
      flush_ignored();
      const std::vector<std::string> names = backticked(line);
      block.reset();
      if (line.find("Top level") != std::string::npos) block = "";
      if (!names.empty() && line.starts_with("##")) block = names.front();
      if (line.find("ignored at the top level") != std::string::npos) {
        block = "";
        in_ignored = true;
      }
      continue;
    }
    if (line.starts_with("Ignored:")) in_ignored = true;
    if (in_ignored) {
      if (line.empty() && !ignored_paragraph.empty()) {
        flush_ignored();
      } else {
        ignored_paragraph += " " + line;
      }
      continue;
    }
    if (!block || !line.starts_with("| `")) continue;
    const std::vector<std::string> c = cells(line);
    if (c.size() < 4) continue;
    // Allowed is the fourth column where the table has one (tierzero.aio's has none).
    const bool has_allowed = c.size() >= 5;
    for (const std::string& name : backticked(c[0])) {
      docs.keys.push_back({*block, name, c[1], has_allowed ? c[3] : "", number});
    }
  }
  flush_ignored();
  return docs;
}

std::string docs_path() { return std::string(TIERZERO_SOURCE_DIR) + "/docs/configuration.md"; }

// Everything a key can set in Config, as text: two configs that print the
// same are the same as far as any consumer can tell. A field added to Config
// belongs here too, or a key that sets only it is reported as reaching nothing.
std::string fingerprint(const Config& c) {
  auto budget = [](const ByteBudget& b) { return b.is_auto ? std::string("auto") : std::to_string(b.bytes); };
  auto given = [](const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : std::string("-"); };
  const ZeroConfig& z = c.zero;
  const SchedulerConfig& s = c.scheduler;
  const PrecisionConfig& p = c.precision;
  std::string out = fmt::format(
      "batch {} {} {} {} {} clip {} | fp16 {} bf16 {} {} {} {} {} {} | opt {} {} {} {} {} {} {} {} | ", 
      c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, given(c.batch_given.train_batch_size),
      given(c.batch_given.train_micro_batch_size_per_gpu), given(c.batch_given.gradient_accumulation_steps),
      c.gradient_clipping, p.fp16, p.bf16, p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis,
      p.min_loss_scale, c.optimizer.type, c.optimizer.lr, c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps,
      c.optimizer.weight_decay, c.optimizer.amsgrad, c.optimizer.present);
  out += fmt::format("sched {} {} {} {} {} {} {} {} {} {} {} | ", static_cast<int>(s.type), s.warmup_min_lr,
                     s.warmup_max_lr, s.warmup_max_lr_auto, s.warmup_num_steps, static_cast<int>(s.warmup_type),
                     s.total_num_steps, s.warmup_min_ratio, s.cos_min_ratio, fmt::join(s.params_given, ","),
                     fmt::join(c.unresolved_auto, ","));
  out += fmt::format("zero {} {} {} {} {} {} {} | param {} {} {} {} {} {} | optim {} {} {} {} {} {} {} | ", z.stage,
                     z.has_offload_param, z.has_offload_optimizer, z.sub_group_size, z.stage3_prefetch_bucket_size,
                     z.stage3_max_live_parameters, z.stage3_param_persistence_threshold,
                     static_cast<int>(z.offload_param.device), z.offload_param.nvme_path, z.offload_param.pin_memory,
                     z.offload_param.buffer_count, z.offload_param.buffer_size, z.offload_param.max_in_cpu,
                     static_cast<int>(z.offload_optimizer.device), z.offload_optimizer.nvme_path,
                     z.offload_optimizer.pin_memory, z.offload_optimizer.buffer_count, z.offload_optimizer.pipeline_read,
                     z.offload_optimizer.pipeline_write, z.offload_optimizer.ratio);
  out += fmt::format("aio {} {} {} {} {} {} {} | tiers {} {} {} {} {} {} | {} {} | states {} {}", c.aio.block_size,
                     c.aio.queue_depth, c.aio.intra_op_parallelism, c.aio.single_submit, c.aio.sqpoll,
                     c.aio.fixed_buffers, c.aio.allow_buffered_io, budget(c.tiers.gpu), budget(c.tiers.cpu),
                     budget(c.tiers.nvme), fmt::join(c.tiers.nvme_paths, ","), c.tiers.numa_node.value_or(-1),
                     c.tiers.huge_pages, static_cast<int>(c.backend), static_cast<int>(c.placement),
                     master_format_name(c.states.master), moment_format_name(c.states.moments));
  out += fmt::format(" grads {}", grad_format_name(c.states.grads));
  out += fmt::format(" | drop_last {}", c.dataloader_drop_last);
  out += fmt::format(" | step_under_backward {}", tz::step_under_backward_name(c.step_under_backward));
  return out;
}

// Values to try for a key of this documented type: the first that loads and
// changes Config shows that the key reaches it.
std::vector<Json> candidates(const DocKey& key) {
  std::vector<Json> out;
  for (const std::string& v : backticked(key.allowed)) {  // `"cuda"`, `Adam`, `log`, ...
    std::string text = v;
    if (text.size() >= 2 && text.front() == '"') text = text.substr(1, text.size() - 2);
    out.push_back(text);
  }
  // A row of aliases leaves the type to the row it aliases: try every kind.
  const std::string t = key.type.find_first_not_of(' ') == std::string::npos ? "integer number boolean string" : key.type;
  if (t.find("boolean") != std::string::npos) out.insert(out.end(), {true, false});
  if (t.find("array of 2 numbers") != std::string::npos) out.push_back(Json::array({0.5, 0.75}));
  if (t.find("array of strings") != std::string::npos) out.push_back(Json::array({"/docs-test"}));
  if (t.find("byte size") != std::string::npos) out.push_back("1GB");
  if (t.find("integer") != std::string::npos) out.insert(out.end(), {3, 2, 0, 8192, 123456});
  if (t.find("number") != std::string::npos) out.insert(out.end(), {0.5, 0.25, 2.0, 1e-4});
  if (t.find("string") != std::string::npos) out.insert(out.end(), {"cpu", "/docs-test"});
  return out;
}

// What some keys need around them to load: a ratio below 1 needs stage 3, a
// scheduler parameter the type it belongs to, a remainder master bf16;
// adam_w_mode shows only with type "Adam".
std::vector<Json> contexts() {
  std::vector<Json> out = {Json::object(), Json{{"zero_optimization", {{"stage", 3}}}},
                           Json{{"bf16", {{"enabled", true}}}}, Json{{"optimizer", {{"type", "Adam"}}}}};
  for (const char* type : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}) {
    Json params = std::string(type) == "WarmupLR" ? Json::object() : Json{{"total_num_steps", 100000}};
    out.push_back({{"scheduler", {{"type", type}, {"params", params}}}});
  }
  return out;
}

Json at(const std::string& block, const std::string& name, const Json& value) {
  Json j = {{name, value}};
  std::string rest = block;
  while (!rest.empty()) {
    const auto dot = rest.rfind('.');
    j = Json{{dot == std::string::npos ? rest : rest.substr(dot + 1), j}};
    rest = dot == std::string::npos ? "" : rest.substr(0, dot);
  }
  return j;
}

std::string dotted(const std::string& block, const std::string& name) {
  return block.empty() ? name : block + "." + name;
}

// Documented keys that load but leave Config as it is, each with the reason.
// Every other documented key must change Config for some value.
const std::map<std::string, std::string>& warned_keys() {
  static const std::map<std::string, std::string> keys = {
      // true is what tierzero does; false loads with a warning naming the
      // key (Note [Overlap events] in common/src/config.cpp).
      {"aio.overlap_events", "false is warned about, not honoured"},
  };
  return keys;
}

TEST(ConfigDocs, TheTablesListTheBlocksAndKeysTheLoaderReads) {
  const Docs docs = read_docs(docs_path());
  // A parser that silently found nothing would pass everything below.
  ASSERT_GT(docs.keys.size(), 60u);
  ASSERT_GT(docs.ignored.size(), 60u);
  for (const char* block : {"", "fp16", "bf16", "optimizer.params", "scheduler.params", "zero_optimization",
                            "zero_optimization.offload_param", "zero_optimization.offload_optimizer", "aio",
                            "tierzero.tiers", "tierzero.aio", "tierzero.states"}) {
    EXPECT_TRUE(std::any_of(docs.keys.begin(), docs.keys.end(), [&](const DocKey& k) { return k.block == block; }))
        << "no keys read for the block '" << block << "'";
  }
}

TEST(ConfigDocs, EveryDocumentedKeyReachesConfigOrIsWarnedAbout) {
  ASSERT_TRUE(log::configure("error"));  // the warnings of the trials below are expected
  const Docs docs = read_docs(docs_path());
  for (const DocKey& key : docs.keys) {
    const std::string path = dotted(key.block, key.name);
    SCOPED_TRACE(fmt::format("docs/configuration.md:{}: {}", key.line, path));
    if (key.type.find("object") != std::string::npos) {  // a block: its keys are checked one by one
      const Expected<Config> c = parse_config(at(key.block, key.name, Json::object()).dump(), "docs.json");
      // An empty block may be incomplete (a scheduler without its type), but not unknown.
      EXPECT_TRUE(c.ok() || c.status().message().find("unknown key") == std::string::npos) << c.status().to_string();
      continue;
    }
    bool known = false, reaches = false;
    std::string last_error;
    for (const Json& context : contexts()) {
      const Expected<Config> base = parse_config(context.dump(), "docs.json");
      if (!base.ok()) continue;
      for (const Json& value : candidates(key)) {
        Json with = context;
        with.merge_patch(at(key.block, key.name, value));
        const Expected<Config> c = parse_config(with.dump(), "docs.json");
        if (!c.ok()) {
          last_error = c.status().message();
          known = known || last_error.find("unknown key") == std::string::npos;
          continue;
        }
        known = true;
        reaches = reaches || fingerprint(*c) != fingerprint(*base);
      }
    }
    EXPECT_TRUE(known) << "the loader does not know it: " << last_error;
    if (warned_keys().contains(path)) {
      EXPECT_FALSE(reaches) << "listed as warned about, but it sets Config: take it off warned_keys()";
    } else {
      EXPECT_TRUE(reaches) << "no value of its documented type changes Config: parsed and read by nothing? "
                           << "(last error: " << last_error << ")";
    }
  }
}

TEST(ConfigDocs, EveryKeyDocumentedAsIgnoredIsAcceptedAndReportedIgnored) {
  ASSERT_TRUE(log::configure("error"));
  for (const auto& [block, name] : read_docs(docs_path()).ignored) {
    const std::string path = dotted(block, name);
    const Expected<Config> c = parse_config(at(block, name, Json(1)).dump(), "docs.json");
    ASSERT_TRUE(c.ok()) << path << ": " << c.status().to_string();
    EXPECT_EQ(c->ignored_keys, std::vector<std::string>{path});
  }
}

}  // namespace
}  // namespace tz
