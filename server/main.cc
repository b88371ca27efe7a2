// ember-server: the parameter-server daemon.
//
//   ember-server --config config/ember.toml [--listen HOST:PORT] [--set table.key=value]...
//   ember-server --config FILE --check-config     validate and exit (0 valid, 1 not)
//   ember-server --config FILE --print-config     print the effective config and exit
//
// Runs until SIGTERM, SIGINT or SIGHUP (the terminal or ssh session that
// started it went away; not when started with SIGHUP ignored, as under
// nohup), then drains, writes a final checkpoint (when
// server.checkpoint_dir is set) and exits 0; another of these signals more
// than 2 s after the first exits at once (128 + the signal number) without
// the checkpoint.
// A stop signal during start-up stops it before the ready line. Under systemd (NOTIFY_SOCKET
// set) it reports READY=1 once listening and pings WATCHDOG=1 every quarter
// of the watchdog interval, withholding the ping while a shard thread or an
// I/O thread has left its liveness probe (Server::check_liveness) waiting for
// two ticks.
// Once listening it prints one line to stdout:
//   ember-server ready listen=127.0.0.1:7070 metrics=127.0.0.1:9100
// (scripts and tests wait for it; "metrics=" is empty when metrics are off).
// This is the program's one top-level catch: exceptions from CLI11 and any
// library stop here with a message and exit code 1.
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#ifdef EMBER_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "common/base/cli_exit.h"
#include "common/base/logging.h"
#include "common/config/config.h"
#include "server/server.h"

namespace {

// "SIGTERM" for SIGTERM: the name operators look for in the log.
std::string signal_name(int signal_number) {
  const char* abbrev = sigabbrev_np(signal_number);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", signal_number);
}

void notify(const std::string& state) {
#ifdef EMBER_HAVE_SYSTEMD
  sd_notify(0, state.c_str());
#else
  (void)state;
#endif
}

// Longest wait of the signal loop, and so the longest watchdog ping
// interval: pinging more often than asked is harmless, and a WATCHDOG_USEC
// of years would overflow the nanoseconds of the wait.
constexpr std::chrono::seconds kLongestTick{3600};

// Watchdog tick: a quarter of WATCHDOG_USEC when systemd asks for pings (at
// most kLongestTick); 0 when it does not. The ping is withheld after two
// failed checks in a row (the first still pings). A shard thread stuck for
// good just after taking a probe passes the next check and fails the two
// after it: systemd restarts the server one interval after the last ping,
// 1.5 intervals after the shard stuck (as with a half-interval tick and one
// failure). What the quarter tick buys: a stall that ends within about one
// interval (a large optimizer step, a descheduled thread) costs no restart,
// where with the half tick one just over half an interval could.
std::chrono::microseconds watchdog_tick() {
#ifdef EMBER_HAVE_SYSTEMD
  std::uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
    const std::uint64_t quarter = usec / 4;
    const std::uint64_t longest = std::chrono::microseconds(kLongestTick).count();
    return std::chrono::microseconds(std::max<std::uint64_t>(1, std::min(quarter, longest)));
  }
#endif
  return std::chrono::microseconds(0);
}

