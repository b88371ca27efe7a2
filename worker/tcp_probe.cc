#include "worker/tcp_probe.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

namespace ember::worker_detail {

bool accepts_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  namespace asio = boost::asio;
  using asio::ip::tcp;
  try {
    asio::io_context io;
    tcp::resolver resolver(io);
    boost::system::error_code ec;
    const auto endpoints =
        resolver.resolve(host, std::to_string(port), tcp::resolver::numeric_service, ec);
    if (ec || endpoints.empty()) return false;
    tcp::socket socket(io);
    bool connected = false;
    asio::async_connect(socket, endpoints,
                        [&](const boost::system::error_code& e, const tcp::endpoint&) {
                          connected = !e;
                        });
    io.run_for(timeout);
    return connected;
  } catch (...) {
    return false;
  }
}

}  // namespace ember::worker_detail
