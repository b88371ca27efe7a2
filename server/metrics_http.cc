// Prometheus endpoint over Boost.Beast; see metrics_http.h.
#include "server/metrics_http.h"

#include <cerrno>
#include <chrono>
#include <thread>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "common/base/logging.h"
#include "common/config/config.h"
#include "common/transport/accept_pacer.h"
#include "common/transport/tcp/address.h"

namespace ember::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// One HTTP exchange: read a request, write a response, close.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const metrics::Registry& registry, const std::function<void()>& refresh,
          const std::function<Result<std::string>()>& checkpoint)
      : stream_(std::move(socket)), registry_(registry), refresh_(refresh), checkpoint_(checkpoint) {}

  void start() {
    stream_.expires_after(std::chrono::seconds(10));
    http::async_read(stream_, buffer_, request_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       if (!ec) self->respond();
                     });
  }

 private:
  void respond() {
    response_.version(request_.version());
    response_.keep_alive(false);
    const auto target = request_.target();
    if (request_.method() == http::verb::get && (target == "/metrics" || target == "/")) {
      if (refresh_) refresh_();
      response_.result(http::status::ok);
      response_.set(http::field::content_type, std::string(metrics::kExpositionContentType));
      response_.body() = registry_.render();
    } else if (request_.method() == http::verb::post && target == "/checkpoint" && checkpoint_) {
      auto r = checkpoint_();
      response_.set(http::field::content_type, "text/plain");
      if (r) {
        response_.result(http::status::ok);
        response_.body() = *r + "\n";
      } else {
        response_.result(r.error().code() == ErrorCode::kConfig ? http::status::conflict
                                                                : http::status::internal_server_error);
        response_.body() = r.error().to_string() + "\n";
      }
    } else {
      response_.result(http::status::not_found);
      response_.set(http::field::content_type, "text/plain");
      response_.body() = "not found; metrics are at /metrics\n";
    }
    response_.prepare_payload();
    http::async_write(stream_, response_, [self = shared_from_this()](beast::error_code, std::size_t) {
      beast::error_code ignored;
      self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  http::response<http::string_body> response_;
  const metrics::Registry& registry_;
  const std::function<void()>& refresh_;
  const std::function<Result<std::string>()>& checkpoint_;
};

}  // namespace

struct MetricsHttp::Impl {
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  const metrics::Registry* registry = nullptr;
  std::function<void()> refresh;
  std::function<Result<std::string>()> checkpoint;
  transport::AcceptPacer accept_pacer{log::logger("server"), "metrics endpoint"};  // io's thread
  std::thread thread;

  void accept() {
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
      std::make_shared<Session>(std::move(socket), *registry, refresh, checkpoint)->start();
      accept();
    });
  }
};

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
    std::function<void()> refresh, std::function<Result<std::string>()> checkpoint) {
  auto impl = std::make_unique<Impl>();
  impl->registry = &registry;
  impl->refresh = std::move(refresh);
  impl->checkpoint = std::move(checkpoint);
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
}

MetricsHttp::~MetricsHttp() { stop(); }

}  // namespace ember::server
