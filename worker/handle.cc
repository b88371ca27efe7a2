// Operation completion state and waiting; see handle.h.
#include "worker/handle.h"

#include <algorithm>

namespace ember {
namespace worker_detail {

Result<std::uint64_t> Op::result_locked() const {
  if (error) return tl::unexpected(*error);
  return step_set ? step : 0;
}

void Op::finish_locked(std::unique_lock<std::mutex>& lock) {
  if (before_done) before_done(result_locked());
  done = true;
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

bool Op::fail(Error e) {
  std::unique_lock lock(mutex);
  if (done) return false;
  error = std::move(e);
  finish_locked(lock);
  return true;
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

Result<std::uint64_t> Handle::wait() const {
  if (!op_) return make_error(ErrorCode::kInvalidArgument, "wait on an empty Handle");
  std::unique_lock lock(op_->mutex);
  // The worker's timer fails the operation at its deadline, so this ends.
  op_->cv.wait(lock, [&] { return op_->done; });
  return op_->result_locked();
}

Result<std::uint64_t> Handle::wait_for(std::chrono::nanoseconds timeout) const {
  if (!op_) return make_error(ErrorCode::kInvalidArgument, "wait on an empty Handle");
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
