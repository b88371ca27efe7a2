// emberctl: the operator's tool for Ember.
//
//   emberctl status     [--config FILE | --metrics HOST:PORT...]   servers, workers, steps, pool
//   emberctl stats      [--config FILE | --metrics HOST:PORT...] [--interval 1s] [--raw]
//   emberctl checkpoint [--config FILE | --metrics HOST:PORT...]   ask every server for one now
//   emberctl config check FILE [--set table.key=value]...
//   emberctl tune  (--rtt 50us --bandwidth 10Gbit | --probe HOST:PORT)
//                  [--workers N] [--avg-message-size 64KB | --metrics HOST:PORT]
//                  [--channels N] [--config FILE]
//   emberctl probe-sink --listen HOST:PORT [--clients N]       the other end of tune --probe
//   emberctl record FILE                                         summary of a pattern recording
//
// status, stats and checkpoint talk to each server's metrics endpoint
// ([server] metrics_listen) over HTTP: GET /metrics, POST /checkpoint.
// With --config, server i's endpoint is cluster.servers[i]'s host with
// metrics_listen's port (metrics_listen's own host when it names one and
// there is one server). Exit codes: 0 success; 1 a server is down or a
// request failed; 2 bad usage or input; 3 the server does not support the
// request. checkpoint sends the job's token (Authorization: Bearer) from the
// config's [communication] auth_token, else from EMBER_AUTH_TOKEN. This is
// the program's one top-level catch.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/base/cli_exit.h"
#include "common/base/units.h"
#include "common/config/config.h"
#include "common/record/recording.h"
#include "tools/emberctl/http.h"
#include "tools/emberctl/probe.h"
#include "tools/emberctl/prometheus.h"
#include "tools/emberctl/report.h"
#include "tools/emberctl/commands.h"
#include "tools/emberctl/tune.h"

namespace {

using namespace ember;
using namespace ember::emberctl;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnsupported = 3;

int usage_error(const std::string& text) {
  std::fprintf(stderr, "emberctl: %s\n", text.c_str());
  return kExitUsage;
}

Result<std::chrono::milliseconds> parse_timeout(const std::string& text) {
  EMBER_ASSIGN_OR_RETURN(const auto d, parse_duration(text));
  if (d < std::chrono::milliseconds(1)) {
    // Sockets take it in whole milliseconds here, and a zero SO_RCVTIMEO
    // would mean no timeout at all.
    return make_error(ErrorCode::kInvalidArgument, "--timeout must be at least 1ms, got \"{}\"",
                      text);
  }
  return std::chrono::ceil<std::chrono::milliseconds>(d);
}

Result<Exposition> scrape(const std::string& address, std::chrono::milliseconds timeout) {
  EMBER_ASSIGN_OR_RETURN(HttpResponse r, http_request(address, "GET", "/metrics", timeout));
  if (r.status != 200) {
    return make_error(ErrorCode::kIo, "GET http://{}/metrics answered HTTP {}: {}", address, r.status,
                      r.body.substr(0, 200));
  }
  return parse_exposition(r.body);
}

struct Targets {
  std::vector<Target> list;
  std::uint32_t num_workers = 0;  // from the config; 0 when not known
  // [communication] auth_token from the config, else EMBER_AUTH_TOKEN; sent
  // with POST /checkpoint.
  std::string auth_token;
};

Result<Targets> resolve(const std::string& config_path, const std::vector<std::string>& metrics) {
  Targets t;
  if (const char* env = std::getenv("EMBER_AUTH_TOKEN")) t.auth_token = env;
  if (!metrics.empty()) {
    for (std::size_t i = 0; i < metrics.size(); ++i) {
      EMBER_TRY(config::parse_host_port(metrics[i]));
      t.list.push_back(Target{fmt::format("server {}", i), metrics[i]});
    }
    if (config_path.empty()) return t;
  }
  if (config_path.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "say where the servers are: --config FILE (with [server] metrics_listen) or "
                      "--metrics HOST:PORT");
  }
  EMBER_ASSIGN_OR_RETURN(const config::Config c, config::load_config_file(config_path));
  t.num_workers = c.cluster.num_workers;
  if (!c.communication.auth_token.empty()) t.auth_token = c.communication.auth_token;
  if (metrics.empty()) {
    EMBER_ASSIGN_OR_RETURN(t.list, metrics_targets(c, config_path));
  }
  return t;
}

