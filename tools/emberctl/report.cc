// Status and stats text from parsed metrics; see report.h.
#include "tools/emberctl/report.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include <fmt/format.h>

namespace ember::emberctl {

namespace {

std::string or_na(const std::optional<double>& v, int decimals = 0) {
  if (!v) return "n/a";
  return fmt::format("{:.{}f}", *v, decimals);
}

std::optional<std::uint64_t> parse_index(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

// Families printed in their own sections of `stats`; the rest go last.
const std::set<std::string>& known_families() {
  static const std::set<std::string> k = {
      "ember_server_bytes_received_total", "ember_server_bytes_sent_total", "ember_server_messages_received_total",
      "ember_server_messages_sent_total", "ember_server_frames_received_total", "ember_server_frames_sent_total",
      "ember_server_batch_fill_ratio", "ember_pool_bytes_in_use", "ember_pool_region_bytes",
      "ember_server_entries", "ember_server_shard_ring_items", "ember_server_workers_connected",
      "ember_server_worker_step", "ember_server_request_latency_us",
      "ember_server_checkpoints_written_total"};
  return k;
}

std::string family_of(const std::string& sample_name) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s(suffix);
    if (sample_name.size() > s.size() && sample_name.ends_with(s)) {
      const std::string base = sample_name.substr(0, sample_name.size() - s.size());
      if (known_families().count(base) != 0) return base;
    }
  }
  return sample_name;
}

std::string labels_text(const std::map<std::string, std::string>& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    out += fmt::format("{}{}=\"{}\"", first ? "" : ",", k, v);
    first = false;
  }
  return out + "}";
}

}  // namespace

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", v);
  return fmt::format("{:.1f} {}", v, units[u]);
}

ServerStatus status_from_metrics(std::string name, std::string metrics_address,
                                 const Exposition& m, std::uint32_t num_workers) {
  ServerStatus s;
  s.name = std::move(name);
  s.metrics_address = std::move(metrics_address);
  s.up = true;
  s.workers_connected = m.value("ember_server_workers_connected");
  for (const Sample* x : m.all("ember_server_worker_step")) {
    auto it = x->labels.find("rank");
    if (it == x->labels.end()) continue;
    if (auto r = parse_index(it->second)) s.worker_steps.emplace_back(static_cast<std::uint32_t>(*r), x->value);
  }
  std::sort(s.worker_steps.begin(), s.worker_steps.end());
  s.workers_expected = num_workers != 0 ? num_workers : static_cast<std::uint32_t>(s.worker_steps.size());
  s.pool_in_use_bytes = m.value("ember_pool_bytes_in_use");
  s.pool_region_bytes = m.value("ember_pool_region_bytes");
  for (const Sample* x : m.all("ember_pool_backing_info")) {
    auto it = x->labels.find("backing");
    if (it != x->labels.end() && x->value != 0) s.pool_backing = it->second;
  }
  s.entries = m.value("ember_server_entries");
  for (const Sample* x : m.all("ember_server_shard_ring_items")) {
    auto it = x->labels.find("shard");
    s.shard_ring_items.emplace_back(it == x->labels.end() ? "?" : it->second, x->value);
  }
  s.checkpoints_written = m.value("ember_server_checkpoints_written_total");
  return s;
}

