// Handle: the caller's side of one asynchronous worker operation (init,
// push, pull, push_pull, barrier, set_learning_rate, checkpoint).
//
// An operation is made of parts — one reply per tensor chunk, plus one send
// completion per chunk sent zero-copy — completed by the worker's I/O
// threads. The operation is done when every part is in, or at the first
// error (a server's error reply, a lost connection, a send failure, or
// [worker] request_timeout passing). Errors reach the caller as values:
// wait() returns Result<std::uint64_t>, whose value is the operation's
// step: for init, pull and push_pull the step to compute next (the smallest
// over the tensor's chunks), for push the step pushed, for barrier its
// generation, for checkpoint the sequence number of the checkpoint written.
//
// Buffers passed to an operation (gradients, pull destinations) must stay
// valid and unchanged until the operation is done; after done, no worker
// thread touches them again (a reply that arrives after a timeout is
// dropped). That includes a gradient sent without a copy (a pool block over
// shm, any large gradient over tcp) that is still queued for the socket or
// lent to the server when the operation fails (request_timeout, an error
// reply): the operation is then done only once the transport is through with
// it, when its send completes or its connection closes. A server that stops
// reading is declared lost after [communication] heartbeat_timeout, which
// closes the connection, so such a failure can come up to about
// heartbeat_timeout after request_timeout. Over shm a bsp server keeps a
// lent gradient until its round folds it (ranks fold in rank order as their
// pushes arrive: at the latest when every rank has pushed that step); a
// round that waits for a lost rank (failed, or waited for under
// on_worker_loss = "wait") gives the lent block back at once (the server
// keeps a copy), so the error reply or request_timeout ends the operation
// on time.
//
// A stalled server (shm): a large message over shm is read by the server
// straight from the worker's memory, through the server's own mapping of it,
// and a pull reply may be written straight into its destination. When the
// connection closes because the server stopped answering (a paused or hung
// process, not a dead one), the server may wake up later with that memory
// still mapped. So the transport (common/transport/shm/shm_transport.h)
//  * keeps a pool block lent to it out of the pool until the server gives it
//    back (it can, after the close), is torn down or exits; and the push's
//    operation is done only then, or heartbeat_timeout after the close,
//    whichever comes first (an error is logged in the second case: memory
//    the caller then reuses may still be read by that process if it wakes);
//  * refuses the server's writes into the worker's memory from the close on,
//    and runs on_closed (which fails the pulls) only once no such write is in
//    progress (up to heartbeat_timeout).
// Restart a server that stalled for longer than heartbeat_timeout (it
// restores its newest checkpoint), or kill it, rather than let it resume.
// A pull that fails with request_timeout while its connection stays up is
// covered by its write window (worker.h, "Memory and copies"): the server's
// late reply writes nothing into its destination.
//
// Boost.Asio: async_wait(executor, token) completes with signature
// void(ember::Result<std::uint64_t>) on `executor` — a callback, a
// use_future, use_awaitable, or any other completion token.
//
// Thread-safety: a Handle is a shared reference; copies may be waited on from
// several threads at once. An empty (default) Handle is invalid: wait()
// returns kInvalidArgument.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>

#include "common/base/error.h"

namespace ember {

namespace transport {
class Connection;
}  // namespace transport

namespace worker_detail {

// Shared completion state. `mutex` also orders a reply's copy into the
// caller's buffer against the operation finishing (timeout): a copy happens
// only while the operation is not done.
struct Op {
  explicit Op(std::uint32_t parts) : remaining(parts) {}

  // Completes one part: with `step` (folded by min; nullopt for parts that
  // carry none, like send completions) or an error (the first error wins and
  // finishes the operation). Returns true if this call finished the
  // operation. Thread-safe.
  bool complete_part(std::optional<std::uint64_t> part_step);
  bool fail(Error error);
  // fail() with a kOutOfStep or kStale error from a server; runs
  // on_out_of_step with the step the server expects (the error reply's
  // step). Thread-safe.
  bool fail_out_of_step(Error error, std::uint64_t server_step);
  // Adds `n` parts before any can complete (used while issuing).
  void add_parts(std::uint32_t n);
  // A send that reads the caller's memory without a copy starts / has
  // finished (its completion ran, with any status). While any is in flight,
  // fail() and fail_out_of_step() record their error but do not finish the
  // operation; the last send_finished() does. send_finished returns true if
  // it finished the operation. Thread-safe.
  void send_started();
  bool send_finished();
  // True once an error is recorded (done, or waiting for its sends): the
  // request must not be re-sent. Takes `mutex`.
  bool failed();

  using Callback = std::function<void(Result<std::uint64_t>)>;
  // Runs `cb` once when done (at once, on this thread, when already done;
  // otherwise on the thread that finishes the operation).
  void on_done(Callback cb);

  Result<std::uint64_t> result_locked() const;

