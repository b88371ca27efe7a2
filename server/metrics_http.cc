// Prometheus endpoint over Boost.Beast; see metrics_http.h.
#include "server/metrics_http.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "common/base/logging.h"
#include "common/config/config.h"
#include "common/transport/accept_pacer.h"
#include "common/transport/handshake.h"
#include "common/transport/tcp/address.h"

namespace ember::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// Open connections at most: idle or slow clients must not use up the file
// descriptors the workers' connections need.
constexpr std::size_t kMaxSessions = 64;
// How long one connection may take to send its request and read the answer.
constexpr std::chrono::seconds kSessionTimeout{10};
// A scrape's request is a few hundred bytes; POST /checkpoint has no body.
constexpr std::uint32_t kMaxRequestHeaderBytes = 16 * 1024;
constexpr std::uint64_t kMaxRequestBodyBytes = 4 * 1024;

// The credentials of an Authorization header of the Bearer scheme (RFC 6750
// section 2.1), or nullopt for another scheme. The scheme is matched without
// regard to case and may be followed by several spaces (RFC 7235 section 2.1).
std::optional<std::string_view> bearer_token(std::string_view header) {
  constexpr std::string_view kScheme = "bearer";
  if (header.size() <= kScheme.size() || header[kScheme.size()] != ' ' ||
      !beast::iequals(beast::string_view(header.data(), kScheme.size()),
                      beast::string_view(kScheme.data(), kScheme.size()))) {
    return std::nullopt;
  }
  header.remove_prefix(kScheme.size());
  while (!header.empty() && header.front() == ' ') header.remove_prefix(1);
  return header;
}

// Checkpoint requests queued or running at once; more get 503.
constexpr std::size_t kMaxCheckpointRequests = 4;

// The path of a request target: origin form ("/metrics?x=1") or absolute
// form ("http://host:9100/metrics"), without its query.
std::string_view target_path(std::string_view target) {
  if (target.starts_with("http://") || target.starts_with("https://")) {
    const std::size_t authority = target.find("//") + 2;
    const std::size_t slash = target.find('/', authority);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
  }
  return target.substr(0, target.find_first_of("?#"));
}


class Session;

}  // namespace

struct MetricsHttp::Impl {
  // Open sessions. First member: sessions that io's destructor drops still
  // count themselves out.
  std::atomic<std::size_t> sessions{0};
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  const metrics::Registry* registry = nullptr;
  std::function<void()> refresh;
  std::function<Result<std::string>()> checkpoint;
  std::string auth_token;
  transport::AcceptPacer accept_pacer{log::logger("server"), "metrics endpoint"};  // io's thread
  std::thread thread;
  // io's thread: the sessions in the order they were accepted (expired ones
  // pruned as met), and when making room was last logged.
  std::deque<std::weak_ptr<Session>> accepted;
  std::chrono::steady_clock::time_point room_logged{};
  // Checkpoint requests run one after another on their own thread, off the
  // endpoint's (a checkpoint of a large model takes seconds; scrapes and
  // probes must not wait for it). Started at the first request; stop()
  // joins it after io's thread.
  std::mutex checkpoint_mutex;
  std::condition_variable checkpoint_cv;
  std::deque<std::function<void()>> checkpoint_jobs;  // under checkpoint_mutex
  bool checkpoint_busy = false;                       // under checkpoint_mutex
  bool checkpoint_stop = false;                       // under checkpoint_mutex
  std::thread checkpoint_thread;

  void accept();
  // At kMaxSessions: closes the oldest session still waiting for its
  // request (an idle or slow client). False when every one is answering.
  bool evict_oldest_reader();
  // Queues a checkpoint job; false when kMaxCheckpointRequests wait already.
  bool queue_checkpoint(std::function<void()> job);
  void checkpoint_loop();
};