std::string format_status(const std::vector<ServerStatus>& servers) {
  std::string out;
  for (const ServerStatus& s : servers) {
    if (!s.up) {
      out += fmt::format("{}  metrics {}  DOWN: {}\n", s.name, s.metrics_address, s.error);
      continue;
    }
    out += fmt::format("{}  metrics {}  up\n", s.name, s.metrics_address);
    std::string expected = s.workers_expected != 0 ? fmt::format(" of {}", s.workers_expected) : "";
    out += fmt::format("  workers connected   {}{}\n", or_na(s.workers_connected), expected);
    if (s.worker_steps.empty()) {
      out += "  step per worker     n/a\n";
    } else {
      std::string steps;
      for (const auto& [rank, step] : s.worker_steps) {
        steps += fmt::format("{}rank {}: {:.0f}", steps.empty() ? "" : ", ", rank, step);
      }
      const auto [lo, hi] = std::minmax_element(
          s.worker_steps.begin(), s.worker_steps.end(),
          [](const auto& a, const auto& b) { return a.second < b.second; });
      out += fmt::format("  step per worker     {}  (spread {:.0f})\n", steps, hi->second - lo->second);
    }
    if (s.pool_in_use_bytes && s.pool_region_bytes && *s.pool_region_bytes > 0) {
      out += fmt::format("  pool                {} of {} in use ({:.1f}%)\n",
                         human_bytes(*s.pool_in_use_bytes), human_bytes(*s.pool_region_bytes),
                         100.0 * *s.pool_in_use_bytes / *s.pool_region_bytes);
    } else {
      out += "  pool                n/a\n";
    }
    out += fmt::format("  pool backing        {}\n",
                       s.pool_backing ? *s.pool_backing
                                      : std::string("n/a (not exported; the server log line "
                                                    "\"page pool '...': ... backed by ...\" says)"));
    out += fmt::format("  tensor chunks       {}\n", or_na(s.entries));
    if (!s.shard_ring_items.empty()) {
      std::string rings;
      for (const auto& [shard, items] : s.shard_ring_items) {
        rings += fmt::format("{}shard {}: {:.0f}", rings.empty() ? "" : ", ", shard, items);
      }
      out += fmt::format("  queued in shards    {}\n", rings);
    }
    out += fmt::format("  checkpoints written {}\n", or_na(s.checkpoints_written));
  }
  return out;
}

std::optional<std::string> format_host_hugepages(std::string_view meminfo) {
  auto field = [&](std::string_view key) -> std::optional<std::uint64_t> {
    const std::size_t at = meminfo.find(key);
    if (at == std::string_view::npos) return std::nullopt;
    std::size_t i = at + key.size();
    while (i < meminfo.size() && (meminfo[i] == ' ' || meminfo[i] == ':')) ++i;
    std::uint64_t v = 0;
    bool any = false;
    while (i < meminfo.size() && meminfo[i] >= '0' && meminfo[i] <= '9') {
      v = v * 10 + static_cast<std::uint64_t>(meminfo[i++] - '0');
      any = true;
    }
    if (!any) return std::nullopt;
    return v;
  };
  const auto total = field("HugePages_Total");
  const auto free = field("HugePages_Free");
  const auto size_kb = field("Hugepagesize");
  if (!total || !free || !size_kb) return std::nullopt;
  return fmt::format("hugepages on this host: {} reserved ({} each), {} free{}", *total,
                     human_bytes(static_cast<double>(*size_kb) * 1024), *free,
                     *total == 0 ? " (none reserved: pools fall back to THP or 4 KiB pages; see "
                                   "deploy/systemd/reserve-hugepages.sh)"
                                 : "");
}