int cmd_status(const std::string& config_path, const std::vector<std::string>& metrics,
               std::chrono::milliseconds timeout) {
  auto targets = resolve(config_path, metrics);
  if (!targets) return usage_error(targets.error().message());
  std::vector<ServerStatus> all;
  bool any_down = false;
  for (const Target& t : targets->list) {
    auto m = scrape(t.metrics_address, timeout);
    if (!m) {
      ServerStatus s;
      s.name = t.name;
      s.metrics_address = t.metrics_address;
      s.error = m.error().to_string();
      all.push_back(std::move(s));
      any_down = true;
      continue;
    }
    all.push_back(status_from_metrics(t.name, t.metrics_address, *m, targets->num_workers));
  }
  std::fputs(format_status(all).c_str(), stdout);
  std::ifstream meminfo("/proc/meminfo");
  if (meminfo) {
    std::stringstream ss;
    ss << meminfo.rdbuf();
    if (auto line = format_host_hugepages(ss.str())) std::printf("%s\n", line->c_str());
  }
  return any_down ? kExitFailed : kExitOk;
}

int cmd_stats(const std::string& config_path, const std::vector<std::string>& metrics,
              std::chrono::milliseconds timeout, const std::string& interval_text, bool raw) {
  auto targets = resolve(config_path, metrics);
  if (!targets) return usage_error(targets.error().message());
  std::chrono::nanoseconds interval{0};
  if (!interval_text.empty()) {
    auto d = parse_duration(interval_text);
    if (!d || d->count() <= 0) return usage_error("--interval needs a positive duration, e.g. 1s");
    interval = *d;
  }
  int rc = kExitOk;
  for (const Target& t : targets->list) {
    if (raw) {
      auto r = http_request(t.metrics_address, "GET", "/metrics", timeout);
      if (!r || r->status != 200) {
        std::fprintf(stderr, "%s: %s\n", t.name.c_str(),
                     r ? fmt::format("HTTP {}", r->status).c_str() : r.error().to_string().c_str());
        rc = kExitFailed;
        continue;
      }
      std::printf("# %s (%s)\n%s", t.name.c_str(), t.metrics_address.c_str(), r->body.c_str());
      continue;
    }
    auto first = scrape(t.metrics_address, timeout);
    if (!first) {
      std::fprintf(stderr, "%s (%s): %s\n", t.name.c_str(), t.metrics_address.c_str(),
                   first.error().to_string().c_str());
      rc = kExitFailed;
      continue;
    }
    std::optional<Exposition> second;
    if (interval.count() > 0) {
      std::this_thread::sleep_for(interval);  // the measurement interval itself, not a wait on a condition
      auto s = scrape(t.metrics_address, timeout);
      if (!s) {
        std::fprintf(stderr, "%s: %s\n", t.name.c_str(), s.error().to_string().c_str());
        rc = kExitFailed;
        continue;
      }
      second = std::move(*s);
    }
    std::printf("== %s (%s)\n", t.name.c_str(), t.metrics_address.c_str());
    const double secs = static_cast<double>(interval.count()) / 1e9;
    std::fputs((second ? format_stats(*second, &*first, secs) : format_stats(*first, nullptr, 0)).c_str(),
               stdout);
  }
  return rc;
}

int cmd_checkpoint(const std::string& config_path, const std::vector<std::string>& metrics,
                   std::chrono::milliseconds timeout) {
  auto targets = resolve(config_path, metrics);
  if (!targets) return usage_error(targets.error().message());
  int rc = kExitOk;
  for (const Target& t : targets->list) {
    auto r = http_request(t.metrics_address, "POST", "/checkpoint", timeout, targets->auth_token);
    if (!r) {
      std::fprintf(stderr, "%s: %s\n", t.name.c_str(), r.error().to_string().c_str());
      rc = kExitFailed;
      continue;
    }
    const CheckpointAnswer a = interpret_checkpoint_answer(r->status, r->body);
    std::fprintf(a.outcome == CheckpointAnswer::kWritten ? stdout : stderr, "%s: %s\n", t.name.c_str(),
                 a.text.c_str());
    if (a.outcome == CheckpointAnswer::kUnsupported && rc == kExitOk) rc = kExitUnsupported;
    if (a.outcome == CheckpointAnswer::kFailed) rc = kExitFailed;
  }
  return rc;
}

