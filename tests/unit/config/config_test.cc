// Unit tests for common/config: defaults, every knob, units, every class of
// bad value (each message checked for file:line and the key), unknown keys
// with suggestions, cross-field rules, to_toml round trips, overrides, and
// the shipped config/ files.
#include "common/config/config.h"

#include <sched.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#ifndef EMBER_SOURCE_DIR
#error "EMBER_SOURCE_DIR must name the repository root"
#endif

namespace ember::config {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

// The error message of parsing `text` as "cfg.toml"; fails the test if it parses.
std::string parse_error(const std::string& text) {
  auto r = parse_config(text, "cfg.toml");
  if (r) {
    ADD_FAILURE() << "parsed without error:\n" << text;
    return "";
  }
  EXPECT_EQ(r.error().code(), ErrorCode::kConfig);
  return r.error().message();
}

Config parse_ok(const std::string& text) {
  auto r = parse_config(text, "cfg.toml");
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message());
  return r ? *r : Config{};
}

// A path as a TOML string literal.
std::string quote_path(const std::filesystem::path& p) { return "\"" + p.string() + "\""; }

// The lowest CPU this process may run on (tests must not assume CPU 0).
std::uint32_t first_allowed_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) return static_cast<std::uint32_t>(c);
  }
  return 0;
}

// ---------------------------------------------------------------------------
TEST(ConfigDefaults, EmptyTextGivesDefaults) {
  const Config c = parse_ok("");
  EXPECT_EQ(c, Config{});
  EXPECT_EQ(c.communication.transport, Transport::kTcp);
  EXPECT_EQ(c.communication.batch_threshold_bytes, 4096u);
  EXPECT_EQ(c.communication.flush_interval, 0us);
  EXPECT_EQ(c.communication.ring_buffer_slots, 1024u);
  EXPECT_EQ(c.communication.prealloc_pages, 128u);
  EXPECT_EQ(c.communication.pool_backing, PoolBacking::kAuto);
  EXPECT_EQ(c.communication.num_channels, 0u);
  EXPECT_EQ(c.communication.zero_copy, ZeroCopy::kWritev);
  EXPECT_EQ(c.communication.inline_write_bytes, 8u << 20);
  EXPECT_FALSE(c.communication.payload_checksum);
  EXPECT_TRUE(c.communication.cpu_affinity.empty());
  EXPECT_EQ(c.communication.num_io_threads, 1u);
  EXPECT_EQ(c.communication.heartbeat_interval, 1s);
  EXPECT_EQ(c.communication.heartbeat_timeout, 10s);
  EXPECT_EQ(c.communication.max_message_bytes, 256u << 20);
  EXPECT_EQ(c.communication.max_queued_bytes, 256u << 20);
  EXPECT_EQ(c.communication.auth_token, "");
  EXPECT_FALSE(c.communication.record_pattern);
  EXPECT_EQ(c.cluster.servers, (std::vector<HostPort>{{"127.0.0.1", 7070}}));
  EXPECT_EQ(c.cluster.num_workers, 1u);
  EXPECT_FALSE(c.server.listen.has_value());
  EXPECT_EQ(c.server.consistency, Consistency::kBsp);
  EXPECT_EQ(c.server.staleness_steps, 2u);
  EXPECT_EQ(c.server.num_shards, 1u);
  EXPECT_EQ(c.server.partition_bytes, 4u << 20);
  EXPECT_EQ(c.server.checkpoint_dir, "");
  EXPECT_EQ(c.server.checkpoint_interval, 0s);
  EXPECT_EQ(c.server.checkpoint_keep, 3u);
  EXPECT_EQ(c.server.on_worker_loss, WorkerLossPolicy::kWait);
  EXPECT_EQ(c.server.worker_timeout, 30s);
  EXPECT_FALSE(c.server.metrics_listen.has_value());
  EXPECT_EQ(c.server.log_level, LogLevel::kInfo);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kSgd);
  EXPECT_EQ(c.optimizer.learning_rate, 0.01);
  EXPECT_EQ(c.worker.rank, 0u);
  EXPECT_EQ(c.worker.request_timeout, 60s);
  EXPECT_EQ(c.worker.connect_timeout, 10s);
  EXPECT_EQ(c.worker.connect_retries, 20u);
  EXPECT_EQ(c.worker.resend_attempts, 3u);
  EXPECT_TRUE(validate(Config{}));
  EXPECT_EQ(effective_listen(c), (HostPort{"127.0.0.1", 7070}));
}

// Every knob set to a non-default value, and the Config that must result.
std::string all_knobs_toml(std::uint32_t cpu) {
  return fmt::format(R"(
[communication]
transport = "shm"
batch_threshold = "8KB"
flush_interval = "50us"
busy_poll = "200us"
ring_buffer_size = 4096
prealloc_pages = 64
pool_backing = "thp"
channels = 4
inline_write = "64KB"
zero_copy = "sendfile"
payload_checksum = true
cpu_affinity = [{0}]
io_threads = 2
heartbeat_interval = "500ms"
heartbeat_timeout = "5s"
max_message_size = "64MB"
max_queued_bytes = "1GB"
auth_token = "s3cr\"et\\ \t ü"
auth_token_file = ""
record_pattern = true
record_path = "/tmp/pattern.bin"

[cluster]
servers = ["10.0.0.1:7070", "[::1]:7071", "ps-2.example.com:7072"]
num_workers = 4

[server]
listen = "0.0.0.0:0"
server_index = 2
consistency = "ssp"
staleness = 5
shards = 8
shard_cpu_affinity = [{0}]
partition_bytes = "1MB"
checkpoint_dir = "/var/lib/ember"
checkpoint_interval = "10m"
checkpoint_keep = 7
on_worker_loss = "shrink"
worker_timeout = "2m"
metrics_listen = "127.0.0.1:9100"
log_level = "debug"

[optimizer]
type = "momentum"
learning_rate = 0.5
momentum = 0.8
nesterov = true
beta1 = 0.5
beta2 = 0.75
epsilon = 1e-6
weight_decay = 1e-4
initial_accumulator = 0.25

[worker]
rank = 3
request_timeout = "90s"
connect_timeout = "250ms"
connect_retries = 0
resend_attempts = 7
)",
                     cpu);
}

Config all_knobs_config(std::uint32_t cpu) {
  Config c;
  auto& m = c.communication;
  m.transport = Transport::kShm;
  m.batch_threshold_bytes = 8192;
  m.flush_interval = 50us;
  m.busy_poll = 200us;
  m.ring_buffer_slots = 4096;
  m.prealloc_pages = 64;
  m.pool_backing = PoolBacking::kThp;
  m.num_channels = 4;
  m.inline_write_bytes = 64 * 1024;
  m.zero_copy = ZeroCopy::kSendfile;
  m.payload_checksum = true;
  m.cpu_affinity = {cpu};
  m.num_io_threads = 2;
  m.heartbeat_interval = 500ms;
  m.heartbeat_timeout = 5s;
  m.max_message_bytes = 64u << 20;
  m.max_queued_bytes = 1u << 30;
  m.auth_token = "s3cr\"et\\ \t \xC3\xBC";
  m.record_pattern = true;
  m.record_path = "/tmp/pattern.bin";
  c.cluster.servers = {{"10.0.0.1", 7070}, {"::1", 7071}, {"ps-2.example.com", 7072}};
  c.cluster.num_workers = 4;
  auto& s = c.server;
  s.listen = HostPort{"0.0.0.0", 0};
  s.server_index = 2;
  s.consistency = Consistency::kSsp;
  s.staleness_steps = 5;
  s.num_shards = 8;
  s.shard_cpu_affinity = {cpu};
  s.partition_bytes = 1u << 20;
  s.checkpoint_dir = "/var/lib/ember";
  s.checkpoint_interval = 10min;
  s.checkpoint_keep = 7;
  s.on_worker_loss = WorkerLossPolicy::kShrink;
  s.worker_timeout = 2min;
  s.metrics_listen = HostPort{"127.0.0.1", 9100};
  s.log_level = LogLevel::kDebug;
  auto& o = c.optimizer;
  o.type = OptimizerType::kMomentum;
  o.learning_rate = 0.5;
  o.momentum = 0.8;
  o.nesterov = true;
  o.beta1 = 0.5;
  o.beta2 = 0.75;
  o.epsilon = 1e-6;
  o.weight_decay = 1e-4;
  o.initial_accumulator = 0.25;
  c.worker.rank = 3;
  c.worker.request_timeout = 90s;
  c.worker.connect_timeout = 250ms;
  c.worker.connect_retries = 0;
  c.worker.resend_attempts = 7;
  return c;
}

