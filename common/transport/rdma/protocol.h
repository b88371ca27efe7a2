// The rdma transport's own bytes on the wire: the 32-bit immediate of each
// SEND, the small control bodies, and the rdma_cm private data that carries
// the handshake. Pure encoders and trust-nothing decoders, testable without
// a device. Byte layouts (all little-endian; reserved bytes are zero and
// checked):
//   RtsBody     16 B: 0 u64 size_bytes | 8 u32 request (>= 1) | 12 u32 reserved
//   GrantBody   32 B: 0 u64 address | 8 u64 capacity_bytes (>= 1) | 16 u32 rkey |
//                     20 u32 slot (>= 1) | 24 u32 request (0: unsolicited) | 28 u32 reserved
//   NoGrantBody  8 B: 0 u32 request (>= 1) | 4 u32 reserved
//   ReleaseBody  8 B: 0 u32 slot (>= 1) | 4 u32 reserved
//   kFragFirst body: 0 u64 total message bytes | 8.. the first bytes
//
// Per channel, one RC queue pair carries, in the order they were posted:
//  * SEND with immediate (the receiver gets IBV_WC_RECV): the immediate is
//    type (bits 31..24) | credits returned (bits 23..0); the payload, if
//    any, is the type's body below. A batch's payload is one common/wire
//    batch frame, byte for byte as tcp sends it.
//  * RDMA WRITE with immediate (IBV_WC_RECV_RDMA_WITH_IMM): a large message
//    written straight into a block the receiver granted; the immediate is
//    the slot the grant named, the completion's byte_len the message size.
// Both consume one posted receive at the peer, hence one credit, except
// kCredit (see Channel in channel.h for the accounting).
//
// Immediates travel in network byte order (ibv_wc::imm_data, ibv_send_wr::
// imm_data are __be32); pack_imm/unpack_imm work in host order. Bodies are
// little-endian.
//
// Connect private data (kConnectDataBytes = 48, within the 56 bytes that
// rdma_cm leaves in an RC connect request): the 40-byte fixed part of the
// handshake Hello (common/transport/handshake.h) with token_bytes = 0 and
// kind = rdma, then a u64 digest of the auth token (token_digest). The token
// itself does not fit; like tcp's clear-text token the digest keeps honest
// mistakes out (another job's workers), not an attacker who can read the
// network. Accept/reject private data: a handshake Reply whose text is cut
// to fit (kMaxRejectDataBytes, the 148 bytes of an IB CM REJ).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "common/base/error.h"
#include "common/transport/handshake.h"

