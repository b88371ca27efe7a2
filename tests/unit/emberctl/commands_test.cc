// emberctl's network-free decisions: endpoints from a config, checkpoint
// answers, status/stats text from metrics, host hugepages, average message
// size, config summary and recording summary.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/config/config.h"
#include "common/metrics/metrics.h"
#include "common/record/recording.h"
#include "tools/emberctl/commands.h"
#include "tools/emberctl/report.h"

namespace ember::emberctl {
namespace {

const std::vector<double> kBounds = {10, 100};

config::Config parse(const std::string& text) {
  auto c = config::parse_config(text, "t.toml");
  EXPECT_TRUE(c) << c.error().to_string();
  return *c;
}

TEST(MetricsTargets, EachServerHostWithTheMetricsPort) {
  auto c = parse(
      "[cluster]\nservers = [\"10.0.0.1:7070\", \"10.0.0.2:7070\"]\n"
      "[server]\nmetrics_listen = \"0.0.0.0:9464\"\n");
  auto t = metrics_targets(c, "t.toml");
  ASSERT_TRUE(t) << t.error().to_string();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].name, "server 0");
  EXPECT_EQ((*t)[0].metrics_address, "10.0.0.1:9464");
  EXPECT_EQ((*t)[1].metrics_address, "10.0.0.2:9464");
}

TEST(MetricsTargets, OneServerWithASpecificMetricsHostUsesIt) {
  auto c = parse("[server]\nmetrics_listen = \"127.0.0.2:9100\"\n");
  auto t = metrics_targets(c, "t.toml");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].metrics_address, "127.0.0.2:9100");
}

TEST(MetricsTargets, RefusesMetricsOffOrPortZero) {
  auto r = metrics_targets(parse(""), "job.toml");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("job.toml: server.metrics_listen is off"), std::string::npos);
  EXPECT_NE(r.error().message().find("--metrics"), std::string::npos);
  r = metrics_targets(parse("[server]\nmetrics_listen = \"127.0.0.1:0\"\n"), "job.toml");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("port 0"), std::string::npos);
}

// Two servers on one host with one metrics port: both targets would read
// whichever process listens there (a break-it run saw a server that was
// not running reported "up"). Refused, naming both.
TEST(MetricsTargets, RefusesServersThatWouldShareOneEndpoint) {
  for (const char* listen : {"127.0.0.1:19467", "0.0.0.0:19467"}) {
    SCOPED_TRACE(listen);
    auto r = metrics_targets(parse(fmt::format("[cluster]\nservers = [\"127.0.0.1:17100\", "
                                               "\"127.0.0.1:17101\"]\n[server]\nmetrics_listen = "
                                               "\"{}\"\n",
                                               listen)),
                             "two.toml");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kConfig);
    EXPECT_NE(r.error().message().find("servers 0 and 1 would both have their metrics endpoint at "
                                       "127.0.0.1:19467"),
              std::string::npos)
        << r.error().message();
    EXPECT_NE(r.error().message().find("--metrics"), std::string::npos);
  }
}

TEST(CheckpointAnswer, StatusCodesMapToOutcomes) {
  auto a = interpret_checkpoint_answer(200, "sequence 4\n");
  EXPECT_EQ(a.outcome, CheckpointAnswer::kWritten);
  EXPECT_EQ(a.text, "checkpoint written: sequence 4");
  for (int s : {404, 405, 501}) {
    a = interpret_checkpoint_answer(s, "not found");
    EXPECT_EQ(a.outcome, CheckpointAnswer::kUnsupported);
    EXPECT_NE(a.text.find("does not take checkpoint requests"), std::string::npos);
  }
  // Checkpoints off on that server: exit 3 (not supported), saying what to set.
  a = interpret_checkpoint_answer(409, "config: checkpoints are off: set server.checkpoint_dir\n");
  EXPECT_EQ(a.outcome, CheckpointAnswer::kUnsupported);
  EXPECT_NE(a.text.find("writes no checkpoints (HTTP 409)"), std::string::npos) << a.text;
  EXPECT_NE(a.text.find("server.checkpoint_dir"), std::string::npos) << a.text;
  a = interpret_checkpoint_answer(500, "kConfig: checkpoints are off");
  EXPECT_EQ(a.outcome, CheckpointAnswer::kFailed);
  EXPECT_NE(a.text.find("HTTP 500: kConfig: checkpoints are off"), std::string::npos);
}