bool MetricsHttp::Impl::queue_checkpoint(std::function<void()> job) {
  std::lock_guard lock(checkpoint_mutex);
  if (checkpoint_stop) return false;
  if (checkpoint_jobs.size() + (checkpoint_busy ? 1 : 0) >= kMaxCheckpointRequests) return false;
  checkpoint_jobs.push_back(std::move(job));
  if (!checkpoint_thread.joinable()) checkpoint_thread = std::thread([this] { checkpoint_loop(); });
  checkpoint_cv.notify_one();
  return true;
}

void MetricsHttp::Impl::checkpoint_loop() {
  pthread_setname_np(pthread_self(), "ember-ckpt-http");
  std::unique_lock lock(checkpoint_mutex);
  for (;;) {
    checkpoint_cv.wait(lock, [&] { return checkpoint_stop || !checkpoint_jobs.empty(); });
    if (checkpoint_stop) return;  // queued jobs go with the deque
    std::function<void()> job = std::move(checkpoint_jobs.front());
    checkpoint_jobs.pop_front();
    checkpoint_busy = true;
    lock.unlock();
    job();
    job = nullptr;  // its session, outside the lock
    lock.lock();
    checkpoint_busy = false;
  }
}

namespace {

// One HTTP exchange: read a request, write a response, close.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, MetricsHttp::Impl& impl) : stream_(std::move(socket)), impl_(impl) {
    impl_.sessions.fetch_add(1, std::memory_order_relaxed);
  }
  ~Session() { impl_.sessions.fetch_sub(1, std::memory_order_relaxed); }

  // Still waiting for its request (an idle or slow client, which a new
  // connection may displace).
  bool reading() const { return reading_; }
  void evict() { stream_.close(); }  // its read ends with operation_aborted

  void start() {
    beast::error_code peer_error;
    const auto peer = stream_.socket().remote_endpoint(peer_error);
    if (!peer_error) {
      // An IPv6 wildcard listener sees IPv4 peers as ::ffff:a.b.c.d.
      const auto a = peer.address();
      peer_loopback_ = a.is_loopback() ||
                       (a.is_v6() && a.to_v6().is_v4_mapped() &&
                        asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6()).is_loopback());
    }
    stream_.expires_after(kSessionTimeout);
    parser_.header_limit(kMaxRequestHeaderBytes);
    parser_.body_limit(kMaxRequestBodyBytes);
    http::async_read_header(stream_, buffer_, parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) {
        self->read_failed(ec);
        return;
      }
      // No route needs a body: a client that waits for "100 Continue" before
      // sending one (curl does, past 1 KiB) gets the final answer at once
      // instead, as RFC 9110 section 10.1.1 allows, rather than after its
      // own wait.
      const auto expect = self->parser_.get()[http::field::expect];
      if (beast::iequals(expect, "100-continue")) {
        self->respond();
        return;
      }
      http::async_read(self->stream_, self->buffer_, self->parser_,
                       [self](beast::error_code read_ec, std::size_t) {
        if (read_ec) {
          self->read_failed(read_ec);
        } else {
          self->respond();
        }
      });
    });
  }

 private:
  void read_failed(beast::error_code ec) {
    if (ec == http::error::header_limit || ec == http::error::body_limit) {
      reply(http::status::payload_too_large, "request too large for the metrics endpoint\n");
    } else if (ec != beast::error::timeout && ec != http::error::end_of_stream &&
               ec != asio::error::eof && ec != asio::error::connection_reset &&
               ec != asio::error::operation_aborted) {  // evicted, or stopping
      reply(http::status::bad_request, "malformed HTTP request: " + ec.message() + "\n");
    }
  }

  void respond() {
    reading_ = false;
    const http::request<http::string_body>& request = parser_.get();
    const std::string_view path =
        target_path(std::string_view(request.target().data(), request.target().size()));
    const http::verb method = request.method();
    if (path == "/metrics" || path == "/") {
      if (method != http::verb::get && method != http::verb::head) {
        response_.set(http::field::allow, "GET, HEAD");
        reply(http::status::method_not_allowed, "metrics are read with GET /metrics\n");
        return;
      }
      if (impl_.refresh) impl_.refresh();
      response_.set(http::field::content_type, std::string(metrics::kExpositionContentType));
      reply(http::status::ok, impl_.registry->render());
      return;
    }
    if (path == "/checkpoint" && impl_.checkpoint) {
      if (method != http::verb::post) {
        response_.set(http::field::allow, "POST");
        reply(http::status::method_not_allowed, "ask for a checkpoint with POST /checkpoint\n");
        return;
      }
      if (!impl_.auth_token.empty()) {
        const auto header = request[http::field::authorization];
        const std::string_view given(header.data(), header.size());
        const auto token = bearer_token(given);
        if (!token || !transport::handshake::tokens_equal(*token, impl_.auth_token)) {
          response_.set(http::field::www_authenticate, "Bearer");
          reply(http::status::unauthorized,
                "POST /checkpoint needs the job's [communication] auth_token as 'Authorization: "
                "Bearer <token>' (emberctl checkpoint --config FILE sends it)\n");
          return;
        }
      } else if (!peer_loopback_) {
        reply(http::status::forbidden,
              "POST /checkpoint from another host needs an auth token: set [communication] "
              "auth_token on the server and give it to emberctl (--config FILE)\n");
        return;
      }
      start_checkpoint();
      return;
    }
    reply(http::status::not_found, "not found; metrics are at /metrics\n");
  }

  void start_checkpoint() {
    // The job holds the session; its reply is written on io's thread (posted
    // to a stopped io_context, it goes with it).
    const bool queued = impl_.queue_checkpoint([self = shared_from_this()] {
      Result<std::string> r = self->impl_.checkpoint();
      asio::post(self->impl_.io, [self, r = std::move(r)] {
        self->response_.set(http::field::content_type, "text/plain");
        if (r) {
          self->reply(http::status::ok, *r + "\n");
        } else {
          self->reply(r.error().code() == ErrorCode::kConfig ? http::status::conflict
                                                             : http::status::internal_server_error,
                      r.error().to_string() + "\n");
        }
      });
    });
    if (!queued) {
      reply(http::status::service_unavailable,
            "checkpoint requests are already waiting for this server; retry when they end\n");
    }
  }

  // Writes the response and closes. To a HEAD request: the headers of
  // `body` (Content-Length included) without it, whatever the status.
  void reply(http::status status, std::string body) {
    const bool head_only = !reading_ && parser_.get().method() == http::verb::head;
    response_.version(parser_.get().version() == 10 ? 10 : 11);
    response_.keep_alive(false);
    response_.result(status);
    if (response_.find(http::field::content_type) == response_.end()) {
      response_.set(http::field::content_type, "text/plain");
    }
    if (head_only) {
      response_.content_length(body.size());
    } else {
      response_.body() = std::move(body);
      response_.prepare_payload();
    }
    stream_.expires_after(kSessionTimeout);
    http::async_write(stream_, response_, [self = shared_from_this()](beast::error_code, std::size_t) {
      beast::error_code ignored;
      self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request_parser<http::string_body> parser_;
  http::response<http::string_body> response_;
  MetricsHttp::Impl& impl_;
  bool peer_loopback_ = false;
  bool reading_ = true;
};

}  // namespace

void MetricsHttp::Impl::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;  // stopped
    if (ec) {
      // Any other error is the process's or the system's state, not the
      // endpoint's: keep serving once it passes (an orchestrator's
      // liveness probe scrapes this endpoint).
      accept_pacer.failed(io, ec.message(), [this] { accept(); });
      return;
    }
    accept_pacer.succeeded();
    // Idle or slow clients must not take every file descriptor (the
    // workers' connections need them), nor keep a scrape or a probe out:
    // at the cap the oldest of them makes room, said once.
    bool room = sessions.load(std::memory_order_relaxed) < kMaxSessions;
    if (!room) {
      room = evict_oldest_reader();
      const auto now = std::chrono::steady_clock::now();
      if (room_logged == std::chrono::steady_clock::time_point{} ||
          now - room_logged >= std::chrono::minutes(1)) {  // at most once a minute
        room_logged = now;
        log::logger("server")->warn(
            "metrics endpoint: {} connections are open; closing the oldest that has not sent its "
            "request (or the new one, when all are being answered) for each new connection",
            kMaxSessions);
      }
    }
    if (room) {
      auto session = std::make_shared<Session>(std::move(socket), *this);
      while (!accepted.empty() && accepted.front().expired()) accepted.pop_front();
      if (accepted.size() > 2 * kMaxSessions) {  // a long-lived one at the front
        std::erase_if(accepted, [](const std::weak_ptr<Session>& w) { return w.expired(); });
      }
      accepted.push_back(session);
      session->start();
    } else {
      beast::error_code ignored;
      socket.close(ignored);
    }
    accept();
  });
}