TEST(ConfigParse, EveryKnobIsParsed) {
  const std::uint32_t cpu = first_allowed_cpu();
  const Config expected = all_knobs_config(cpu);
  const Config c = parse_ok(all_knobs_toml(cpu));
  EXPECT_EQ(c.communication, expected.communication);
  EXPECT_EQ(c.cluster, expected.cluster);
  EXPECT_EQ(c.server, expected.server);
  EXPECT_EQ(c.optimizer, expected.optimizer);
  EXPECT_EQ(c.worker, expected.worker);
  EXPECT_EQ(effective_listen(c), (HostPort{"0.0.0.0", 0}));
  EXPECT_EQ(resolved_num_channels(c.communication), 4u);
}

TEST(ConfigParse, EveryKnobHasATestValue) {
  // all_knobs_toml must set every known key, so that a new key without a
  // parse test is noticed here.
  const std::string text = all_knobs_toml(0);
  for (const std::string& key : known_keys()) {
    const std::string leaf = key.substr(key.find('.') + 1);
    EXPECT_THAT(text, HasSubstr("\n" + leaf + " = ")) << key;
  }
}

TEST(ConfigParse, SizesAcceptUnitsAndIntegers) {
  EXPECT_EQ(parse_ok("[communication]\nbatch_threshold = 4096\n").communication.batch_threshold_bytes,
            4096u);
  EXPECT_EQ(parse_ok("[communication]\nbatch_threshold = \"0.5KB\"\n")
                .communication.batch_threshold_bytes,
            512u);
  EXPECT_EQ(parse_ok("[communication]\nbatch_threshold = \"1MiB\"\n")
                .communication.batch_threshold_bytes,
            1u << 20);
  EXPECT_EQ(parse_ok("[communication]\nmax_queued_bytes = \"2 GB\"\n")
                .communication.max_queued_bytes,
            2ull << 30);
  EXPECT_EQ(parse_ok("[server]\npartition_bytes = \"16m\"\n").server.partition_bytes, 16u << 20);
}

TEST(ConfigParse, DurationsAcceptUnits) {
  EXPECT_EQ(parse_ok("").communication.busy_poll, 1ms);
  EXPECT_EQ(parse_ok("[communication]\nbusy_poll = \"0us\"\n").communication.busy_poll, 0ns);
  EXPECT_EQ(parse_ok("[communication]\nbusy_poll = \"200us\"\n").communication.busy_poll, 200us);
  EXPECT_EQ(parse_ok("[communication]\nflush_interval = \"0us\"\n").communication.flush_interval,
            0ns);
  EXPECT_EQ(parse_ok("[communication]\nflush_interval = \"1.5ms\"\n").communication.flush_interval,
            1500us);
  EXPECT_EQ(parse_ok("[worker]\nrequest_timeout = \"2h\"\n").worker.request_timeout, 2h);
  EXPECT_EQ(parse_ok("[server]\ncheckpoint_interval = \"1500ms\"\n").server.checkpoint_interval,
            1500ms);
}

TEST(ConfigParse, DottedKeysAndInlineTablesWork) {
  const Config a = parse_ok("communication.transport = \"shm\"\nworker.rank = 0\n");
  EXPECT_EQ(a.communication.transport, Transport::kShm);
  const Config b = parse_ok("communication = { transport = \"rdma\", channels = 2 }\n");
  EXPECT_EQ(b.communication.transport, Transport::kRdma);
  EXPECT_EQ(b.communication.num_channels, 2u);
}

TEST(ConfigParse, OptimizerNumbersAcceptIntegers) {
  EXPECT_EQ(parse_ok("[optimizer]\nlearning_rate = 1\n").optimizer.learning_rate, 1.0);
}

// ---------------------------------------------------------------------------
// Bad values: every class, each with file:line, the key and a remedy.

TEST(ConfigErrors, WrongTypeNamesLineKeyAndExpectedType) {
  EXPECT_THAT(parse_error("[communication]\n\nbatch_threshold = true\n"),
              AllOf(HasSubstr("cfg.toml:3: key 'communication.batch_threshold': must be a size, "
                              "got boolean true"),
                    HasSubstr("\"4KB\"")));
  EXPECT_THAT(parse_error("[communication]\nchannels = \"4\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.channels': must be an integer, got string "
                        "\"4\""));
  EXPECT_THAT(parse_error("[communication]\nrecord_pattern = \"yes\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.record_pattern': must be true or false"));
  EXPECT_THAT(parse_error("[communication]\nauth_token = 5\n"),
              HasSubstr("cfg.toml:2: key 'communication.auth_token': must be a string, got "
                        "integer 5"));
  EXPECT_THAT(parse_error("[optimizer]\nlearning_rate = \"fast\"\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.learning_rate': must be a number"));
  EXPECT_THAT(parse_error("[cluster]\nservers = \"127.0.0.1:7070\"\n"),
              HasSubstr("cfg.toml:2: key 'cluster.servers': must be an array"));
  EXPECT_THAT(parse_error("[communication]\ncpu_affinity = [\"0\"]\n"),
              HasSubstr("cfg.toml:2: key 'communication.cpu_affinity': element [0] must be a CPU "
                        "id"));
  EXPECT_THAT(parse_error("[communication]\ntransport = 1979-05-27\n"),
              HasSubstr("cfg.toml:2: key 'communication.transport': must be a string, got a "
                        "date/time"));
  EXPECT_THAT(parse_error("communication = 5\n"),
              HasSubstr("cfg.toml:1: key 'communication' must be a table, got integer 5"));
}

