// Network-free logic of emberctl's subcommands; see commands.h.
#include "tools/emberctl/commands.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/units.h"
#include "tools/emberctl/report.h"

namespace ember::emberctl {

Result<std::vector<Target>> metrics_targets(const config::Config& config, std::string_view config_name) {
  const auto& ml = config.server.metrics_listen;
  if (!ml) {
    return make_error(ErrorCode::kConfig,
                      "{}: server.metrics_listen is off, and emberctl reads each server's metrics "
                      "endpoint; set it (e.g. metrics_listen = \"0.0.0.0:9464\") and restart the "
                      "servers, or pass --metrics HOST:PORT",
                      config_name);
  }
  if (ml->port == 0) {
    return make_error(ErrorCode::kConfig,
                      "{}: server.metrics_listen has port 0 (any free port, chosen at start-up); "
                      "pass --metrics HOST:PORT with the port from the server's 'ember-server ready' "
                      "line",
                      config_name);
  }
  const bool wildcard = ml->host == "0.0.0.0" || ml->host == "::" || ml->host.empty();
  std::vector<Target> out;
  const auto& servers = config.cluster.servers;
  for (std::size_t i = 0; i < servers.size(); ++i) {
    config::HostPort hp{servers[i].host, ml->port};
    if (!wildcard && servers.size() == 1) hp.host = ml->host;
    out.push_back(Target{fmt::format("server {}", i), hp.to_string()});
  }
  // Servers sharing a host with one metrics port: only one of them can
  // listen there, and every target would read that one server.
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (std::size_t j = i + 1; j < out.size(); ++j) {
      if (out[i].metrics_address == out[j].metrics_address) {
        return make_error(ErrorCode::kConfig,
                          "{}: servers {} and {} would both have their metrics endpoint at {} "
                          "(server.metrics_listen's port on the host they share), but only one "
                          "process can listen there; give each server on a host its own "
                          "metrics_listen port and pass each endpoint with --metrics HOST:PORT",
                          config_name, i, j, out[i].metrics_address);
      }
    }
  }
  return out;
}

CheckpointAnswer interpret_checkpoint_answer(int http_status, std::string_view body) {
  std::string text(body);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (http_status == 200) return {CheckpointAnswer::kWritten, fmt::format("checkpoint written: {}", text)};
  if (http_status == 409) {  // the server's checkpoint hook: checkpoint_dir is not set
    return {CheckpointAnswer::kUnsupported,
            fmt::format("this ember-server writes no checkpoints (HTTP 409): {}; set "
                        "server.checkpoint_dir in its config and restart it",
                        text)};
  }
  if (http_status == 404 || http_status == 405 || http_status == 501) {
    return {CheckpointAnswer::kUnsupported,
            fmt::format("this ember-server does not take checkpoint requests over HTTP (HTTP {} on "
                        "POST /checkpoint); it writes one every server.checkpoint_interval and on "
                        "SIGTERM, and workers can ask with Worker::checkpoint()",
                        http_status)};
  }
  return {CheckpointAnswer::kFailed, fmt::format("checkpoint failed: HTTP {}: {}", http_status, text)};
}

std::string config_summary(const config::Config& c, std::string_view path) {
  const auto& cm = c.communication;
  std::string servers;
  for (const auto& s : c.cluster.servers) servers += (servers.empty() ? "" : ", ") + s.to_string();
  std::string out = fmt::format("{}: valid\n", path);
  out += fmt::format("  transport           {} (zero_copy {}, payload_checksum {}, pool_backing {})\n",
                     config::to_string(cm.transport), config::to_string(cm.zero_copy),
                     cm.payload_checksum ? "on" : "off", config::to_string(cm.pool_backing));
  out += fmt::format("  channels            {}{}\n", config::resolved_num_channels(cm),
                     cm.num_channels == 0 ? " (auto)" : "");
  out += fmt::format("  batching            batch_threshold {}, flush_interval {}, ring_buffer_size {}\n",
                     format_bytes(cm.batch_threshold_bytes), duration_text(cm.flush_interval),
                     cm.ring_buffer_slots);
  out += fmt::format("  page pool           {} pages of 2 MiB ({})\n", cm.prealloc_pages,
                     format_bytes(std::uint64_t{cm.prealloc_pages} << 21));
  out += fmt::format("  cluster             {} server(s): {}; {} worker(s)\n", c.cluster.servers.size(),
                     servers, c.cluster.num_workers);
  out += fmt::format("  server              consistency {}, on_worker_loss {}, checkpoints {}, metrics {}\n",
                     config::to_string(c.server.consistency), config::to_string(c.server.on_worker_loss),
                     c.server.checkpoint_dir.empty() ? std::string("off") : c.server.checkpoint_dir,
                     c.server.metrics_listen ? c.server.metrics_listen->to_string() : std::string("off"));
  out += fmt::format("  shards              {} per server{}, partition_bytes {}\n", c.server.num_shards,
                     c.server.shard_cpu_affinity.empty()
                         ? std::string()
                         : fmt::format(" (pinned to CPUs {})", fmt::join(c.server.shard_cpu_affinity, ",")),
                     format_bytes(c.server.partition_bytes));
  out += fmt::format("  recording           {}\n",
                     cm.record_pattern ? fmt::format("on, to {}", cm.record_path) : std::string("off"));
  return out;
}