bool MetricsHttp::Impl::evict_oldest_reader() {
  while (!accepted.empty() && accepted.front().expired()) accepted.pop_front();
  for (auto it = accepted.begin(); it != accepted.end();) {
    auto s = it->lock();
    if (!s) {
      it = accepted.erase(it);
      continue;
    }
    if (s->reading()) {
      s->evict();
      accepted.erase(it);
      return true;
    }
    ++it;
  }
  return false;
}

MetricsHttp::MetricsHttp(std::unique_ptr<Impl> impl, std::string address)
    : impl_(std::move(impl)), address_(std::move(address)) {}

Result<tcp::endpoint> MetricsHttp::resolve(const std::string& host, std::uint16_t port) {
  auto resolved = transport::tcp::resolve_endpoint(config::HostPort{host, port}.to_string());
  if (!resolved) {
    Error err = std::move(resolved).error();
    err.with_context("[server] metrics_listen");
    return tl::unexpected(std::move(err));
  }
  return *resolved;
}

Result<std::unique_ptr<MetricsHttp>> MetricsHttp::start(
    const std::string& host, std::uint16_t port, const metrics::Registry& registry,
    std::function<void()> refresh, std::function<Result<std::string>()> checkpoint,
    std::string auth_token) {
  auto impl = std::make_unique<Impl>();
  impl->registry = &registry;
  impl->refresh = std::move(refresh);
  impl->checkpoint = std::move(checkpoint);
  impl->auth_token = std::move(auth_token);
  beast::error_code ec;
  EMBER_ASSIGN_OR_RETURN(const tcp::endpoint endpoint, resolve(host, port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    if (ec.value() == EADDRINUSE) {
      return make_sys_error(ec.value(),
                            "[server] metrics_listen: {}:{} is already in use: another process "
                            "listens there (`ss -ltnp` names it); stop it, or set metrics_listen "
                            "to another port (port 0 picks a free one)",
                            host, port);
    }
    return make_sys_error(ec.value(), "[server] metrics_listen: cannot listen on {}:{}", host, port);
  }
  const tcp::endpoint bound = impl->acceptor.local_endpoint(ec);
  std::string bound_text = bound.address().is_v6()
                               ? fmt::format("[{}]:{}", bound.address().to_string(), bound.port())
                               : fmt::format("{}:{}", bound.address().to_string(), bound.port());
  impl->accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    pthread_setname_np(pthread_self(), "ember-metrics");
    try {
      raw->io.run();
    } catch (const std::exception& e) {
      log::logger("server")->error("metrics endpoint stopped: {}", e.what());
    }
  });
  return std::unique_ptr<MetricsHttp>(new MetricsHttp(std::move(impl), std::move(bound_text)));
}

void MetricsHttp::stop() {
  if (!impl_) return;
  asio::post(impl_->io, [raw = impl_.get()] {
    beast::error_code ec;
    raw->acceptor.close(ec);
    raw->accept_pacer.cancel();
  });
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  // A checkpoint request still running ends when its checkpoint is written
  // or the server stops taking them (its shutdown does so before this).
  {
    std::lock_guard lock(impl_->checkpoint_mutex);
    impl_->checkpoint_stop = true;
  }
  impl_->checkpoint_cv.notify_all();
  if (impl_->checkpoint_thread.joinable()) impl_->checkpoint_thread.join();
  impl_->checkpoint_jobs.clear();
}

MetricsHttp::~MetricsHttp() { stop(); }

}  // namespace ember::server
