// A one-shot tcp reachability probe, used to explain a failed connect: an shm
// worker that finds no shm listener checks whether the server accepts tcp
// there instead (a transport mismatch between worker and server configs).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace ember::worker_detail {

// True when a tcp connection to host:port (a name, an IPv4 or an IPv6
// literal without brackets; port in host byte order) is accepted within
// `timeout`; the connection is closed at once. False on any failure: name
// resolution, refusal, timeout. Blocks the caller up to `timeout`, name
// resolution included (Asio runs getaddrinfo on its own thread; a lookup
// still running then is abandoned). Thread-safe: each call has its own
// io_context. Throws nothing.
bool accepts_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout);

}  // namespace ember::worker_detail
