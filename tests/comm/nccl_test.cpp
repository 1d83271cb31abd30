// The NCCL backend on real GPUs. Each test skips, saying why, without the
// GPUs it needs (or in a build without NCCL). GPUs are counted in a child
// process: CUDA initialised in this process would not survive fork().
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tierzero/testing/ranks.h"
#include "tierzero/comm/communicator.h"
#include "tierzero/kernels.h"

namespace tz {
namespace {

struct GpuCount {
  int count = 0;
  std::string why;  // the probe's status when there are none
};

GpuCount count_gpus() {
  auto outcomes = test::run_listed_ranks({0}, [](int) -> std::string {
    const CudaCapabilities& cuda = capabilities().cuda;
    return fmt::format("{}|{}{}", cuda.device_count, cuda.compiled ? "" : "built without CUDA; ", cuda.status);
  });
  const std::string& report = outcomes[0].message;
  GpuCount gpus;
  gpus.count = std::atoi(report.c_str());
  gpus.why = report.substr(report.find('|') + 1);
  return gpus;
}

#define SKIP_WITHOUT_GPUS(n)                                                                        \
  do {                                                                                              \
    const GpuCount gpus = count_gpus();                                                             \
    if (gpus.count < (n)) {                                                                         \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << gpus.count << " (" << gpus.why << ")"; \
    }                                                                                               \
  } while (0)

// Copies host data to a fresh device buffer, runs `op` on it, copies back.
struct DeviceBuffer {
  Device& device;
  Stream& stream;
  void* d_ptr = nullptr;
  std::size_t bytes = 0;
  Status upload(const void* h_src, std::size_t n) {
    bytes = n;
    TZ_ASSIGN_OR_RETURN(d_ptr, device.allocate(n, nullptr));
    TZ_TRY(device.copy_async(d_ptr, h_src, n, stream));
    return device.synchronize_stream(stream);
  }
  Status download(void* h_dst) {
    TZ_TRY(device.copy_async(h_dst, d_ptr, bytes, stream));
    return device.synchronize_stream(stream);
  }
  ~DeviceBuffer() {
    if (d_ptr != nullptr) device.deallocate(d_ptr, bytes, nullptr).ignore_error();
  }
};

TEST(NcclComm, OneRankCopiesInStreamOrder) {
  SKIP_WITHOUT_GPUS(1);
  auto outcomes = test::run_listed_ranks({0}, [](int) -> std::string {
    auto device = create_device({.backend = BackendChoice::kCuda});
    if (!device.ok()) return device.status().to_string();
    auto created = create_communicator({.backend = CommBackend::kNccl, .device = device->get()});
    if (!created.ok()) {
      if (created.status().code() == ErrorCode::kUnavailable) return "SKIP " + created.status().message();
      return created.status().to_string();
    }
    auto stream = (*device)->create_stream();
    if (!stream.ok()) return stream.status().to_string();
    std::vector<float> host = {1.0F, 2.0F, 3.0F};
    DeviceBuffer src{**device, **stream};
    DeviceBuffer dst{**device, **stream};
    std::vector<float> zeros(3, 0.0F);
    if (Status st = src.upload(host.data(), 12); !st.ok()) return st.to_string();
    if (Status st = dst.upload(zeros.data(), 12); !st.ok()) return st.to_string();
    if (Status st = (*created)->all_gather(src.d_ptr, dst.d_ptr, 3, DType::kFp32, stream->get()); !st.ok()) {
      return st.to_string();
    }
    std::vector<float> back(3);
    if (Status st = dst.download(back.data()); !st.ok()) return st.to_string();
    return back == host ? "" : "all_gather over one rank did not copy";
  });
  if (outcomes[0].message.starts_with("SKIP ")) GTEST_SKIP() << outcomes[0].message.substr(5);
  EXPECT_ALL_RANKS_PASS(outcomes);
}

constexpr std::size_t kCount = 1 << 20;

// bf16 all_reduce sum against the plain sum, tolerance as in
// gloo_test.cpp: one rounding to bf16 (u = 2^-8) for two ranks.
std::string check_bf16_sum(Communicator& comm, Device& device, Stream& stream, int rank) {
  std::vector<std::uint16_t> mine(kCount);
  for (std::size_t i = 0; i < kCount; ++i) {
    mine[i] = kernels::fp32_to_bf16(static_cast<float>(test::uniform(7, rank, i)));
  }
  DeviceBuffer buf{device, stream};
  if (Status st = buf.upload(mine.data(), kCount * 2); !st.ok()) return st.to_string();
  if (Status st = comm.all_reduce(buf.d_ptr, kCount, DType::kBf16, ReduceOp::kSum, &stream); !st.ok()) {
    return st.to_string();
  }
  std::vector<std::uint16_t> sum(kCount);
  if (Status st = buf.download(sum.data()); !st.ok()) return st.to_string();
  for (std::size_t i = 0; i < kCount; ++i) {
    const double a = kernels::bf16_to_fp32(kernels::fp32_to_bf16(static_cast<float>(test::uniform(7, 0, i))));
    const double b = kernels::bf16_to_fp32(kernels::fp32_to_bf16(static_cast<float>(test::uniform(7, 1, i))));
    const double bound = 0x1.0p-8 / (1 - 0x1.0p-8) * (std::fabs(a) + std::fabs(b));
    if (std::fabs(kernels::bf16_to_fp32(sum[i]) - (a + b)) > bound) {
      return fmt::format("bf16 sum element {}: {} vs {}", i, kernels::bf16_to_fp32(sum[i]), a + b);
    }
  }
  return "";
}

// fp32 all_gather, reduce_scatter of the gathered buffer (2x each shard),
// then broadcast from rank 1.
std::string check_gather_scatter_broadcast(Communicator& comm, Device& device, Stream& stream, int rank) {
  std::vector<float> shard(kCount, static_cast<float>(rank + 1));
  std::vector<float> whole(2 * kCount, 0.0F);
  DeviceBuffer d_shard{device, stream};
  DeviceBuffer d_whole{device, stream};
  if (Status st = d_shard.upload(shard.data(), kCount * 4); !st.ok()) return st.to_string();
  if (Status st = d_whole.upload(whole.data(), 2 * kCount * 4); !st.ok()) return st.to_string();
  if (Status st = comm.all_gather(d_shard.d_ptr, d_whole.d_ptr, kCount, DType::kFp32, &stream); !st.ok()) {
    return st.to_string();
  }
  Status st = comm.reduce_scatter(d_whole.d_ptr, d_shard.d_ptr, kCount, DType::kFp32, ReduceOp::kSum, &stream);
  if (!st.ok()) return st.to_string();
  if (st = d_shard.download(shard.data()); !st.ok()) return st.to_string();
  if (shard[0] != 2.0F * static_cast<float>(rank + 1) || shard[kCount - 1] != shard[0]) {
    return fmt::format("reduce_scatter of the gathered shards: {}", shard[0]);
  }
  if (st = comm.broadcast(d_shard.d_ptr, kCount * 4, 1, &stream); !st.ok()) return st.to_string();
  if (st = d_shard.download(shard.data()); !st.ok()) return st.to_string();
  if (shard[0] != 4.0F) return fmt::format("broadcast from rank 1: {}", shard[0]);
  return "";
}

// Two GPUs, one rank each.
TEST(NcclComm, TwoRanksMatchThePlainReference) {
  SKIP_WITHOUT_GPUS(2);
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto device = create_device({.backend = BackendChoice::kCuda, .ordinal = rank});
    if (!device.ok()) return device.status().to_string();
    CommOptions options = test::test_options(rank, 2, dir.path(), port);
    options.backend = CommBackend::kNccl;
    options.device = device->get();
    auto created = create_communicator(options);
    if (!created.ok()) {
      if (created.status().code() == ErrorCode::kUnavailable) return "SKIP " + created.status().message();
      return created.status().to_string();
    }
    auto stream = (*device)->create_stream();
    if (!stream.ok()) return stream.status().to_string();
    for (const std::string& e : {check_bf16_sum(**created, **device, **stream, rank),
                                 check_gather_scatter_broadcast(**created, **device, **stream, rank)}) {
      if (!e.empty()) return e;
    }
    Status st = (*created)->barrier();
    return st.ok() ? "" : st.to_string();
  });
  for (const auto& o : outcomes) {
    if (o.message.starts_with("SKIP ")) GTEST_SKIP() << o.message.substr(5);
  }
  EXPECT_ALL_RANKS_PASS(outcomes);
}