  std::mutex mutex;
  std::condition_variable cv;
  std::uint32_t remaining = 0;
  bool done = false;
  std::optional<Error> error;
  std::uint64_t step = ~std::uint64_t{0};
  bool step_set = false;
  std::uint32_t sends_in_flight = 0;          // see send_started()
  std::optional<std::uint64_t> out_of_step_at;  // fail_out_of_step's step, until done
  std::vector<Callback> callbacks;
  // Mirrors `done` (release store under `mutex`), so wait() can poll it
  // without the lock.
  std::atomic<bool> done_flag{false};
  // wait() polls done_flag this long (with sched_yield()) before it sleeps
  // on `cv` ([communication] busy_poll). Set before the Op is shared.
  std::chrono::nanoseconds busy_poll{0};
  // The shm connection the request went out on, under `mutex`: while wait()
  // polls, it consumes that connection's replies itself
  // (transport::Connection::poll) instead of waiting for the worker's I/O
  // thread to be scheduled. Empty over tcp and rdma.
  std::weak_ptr<transport::Connection> progress;
  // When the worker's timer fails the operation with kTimeout (issue time +
  // [worker] request_timeout). A call that has to wait for its server's
  // connection (a reconnect, a join, re-sends) waits no longer than this.
  // Set before the Op is shared.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // What the operation is, for its timeout and out-of-step errors: what()
  // returns `what_text` when set, else "<verb> of key <key> step <step> to
  // server <servers>" from the what_* fields. That text is formatted only
  // when an error needs it: formatted per request it was an allocation and
  // a format on every push and pull. All set before the Op is shared.
  std::string what_text;
  std::string_view what_verb;     // static storage (proto::msg_type_name)
  std::uint64_t what_key = 0;
  std::uint64_t what_step = 0;
  std::string_view what_servers;  // "0, 2": kept alive by `context`
  std::string what() const;
  // Keeps alive what what_servers, before_done and on_out_of_step refer to
  // (the worker's state of the key).
  std::shared_ptr<const void> context;
  // Runs under `mutex` just before the operation is marked done, so waiters
  // see its effects (the worker records a key's resume step here). Must not
  // block or touch this Op.
  std::function<void(const Result<std::uint64_t>&)> before_done;
  // Runs under `mutex` when fail_out_of_step finishes the operation, with
  // the server's step and the error's code (kOutOfStep or kStale), before
  // before_done (the worker moves the key's step there). Must not block or
  // touch this Op.
  std::function<void(std::uint64_t server_step, ErrorCode code)> on_out_of_step;

 private:
  void finish_locked(std::unique_lock<std::mutex>& lock);
  // fail() and fail_out_of_step() (with `out_of_step`): records the first
  // error, finishes unless sends are in flight.
  bool record_failure(Error error, std::optional<std::uint64_t> out_of_step);
};

}  // namespace worker_detail

class Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_ptr<worker_detail::Op> op) : op_(std::move(op)) {}

  // An already finished Handle (for errors found before anything was sent).
  static Handle failed(Error error);
  static Handle finished(std::uint64_t step);

  bool valid() const noexcept { return op_ != nullptr; }
  // True when done (successfully or not). Never blocks.
  bool ready() const;

  // Blocks until done. The worker's request_timeout bounds the wait (the
  // operation fails with kTimeout then), plus up to heartbeat_timeout for a
  // gradient sent without a copy that the transport still holds (file
  // comment). For up to [communication] busy_poll
  // it polls before it sleeps; over shm it consumes the replies of the
  // request's connection meanwhile (any request's, on this thread:
  // transport::Connection::poll), so a reply does not wait for the worker's
  // I/O thread to be scheduled. Errors: whatever the operation
  // failed with (the server's code and message, kClosed for a lost
  // connection, kTimeout), kInvalidArgument for an empty Handle.
  Result<std::uint64_t> wait() const;

  // Waits at most `timeout`. Errors: as wait(), plus kTimeout when the
  // operation is still running (it keeps running; wait again later). Both
  // that and an operation that itself timed out give kTimeout: ready()
  // tells them apart (false: still running). A
  // timeout of kWaitAsLongAsAnyRequest or more (nanoseconds::max()
  // included) waits like wait(): no operation outlives request_timeout
  // (whose maximum that is) by more than heartbeat_timeout, and clock
  // arithmetic on larger values overflows.
  Result<std::uint64_t> wait_for(std::chrono::nanoseconds timeout) const;
  static constexpr std::chrono::hours kWaitAsLongAsAnyRequest{24 * 365};

  // Boost.Asio: the handler runs on `executor` (posted) when the operation is
  // done, with the Result. Initiation never blocks.
  template <typename Executor, typename CompletionToken>
  auto async_wait(const Executor& executor, CompletionToken&& token) const {
    using Signature = void(Result<std::uint64_t>);
    return boost::asio::async_initiate<CompletionToken, Signature>(
        [op = op_, executor](auto handler) {
          auto shared = std::make_shared<decltype(handler)>(std::move(handler));
          auto deliver = [executor, shared](Result<std::uint64_t> r) {
            boost::asio::post(executor, [shared, r = std::move(r)]() mutable {
              (*shared)(std::move(r));
            });
          };
          if (!op) {
            deliver(Result<std::uint64_t>(tl::unexpected(
                Error(ErrorCode::kInvalidArgument, "async_wait on an empty Handle"))));
            return;
          }
          op->on_done(std::move(deliver));
        },
        token);
  }

 private:
  std::shared_ptr<worker_detail::Op> op_;
};

// Waits for every handle; returns the first error (all are waited for).
Status wait_all(const std::vector<Handle>& handles);

}  // namespace ember
