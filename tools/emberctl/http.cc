// Blocking HTTP client over Beast's async operations, run on a private
// io_context for at most the timeout (Beast's sync calls have no deadline).
#include "tools/emberctl/http.h"

#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "common/config/config.h"

namespace ember::emberctl {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::string_view kHttpPrefix = "HTTP/";
constexpr std::uint64_t kBodyLimit = kMaxResponseBytes - kMaxResponseHeaderBytes;

// Up to 16 leading bytes of `bytes`, printable ASCII as is, others as \xNN,
// so an error shows what the peer sent instead of HTTP.
std::string leading_bytes(std::string_view bytes) {
  std::string out;
  for (const char c : bytes.substr(0, 16)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && u != '\\') {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", u);
    }
  }
  if (bytes.size() > 16) out += "...";
  return out;
}

// True when `first` (the first bytes of the answer) could begin "HTTP/".
bool may_be_http(std::string_view first) {
  return first.substr(0, kHttpPrefix.size()) == kHttpPrefix.substr(0, first.size());
}

// Turns a failed step into an Error. `first` holds the first bytes of the
// answer (up to 16; empty when none came). Only system-category codes carry
// an errno: Beast's and Asio's other categories number their own enums,
// which are not errno values (Beast's bad_version, 14, once printed as
// "Bad address (errno 14)").
Error describe_failure(std::string_view method, const std::string& address,
                       std::string_view target, std::string_view stage, beast::error_code ec,
                       std::string_view first) {
  const std::string what = fmt::format("{} http://{}{}", method, address, target);
  if (stage == "read" && !first.empty() && !may_be_http(first)) {
    return Error(ErrorCode::kProtocol,
                 fmt::format("{}: the endpoint at {} did not answer with HTTP: it sent '{}' "
                             "instead of 'HTTP/1.1 <status>'; is this the server's metrics "
                             "address (metrics_listen), not its data port?",
                             what, address, leading_bytes(first)));
  }
  if (ec.category() == http::make_error_code(http::error::body_limit).category()) {
    switch (static_cast<http::error>(ec.value())) {
      case http::error::body_limit:
      case http::error::header_limit:
      case http::error::buffer_overflow:
        return Error(ErrorCode::kTooLarge,
                     fmt::format("{}: response larger than {} MiB (header at most {} MiB), "
                                 "refused: {}; a metrics endpoint answers a few KiB",
                                 what, kMaxResponseBytes / kMiB, kMaxResponseHeaderBytes / kMiB,
                                 ec.message()));
      case http::error::end_of_stream:
        return Error(ErrorCode::kIo,
                     fmt::format("{}: the endpoint at {} closed the connection without "
                                 "answering; is it an HTTP metrics endpoint?",
                                 what, address));
      case http::error::partial_message:
        return Error(ErrorCode::kIo,
                     fmt::format("{}: the answer from {} ended before it was complete ({})",
                                 what, address, ec.message()));
      default:
        return Error(ErrorCode::kProtocol,
                     fmt::format("{}: the endpoint at {} did not answer with HTTP: {}", what,
                                 address, ec.message()));
    }
  }
  if (ec.category() == boost::system::system_category() ||
      ec.category() == boost::system::generic_category()) {
    return Error(ErrorCode::kIo, fmt::format("{}: {} failed", what, stage), ec.value());
  }
  return Error(ErrorCode::kIo, fmt::format("{}: {} failed: {}", what, stage, ec.message()));
}

