#include "worker/tcp_probe.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

namespace ember::worker_detail {

bool accepts_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  namespace asio = boost::asio;
  using asio::ip::tcp;
  try {
    // Resolution and connect both run inside run_for: `timeout` bounds the
    // whole probe. Handlers still pending then are destroyed with `io`.
    asio::io_context io;
    tcp::resolver resolver(io);
    tcp::socket socket(io);
    bool connected = false;
    resolver.async_resolve(
        host, std::to_string(port), tcp::resolver::numeric_service,
        [&](const boost::system::error_code& ec, const tcp::resolver::results_type& endpoints) {
          if (ec || endpoints.empty()) return;
          asio::async_connect(socket, endpoints,
                              [&](const boost::system::error_code& e, const tcp::endpoint&) {
                                connected = !e;
                                io.stop();
                              });
        });
    io.run_for(timeout);
    return connected;
  } catch (...) {
    return false;
  }
}

}  // namespace ember::worker_detail