Result<std::uint64_t> average_message_bytes(const Exposition& m) {
  const auto bytes = m.value("ember_server_bytes_received_total");
  const auto msgs = m.value("ember_server_messages_received_total");
  if (!bytes || !msgs) {
    return make_error(ErrorCode::kNotFound,
                      "the server exports no ember_server_bytes_received_total / "
                      "ember_server_messages_received_total; give --avg-message-size");
  }
  if (*msgs < 1) {
    return make_error(ErrorCode::kNotFound,
                      "the server has received no message yet; run some training first or give "
                      "--avg-message-size");
  }
  return static_cast<std::uint64_t>(std::llround(*bytes / *msgs));
}

std::string recording_summary(const record::Recording& rec) {
  const record::Totals totals = record::final_totals(rec);
  std::string out = fmt::format("recording of {}: {} channel(s), {} rank(s), {}\n", rec.source,
                                rec.num_channels, rec.num_ranks,
                                rec.complete ? fmt::format("{:.3f} s", static_cast<double>(rec.duration_ns) / 1e9)
                                             : std::string("cut short (no end line)"));
  if (rec.out_of_range != 0) {
    out += fmt::format("  {} hook call(s) named a channel or rank outside the declared range\n",
                       rec.out_of_range);
  }
  std::vector<std::uint64_t> peak(rec.num_channels, 0);
  for (const auto& s : rec.channel_samples) {
    const std::uint64_t occ = s.tail_msgs > s.head_msgs ? s.tail_msgs - s.head_msgs : 0;
    peak[s.channel] = std::max(peak[s.channel], occ);
  }
  out += "  channel  messages       bytes  peak queued  median size\n";
  for (std::uint32_t c = 0; c < rec.num_channels; ++c) {
    // Median from the size histogram: the bucket holding the middle message.
    std::vector<const record::SizeBucketCount*> buckets;
    std::uint64_t n = 0;
    for (const auto& b : rec.size_buckets) {
      if (b.channel == c) {
        buckets.push_back(&b);
        n += b.count;
      }
    }
    std::sort(buckets.begin(), buckets.end(), [](auto* a, auto* b) { return a->lo_bytes < b->lo_bytes; });
    std::string median = "-";
    std::uint64_t seen = 0;
    for (const auto* b : buckets) {
      seen += b->count;
      if (2 * seen >= n && n > 0) {
        median = b->hi_bytes - b->lo_bytes <= 1 ? fmt::format("{} B", b->lo_bytes)
                                                : fmt::format("{}..{} B", b->lo_bytes, b->hi_bytes - 1);
        break;
      }
    }
    const auto& t = totals.channels[c];
    out += fmt::format("  {:>7}  {:>8}  {:>10}  {:>11}  {}\n", c, t.tail_msgs, human_bytes(static_cast<double>(t.tail_bytes)),
                       peak[c], median);
  }
  double mean = 0;
  for (const auto& r : totals.ranks) mean += static_cast<double>(r.bytes_sent);
  mean /= std::max<std::size_t>(1, totals.ranks.size());
  out += "  rank     messages       bytes\n";
  for (const auto& r : totals.ranks) {
    const bool hot = totals.ranks.size() > 1 && static_cast<double>(r.bytes_sent) > 2 * mean;
    out += fmt::format("  {:>4}     {:>8}  {:>10}{}\n", r.rank, r.messages_sent,
                       human_bytes(static_cast<double>(r.bytes_sent)), hot ? "  hot (over twice the mean)" : "");
  }
  return out;
}

}  // namespace ember::emberctl
