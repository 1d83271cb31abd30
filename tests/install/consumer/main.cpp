// Links tierzero::engine from an installed tree and uses each layer once.
#include <tierzero/engine.h>

#include <cstdio>
#include <cstring>

int main() {
  std::printf("%s\n", tz::build_summary().c_str());
  auto device = tz::create_device({.backend = tz::BackendChoice::kHost});
  if (!device.ok()) return 1;
  auto pool = tz::make_device_pool(**device, 16 * tz::kMiB);
  if (!pool.ok()) return 2;
  auto block = (*pool)->allocate(1 * tz::kMiB);
  if (!block.ok()) return 3;
  std::memset(block->data(), 1, block->size_bytes());
  auto config = tz::parse_config(R"({"zero_optimization": {"stage": 3}})");
  if (!config.ok() || config->zero.stage != 3) return 4;
  std::printf("consumer ok: %s, pool reserved %llu bytes\n", (*device)->name().c_str(),
              static_cast<unsigned long long>((*pool)->stats().reserved_bytes));
  return 0;
}
