// ember::Worker — the client library training code calls.
//
// A Worker is built from the same TOML config as the servers ([cluster]
// servers and num_workers, [communication], [worker] rank and timeouts). It
// connects to every server (retrying connect_retries times, so workers may
// start before the servers), checks with each that they share the [cluster]
// table (join), and then moves tensors:
//
//   init(key, shape, values)    register a float32 tensor; rank 0's values
//                               are the initial parameters, other ranks wait
//                               for them. Same shape again: no-op; other
//                               shape: kShapeMismatch. The reply says which
//                               step to compute next (rejoin after a restart).
//   push(key, gradient)         send this step's gradient
//   pull(key, out)              receive parameters that include every push
//                               this worker made (bsp: all workers' pushes of
//                               those steps; ssp: within the staleness bound)
//   push_pull(key, grad, out)   both, one round trip
//   barrier()                   every worker reaches it before anyone leaves
//   set_learning_rate(lr)       on every server, applied before the reply
//   checkpoint()                every server writes a checkpoint now
//
// Steps. The worker counts pushes per key: push and push_pull use step(key)
// and advance it; pull asks for parameters of step(key). init sets step(key)
// to the step the servers report (0 for a fresh job), so a restarted worker
// resumes where the job is. Overloads with an explicit step exist for callers
// that manage steps themselves (and for re-sending: a push re-sent with the
// same step is applied once). A push that fails gives its step back when no
// later push of that key was issued, so retrying the call pushes the same
// step again (applied once, whether or not the server saw the first try).
//
// Out of step (kOutOfStep). A server that restarted from a checkpoint older
// than the job's step (after kill -9 or a crash) cannot complete a bsp round
// for a step it never saw pushed; instead of letting the job wait until
// request_timeout, it refuses at once a push (bsp) or pull (bsp, ssp) whose
// step does not follow its own. The Handle fails with kOutOfStep, naming the
// request and the server's step, and step(key) is set to that step (a push
// refused so does not give its step back). To continue, pull(key, out) (at
// the new step(key): the parameters the server has) and go on pushing from
// there; every worker of the job gets the same error and resumes at the same
// step. asp and ssp pushes are accepted whatever their step (the server's
// clock for the worker jumps to it). Under bsp a pull with an explicit step
// for which this worker has not yet issued its pushes of the steps below is
// refused the same way (it would wait on itself): issue pushes first.
//
// Tensors larger than [server] partition_bytes travel as chunks, each to the
// server and channel common/placement assigns; a Handle completes when every
// chunk is answered.
//
// Memory and copies. allocate(bytes) hands out page-pool blocks; a gradient
// written into one leaves from there without a copy (tcp: a gathered write
// from the block; shm: by reference). A gradient in other memory is sent
// without a copy over tcp and copied once into a pool block over shm. Small
// chunks (below batch_threshold) are copied once into the channel's batch.
// A pull's parameters are copied once from the receive buffer into `out`;
// over shm, when `out` is a pool block (allocate()) and the chunk is above
// batch_threshold, the server writes them straight into `out` instead
// (proto::kFlagInPlace: one copy in all, made by the server, none here).
// The server writes through a write window the worker opened for that
// request (transport::Connection::open_write_window); the worker closes it
// when the reply is in or when it gives up (request_timeout), and the pull's
// Handle is done only after that: a late reply then writes nothing, so `out`
// is the caller's again once wait() returned, whatever the result.
//
// Lost connections. When a connection to a server closes for a reason a
// reconnect can cure (peer reset or crash, heartbeat timeout, orderly close
// by a restarting server), the requests still waiting on it are not failed:
// a per-server re-sender thread reconnects (connect_retries with back-off),
// joins again, and re-sends them in issue order with the same request id,
// key, chunk and step — the server applies a re-sent push once (it
// deduplicates by worker, key and step; a server restored from a checkpoint
// takes it as new when the step follows the checkpoint's, and refuses it
// with kOutOfStep when the checkpoint is older: see "Out of step"). Each
// request is re-sent at most [worker] resend_attempts times (a failed
// reconnect counts), and its operation
// still fails at request_timeout (kTimeout, naming the server and the
// attempt). While re-sends for a server are queued, new requests to it wait
// (at most request_timeout) so they do not overtake them. Not re-sent:
// resend_attempts = 0, protocol errors (the worker closed the connection),
// a refused join (another [cluster] table, or settings that differ from
// another server's: see create()), the Worker's own destruction;
// those requests fail with kClosed ("connection to server <i> (<addr>) lost
// before the reply: ..."). Re-sending reads the caller's gradient again, so
// buffers must stay valid until the operation is done (handle.h). Once a
// whole round of reconnect attempts to a server has failed (all of
// connect_retries, or half a request_timeout or more of them cut short when
// a request's request_timeout ran out), a new request to it makes a single
// attempt (kIo/kTimeout "cannot connect ... 1 attempt") until a connect
// succeeds again: after the re-sender gave up, later calls fail at once
// instead of each waiting out connect_retries.
//
// Asynchrony. Every call returns a Handle (handle.h); wait() or
// async_wait() gives the Result. Errors found before sending (unknown key,
// wrong sizes) come back as an already failed Handle. A call returns once
// its request is handed to the transport: at once while its server's
// connection is up and its channel has room (a full send queue,
// [communication] max_queued_bytes, or a full shm ring makes the call wait
// for the server to drain it, up to 30 s, then kTimeout). When the
// connection is being re-established (by the re-sender or another call), or
// re-sends are queued, the call waits for that, never past its
// request_timeout: its Handle then fails with kTimeout naming the server and
// what it waited for. A call that finds the
// connection lost and nobody reconnecting makes the attempt itself: it
// starts no attempt after its request_timeout, but one under way may last
// up to connect_timeout, and the join that follows a successful connect up
// to request_timeout. A pipeline()'s flush() sends, so it may wait the same
// way, and so may an enqueue() that finds its channel's ring full (it then
// sends what is queued). Calls from different
// threads may overlap, on one key too: a call takes its step and hands its
// request to the channel in one step (per key, under a lock), so the
// requests of a key leave in step order whichever threads issue them, and
// the server applies each once. A call that finds another thread's request
// of the key still being handed over (e.g. reconnecting) waits for it at
// most request_timeout (then kTimeout, nothing sent) before its own
// request_timeout starts. A direct request, or a pipelined one from another
// thread, first sends the key's requests still queued in a pipeline (a
// ring's lanes keep no order between threads). One exception to "each
// push applied": a failed push gives its step back for the retry (see
// push), so when several threads push one key, the next thread's push can
// take that step and, if the failed one had reached the server after all,
// be acknowledged as its duplicate without being applied.
//
// When a push is done. Over shm a gradient in pool memory larger than a
// batch is not copied: the server reads it in place and gives the block back
// once it has used it, and the push's Handle is done only then (the caller
// may not change the block before). Under bsp the server uses it when the
// round completes, i.e. when every worker has pushed that key's step. So a
// worker that waits for a large push before it issues its next one can stall
// its peers: rank 0 waits on key A while rank 1 waits on key B, each round
// needing the other's next push (until request_timeout). Issue every push
// of a step, then wait (as a training step does; pipeline() and push_pull
// work the same way), or wait on the pull that follows. Over tcp, and for
// small gradients, a push is done when the server has received it.
//
// pipeline() returns a scope for many small tensors: enqueue() from any
// thread puts the request in its channel's MPSC ring without sending;
// flush() (and leaving the scope) hands everything queued to the transport,
// whose framer packs small messages into batches; wait() flushes and
// returns when every reply is in.
//
// Recording. With [communication] record_pattern, every request entering
// and leaving a channel (its ring in a pipeline; straight through
// otherwise) is recorded with its bytes (common/record) to
// "<record_path>.worker<rank>", closed when the Worker is destroyed.
// Off, it costs one branch per request.
//
// Thread-safety: all Worker and Pipeline methods may be called from any
// thread, except create/destruction. Blocking: create() (connect, join);
// Handle::wait; a call, flush() or an enqueue() into a full ring while its
// server's connection is being re-established (bounded: see Asynchrony);
// allocate never blocks. The Worker must outlive its Handles'
// operations, its TensorBuffers and its Pipelines.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/base/error.h"
#include "common/config/config.h"
#include "worker/handle.h"

