#include "common/transport/tcp/address.h"

#include <charconv>

#include <boost/asio/io_context.hpp>
#include <boost/system/error_code.hpp>
#include <fmt/format.h>

namespace ember::transport::tcp {

namespace asio = boost::asio;
using asio::ip::tcp;

Result<tcp::endpoint> resolve_endpoint(std::string_view address) {
  const auto colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "address '{}' is not host:port; write e.g. '127.0.0.1:7070' or '[::1]:7070'",
                      address);
  }
  std::string_view host = address.substr(0, colon);
  const std::string_view port_text = address.substr(colon + 1);
  unsigned port = 0;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port > 65535) {
    return make_error(ErrorCode::kInvalidArgument,
                      "address '{}': port '{}' is not a number in 0..65535", address, port_text);
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  boost::system::error_code error;
  asio::ip::address ip = asio::ip::make_address(std::string(host), error);
  if (!error) return tcp::endpoint(ip, static_cast<std::uint16_t>(port));
  asio::io_context ctx;
  tcp::resolver resolver(ctx);
  auto results = resolver.resolve(std::string(host), std::string(port_text),
                                  tcp::resolver::numeric_service, error);
  if (error || results.empty()) {
    return make_error(ErrorCode::kNotFound, "address '{}': cannot resolve host '{}': {}", address,
                      host, error ? error.message() : std::string("no addresses"));
  }
  // Prefer IPv4 (loopback names usually resolve to both).
  for (const auto& r : results) {
    if (r.endpoint().address().is_v4()) return r.endpoint();
  }
  return results.begin()->endpoint();
}

std::string endpoint_to_string(const tcp::endpoint& endpoint) {
  if (endpoint.address().is_v6()) {
    return fmt::format("[{}]:{}", endpoint.address().to_string(), endpoint.port());
  }
  return fmt::format("{}:{}", endpoint.address().to_string(), endpoint.port());
}

}  // namespace ember::transport::tcp