int cmd_config_check(const std::string& path, const std::vector<std::string>& overrides) {
  auto c = config::load_config_file(path);
  if (c) {
    if (auto s = config::apply_overrides(*c, overrides); !s) c = tl::unexpected(s.error());
  }
  if (!c) {
    std::fprintf(stderr, "%s\n", c.error().message().c_str());
    std::fprintf(stderr, "emberctl: %s is NOT valid\n", path.c_str());
    return kExitFailed;
  }
  std::fputs(config_summary(*c, path).c_str(), stdout);
  return kExitOk;
}

struct TuneArgs {
  std::string rtt, bandwidth, probe, avg_message, metrics, config_path, probe_duration = "1s",
                                                                       timeout = "10s";
  std::uint32_t workers = 0, channels = 0, pings = 200;
};

int cmd_tune(const TuneArgs& a) {
  TuneInputs in;
  std::optional<config::Config> cfg;
  if (!a.config_path.empty()) {
    auto c = config::load_config_file(a.config_path);
    if (!c) return usage_error(c.error().message());
    cfg = std::move(*c);
  }
  auto timeout = parse_timeout(a.timeout);
  if (!timeout) return usage_error(timeout.error().message());
  if (a.workers != 0) {
    in.num_workers = a.workers;
  } else if (cfg) {
    in.num_workers = cfg->cluster.num_workers;
    std::printf("workers: %u (cluster.num_workers in %s)\n", in.num_workers, a.config_path.c_str());
  } else {
    return usage_error("tune needs --workers N (or --config FILE for cluster.num_workers)");
  }
  if (a.channels != 0) {
    in.num_channels = a.channels;
  } else if (cfg) {
    in.num_channels = config::resolved_num_channels(cfg->communication);
    std::printf("channels: %u (from %s)\n", in.num_channels, a.config_path.c_str());
  } else {
    in.num_channels = 1;
    std::printf("channels: 1 (default; give --channels or --config)\n");
  }
  // Chunks above 64 MiB (the largest pool block) are received into heap memory anyway.
  if (cfg) in.largest_message_bytes = std::min<std::uint64_t>(cfg->server.partition_bytes, std::uint64_t{64} << 20);
  if (!a.avg_message.empty()) {
    auto m = parse_size_bytes(a.avg_message);
    if (!m) return usage_error(fmt::format("--avg-message-size: {}", m.error().message()));
    in.avg_message_bytes = *m;
  } else if (!a.metrics.empty()) {
    auto m = scrape(a.metrics, *timeout);
    if (!m) {
      std::fprintf(stderr, "emberctl tune: %s\n", m.error().to_string().c_str());
      return kExitFailed;
    }
    auto avg = average_message_bytes(*m);
    if (!avg) return usage_error(fmt::format("--metrics {}: {}", a.metrics, avg.error().message()));
    in.avg_message_bytes = *avg;
    std::printf("average message: %llu bytes (bytes / messages received by %s)\n",
                static_cast<unsigned long long>(in.avg_message_bytes), a.metrics.c_str());
  } else {
    return usage_error("tune needs --avg-message-size SIZE (e.g. 64KB), or --metrics HOST:PORT of a "
                       "server that has seen traffic");
  }
  // The link last: a probe takes a while, and a missing or bad argument
  // above is reported before it runs.
  if (!a.probe.empty()) {
    if (!a.rtt.empty() || !a.bandwidth.empty()) {
      return usage_error("give either --probe or --rtt and --bandwidth, not both");
    }
    auto d = parse_duration(a.probe_duration);
    if (!d) return usage_error(d.error().message());
    // run_probe sizes the bulk transfer from a warm-up's rate, so it takes
    // about --probe-duration only when the link's rate holds; the measured
    // line below gives the time it really took.
    std::printf("probing %s: %u pings, then a bulk transfer sized to take about %s (--probe-duration) "
                "at a warm-up's rate...\n",
                a.probe.c_str(), a.pings, format_duration(*d).c_str());
    std::fflush(stdout);
    auto p = run_probe(a.probe, a.pings, *d, *timeout);
    if (!p) {
      std::fprintf(stderr, "emberctl tune: %s\n", p.error().to_string().c_str());
      return kExitFailed;
    }
    std::printf("measured: RTT %s (median of %u, min %s), bandwidth %s (%s sent in %s)\n",
                format_duration(p->rtt).c_str(), p->pings, format_duration(p->rtt_min).c_str(),
                format_bandwidth(p->bandwidth_bytes_per_s).c_str(), human_bytes(static_cast<double>(p->bulk_bytes)).c_str(),
                format_duration(p->bulk_time).c_str());
    in.rtt = p->rtt;
    in.bandwidth_bytes_per_s = p->bandwidth_bytes_per_s;
  } else {
    if (a.rtt.empty() || a.bandwidth.empty()) {
      return usage_error("tune needs --rtt and --bandwidth (e.g. --rtt 50us --bandwidth 10Gbit), or "
                         "--probe HOST:PORT to measure them against `emberctl probe-sink`");
    }
    auto rtt = parse_duration(a.rtt);
    if (!rtt) return usage_error(fmt::format("--rtt: {}", rtt.error().message()));
    auto bw = parse_bandwidth(a.bandwidth);
    if (!bw) return usage_error(fmt::format("--bandwidth: {}", bw.error().message()));
    in.rtt = *rtt;
    in.bandwidth_bytes_per_s = *bw;
  }
  auto r = tune(in);
  if (!r) return usage_error(r.error().message());
  std::printf("\nreasoning:\n");
  for (const std::string& line : r->reasoning) std::printf("  %s\n", line.c_str());
  std::printf("\nrecommended:\n%s", r->toml().c_str());
  return kExitOk;
}