std::string format_stats(const Exposition& now, const Exposition* previous, double interval_s) {
  std::string out;
  const bool rates = previous != nullptr && interval_s > 0;
  // Rates of counters only (Prometheus: a counter's name ends in _total);
  // a gauge's difference is not a rate.
  auto rate = [&](const std::string& name) -> std::string {
    if (!rates || !name.ends_with("_total")) return "";
    const auto a = previous->value(name);
    const auto b = now.value(name);
    if (!a || !b) return "";
    return fmt::format("  ({}/s)", human_bytes((*b - *a) / interval_s));
  };
  auto count_rate = [&](const std::string& name) -> std::string {
    if (!rates || !name.ends_with("_total")) return "";
    const auto a = previous->value(name);
    const auto b = now.value(name);
    if (!a || !b) return "";
    return fmt::format("  ({:.0f}/s)", (*b - *a) / interval_s);
  };
  auto bytes_line = [&](const char* label, const std::string& name) {
    const auto v = now.value(name);
    out += fmt::format("  {:<22}{}{}\n", label, v ? human_bytes(*v) : std::string("n/a"), rate(name));
  };
  auto count_line = [&](const char* label, const std::string& name) {
    out += fmt::format("  {:<22}{}{}\n", label, or_na(now.value(name)), count_rate(name));
  };
  out += "traffic\n";
  bytes_line("bytes received", "ember_server_bytes_received_total");
  bytes_line("bytes sent", "ember_server_bytes_sent_total");
  count_line("messages received", "ember_server_messages_received_total");
  count_line("messages sent", "ember_server_messages_sent_total");
  count_line("frames received", "ember_server_frames_received_total");
  count_line("frames sent", "ember_server_frames_sent_total");
  const auto msgs = now.value("ember_server_messages_received_total");
  const auto bytes = now.value("ember_server_bytes_received_total");
  const auto frames = now.value("ember_server_frames_received_total");
  out += "batching\n";
  out += fmt::format("  {:<22}{}\n", "average message",
                     msgs && bytes && *msgs > 0 ? human_bytes(*bytes / *msgs) : std::string("n/a"));
  out += fmt::format("  {:<22}{}\n", "messages per frame",
                     msgs && frames && *frames > 0 ? fmt::format("{:.2f}", *msgs / *frames)
                                                   : std::string("n/a"));
  const auto fill = now.value("ember_server_batch_fill_ratio");
  out += fmt::format("  {:<22}{}\n", "batch fill",
                     fill ? fmt::format("{:.1f}% of batch_threshold", 100.0 * *fill) : std::string("n/a"));
  out += "pool and shards\n";
  bytes_line("pool in use", "ember_pool_bytes_in_use");
  bytes_line("pool region", "ember_pool_region_bytes");
  count_line("tensor chunks", "ember_server_entries");
  for (const Sample* s : now.all("ember_server_shard_ring_items")) {
    out += fmt::format("  {:<22}{:.0f}\n", fmt::format("queued {}", labels_text(s->labels)), s->value);
  }
  count_line("workers connected", "ember_server_workers_connected");
  for (const Sample* s : now.all("ember_server_worker_step")) {
    out += fmt::format("  {:<22}{:.0f}\n", fmt::format("step {}", labels_text(s->labels)), s->value);
  }
  count_line("checkpoints written", "ember_server_checkpoints_written_total");
  out += rates ? "request latency (receipt to shard) over the interval, microseconds\n"
               : "request latency (receipt to shard) since start, microseconds\n";
  auto hs = histograms(now, "ember_server_request_latency_us");
  if (rates) {
    // Over the interval: the previous scrape's counts taken off each
    // series with the same labels and bounds (a restarted server's lower
    // counts leave the series as it is).
    const auto before = histograms(*previous, "ember_server_request_latency_us");
    for (Histogram& h : hs) {
      const auto it = std::find_if(before.begin(), before.end(),
                                   [&](const Histogram& b) { return b.labels == h.labels; });
      if (it == before.end() || it->buckets.size() != h.buckets.size() || it->count > h.count) continue;
      bool same_series = true;  // same bounds, and no bucket went down (a restart)
      for (std::size_t i = 0; i < h.buckets.size(); ++i) {
        same_series = same_series && h.buckets[i].first == it->buckets[i].first &&
                      h.buckets[i].second >= it->buckets[i].second;
      }
      if (!same_series) continue;
      for (std::size_t i = 0; i < h.buckets.size(); ++i) h.buckets[i].second -= it->buckets[i].second;
      h.count -= it->count;
      h.sum -= it->sum;
    }
  }
  if (hs.empty()) out += "  n/a\n";
  for (const Histogram& h : hs) {
    auto q = [&](double p) {
      const auto v = h.quantile(p);
      return v ? fmt::format("{:.1f}", *v) : std::string("-");
    };
    const auto mean = h.mean();
    out += fmt::format("  {:<22}count {:.0f}  mean {}  p50 {}  p90 {}  p99 {}\n",
                       labels_text(h.labels), h.count, mean ? fmt::format("{:.1f}", *mean) : "-",
                       q(0.5), q(0.9), q(0.99));
  }
  std::string other;
  for (const Sample& s : now.samples) {
    if (known_families().count(family_of(s.name)) != 0) continue;
    if (s.name.ends_with("_bucket")) continue;  // other histograms: show _sum and _count only
    other += fmt::format("  {}{} {}{}\n", s.name, labels_text(s.labels), s.value,
                         s.labels.empty() ? count_rate(s.name) : "");
  }
  if (!other.empty()) out += "other\n" + other;
  return out;
}

}  // namespace ember::emberctl