namespace ember {

namespace memory {
class PagePool;
}

using Key = std::uint64_t;

// A float32 buffer in the worker's page pool. Above the largest block class
// (64 MiB) it spans consecutive 64 MiB blocks when the pool can carve them
// contiguously (a fresh region can); otherwise, or when the pool is
// exhausted, it is heap memory (in_pool() false: shm then copies it once
// into pool blocks when sending). Move-only; freed on destruction. The
// Worker must outlive it.
class TensorBuffer {
 public:
  TensorBuffer() = default;
  TensorBuffer(TensorBuffer&&) noexcept;
  TensorBuffer& operator=(TensorBuffer&&) noexcept;
  TensorBuffer(const TensorBuffer&) = delete;
  TensorBuffer& operator=(const TensorBuffer&) = delete;
  ~TensorBuffer();

  std::span<std::byte> bytes() const noexcept { return {data_, size_}; }
  // The bytes as float32 (size_bytes / 4 elements).
  std::span<float> floats() const noexcept {
    return {reinterpret_cast<float*>(data_), size_ / sizeof(float)};
  }
  std::size_t size_bytes() const noexcept { return size_; }
  bool in_pool() const noexcept { return pool_ != nullptr; }
  bool empty() const noexcept { return data_ == nullptr; }

 private:
  friend class Worker;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  memory::PagePool* pool_ = nullptr;  // null: heap
  std::uint64_t block_offset_ = 0;
  std::uint32_t num_blocks_ = 0;  // pool blocks spanned (> 1 only above 64 MiB)
  void release() noexcept;
};

class Pipeline;

class Worker {
 public:
  // Connects to every server and joins. Errors: kConfig (invalid config,
  // a server with another [cluster] table, two servers
  // whose consistency, staleness, on_worker_loss, optimizer type or
  // configured [optimizer] numbers differ: see the join reply in
  // docs/wire-format.md; after a reconnect, requests to such a server fail
  // with the same error), kIo / kTimeout
  // (a server unreachable after connect_retries), kAuth / kVersionMismatch /
  // kProtocol (the handshake refused), kUnavailable (transport "rdma" with
  // no active RDMA port; pool_backing "hugetlb" or "thp" that this host
  // cannot give; a server refused the join because this rank is connected
  // already, still so after connect_retries: two workers given one rank, or
  // a predecessor not yet declared lost), kIo (record_pattern on and the
  // recording file cannot be created; pre-faulting the pool failed),
  // kInternal (out of memory).
  static Result<std::unique_ptr<Worker>> create(const config::Config& config);
  // Loads `path` (config::load_config_file), applies `overrides`
  // ("table.key=value"), then create().
  static Result<std::unique_ptr<Worker>> create_from_file(
      const std::filesystem::path& path, std::span<const std::string> overrides = {});

