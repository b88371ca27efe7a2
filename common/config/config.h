// Ember configuration: plain structs with defaults, a TOML loader (toml11),
// validation and a printer.
//
// One Config describes a whole deployment: [communication] (the data path
// shared by server and worker), [cluster] (who talks to whom), [server],
// [optimizer] (applied on the server) and [worker]. Every field has a default,
// so an empty file is a valid config for one server and one worker on
// 127.0.0.1:7070. config/ember.toml documents every knob, its unit and its
// default; known_keys() lists them.
//
// Invariant: a Config returned by load_config_file / parse_config /
// validate() == ok has passed every check below, and to_toml() of it parses
// back to an equal Config (operator==).
//
// TOML spelling versus C++ names: TOML keys are the user-facing names
// ("batch_threshold = \"4KB\"", "channels = 4"); the C++ fields carry units and
// counts in their names (batch_threshold_bytes, num_channels). Each field's
// comment gives its TOML key. Sizes accept an integer (bytes) or a string with
// a unit as parsed by ember::parse_size_bytes ("4KB" = 4096: binary units).
// Durations are strings with a required unit as parsed by ember::parse_duration
// ("20us", "1.5s").
//
// Errors: every function returning Result/Status fails with ErrorCode::kConfig
// and a message of the form
//   "<file>:<line>: key 'communication.batch_threshold': <what is wrong>; <what to do>"
// (one line per problem; all problems found are reported, in file order).
// Values that did not come from a file (overrides, configs built in code) are
// reported as "<source>: key '...': ..." with the source named by the caller.
// No exception escapes this module: toml11's syntax and type errors, and
// std::bad_alloc from absurd input, are converted to Errors.
//
// Thread-safety: all functions are pure apart from reading the file and this
// process's CPU affinity mask (sched_getaffinity); they may be called from any
// thread concurrently. They allocate; none is meant for a hot path.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"

namespace ember::config {

// ---------------------------------------------------------------------------
// Enumerations. Each has to_string() (the TOML spelling) and is parsed from
// exactly that spelling; a bad string is an error that lists the valid ones.

// [communication] transport.
enum class Transport : std::uint8_t {
  kTcp,   // "tcp": Boost.Asio over TCP (any host)
  kShm,   // "shm": same-host shared memory (memfd pool + shared rings)
  kRdma,  // "rdma": rdma-core verbs, RC queue pairs
  kAuto,  // "auto": shm for a same-host (loopback) peer, else rdma if a port is active, else tcp
};

// [communication] pool_backing: which pages back the page pool.
enum class PoolBacking : std::uint8_t {
  kAuto,     // "auto": try hugetlb, then thp, then plain (the log says which was obtained)
  kHugetlb,  // "hugetlb": explicit 2 MiB hugepages (MFD_HUGETLB); fails if none are reserved
  kThp,      // "thp": transparent hugepages (madvise MADV_HUGEPAGE)
  kPlain,    // "plain": 4 KiB pages
};

// [communication] zero_copy: how large messages leave the page pool over TCP.
enum class ZeroCopy : std::uint8_t {
  kWritev,    // "writev": gathered write of header + pool payload
  kSendfile,  // "sendfile": sendfile(2) from the pool's memfd (not with a hugetlb memfd)
};

// [server] consistency.
enum class Consistency : std::uint8_t {
  kBsp,  // "bsp": bulk synchronous; step t+1 is served only after all pushes of step t
  kAsp,  // "asp": asynchronous; each push applied on arrival
  kSsp,  // "ssp": stale synchronous; a worker at most `staleness` steps ahead of the slowest
};

// [server] on_worker_loss.
enum class WorkerLossPolicy : std::uint8_t {
  kWait,    // "wait": a BSP round waits up to worker_timeout for the worker to return,
            // then the waiting workers get ErrorCode::kWorkerLost
  kShrink,  // "shrink": continue with the remaining workers
  kFail,    // "fail": every waiting worker gets ErrorCode::kWorkerLost
};

// [optimizer] type.
enum class OptimizerType : std::uint8_t {
  kSgd,       // "sgd": w -= lr * (g + weight_decay * w)
  kMomentum,  // "momentum": heavy ball (PyTorch SGD with momentum), optional Nesterov
  kAdam,      // "adam": Kingma & Ba 2015, L2 weight decay added to the gradient
  kAdamW,     // "adamw": Loshchilov & Hutter 2019, decoupled weight decay
  kAdagrad,   // "adagrad": Duchi et al. 2011, accumulator starts at initial_accumulator
};

// [server] log_level (spdlog level names).
enum class LogLevel : std::uint8_t { kTrace, kDebug, kInfo, kWarn, kError, kCritical, kOff };

std::string_view to_string(Transport v) noexcept;
std::string_view to_string(PoolBacking v) noexcept;
std::string_view to_string(ZeroCopy v) noexcept;
std::string_view to_string(Consistency v) noexcept;
std::string_view to_string(WorkerLossPolicy v) noexcept;
std::string_view to_string(OptimizerType v) noexcept;
std::string_view to_string(LogLevel v) noexcept;  // "trace" .. "critical", "off"

// ---------------------------------------------------------------------------
// A "host:port" address, as written in config files and on command lines.
// host is a DNS name, an IPv4 literal, or an IPv6 literal (written in
// brackets, "[::1]:7070", and stored without them). No name resolution here.
struct HostPort {
  std::string host;
  std::uint16_t port = 0;

