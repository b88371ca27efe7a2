// A small blocking HTTP/1.1 client (Boost.Beast) for emberctl: one request
// per connection to ember-server's metrics endpoint.
//
// Thread-safety: each call uses its own io_context; calls may run
// concurrently. Blocks for at most `timeout` (resolve + connect + write +
// read together).
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "common/base/error.h"

namespace ember::emberctl {

struct HttpResponse {
  int status = 0;     // e.g. 200, 404
  std::string body;
};

// Sends `method` ("GET", "POST") for `target` ("/metrics") to `host_port`
// ("127.0.0.1:9464", "[::1]:9464", "name:9464") with an empty body.
// Errors: kInvalidArgument (host_port malformed), kIo (resolve, connect,
// write or read failed, naming the address and the cause), kTimeout (no
// complete answer within `timeout`). An HTTP error status is not an Error:
// it is returned in `status`.
[[nodiscard]] Result<HttpResponse> http_request(std::string_view host_port, std::string_view method,
                                                std::string_view target,
                                                std::chrono::milliseconds timeout);

}  // namespace ember::emberctl
