// Worker threads of the engine's pipeline.
//
// Note [Collective order]
// Ranks must issue collectives in the same order. The training loop enqueues
// every collective (prefetch all-gathers, on-demand all-gathers, gradient
// reduce-scatters, the norm all-reduce) on one CommWorker, from the training
// thread, at points fixed by the program and the trace: never from a
// callback whose timing varies. The worker runs them one at a time in that
// order, so every rank sees the same sequence however its I/O is timed.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "tierzero/common.h"

namespace tz::detail {

// A thread running tasks in FIFO order. The first failure is kept; later
// tasks still run (each decides whether to skip on a failed pipeline), and
// wait_idle() / error() report it.
class TaskThread {
 public:
  explicit TaskThread(std::string name);
  ~TaskThread();  // runs what is queued, then stops
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;

  void post(std::function<Status()> task);
  // Runs `task` on the calling thread when nothing is queued or running
  // (marked busy meanwhile, so tasks posted by others wait behind it: the
  // order is kept, only the thread differs); otherwise posts it. For cheap
  // tasks, where two thread wake-ups would cost more than the work.
  void run_inline_or_post(std::function<Status()> task);
  // Blocks until every task posted so far has run; the first error, if any.
  Status wait_idle();
  // Posts `task` and waits for it (and everything before it).
  Status run(std::function<Status()> task);
  Status error() const;
  bool failed() const;

 private:
  void loop();
  // Runs a dequeued task; its failure becomes error() if the first.
  void finish(std::function<Status()>& task);

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> queue_;
  bool busy_ = false;  // a task is running (on the thread, or inline on a caller)
  bool stop_ = false;
  Status error_;
  std::thread thread_;
};

}  // namespace tz::detail