  // "host:port", with brackets around an IPv6 literal.
  std::string to_string() const;
  bool operator==(const HostPort&) const = default;
};

// Parses "host:port". Port 0 (any free port) is accepted only when
// allow_port_zero (listen addresses). Errors: kConfig naming the text and the
// expected form, e.g. "'localhost' has no port; write host:port, e.g.
// '127.0.0.1:7070'".
[[nodiscard]] Result<HostPort> parse_host_port(std::string_view text, bool allow_port_zero = false);

// ---------------------------------------------------------------------------
// [communication]: the data path, shared by server and worker.
struct CommunicationConfig {
  // transport: "tcp" | "shm" | "rdma" | "auto".
  Transport transport = Transport::kTcp;
  // batch_threshold: small messages are packed into batches of at most this
  // many bytes; larger messages go alone. 512 B .. 1 MiB.
  std::uint64_t batch_threshold_bytes = 4096;
  // flush_interval: a partly filled batch is sent after this long; 0 = as
  // soon as the I/O thread gets to it (see config/ember.toml). 0 .. 1 s.
  std::chrono::nanoseconds flush_interval{0};
  // busy_poll: after its last event, an I/O thread, a shard thread and a
  // worker waiting on a Handle keep polling (with sched_yield()) this long
  // before they sleep; 0 = sleep at once. Over shm the waiting worker thread
  // consumes its connection's replies itself meanwhile (Handle::wait).
  // 0 .. 10 ms. See
  // docs/troubleshooting.md#throughput-drops for the trade-off.
  std::chrono::nanoseconds busy_poll{std::chrono::milliseconds(1)};
  // ring_buffer_size: slots per channel ring; a power of two, 2 .. 2^24.
  std::uint32_t ring_buffer_slots = 1024;
  // prealloc_pages: 2 MiB pages reserved for the page pool up front; 1 .. 2^20.
  std::uint32_t prealloc_pages = 128;
  // pool_backing: "auto" | "hugetlb" | "thp" | "plain".
  PoolBacking pool_backing = PoolBacking::kAuto;
  // channels: 0 = auto (see resolved_num_channels), else 1 .. 64.
  std::uint32_t num_channels = 0;
  // zero_copy: "writev" | "sendfile".
  ZeroCopy zero_copy = ZeroCopy::kWritev;
  // payload_checksum: true = a tcp frame's CRC32C covers its large payload
  // too; false = only its header and table (wire flag 0x0001), the payload
  // being left to TCP's own checksum. Small (batched) messages are always
  // covered. docs/wire-format.md#checksum.
  bool payload_checksum = false;
  // inline_write: bytes a sending thread writes to a tcp socket itself
  // before the I/O thread takes over; 0 = the I/O thread writes everything
  // (for I/O threads pinned to cores of their own). 0 .. 1 GiB.
  std::uint64_t inline_write_bytes = std::uint64_t{8} << 20;
  // cpu_affinity: CPU ids the I/O threads are pinned to (round robin); empty =
  // not pinned. Every id must exist and be in this process's affinity mask;
  // no duplicates.
  std::vector<std::uint32_t> cpu_affinity;
  // io_threads: I/O threads (one io_context each); 1 .. 256.
  std::uint32_t num_io_threads = 1;
  // heartbeat_interval: a heartbeat is sent after this much silence; > 0,
  // at most 24 h (heartbeat_timeout too).
  std::chrono::nanoseconds heartbeat_interval{std::chrono::seconds(1)};
  // heartbeat_timeout: a peer silent this long is dead; > heartbeat_interval.
  std::chrono::nanoseconds heartbeat_timeout{std::chrono::seconds(10)};
  // max_message_size: largest message accepted or sent; 512 B .. 1 TiB,
  // >= batch_threshold,
  // and >= [server] partition_bytes (a large chunk's data travels as a
  // message of its own, after its header's).
  std::uint64_t max_message_bytes = std::uint64_t{256} << 20;
  // max_queued_bytes: bytes a connection may hold queued for a slow receiver
  // before the sender waits or fails; >= max_message_size.
  std::uint64_t max_queued_bytes = std::uint64_t{256} << 20;
  // auth_token: shared secret checked at handshake; "" = none (loopback
  // only). At most 1024 bytes. Holds auth_token_file's token when that is set.
  std::string auth_token;
  // auth_token_file: a file holding the secret instead (read when the key is
  // set, one trailing newline dropped; auth_token then prints as ""): keeps
  // it off command lines. Not together with auth_token.
  std::string auth_token_file;
  // record_pattern: record per-channel head/tail positions and message sizes
  // (cluster.num_workers at most kMaxRecordedRanks).
  bool record_pattern = false;
  // record_path: base name of the recording; each process writes
  // <record_path>.server<i> or <record_path>.worker<r>. Required when
  // record_pattern = true.
  std::string record_path;