TEST(ConfigErrors, OutOfRangeValues) {
  EXPECT_THAT(parse_error("[communication]\nbatch_threshold = \"100B\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.batch_threshold': 100 B is below the "
                        "minimum 512 B; use at least \"512B\""));
  EXPECT_THAT(parse_error("[communication]\nbatch_threshold = \"2MB\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.batch_threshold': 2 MiB is above the "
                        "maximum 1 MiB; use at most \"1MB\""));
  EXPECT_THAT(parse_error("[communication]\nbatch_threshold = -5\n"),
              HasSubstr("cfg.toml:2: key 'communication.batch_threshold': -5 is negative"));
  EXPECT_THAT(parse_error("[communication]\nring_buffer_size = 1000\n"),
              HasSubstr("cfg.toml:2: key 'communication.ring_buffer_size': 1000 is not a power of "
                        "two; use 512 or 1024"));
  EXPECT_THAT(parse_error("[communication]\nring_buffer_size = 1\n"),
              HasSubstr("cfg.toml:2: key 'communication.ring_buffer_size': 1 is outside 2 .. "
                        "16777216"));
  EXPECT_THAT(parse_error("[communication]\nchannels = 65\n"),
              HasSubstr("cfg.toml:2: key 'communication.channels': 65 is outside 0 .. 64; use 0 "
                        "(auto) or a count from 1 to 64"));
  EXPECT_THAT(parse_error("[communication]\nio_threads = -1\n"),
              HasSubstr("cfg.toml:2: key 'communication.io_threads': -1 is outside 1 .. 256"));
  EXPECT_THAT(parse_error("[communication]\nprealloc_pages = 0\n"),
              HasSubstr("cfg.toml:2: key 'communication.prealloc_pages': 0 is outside"));
  EXPECT_THAT(parse_error("[cluster]\nnum_workers = 0\n"),
              HasSubstr("cfg.toml:2: key 'cluster.num_workers': 0 is outside 1 .. "));
  EXPECT_THAT(parse_error("[communication]\nflush_interval = \"2s\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.flush_interval': \"2s\" is above the "
                        "maximum \"1s\""));
  EXPECT_THAT(parse_error("[communication]\nbusy_poll = \"20ms\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.busy_poll': \"20ms\" is above the "
                        "maximum \"10ms\""));
  EXPECT_THAT(parse_error("[communication]\nbusy_poll = \"-1us\"\n"),
              HasSubstr("key 'communication.busy_poll'"));
  EXPECT_THAT(parse_error("[communication]\nheartbeat_interval = \"0s\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.heartbeat_interval': must be longer than "
                        "zero"));
  EXPECT_THAT(parse_error("[server]\ncheckpoint_keep = 0\n"),
              HasSubstr("cfg.toml:2: key 'server.checkpoint_keep': 0 is outside 1 .. "));
  EXPECT_THAT(parse_error("[server]\npartition_bytes = \"1KB\"\n"),
              HasSubstr("cfg.toml:2: key 'server.partition_bytes': 1 KiB is below the minimum 4 "
                        "KiB"));
  // toml11 saturates numbers that overflow; they are refused with their text.
  EXPECT_THAT(parse_error("[worker]\nrank = 99999999999999999999\n"),
              HasSubstr("cfg.toml:2: key 'worker.rank': 99999999999999999999 does not fit in a "
                        "64-bit integer"));
  EXPECT_THAT(parse_error("[communication]\ncpu_affinity = [0, -9_223_372_036_854_775_809]\n"),
              HasSubstr("cfg.toml:2: key 'communication.cpu_affinity': "
                        "-9_223_372_036_854_775_809 does not fit in a 64-bit integer"));
  EXPECT_THAT(parse_error("[optimizer]\nweight_decay = 1e999\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.weight_decay': 1e999 does not fit in a "
                        "double"));
  // The extremes that do fit are ordinary values (refused here by the range).
  EXPECT_THAT(parse_error("[worker]\nrank = 9223372036854775807\n"),
              HasSubstr("cfg.toml:2: key 'worker.rank': 9223372036854775807 is outside 0 .. "));
  EXPECT_THAT(parse_error("[worker]\nrank = -0x1\n"), HasSubstr("TOML syntax error"));
  EXPECT_THAT(parse_error("[worker]\nresend_attempts = 101\n"),
              HasSubstr("cfg.toml:2: key 'worker.resend_attempts': 101 is outside 0 .. 100; use "
                        "0 (fail at once) to 100 re-sends"));
  EXPECT_THAT(parse_error("[worker]\nresend_attempts = -1\n"),
              HasSubstr("cfg.toml:2: key 'worker.resend_attempts': -1 is outside 0 .. 100"));
  EXPECT_EQ(parse_ok("[worker]\nresend_attempts = 0\n").worker.resend_attempts, 0u);
  EXPECT_EQ(parse_ok("[worker]\nresend_attempts = 100\n").worker.resend_attempts, 100u);
}

TEST(ConfigErrors, OptimizerRanges) {
  for (const char* bad : {"0", "-0.1", "inf", "nan", "-inf"}) {
    EXPECT_THAT(parse_error(fmt::format("[optimizer]\nlearning_rate = {}\n", bad)),
                AllOf(HasSubstr("cfg.toml:2: key 'optimizer.learning_rate': "),
                      HasSubstr("is out of range: it must be finite, > 0")))
        << bad;
  }
  EXPECT_THAT(parse_error("[optimizer]\nmomentum = 1.0\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.momentum': 1.0 is out of range: it must be "
                        "finite, >= 0 and < 1; use e.g. 0.9"));
  EXPECT_THAT(parse_error("[optimizer]\nbeta2 = -0.5\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.beta2': -0.5 is out of range"));
  EXPECT_THAT(parse_error("[optimizer]\nepsilon = 0.0\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.epsilon': 0.0 is out of range"));
  EXPECT_THAT(parse_error("[optimizer]\nweight_decay = -1e-4\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.weight_decay': "));
}

TEST(ConfigErrors, BadUnits) {
  EXPECT_THAT(parse_error("[communication]\nbatch_threshold = \"4XB\"\n"),
              AllOf(HasSubstr("cfg.toml:2: key 'communication.batch_threshold': size '4XB' has "
                              "unknown unit 'XB'"),
                    HasSubstr("KB")));
  EXPECT_THAT(parse_error("[communication]\nflush_interval = 20\n"),
              HasSubstr("cfg.toml:2: key 'communication.flush_interval': integer 20 has no unit; "
                        "write a string with a unit: ns, us, ms, s, m or h (e.g. \"0s\")"));
  EXPECT_THAT(parse_error("[communication]\nflush_interval = \"20\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.flush_interval': duration '20' needs a "
                        "unit"));
  EXPECT_THAT(parse_error("[communication]\nflush_interval = \"20 parsecs\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.flush_interval': duration '20 parsecs' "
                        "has unknown unit"));
}

TEST(ConfigErrors, BadEnumListsValidValues) {
  EXPECT_THAT(parse_error("[communication]\ntransport = \"udp\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.transport': \"udp\" is not a valid "
                        "transport; use one of \"tcp\", \"shm\", \"rdma\", \"auto\""));
  EXPECT_THAT(parse_error("[communication]\ntransport = \"TCP\"\n"),
              HasSubstr("names are lower case: write \"tcp\""));
  EXPECT_THAT(parse_error("[communication]\npool_backing = \"huge\"\n"),
              HasSubstr("use one of \"auto\", \"hugetlb\", \"thp\", \"plain\""));
  EXPECT_EQ(parse_ok("[communication]\ninline_write = 0\n").communication.inline_write_bytes, 0u);
  EXPECT_THAT(parse_error("[communication]\ninline_write = \"2GB\"\n"),
              AllOf(HasSubstr("communication.inline_write"), HasSubstr("above the maximum"),
                    HasSubstr("use at most \"1GB\"")));
  // Just over the limit: shown in bytes, not rounded to the limit's text.
  EXPECT_THAT(parse_error("[communication]\ninline_write = \"1073741825B\"\n"),
              HasSubstr("1073741825 B is above the maximum 1 GiB"));
  EXPECT_THAT(parse_error("[server]\ncheckpoint_dir = \"/tmp/a\\u0000b\"\n"),
              HasSubstr("cfg.toml:2: key 'server.checkpoint_dir': holds a NUL character (\\u0000) "
                        "at byte 6; remove it"));
  // Rounded text is shown with the exact bytes (not "4.00 KiB is below 4 KiB").
  EXPECT_THAT(parse_error("[server]\npartition_bytes = 4095\n"),
              HasSubstr("4095 B (4.00 KiB) is below the minimum 4 KiB"));
  EXPECT_THAT(parse_error("[communication]\nzero_copy = \"splice\"\n"),
              HasSubstr("use one of \"writev\", \"sendfile\""));
  EXPECT_THAT(parse_error("[communication]\npayload_checksum = \"yes\"\n"),
              AllOf(HasSubstr("communication.payload_checksum"),
                    HasSubstr("write payload_checksum = true or payload_checksum = false")));
  EXPECT_THAT(parse_error("[server]\nconsistency = \"sync\"\n"),
              HasSubstr("use one of \"bsp\", \"asp\", \"ssp\""));
  EXPECT_THAT(parse_error("[server]\non_worker_loss = \"retry\"\n"),
              HasSubstr("use one of \"wait\", \"shrink\", \"fail\""));
  EXPECT_THAT(parse_error("[server]\nlog_level = \"verbose\"\n"),
              HasSubstr("use one of \"trace\", \"debug\", \"info\", \"warn\", \"error\", "
                        "\"critical\", \"off\""));
  EXPECT_THAT(parse_error("[optimizer]\ntype = \"rmsprop\"\n"),
              HasSubstr("use one of \"sgd\", \"momentum\", \"adam\", \"adamw\", \"adagrad\""));
}

