// Operations through the real ember-server and a real worker on 127.0.0.1:
// communication pattern recording on both sides (the files parse, hold the
// traffic of the channel used and the bytes of the rank, and
// scripts/plot_channels.py renders them), and the metrics emberctl status
// reads (stored tensor chunks, the pool's backing).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <sys/wait.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/config/config.h"
#include "common/placement/placement.h"
#include "common/record/recording.h"
#include "tests/integration/server/harness.h"
#include "tools/emberctl/prometheus.h"
#include "tools/emberctl/report.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

namespace fs = std::filesystem;

constexpr std::uint32_t kChannels = 4;
constexpr std::uint64_t kElements = 16;

// The first key whose (single) chunk travels on `channel`.
Key key_on_channel(std::uint32_t channel, std::uint64_t partition_bytes) {
  for (Key k = 1;; ++k) {
    const auto plan = placement::chunk_plan(k, kElements * sizeof(float), sizeof(float),
                                            partition_bytes, 1, kChannels);
    if (plan.size() == 1 && plan[0].channel == channel) return k;
  }
}

// Server `pid` exits after SIGTERM (drains, closes the recording).
void stop_server(ServerProcess& server) {
  server.process().signal(SIGTERM);
  const auto status = server.process().wait_exit(20s);
  ASSERT_TRUE(status) << "ember-server did not exit after SIGTERM; log:\n" << server.log();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server.log();
}

bool is_png(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  char magic[8] = {};
  in.read(magic, sizeof magic);
  return in.gcount() == 8 && std::string(magic + 1, 3) == "PNG" && fs::file_size(p) > 1000;
}

