// SIGINT and SIGTERM for tierzero-train: the first asks the run to stop at
// the end of the step under way; a second aborts at once, removing the swap
// files first (Note [Stopping on a signal] in stop_signals.cpp).
//
//   tz::tool::StopSignals::install();             // first thing in main()
//   ...
//   if (tz::tool::StopSignals::requested() != 0) break;   // between steps
//   ...
//   return tz::tool::StopSignals::exit_as_signalled(rc); // last thing in main()
//
// Thread safety: install() once, from main(); the rest from any thread.
#pragma once

#include <string>

namespace tz::tool {

class StopSignals {
 public:
  // Sets the handlers for SIGINT and SIGTERM.
  static void install();
  // The first signal received (SIGINT or SIGTERM), 0 when none.
  static int requested();
  // "SIGINT" / "SIGTERM".
  static std::string name(int signal);
  // With a signal received: flushes stdio and ends the process by that
  // signal (default action), so the parent sees it and a shell reports
  // 128 + N. Without: returns `rc`.
  static int exit_as_signalled(int rc);
};

}  // namespace tz::tool
