// Named loggers per subsystem ("pool", "ring", "wire", "tcp", "server", ...).
//
// The library never installs sinks: a logger made here shares the sinks of
// spdlog's default logger at the time of the call, so whatever the program
// configured in main() (console, file, journald) receives library messages.
// Binaries call init_program_logging() once from main().
//
// Thread-safety: logger() may be called from any thread; spdlog loggers are
// thread-safe (the _mt sinks). The first call per name allocates; later calls
// are a registry lookup, so cache the pointer on hot paths.
#pragma once

#include <memory>
#include <string_view>

#include <spdlog/spdlog.h>

namespace ember::log {

// The logger named `subsystem`, created on first use with the default
// logger's sinks and level.
std::shared_ptr<spdlog::logger> logger(std::string_view subsystem);

// For programs only (never called by library code): colour console sink on
// stderr, pattern with time, level and subsystem, level from `level`
// ("trace".."critical", "off"). Unknown levels fall back to "info".
void init_program_logging(std::string_view level);

}  // namespace ember::log