TEST(Recording, ServerAndWorkerRecordTheChannelUsedAndTheRanksBytes) {
  TempDir dir;
  ClusterSpec spec;
  const fs::path base = dir / "pattern.rec";
  ServerProcess server(dir, spec, 0,
                       {"--set", fmt::format("communication.channels={}", kChannels), "--set",
                        "communication.record_pattern=true", "--set",
                        "communication.record_path=" + base.string()});
  ASSERT_TRUE(server.ok());
  EXPECT_NE(server.log().find("recording the communication pattern to '" + base.string() + ".server0'"),
            std::string::npos)
      << server.log();

  config::Config cfg = worker_config(spec, {server.address()}, 0);
  cfg.communication.num_channels = kChannels;
  cfg.communication.record_pattern = true;
  cfg.communication.record_path = base.string();
  const std::uint32_t used = 2;
  const Key key = key_on_channel(used, cfg.server.partition_bytes);
  constexpr int kSteps = 5;
  constexpr int kPipelined = 3;
  {
    auto w = Worker::create(cfg);
    ASSERT_TRUE(w) << w.error().to_string();
    const std::uint64_t shape[] = {kElements};
    std::vector<float> params(kElements, 1.0f);
    ASSERT_TRUE((*w)->init(key, shape, params).wait());
    std::vector<float> grad(kElements, 0.5f);
    for (int s = 0; s < kSteps; ++s) {
      auto p = (*w)->push(key, grad).wait();
      ASSERT_TRUE(p) << p.error().to_string();
      auto q = (*w)->pull(key, params).wait();
      ASSERT_TRUE(q) << q.error().to_string();
    }
    {
      Pipeline pipe = (*w)->pipeline();
      for (int i = 0; i < kPipelined; ++i) pipe.enqueue(key, grad);
      auto done = pipe.wait();
      ASSERT_TRUE(done) << done.error().to_string();
    }
    ASSERT_TRUE((*w)->barrier().wait());
  }  // the worker closes its recording
  stop_server(server);

  // init + kSteps pushes and pulls + the pipelined pushes on the key's
  // channel; the barrier on channel 0; nothing else.
  const std::uint64_t on_used = 1 + 2 * kSteps + kPipelined;
  auto check = [&](const fs::path& file, const std::string& source) -> record::Totals {
    auto rec = record::load_recording(file);
    EXPECT_TRUE(rec) << file << ": " << (rec ? "" : rec.error().to_string());
    if (!rec) return {};
    EXPECT_EQ(rec->source, source);
    EXPECT_TRUE(rec->complete) << file << " has no end line";
    EXPECT_EQ(rec->num_channels, kChannels);
    EXPECT_EQ(rec->num_ranks, 1u);
    EXPECT_EQ(rec->out_of_range, 0u);
    const bool sampled = std::any_of(rec->channel_samples.begin(), rec->channel_samples.end(),
                                     [&](const record::ChannelSample& c) {
                                       return c.channel == used && c.tail_msgs > 0;
                                     });
    EXPECT_TRUE(sampled) << file << ": no non-zero sample of channel " << used;
    std::uint64_t histogram_messages = 0;
    for (const auto& b : rec->size_buckets) {
      if (b.channel == used) histogram_messages += b.count;
    }
    EXPECT_EQ(histogram_messages, on_used) << file;
    const record::Totals t = record::final_totals(*rec);
    std::uint64_t channel_bytes = 0;
    for (std::uint32_t c = 0; c < kChannels; ++c) {
      const auto& ch = t.channels[c];
      const std::uint64_t expect = c == used ? on_used : c == 0 ? 1 : 0;
      EXPECT_EQ(ch.tail_msgs, expect) << file << " channel " << c;
      EXPECT_EQ(ch.head_msgs, ch.tail_msgs) << file << " channel " << c << ": all taken out";
      EXPECT_EQ(ch.head_bytes, ch.tail_bytes) << file << " channel " << c;
      channel_bytes += ch.tail_bytes;
    }
    // Every push carried kElements floats, as did rank 0's init.
    EXPECT_GT(t.ranks[0].bytes_sent, (1 + kSteps + kPipelined) * kElements * sizeof(float));
    EXPECT_EQ(t.ranks[0].bytes_sent, channel_bytes) << "one rank: its bytes are all the channels'";
    EXPECT_EQ(t.ranks[0].messages_sent, on_used + 1);
    return t;
  };
  const fs::path worker_file = base.string() + ".worker0";
  const fs::path server_file = base.string() + ".server0";
  const record::Totals wt = check(worker_file, "worker 0");
  const record::Totals st = check(server_file, "server 0");
  if (!wt.ranks.empty() && !st.ranks.empty()) {
    EXPECT_EQ(wt.ranks[0].bytes_sent, st.ranks[0].bytes_sent)
        << "the server counts what the worker sent, byte for byte";
  }
  EXPECT_FALSE(fs::exists(base)) << "record_path itself is only a prefix";

  // scripts/plot_channels.py renders the server's recording.
  const std::string python = "/usr/bin/python3";
  if (!fs::exists(python)) GTEST_SKIP() << python << " is missing (Debian python3-matplotlib)";
  const fs::path out = dir / "png";
  Process plot(python,
               {std::string(EMBER_SOURCE_DIR) + "/scripts/plot_channels.py", server_file.string(),
                "--out", out.string(), "--prefix", "run-"},
               dir / "plot.err");
  EXPECT_TRUE(plot.wait_line("plot_channels: wrote", 60s)) << read_file(dir / "plot.err");
  const auto status = plot.wait_exit(60s);
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << read_file(dir / "plot.err");
  for (const char* name : {"run-channels.png", "run-sizes.png", "run-ranks.png"}) {
    EXPECT_TRUE(is_png(out / name)) << name;
  }
}

TEST(Recording, OffByDefaultWritesNothing) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0, {"--set", "communication.record_path=" + (dir / "r").string()});
  ASSERT_TRUE(server.ok());
  {
    auto w = Worker::create(worker_config(spec, {server.address()}, 0));
    ASSERT_TRUE(w) << w.error().to_string();
    const std::uint64_t shape[] = {4};
    const std::vector<float> v(4, 1.0f);
    ASSERT_TRUE((*w)->init(1, shape, v).wait());
  }
  stop_server(server);
  EXPECT_FALSE(fs::exists(dir / "r.server0"));
  EXPECT_FALSE(fs::exists(dir / "r.worker0"));
  EXPECT_EQ(server.log().find("recording the communication pattern"), std::string::npos);
}

