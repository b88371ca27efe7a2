// Blocking HTTP client over Beast's async operations, run on a private
// io_context for at most the timeout (Beast's sync calls have no deadline).
#include "tools/emberctl/http.h"

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

Result<HttpResponse> http_request(std::string_view host_port, std::string_view method,
                                  std::string_view target, std::chrono::milliseconds timeout) {
  EMBER_ASSIGN_OR_RETURN(const config::HostPort hp, config::parse_host_port(host_port));
  const http::verb verb = http::string_to_verb(beast::string_view(method.data(), method.size()));
  if (verb == http::verb::unknown) {
    return make_error(ErrorCode::kInvalidArgument, "unknown HTTP method '{}'", method);
  }
  asio::io_context io{1};
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  http::request<http::empty_body> request{verb, std::string(target), 11};
  request.set(http::field::host, hp.host);
  request.set(http::field::user_agent, "emberctl");
  beast::flat_buffer buffer;
  http::response<http::string_body> response;
  beast::error_code failure;
  std::string stage = "resolve";
  bool done = false;

  auto fail = [&](std::string_view what, beast::error_code ec) {
    failure = ec;
    stage = std::string(what);
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
        http::async_read(stream, buffer, response, [&](beast::error_code ec4, std::size_t) {
          if (ec4) return fail("read", ec4);
          done = true;
        });
      });
    });
  });
  io.run_for(timeout);
  if (done) {
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    return HttpResponse{static_cast<int>(response.result_int()), std::move(response.body())};
  }
  if (failure) {
    return make_sys_error(failure.value(), "{} http://{}{}: {} failed", method, hp.to_string(),
                          target, stage);
  }
  return make_error(ErrorCode::kTimeout, "{} http://{}{}: no answer within {} ms (stuck in {})",
                    method, hp.to_string(), target, timeout.count(), stage);
}

}  // namespace ember::emberctl