int cmd_probe_sink(const std::string& listen, std::uint32_t clients) {
  auto sink = ProbeSink::listen(listen);
  if (!sink) {
    std::fprintf(stderr, "emberctl probe-sink: %s\n", sink.error().to_string().c_str());
    return kExitFailed;
  }
  std::printf("emberctl probe-sink listening on %s\n", (*sink)->address().c_str());
  std::fflush(stdout);
  if (auto s = (*sink)->serve(clients); !s) {
    std::fprintf(stderr, "emberctl probe-sink: %s\n", s.error().to_string().c_str());
    return kExitFailed;
  }
  return kExitOk;
}

int cmd_record(const std::string& path) {
  auto rec = record::load_recording(path);
  if (!rec) {
    std::fprintf(stderr, "emberctl record: %s\n", rec.error().to_string().c_str());
    return kExitFailed;
  }
  std::fputs(recording_summary(*rec).c_str(), stdout);
  return kExitOk;
}

int run(int argc, char** argv) {
  CLI::App app{"emberctl: status, stats, checkpoints, config checks and tuning for Ember"};
  // Not require_subcommand(1): CLI11 then says "A subcommand is required"
  // for a missing and for a misspelt one alike; the checks around parse()
  // name the word and list the commands.
  app.require_subcommand(0, 1);
  std::string config_path;
  std::vector<std::string> metrics;
  std::string timeout_text = "5s";
  auto add_target_options = [&](CLI::App* sub) {
    sub->add_option("-c,--config", config_path,
                    "the job's TOML config: servers from [cluster] servers, port from [server] "
                    "metrics_listen");
    sub->add_option("-m,--metrics", metrics,
                    "metrics endpoint HOST:PORT of a server (repeatable; overrides --config's)");
    sub->add_option("--timeout", timeout_text, "per-request timeout (duration)")->capture_default_str();
  };

  auto* status = app.add_subcommand("status", "servers up, workers connected, step per worker, pool use");
  add_target_options(status);

  auto* stats = app.add_subcommand("stats", "every metric of each server, human-readable");
  add_target_options(stats);
  std::string interval;
  bool raw = false;
  stats->add_option("--interval", interval, "scrape twice this far apart and show rates (e.g. 1s)");
  stats->add_flag("--raw", raw, "print the Prometheus text as served");

  auto* checkpoint = app.add_subcommand("checkpoint", "ask every server to write a checkpoint now");
  add_target_options(checkpoint);

  // Not require_subcommand(1): CLI11's message for it ("A subcommand is
  // required") names none; the check after parsing lists them.
  auto* config_cmd = app.add_subcommand("config", "configuration files");
  auto* check = config_cmd->add_subcommand(
      "check", "validate a TOML config's keys and values (exit 0 when valid); ember-server "
               "--check-config also checks what needs the server's host: the listen address and "
               "token rule, shard CPUs, checkpoint_dir");
  std::string check_file;
  std::vector<std::string> overrides;
  check->add_option("file", check_file, "the TOML file")->required();
  check->add_option("--set", overrides, "override table.key=value before checking (repeatable)");

  auto* tune_cmd = app.add_subcommand(
      "tune", "recommend batch_threshold, ring_buffer_size and prealloc_pages from RTT and bandwidth");
  TuneArgs ta;
  tune_cmd->add_option("--rtt", ta.rtt, "round-trip time to a server (duration, e.g. 50us)");
  tune_cmd->add_option("--bandwidth", ta.bandwidth, "link bandwidth (10Gbit, 25Gbps, 1.25GB/s)");
  tune_cmd->add_option("--probe", ta.probe, "measure RTT and bandwidth against `emberctl probe-sink` at HOST:PORT");
  tune_cmd->add_option("--pings", ta.pings, "pings for the RTT median")->capture_default_str();
  tune_cmd->add_option("--probe-duration", ta.probe_duration, "length of the bulk transfer")
      ->capture_default_str();
  tune_cmd->add_option("--workers", ta.workers, "workers in the job (default: cluster.num_workers of --config)");
  tune_cmd->add_option("--avg-message-size", ta.avg_message, "average message size (e.g. 64KB)");
  tune_cmd->add_option("-m,--metrics", ta.metrics,
                       "read the average message size from this server's metrics (HOST:PORT)");
  tune_cmd->add_option("--channels", ta.channels, "channels (default: from --config, else 1)");
  tune_cmd->add_option("-c,--config", ta.config_path, "the job's TOML config (workers, channels)");
  tune_cmd->add_option("--timeout", ta.timeout, "per-operation timeout")->capture_default_str();

  auto* sink = app.add_subcommand("probe-sink", "the far end of `tune --probe`: echo pings, absorb bulk");
  std::string sink_listen;
  std::uint32_t sink_clients = 0;
  sink->add_option("--listen", sink_listen, "HOST:PORT to listen on (port 0: any)")->required();
  sink->add_option("--clients", sink_clients, "exit after serving this many probes (0: never)")
      ->capture_default_str();

  auto* record_cmd = app.add_subcommand("record", "summarise a communication pattern recording");
  std::string record_file;
  record_cmd->add_option("file", record_file, "the file written with record_pattern = true")->required();

  // "\n  emberctl [<prefix> ]<name>: <description>" for each subcommand of `parent`.
  auto command_list = [](CLI::App& parent, std::string_view prefix) {
    std::string names;
    for (const CLI::App* sub : parent.get_subcommands([](const CLI::App*) { return true; })) {
      names += fmt::format("\n  emberctl {}{}: {}", prefix, sub->get_name(), sub->get_description());
    }
    return names;
  };
  if (argc > 1 && argv[1][0] != '-' &&
      app.get_subcommands([&](const CLI::App* sub) { return sub->get_name() == argv[1]; })
          .empty()) {
    return usage_error(fmt::format("unknown command '{}'; the commands are:{}", argv[1],
                                   command_list(app, "")));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ember::cli_exit(app, e);
  }
  if (app.get_subcommands().empty()) {
    return usage_error("a command is needed:" + command_list(app, "") +
                       "\n(emberctl <command> --help for its options)");
  }
  if (*status || *stats || *checkpoint) {
    auto timeout = parse_timeout(timeout_text);
    if (!timeout) return usage_error(timeout.error().message());
    if (*status) return cmd_status(config_path, metrics, *timeout);
    if (*stats) return cmd_stats(config_path, metrics, *timeout, interval, raw);
    return cmd_checkpoint(config_path, metrics, *timeout);
  }
  if (*config_cmd && config_cmd->get_subcommands().empty()) {
    return usage_error("config needs a subcommand:" + command_list(*config_cmd, "config "));
  }
  if (*check) return cmd_config_check(check_file, overrides);
  if (*tune_cmd) return cmd_tune(ta);
  if (*sink) return cmd_probe_sink(sink_listen, sink_clients);
  if (*record_cmd) return cmd_record(record_file);
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberctl: fatal: %s\n", e.what());
    return kExitFailed;
  }
}
