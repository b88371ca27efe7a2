// Server: one ember-server process — transport listener, shard threads,
// checkpoints and metrics, wired together.
//
// Data path: the transport's I/O threads call on_message; there the message
// is decoded (proto::decode trusts nothing), checked against the connection's
// rank, and routed to the shard that owns (key, chunk) through that shard's
// MPSC ring (I/O threads are the producers). Over shm, a push, pull or
// push_pull of a chunk of at most 64 KiB is handled by the I/O thread itself
// when its shard is idle (Shard::try_handle_inline: under the shard's
// consumer lock, so the core still has one owner at a time; metric
// ember_server_requests_inline_total). Large tensor payloads are adopted
// from the transport's receive Buffer without a copy (a page-pool block for
// tcp). Shards reply through ServerSink: a pull's parameters are copied once
// into the worker's memory (shm, in place; streamed past the cache for a
// tensor of a quarter of the last-level cache or more) or into a pool block
// (the snapshot a reply needs, since the parameters change afterwards) and
// sent from there.
//
// Control: join, set_learning_rate and checkpoint requests are handled off
// the shards' data path. Worker loss: when the last connection of a rank
// closes (heartbeat timeout, reset, close), every shard gets kWorkerLost; when
// a connection of the rank is accepted again and its join succeeds (or, for
// a client without a join, at its first request), kWorkerBack (it rejoins).
// A connection whose first message is a refused join (another [cluster]
// table, partition_bytes) is answered, closed, and never counted for its
// rank.
//
// Bad requests: a malformed message closes that connection (logged once with
// the peer); a well-formed request the store refuses gets an error reply
// (logged at warn, first few per connection). Other workers carry on.
//
// Observability: metrics on [server] metrics_listen (ember_server_entries
// counts the tensor chunks stored, as of each shard's last batch;
// ember_pool_backing_info{backing} says what backs the page pool). With
// [communication] record_pattern, the requests that enter and leave the
// shard rings are recorded per channel and sender rank (common/record) to
// "<record_path>.server<server_index>", closed at shutdown().
//
// Lifecycle: create() restores the newest valid checkpoint, starts shards,
// listener, checkpoint thread and metrics; shutdown() stops accepting,
// closes connections, drains the shards, writes a final checkpoint (when
// checkpoint_dir is set) and stops everything. Thread-safety: create,
// shutdown and the accessors from the owning thread; checkpoint_now from any
// thread but the server's own (see there).
#pragma once

#include <array>

#include <cstdint>
#include <memory>
#include <string>

#include "common/base/error.h"
#include "common/config/config.h"

namespace ember::server {

class Server {
 public:
  // Errors: kConfig (unusable settings, e.g. a checkpoint from another
  // optimizer type), kIo (bind,
  // threads, checkpoint directory, the recording file), kUnavailable (another
  // live ember-server holds checkpoint_dir's lock), kCorrupt or
  // kInvalidArgument (the checkpoint being restored passed its checksums but
  // holds an entry the store refuses: sizes that do not fit its shape,
  // optimizer state of another size, an entry twice; move the file aside),
  // and the pool's and transport's errors.
  static Result<std::unique_ptr<Server>> create(const config::Config& config);
  ~Server();  // shutdown() if not done

  // Bound addresses: the data listener and the metrics endpoint ("" when off).
  std::string address() const;
  std::string metrics_address() const;

  // Drains and checkpoints as described above. Idempotent. Returns the final
  // checkpoint's error, if writing it failed (the server is stopped anyway).
  Status shutdown();

  // The watchdog's liveness check (ember-server pings systemd's WATCHDOG=1
  // only after it passes): whether every shard thread and every transport
  // I/O thread took the probe posted at the previous call; then posts the
  // next ones (a thread whose probe is still queued gets none). Call it from
  // one thread, once per watchdog tick, before shutdown() (ember-server
  // withholds the ping after two failures in a row): a thread stuck for a
  // whole tick fails it. The first call passes. Errors: kTimeout naming the
  // shard threads and I/O threads whose probe is still queued.
  Status check_liveness();

  // Writes a checkpoint now and waits for it; returns its sequence number
  // (the one in its file name). Errors: kConfig when checkpoint_dir is
  // empty, kIo from the write, kTooLarge when the sequence would pass 2^53
  // (checkpoint.h), kCancelled when the server shuts down first. Any thread
  // except an I/O or shard thread.
  Result<std::uint64_t> checkpoint_now();

 private:
  Server();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What `ember-server --check-config` checks beyond config::validate: that
// server.metrics_listen (when set) resolves, as the metrics endpoint
// resolves it at start; that the listen address (server.listen, else its
// cluster.servers entry) of a tcp, rdma or auto server resolves, and that one
// which is not a loopback address has an auth_token (as the tcp and rdma
// listeners demand at start; shm is not checked). Resolves names with the
// system resolver (blocking). Errors: kConfig naming the address and the key
// to set; kInvalidArgument/kIo from resolving, naming the keys that give the
// address.
Status check_listen_address(const config::Config& config);

// What ember-server checks of server.shard_cpu_affinity before it starts (and
// in --check-config): every CPU is in this process's affinity mask (config::
// check_cpus_available). Parsing checks only that the CPUs exist, because
// workers, pinned elsewhere, load the same file. Errors: kConfig naming the
// key, the CPU and the allowed CPUs.
Status check_shard_cpus(const config::Config& config);

// The [optimizer] numbers the server's join reply digests (proto::
// optimizer_check): learning_rate (as configured), momentum, beta1, beta2,
// epsilon, weight_decay, initial_accumulator, each 0 when `o.type` does not
// use it, and -0.0 as 0.0, so that only configs that update differently
// differ.
std::array<double, 7> optimizer_numbers(const config::OptimizerConfig& o);

// What `ember-server --check-config` checks of server.checkpoint_dir (when
// set), without creating it: an existing path must be a directory this
// process can create files in; a missing one needs its nearest existing
// parent to be such a directory (the start creates it). Tries by creating
// and removing a probe file ".ember-write-probe-<pid>".
// Errors: kConfig naming the key, the path and why (errno text).
Status check_checkpoint_dir(const config::Config& config);

// What `ember-server --check-config` notes, without failing, of an existing
// server.checkpoint_dir: whether a live server of this server_index holds it
// (check_checkpoint_dir_free; creates and writes nothing). A start would be
// refused until it stops, which is expected when checking the config of a
// running server before restarting it. Errors: kUnavailable naming the pid.
Status checkpoint_dir_free(const config::Config& config);

// What `ember-server --check-config` checks of communication.record_path
// when record_pattern is on: the recording "<record_path>.server<i>" needs
// an existing directory this process can create files in (the recorder
// creates none). Probes it as check_checkpoint_dir does. Errors: kConfig
// naming the key, the file and why.
Status check_record_path(const config::Config& config);

}  // namespace ember::server
