#include "workers.h"

#include <exception>

namespace tz::detail {

TaskThread::TaskThread(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {}

TaskThread::~TaskThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void TaskThread::post(std::function<Status()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void TaskThread::run_inline_or_post(std::function<Status()> task) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!queue_.empty() || busy_ || stop_) {
      queue_.push_back(std::move(task));
      lock.unlock();
      cv_.notify_all();
      return;
    }
    busy_ = true;
  }
  finish(task);
}

Status TaskThread::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  return error_;
}

Status TaskThread::run(std::function<Status()> task) {
  if (Status prior = error(); !prior.ok()) return prior;  // a failed pipeline runs no more collectives
  post(std::move(task));
  return wait_idle();
}

Status TaskThread::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool TaskThread::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !error_.ok();
}

void TaskThread::loop() {
  for (;;) {
    std::function<Status()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !busy_ && (stop_ || !queue_.empty()); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    finish(task);
  }
}

void TaskThread::finish(std::function<Status()>& task) {
  Status s;
  try {
    s = task();
  } catch (const std::exception& e) {
    s = internal_error("{} thread: a task threw: {}", name_, e.what());
  } catch (...) {
    s = internal_error("{} thread: a task threw something that is not a std::exception", name_);
  }
  // What the task holds (buffers, tokens) goes before it counts as done, so
  // wait_idle() means everything it held is released.
  task = nullptr;
  // Notified under the lock: once busy_ is false a waiter may return and
  // destroy this object, so nothing of it is touched after the unlock.
  std::lock_guard<std::mutex> lock(mu_);
  if (!s.ok() && error_.ok()) error_ = std::move(s);
  busy_ = false;
  if (!queue_.empty() || stop_) cv_.notify_all();  // posted (or stopping) while this ran inline: the thread goes on
  idle_cv_.notify_all();
}

}  // namespace tz::detail