  ~Worker();  // closes the connections; running operations fail with kClosed
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  std::uint32_t rank() const noexcept;
  std::uint32_t num_workers() const noexcept;
  std::uint32_t num_servers() const noexcept;
  const config::Config& config() const noexcept;

  // A pool buffer of `bytes` (rounded to nothing: size_bytes() == bytes).
  // Never blocks. Falls back to heap memory when the pool cannot hold it
  // (see TensorBuffer); throws std::bad_alloc when that fails too.
  TensorBuffer allocate(std::size_t bytes);

  // Registers `key` as a float32 tensor of `shape` (product = elements;
  // up to 8 dims, a scalar has none). Rank 0 must pass the initial values
  // (values.size() == elements); other ranks may pass an empty span.
  // Errors (in the Handle): kInvalidArgument (sizes; from the server: a
  // chunk layout other than its partition_bytes and server list give, i.e.
  // workers and servers configured differently), kTooLarge (the tensor
  // is larger than this host's physical memory: every rank pulls all of it),
  // kShapeMismatch (the key exists with another shape), kWorkerLost (rank 0
  // lost while waiting), and the connection errors of push: kClosed,
  // kTimeout, kIo, kAuth / kVersionMismatch / kProtocol, kConfig (a
  // reconnect's join refused, see create). After a failed init the key is not this worker's:
  // its pushes and pulls fail with kNotFound until an init succeeds (with
  // any shape). Wait for init before pushing the key: a push issued while
  // its init is still in flight goes out whatever the init's outcome.
  Handle init(Key key, std::span<const std::uint64_t> shape, std::span<const float> values);

  // Errors: kNotFound (key not init-ed by this worker, or its init failed,
  // or unknown on the server), kInvalidArgument (gradient.size() != elements;
  // an explicit step of 2^53 or more; or, from the server, a step more than
  // 64 steps past the key's open round: pull first), kShapeMismatch,
  // kStale (bsp: the step's round closed without this worker, e.g. left
  // out by on_worker_loss = "shrink" while it was lost; ssp: a step this
  // worker skipped when it came back after such a loss; step(key) moves up
  // to the server's step: pull, then push from there), kOutOfStep (bsp: the
  // server is at an earlier step for this worker, e.g. restored from an
  // older checkpoint; step(key) is now the server's step, see "Out of step"),
  // kClosed (connection lost and not re-sent, or re-sending gave up; see
  // "Lost connections"), kTimeout, kIo ("cannot connect ... 1 attempt":
  // the server stayed unreachable), kAuth / kVersionMismatch (a reconnect
  // was refused), kProtocol (a reply of the wrong size).
  Handle push(Key key, std::span<const float> gradient);
  Handle push(Key key, std::span<const float> gradient, std::uint64_t step);

