#include "common/transport/handshake.h"

#include <cstring>

namespace ember::transport::handshake {
namespace {

template <typename T>
void put(std::vector<std::byte>& out, std::size_t offset, T value) {
  std::memcpy(out.data() + offset, &value, sizeof(T));
}
template <typename T>
T get(std::span<const std::byte> in, std::size_t offset) {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof(T));
  return value;
}

bool valid_role(std::uint8_t r) { return r == 1 || r == 2; }
bool valid_kind(std::uint8_t k) { return k >= 1 && k <= 3; }

}  // namespace

std::vector<std::byte> encode(const Hello& hello) {
  const std::size_t token_bytes = std::min(hello.token.size(), kMaxTokenBytes);
  std::vector<std::byte> out(kHelloFixedBytes + token_bytes);
  put<std::uint32_t>(out, 0, kHelloMagic);
  put<std::uint16_t>(out, 4, hello.version);
  put<std::uint16_t>(out, 6, static_cast<std::uint16_t>(token_bytes));
  put<std::uint8_t>(out, 8, static_cast<std::uint8_t>(hello.role));
  put<std::uint8_t>(out, 9, static_cast<std::uint8_t>(hello.kind));
  put<std::uint16_t>(out, 10, 0);
  put<std::uint32_t>(out, 12, hello.rank);
  put<std::uint32_t>(out, 16, hello.num_channels);
  put<std::uint32_t>(out, 20, hello.channel);
  put<std::uint64_t>(out, 24, hello.session_id);
  put<std::uint64_t>(out, 32, hello.max_message_bytes);
  std::memcpy(out.data() + kHelloFixedBytes, hello.token.data(), token_bytes);
  return out;
}

std::vector<std::byte> encode(const Reply& reply) {
  const std::size_t text_bytes = std::min(reply.text.size(), kMaxReplyTextBytes);
  std::vector<std::byte> out(kReplyFixedBytes + text_bytes);
  put<std::uint32_t>(out, 0, kReplyMagic);
  put<std::uint16_t>(out, 4, reply.version);
  put<std::uint16_t>(out, 6, static_cast<std::uint16_t>(text_bytes));
  put<std::uint16_t>(out, 8, static_cast<std::uint16_t>(reply.status));
  put<std::uint8_t>(out, 10, static_cast<std::uint8_t>(reply.role));
  put<std::uint8_t>(out, 11, 0);
  put<std::uint32_t>(out, 12, reply.rank);
  put<std::uint32_t>(out, 16, reply.num_channels);
  put<std::uint32_t>(out, 20, 0);
  std::memcpy(out.data() + kReplyFixedBytes, reply.text.data(), text_bytes);
  return out;
}

Result<std::size_t> hello_bytes_missing(std::span<const std::byte> prefix) {
  if (prefix.size() >= 4 && get<std::uint32_t>(prefix, 0) != kHelloMagic) {
    return make_error(ErrorCode::kProtocol,
                      "handshake: the peer's first bytes are not an Ember hello (magic {:#010x}, "
                      "expected {:#010x}): it is not an Ember worker, or speaks another protocol",
                      get<std::uint32_t>(prefix, 0), kHelloMagic);
  }
  if (prefix.size() < 8) return kHelloFixedBytes - prefix.size();
  const std::size_t token_bytes = get<std::uint16_t>(prefix, 6);
  if (token_bytes > kMaxTokenBytes) {
    return make_error(ErrorCode::kProtocol, "handshake: token of {} bytes exceeds the maximum {}",
                      token_bytes, kMaxTokenBytes);
  }
  const std::size_t total = kHelloFixedBytes + token_bytes;
  return prefix.size() >= total ? 0 : total - prefix.size();
}

Result<std::size_t> reply_bytes_missing(std::span<const std::byte> prefix) {
  if (prefix.size() >= 4 && get<std::uint32_t>(prefix, 0) != kReplyMagic) {
    return make_error(ErrorCode::kProtocol,
                      "handshake: the listener's reply is not an Ember reply (magic {:#010x}, "
                      "expected {:#010x}): the address is not an Ember server",
                      get<std::uint32_t>(prefix, 0), kReplyMagic);
  }
  if (prefix.size() < 8) return kReplyFixedBytes - prefix.size();
  const std::size_t text_bytes = get<std::uint16_t>(prefix, 6);
  if (text_bytes > kMaxReplyTextBytes) {
    return make_error(ErrorCode::kProtocol, "handshake: reply text of {} bytes exceeds the maximum {}",
                      text_bytes, kMaxReplyTextBytes);
  }
  const std::size_t total = kReplyFixedBytes + text_bytes;
  return prefix.size() >= total ? 0 : total - prefix.size();
}