Exposition server_metrics() {
  metrics::Registry reg;
  reg.gauge("ember_server_workers_connected", "w").set(2);
  reg.gauge("ember_server_worker_step", "s", {{"rank", "1"}}).set(17);
  reg.gauge("ember_server_worker_step", "s", {{"rank", "0"}}).set(19);
  reg.gauge("ember_server_worker_step", "s", {{"rank", "10"}}).set(18);
  reg.gauge("ember_pool_bytes_in_use", "p").set(64.0 * 1024 * 1024);
  reg.gauge("ember_pool_region_bytes", "p").set(256.0 * 1024 * 1024);
  reg.gauge("ember_server_entries", "e").set(42);
  reg.gauge("ember_server_shard_ring_items", "r", {{"shard", "0"}}).set(3);
  reg.counter("ember_server_checkpoints_written_total", "c").inc(5);
  reg.counter("ember_server_bytes_received_total", "b").inc(1000 * 4096);
  reg.counter("ember_server_messages_received_total", "m").inc(1000);
  reg.counter("ember_server_frames_received_total", "f").inc(250);
  reg.gauge("ember_server_batch_fill_ratio", "f").set(0.5);
  auto& h = reg.histogram("ember_server_request_latency_us", "l", kBounds, {{"type", "push"}});
  h.observe(5);
  h.observe(50);
  reg.counter("ember_other_total", "o").inc(9);
  auto e = parse_exposition(reg.render());
  EXPECT_TRUE(e);
  return *e;
}

