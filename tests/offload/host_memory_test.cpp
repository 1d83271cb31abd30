#include "tierzero/offload/host_memory.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace tz {
namespace {

TEST(HostMemory, PinnedPoolLocksAndUnlocksPages) {
  std::unique_ptr<Device> device = create_host_device();
  // Sizes stay under Debian's default 8 MiB memlock limit, so this runs unprivileged too.
  auto pool = make_host_pool(*device, 4 * kMiB, {.pinned = true});
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  const std::uint64_t before = locked_bytes();
  {
    auto block = (*pool)->allocate(2 * kMiB);
    ASSERT_TRUE(block.ok()) << block.status().to_string();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block->data()) % 4096, 0u);
    EXPECT_GE(locked_bytes(), before + 2 * kMiB);
    std::memset(block->data(), 0x5A, block->size_bytes());
  }
  EXPECT_GE(locked_bytes(), before + 2 * kMiB) << "cached blocks stay pinned for reuse";
  EXPECT_EQ((*pool)->trim(), 2 * kMiB);
  EXPECT_EQ(locked_bytes(), before);
  EXPECT_EQ((*pool)->options().tier, "pinned cpu");
}

TEST(HostMemory, UnpinnedPoolDoesNotLock) {
  std::unique_ptr<Device> device = create_host_device();
  auto pool = make_host_pool(*device, 64 * kMiB, {.pinned = false});
  ASSERT_TRUE(pool.ok());
  const std::uint64_t before = locked_bytes();
  auto block = (*pool)->allocate(8 * kMiB);
  ASSERT_TRUE(block.ok());
  EXPECT_EQ(locked_bytes(), before);
  EXPECT_EQ((*pool)->options().tier, "cpu");
}

TEST(HostMemory, BindsToAConfiguredNumaNode) {
  std::unique_ptr<Device> device = create_host_device();
  ASSERT_FALSE(capabilities().numa_nodes.empty()) << capabilities().numa_error;
  const int node = capabilities().numa_nodes.front().os_index;
  Expected<int> resolved = resolve_numa_node(*device, node);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(*resolved, node);
  auto pool = make_host_pool(*device, 4 * kMiB, {.pinned = true, .numa_node = node});
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  auto block = (*pool)->allocate(2 * kMiB);
  ASSERT_TRUE(block.ok()) << block.status().to_string();
}

TEST(HostMemory, UnknownNumaNodeIsAnErrorNamingTheKey) {
  std::unique_ptr<Device> device = create_host_device();
  Expected<int> resolved = resolve_numa_node(*device, 999);
  ASSERT_FALSE(resolved.ok());
  EXPECT_EQ(resolved.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(resolved.status().message().find("tierzero.tiers.numa_node is 999"), std::string::npos)
      << resolved.status().message();
  EXPECT_EQ(*resolve_numa_node(*device, std::nullopt), device->numa_node());
}

TEST(HostMemory, DeviceBudgetOverrunIsReported) {
  std::unique_ptr<Device> device = create_host_device();
  auto pool = make_device_pool(*device, 1 * kMiB);
  ASSERT_TRUE(pool.ok());
  auto block = (*pool)->allocate(2 * kMiB);
  ASSERT_FALSE(block.ok());
  EXPECT_NE(block.status().message().find("tierzero.tiers.gpu_bytes"), std::string::npos);
  EXPECT_NE(block.status().message().find("stage3_prefetch_bucket_size"), std::string::npos);
}

// Runs in a forked child: without CAP_IPC_LOCK and with a 1 MiB memlock limit,
// pinning must fail with the limit and the settings that would help.
bool drop_cap_ipc_lock() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (::syscall(SYS_capget, &header, data) != 0) return false;
  const unsigned bit = 1U << (CAP_IPC_LOCK % 32);
  data[CAP_IPC_LOCK / 32].effective &= ~bit;
  data[CAP_IPC_LOCK / 32].permitted &= ~bit;
  data[CAP_IPC_LOCK / 32].inheritable &= ~bit;
  return ::syscall(SYS_capset, &header, data) == 0;
}

[[noreturn]] void fail_child(const std::string& why) {
  std::fprintf(stderr, "CHILD FAILED: %s\n", why.c_str());
  std::_Exit(1);
}

void expect_advice(const Status& s, const char* what) {
  if (s.ok()) fail_child(std::string(what) + " succeeded under a 1 MiB memlock limit");
  for (const char* needle : {"1.00 MiB", "ulimit -l", "pin_memory", "lacks CAP_IPC_LOCK"}) {
    if (s.message().find(needle) == std::string::npos) {
      fail_child(std::string(what) + ": missing '" + needle + "' in: " + s.message());
    }
  }
}

void memlock_child() {
  if (!drop_cap_ipc_lock()) fail_child("could not drop CAP_IPC_LOCK");
  rlimit limit{1 * kMiB, 1 * kMiB};
  if (::setrlimit(RLIMIT_MEMLOCK, &limit) != 0) fail_child("setrlimit");
  if (has_cap_ipc_lock()) fail_child("CAP_IPC_LOCK still effective");
  std::unique_ptr<Device> device = create_host_device();
  // A pinned budget over the limit is refused at creation.
  auto pool = make_host_pool(*device, 64 * kMiB, {.pinned = true});
  expect_advice(pool.status(), "make_host_pool(64 MiB)");
  // Pools that fit alone but not together: the second is refused at creation.
  auto first = make_host_pool(*device, 768 * kKiB, {.pinned = true});
  if (!first.ok()) fail_child("768 KiB pinned pool refused: " + first.status().message());
  auto held = (*first)->allocate(768 * kKiB);
  if (!held.ok()) fail_child("768 KiB pinned allocation failed: " + held.status().message());
  auto second = make_host_pool(*device, 768 * kKiB, {.pinned = true});
  if (second.ok()) fail_child("a second 768 KiB pinned pool fit under a 1 MiB limit with 768 KiB locked");
  if (second.status().message().find("already locked") == std::string::npos) {
    fail_child("second pool error does not mention what is locked: " + second.status().message());
  }
  held->reset();
  (*first)->trim();
  // An allocation over the limit fails at mlock with the same advice.
  auto allocator = make_host_allocator(*device, {.pinned = true});
  Expected<void*> raw = allocator->allocate(4 * kMiB);
  expect_advice(raw.status(), "pinned 4 MiB allocation");
  // Unpinned memory still works.
  auto unpinned = make_host_pool(*device, 64 * kMiB, {.pinned = false});
  if (!unpinned.ok() || !(*unpinned)->allocate(4 * kMiB).ok()) fail_child("unpinned pool failed");
  std::fprintf(stderr, "CHILD OK\n");
  std::_Exit(0);
}

TEST(HostMemoryDeathTest, MemlockLimitTooLowSaysWhatToChange) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(memlock_child(), ::testing::ExitedWithCode(0), "CHILD OK");
}

}  // namespace
}  // namespace tz
