// SIGINT and SIGTERM for tierzero-train.
//
// Note [Stopping on a signal]
// Ctrl-C, `timeout`, Slurm's and Kubernetes' SIGTERM used to kill the trainer
// where it stood: the swap file (the size of the run's NVMe states) stayed
// behind, and there was no loss CSV or summary for the steps that ran. Now:
// - The first SIGINT or SIGTERM only sets a flag (a lock-free atomic, the one
//   thing a handler may safely do beside write(2)). The training loop looks
//   at it when a step ends, never between a step's micro-batches: a step's
//   micro-batches, reductions and optimizer pass are one unit on every rank,
//   and stopping inside it would leave other ranks in a collective. With
//   several ranks they agree after every step whether any was signalled (one
//   small collective), so all stop after the same step.
// - The run then writes what a normal end writes (summary JSON saying it was
//   stopped, by which signal and after which step; the loss CSV and plot; the
//   trace if its step ran), skips the evaluations and saves still due,
//   destroys the engine (which removes its swap files) and ends by the same
//   signal, re-raised with its default action: the parent sees "killed by
//   SIGINT/SIGTERM" and a shell reports 128 + N. Exiting with 130 would look
//   like a program that handled Ctrl-C and carried on, and a shell script
//   looping over runs would go on to the next one.
// - A second signal, while the step ends or the files are written, aborts
//   at once: the handler unlinks the swap files (their paths wait in fixed
//   memory for this: tz::nvme::remove_swap_files_now, async-signal-safe),
//   restores the default action and re-raises. Nothing else is safe there: a
//   checkpoint's .partial folder (only there when the abort comes inside a
//   save) is removed by the next save of that name.
// - As the first process of a PID namespace (a container's entry point, or
//   `unshare --pid --fork`), the kernel drops every signal whose action is
//   the default, a re-raised one included: the abort would unlink the swap
//   files and then carry on training without them, and a stopped run would
//   fall out of main instead of ending by its signal. There the handler ends
//   the process with _exit(128 + N) (what a shell reports for death by
//   signal N), and exit_as_signalled returns that status.
#include "stop_signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>

#include "tierzero/nvme.h"

namespace tz::tool {
namespace {

std::atomic<int> g_first{0};
static_assert(std::atomic<int>::is_always_lock_free, "read and written by a signal handler");

// Messages by length, for write(2) (strlen is not on every list of
// async-signal-safe functions).
template <std::size_t N>
void say(const char (&text)[N]) {
  (void)!::write(STDERR_FILENO, text, N - 1);
}

void restore_default(int sig) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
}

extern "C" void on_stop_signal(int sig) {
  const int saved_errno = errno;
  int none = 0;
  if (g_first.compare_exchange_strong(none, sig)) {
    if (sig == SIGINT) {
      say("\ntierzero-train: SIGINT: stopping when this step ends (send it again to abort at once)\n");
    } else {
      say("\ntierzero-train: SIGTERM: stopping when this step ends (send it again to abort at once)\n");
    }
    errno = saved_errno;
    return;
  }
  say("\ntierzero-train: a second signal: aborting now; removing the swap files\n");
  nvme::remove_swap_files_now();
  if (::getpid() == 1) ::_exit(128 + sig);  // a re-raised signal would be dropped (the Note)
  restore_default(sig);
  ::raise(sig);  // delivered when the handler returns: the process ends
  errno = saved_errno;
}

}  // namespace

void StopSignals::install() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);  // one handler at a time
  sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART;        // I/O under way goes on; the loop looks at the flag
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

int StopSignals::requested() { return g_first.load(); }

std::string StopSignals::name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

int StopSignals::exit_as_signalled(int rc) {
  const int sig = g_first.load();
  if (sig == 0) return rc;
  std::fflush(nullptr);  // the default action does not flush stdio
  restore_default(sig);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  return 128 + sig;  // reached only as a PID namespace's first process (the Note)
}

}  // namespace tz::tool