  bool operator==(const CommunicationConfig&) const = default;
};

// Channels to open: num_channels, or when it is 0 (auto) the number of comm
// cores, i.e. cpu_affinity.size() when pinned, else num_io_threads; clamped
// to 1 .. 64. Both ends must agree; the handshake carries the number.
std::uint32_t resolved_num_channels(const CommunicationConfig& comm) noexcept;

// [cluster]: the servers and the number of workers. Every process of a job
// must use the same [cluster] table: the key → server map depends on it.
struct ClusterConfig {
  // servers: "host:port" of every server, in server_index order; >= 1, no
  // duplicates, ports 1 .. 65535.
  std::vector<HostPort> servers{HostPort{"127.0.0.1", 7070}};
  // num_workers: workers in the job; 1 .. 2^20.
  std::uint32_t num_workers = 1;

  bool operator==(const ClusterConfig&) const = default;
};

// [server]: ember-server only.
struct ServerConfig {
  // listen: address to bind; nullopt ("" in TOML) = servers[server_index].
  // Port 0 binds any free port.
  std::optional<HostPort> listen;
  // server_index: this server's position in cluster.servers; < servers.size().
  std::uint32_t server_index = 0;
  // consistency: "bsp" | "asp" | "ssp".
  Consistency consistency = Consistency::kBsp;
  // staleness: ssp bound in steps (a worker may be this many steps ahead of
  // the slowest); 0 .. 1000000. Ignored unless consistency = "ssp".
  std::uint32_t staleness_steps = 2;
  // shards: shard threads, each owning a key range; 1 .. 1024.
  std::uint32_t num_shards = 1;
  // shard_cpu_affinity: CPU ids the shard threads are pinned to (round
  // robin). Parsing checks that they exist and do not repeat
  // (check_cpus_exist); the server process checks its own affinity mask at
  // start (server::check_shard_cpus), so a worker pinned elsewhere loads
  // the same file.
  std::vector<std::uint32_t> shard_cpu_affinity;
  // partition_bytes: tensors larger than this are cut into chunks spread over
  // servers and channels; 4 KiB .. 1 TiB.
  std::uint64_t partition_bytes = std::uint64_t{4} << 20;
  // checkpoint_dir: directory for checkpoints; "" = checkpoints off.
  std::string checkpoint_dir;
  // checkpoint_interval: time between checkpoints; 0 = only on SIGTERM (and
  // when a worker asks, Worker::checkpoint); otherwise >= 1 s.
  std::chrono::nanoseconds checkpoint_interval{0};
  // checkpoint_keep: newest checkpoints kept; >= 1.
  std::uint32_t checkpoint_keep = 3;
  // on_worker_loss: "wait" | "shrink" | "fail".
  WorkerLossPolicy on_worker_loss = WorkerLossPolicy::kWait;
  // worker_timeout: how long "wait" waits for a lost worker; > 0.
  std::chrono::nanoseconds worker_timeout{std::chrono::seconds(30)};
  // metrics_listen: "host:port" of the Prometheus HTTP endpoint; nullopt
  // ("" in TOML) = off. Port 0 binds any free port.
  std::optional<HostPort> metrics_listen;
  // log_level: "trace" | "debug" | "info" | "warn" | "error" | "critical" | "off".
  LogLevel log_level = LogLevel::kInfo;