  // Errors: kNotFound, kInvalidArgument (out.size() != elements, or an
  // explicit step of 2^53 or more), kWorkerLost (a worker this step needs is
  // gone, per on_worker_loss),
  // kOutOfStep (bsp/ssp: the step asked needs pushes of this worker the
  // server never received; step(key) is now the server's step, unless
  // pushes of the key from this worker are still unanswered: then the pull
  // overtook them, and step(key) stays), kClosed, kTimeout, and kIo /
  // kAuth / kVersionMismatch / kProtocol as for push.
  Handle pull(Key key, std::span<float> out);
  Handle pull(Key key, std::span<float> out, std::uint64_t step);

  // Errors: those of push and pull (kOutOfStep from the push part: bsp).
  Handle push_pull(Key key, std::span<const float> gradient, std::span<float> out);
  Handle push_pull(Key key, std::span<const float> gradient, std::span<float> out,
                   std::uint64_t step);

  // Returns the barrier's generation (0, 1, ... since server 0 started).
  // Barriers are numbered per worker (a restarted worker goes on from its
  // predecessor's number): server 0 answers a re-sent one once, and a
  // worker's barriers called before the previous ones finished enter the
  // following generations in order. Failed barriers give their numbers back
  // once no later one is outstanding, so retries are the same barriers.
  // Errors: kWorkerLost (a worker is gone, per on_worker_loss), kClosed,
  // kTimeout, kInvalidArgument (16 of this worker's barriers wait already;
  // a re-sent barrier older than the answers server 0 keeps), kCancelled
  // (it came on a connection that a newer join of this rank replaced), and
  // kIo / kAuth / kVersionMismatch / kProtocol / kConfig from a reconnect,
  // as for push and init.
  Handle barrier();
  // Errors: kInvalidArgument (lr <= 0 or not finite), kClosed, kTimeout, and
  // the reconnect errors of barrier.
  Handle set_learning_rate(double learning_rate);
  // Asks every server to write a checkpoint now. Errors: kConfig (a server
  // has no checkpoint_dir), kIo (the write failed), kTooLarge (a server's
  // checkpoint numbering is at 2^53), kCancelled (a server shut down first),
  // kClosed, kTimeout, and the reconnect errors of barrier.
  Handle checkpoint();

  // The next step push(key) will use; 0 for a key not init-ed. After a
  // kOutOfStep error: the step the refusing server expects (except after a
  // pull that overtook this worker's own unanswered pushes; see pull).
  std::uint64_t step(Key key) const;

  Pipeline pipeline();

  // Requests whose request_timeout deadline the worker still tracks: those in
  // flight, plus finished ones not yet dropped. Finished ones are dropped
  // from the front as requests are issued, and the whole queue is swept when
  // it reaches twice its size after the last sweep (at least 64); so while
  // one request stays pending, this stays below about twice the most
  // requests in flight at once since it was issued, plus 64. Memory per
  // request is released when it finishes, not when its deadline passes. For
  // tests and diagnostics. Thread-safe.
  std::size_t tracked_deadlines() const;

  // Requests sent and waiting for their reply (all servers). A request whose
  // operation has failed (timed out, or an error from another of its
  // servers) leaves within about 0.5 s, even while its server stays
  // connected and never answers. For tests and diagnostics. Thread-safe.
  std::size_t pending_requests() const;

 private:
  friend class Pipeline;
  Worker();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A batching scope over a Worker; see the file comment. Move-only; leaving
// the scope flushes (without waiting).
class Pipeline {
 public:
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) = delete;
  Pipeline(const Pipeline&) = delete;
  ~Pipeline();

  // Queue a push / pull / push_pull (same meaning and errors as Worker's).
  // Any thread. Sends by itself only when a channel's ring is full (then
  // that channel is flushed to make room) or when the key's previous
  // pipelined request came from another thread (the key's rings are flushed
  // first, to keep its steps in order); may wait for another thread's
  // request of the key (see "Asynchrony").
  Handle enqueue(Key key, std::span<const float> gradient);
  Handle enqueue_pull(Key key, std::span<float> out);
  Handle enqueue_push_pull(Key key, std::span<const float> gradient, std::span<float> out);

  // Sends everything queued (through the transport's batches) and flushes
  // the batches. Errors: the first send error (that operation's Handle has
  // it too).
  Status flush();
  // flush(), then waits for every Handle enqueued through this scope.
  // Returns the first error: any of enqueue's (Worker's push / pull /
  // push_pull errors, kOutOfStep included: then step(key) of that key is
  // the server's step) or flush's.
  Status wait();

 private:
  friend class Worker;
  explicit Pipeline(Worker::Impl* impl);
  Worker::Impl* impl_ = nullptr;
  std::vector<Handle> handles_;
  std::unique_ptr<std::mutex> mutex_;  // guards handles_
};

}  // namespace ember