Result<HttpResponse> do_request(const config::HostPort& hp, http::verb verb,
                                std::string_view method, std::string_view target,
                                std::chrono::milliseconds timeout, std::string_view bearer_token) {
  asio::io_context io{1};
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  http::request<http::empty_body> request{verb, std::string(target), 11};
  request.set(http::field::host, hp.host);
  request.set(http::field::user_agent, "emberctl");
  if (!bearer_token.empty()) {
    request.set(http::field::authorization, fmt::format("Bearer {}", bearer_token));
  }
  // Bounded: the buffer holds the header and body chunks in flight, the
  // parser refuses a larger header or body before storing it (a huge
  // Content-Length is refused as soon as the header parses).
  beast::flat_buffer buffer{static_cast<std::size_t>(kMaxResponseBytes)};
  http::response_parser<http::string_body> parser;
  // Beast applies header_limit to the status line and to the fields
  // separately: half each keeps the whole header within the cap.
  parser.header_limit(kMaxResponseHeaderBytes / 2);
  parser.body_limit(kBodyLimit);
  beast::error_code failure;
  std::string stage = "resolve";
  std::string first_bytes;  // up to 16 leading bytes of the answer
  bool done = false;

  auto fail = [&](std::string_view what, beast::error_code ec) {
    failure = ec;
    stage = std::string(what);
  };
  auto read_rest = [&] {
    // Header first, then the body: Beast 1.74's eager read (async_read
    // on a whole message) ignores the body_limit error for a too-large
    // Content-Length when body bytes follow in the same read, and goes on
    // to reserve() the claimed size (std::bad_alloc). Reading the header
    // alone stops there, and the length is checked before the body.
    http::async_read_header(stream, buffer, parser, [&](beast::error_code ec4, std::size_t) {
      if (ec4) return fail("read", ec4);
      const auto length = parser.content_length();
      if (length && *length > kBodyLimit) {
        return fail("read", http::make_error_code(http::error::body_limit));
      }
      http::async_read(stream, buffer, parser, [&](beast::error_code ec5, std::size_t) {
        if (ec5) return fail("read", ec5);
        done = true;
      });
    });
  };
  resolver.async_resolve(hp.host, std::to_string(hp.port),
                         [&](beast::error_code ec, tcp::resolver::results_type results) {
    if (ec) return fail("resolve", ec);
    stage = "connect";
    stream.async_connect(results, [&](beast::error_code ec2, const tcp::endpoint&) {
      if (ec2) return fail("connect", ec2);
      stage = "write";
      http::async_write(stream, request, [&](beast::error_code ec3, std::size_t) {
        if (ec3) return fail("write", ec3);
        stage = "read";
        // The first bytes alone, to tell "not HTTP at all" (a data port,
        // random bytes) from a broken HTTP answer; the parser then starts on
        // what is already in `buffer`.
        stream.async_read_some(buffer.prepare(4096), [&](beast::error_code ec4, std::size_t n) {
          if (ec4 == asio::error::eof) return fail("read", http::error::end_of_stream);
          if (ec4) return fail("read", ec4);
          buffer.commit(n);
          const auto* data = static_cast<const char*>(buffer.data().data());
          first_bytes.assign(data, std::min<std::size_t>(buffer.size(), 16));
          if (!may_be_http(first_bytes)) return fail("read", http::error::bad_version);
          read_rest();
        });
      });
    });
  });
  io.run_for(timeout);
  const std::string address = hp.to_string();
  if (done) {
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    http::response<http::string_body> response = parser.release();
    return HttpResponse{static_cast<int>(response.result_int()), std::move(response.body())};
  }
  if (failure) {
    return tl::unexpected<Error>(
        describe_failure(method, address, target, stage, failure, first_bytes));
  }
  return make_error(ErrorCode::kTimeout, "{} http://{}{}: no answer within {} ms (stuck in {})",
                    method, address, target, timeout.count(), stage);
}

}  // namespace

Result<HttpResponse> http_request(std::string_view host_port, std::string_view method,
                                  std::string_view target, std::chrono::milliseconds timeout,
                                  std::string_view bearer_token) {
  EMBER_ASSIGN_OR_RETURN(const config::HostPort hp, config::parse_host_port(host_port));
  const http::verb verb = http::string_to_verb(beast::string_view(method.data(), method.size()));
  if (verb == http::verb::unknown) {
    return make_error(ErrorCode::kInvalidArgument, "unknown HTTP method '{}'", method);
  }
  // Asio and Beast report failures through error codes here; what can still
  // throw is allocation (bounded above) and resolver internals. None of it
  // may escape as an exception.
  try {
    return do_request(hp, verb, method, target, timeout, bearer_token);
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kTooLarge, "{} http://{}{}: out of memory while reading the answer",
                      method, hp.to_string(), target);
  } catch (const std::exception& e) {
    return make_error(ErrorCode::kIo, "{} http://{}{}: {}", method, hp.to_string(), target,
                      e.what());
  }
}

}  // namespace ember::emberctl