// A rank that dies: the watchdog aborts the communicator, and the survivor's
// next call reports the failure within a few timeouts.
TEST(NcclComm, KilledRankAbortsTheCommunicator) {
  SKIP_WITHOUT_GPUS(2);
  test::TempDir dir;
  const int port = test::next_port();
  constexpr auto kTimeout = std::chrono::milliseconds(3000);
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto device = create_device({.backend = BackendChoice::kCuda, .ordinal = rank});
    if (!device.ok()) return device.status().to_string();
    CommOptions options = test::test_options(rank, 2, dir.path(), port, kTimeout);
    options.backend = CommBackend::kNccl;
    options.device = device->get();
    auto created = create_communicator(options);
    if (!created.ok()) {
      if (created.status().code() == ErrorCode::kUnavailable) return "SKIP " + created.status().message();
      return created.status().to_string();
    }
    if (Status st = (*created)->barrier(); !st.ok()) return st.to_string();
    if (rank == 1) ::kill(::getpid(), SIGKILL);
    const test::Clock::time_point start = test::Clock::now();
    Status st = (*created)->barrier();  // its all-reduce cannot finish: the peer is gone
    const double ms = test::elapsed_ms(start);
    if (st.ok()) return "barrier succeeded without the peer";
    if (ms > 3.0 * static_cast<double>(kTimeout.count())) return fmt::format("took {:.0f} ms", ms);
    std::fprintf(stderr, "  rank 0 after %.0f ms: %s\n", ms, st.to_string().c_str());
    return "";
  });
  if (outcomes[0].message.starts_with("SKIP ")) GTEST_SKIP() << outcomes[0].message.substr(5);
  EXPECT_TRUE(outcomes[0].passed()) << test::describe(outcomes[0]);
  EXPECT_EQ(outcomes[1].signal, SIGKILL) << test::describe(outcomes[1]);
}

}  // namespace
}  // namespace tz