TEST(Status, SummarisesAServerFromItsMetrics) {
  const ServerStatus s = status_from_metrics("server 0", "127.0.0.1:9464", server_metrics(), 4);
  EXPECT_TRUE(s.up);
  EXPECT_EQ(s.workers_connected, 2.0);
  EXPECT_EQ(s.workers_expected, 4u);
  ASSERT_EQ(s.worker_steps.size(), 3u);
  EXPECT_EQ(s.worker_steps[0], (std::pair<std::uint32_t, double>{0, 19}));
  EXPECT_EQ(s.worker_steps[2], (std::pair<std::uint32_t, double>{10, 18}));  // numeric order
  const std::string text = format_status({s});
  EXPECT_NE(text.find("server 0  metrics 127.0.0.1:9464  up"), std::string::npos) << text;
  EXPECT_NE(text.find("workers connected   2 of 4"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 0: 19, rank 1: 17, rank 10: 18  (spread 2)"), std::string::npos) << text;
  EXPECT_NE(text.find("64.0 MiB of 256.0 MiB in use (25.0%)"), std::string::npos) << text;
  EXPECT_NE(text.find("pool backing        n/a"), std::string::npos) << text;
  EXPECT_NE(text.find("checkpoints written 5"), std::string::npos) << text;
}

TEST(Status, ShowsBackingWhenExportedAndDownServers) {
  auto e = parse_exposition("ember_pool_backing_info{backing=\"hugetlb\"} 1\n");
  ASSERT_TRUE(e);
  const ServerStatus s = status_from_metrics("server 1", "h:1", *e, 0);
  EXPECT_EQ(s.pool_backing, "hugetlb");
  EXPECT_EQ(s.workers_expected, 0u);
  ServerStatus down;
  down.name = "server 2";
  down.metrics_address = "h:2";
  down.error = "connect refused";
  const std::string text = format_status({s, down});
  EXPECT_NE(text.find("pool backing        hugetlb"), std::string::npos) << text;
  EXPECT_NE(text.find("workers connected   n/a\n"), std::string::npos) << text;
  EXPECT_NE(text.find("server 2  metrics h:2  DOWN: connect refused"), std::string::npos) << text;
}

TEST(Stats, FormatsSectionsAndRates) {
  const Exposition now = server_metrics();
  std::string text = format_stats(now, nullptr, 0);
  EXPECT_NE(text.find("average message       4.0 KiB"), std::string::npos) << text;
  EXPECT_NE(text.find("messages per frame    4.00"), std::string::npos) << text;
  EXPECT_NE(text.find("batch fill            50.0% of batch_threshold"), std::string::npos) << text;
  EXPECT_NE(text.find("{type=\"push\"}         count 2  mean 27.5  p50 10.0  p90 82.0  p99 98.2"), std::string::npos) << text;
  EXPECT_NE(text.find("checkpoints written   5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("other\n  ember_other_total 9\n"), std::string::npos) << text;
  auto before = parse_exposition(
      "ember_server_bytes_received_total 0\nember_server_messages_received_total 600\n");
  ASSERT_TRUE(before);
  text = format_stats(now, &*before, 2.0);
  EXPECT_NE(text.find("bytes received        3.9 MiB  (2.0 MiB/s)"), std::string::npos) << text;
  EXPECT_NE(text.find("messages received     1000  (200/s)"), std::string::npos) << text;
}

// A gauge's change is no rate, and the latencies are those of the interval.
TEST(Stats, RatesOfCountersOnlyAndLatencyOverTheInterval) {
  metrics::Registry reg;
  reg.gauge("ember_pool_region_bytes", "p").set(16.0 * 1024 * 1024);
  reg.gauge("ember_server_workers_connected", "w").set(2);
  auto& h = reg.histogram("ember_server_request_latency_us", "l", kBounds, {{"type", "push"}});
  for (int i = 0; i < 100; ++i) h.observe(5);  // before the interval: fast
  auto before = parse_exposition(reg.render());
  ASSERT_TRUE(before);
  for (int i = 0; i < 10; ++i) h.observe(50);  // during it: slower
  auto now = parse_exposition(reg.render());
  ASSERT_TRUE(now);
  const std::string text = format_stats(*now, &*before, 1.0);
  EXPECT_NE(text.find("pool region           16.0 MiB\n"), std::string::npos) << text;
  EXPECT_NE(text.find("workers connected     2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("over the interval"), std::string::npos) << text;
  EXPECT_NE(text.find("{type=\"push\"}         count 10  mean 50.0"), std::string::npos) << text;
  // Without a previous scrape: since start.
  const std::string once = format_stats(*now, nullptr, 0);
  EXPECT_NE(once.find("since start"), std::string::npos) << once;
  EXPECT_NE(once.find("count 110"), std::string::npos) << once;
}

TEST(HostHugepages, ReadsMeminfo) {
  const auto line = format_host_hugepages(
      "MemTotal: 1 kB\nHugePages_Total:     256\nHugePages_Free:      128\nHugepagesize:       2048 kB\n");
  ASSERT_TRUE(line);
  EXPECT_EQ(*line, "hugepages on this host: 256 reserved (2.0 MiB each), 128 free");
  EXPECT_NE(format_host_hugepages("HugePages_Total: 0\nHugePages_Free: 0\nHugepagesize: 2048 kB\n")
                ->find("none reserved"),
            std::string::npos);
  EXPECT_FALSE(format_host_hugepages("MemTotal: 5 kB\n"));
}

TEST(AverageMessage, BytesOverMessages) {
  auto avg = average_message_bytes(server_metrics());
  ASSERT_TRUE(avg);
  EXPECT_EQ(*avg, 4096u);
  auto none = parse_exposition("ember_server_bytes_received_total 0\nember_server_messages_received_total 0\n");
  auto r = average_message_bytes(*none);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("no message yet"), std::string::npos);
  auto missing = parse_exposition("x 1\n");
  EXPECT_FALSE(average_message_bytes(*missing));
}

TEST(ConfigSummary, NamesTheKnobsAnOperatorChecks) {
  auto c = parse(
      "[communication]\nchannels = 4\nbatch_threshold = \"8KB\"\nprealloc_pages = 64\n"
      "payload_checksum = true\n"
      "[cluster]\nservers = [\"a:1\", \"b:2\"]\nnum_workers = 3\n"
      "[server]\ncheckpoint_dir = \"/var/lib/ember\"\nshards = 2\npartition_bytes = \"1MB\"\n");
  const std::string s = config_summary(c, "job.toml");
  EXPECT_NE(s.find("job.toml: valid"), std::string::npos);
  EXPECT_NE(s.find("(zero_copy writev, payload_checksum on, pool_backing auto)"), std::string::npos) << s;
  EXPECT_NE(s.find("channels            4\n"), std::string::npos) << s;
  EXPECT_NE(s.find("batch_threshold 8 KiB"), std::string::npos) << s;
  EXPECT_NE(s.find("64 pages of 2 MiB (128 MiB)"), std::string::npos) << s;
  EXPECT_NE(s.find("2 server(s): a:1, b:2; 3 worker(s)"), std::string::npos) << s;
  EXPECT_NE(s.find("checkpoints /var/lib/ember, metrics off"), std::string::npos) << s;
  EXPECT_NE(s.find("shards              2 per server, partition_bytes 1 MiB\n"), std::string::npos) << s;
}

TEST(RecordingSummary, PeakOccupancyMedianSizeAndHotRanks) {
  auto rec = record::parse_recording(
      "ember-record 1\nsource worker 0\nstart_unix_ns 1\nchannels 2\nranks 3\nsample_interval_ns 1000\n"
      "data\n"
      "c 0 0 0 0 0 0\nc 10 0 2 7 200 700\nc 20 0 7 7 700 700\nc 20 1 0 1 0 5000\n"
      "r 20 0 700 7\nr 20 1 10 1\nr 20 2 20 2\n"
      "h 0 96 104 7\nh 1 4096 5120 1\nend 1000000000 6 0\n",
      "x");
  ASSERT_TRUE(rec) << rec.error().to_string();
  const std::string s = recording_summary(*rec);
  EXPECT_NE(s.find("recording of worker 0: 2 channel(s), 3 rank(s), 1.000 s"), std::string::npos) << s;
  EXPECT_NE(s.find("        0         7       700 B            5  96..103 B"), std::string::npos) << s;
  EXPECT_NE(s.find("     0            7       700 B  hot (over twice the mean)"), std::string::npos) << s;
  EXPECT_EQ(s.find("     1            1        10 B  hot"), std::string::npos) << s;
}

}  // namespace
}  // namespace ember::emberctl
