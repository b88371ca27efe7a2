// The decisions of emberctl's subcommands that need no network: where each
// server's metrics endpoint is, what a checkpoint answer means, the summary
// of a valid config, the average message size from metrics, and the summary
// of a pattern recording. main.cc does the I/O around them.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "common/config/config.h"
#include "common/record/recording.h"
#include "tools/emberctl/prometheus.h"

namespace ember::emberctl {

struct Target {
  std::string name;             // "server 0"
  std::string metrics_address;  // "host:port"
};

// One metrics endpoint per server of `config`: server i is at
// cluster.servers[i].host with server.metrics_listen's port — except that a
// one-server job whose metrics_listen names a specific host (not 0.0.0.0 or
// ::) uses metrics_listen as written. Errors (kConfig): metrics_listen is
// off (""), naming `config_name` and what to set; its port is 0 (chosen at
// start-up, unknowable here: pass --metrics); two servers would get the same
// endpoint (servers sharing a host: pass --metrics).
[[nodiscard]] Result<std::vector<Target>> metrics_targets(const config::Config& config,
                                                          std::string_view config_name);

// What an answer to POST /checkpoint means.
//   200            kWritten, text "checkpoint written: <body>"
//   404, 405, 501  kUnsupported: the server has no such endpoint; the text
//                  says how checkpoints are written instead
//   other          kFailed, text "HTTP <status>: <body>"
struct CheckpointAnswer {
  enum Outcome { kWritten, kUnsupported, kFailed } outcome = kFailed;
  std::string text;
};
CheckpointAnswer interpret_checkpoint_answer(int http_status, std::string_view body);

// What `emberctl config check` prints for a valid config: the file, the
// transport, channels, batching, pool, servers, workers and the server
// settings that matter to an operator.
std::string config_summary(const config::Config& config, std::string_view path);

// Average message payload size seen by a server: ember_server_bytes_received_total
// / ember_server_messages_received_total, rounded to the nearest byte. Errors
// (kNotFound): either metric is missing, or no message was received yet.
[[nodiscard]] Result<std::uint64_t> average_message_bytes(const Exposition& metrics);

// What `emberctl record FILE` prints: source, duration, per channel the
// messages and bytes that went through, the peak occupancy (tail - head) and
// the median message size; per rank bytes and messages sent, hot ranks
// (above twice the mean) marked.
std::string recording_summary(const record::Recording& recording);

}  // namespace ember::emberctl
