#include "common/transport/rdma/cm_thread.h"

#include <fcntl.h>
#include <pthread.h>

#include <cerrno>
#include <system_error>

#include <boost/asio/post.hpp>

#include "common/base/logging.h"

namespace ember::transport::rdma::detail {

const char* cm_event_name(rdma_cm_event_type type) noexcept { return ::rdma_event_str(type); }

Result<std::unique_ptr<CmThread>> CmThread::start() {
  std::unique_ptr<CmThread> t(new CmThread());
  t->channel_ = ::rdma_create_event_channel();
  if (t->channel_ == nullptr) {
    const int err = errno;
    if (err == ENODEV || err == ENOENT || err == ENOSYS) {
      return tl::unexpected<Error>(Error(
          ErrorCode::kUnavailable,
          "rdma_cm is not usable on this host (/dev/infiniband/rdma_cm is missing: load the "
          "rdma_ucm kernel module), or use transport = \"tcp\"",
          err));
    }
    return make_sys_error(err, "rdma_create_event_channel");
  }
  const int flags = ::fcntl(t->channel_->fd, F_GETFL);
  if (flags < 0 || ::fcntl(t->channel_->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return make_sys_error(errno, "fcntl(O_NONBLOCK) on the rdma_cm event channel");
  }
  t->fd_ = std::make_unique<boost::asio::posix::stream_descriptor>(t->ctx_, t->channel_->fd);
  t->guard_ = std::make_unique<
      boost::asio::executor_work_guard<boost::asio::io_context::executor_type>>(
      t->ctx_.get_executor());
  CmThread* self = t.get();
  try {
    t->thread_ = std::thread([self] {
      self->thread_id_.store(std::this_thread::get_id());
      pthread_setname_np(pthread_self(), "ember-rdma-cm");
      self->arm();
      self->ctx_.run();  // handlers never throw (STYLE: errors are values)
    });
  } catch (const std::system_error& e) {
    return make_sys_error(e.code().value(), "cannot start the rdma_cm thread");
  }
  return t;
}

CmThread::~CmThread() {
  if (thread_.joinable()) {
    // Destroy the descriptor wrapper on the thread that uses it, then stop.
    boost::asio::post(ctx_, [this] {
      if (fd_) {
        boost::system::error_code ec;
        fd_->cancel(ec);
        fd_->release();  // the fd belongs to the event channel
        fd_.reset();
      }
      if (!handlers_.empty()) {
        log::logger("rdma")->error("rdma_cm thread stops with {} ids still open (leaked)",
                                   handlers_.size());
      }
      guard_.reset();
      ctx_.stop();
    });
    thread_.join();
  }
  if (fd_) {
    fd_->release();
    fd_.reset();
  }
  if (channel_ != nullptr && handlers_.empty()) ::rdma_destroy_event_channel(channel_);
}

void CmThread::post(std::function<void()> fn) { boost::asio::post(ctx_, std::move(fn)); }

bool CmThread::on_thread() const noexcept {
  return thread_id_.load() == std::this_thread::get_id();
}

Result<rdma_cm_id*> CmThread::create_id(Handler handler) {
  rdma_cm_id* id = nullptr;
  if (::rdma_create_id(channel_, &id, nullptr, RDMA_PS_TCP) != 0) {
    return make_sys_error(errno, "rdma_create_id");
  }
  handlers_[id] = std::move(handler);
  return id;
}

void CmThread::set_handler(rdma_cm_id* id, Handler handler) { handlers_[id] = std::move(handler); }

void CmThread::destroy_id(rdma_cm_id* id) noexcept {
  if (id == nullptr) return;
  handlers_.erase(id);
  if (id->qp != nullptr) ::rdma_destroy_qp(id);
  if (::rdma_destroy_id(id) != 0) {
    log::logger("rdma")->warn("rdma_destroy_id failed: {}", std::strerror(errno));
  }
}

void CmThread::arm() {
  if (!fd_) return;
  fd_->async_wait(boost::asio::posix::stream_descriptor::wait_read,
                  [this](const boost::system::error_code& ec) {
                    if (ec) return;
                    on_readable();
                  });
}

void CmThread::on_readable() {
  for (int i = 0; i < 64; ++i) {
    rdma_cm_event* raw = nullptr;
    if (::rdma_get_cm_event(channel_, &raw) != 0) {
      const int err = errno;
      if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR) {
        log::logger("rdma")->error("rdma_get_cm_event failed: {}", std::strerror(err));
      }
      break;
    }
    CmEvent ev;
    ev.type = raw->event;
    ev.status = raw->status;
    ev.id = raw->id;
    ev.listen_id = raw->listen_id;
    const rdma_conn_param& conn = raw->param.conn;
    if (raw->event != RDMA_CM_EVENT_MULTICAST_JOIN && raw->event != RDMA_CM_EVENT_MULTICAST_ERROR &&
        conn.private_data != nullptr && conn.private_data_len > 0) {
      const auto* p = static_cast<const std::byte*>(conn.private_data);
      ev.private_data.assign(p, p + conn.private_data_len);
    }
    ::rdma_ack_cm_event(raw);
    rdma_cm_id* route = ev.type == RDMA_CM_EVENT_CONNECT_REQUEST ? ev.listen_id : ev.id;
    auto it = handlers_.find(route);
    if (it == handlers_.end()) {
      log::logger("rdma")->debug("{} for an id without handler (ignored)", cm_event_name(ev.type));
      if (ev.type == RDMA_CM_EVENT_CONNECT_REQUEST) {
        // Nobody will take it: refuse so the peer is not left waiting.
        (void)::rdma_reject(ev.id, nullptr, 0);
        ::rdma_destroy_id(ev.id);
      }
      continue;
    }
    Handler h = it->second;  // a copy: the handler may replace or drop itself
    h(ev);
  }
  arm();
}

}  // namespace ember::transport::rdma::detail
