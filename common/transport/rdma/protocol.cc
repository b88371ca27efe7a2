#include "common/transport/rdma/protocol.h"

#include <bit>
#include <cstring>

namespace ember::transport::rdma::protocol {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the rdma control bodies are encoded with memcpy: little-endian hosts only");

template <typename T>
void put(std::span<std::byte> out, std::size_t offset, T value) noexcept {
  std::memcpy(out.data() + offset, &value, sizeof(T));
}
template <typename T>
T get(std::span<const std::byte> in, std::size_t offset) noexcept {
  T value;
  std::memcpy(&value, in.data() + offset, sizeof(T));
  return value;
}

Status check_body(std::span<const std::byte> bytes, std::size_t want, const char* what) {
  if (bytes.size() != want) {
    return make_error(ErrorCode::kProtocol, "rdma: {} body of {} bytes (expected {})", what,
                      bytes.size(), want);
  }
  return ok_status();
}

Status check_zero(std::span<const std::byte> bytes, std::size_t from, const char* what) {
  for (std::size_t i = from; i < bytes.size(); ++i) {
    if (bytes[i] != std::byte{0}) {
      return make_error(ErrorCode::kProtocol, "rdma: reserved byte {} of a {} body is not zero", i,
                        what);
    }
  }
  return ok_status();
}

}  // namespace

std::string_view msg_type_name(MsgType type) noexcept {
  switch (type) {
    case MsgType::kBatch: return "batch";
    case MsgType::kCredit: return "credit";
    case MsgType::kHeartbeat: return "heartbeat";
    case MsgType::kGoodbye: return "goodbye";
    case MsgType::kRts: return "rts";
    case MsgType::kGrant: return "grant";
    case MsgType::kNoGrant: return "no-grant";
    case MsgType::kRelease: return "release";
    case MsgType::kFragFirst: return "fragment-first";
    case MsgType::kFragNext: return "fragment-next";
  }
  return "unknown";
}

std::optional<Imm> unpack_imm(std::uint32_t imm) noexcept {
  const std::uint32_t type = imm >> 24;
  if (type == 0 || type > kMaxMsgType) return std::nullopt;
  return Imm{static_cast<MsgType>(type), imm & kMaxImmCredits};
}

void encode(const RtsBody& body, std::span<std::byte, kRtsBytes> out) noexcept {
  std::memset(out.data(), 0, out.size());
  put<std::uint64_t>(out, 0, body.size_bytes);
  put<std::uint32_t>(out, 8, body.request);
}

void encode(const GrantBody& body, std::span<std::byte, kGrantBytes> out) noexcept {
  std::memset(out.data(), 0, out.size());
  put<std::uint64_t>(out, 0, body.address);
  put<std::uint64_t>(out, 8, body.capacity_bytes);
  put<std::uint32_t>(out, 16, body.rkey);
  put<std::uint32_t>(out, 20, body.slot);
  put<std::uint32_t>(out, 24, body.request);
}

void encode(const NoGrantBody& body, std::span<std::byte, kNoGrantBytes> out) noexcept {
  std::memset(out.data(), 0, out.size());
  put<std::uint32_t>(out, 0, body.request);
}

void encode(const ReleaseBody& body, std::span<std::byte, kReleaseBytes> out) noexcept {
  std::memset(out.data(), 0, out.size());
  put<std::uint32_t>(out, 0, body.slot);
}

Result<RtsBody> decode_rts(std::span<const std::byte> bytes) {
  EMBER_TRY(check_body(bytes, kRtsBytes, "rts"));
  EMBER_TRY(check_zero(bytes, 12, "rts"));
  RtsBody b;
  b.size_bytes = get<std::uint64_t>(bytes, 0);
  b.request = get<std::uint32_t>(bytes, 8);
  if (b.request == 0) return make_error(ErrorCode::kProtocol, "rdma: rts with request number 0");
  return b;
}

Result<GrantBody> decode_grant(std::span<const std::byte> bytes) {
  EMBER_TRY(check_body(bytes, kGrantBytes, "grant"));
  EMBER_TRY(check_zero(bytes, 28, "grant"));
  GrantBody b;
  b.address = get<std::uint64_t>(bytes, 0);
  b.capacity_bytes = get<std::uint64_t>(bytes, 8);
  b.rkey = get<std::uint32_t>(bytes, 16);
  b.slot = get<std::uint32_t>(bytes, 20);
  b.request = get<std::uint32_t>(bytes, 24);
  if (b.slot == 0) return make_error(ErrorCode::kProtocol, "rdma: grant of slot 0");
  if (b.capacity_bytes == 0) return make_error(ErrorCode::kProtocol, "rdma: grant of 0 bytes");
  return b;
}