  bool operator==(const ServerConfig&) const = default;
};

// [optimizer]: applied by the server's shards. Unitless hyper-parameters.
struct OptimizerConfig {
  // type: "sgd" | "momentum" | "adam" | "adamw" | "adagrad".
  OptimizerType type = OptimizerType::kSgd;
  // learning_rate: > 0, finite.
  double learning_rate = 0.01;
  // momentum: 0 <= m < 1 (type = "momentum").
  double momentum = 0.9;
  // nesterov: Nesterov momentum; only with type = "momentum".
  bool nesterov = false;
  // beta1, beta2: Adam/AdamW moment decay rates; 0 <= beta < 1.
  double beta1 = 0.9;
  double beta2 = 0.999;
  // epsilon: Adam/AdamW/Adagrad denominator term; > 0. Unset ("auto" in
  // TOML): the default of the type's PyTorch optimizer, see epsilon_or_default().
  std::optional<double> epsilon;
  // weight_decay: L2 (sgd, momentum, adam, adagrad) or decoupled (adamw); >= 0.
  // Unset ("auto"): PyTorch's default of the type, see weight_decay_or_default().
  std::optional<double> weight_decay;
  // initial_accumulator: Adagrad's starting accumulator value; >= 0
  // (PyTorch's initial_accumulator_value, whose default is 0 too).
  double initial_accumulator = 0.0;

  // The epsilon the optimizer uses: `epsilon` if set, else 1e-10 for adagrad
  // (torch.optim.Adagrad) and 1e-8 for the others (torch.optim.Adam, AdamW).
  double epsilon_or_default() const noexcept {
    if (epsilon) return *epsilon;
    return type == OptimizerType::kAdagrad ? 1e-10 : 1e-8;
  }
  // The weight decay the optimizer uses: `weight_decay` if set, else 0.01 for
  // adamw (torch.optim.AdamW) and 0 for the others.
  double weight_decay_or_default() const noexcept {
    if (weight_decay) return *weight_decay;
    return type == OptimizerType::kAdamW ? 0.01 : 0.0;
  }

