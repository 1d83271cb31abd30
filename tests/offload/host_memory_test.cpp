#include "tierzero/offload/host_memory.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

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

// The AnonHugePages of the mapping that holds `ptr`, from /proc/self/smaps (kB).
std::uint64_t anon_huge_kb(const void* ptr) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = addr >= lo && addr < hi;
      continue;
    }
    unsigned long kb = 0;
    if (inside && std::sscanf(line.c_str(), "AnonHugePages: %lu kB", &kb) == 1) return kb;
  }
  return 0;
}

TEST(HostMemory, LargeBlocksStartOnAHugePageAndAreAdvisedOntoOne) {
  const std::string& thp = capabilities().memory.transparent_hugepage;
  const bool offered = thp == "always" || thp == "madvise";
  if (!offered) std::printf("note: transparent huge pages are '%s' here: only page alignment is checked\n", thp.c_str());
  std::unique_ptr<Device> device = create_host_device();
  auto pool = make_host_pool(*device, 64 * kMiB, {.pinned = false});
  ASSERT_TRUE(pool.ok());
  // Blocks of 2 MiB and more start on a 2 MiB boundary, whatever mmap would have given.
  for (std::size_t bytes : {2 * kMiB, 6 * kMiB + 4096, 8 * kMiB}) {
    auto block = (*pool)->allocate(bytes);
    ASSERT_TRUE(block.ok()) << block.status().to_string();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block->data()) % (offered ? 2 * kMiB : 4096), 0u) << bytes;
    std::memset(block->data(), 1, block->size_bytes());
    // The kernel may still decline (fragmentation); what it did is visible in smaps.
    if (offered && anon_huge_kb(block->data()) == 0) {
      std::printf("note: %zu B block not on huge pages (the kernel declined)\n", bytes);
    }
  }
  // Below a huge page nothing changes: page-aligned, not padded.
  auto small = (*pool)->allocate(64 * 1024);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small->data()) % 4096, 0u);
  EXPECT_EQ(small->capacity_bytes(), 64u * 1024);
  // Nothing beyond the budget's count is mapped: 2 + 6 MiB+4 KiB + 8 MiB + 64 KiB.
  EXPECT_EQ((*pool)->stats().reserved_bytes, 16 * kMiB + 4096 + 64 * 1024);
}

// VmSize of this process, bytes.
std::uint64_t vm_size_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    unsigned long kb = 0;
    if (std::sscanf(line.c_str(), "VmSize: %lu kB", &kb) == 1) return std::uint64_t{kb} * 1024;
  }
  return 0;
}

