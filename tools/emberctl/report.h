// What `emberctl status` and `emberctl stats` print, computed from the
// metrics one ember-server exports (parsed with prometheus.h). Pure
// functions, so the text is tested without a server.
//
// Metrics read (names as server/server.cc registers them):
//   ember_server_workers_connected, ember_server_worker_step{rank},
//   ember_pool_bytes_in_use, ember_pool_region_bytes, ember_server_entries,
//   ember_server_shard_ring_items{shard}, ember_server_checkpoints_written_total,
//   ember_server_{bytes,messages}_{received,sent}_total,
//   ember_server_frames_received_total, ember_server_batch_fill_ratio,
//   ember_server_request_latency_us{type} (histogram), and
//   ember_pool_backing_info{backing="hugetlb"|"thp"|"plain"} 1.
// A metric the server does not export (an older server lacks the backing
// info) is shown as "n/a", never guessed.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tools/emberctl/prometheus.h"

namespace ember::emberctl {

struct ServerStatus {
  std::string name;             // "server 0"
  std::string metrics_address;  // "127.0.0.1:9464"
  bool up = false;
  std::string error;            // why not up
  std::optional<double> workers_connected;
  std::uint32_t workers_expected = 0;  // 0: unknown
  std::vector<std::pair<std::uint32_t, double>> worker_steps;  // (rank, step), by rank
  std::optional<double> pool_in_use_bytes;
  std::optional<double> pool_region_bytes;
  std::optional<std::string> pool_backing;  // "hugetlb", "thp", "plain"
  std::optional<double> entries;
  std::vector<std::pair<std::string, double>> shard_ring_items;  // (shard, items)
  std::optional<double> checkpoints_written;
};

// Fills the status of a reachable server from its metrics. workers_expected
// is taken from `num_workers` when non-zero, else from the number of
// worker_step series.
ServerStatus status_from_metrics(std::string name, std::string metrics_address,
                                 const Exposition& metrics, std::uint32_t num_workers);

// Text of `emberctl status` for all servers, one block each.
std::string format_status(const std::vector<ServerStatus>& servers);

// Host hugepage facts from /proc/meminfo text (HugePages_Total, _Free,
// Hugepagesize): "hugepages on this host: 256 reserved (2 MiB), 128 free".
// nullopt when the fields are missing.
std::optional<std::string> format_host_hugepages(std::string_view meminfo);

// Text of `emberctl stats`: traffic, batching, pool, shards and request
// latency (count, mean, p50, p90, p99 per type), then every other Ember
// metric by name. When `previous` is given (an earlier scrape `interval_s`
// seconds before), counters and byte totals also show per-second rates.
std::string format_stats(const Exposition& now, const Exposition* previous, double interval_s);

// "12.0 MiB", "512 B": bytes as the log prints them.
std::string human_bytes(double bytes);

}  // namespace ember::emberctl
