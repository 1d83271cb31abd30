// The engine's task threads (engine/src/workers.h): FIFO order, the first
// error kept, and cheap tasks run on the caller when the thread is idle
// (Note [Cheap accumulations run inline] in engine/src/zero_engine.cpp)
// without breaking the order.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../../engine/src/workers.h"

namespace tz::detail {
namespace {

using namespace std::chrono_literals;

// Appends to a shared log, from whichever thread runs the task.
struct Log {
  std::mutex mu;
  std::vector<int> order;
  void add(int i) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(i);
  }
};

TEST(TaskThread, AnIdleThreadsCheapTaskRunsOnTheCaller) {
  TaskThread t("test");
  std::thread::id ran_on;
  t.run_inline_or_post([&] {
    ran_on = std::this_thread::get_id();
    return ok_status();
  });
  // Inline means done on return, without waiting for anything.
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_TRUE(t.wait_idle().ok());
}

TEST(TaskThread, ABusyThreadsCheapTaskQueuesBehindWhatIsThere) {
  TaskThread t("test");
  Log log;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::promise<void> entered;
  t.post([&] {
    entered.set_value();
    gate.wait();
    log.add(1);
    return ok_status();
  });
  entered.get_future().wait();
  std::thread::id ran_on;
  t.run_inline_or_post([&] {
    ran_on = std::this_thread::get_id();
    log.add(2);
    return ok_status();
  });
  release.set_value();
  ASSERT_TRUE(t.wait_idle().ok());
  EXPECT_EQ(log.order, (std::vector<int>{1, 2}));
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(TaskThread, TasksPostedWhileOneRunsInlineWaitForIt) {
  TaskThread t("test");
  Log log;
  std::atomic<bool> posted_ran{false};
  std::promise<void> posted;
  std::future<void> posted_done = posted.get_future();
  std::thread other;
  t.run_inline_or_post([&] {
    other = std::thread([&] {
      t.post([&] {
        posted_ran = true;
        log.add(2);
        return ok_status();
      });
      posted.set_value();
    });
    posted_done.wait();
    // The thread is idle and has a task, but this one holds it: give it time
    // to (wrongly) start.
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(posted_ran.load()) << "a task posted during an inline one ran beside it";
    log.add(1);
    return ok_status();
  });
  other.join();
  ASSERT_TRUE(t.wait_idle().ok());
  EXPECT_EQ(log.order, (std::vector<int>{1, 2}));
}

TEST(TaskThread, AnInlineTasksFailureIsTheThreadsError) {
  TaskThread t("grad");
  t.run_inline_or_post([] { return internal_error("the accumulator of block 3 is gone"); });
  t.run_inline_or_post([]() -> Status { throw std::runtime_error("out of cheese"); });
  const Status s = t.wait_idle();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("block 3"), std::string::npos) << s.message();  // the first error is kept
  EXPECT_TRUE(t.failed());

  TaskThread u("grad");
  u.run_inline_or_post([]() -> Status { throw std::runtime_error("out of cheese"); });
  const Status thrown = u.error();
  ASSERT_FALSE(thrown.ok());
  EXPECT_NE(thrown.message().find("grad thread: a task threw: out of cheese"), std::string::npos) << thrown.message();

  // Not a std::exception: still an error, and the thread is not left busy
  // (wait_idle would hang).
  TaskThread v("grad");
  v.run_inline_or_post([]() -> Status { throw 42; });
  v.post([] { return ok_status(); });
  const Status odd = v.wait_idle();
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.message().find("grad thread: a task threw something"), std::string::npos) << odd.message();
}

// wait_idle() returning means the object may go: an inline task on another
// thread has finished touching it (ThreadSanitizer sees a notify after the
// destruction otherwise).
TEST(TaskThread, ItCanBeDestroyedOnceWaitIdleReturns) {
  for (int i = 0; i < 200; ++i) {
    auto t = std::make_unique<TaskThread>("test");
    std::atomic<bool> started{false};
    std::thread other([&t, &started] {
      t->run_inline_or_post([&started] {
        started = true;
        return ok_status();
      });
      // `t` is not touched after run_inline_or_post returns.
    });
    while (!started) std::this_thread::yield();
    ASSERT_TRUE(t->wait_idle().ok());
    t.reset();
    other.join();
  }
}

TEST(TaskThread, ManyThreadsMixingInlineAndPostedTasksKeepEachThreadsOrder) {
  TaskThread t("test");
  constexpr int kThreads = 3, kTasks = 400;
  std::mutex mu;
  std::vector<std::vector<int>> seen(kThreads);
  std::atomic<int> running{0};
  std::atomic<bool> overlapped{false};
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < kTasks; ++i) {
        auto task = [&, th, i] {
          if (running.fetch_add(1) != 0) overlapped = true;
          {
            std::lock_guard<std::mutex> lock(mu);
            seen[th].push_back(i);
          }
          running.fetch_sub(1);
          return ok_status();
        };
        if (i % 3 == 0) {
          t.post(task);
        } else {
          t.run_inline_or_post(task);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  ASSERT_TRUE(t.wait_idle().ok());
  EXPECT_FALSE(overlapped.load()) << "two tasks ran at once";
  for (int th = 0; th < kThreads; ++th) {
    ASSERT_EQ(seen[th].size(), static_cast<std::size_t>(kTasks));
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[th][i], i) << "thread " << th;
  }
}

}  // namespace
}  // namespace tz::detail