TEST(ConfigErrors, BadAddresses) {
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"localhost\"]\n"),
              HasSubstr("cfg.toml:2: key 'cluster.servers': element [0]: 'localhost' has no port; "
                        "write host:port"));
  EXPECT_THAT(parse_error("[cluster]\nservers = []\n"),
              HasSubstr("cfg.toml:2: key 'cluster.servers': is empty; list at least one server"));
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"a:1\", \"b:2\", \"a:1\"]\n"),
              HasSubstr("\"a:1\" is listed twice (elements [0] and [2])"));
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"127.0.0.1:7070\", \"localhost:7070\"]\n"),
              HasSubstr("\"localhost:7070\" (element [1]) is the same server as \"127.0.0.1:7070\" "
                        "(element [0]) under another name"));
  parse_ok("[cluster]\nservers = [\"127.0.0.1:7070\", \"localhost:7071\"]\n");
  // Every spelling of one address literal is the same server.
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"127.0.0.1:7070\", \"127.1:7070\"]\n"),
              HasSubstr("\"127.1:7070\" (element [1]) is the same server as \"127.0.0.1:7070\""));
  EXPECT_THAT(
      parse_error("[cluster]\nservers = [\"127.0.0.1:7070\", \"[::ffff:127.0.0.1]:7070\"]\n"),
      HasSubstr("is the same server as \"127.0.0.1:7070\""));
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"[::1]:7070\", \"[0:0::1]:7070\"]\n"),
              HasSubstr("is the same server as \"[::1]:7070\""));
  parse_ok("[cluster]\nservers = [\"127.0.0.1:7070\", \"127.0.0.2:7070\", \"[::1]:7070\"]\n");
  // A control character in a quoted value is shown escaped: a NUL used to
  // end the message there.
  EXPECT_THAT(parse_error("[server]\nlisten = \"a\\u0000b\\u0007c:7000\"\n"),
              HasSubstr("cfg.toml:2: key 'server.listen': 'a\\u0000b\\u0007c:7000': 'a\\u0000b\\u0007c' "
                        "is not a host name or IPv4 address"));
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"a:0\"]\n"),
              HasSubstr("port 0 is not in 1 .. 65535"));
  EXPECT_THAT(parse_error("[cluster]\nservers = [\"a:70000\"]\n"),
              HasSubstr("port 70000 is not in 1 .. 65535"));
  EXPECT_THAT(parse_error("[server]\nlisten = \"::1:7070\"\n"),
              HasSubstr("cfg.toml:2: key 'server.listen': '::1:7070': an IPv6 address needs "
                        "brackets"));
  EXPECT_THAT(parse_error("[server]\nmetrics_listen = \"bad host:80\"\n"),
              HasSubstr("cfg.toml:2: key 'server.metrics_listen': 'bad host:80': 'bad host' is "
                        "not a host name"));
}

TEST(ConfigErrors, CpuThatDoesNotExist) {
  EXPECT_THAT(parse_error("[communication]\ncpu_affinity = [100000]\n"),
              AllOf(HasSubstr("cfg.toml:2: key 'communication.cpu_affinity': CPU 100000 does not "
                              "exist on this machine (CPUs 0-"),
                    Not(HasSubstr("key 'communication.cpu_affinity': key"))));
  const std::uint32_t cpu = first_allowed_cpu();
  EXPECT_THAT(parse_error(fmt::format("[server]\nshard_cpu_affinity = [{0}, {0}]\n", cpu)),
              HasSubstr(fmt::format("cfg.toml:2: key 'server.shard_cpu_affinity': CPU {} is listed "
                                    "twice",
                                    cpu)));
  EXPECT_THAT(parse_error("[communication]\ncpu_affinity = [-1]\n"),
              HasSubstr("element [0] must be a CPU id (an integer >= 0), got integer -1"));
}

