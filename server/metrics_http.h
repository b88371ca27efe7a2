// A minimal HTTP/1.1 endpoint (Boost.Beast) that serves a metrics Registry
// in Prometheus text format at GET /metrics (and /), and takes POST
// /checkpoint (emberctl checkpoint): 200 with the hook's text, or 409 with
// its error when checkpoints are off, 500 when writing failed; 404
// elsewhere.
//
// One thread runs its own io_context; each connection gets one response and
// is closed (Prometheus scrapes are rare: no keep-alive needed). Before each
// render, `refresh` runs on that thread so the owner can update gauges that
// are sampled rather than counted (ring occupancy, pool usage, connections).
//
// Thread-safety: start() and stop() from the owning thread; refresh runs on
// the endpoint's thread and must be thread-safe with the rest of the program.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/ip/tcp.hpp>

#include "common/base/error.h"
#include "common/metrics/metrics.h"

namespace ember::server {

class MetricsHttp {
 public:
  // The endpoint start() binds for "host:port": a host name resolves as for
  // [server] listen (`ember-server --check-config` calls this too). Blocks
  // on the system resolver. Errors: kInvalidArgument, kNotFound (from
  // transport::tcp::resolve_endpoint), with "[server] metrics_listen" as
  // context.
  static Result<boost::asio::ip::tcp::endpoint> resolve(const std::string& host, std::uint16_t port);
  // Binds "host:port" (port 0: any free port) and starts serving. Errors:
  // those of resolve(), kIo (bind/listen).
  // `checkpoint` (optional) runs on the endpoint's thread for POST
  // /checkpoint and may block until the checkpoint is durable.
  static Result<std::unique_ptr<MetricsHttp>> start(
      const std::string& host, std::uint16_t port, const metrics::Registry& registry,
      std::function<void()> refresh, std::function<Result<std::string>()> checkpoint = {});
  ~MetricsHttp();  // stop()
  // The bound "host:port".
  const std::string& address() const noexcept { return address_; }
  void stop();

 private:
  struct Impl;
  explicit MetricsHttp(std::unique_ptr<Impl> impl, std::string address);
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace ember::server
