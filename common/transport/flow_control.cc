#include "common/transport/flow_control.h"

#include "common/base/units.h"

namespace ember::transport {

bool FlowControl::try_take(std::uint64_t bytes) noexcept {
  std::uint64_t cur = queued_.load(std::memory_order_relaxed);
  for (;;) {
    if (cur != 0 && cur + bytes > max_) return false;
    // seq_cst: pairs with the seq_cst waiters_ increment in acquire() and the
    // load of waiters_ in release() (Dekker: a waiter either sees this
    // decrement's effect or the releaser sees the waiter).
    if (queued_.compare_exchange_weak(cur, cur + bytes)) break;
  }
  std::uint64_t hw = high_water_.load(std::memory_order_relaxed);
  while (cur + bytes > hw &&
         !high_water_.compare_exchange_weak(hw, cur + bytes, std::memory_order_relaxed)) {
  }
  return true;
}

Status FlowControl::acquire(std::uint64_t bytes, std::chrono::nanoseconds wait, bool may_wait) {
  if (try_take(bytes)) return ok_status();
  auto full_error = [&] {
    return make_error(ErrorCode::kTimeout,
                      "send queue full: {} queued of max_queued_bytes {} and {} more asked; the "
                      "receiver is slow: retry later, or raise [communication] max_queued_bytes",
                      format_bytes(queued_bytes()), format_bytes(max_), format_bytes(bytes));
  };
  if (!may_wait || wait.count() <= 0) return full_error();
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::unique_lock lock(mu_);
  waiters_.fetch_add(1);
  Status result = ok_status();
  for (;;) {
    if (closed_.load()) {
      result = make_error(ErrorCode::kClosed, "connection closed while waiting for queue space");
      break;
    }
    if (try_take(bytes)) break;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (!try_take(bytes)) result = full_error();
      break;
    }
  }
  waiters_.fetch_sub(1);
  return result;
}

void FlowControl::release(std::uint64_t bytes) noexcept {
  if (bytes == 0) return;
  queued_.fetch_sub(bytes);
  if (waiters_.load() != 0) {
    std::lock_guard lock(mu_);
    cv_.notify_all();
  }
}

void FlowControl::close() noexcept {
  closed_.store(true);
  std::lock_guard lock(mu_);
  cv_.notify_all();
}

}  // namespace ember::transport
