// A minimal HTTP/1.1 endpoint (Boost.Beast) that serves a metrics Registry
// in Prometheus text format at GET (or HEAD) /metrics (and /; a query string
// is ignored), and takes POST /checkpoint (emberctl checkpoint): 200 with the
// hook's text, 409 with its error when checkpoints are off, 500 when writing
// failed, 503 when 4 requests are queued or running already. POST /checkpoint needs
// `Authorization: Bearer <auth_token>` when a token is configured, and comes
// only from a loopback peer when none is (401 / 403 otherwise). Other
// methods on those paths get 405, other paths 404, a request over 16 KiB of
// header or 4 KiB of body 413, a malformed one 400.
//
// One thread runs its own io_context; each connection gets one response and
// is closed (Prometheus scrapes are rare: no keep-alive needed). A client
// has 10 s to send its request and 10 s to read the answer (a checkpoint
// request's answer waits for the checkpoint). At 64 open connections a new
// one closes the oldest that has not sent its request yet (an idle or slow
// client), or is itself closed when all 64 are being answered (logged at
// most once a minute). Peers on 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104
// are loopback. Before each render, `refresh` runs on that thread so
// the owner can update gauges that are sampled rather than counted (ring
// occupancy, pool usage, connections). The checkpoint hook runs on a thread
// of its own, one request after another, so that scrapes and probes go on
// while a checkpoint is written.
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
  // `checkpoint` (optional) runs for POST /checkpoint on the endpoint's
  // checkpoint thread and may block until the checkpoint is durable; it
  // must return once the owner stops taking checkpoints (before stop()).
  // `auth_token`: [communication] auth_token, "" for none.
  static Result<std::unique_ptr<MetricsHttp>> start(
      const std::string& host, std::uint16_t port, const metrics::Registry& registry,
      std::function<void()> refresh, std::function<Result<std::string>()> checkpoint = {},
      std::string auth_token = {});
  ~MetricsHttp();  // stop()
  // The bound "host:port".
  const std::string& address() const noexcept { return address_; }
  void stop();

  struct Impl;  // (public for the endpoint's session class; not an API)

 private:
  explicit MetricsHttp(std::unique_ptr<Impl> impl, std::string address);
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace ember::server