Result<Hello> decode_hello(std::span<const std::byte> bytes) {
  EMBER_ASSIGN_OR_RETURN(std::size_t missing, hello_bytes_missing(bytes));
  if (missing != 0 || bytes.size() != kHelloFixedBytes + get<std::uint16_t>(bytes, 6)) {
    return make_error(ErrorCode::kProtocol, "handshake: hello of {} bytes is incomplete or too long",
                      bytes.size());
  }
  Hello h;
  h.version = get<std::uint16_t>(bytes, 4);
  const auto role = get<std::uint8_t>(bytes, 8);
  const auto kind = get<std::uint8_t>(bytes, 9);
  if (!valid_role(role)) {
    return make_error(ErrorCode::kProtocol, "handshake: unknown role {} in hello", role);
  }
  if (!valid_kind(kind)) {
    return make_error(ErrorCode::kProtocol, "handshake: unknown transport kind {} in hello", kind);
  }
  if (get<std::uint16_t>(bytes, 10) != 0) {
    return make_error(ErrorCode::kProtocol, "handshake: reserved hello bytes 10..11 are not zero");
  }
  h.role = static_cast<Role>(role);
  h.kind = static_cast<Kind>(kind);
  h.rank = get<std::uint32_t>(bytes, 12);
  h.num_channels = get<std::uint32_t>(bytes, 16);
  h.channel = get<std::uint32_t>(bytes, 20);
  h.session_id = get<std::uint64_t>(bytes, 24);
  h.max_message_bytes = get<std::uint64_t>(bytes, 32);
  if (h.num_channels == 0 || h.channel >= h.num_channels) {
    return make_error(ErrorCode::kProtocol,
                      "handshake: hello names channel {} of {} channels (need channel < channels, "
                      "channels >= 1)",
                      h.channel, h.num_channels);
  }
  h.token.assign(reinterpret_cast<const char*>(bytes.data()) + kHelloFixedBytes,
                 bytes.size() - kHelloFixedBytes);
  return h;
}

Result<Reply> decode_reply(std::span<const std::byte> bytes) {
  EMBER_ASSIGN_OR_RETURN(std::size_t missing, reply_bytes_missing(bytes));
  if (missing != 0 || bytes.size() != kReplyFixedBytes + get<std::uint16_t>(bytes, 6)) {
    return make_error(ErrorCode::kProtocol, "handshake: reply of {} bytes is incomplete or too long",
                      bytes.size());
  }
  Reply r;
  r.version = get<std::uint16_t>(bytes, 4);
  const auto status = get<std::uint16_t>(bytes, 8);
  // A listener of another version may use codes and bytes this one does not
  // know; its reply still decodes, so the caller can name the mismatch.
  const bool same_version = r.version == kProtocolVersion;
  if (same_version && status > static_cast<std::uint16_t>(kLastErrorCode)) {
    return make_error(ErrorCode::kProtocol, "handshake: unknown status {} in reply", status);
  }
  r.status = static_cast<ErrorCode>(status);
  const auto role = get<std::uint8_t>(bytes, 10);
  if (!valid_role(role)) {
    return make_error(ErrorCode::kProtocol, "handshake: unknown role {} in reply", role);
  }
  if (same_version && (get<std::uint8_t>(bytes, 11) != 0 || get<std::uint32_t>(bytes, 20) != 0)) {
    return make_error(ErrorCode::kProtocol, "handshake: reserved reply bytes 11 and 20..23 are not zero");
  }
  r.role = static_cast<Role>(role);
  r.rank = get<std::uint32_t>(bytes, 12);
  r.num_channels = get<std::uint32_t>(bytes, 16);
  r.text.assign(reinterpret_cast<const char*>(bytes.data()) + kReplyFixedBytes,
                bytes.size() - kReplyFixedBytes);
  return r;
}

bool tokens_equal(std::string_view a, std::string_view b) noexcept {
  // Length is not secret enough to hide (it leaks through timing of the
  // read anyway); the content comparison does not stop early.
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

Status check_hello(const Hello& hello, const Expectations& expect) {
  if (hello.version != kProtocolVersion) {
    return make_error(ErrorCode::kVersionMismatch,
                      "protocol version mismatch: this {} speaks version {}, the {} (rank {}) "
                      "speaks version {}; run the same Ember release on both sides",
                      role_name(expect.self_role), kProtocolVersion, role_name(hello.role),
                      hello.rank, hello.version);
  }
  if (!expect.auth_token.empty()) {
    if (hello.token.empty()) {
      return make_error(ErrorCode::kAuth,
                        "the {} (rank {}) sent no auth token but this listener requires one; set "
                        "[communication] auth_token to the same secret on both sides",
                        role_name(hello.role), hello.rank);
    }
    if (!tokens_equal(hello.token, expect.auth_token)) {
      return make_error(ErrorCode::kAuth,
                        "the {} (rank {}) sent a wrong auth token; set [communication] auth_token "
                        "to the same secret on both sides",
                        role_name(hello.role), hello.rank);
    }
  }
  if (hello.kind != expect.kind) {
    return make_error(ErrorCode::kProtocol,
                      "the {} (rank {}) uses transport '{}' but this listener serves '{}'; set the "
                      "same [communication] transport on both sides",
                      role_name(hello.role), hello.rank, kind_name(hello.kind), kind_name(expect.kind));
  }
  if (hello.num_channels != expect.num_channels) {
    return make_error(ErrorCode::kProtocol,
                      "the {} (rank {}) asks for {} channels but this listener uses {}; set the "
                      "same [communication] channels on both sides",
                      role_name(hello.role), hello.rank, hello.num_channels, expect.num_channels);
  }
  return ok_status();
}

}  // namespace ember::transport::handshake