  bool operator==(const OptimizerConfig&) const = default;
};

// [worker]: the client library.
struct WorkerConfig {
  // rank: this worker's rank; < cluster.num_workers (so < 2^20).
  std::uint32_t rank = 0;
  // request_timeout: a push/pull/barrier not answered in this time fails
  // with ErrorCode::kTimeout; > 0, at most 365 days.
  std::chrono::nanoseconds request_timeout{std::chrono::seconds(60)};
  // connect_timeout: one connection attempt to a server; > 0, at most 24 h.
  std::chrono::nanoseconds connect_timeout{std::chrono::seconds(10)};
  // connect_retries: further attempts after the first fails; 0 .. 1000000.
  std::uint32_t connect_retries = 20;
  // resend_attempts: when a connection to a server is lost for a reason a
  // reconnect can cure (reset, heartbeat timeout, server restart), the worker
  // reconnects (connect_retries each time) and re-sends the requests still
  // waiting on it, with the same request id, key, chunk and step (the server
  // applies a re-sent push once), at most this many times per request and
  // always within request_timeout. 0: such requests fail with kClosed at
  // once. 0 .. 100.
  std::uint32_t resend_attempts = 3;

  bool operator==(const WorkerConfig&) const = default;
};

// The whole configuration. New tables are added as new members (and rows in
// the field table in config.cc); nothing else needs to change.
struct Config {
  CommunicationConfig communication;
  ClusterConfig cluster;
  ServerConfig server;
  OptimizerConfig optimizer;
  WorkerConfig worker;

