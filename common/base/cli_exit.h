// One exit status for command-line misuse across Ember's programs.
//
// CLI11's App::exit prints a parse error (or the help text) and returns
// CLI11's own code for it: 105 for a bad conversion, 106 for a failed check,
// 109 for an unknown argument, and so on. Ember's programs (ember-server,
// emberctl, fmnist-worker, fmnist-baseline) exit 2 for every usage error
// instead, as getopt-based tools and scripts/demo.sh do, and keep 1 for a
// failure after the command line was understood (a bad config file, a run
// that failed). --help and --version still exit 0.
//
// Usage:
//   try { app.parse(argc, argv); }
//   catch (const CLI::ParseError& e) { return ember::cli_exit(app, e); }
//
// Thread-safety: as CLI::App::exit (writes to stdout/stderr); call from main.
#pragma once

#include <CLI/CLI.hpp>

namespace ember {

// Exit status for a program whose command line did not parse.
inline constexpr int kUsageExitCode = 2;

// Prints `error` as App::exit does and returns 0 for --help/--version,
// kUsageExitCode otherwise.
inline int cli_exit(const CLI::App& app, const CLI::ParseError& error) {
  return app.exit(error) == 0 ? 0 : kUsageExitCode;
}

}  // namespace ember