namespace ember::transport::rdma::protocol {

enum class MsgType : std::uint8_t {
  kBatch = 1,      // body: one common/wire batch frame
  kCredit = 2,     // no body; credits only; consumes no credit itself
  kHeartbeat = 3,  // no body; "I am alive"
  kGoodbye = 4,    // no body; nothing more follows on this channel from the sender
  kRts = 5,        // body: RtsBody — "I have a large message; where may I write it?"
  kGrant = 6,      // body: GrantBody — "write it there" (or, request 0: a slot for later)
  kNoGrant = 7,    // body: NoGrantBody — "no RDMA-writable memory here: send fragments"
  kRelease = 8,    // body: ReleaseBody — "I will not use this granted slot; free it"
  kFragFirst = 9,  // body: u64 total message bytes, then the message's first bytes
  kFragNext = 10,  // body: the message's next bytes
};
inline constexpr std::uint8_t kMaxMsgType = 10;
std::string_view msg_type_name(MsgType type) noexcept;

inline constexpr std::uint32_t kMaxImmCredits = (1u << 24) - 1;

// pre: credits <= kMaxImmCredits.
constexpr std::uint32_t pack_imm(MsgType type, std::uint32_t credits) noexcept {
  return (std::uint32_t{static_cast<std::uint8_t>(type)} << 24) | (credits & kMaxImmCredits);
}
struct Imm {
  MsgType type = MsgType::kBatch;
  std::uint32_t credits = 0;
};
// nullopt for an unknown type.
std::optional<Imm> unpack_imm(std::uint32_t imm) noexcept;

// Bodies (little-endian, sizes pinned by the encoders).
struct RtsBody {            // 16 bytes
  std::uint64_t size_bytes = 0;  // the large message's size
  std::uint32_t request = 0;     // sender's request number (>= 1), echoed by the grant
};
struct GrantBody {          // 32 bytes
  std::uint64_t address = 0;        // remote virtual address of the block
  std::uint64_t capacity_bytes = 0; // bytes that may be written there
  std::uint32_t rkey = 0;
  std::uint32_t slot = 0;           // the immediate to write with (>= 1)
  std::uint32_t request = 0;        // the RTS answered, or 0 for an unsolicited (re-armed) slot
};
struct NoGrantBody {        // 8 bytes
  std::uint32_t request = 0;
};
struct ReleaseBody {        // 8 bytes
  std::uint32_t slot = 0;
};
inline constexpr std::size_t kRtsBytes = 16;
inline constexpr std::size_t kGrantBytes = 32;
inline constexpr std::size_t kNoGrantBytes = 8;
inline constexpr std::size_t kReleaseBytes = 8;
inline constexpr std::size_t kFragHeaderBytes = 8;
// Largest control body: the size of a control slot in the send ring.
inline constexpr std::size_t kMaxControlBytes = 32;

void encode(const RtsBody& body, std::span<std::byte, kRtsBytes> out) noexcept;
void encode(const GrantBody& body, std::span<std::byte, kGrantBytes> out) noexcept;
void encode(const NoGrantBody& body, std::span<std::byte, kNoGrantBytes> out) noexcept;
void encode(const ReleaseBody& body, std::span<std::byte, kReleaseBytes> out) noexcept;
// Errors: kProtocol when `bytes` has the wrong size, a reserved byte is not
// zero, or a field is out of range (request/slot 0 where not allowed).
Result<RtsBody> decode_rts(std::span<const std::byte> bytes);
Result<GrantBody> decode_grant(std::span<const std::byte> bytes);
Result<NoGrantBody> decode_no_grant(std::span<const std::byte> bytes);
Result<ReleaseBody> decode_release(std::span<const std::byte> bytes);

// --- rdma_cm private data ---
inline constexpr std::size_t kConnectDataBytes = handshake::kHelloFixedBytes + 8;
inline constexpr std::size_t kMaxConnectDataBytes = 56;   // RC REQ under rdma_cm
inline constexpr std::size_t kMaxAcceptDataBytes = 196;   // RC REP
inline constexpr std::size_t kMaxRejectDataBytes = 148;   // RC REJ
static_assert(kConnectDataBytes <= kMaxConnectDataBytes);

// FNV-1a (64-bit) over the session id's 8 little-endian bytes, then the token.
// "" hashes like any other token; the listener compares digests only when it
// has a token configured.
std::uint64_t token_digest(std::string_view token, std::uint64_t session_id) noexcept;

// `hello.token` is not sent (its digest is); hello.kind must be kRdma.
std::vector<std::byte> encode_connect_data(const handshake::Hello& hello);
struct ConnectData {
  handshake::Hello hello;  // token empty
  std::uint64_t token_digest = 0;
};
// Accepts trailing padding (the CM pads private data to its full size).
// Errors: kProtocol for anything that is not an Ember rdma connect request.
Result<ConnectData> decode_connect_data(std::span<const std::byte> bytes);

// A Reply cut (text truncated at a UTF-8 boundary) to at most `max_bytes`.
std::vector<std::byte> encode_reply_data(handshake::Reply reply, std::size_t max_bytes);
// Accepts trailing padding. Errors: kProtocol (not an Ember reply).
Result<handshake::Reply> decode_reply_data(std::span<const std::byte> bytes);

}  // namespace ember::transport::rdma::protocol
