#include "common/transport/rdma/poller.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>

#include <boost/asio/post.hpp>

#include "common/base/check.h"

namespace ember::transport::rdma::detail {
namespace {
constexpr int kPollBudget = 64;  // completions per channel per pass
}

Poller::Poller(boost::asio::io_context& ctx, ibv_comp_channel* channel)
    : ctx_(ctx), channel_(channel) {
  // Non-blocking, so ibv_get_cq_event drains the queued events and stops.
  const int flags = ::fcntl(channel_->fd, F_GETFL);
  EMBER_CHECK_MSG(flags >= 0 && ::fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK) == 0,
                  "fcntl(O_NONBLOCK) on a completion channel failed: errno {}", errno);
  fd_ = std::make_unique<boost::asio::posix::stream_descriptor>(ctx_, channel_->fd);
}

Poller::~Poller() {
  if (fd_) fd_->release();  // the fd belongs to the completion channel
}

void Poller::add(std::shared_ptr<void> keep, Pollable* p) {
  entries_.push_back(Entry{std::move(keep), p});
  kick();
}

void Poller::remove(Pollable* p) {
  // Swap in a null entry rather than erase: pass() may be iterating.
  for (Entry& e : entries_) {
    if (e.p == p) e.p = nullptr;
  }
  if (!pass_scheduled_) {
    std::erase_if(entries_, [](const Entry& e) { return e.p == nullptr; });
  }
}

void Poller::kick() {
  if (pass_scheduled_ || shut_down_) return;
  pass_scheduled_ = true;
  boost::asio::post(ctx_, [this] { pass(); });
}

void Poller::shutdown() {
  shut_down_ = true;
  if (fd_) {
    boost::system::error_code ec;
    fd_->cancel(ec);
  }
  entries_.clear();
}

void Poller::pass() {
  pass_scheduled_ = false;
  if (shut_down_) return;
  int work = 0;
  // Index loop: a poll may add channels (their entries go to the end) or
  // remove them (entries become null).
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (Pollable* p = entries_[i].p) work += p->poll(kPollBudget);
  }
  std::erase_if(entries_, [](const Entry& e) { return e.p == nullptr; });
  const auto now = std::chrono::steady_clock::now();
  if (work > 0) last_work_ = now;
  if (entries_.empty()) return;
  if (now - last_work_ < kSpinBeforeBlock) {
    kick();
    return;
  }
  // Block: arm every CQ, then poll once more for what raced the arming.
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (Pollable* p = entries_[i].p) (void)p->arm();
  }
  work = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (Pollable* p = entries_[i].p) work += p->poll(kPollBudget);
  }
  if (work > 0) {
    last_work_ = now;
    kick();
    return;
  }
  wait_fd();
}

void Poller::wait_fd() {
  if (waiting_ || shut_down_) return;
  waiting_ = true;
  fd_->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                  [this](const boost::system::error_code& ec) {
                    waiting_ = false;
                    if (ec || shut_down_) return;
                    on_fd_readable();
                  });
}

void Poller::on_fd_readable() {
  // Drain the notifications; each names one CQ, which the pass polls anyway.
  for (;;) {
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    if (::ibv_get_cq_event(channel_, &cq, &cq_context) != 0) break;  // EAGAIN: drained
    ::ibv_ack_cq_events(cq, 1);
  }
  last_work_ = std::chrono::steady_clock::now();
  kick();
}

}  // namespace ember::transport::rdma::detail