TEST(Recording, AnUncreatableFileFailsStartNamingIt) {
  TempDir dir;
  ClusterSpec spec;
  const std::string base = (dir / "no-such-dir" / "r").string();

  config::Config cfg = worker_config(spec, {"127.0.0.1:1"}, 0);
  cfg.communication.record_pattern = true;
  cfg.communication.record_path = base;
  auto w = Worker::create(cfg);
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code(), ErrorCode::kIo);
  EXPECT_NE(w.error().to_string().find(base + ".worker0"), std::string::npos) << w.error().to_string();
  EXPECT_NE(w.error().to_string().find("record_path"), std::string::npos) << w.error().to_string();

  const fs::path config = dir / "server.toml";
  write_file(config, cluster_toml(spec, {"127.0.0.1:1"}));
  Process server(server_binary(),
                 {"--config", config.string(), "--listen", "127.0.0.1:0", "--set",
                  "communication.record_pattern=true", "--set", "communication.record_path=" + base},
                 dir / "server.log");
  const auto status = server.wait_exit(20s);
  ASSERT_TRUE(status) << "ember-server kept running";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
  const std::string log = read_file(dir / "server.log");
  EXPECT_NE(log.find("cannot create '" + base + ".server0'"), std::string::npos) << log;
}

// A second server on an address (data or metrics) the first one holds exits
// at once, naming the address, the setting and what to do.
TEST(ServerStart, AnAddressInUseIsNamedWithWhatToDo) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess first(dir, spec, 0);
  ASSERT_TRUE(first.ok());
  const fs::path config = dir / "second.toml";
  write_file(config, cluster_toml(spec, {"127.0.0.1:1"}));
  struct Case {
    std::vector<std::string> args;
    std::string want, advice;
  };
  const std::vector<Case> cases{
      {{"--listen", first.address()},
       "[server] listen: " + first.address() + " is already in use",
       "another address with --listen HOST:PORT"},
      {{"--listen", "127.0.0.1:0", "--set", "server.metrics_listen=" + first.metrics_address()},
       "[server] metrics_listen: " + first.metrics_address() + " is already in use",
       "set metrics_listen to another port"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::string> args{"--config", config.string()};
    args.insert(args.end(), cases[i].args.begin(), cases[i].args.end());
    const fs::path log_path = dir / fmt::format("second{}.log", i);
    Process second(server_binary(), args, log_path);
    const auto status = second.wait_exit(20s);
    ASSERT_TRUE(status) << "the second ember-server kept running: " << cases[i].want;
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
    const std::string log = read_file(log_path);
    EXPECT_NE(log.find(cases[i].want), std::string::npos) << log;
    EXPECT_NE(log.find(cases[i].advice), std::string::npos) << log;
    EXPECT_EQ(log.find("cannot listen on " + first.address() + ": cannot listen"), std::string::npos) << log;
    // A server that never started does not report shutting down.
    EXPECT_EQ(log.find("shutting down"), std::string::npos) << log;
    EXPECT_EQ(log.find("[server] stopped"), std::string::npos) << log;
  }
  // The first one is unharmed.
  auto w = Worker::create(worker_config(spec, {first.address()}, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  const std::uint64_t shape[] = {4};
  EXPECT_TRUE((*w)->init(1, shape, std::vector<float>(4, 1.0f)).wait());
}

// Scrapes `address` until `name` reads `want` or 10 s pass; the last value.
std::optional<double> scrape_until(const std::string& address, const std::string& name, double want,
                                   emberctl::Exposition* last) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  std::optional<double> v;
  do {
    const std::string response = http_get(address, "/metrics");
    const auto body = response.find("\r\n\r\n");
    if (body == std::string::npos) continue;
    auto e = emberctl::parse_exposition(std::string_view(response).substr(body + 4));
    EXPECT_TRUE(e) << (e ? "" : e.error().to_string());
    if (!e) break;
    v = e->value(name);
    *last = std::move(*e);
    if (v && *v == want) break;
  } while (std::chrono::steady_clock::now() < deadline);
  return v;
}

TEST(ServerMetrics, EntriesCountStoredChunksAndBackingIsExported) {
  TempDir dir;
  ClusterSpec spec;
  spec.shards = 2;
  spec.partition_bytes = "64KB";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  emberctl::Exposition metrics;
  EXPECT_EQ(scrape_until(server.metrics_address(), "ember_server_entries", 0, &metrics), 0.0);

  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  // 1 + 3 (160000 bytes in 64 KiB chunks) + 1 chunks.
  const std::vector<std::pair<Key, std::uint64_t>> tensors{{11, 16}, {12, 40000}, {13, 1}};
  std::uint64_t chunks = 0;
  for (const auto& [key, n] : tensors) {
    const std::uint64_t shape[] = {n};
    const std::vector<float> v(n, 0.25f);
    auto r = (*w)->init(key, shape, v).wait();
    ASSERT_TRUE(r) << r.error().to_string();
    chunks += placement::num_chunks(n * sizeof(float), sizeof(float), 64 * 1024);
  }
  ASSERT_EQ(chunks, 5u);
  EXPECT_EQ(scrape_until(server.metrics_address(), "ember_server_entries", 5, &metrics), 5.0);
  // The harness config asks for plain pages.
  EXPECT_EQ(metrics.value("ember_pool_backing_info", {{"backing", "plain"}}), 1.0);
  EXPECT_EQ(metrics.all("ember_pool_backing_info").size(), 1u);

  // What `emberctl status` prints from them.
  const auto status = emberctl::status_from_metrics("server 0", server.metrics_address(), metrics, 1);
  const std::string text = emberctl::format_status({status});
  EXPECT_NE(text.find("pool backing        plain"), std::string::npos) << text;
  EXPECT_NE(text.find("tensor chunks       5"), std::string::npos) << text;

  // A second init of the same tensors stores nothing new.
  const std::uint64_t shape[] = {16};
  const std::vector<float> v(16, 0.25f);
  ASSERT_TRUE((*w)->init(11, shape, v).wait());
  ASSERT_TRUE((*w)->barrier().wait());
  EXPECT_EQ(scrape_until(server.metrics_address(), "ember_server_entries", 5, &metrics), 5.0);
}

// The checkpoint thread is not in the watchdog's liveness check; a stopped or
// failing checkpoint shows in these two metrics instead.
TEST(ServerMetrics, CheckpointTimeAndFailuresAreExported) {
  TempDir dir;
  ClusterSpec spec;
  spec.checkpoint_dir = (dir / "ckpt").string();
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  emberctl::Exposition metrics;
  const std::string stamp = "ember_server_last_checkpoint_timestamp_seconds";
  const std::string failures = "ember_server_checkpoint_failures_total";
  EXPECT_EQ(scrape_until(server.metrics_address(), stamp, 0, &metrics), 0.0);
  EXPECT_EQ(metrics.value(failures), 0.0);

  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  const std::uint64_t shape[] = {16};
  ASSERT_TRUE((*w)->init(3, shape, std::vector<float>(16, 0.5f)).wait());
  const auto unix_now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  const double before = unix_now();
  auto written = (*w)->checkpoint().wait();
  ASSERT_TRUE(written) << written.error().to_string();
  const double after = unix_now();
  ASSERT_EQ(scrape_until(server.metrics_address(), "ember_server_checkpoints_written_total", 1, &metrics),
            1.0);
  const auto at = metrics.value(stamp);
  ASSERT_TRUE(at);
  EXPECT_GE(*at, before - 1e-3);
  EXPECT_LE(*at, after + 1e-3);

  // The directory replaced by a file: the next write fails (ENOTDIR), is
  // counted, and the time of the last good one stays.
  fs::rename(dir / "ckpt", dir / "ckpt.moved");
  { std::ofstream(dir / "ckpt") << "not a directory\n"; }
  auto failed = (*w)->checkpoint().wait();
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code(), ErrorCode::kIo) << failed.error().to_string();
  EXPECT_EQ(scrape_until(server.metrics_address(), failures, 1, &metrics), 1.0);
  EXPECT_EQ(metrics.value(stamp), at);
  EXPECT_EQ(metrics.value("ember_server_checkpoints_written_total"), 1.0);

  // A server that restores that checkpoint starts from its time, not 0.
  w->reset();
  server.process().signal(SIGKILL);
  ASSERT_TRUE(server.process().wait_exit());
  fs::remove(dir / "ckpt");
  fs::rename(dir / "ckpt.moved", dir / "ckpt");
  ServerProcess restarted(dir, spec, 0);
  ASSERT_TRUE(restarted.ok());
  EXPECT_EQ(scrape_until(restarted.metrics_address(), stamp, *at, &metrics), *at);
}

}  // namespace
}  // namespace ember::test