// Narrows this thread's affinity mask (what sched_getaffinity(0) reads) to
// one CPU for the test's lifetime, so another existing CPU is outside it;
// restores the old mask on exit. ok() is false on a 1-CPU machine.
class OneCpuMask {
 public:
  OneCpuMask() {
    CPU_ZERO(&saved_);
    if (sched_getaffinity(0, sizeof(saved_), &saved_) != 0 || CPU_COUNT(&saved_) < 2) return;
    kept_ = first_allowed_cpu();
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &saved_) && static_cast<std::uint32_t>(c) != kept_) {
        outside_ = static_cast<std::uint32_t>(c);
        break;
      }
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(kept_, &one);
    ok_ = sched_setaffinity(0, sizeof(one), &one) == 0;
  }
  ~OneCpuMask() {
    if (ok_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  OneCpuMask(const OneCpuMask&) = delete;
  OneCpuMask& operator=(const OneCpuMask&) = delete;
  bool ok() const { return ok_; }
  std::uint32_t kept() const { return kept_; }
  std::uint32_t outside() const { return outside_; }

 private:
  cpu_set_t saved_;
  bool ok_ = false;
  std::uint32_t kept_ = 0, outside_ = 0;
};

TEST(ConfigErrors, CpuOutsideAffinityMask) {
  OneCpuMask mask;
  if (!mask.ok()) GTEST_SKIP() << "needs 2 CPUs in this process's affinity mask";
  EXPECT_THAT(parse_error(fmt::format("[communication]\ncpu_affinity = [{}]\n", mask.outside())),
              HasSubstr(fmt::format("key 'communication.cpu_affinity': CPU {} is not in this "
                                    "process's allowed CPUs ({}, set by taskset",
                                    mask.outside(), mask.kept())));
}

// server.shard_cpu_affinity pins only ember-server's threads: a worker pinned
// by taskset to one core loads the same file without an error (the server
// checks its own mask at start; tests/integration/server/bad_request_test.cc).
// A CPU that does not exist or repeats is still refused by every process.
TEST(ConfigErrors, ShardCpusOutsideThisProcessMaskAreLeftToTheServer) {
  OneCpuMask mask;
  if (!mask.ok()) GTEST_SKIP() << "needs 2 CPUs in this process's affinity mask";
  const Config c =
      parse_ok(fmt::format("[server]\nshard_cpu_affinity = [{}, {}]\n", mask.kept(), mask.outside()));
  EXPECT_EQ(c.server.shard_cpu_affinity, (std::vector<std::uint32_t>{mask.kept(), mask.outside()}));
  EXPECT_FALSE(check_cpus_available(c.server.shard_cpu_affinity, "server.shard_cpu_affinity"));
  EXPECT_TRUE(check_cpus_exist(c.server.shard_cpu_affinity, "server.shard_cpu_affinity"));
  EXPECT_THAT(parse_error("[server]\nshard_cpu_affinity = [100000]\n"),
              HasSubstr("key 'server.shard_cpu_affinity': CPU 100000 does not exist"));
}

TEST(ConfigErrors, SendfileWithHugetlbIsRefused) {
  const std::string msg = parse_error(
      "[communication]\npool_backing = \"hugetlb\"\nzero_copy = \"sendfile\"\n");
  EXPECT_THAT(msg, AllOf(HasSubstr("cfg.toml:3: key 'communication.zero_copy': \"sendfile\" "
                                   "cannot be used with pool_backing = \"hugetlb\""),
                         HasSubstr("a hugetlb memfd cannot feed sendfile"), HasSubstr("EINVAL"),
                         HasSubstr("use pool_backing = \"thp\" or zero_copy = \"writev\"")));
  // Each of the two alone is fine, and sendfile with thp is fine.
  parse_ok("[communication]\npool_backing = \"hugetlb\"\n");
  parse_ok("[communication]\nzero_copy = \"sendfile\"\npool_backing = \"thp\"\n");
}

TEST(ConfigErrors, CheckpointIntervalIsZeroOrAtLeastOneSecond) {
  // "1ns" passed once, and an idle server then wrote and fsynced thousands of
  // checkpoints a second.
  EXPECT_THAT(parse_error("[server]\ncheckpoint_interval = \"1ns\"\n"),
              HasSubstr("cfg.toml:2: key 'server.checkpoint_interval': \"1ns\" is below \"1s\": "
                        "each checkpoint writes and fsyncs every tensor"));
  EXPECT_THAT(parse_error("[server]\ncheckpoint_interval = \"999ms\"\n"), HasSubstr("is below \"1s\""));
  EXPECT_EQ(parse_ok("[server]\ncheckpoint_interval = \"0s\"\n").server.checkpoint_interval, 0s);
  EXPECT_EQ(parse_ok("[server]\ncheckpoint_interval = \"1s\"\n").server.checkpoint_interval, 1s);
}

TEST(ConfigErrors, CrossFieldRulesPointAtTheLine) {
  EXPECT_THAT(parse_error("[communication]\nheartbeat_interval = \"5s\"\nheartbeat_timeout = "
                          "\"5s\"\n"),
              HasSubstr("cfg.toml:3: key 'communication.heartbeat_timeout': \"5s\" must exceed "
                        "heartbeat_interval \"5s\""));
  // Only the interval is in the file: its line is used.
  EXPECT_THAT(parse_error("[communication]\nheartbeat_interval = \"20s\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.heartbeat_timeout': \"10s\" must exceed"));
  EXPECT_THAT(parse_error("[communication]\nmax_message_size = \"1KB\"\nbatch_threshold = "
                          "\"2KB\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.max_message_size': \"1KB\" is smaller "
                        "than batch_threshold \"2KB\""));
  // A message must hold one chunk's data: partition_bytes.
  EXPECT_THAT(parse_error("[communication]\nmax_message_size = \"3MB\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.max_message_size': \"3MB\" is smaller "
                        "than [server] partition_bytes \"4MB\""));
  EXPECT_THAT(parse_error("[server]\npartition_bytes = \"512MB\"\n"),
              HasSubstr("raise max_message_size to at least partition_bytes or lower "
                        "partition_bytes"));
  auto equal = parse_config("[communication]\nmax_message_size = \"4MB\"\n", "cfg.toml");
  EXPECT_TRUE(equal) << equal.error().to_string();
  EXPECT_THAT(parse_error("[communication]\nmax_queued_bytes = \"1MB\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.max_queued_bytes': \"1MB\" cannot hold "
                        "one message of max_message_size \"256MB\""));
  EXPECT_THAT(parse_error("[communication]\nrecord_pattern = true\n"),
              HasSubstr("cfg.toml:2: key 'communication.record_pattern': is true but record_path "
                        "is empty"));
  EXPECT_THAT(parse_error("[cluster]\nnum_workers = 65537\n[communication]\nrecord_pattern = "
                          "true\nrecord_path = \"/tmp/p.bin\"\n"),
              HasSubstr("cfg.toml:4: key 'communication.record_pattern': is true but "
                        "cluster.num_workers = 65537 is above the 65536 ranks a recording holds"));
  auto most = parse_config("[cluster]\nnum_workers = 65536\n[communication]\nrecord_pattern = "
                           "true\nrecord_path = \"/tmp/p.bin\"\n",
                           "cfg.toml");
  EXPECT_TRUE(most) << most.error().to_string();
  EXPECT_THAT(parse_error("[server]\nserver_index = 1\n"),
              HasSubstr("cfg.toml:2: key 'server.server_index': 1 is not a position in "
                        "cluster.servers, which lists 1 server(s); use 0 .. 0"));
  EXPECT_THAT(parse_error("[cluster]\nnum_workers = 2\n[worker]\nrank = 2\n"),
              HasSubstr("cfg.toml:4: key 'worker.rank': 2 is not below cluster.num_workers = 2"));
  EXPECT_THAT(parse_error("[optimizer]\ntype = \"adam\"\nnesterov = true\n"),
              HasSubstr("cfg.toml:3: key 'optimizer.nesterov': is true but type = \"adam\""));
  EXPECT_THAT(parse_error("[server]\nmetrics_listen = \"127.0.0.1:7070\"\n"),
              HasSubstr("cfg.toml:2: key 'server.metrics_listen': \"127.0.0.1:7070\" is also the "
                        "server's data address"));
}

TEST(ConfigErrors, UnknownKeySuggestsClosest) {
  EXPECT_THAT(parse_error("[communication]\nbatch_treshold = \"4KB\"\n"),
              HasSubstr("cfg.toml:2: key 'communication.batch_treshold': unknown key in "
                        "[communication]; did you mean 'batch_threshold'?"));
  EXPECT_THAT(parse_error("[communication]\nchannel = 2\n"), HasSubstr("did you mean 'channels'?"));
  EXPECT_THAT(parse_error("[server]\nrank = 1\n"),
              HasSubstr("cfg.toml:2: key 'server.rank': unknown key in [server]; 'rank' belongs "
                        "in [worker]: move it there"));
  EXPECT_THAT(parse_error("[worker]\nzzzzzzzzzz = 1\n"),
              HasSubstr("unknown key in [worker]; known keys are: rank, request_timeout, "
                        "connect_timeout, connect_retries, resend_attempts"));
  EXPECT_THAT(parse_error("[comunication]\ntransport = \"tcp\"\n"),
              HasSubstr("cfg.toml:1: key 'comunication': unknown table [comunication]; did you "
                        "mean [communication]?"));
  EXPECT_THAT(parse_error("[gpu]\nchannels = 2\n"),
              HasSubstr("cfg.toml:1: key 'gpu': unknown table [gpu]; the tables are "
                        "[communication], [cluster], [server], [optimizer], [worker]"));
  EXPECT_THAT(parse_error("transport = \"tcp\"\n"),
              HasSubstr("cfg.toml:1: key 'transport': keys must be inside a table; move it under "
                        "[communication]"));
  EXPECT_THAT(parse_error("[communication.sub]\nx = 1\n"),
              HasSubstr("key 'communication.sub': unknown key in [communication]"));
}

TEST(ConfigErrors, AllProblemsAreReportedInLineOrder) {
  const std::string msg = parse_error(
      "[worker]\nrank = -1\n[communication]\ntransport = \"x\"\nbogus = 1\n");
  const auto a = msg.find("cfg.toml:2:");
  const auto b = msg.find("cfg.toml:4:");
  const auto c = msg.find("cfg.toml:5:");
  ASSERT_NE(a, std::string::npos) << msg;
  ASSERT_NE(b, std::string::npos) << msg;
  ASSERT_NE(c, std::string::npos) << msg;
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
}

TEST(ConfigErrors, SyntaxErrorHasFileAndLine) {
  EXPECT_THAT(parse_error("[communication]\ntransport = \"tcp\"\nchannels = = 3\n"),
              AllOf(HasSubstr("cfg.toml:3: TOML syntax error: "), HasSubstr("channels = = 3")));
  // toml11's excerpt keeps its lines (the marker under the place is one).
  EXPECT_THAT(parse_error("[communication]\ntransport = \"tcp\"\nchannels = = 3\n"),
              AllOf(HasSubstr("\n"), Not(HasSubstr("\\u000a"))));
  EXPECT_THAT(parse_error("[communication]\ntransport = \"tcp\n"),
              HasSubstr("cfg.toml:2: TOML syntax error"));
  // toml11's summary ends with a full stop; the advice follows it cleanly.
  EXPECT_THAT(parse_error("[communication]\n= 3\n"),
              AllOf(HasSubstr("cfg.toml:2: TOML syntax error"), Not(HasSubstr(".;"))));
  EXPECT_THAT(parse_error("[communication]\ntransport = \"a\"\ntransport = \"b\"\n"),
              HasSubstr("cfg.toml:"));
  EXPECT_THAT(parse_error("[worker]\nrank = 0\nx = 'ab\xff'\n"),
              HasSubstr("cfg.toml:3: byte 0xFF at column 8 is not valid UTF-8; a TOML file must "
                        "be UTF-8"));
  EXPECT_THAT(parse_error("# \xC0\x80 overlong\n"), HasSubstr("cfg.toml:1: byte 0xC0 at column 3"));
  EXPECT_THAT(parse_error("x = \"\xED\xA0\x80\"\n"),  // a UTF-16 surrogate
              HasSubstr("cfg.toml:1: byte 0xED at column 6 is not valid UTF-8"));
}

TEST(ConfigErrors, DeepNestingIsRefusedWithoutCrashing) {
  EXPECT_THAT(parse_error("a = " + std::string(100000, '[') + "\n"),
              HasSubstr("cfg.toml:1: arrays, tables or inline tables nest deeper than 64"));
  EXPECT_THAT(parse_error("a = " + std::string(100000, '{') + "\n"),
              HasSubstr("nest deeper than 64"));
  std::string dotted = "a";
  for (int i = 0; i < 100000; ++i) dotted += ".a";
  EXPECT_THAT(parse_error(dotted + " = 1\n"), HasSubstr("a dotted key has more than 64 parts"));
  EXPECT_THAT(parse_error("[" + dotted + "]\n"), HasSubstr("a dotted key has more than 64 parts"));
  // Brackets inside strings and comments do not count.
  parse_ok("# [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n"
           "[communication]\nauth_token = \"" + std::string(200, '[') + "\"\n" +
           "record_path = '''" + std::string(200, '{') + "'''\n");
}

// ---------------------------------------------------------------------------
TEST(ConfigFile, MissingFileNamesThePath) {
  auto r = load_config_file("/nonexistent/dir/ember.toml");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kConfig);
  EXPECT_THAT(r.error().message(),
              HasSubstr("/nonexistent/dir/ember.toml: the config file does not exist"));
}

