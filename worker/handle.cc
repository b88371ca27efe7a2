// Operation completion state and waiting; see handle.h.
#include "worker/handle.h"

#include "common/transport/transport.h"

#include <sched.h>

#include <algorithm>

#include <fmt/format.h>

namespace ember {
namespace worker_detail {

std::string Op::what() const {
  if (!what_text.empty() || what_verb.empty()) return what_text;
  return fmt::format("{} of key {} step {} to server {}", what_verb, what_key, what_step, what_servers);
}

Result<std::uint64_t> Op::result_locked() const {
  if (error) return tl::unexpected(*error);
  return step_set ? step : 0;
}

void Op::finish_locked(std::unique_lock<std::mutex>& lock) {
  if (out_of_step_at && on_out_of_step) on_out_of_step(*out_of_step_at, error->code());
  if (before_done) before_done(result_locked());
  done = true;
  // release: a waiter that sees the flag and then takes `mutex` reads the
  // result; the flag alone only ends its polling.
  done_flag.store(true, std::memory_order_release);
  std::vector<Callback> cbs = std::move(callbacks);
  callbacks.clear();
  const Result<std::uint64_t> r = result_locked();
  lock.unlock();
  cv.notify_all();
  for (auto& cb : cbs) cb(r);
}

bool Op::complete_part(std::optional<std::uint64_t> part_step) {
  std::unique_lock lock(mutex);
  if (done) return false;
  if (part_step) {
    step = std::min(step, *part_step);
    step_set = true;
  }
  if (remaining > 0) --remaining;
  if (remaining != 0) return false;
  finish_locked(lock);
  return true;
}

bool Op::record_failure(Error e, std::optional<std::uint64_t> out_of_step) {
  std::unique_lock lock(mutex);
  if (done || error) return false;  // the first error wins
  error = std::move(e);
  out_of_step_at = out_of_step;
  if (sends_in_flight > 0) return false;  // the last send_finished() finishes it
  finish_locked(lock);
  return true;
}

bool Op::fail(Error e) { return record_failure(std::move(e), std::nullopt); }

bool Op::fail_out_of_step(Error e, std::uint64_t at) { return record_failure(std::move(e), at); }

void Op::send_started() {
  std::lock_guard lock(mutex);
  ++sends_in_flight;
}

bool Op::send_finished() {
  std::unique_lock lock(mutex);
  if (sends_in_flight > 0) --sends_in_flight;
  if (done || !error || sends_in_flight > 0) return false;
  finish_locked(lock);
  return true;
}

bool Op::failed() {
  std::lock_guard lock(mutex);
  return done || error.has_value();
}

void Op::add_parts(std::uint32_t n) {
  std::lock_guard lock(mutex);
  remaining += n;
}

void Op::on_done(Callback cb) {
  std::unique_lock lock(mutex);
  if (!done) {
    callbacks.push_back(std::move(cb));
    return;
  }
  const Result<std::uint64_t> r = result_locked();
  lock.unlock();
  cb(r);
}

}  // namespace worker_detail

Handle Handle::failed(Error error) {
  auto op = std::make_shared<worker_detail::Op>(0);
  op->fail(std::move(error));
  return Handle(std::move(op));
}

Handle Handle::finished(std::uint64_t step) {
  auto op = std::make_shared<worker_detail::Op>(1);
  op->complete_part(step);
  return Handle(std::move(op));
}

bool Handle::ready() const {
  if (!op_) return false;
  std::lock_guard lock(op_->mutex);
  return op_->done;
}

namespace {
// Polls op.done_flag for up to min(op.busy_poll, limit); true when it is set.
// Over shm it consumes the request's connection meanwhile
// (transport::Connection::poll), so the reply need not wait for the worker's
// I/O thread: on 2 cores that thread shares a core with another busy one,
// and each hand-over between them was a context switch (several
// microseconds) on the path of every reply.
bool poll_done(worker_detail::Op& op, std::chrono::nanoseconds limit) {
  const std::chrono::nanoseconds budget = std::min(op.busy_poll, limit);
  if (budget.count() <= 0) return false;
  std::shared_ptr<transport::Connection> conn;
  {
    std::lock_guard lock(op.mutex);
    conn = op.progress.lock();
  }
  const auto end = std::chrono::steady_clock::now() + budget;
  do {
    // acquire pairs with the release store in finish_locked().
    if (op.done_flag.load(std::memory_order_acquire)) return true;
    if (conn && conn->poll()) continue;
    sched_yield();
  } while (std::chrono::steady_clock::now() < end);
  return op.done_flag.load(std::memory_order_acquire);
}
}  // namespace

Result<std::uint64_t> Handle::wait() const {
  if (!op_) return make_error(ErrorCode::kInvalidArgument, "wait on an empty Handle");
  (void)poll_done(*op_, op_->busy_poll);
  std::unique_lock lock(op_->mutex);
  // The worker's timer fails the operation at its deadline, so this ends.
  op_->cv.wait(lock, [&] { return op_->done; });
  return op_->result_locked();
}

Result<std::uint64_t> Handle::wait_for(std::chrono::nanoseconds timeout) const {
  if (!op_) return make_error(ErrorCode::kInvalidArgument, "wait on an empty Handle");
  if (timeout >= kWaitAsLongAsAnyRequest) return wait();
  (void)poll_done(*op_, timeout);
  std::unique_lock lock(op_->mutex);
  if (!op_->cv.wait_for(lock, timeout, [&] { return op_->done; })) {
    return make_error(ErrorCode::kTimeout, "operation still running after {} ms",
                      std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
  }
  return op_->result_locked();
}

Status wait_all(const std::vector<Handle>& handles) {
  Status first;
  for (const Handle& h : handles) {
    auto r = h.wait();
    if (!r && first) first = tl::unexpected(r.error());
  }
  return first;
}

}  // namespace ember