Result<NoGrantBody> decode_no_grant(std::span<const std::byte> bytes) {
  EMBER_TRY(check_body(bytes, kNoGrantBytes, "no-grant"));
  EMBER_TRY(check_zero(bytes, 4, "no-grant"));
  NoGrantBody b;
  b.request = get<std::uint32_t>(bytes, 0);
  if (b.request == 0) return make_error(ErrorCode::kProtocol, "rdma: no-grant for request 0");
  return b;
}

Result<ReleaseBody> decode_release(std::span<const std::byte> bytes) {
  EMBER_TRY(check_body(bytes, kReleaseBytes, "release"));
  EMBER_TRY(check_zero(bytes, 4, "release"));
  ReleaseBody b;
  b.slot = get<std::uint32_t>(bytes, 0);
  if (b.slot == 0) return make_error(ErrorCode::kProtocol, "rdma: release of slot 0");
  return b;
}

std::uint64_t token_digest(std::string_view token, std::uint64_t session_id) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a offset basis
  auto mix = [&h](unsigned char c) {
    h ^= c;
    h *= 0x100000001b3ull;  // FNV prime
  };
  for (int i = 0; i < 8; ++i) mix(static_cast<unsigned char>(session_id >> (8 * i)));
  for (char c : token) mix(static_cast<unsigned char>(c));
  return h;
}

std::vector<std::byte> encode_connect_data(const handshake::Hello& hello) {
  handshake::Hello fixed = hello;
  fixed.token.clear();
  std::vector<std::byte> out = handshake::encode(fixed);
  out.resize(kConnectDataBytes);
  put<std::uint64_t>(out, handshake::kHelloFixedBytes, token_digest(hello.token, hello.session_id));
  return out;
}

Result<ConnectData> decode_connect_data(std::span<const std::byte> bytes) {
  if (bytes.size() < kConnectDataBytes) {
    return make_error(ErrorCode::kProtocol,
                      "rdma: connect request carries {} bytes of private data, an Ember peer "
                      "sends {}: the peer is not an Ember worker",
                      bytes.size(), kConnectDataBytes);
  }
  EMBER_ASSIGN_OR_RETURN(handshake::Hello hello,
                         handshake::decode_hello(bytes.first(handshake::kHelloFixedBytes)));
  ConnectData d;
  d.hello = std::move(hello);
  d.token_digest = get<std::uint64_t>(bytes, handshake::kHelloFixedBytes);
  return d;
}

std::vector<std::byte> encode_reply_data(handshake::Reply reply, std::size_t max_bytes) {
  const std::size_t room =
      max_bytes > handshake::kReplyFixedBytes ? max_bytes - handshake::kReplyFixedBytes : 0;
  if (reply.text.size() > room) {
    std::size_t cut = room;
    // Do not split a UTF-8 sequence: back up over continuation bytes.
    while (cut > 0 && (static_cast<unsigned char>(reply.text[cut]) & 0xC0) == 0x80) --cut;
    reply.text.resize(cut);
  }
  return handshake::encode(reply);
}

Result<handshake::Reply> decode_reply_data(std::span<const std::byte> bytes) {
  if (bytes.size() < handshake::kReplyFixedBytes) {
    return make_error(ErrorCode::kProtocol,
                      "rdma: the listener's reply carries {} bytes of private data (need {}): "
                      "the address is not an Ember server",
                      bytes.size(), handshake::kReplyFixedBytes);
  }
  EMBER_ASSIGN_OR_RETURN(std::size_t missing,
                         handshake::reply_bytes_missing(bytes.first(handshake::kReplyFixedBytes)));
  const std::size_t total = handshake::kReplyFixedBytes + missing;
  if (bytes.size() < total) {
    return make_error(ErrorCode::kProtocol, "rdma: the listener's reply is truncated ({} of {} bytes)",
                      bytes.size(), total);
  }
  return handshake::decode_reply(bytes.first(total));
}

}  // namespace ember::transport::rdma::protocol
