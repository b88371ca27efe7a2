// A small blocking HTTP/1.1 client (Boost.Beast) for emberctl: one request
// per connection to ember-server's metrics endpoint.
//
// Thread-safety: each call uses its own io_context; calls may run
// concurrently. Blocks for at most `timeout` (resolve + connect + write +
// read together).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/error.h"

namespace ember::emberctl {

// The most a response may take, header and body together: 64 MiB (a real
// metrics page is a few KiB). The header gets at most kMaxResponseHeaderBytes
// of it, the body the rest. Anything larger is refused before it is buffered,
// whatever Content-Length says.
inline constexpr std::uint64_t kMaxResponseBytes = std::uint64_t{64} << 20;
inline constexpr std::uint32_t kMaxResponseHeaderBytes = std::uint32_t{1} << 20;

struct HttpResponse {
  int status = 0;     // e.g. 200, 404
  std::string body;
};

// Sends `method` ("GET", "POST") for `target` ("/metrics") to `host_port`
// ("127.0.0.1:9464", "[::1]:9464", "name:9464") with an empty body, and
// `Authorization: Bearer <bearer_token>` when the token is not empty.
// Allocates at most about kMaxResponseBytes for the answer.
// Errors: kInvalidArgument (host_port malformed or method unknown), kIo
// (resolve, connect, write or read failed, or the peer closed mid-answer,
// naming the address and the cause), kProtocol ("the endpoint at <addr> did
// not answer with HTTP: <what>", e.g. a data port or random bytes), kTooLarge
// ("response larger than 64 MiB", by Content-Length or by bytes received),
// kTimeout (no complete answer within `timeout`). Never throws. An HTTP error
// status is not an Error: it is returned in `status`.
[[nodiscard]] Result<HttpResponse> http_request(std::string_view host_port, std::string_view method,
                                                std::string_view target,
                                                std::chrono::milliseconds timeout,
                                                std::string_view bearer_token = {});

}  // namespace ember::emberctl
