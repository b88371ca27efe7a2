// The handshake that opens every transport stream (each tcp channel
// connection, each shm control socket), before any frame is sent.
//
// The connecting side (a worker, or a server dialing a server) sends a Hello;
// the listening side answers with a Reply and, when the Reply's status is not
// kOk, closes the stream. Both are little-endian and their first 8 bytes
// (magic, version, and the Hello's/Reply's own length fields) keep this
// layout in every protocol version, so peers of different versions can still
// tell each other which versions they speak.
//
// Hello (kHelloFixedBytes = 40, then the token):
//   0  u32  magic 'EMBH' (0x48424D45)
//   4  u16  protocol version (kProtocolVersion)
//   6  u16  token_bytes (<= kMaxTokenBytes)
//   8  u8   role (Role)
//   9  u8   transport kind (Kind)
//  10  u16  reserved, 0
//  12  u32  rank
//  16  u32  num_channels (>= 1)
//  20  u32  channel index (< num_channels; 0 for shm, which has one stream)
//  24  u64  session id: random, the same on every channel stream of one
//           Connection, so the listener can group them
//  32  u64  max_message_bytes the sender accepts (informational)
//  40  token_bytes bytes of the auth token (opaque)
// Reply (kReplyFixedBytes = 24, then the text):
//   0  u32  magic 'EMBR' (0x52424D45)
//   4  u16  protocol version of the listener
//   6  u16  text_bytes (<= kMaxReplyTextBytes)
//   8  u16  status: ErrorCode (0 = accepted)
//  10  u8   role of the listener
//  11  u8   reserved, 0
//  12  u32  rank (server index) of the listener
//  16  u32  num_channels the listener accepts
//  20  u32  reserved, 0
//  24  text_bytes bytes of UTF-8: why the Hello was refused ("" when accepted)
//
// The token travels in clear text: it keeps honest mistakes (a worker of
// another job) out, not an attacker who can read the network. Use a private
// network or a tunnel for that.
//
// Thread-safety: pure functions; no allocation except the returned values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "common/transport/transport.h"

namespace ember::transport::handshake {

inline constexpr std::uint32_t kHelloMagic = 0x48424D45u;  // "EMBH"
inline constexpr std::uint32_t kReplyMagic = 0x52424D45u;  // "EMBR"
inline constexpr std::size_t kHelloFixedBytes = 40;
inline constexpr std::size_t kReplyFixedBytes = 24;
inline constexpr std::size_t kMaxTokenBytes = 1024;
inline constexpr std::size_t kMaxReplyTextBytes = 1024;

struct Hello {
  std::uint16_t version = kProtocolVersion;
  Role role = Role::kWorker;
  Kind kind = Kind::kTcp;
  std::uint32_t rank = 0;
  std::uint32_t num_channels = 1;
  std::uint32_t channel = 0;
  std::uint64_t session_id = 0;
  std::uint64_t max_message_bytes = 0;
  std::string token;
};

struct Reply {
  std::uint16_t version = kProtocolVersion;
  ErrorCode status = ErrorCode::kOk;
  Role role = Role::kServer;
  std::uint32_t rank = 0;
  std::uint32_t num_channels = 1;
  std::string text;
};

std::vector<std::byte> encode(const Hello& hello);
std::vector<std::byte> encode(const Reply& reply);

// Bytes still missing before the Hello/Reply in `prefix` can be decoded
// (0 when complete). Reads the fixed part's length field once it is there.
// Errors: kProtocol when the magic is wrong ("not an Ember peer"), when a
// length field exceeds its maximum.
Result<std::size_t> hello_bytes_missing(std::span<const std::byte> prefix);
Result<std::size_t> reply_bytes_missing(std::span<const std::byte> prefix);

// Decodes a complete Hello/Reply. Errors: kProtocol (bad magic, unknown
// role/kind, non-zero reserved bytes, channel >= num_channels, zero
// channels, length mismatch; in a Reply of this version, a status above
// kLastErrorCode or non-zero reserved bytes). A different version is NOT an
// error here: check_hello (or the caller, for a Reply) decides, and a Reply
// of another version keeps its status and reserved bytes unchecked.
Result<Hello> decode_hello(std::span<const std::byte> bytes);
Result<Reply> decode_reply(std::span<const std::byte> bytes);

// What a listener requires of a Hello.
struct Expectations {
  Kind kind = Kind::kTcp;
  std::uint32_t num_channels = 1;
  std::string_view auth_token;  // "" = none required (any token accepted)
  Role self_role = Role::kServer;
};

// The listener's verdict: ok, or the Error to put in the Reply (and log):
// kVersionMismatch naming both versions, kAuth for a missing or wrong token
// (compared in constant time), kProtocol for a kind or channel-count
// mismatch.
Status check_hello(const Hello& hello, const Expectations& expect);

// Constant-time comparison (no early exit on the first differing byte).
bool tokens_equal(std::string_view a, std::string_view b) noexcept;

}  // namespace ember::transport::handshake
