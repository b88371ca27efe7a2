// Link measurement for `emberctl tune --probe`: round-trip time and
// bandwidth over TCP between this host and a host running
// `emberctl probe-sink` (the same path Ember's tcp transport takes, without
// touching a running server).
//
// Protocol (all integers little-endian):
//   client -> sink   "EMBRPRB1"                                once, magic
//   client -> sink   'P' + 63 bytes      sink -> client  the same 64 bytes    (ping)
//   client -> sink   'B' + u64 n + n bytes  sink -> client u64 n (after all n read)  (bulk)
//   client -> sink   'Q'                 sink closes                          (quit)
// RTT = median of the ping round trips; bandwidth = n / (time from the first
// bulk byte sent to the sink's acknowledgement), after a warm-up bulk of
// 4 MiB that also sizes the measured one to last about `duration`.
//
// Thread-safety: functions are independent; ProbeSink::serve runs on the
// caller's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/base/error.h"

namespace ember::emberctl {

struct ProbeResult {
  std::chrono::nanoseconds rtt{0};           // median of the pings
  std::chrono::nanoseconds rtt_min{0};
  double bandwidth_bytes_per_s = 0;
  std::uint64_t bulk_bytes = 0;              // measured bulk transfer size
  std::chrono::nanoseconds bulk_time{0};
  std::uint32_t pings = 0;
};

// Measures against the sink at host_port. Blocks for the pings (pings x
// RTT), the 4 MiB warm-up and a bulk transfer sized to last `duration` at
// the warm-up's rate (it often ends sooner: the warm-up includes TCP's slow
// start, so its rate is low). `timeout` (>= 1 ms) bounds a ping's round
// trip and the wait for a bulk transfer's acknowledgement after its last
// byte as a whole (a peer trickling bytes cannot stretch them), and each
// send() call on its own.
// Errors: kInvalidArgument (address, pings < 1, duration <= 0), kIo
// (connect, send, receive; naming the address), kTimeout, kProtocol (the
// peer is not a probe sink).
[[nodiscard]] Result<ProbeResult> run_probe(const std::string& host_port, std::uint32_t pings,
                                            std::chrono::nanoseconds duration,
                                            std::chrono::milliseconds timeout);

class ProbeSink {
 public:
  // Binds and listens on host_port (port 0: any free port). IPv4/IPv6
  // literals or "localhost". Errors: kInvalidArgument, kIo.
  [[nodiscard]] static Result<std::unique_ptr<ProbeSink>> listen(const std::string& host_port);
  ~ProbeSink();
  ProbeSink(const ProbeSink&) = delete;
  ProbeSink& operator=(const ProbeSink&) = delete;

  // The bound "host:port".
  const std::string& address() const noexcept { return address_; }

  // Serves clients one after another; returns after `max_clients` (0 =
  // forever). A misbehaving client is dropped (reported on stderr) and the
  // next one served. A bulk larger than 64 GiB is refused. Errors: kIo from
  // accept.
  Status serve(std::uint32_t max_clients);

 private:
  ProbeSink(int fd, std::string address) : fd_(fd), address_(std::move(address)) {}
  int fd_ = -1;
  std::string address_;
};

}  // namespace ember::emberctl