int run(int argc, char** argv) {
  CLI::App app{"ember-server: Ember's parameter server daemon"};
  std::string config_path;
  std::string listen;
  std::vector<std::string> overrides;
  bool check_config = false;
  bool print_config = false;
  app.add_option("-c,--config", config_path, "TOML config file (see config/ember.toml); "
                                             "without it the built-in defaults are used");
  CLI::Option* listen_option =
      app.add_option("--listen", listen,
                     "HOST:PORT to bind, overriding server.listen (port 0: any free port)");
  app.add_option("--set", overrides, "override one key: table.key=value (repeatable)");
  CLI::Option* check = app.add_flag("--check-config", check_config,
                                    "validate the configuration and exit (0 = valid, 1 = not): the file, the listen "
                                    "address (its form and the auth-token rule; not whether the port is "
                                    "free now), shard CPUs, and that checkpoint_dir (and record_path when recording) is "
                                    "usable");
  app.add_flag("--print-config", print_config,
               "print the effective configuration, defaults included, and exit (1 if the file "
               "or a --set is invalid); not with --check-config")
      ->excludes(check);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError& e) {
    const int code = ember::cli_exit(app, e);
    // Most often `ember-server --check-config FILE`: the file needs --config.
    // (An unknown --option is only named, above.)
    bool positional = false;
    for (const std::string& extra : app.remaining()) positional |= !extra.starts_with('-');
    if (positional) {
      std::fprintf(stderr, "ember-server takes no positional arguments: give the config file with "
                           "--config FILE (e.g. ember-server --config config/ember.toml "
                           "--check-config)\n");
    }
    return code;
  } catch (const CLI::ParseError& e) {
    return ember::cli_exit(app, e);  // 2: the command line itself is wrong
  }

  ember::Result<ember::config::Config> loaded =
      config_path.empty() ? ember::config::parse_config("", "<defaults>")
                          : ember::config::load_config_file(config_path);
  if (!loaded) {
    std::fprintf(stderr, "ember-server: %s\n", loaded.error().message().c_str());
    return 1;
  }
  ember::config::Config config = std::move(*loaded);
  if (listen_option->count() > 0) {
    if (listen.empty()) {
      // Most often an unset variable in a unit or script (--listen "$ADDR").
      std::fprintf(stderr, "ember-server: --listen was given an empty value; give HOST:PORT, or "
                           "leave --listen out to use server.listen or this server's "
                           "cluster.servers entry\n");
      return 1;
    }
    for (const std::string& o : overrides) {
      // As set_values reads it: spaces around the key are allowed.
      const std::string_view assignment(o);
      std::string_view key = assignment.substr(0, assignment.find('='));
      while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
      while (!key.empty() && key.back() == ' ') key.remove_suffix(1);
      if (key == "server.listen") {
        std::fprintf(stderr, "ember-server: --listen %s and --set %s both give the listen "
                             "address; give one of them\n",
                     listen.c_str(), o.c_str());
        return 1;
      }
    }
    if (auto s = ember::config::set_listen(config, listen); !s) {
      std::fprintf(stderr, "ember-server: --listen: %s\n", s.error().message().c_str());
      return 1;
    }
  }
  if (auto s = ember::config::apply_overrides(config, overrides); !s) {
    std::fprintf(stderr, "ember-server: %s\n", s.error().message().c_str());
    return 1;
  }
  if (check_config) {
    for (auto usable : {ember::server::check_listen_address, ember::server::check_shard_cpus,
                       ember::server::check_checkpoint_dir, ember::server::check_record_path}) {
      if (auto s = usable(config); !s) {
        std::fprintf(stderr, "ember-server: %s\n", s.error().message().c_str());
        return 1;
      }
    }
    // Valid, but a start now would be refused: said, not failed (checking a
    // running server's config before a restart is expected to pass).
    if (auto s = ember::server::checkpoint_dir_free(config); !s) {
      std::fprintf(stderr, "ember-server: note: %s; a start with this config is refused until then\n",
                   s.error().message().c_str());
    }
    std::printf("ember-server: configuration is valid (%s)\n",
                config_path.empty() ? "built-in defaults" : config_path.c_str());
    return 0;
  }
  if (print_config) {
    std::fputs(ember::config::to_toml(config).c_str(), stdout);
    return 0;
  }

  ember::log::init_program_logging(ember::config::to_string(config.server.log_level));
  auto log = ember::log::logger("server");

  // Block the stop signals in every thread (threads inherit the mask) and
  // take them synchronously below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  // A hangup would otherwise end the process by default action, without the
  // drain or the final checkpoint, losing pushes already applied. Started
  // with SIGHUP ignored (nohup, or a supervisor that asks for it), it keeps
  // running when its terminal goes away, as asked.
  struct sigaction hup {};
  const bool stops_on_hup = sigaction(SIGHUP, nullptr, &hup) != 0 || hup.sa_handler != SIG_IGN;
  if (stops_on_hup) sigaddset(&stop_signals, SIGHUP);
  const char* const stop_names = stops_on_hup ? "SIGTERM, SIGINT or SIGHUP" : "SIGTERM or SIGINT";
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto server = ember::server::Server::create(config);
  if (!server) {
    log->critical("cannot start: {}", server.error().to_string());
    if (config.server.log_level == ember::config::LogLevel::kOff) {
      // The log is silenced, but a failed start is never silent.
      std::fprintf(stderr, "ember-server: cannot start: %s\n", server.error().to_string().c_str());
    }
    notify(fmt::format("STATUS=failed: {}", server.error().message()));
    return 1;
  }

  // A stop signal that came while the server started (pre-faulting a large
  // pool takes seconds): stop now, without announcing a server that is
  // already on its way out.
  const timespec now{};
  int signal_number = sigtimedwait(&stop_signals, nullptr, &now);
  if (signal_number < 0) signal_number = 0;
  const auto watchdog = watchdog_tick();
  if (signal_number == 0) {
    std::printf("ember-server ready listen=%s metrics=%s\n", (*server)->address().c_str(),
                (*server)->metrics_address().c_str());
    std::fflush(stdout);
    notify(fmt::format("READY=1\nSTATUS=serving on {}", (*server)->address()));
  }
  int failed_checks = 0;  // consecutive ticks with a probe still waiting (2+: ping withheld)
  const std::chrono::nanoseconds tick =
      watchdog.count() > 0 ? std::chrono::nanoseconds(watchdog) : std::chrono::nanoseconds(kLongestTick);
  while (signal_number == 0) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(tick.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(tick.count() % 1'000'000'000);
    const int s = sigtimedwait(&stop_signals, nullptr, &ts);
    if (s > 0) {
      signal_number = s;
    } else if (errno != EAGAIN && errno != EINTR) {
      // Never spin: wait without a timeout (and without watchdog pings).
      log->error("sigtimedwait failed ({}); waiting for {} without watchdog pings",
                 std::strerror(errno), stop_names);
      if (sigwait(&stop_signals, &signal_number) != 0) signal_number = SIGTERM;
      break;
    }
    if (watchdog.count() > 0 && signal_number == 0) {
      // A ping says the server works, not only that this thread runs: it
      // is withheld while a shard or I/O thread has taken no request for
      // two ticks, so that systemd restarts a server stuck there
      // (WatchdogSec).
      auto live = (*server)->check_liveness();
      const bool was_withheld = failed_checks >= 2;
      failed_checks = live ? 0 : std::min(failed_checks + 1, 2);
      if (failed_checks < 2) {
        if (was_withheld) log->info("server threads answer again: watchdog pings resume");
        notify("WATCHDOG=1");
      } else if (!was_withheld) {
        log->error("{}, for {} checks {} ms apart: withholding the watchdog ping; systemd "
                   "restarts the server if this lasts WatchdogSec",
                   live.error().message(), failed_checks,
                   std::chrono::duration_cast<std::chrono::milliseconds>(tick).count());
        notify(fmt::format("STATUS=watchdog ping withheld: {}", live.error().message()));
      }
    }
  }
  log->info("received {}: stopping (another {} after 2 s stops at once, without the final "
            "checkpoint)",
            signal_name(signal_number), stop_names);
  notify("STOPPING=1");
  // A second stop signal during the drain and the final checkpoint (say a
  // hung one) ends the process at once, as operators expect of Ctrl-C twice.
  // Not one within kRepeatGrace of the first: Ctrl-C in a terminal reaches
  // the whole process group, and a script or supervisor that then sends its
  // own SIGTERM asks for the same orderly stop.
  static constexpr std::chrono::seconds kRepeatGrace{2};
  const auto first = std::chrono::steady_clock::now();
  std::thread([stop_signals, log, first] {
    for (;;) {
      int again = 0;
      if (sigwait(&stop_signals, &again) != 0) return;
      if (std::chrono::steady_clock::now() - first < kRepeatGrace) continue;
      log->warn("received {} again while stopping: exiting now, without the final checkpoint",
                signal_name(again));
      std::_Exit(128 + again);
    }
  }).detach();
  if (auto s = (*server)->shutdown(); !s) {
    log->error("final checkpoint failed: {}", s.error().to_string());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ember-server: fatal: %s\n", e.what());
    return 1;
  }
}
