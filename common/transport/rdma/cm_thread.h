// CmThread: one rdma_cm event channel and the thread that serves it.
//
// Every rdma_cm_id of a Transport lives on this channel and is touched
// (created, resolved, connected, accepted, rejected, disconnected, its queue
// pair created and destroyed, destroyed) only on this thread, so no id is
// ever used by two threads and an event can never race the destruction of
// its id. Other threads post work with post(). Events are fetched
// non-blockingly when the channel's fd is readable, copied (private data
// included) into an Event, acknowledged at once, then handed to the handler
// registered for the id (or, for a CONNECT_REQUEST, for its listening id).
// Acknowledging before dispatch lets a handler destroy the id it got the
// event for (rdma_destroy_id waits only for acknowledged events).
//
// Thread-safety: post() and on_thread() from any thread; everything else on
// the CM thread only.
#pragma once

#include <rdma/rdma_cma.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include "common/base/error.h"

namespace ember::transport::rdma::detail {

struct CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_RESOLVED;
  int status = 0;                    // event->status (errno or CM reject reason)
  rdma_cm_id* id = nullptr;          // the id the event is for (a new id for CONNECT_REQUEST)
  rdma_cm_id* listen_id = nullptr;   // CONNECT_REQUEST: the listening id
  std::vector<std::byte> private_data;
};

class CmThread {
 public:
  using Handler = std::function<void(const CmEvent& event)>;

  // Creates the event channel and starts the thread ("ember-rdma-cm").
  // Errors: kUnavailable when rdma_cm is not usable (no /dev/infiniband/
  // rdma_cm: the rdma_ucm module is not loaded), kIo otherwise.
  static Result<std::unique_ptr<CmThread>> start();
  // Stops the thread. pre: every id was destroyed (else they leak, logged).
  ~CmThread();
  CmThread(const CmThread&) = delete;
  CmThread& operator=(const CmThread&) = delete;

  void post(std::function<void()> fn);
  bool on_thread() const noexcept;
  boost::asio::io_context& context() { return ctx_; }

  // --- CM thread only ---
  // A new id on this channel (RDMA_PS_TCP) whose events go to `handler`.
  Result<rdma_cm_id*> create_id(Handler handler);
  // Routes the events of `id` (e.g. one made by a CONNECT_REQUEST) to `handler`.
  void set_handler(rdma_cm_id* id, Handler handler);
  // Destroys the id's queue pair (if any) and the id; its handler is dropped.
  void destroy_id(rdma_cm_id* id) noexcept;
  std::size_t num_ids() const noexcept { return handlers_.size(); }

 private:
  CmThread() = default;
  void arm();
  void on_readable();

  rdma_event_channel* channel_ = nullptr;
  boost::asio::io_context ctx_{1};
  std::unique_ptr<boost::asio::posix::stream_descriptor> fd_;
  std::unique_ptr<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guard_;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  std::unordered_map<rdma_cm_id*, Handler> handlers_;
};

// Text of a CM event type ("RDMA_CM_EVENT_REJECTED").
const char* cm_event_name(rdma_cm_event_type type) noexcept;

}  // namespace ember::transport::rdma::detail
