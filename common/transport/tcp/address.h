// "host:port" parsing for the tcp transport.
//
// host: an IPv4 literal, an IPv6 literal in brackets ("[::1]:7070"), or a
// name resolved with the system resolver (blocking; cold path only).
// Thread-safety: pure apart from name resolution; any thread.
#pragma once

#include <string>
#include <string_view>

#include <boost/asio/ip/tcp.hpp>

#include "common/base/error.h"

namespace ember::transport::tcp {

// Errors: kInvalidArgument naming the text and the expected form; kNotFound
// when a name does not resolve.
Result<boost::asio::ip::tcp::endpoint> resolve_endpoint(std::string_view address);

// "127.0.0.1:7070" / "[::1]:7070".
std::string endpoint_to_string(const boost::asio::ip::tcp::endpoint& endpoint);

}  // namespace ember::transport::tcp