  bool operator==(const Config&) const = default;
};

// The address ember-server binds: server.listen, else
// cluster.servers[server.server_index]. pre: validate(config) succeeded.
HostPort effective_listen(const Config& config);

// ---------------------------------------------------------------------------
// Loading, validating, printing.

// Most worker ranks a pattern recording holds (record::RecorderOptions).
inline constexpr std::uint32_t kMaxRecordedRanks = 65536;

// Reads and parses a TOML file. Errors (kConfig): the file is missing or
// unreadable (naming the path and the errno text), a directory, larger than
// kMaxConfigFileBytes (also what a device such as /dev/urandom or an endless
// FIFO gives: reading stops there; a FIFO without a writer is waited for, as
// by any reader), a TOML syntax error (with file:line and
// toml11's explanation), and everything parse_config reports.
// Blocks on file I/O.
inline constexpr std::size_t kMaxConfigFileBytes = std::size_t{16} << 20;
[[nodiscard]] Result<Config> load_config_file(const std::filesystem::path& path);

// Parses TOML text; source_name is used in messages ("<name>:<line>: ...").
// Starts from the defaults, applies every key present, then validate()s.
// Errors (kConfig), each with file:line: TOML syntax; unknown table or key
// (with the closest known key suggested); wrong type; out-of-range value; bad
// size or duration unit; bad enum string (the valid ones listed); invalid
// host:port; a CPU id that does not exist or is not allowed here; a number
// that does not fit in 64 bits (toml11 would saturate it); cross-field
// conflicts (see validate). Text that is not valid UTF-8 (TOML requires it),
// larger than 16 MiB, nested deeper than 64 levels or with a dotted key of
// more than 64 parts is refused before toml11 sees it (toml11 3.7 recurses
// without a limit and mishandles invalid UTF-8 inside strings).
[[nodiscard]] Result<Config> parse_config(std::string_view toml_text,
                                          std::string_view source_name);

// Checks every range and cross-field rule of a Config built or modified in
// code (parse_config already did this for a loaded one). source_name prefixes
// each message. Cross-field rules: checkpoint_interval is 0 or >= 1 s;
// heartbeat_timeout > heartbeat_interval; max_message_size >= batch_threshold
// and >= partition_bytes; max_queued_bytes >= max_message_size;
// zero_copy = "sendfile" is refused with pool_backing = "hugetlb" (a hugetlb
// memfd cannot feed sendfile: EINVAL); record_pattern needs record_path and
// at most kMaxRecordedRanks workers;
// server_index < number of servers; worker rank < num_workers; nesterov only
// with type = "momentum"; metrics_listen differs from the data address.
// Field rules are those listed with each member above.
[[nodiscard]] Status validate(const Config& config, std::string_view source_name = "config");

// The effective configuration as TOML: every table and key, defaults
// included, one "# <unit and range>" comment per key. parse_config of the
// output yields a Config equal to `config` (for any valid config).
// Used by `ember-server --print-config`.
std::string to_toml(const Config& config);

// Every known key as "table.key" (e.g. "communication.batch_threshold"), in
// the order to_toml prints them.
std::vector<std::string> known_keys();

// ---------------------------------------------------------------------------
// Overrides (for command lines: --set table.key=value, --rank, --listen).
// Each checks the value's type, unit and range; cross-field rules are checked
// by validate(), which callers run once after applying all overrides
// (apply_overrides does).

// Sets one key from its textual value as it would be written on a command
// line: "8KB", "20us", "shm", "3", "true", "127.0.0.1:7071"; list keys take a
// TOML array ("[0, 1]", "[\"a:1\", \"b:2\"]") or comma-separated items
// ("0,1", "a:1,b:2"); string keys take the text as is (a TOML string literal
// "\"...\"" is unquoted). Errors (kConfig): unknown key (closest suggested),
// bad value; the message names "override" and the key.
[[nodiscard]] Status set_value(Config& config, std::string_view dotted_key, std::string_view value);

// Applies "table.key=value" assignments in order with set_value, then
// validate(config, "overrides"). Errors: an assignment
// without '=', and everything set_value and validate report. On error
// `config` may hold the assignments before the failing one.
[[nodiscard]] Status apply_overrides(Config& config, std::span<const std::string> assignments);
// The same without the final validate(), for a caller that changes more
// before it validates once (the C ABI sets the rank argument after them).
[[nodiscard]] Status set_values(Config& config, std::span<const std::string> assignments);

// Typed helpers for common CLI flags. set_listen and set_servers check the
// addresses (errors as set_value); set_worker_rank cannot fail: the rank is
// checked against cluster.num_workers by validate(), which callers run after.
void set_worker_rank(Config& config, std::uint32_t rank) noexcept;
[[nodiscard]] Status set_listen(Config& config, std::string_view host_port);
[[nodiscard]] Status set_servers(Config& config, std::span<const std::string> host_ports);

// ---------------------------------------------------------------------------
// Checks that every CPU id in `cpus` exists on this machine (< get_nprocs_conf())
// and is in this process's affinity mask (sched_getaffinity), and that none
// repeats. `key` names the list in messages ("communication.cpu_affinity").
// Errors (kConfig): "key '<key>': CPU 7 does not exist on this machine (CPUs
// 0-1); ..." / "... is not in this process's allowed CPUs (0-1, set by taskset
// or the cgroup cpuset); ..." / "... is listed twice; ...".
[[nodiscard]] Status check_cpus_available(std::span<const std::uint32_t> cpus,
                                          std::string_view key);

// The machine-wide half of check_cpus_available: every id exists
// (< get_nprocs_conf()) and none repeats; this process's affinity mask is not
// consulted. The parser checks server.shard_cpu_affinity this way, because
// every process of a job loads the same file and a worker pinned by taskset
// to one core must accept the cores its server's shards are given;
// ember-server checks the mask itself when it starts (and --check-config).
// Errors: the "does not exist" and "listed twice" errors above.
[[nodiscard]] Status check_cpus_exist(std::span<const std::uint32_t> cpus, std::string_view key);

}  // namespace ember::config