TEST(ConfigFile, DirectoryAndEndlessDevicesAreRefused) {
  // A device that never ends (or a huge file) stops at the bound with an error.
  if (std::filesystem::exists("/dev/zero")) {
    auto endless = load_config_file("/dev/zero");
    ASSERT_FALSE(endless);
    EXPECT_THAT(endless.error().message(), HasSubstr("/dev/zero: more than 16 MiB"));
  }
  auto r = load_config_file(std::filesystem::temp_directory_path());
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(), HasSubstr("is a directory"));
}

TEST(ConfigFile, ErrorsNameTheFileAndLine) {
  const auto path = std::filesystem::temp_directory_path() /
                    fmt::format("ember_config_test_{}.toml", ::getpid());
  {
    std::ofstream out(path);
    out << "# comment\n[communication]\nchannels = 100\n";
  }
  auto r = load_config_file(path);
  std::filesystem::remove(path);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(),
              HasSubstr(path.string() + ":3: key 'communication.channels': 100 is outside"));
}

// [communication] auth_token_file: the token read from a file (a mounted
// secret), one trailing newline dropped; never printed; not together with
// auth_token, in either order of lines or overrides.
TEST(ConfigFile, AuthTokenFileGivesTheTokenAndIsExclusiveWithAuthToken) {
  const auto dir = std::filesystem::temp_directory_path() /
                   fmt::format("ember_token_test_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto token = dir / "token";
  {
    std::ofstream out(token);
    out << "s3cret-from-file\r\n";
  }
  const std::string file_line = "auth_token_file = " + quote_path(token) + "\n";
  Config c = parse_ok("[communication]\n" + file_line);
  EXPECT_EQ(c.communication.auth_token, "s3cret-from-file");
  EXPECT_EQ(c.communication.auth_token_file, token.string());
  const std::string printed = to_toml(c);
  EXPECT_THAT(printed, Not(HasSubstr("s3cret-from-file")));
  EXPECT_EQ(parse_ok(printed).communication.auth_token, "s3cret-from-file");  // round trip
  EXPECT_THAT(parse_error("[communication]\nauth_token = \"x\"\n" + file_line),
              HasSubstr("cfg.toml:3: key 'communication.auth_token_file': auth_token gives the "
                        "token already; give auth_token or auth_token_file, not both"));
  EXPECT_THAT(parse_error("[communication]\n" + file_line + "auth_token = \"x\"\n"),
              HasSubstr("cfg.toml:3: key 'communication.auth_token': auth_token_file = "));
  EXPECT_FALSE(set_value(c, "communication.auth_token", "other"));
  ASSERT_TRUE(set_value(c, "communication.auth_token_file", ""));  // off: the token goes too
  EXPECT_EQ(c.communication.auth_token, "");
  ASSERT_TRUE(set_value(c, "communication.auth_token_file", token.string()));
  EXPECT_EQ(c.communication.auth_token, "s3cret-from-file");

  EXPECT_THAT(parse_error("[communication]\nauth_token_file = \"" + (dir / "missing").string() +
                          "\"\n"),
              HasSubstr("cannot open '" + (dir / "missing").string() + "': No such file"));
  const auto empty = dir / "empty";
  { std::ofstream out(empty); out << "\n"; }
  EXPECT_THAT(parse_error("[communication]\nauth_token_file = " + quote_path(empty) + "\n"),
              HasSubstr("is empty; write the job's token into it"));
  const auto big = dir / "big";
  { std::ofstream out(big); out << std::string(1025, 'k'); }
  EXPECT_THAT(parse_error("[communication]\nauth_token_file = " + quote_path(big) + "\n"),
              HasSubstr("holds more than 1024 bytes"));
  EXPECT_THAT(parse_error("[communication]\nauth_token_file = " + quote_path(dir) + "\n"),
              HasSubstr("'" + dir.string() + "' is a directory; name the token file in it"));
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------
TEST(ConfigToml, DefaultsRoundTrip) {
  const std::string text = to_toml(Config{});
  auto back = parse_config(text, "printed.toml");
  ASSERT_TRUE(back) << back.error().message() << "\n" << text;
  EXPECT_EQ(*back, Config{});
  EXPECT_THAT(text, HasSubstr("batch_threshold = \"4KB\""));
  EXPECT_THAT(text, HasSubstr("flush_interval = \"0s\""));
  EXPECT_THAT(text, HasSubstr("max_message_size = \"256MB\""));
  EXPECT_THAT(text, HasSubstr("servers = [\"127.0.0.1:7070\"]"));
  EXPECT_THAT(text, HasSubstr("epsilon = \"auto\""));
  EXPECT_THAT(text, HasSubstr("weight_decay = \"auto\""));
  EXPECT_THAT(text, HasSubstr("initial_accumulator = 0.0"));
}

// epsilon and weight_decay take a number or "auto" (PyTorch's default of the
// type, resolved by OptimizerConfig::*_or_default); anything else is refused
// with both spellings named.
TEST(ConfigToml, OptimizerAutoValues) {
  auto c = parse_config("[optimizer]\ntype = \"adamw\"\nepsilon = \"auto\"\n", "cfg.toml");
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_FALSE(c->optimizer.epsilon.has_value());
  EXPECT_FALSE(c->optimizer.weight_decay.has_value());
  EXPECT_EQ(c->optimizer.weight_decay_or_default(), 0.01);
  c = parse_config("[optimizer]\ntype = \"adagrad\"\nepsilon = 1e-6\nweight_decay = 0\n", "cfg.toml");
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->optimizer.epsilon, 1e-6);
  EXPECT_EQ(c->optimizer.weight_decay, 0.0);
  EXPECT_THAT(to_toml(*c), HasSubstr("weight_decay = 0.0"));

  // An override back to "auto" after a file that set a number.
  Config o = *c;
  const std::vector<std::string> to_auto{"optimizer.epsilon=auto", "optimizer.weight_decay=\"auto\""};
  ASSERT_TRUE(apply_overrides(o, to_auto));
  EXPECT_FALSE(o.optimizer.epsilon.has_value());
  EXPECT_FALSE(o.optimizer.weight_decay.has_value());
  EXPECT_EQ(o.optimizer.epsilon_or_default(), 1e-10);

  EXPECT_THAT(parse_error("[optimizer]\nepsilon = \"small\"\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.epsilon': must be a number or \"auto\", got "
                        "string \"small\"; write e.g. epsilon = 1e-8"));
  EXPECT_THAT(parse_error("[optimizer]\nweight_decay = true\n"),
              HasSubstr("cfg.toml:2: key 'optimizer.weight_decay': must be a number or \"auto\""));
}

TEST(ConfigToml, EveryKnobRoundTrips) {
  const Config c = all_knobs_config(first_allowed_cpu());
  ASSERT_TRUE(validate(c)) << validate(c).error().message();
  const std::string text = to_toml(c);
  auto back = parse_config(text, "printed.toml");
  ASSERT_TRUE(back) << back.error().message() << "\n" << text;
  EXPECT_EQ(*back, c) << text;
  for (const std::string& key : known_keys()) {
    const std::string leaf = key.substr(key.find('.') + 1);
    EXPECT_THAT(text, HasSubstr("\n" + leaf + " = ")) << key;
  }
}

TEST(ConfigToml, OddValuesRoundTrip) {
  Config c;
  c.communication.batch_threshold_bytes = 513;          // not a multiple of 1 KiB
  c.communication.flush_interval = 1234567ns;           // not a whole microsecond
  c.communication.auth_token = std::string("a\0b\x01\x7f\r\n'\"\\", 11);
  c.server.checkpoint_interval = 90s;
  c.optimizer.learning_rate = 0.1 + 0.2;                // needs 17 digits
  c.optimizer.weight_decay = 1e300;
  c.optimizer.epsilon = 5e-324;                         // denormal
  c.cluster.servers = {{"::ffff:10.0.0.1", 1}, {"h", 65535}};
  ASSERT_TRUE(validate(c)) << validate(c).error().message();
  const std::string text = to_toml(c);
  auto back = parse_config(text, "printed.toml");
  ASSERT_TRUE(back) << back.error().message() << "\n" << text;
  EXPECT_EQ(*back, c) << text;
}

// ---------------------------------------------------------------------------
TEST(ConfigValidate, MetricsListenOnTheDataSocketUnderAnotherNameIsRefused) {
  const auto with = [](const std::string& data, const std::string& metrics) {
    return "[server]\nlisten = \"" + data + "\"\nmetrics_listen = \"" + metrics + "\"\n";
  };
  EXPECT_THAT(parse_error(with("127.0.0.1:7070", "127.0.0.1:7070")),
              HasSubstr("\"127.0.0.1:7070\" is also the server's data address"));
  for (const char* metrics : {"localhost:7070", "0.0.0.0:7070", "[::]:7070"}) {
    EXPECT_THAT(parse_error(with("127.0.0.1:7070", metrics)),
                HasSubstr("takes the same port as the server's data address \"127.0.0.1:7070\""))
        << metrics;
  }
  EXPECT_THAT(parse_error(with("0.0.0.0:7070", "127.0.0.1:7070")), HasSubstr("takes the same port"));
  // Other ports, or an IPv6 host beside an IPv4 wildcard, do not collide.
  parse_ok(with("127.0.0.1:7070", "localhost:7071"));
  parse_ok(with("0.0.0.0:7070", "[::1]:7070"));
  parse_ok(with("10.0.0.1:7070", "127.0.0.1:7070"));
  // Over shm the data address names a unix socket, not a TCP port.
  parse_ok("[communication]\ntransport = \"shm\"\n" + with("127.0.0.1:7070", "0.0.0.0:7070"));
}

TEST(ConfigValidate, RejectsBadProgrammaticConfigs) {
  Config c;
  c.cluster.servers.clear();
  EXPECT_THAT(validate(c, "code").error().message(),
              HasSubstr("code: key 'cluster.servers': is empty"));
  c = Config{};
  c.communication.transport = static_cast<Transport>(42);
  EXPECT_THAT(validate(c).error().message(),
              HasSubstr("config: key 'communication.transport': holds the out-of-range enum "
                        "value 42"));
  c = Config{};
  c.communication.auth_token = "\xff";
  EXPECT_THAT(validate(c).error().message(), HasSubstr("is not valid UTF-8"));
  c = Config{};
  c.cluster.servers = {{"", 80}};
  EXPECT_THAT(validate(c).error().message(), HasSubstr("key 'cluster.servers': element [0]"));
  c = Config{};
  c.server.listen = HostPort{"a b", 1};
  EXPECT_THAT(validate(c).error().message(),
              HasSubstr("key 'server.listen': host 'a b' is not a valid host name"));
  c = Config{};
  c.communication.flush_interval = -1ns;
  EXPECT_THAT(validate(c).error().message(),
              HasSubstr("key 'communication.flush_interval': is negative"));
  c = Config{};
  c.communication.cpu_affinity = {100000};
  EXPECT_THAT(validate(c).error().message(), HasSubstr("CPU 100000 does not exist"));
}

// ---------------------------------------------------------------------------
TEST(ConfigOverride, SetValueParsesCommandLineText) {
  Config c;
  ASSERT_TRUE(set_value(c, "communication.batch_threshold", "8KB"));
  EXPECT_EQ(c.communication.batch_threshold_bytes, 8192u);
  ASSERT_TRUE(set_value(c, "communication.batch_threshold", "1024"));
  EXPECT_EQ(c.communication.batch_threshold_bytes, 1024u);
  ASSERT_TRUE(set_value(c, "communication.transport", "shm"));
  EXPECT_EQ(c.communication.transport, Transport::kShm);
  ASSERT_TRUE(set_value(c, "communication.transport", "\"rdma\""));
  EXPECT_EQ(c.communication.transport, Transport::kRdma);
  ASSERT_TRUE(set_value(c, "communication.flush_interval", "5us"));
  EXPECT_EQ(c.communication.flush_interval, 5us);
  ASSERT_TRUE(set_value(c, "communication.record_pattern", "true"));
  EXPECT_TRUE(c.communication.record_pattern);
  ASSERT_TRUE(set_value(c, "communication.auth_token", "tok=en with spaces"));
  EXPECT_EQ(c.communication.auth_token, "tok=en with spaces");
  ASSERT_TRUE(set_value(c, "communication.auth_token", "\"quoted\\tvalue\""));
  EXPECT_EQ(c.communication.auth_token, "quoted\tvalue");
  ASSERT_TRUE(set_value(c, "optimizer.learning_rate", "0.5"));
  EXPECT_EQ(c.optimizer.learning_rate, 0.5);
  ASSERT_TRUE(set_value(c, "server.listen", "127.0.0.1:7071"));
  EXPECT_EQ(c.server.listen, (HostPort{"127.0.0.1", 7071}));
  ASSERT_TRUE(set_value(c, "server.listen", ""));
  EXPECT_FALSE(c.server.listen.has_value());
  ASSERT_TRUE(set_value(c, "cluster.servers", "a:1,b:2"));
  EXPECT_EQ(c.cluster.servers, (std::vector<HostPort>{{"a", 1}, {"b", 2}}));
  ASSERT_TRUE(set_value(c, "cluster.servers", "[\"c:3\"]"));
  EXPECT_EQ(c.cluster.servers, (std::vector<HostPort>{{"c", 3}}));
  const std::uint32_t cpu = first_allowed_cpu();
  ASSERT_TRUE(set_value(c, "communication.cpu_affinity", std::to_string(cpu)));
  EXPECT_EQ(c.communication.cpu_affinity, std::vector<std::uint32_t>{cpu});
  ASSERT_TRUE(set_value(c, "communication.cpu_affinity", "[]"));
  EXPECT_TRUE(c.communication.cpu_affinity.empty());
  ASSERT_TRUE(set_value(c, "server.checkpoint_dir", "/tmp/x y"));
  EXPECT_EQ(c.server.checkpoint_dir, "/tmp/x y");
}

TEST(ConfigOverride, SetValueErrors) {
  Config c;
  EXPECT_THAT(set_value(c, "communication.batch_treshold", "8KB").error().message(),
              HasSubstr("override: key 'communication.batch_treshold' is unknown; did you mean "
                        "'communication.batch_threshold'?"));
  EXPECT_THAT(set_value(c, "rank", "1").error().message(), HasSubstr("did you mean 'worker.rank'?"));
  EXPECT_THAT(set_value(c, "nothing.like.this", "1").error().message(),
              HasSubstr("keys are written table.key with a table of communication, cluster, "));
  // Nothing close in a known table: that table's keys.
  EXPECT_THAT(set_value(c, "communication.bogus", "1").error().message(),
              HasSubstr("override: key 'communication.bogus' is unknown; [communication] has: "
                        "transport, batch_threshold,"));
  EXPECT_THAT(set_value(c, "communication.transport", "udp").error().message(),
              HasSubstr("override: key 'communication.transport': \"udp\" is not a valid "
                        "transport"));
  EXPECT_THAT(set_value(c, "communication.channels", "lots").error().message(),
              HasSubstr("override: key 'communication.channels': must be an integer, got string "
                        "\"lots\""));
  EXPECT_THAT(set_value(c, "cluster.servers", "a:1,nope").error().message(),
              HasSubstr("element [1]: 'nope' has no port"));
  EXPECT_EQ(c, Config{});  // failed overrides change nothing
}

TEST(ConfigOverride, ApplyOverridesValidatesAtTheEnd) {
  Config c;
  const std::vector<std::string> ok{"cluster.num_workers=4", "worker.rank = 3",
                                    "communication.channels=8"};
  ASSERT_TRUE(apply_overrides(c, ok));
  EXPECT_EQ(c.cluster.num_workers, 4u);
  EXPECT_EQ(c.worker.rank, 3u);
  EXPECT_EQ(c.communication.num_channels, 8u);
  const std::vector<std::string> conflict{"worker.rank=9"};
  EXPECT_THAT(apply_overrides(c, conflict).error().message(),
              HasSubstr("overrides: key 'worker.rank': 9 is not below cluster.num_workers = 4"));
  const std::vector<std::string> no_eq{"worker.rank"};
  EXPECT_THAT(apply_overrides(c, no_eq).error().message(), HasSubstr("has no '='"));
}

TEST(ConfigOverride, TypedHelpers) {
  Config c;
  set_worker_rank(c, 5);
  EXPECT_EQ(c.worker.rank, 5u);
  EXPECT_THAT(validate(c).error().message(), HasSubstr("key 'worker.rank': 5 is not below"));
  c.cluster.num_workers = 6;
  EXPECT_TRUE(validate(c));
  ASSERT_TRUE(set_listen(c, "[::1]:0"));
  EXPECT_EQ(c.server.listen, (HostPort{"::1", 0}));
  EXPECT_THAT(set_listen(c, "nowhere").error().message(),
              HasSubstr("override: key 'server.listen': 'nowhere' has no port"));
  const std::vector<std::string> servers{"h1:7070", "h2:7070"};
  ASSERT_TRUE(set_servers(c, servers));
  EXPECT_EQ(c.cluster.servers.size(), 2u);
  const std::vector<std::string> dup{"h1:7070", "h1:7070"};
  EXPECT_THAT(set_servers(c, dup).error().message(), HasSubstr("is listed twice"));
}

// ---------------------------------------------------------------------------
TEST(HostPortParse, Forms) {
  EXPECT_EQ(*parse_host_port("127.0.0.1:7070"), (HostPort{"127.0.0.1", 7070}));
  EXPECT_EQ(*parse_host_port("ps-0.ember.svc:1"), (HostPort{"ps-0.ember.svc", 1}));
  EXPECT_EQ(*parse_host_port("[fe80::1]:65535"), (HostPort{"fe80::1", 65535}));
  EXPECT_EQ(parse_host_port("[fe80::1]:65535")->to_string(), "[fe80::1]:65535");
  EXPECT_EQ(*parse_host_port("0.0.0.0:0", true), (HostPort{"0.0.0.0", 0}));
  EXPECT_FALSE(parse_host_port("0.0.0.0:0"));
  EXPECT_FALSE(parse_host_port(""));
  EXPECT_FALSE(parse_host_port(":80"));
  EXPECT_FALSE(parse_host_port("host:"));
  EXPECT_FALSE(parse_host_port("host:80x"));
  EXPECT_FALSE(parse_host_port("host:123456"));
  EXPECT_FALSE(parse_host_port("[::1"));
  EXPECT_FALSE(parse_host_port("[::1]"));
  EXPECT_FALSE(parse_host_port("[zz]:1"));
  EXPECT_EQ(parse_host_port("h:99999").error().code(), ErrorCode::kConfig);
}

TEST(ConfigDerived, ResolvedChannels) {
  CommunicationConfig m;
  EXPECT_EQ(resolved_num_channels(m), 1u);  // auto: one I/O thread
  m.num_io_threads = 3;
  EXPECT_EQ(resolved_num_channels(m), 3u);
  m.cpu_affinity = {0, 1};
  EXPECT_EQ(resolved_num_channels(m), 2u);  // auto: pinned comm cores
  m.num_channels = 7;
  EXPECT_EQ(resolved_num_channels(m), 7u);
  m.num_channels = 0;
  m.cpu_affinity.assign(100, 0);
  EXPECT_EQ(resolved_num_channels(m), 64u);
}

TEST(ConfigDerived, CheckCpus) {
  const std::uint32_t cpu = first_allowed_cpu();
  const std::vector<std::uint32_t> ok{cpu};
  EXPECT_TRUE(check_cpus_available(ok, "k"));
  EXPECT_TRUE(check_cpus_available({}, "k"));
  const std::vector<std::uint32_t> missing{1u << 30};
  EXPECT_THAT(check_cpus_available(missing, "x.y").error().message(),
              HasSubstr("key 'x.y': CPU 1073741824 does not exist on this machine"));
}

// ---------------------------------------------------------------------------
// The shipped files.
const std::filesystem::path kConfigDir = std::filesystem::path(EMBER_SOURCE_DIR) / "config";

TEST(ShippedConfigs, EveryTomlUnderConfigLoads) {
  int count = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(kConfigDir)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".toml") continue;
    ++count;
    auto r = load_config_file(entry.path());
    EXPECT_TRUE(r) << entry.path() << ": " << (r ? "" : r.error().message());
  }
  EXPECT_GE(count, 4) << "config/ember.toml and config/examples/*.toml";
}

TEST(ShippedConfigs, DefaultFileHoldsTheDefaultsAndDocumentsEveryKnob) {
  const auto path = kConfigDir / "ember.toml";
  auto r = load_config_file(path);
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(*r, Config{}) << "config/ember.toml must spell out the built-in defaults";
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const std::string& key : known_keys()) {
    const std::string leaf = key.substr(key.find('.') + 1);
    EXPECT_THAT(text, HasSubstr("\n" + leaf + " = ")) << key << " is not in config/ember.toml";
  }
}

}  // namespace
}  // namespace ember::config
