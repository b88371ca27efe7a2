// Poller: the completion side of one I/O thread. It polls the completion
// queues of the channels served by that thread; when none has had work for
// kSpinBeforeBlock it arms them (ibv_req_notify_cq), polls once more to
// close the race with a completion that arrived meanwhile, and waits on the
// thread's completion channel, whose fd is awaited from the thread's
// Boost.Asio io_context. The spin is cooperative: each pass is a posted
// handler, so timers and other posted work on the thread run between passes.
//
// Thread-safety: every method runs on the poller's I/O thread, except the
// constructor and destructor (before the thread serves it / after it stopped).
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <memory>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

namespace ember::transport::rdma::detail {

// How long an idle I/O thread keeps polling before it blocks. Short: on a
// loaded machine (the 2-core CI box) a long spin steals the core the peer
// needs; long enough to catch the reply to a request just sent on a NIC.
inline constexpr std::chrono::microseconds kSpinBeforeBlock{50};

// What a Poller drives: a channel's completion queue.
class Pollable {
 public:
  virtual ~Pollable() = default;
  // Processes up to `budget` completions; returns how many.
  virtual int poll(int budget) = 0;
  // ibv_req_notify_cq on its CQ; false when that failed (it then fails itself).
  virtual bool arm() = 0;
};

class Poller {
 public:
  Poller(boost::asio::io_context& ctx, ibv_comp_channel* channel);
  ~Poller();
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  ibv_comp_channel* comp_channel() const noexcept { return channel_; }
  boost::asio::io_context& context() noexcept { return ctx_; }

  // I/O thread. `keep` holds the object that owns `p` alive while it is here.
  void add(std::shared_ptr<void> keep, Pollable* p);
  void remove(Pollable* p);
  // I/O thread: schedule a pass now (new work may be in a CQ).
  void kick();
  // I/O thread: stop waiting on the fd (before the thread stops).
  void shutdown();

 private:
  struct Entry {
    std::shared_ptr<void> keep;
    Pollable* p;
  };
  void pass();
  void wait_fd();
  void on_fd_readable();

  boost::asio::io_context& ctx_;
  ibv_comp_channel* channel_;
  std::unique_ptr<boost::asio::posix::stream_descriptor> fd_;
  std::vector<Entry> entries_;
  std::chrono::steady_clock::time_point last_work_{};
  bool pass_scheduled_ = false;
  bool waiting_ = false;
  bool shut_down_ = false;
};

}  // namespace ember::transport::rdma::detail
