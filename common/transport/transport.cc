// Names and option validation shared by every transport implementation.
#include "common/transport/transport.h"

namespace ember::transport {

std::string_view kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::kTcp: return "tcp";
    case Kind::kShm: return "shm";
    case Kind::kRdma: return "rdma";
  }
  return "unknown";
}

std::string_view zero_copy_name(ZeroCopy mode) noexcept {
  switch (mode) {
    case ZeroCopy::kWritev: return "writev";
    case ZeroCopy::kSendfile: return "sendfile";
  }
  return "unknown";
}

std::string_view role_name(Role role) noexcept {
  switch (role) {
    case Role::kWorker: return "worker";
    case Role::kServer: return "server";
  }
  return "unknown";
}

Status Options::validate() const {
  // The smallest batch must hold a frame header, one item entry and a
  // useful payload; 512 B leaves room for any header layout the framer uses.
  if (batch_threshold_bytes < 512 || batch_threshold_bytes > (std::uint64_t{64} << 20)) {
    return make_error(ErrorCode::kConfig,
                      "batch_threshold = {} bytes is out of range: use 512 B .. 64 MiB (default 4KB)",
                      batch_threshold_bytes);
  }
  if (num_channels == 0 || num_channels > 256) {
    return make_error(ErrorCode::kConfig, "channels = {} is out of range: use 1 .. 256",
                      num_channels);
  }
  if (num_io_threads == 0 || num_io_threads > 256) {
    return make_error(ErrorCode::kConfig, "io_threads = {} is out of range: use 1 .. 256",
                      num_io_threads);
  }
  if (flush_interval.count() < 0) {
    return make_error(ErrorCode::kConfig, "flush_interval must not be negative");
  }
  if (heartbeat_interval.count() <= 0 || heartbeat_timeout <= heartbeat_interval) {
    return make_error(ErrorCode::kConfig,
                      "heartbeat_timeout ({} ms) must be greater than heartbeat_interval ({} ms), "
                      "and the interval positive; a timeout of 3-10 intervals is usual",
                      std::chrono::duration_cast<std::chrono::milliseconds>(heartbeat_timeout).count(),
                      std::chrono::duration_cast<std::chrono::milliseconds>(heartbeat_interval).count());
  }
  if (max_message_bytes == 0) {
    return make_error(ErrorCode::kConfig, "max_message_size must be positive");
  }
  if (max_queued_bytes < batch_threshold_bytes) {
    return make_error(ErrorCode::kConfig,
                      "max_queued_bytes = {} is smaller than batch_threshold = {}: a single batch "
                      "could never be queued; raise max_queued_bytes",
                      max_queued_bytes, batch_threshold_bytes);
  }
  if (kind == Kind::kShm) {
    if (ring_slots < 2 || ring_slots > (1u << 24) || (ring_slots & (ring_slots - 1)) != 0) {
      return make_error(ErrorCode::kConfig,
                        "ring_buffer_size = {} slots must be a power of two in 2 .. 2^24 for the "
                        "shm transport",
                        ring_slots);
    }
  }
  if (connect_timeout.count() <= 0) {
    return make_error(ErrorCode::kConfig, "connect_timeout must be positive");
  }
  return ok_status();
}

Status Connection::write_peer_memory(std::uint32_t region_id, std::uint64_t offset_bytes,
                                     std::span<const std::byte> data, PeerCopy copy,
                                     std::uint32_t window) {
  (void)copy;
  (void)window;
  return make_error(ErrorCode::kUnavailable,
                    "peer memory (region {}, offset {}, {} bytes): this transport maps no peer "
                    "memory; only shm does",
                    region_id, offset_bytes, data.size());
}

Result<std::uint32_t> Connection::open_write_window() {
  return make_error(ErrorCode::kUnavailable,
                    "write windows: this transport maps no peer memory; only shm does");
}

}  // namespace ember::transport