// Note [Coloured arrays]: blocks a kernel streams together never alias, even
// when their sizes are exact multiples of 128 MiB (as a width-4096 GPT block's
// shards are): each of 32 MiB or more starts its colour's 68 KiB step past a
// 2 MiB boundary, and costs no byte more (the slack is unmapped again).
TEST(HostMemory, ColouredBlocksStartTheirColoursStepPastAHugePage) {
  std::unique_ptr<Device> device = create_host_device();
  constexpr std::size_t kBlock = 32 * kMiB;
  for (bool huge : {true, false}) {
    auto pool = make_host_pool(*device, 6 * kBlock + 8 * kMiB, {.pinned = false, .huge_pages = huge});
    ASSERT_TRUE(pool.ok());
    const std::uint64_t vm_before = vm_size_bytes();
    std::vector<PoolBlock> blocks;
    for (Colour c : {Colour::kMaster, Colour::kGrad, Colour::kExpAvg, Colour::kExpAvgSq, Colour::kParam16,
                     Colour::kArrivingGrad}) {
      auto block = (*pool)->allocate(kBlock, c);
      ASSERT_TRUE(block.ok()) << block.status().to_string();
      const auto addr = reinterpret_cast<std::uintptr_t>(block->data());
      EXPECT_EQ(addr % (2 * kMiB), static_cast<std::size_t>(c) * kColourStepBytes) << "colour " << static_cast<int>(c);
      std::memset(block->data(), static_cast<int>(c), block->size_bytes());  // every byte is mapped and writable
      blocks.push_back(std::move(*block));
    }
    // What stays mapped is the blocks, not the 2 MiB more each was cut from
    // (12 MiB in all); under 1 MiB of slack either way for the test's own
    // mallocs and frees (glibc trims the top of its heap when enough is free
    // there: with another test binary's heap layout it gave back 8 KiB here).
    const std::uint64_t grown = vm_size_bytes() - vm_before;
    EXPECT_GT(grown, 6 * kBlock - kMiB);
    EXPECT_LT(grown, 6 * kBlock + kMiB);
    // Pairwise distinct residues modulo 2 MiB, so modulo any larger power of two too.
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      for (std::size_t j = i + 1; j < blocks.size(); ++j) {
        const auto a = reinterpret_cast<std::uintptr_t>(blocks[i].data());
        const auto b = reinterpret_cast<std::uintptr_t>(blocks[j].data());
        EXPECT_NE(a % (2 * kMiB), b % (2 * kMiB)) << i << " " << j;
      }
    }
    EXPECT_EQ((*pool)->stats().reserved_bytes, 6 * kBlock) << "colours cost no bytes";
    for (std::size_t i = 0; i < blocks.size(); ++i) {  // nothing overlapped: each still holds its own fill
      const auto* bytes = static_cast<const unsigned char*>(blocks[i].data());
      EXPECT_EQ(bytes[0], i);
      EXPECT_EQ(bytes[kBlock - 1], i);
    }
    // Below 32 MiB no colour: the block starts on the boundary, to stay on huge pages.
    auto small = (*pool)->allocate(8 * kMiB, Colour::kExpAvgSq);
    ASSERT_TRUE(small.ok());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small->data()) % (2 * kMiB), 0u);
    small->reset();
    blocks.clear();
    (*pool)->trim();
    EXPECT_LT(vm_size_bytes(), vm_before + kMiB) << "everything unmapped again";
  }
}

// A cached block serves only a request of its own colour (else the colours
// would depend on which sizes were asked for first).
TEST(HostMemory, ACachedBlockIsReusedOnlyForItsOwnColour) {
  std::unique_ptr<Device> device = create_host_device();
  auto pool = make_host_pool(*device, 128 * kMiB, {.pinned = false});
  ASSERT_TRUE(pool.ok());
  void* grad = nullptr;
  {
    auto block = (*pool)->allocate(32 * kMiB, Colour::kGrad);
    ASSERT_TRUE(block.ok());
    grad = block->data();
  }  // cached
  auto moment = (*pool)->allocate(32 * kMiB, Colour::kExpAvg);
  ASSERT_TRUE(moment.ok());
  EXPECT_NE(moment->data(), grad);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(moment->data()) % (2 * kMiB), 2 * kColourStepBytes);
  EXPECT_EQ((*pool)->stats().backend_allocations, 2u);
  auto again = (*pool)->allocate(32 * kMiB, Colour::kGrad);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), grad) << "the cached block of its colour";
  EXPECT_EQ((*pool)->stats().cache_hits, 1u);
  // Small blocks are not coloured: any request of the size reuses them.
  { auto a = (*pool)->allocate(kMiB, Colour::kGrad); ASSERT_TRUE(a.ok()); }
  auto b = (*pool)->allocate(kMiB, Colour::kExpAvg);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*pool)->stats().cache_hits, 2u);
}

TEST(HostMemory, HugePagesCanBeTurnedOff) {
  std::unique_ptr<Device> device = create_host_device();
  auto pool = make_host_pool(*device, 64 * kMiB, {.pinned = false, .huge_pages = false});
  ASSERT_TRUE(pool.ok());
  auto block = (*pool)->allocate(8 * kMiB);
  ASSERT_TRUE(block.ok());
  std::memset(block->data(), 1, block->size_bytes());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block->data()) % 4096, 0u);
  // Only in madvise mode does leaving the advice out keep small pages ("always" uses huge ones anyway).
  if (capabilities().memory.transparent_hugepage == "madvise") {
    EXPECT_EQ(anon_huge_kb(block->data()), 0u);
  } else {
    std::printf("note: transparent huge pages are '%s' here: the small-page check needs 'madvise'\n",
                capabilities().memory.transparent_hugepage.c_str());
  }
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
