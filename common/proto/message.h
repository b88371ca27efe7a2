// Request/reply protocol between workers and ember-server.
//
// Every message is one opaque transport message (see common/transport): a
// fixed 64-byte little-endian header, then `ndim` little-endian u64 shape
// dimensions (init only), then the payload (tensor elements, a fixed body, or
// the UTF-8 text of an error). The byte-by-byte layout is in
// docs/wire-format.md ("Parameter-server messages"); WireHeader below is that
// layout, pinned with static_asserts. The payload's length is not stored: it
// is the message length minus the header and the shape.
//
// A tensor larger than partition_bytes travels as chunks (common/placement's
// chunk_plan); each chunk is its own message carrying (chunk_index,
// num_chunks, offset_elements, num_elements), so a server sees and stores
// chunks, never whole tensors it does not own.
//
// Main invariant: decode() trusts nothing. Every field, every length and
// every product is checked (without overflow) before a byte of the payload is
// exposed; a message that passes decode() can be used without further bounds
// checks. Semantic checks (does the key exist, is the step over) belong to the
// server.
//
// Thread-safety: pure functions over caller-owned bytes. No allocation except
// encode_message()'s vector and error messages.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"

namespace ember::proto {

static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "mixed-endian hosts are not supported");

inline constexpr std::uint32_t kMagic = 0x53504D45;  // bytes 'E' 'M' 'P' 'S' on the wire
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 64;
inline constexpr std::size_t kMaxDims = 8;
// Structural bound on elements in one tensor or chunk (2^40 float32 = 4 TiB):
// keeps every byte-count product far from 64-bit overflow.
inline constexpr std::uint64_t kMaxElements = std::uint64_t{1} << 40;
// Error replies carry at most this much text.
inline constexpr std::size_t kMaxErrorTextBytes = 4096;
// Steps stay below this: a key's step moves by one per round, so 2^53 rounds
// (285 years at one per microsecond) mean a corrupt counter or a peer that
// breaks the protocol. A double holds every step exactly (Python, metrics),
// and clock arithmetic (clock + 1, clock + staleness) cannot wrap. The
// worker refuses an explicit step at or above it; the server a push.
inline constexpr std::uint64_t kLargestStep = std::uint64_t{1} << 53;

enum class MsgType : std::uint8_t {
  kJoin = 1,             // hello: rank and cluster sizes checked; reply JoinReplyBody
  kInit = 2,             // register (key, chunk) with shape and initial values
  kPush = 3,             // gradient of step `step`; reply is an ack
  kPull = 4,             // parameters for step >= `step`; reply carries them
  kPushPull = 5,         // push of step `step`, reply carries parameters of step+1
  kBarrier = 6,          // reply when every worker has entered its next barrier
  kSetLearningRate = 7,  // payload: one float64; reply after every shard applied it
  kCheckpoint = 8,       // write a checkpoint now; reply (step = sequence) when durable
};
inline constexpr std::uint8_t kMaxMsgType = 8;
std::string_view msg_type_name(MsgType type) noexcept;

// Element types of tensors on the wire and in the store. Only float32 is
// stored today; the field exists so float16/bfloat16 can follow without a
// protocol version change. kFloat64 is for scalars (learning rate).
enum class DType : std::uint8_t { kNone = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3, kFloat64 = 4 };
inline constexpr std::uint8_t kMaxDType = 4;
std::string_view dtype_name(DType dtype) noexcept;
// Bytes per element; 0 for kNone.
constexpr std::size_t dtype_bytes(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kNone: return 0;
  }
  return 0;
}
// True for the element types a tensor may have.
constexpr bool is_tensor_dtype(DType dtype) noexcept {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

// Flag bits (WireHeader::flags).
inline constexpr std::uint8_t kFlagReply = 0x01;   // a reply to request `request_id`
inline constexpr std::uint8_t kFlagNoData = 0x02;  // init without values: wait for rank 0's
// Messages with tensor data only (init, push and push_pull requests; pull
// and push_pull replies): the payload is not inline but is the next message
// on the same channel, exactly num_elements * dtype bytes long. Lets a sender
// send a chunk straight from its buffer (a transport Buffer over exactly the
// chunk) without a header in front.
inline constexpr std::uint8_t kFlagPayloadFollows = 0x04;
// In place (same-host transports; see ReplyPlacement). In a pull request, or
// a push_pull request with kFlagPayloadFollows: the inline payload is a
// 16-byte ReplyPlacement naming where in the worker's registered memory the
// reply's tensor data may be written. In a pull or push_pull reply with
// status kOk: the data was written there, the reply carries none. A server
// that cannot write there (tcp, rdma, a placement outside the memory it
// maps) ignores the placement and sends the data as usual.
inline constexpr std::uint8_t kFlagInPlace = 0x08;
inline constexpr std::uint8_t kKnownFlags =
    kFlagReply | kFlagNoData | kFlagPayloadFollows | kFlagInPlace;

// The header as the program sees it (host byte order, typed fields).
struct Header {
  MsgType type = MsgType::kJoin;
  std::uint8_t flags = 0;
  DType dtype = DType::kNone;
  std::uint64_t request_id = 0;   // chosen by the worker, echoed in the reply
  std::uint64_t key = 0;
  // Push: the worker's step. Pull: the least step wanted. Reply to init,
  // pull, push_pull: the step the worker should compute next. Barrier: the
  // worker's barrier number (request; a re-send of an answered one is
  // answered again) and the generation (reply). Join reply of server 0: the
  // number the rank's next barrier carries. Checkpoint reply: the
  // checkpoint sequence number.
  std::uint64_t step = 0;
  std::uint32_t chunk_index = 0;  // < num_chunks
  std::uint32_t num_chunks = 1;   // >= 1 for keyed messages
  std::uint32_t worker_rank = 0;
  ErrorCode status = ErrorCode::kOk;  // replies only; kOk in requests
  std::uint8_t ndim = 0;              // shape dimensions following the header (init)
  std::uint64_t num_elements = 0;     // elements of this chunk (payload elements when data flows)
  std::uint64_t offset_elements = 0;  // first element of this chunk within the tensor

  bool is_reply() const noexcept { return (flags & kFlagReply) != 0; }
};

// Wire image of the header: 64 bytes, every field little-endian, naturally
// aligned, no implicit padding. Reserved bytes are zero (checked).
struct WireHeader {
  std::uint32_t magic;            // 0  kMagic
  std::uint8_t version;           // 4  kVersion
  std::uint8_t type;              // 5  MsgType
  std::uint8_t flags;             // 6  kFlag*
  std::uint8_t dtype;             // 7  DType
  std::uint64_t request_id;       // 8
  std::uint64_t key;              // 16
  std::uint64_t step;             // 24
  std::uint32_t chunk_index;      // 32
  std::uint32_t num_chunks;       // 36
  std::uint32_t worker_rank;      // 40
  std::uint16_t status;           // 44 ErrorCode
  std::uint8_t ndim;              // 46 <= kMaxDims
  std::uint8_t reserved;          // 47 zero
  std::uint64_t num_elements;     // 48
  std::uint64_t offset_elements;  // 56
};
static_assert(sizeof(WireHeader) == kHeaderBytes);
static_assert(offsetof(WireHeader, magic) == 0);
static_assert(offsetof(WireHeader, version) == 4);
static_assert(offsetof(WireHeader, type) == 5);
static_assert(offsetof(WireHeader, flags) == 6);
static_assert(offsetof(WireHeader, dtype) == 7);
static_assert(offsetof(WireHeader, request_id) == 8);
static_assert(offsetof(WireHeader, key) == 16);
static_assert(offsetof(WireHeader, step) == 24);
static_assert(offsetof(WireHeader, chunk_index) == 32);
static_assert(offsetof(WireHeader, num_chunks) == 36);
static_assert(offsetof(WireHeader, worker_rank) == 40);
static_assert(offsetof(WireHeader, status) == 44);
static_assert(offsetof(WireHeader, ndim) == 46);
static_assert(offsetof(WireHeader, reserved) == 47);
static_assert(offsetof(WireHeader, num_elements) == 48);
static_assert(offsetof(WireHeader, offset_elements) == 56);

// Body of a join request (16 bytes, little-endian): the worker's view of the
// cluster, checked against the server's own config.
struct JoinRequestBody {
  std::uint32_t num_workers;   // 0
  std::uint32_t num_servers;   // 4
  std::uint32_t server_index;  // 8  index of the server the worker thinks it reached
  // 12: partition_check(partition_bytes) of the worker's [server]
  // partition_bytes, which fixes how tensors are cut into chunks; 0 = not
  // stated (not checked).
  std::uint32_t partition_check;
};
static_assert(sizeof(JoinRequestBody) == 16);
// A non-zero 32-bit digest of partition_bytes (placement::mix64, folded), so
// a server can refuse a worker that would cut tensors differently.
std::uint32_t partition_check(std::uint64_t partition_bytes) noexcept;
static_assert(offsetof(JoinRequestBody, server_index) == 8);

// Body of a request with kFlagInPlace (16 bytes, little-endian): the reply's
// tensor data (num_elements * dtype bytes) goes to bytes [offset_bytes, +n)
// of the memory region the worker registered with its transport as
// `region_id` (transport::Transport::register_memory; for shm the region is
// shared with the server at connect). The worker keeps that memory for the
// request until its reply arrives. The idea is a one-sided write, as an RDMA
// WRITE into a remote memory region (and DeepEP's buffers that peers write
// into): the server copies the parameters once, into their destination,
// instead of into a send buffer that the worker then copies again.
// `window`: the write window the worker opened for this request
// (transport::Connection::open_write_window; 0: none). The server writes
// through it, so once the worker gave up on the request (request_timeout)
// and closed the window, a late reply writes nothing.
struct ReplyPlacement {
  std::uint32_t region_id;  // 0
  std::uint32_t window;     // 4
  std::uint64_t offset_bytes;  // 8

  bool operator==(const ReplyPlacement&) const = default;
};
static_assert(sizeof(ReplyPlacement) == 16);
static_assert(offsetof(ReplyPlacement, offset_bytes) == 8);

// Consistency model and loss policy codes (JoinReplyBody, checkpoints).
enum class Consistency : std::uint8_t { kBsp = 0, kAsp = 1, kSsp = 2 };
enum class LossPolicy : std::uint8_t { kWait = 0, kShrink = 1, kFail = 2 };
// Optimizer codes (JoinReplyBody): the [optimizer] type the server applies.
enum class OptimizerCode : std::uint8_t { kSgd = 0, kMomentum = 1, kAdam = 2, kAdamW = 3, kAdagrad = 4 };
std::string_view consistency_name(Consistency c) noexcept;
std::string_view loss_policy_name(LossPolicy p) noexcept;
// "sgd", "momentum", "adam", "adamw", "adagrad" (the config's names); "unknown".
std::string_view optimizer_name(OptimizerCode o) noexcept;

// Body of a join reply (32 bytes, little-endian): the server's settings, so
// a worker can say when its own config disagrees (the server's apply) and
// refuse servers of one job that disagree with each other.
struct JoinReplyBody {
  std::uint32_t num_workers;   // 0
  std::uint32_t num_servers;   // 4
  std::uint32_t server_index;  // 8
  std::uint8_t consistency;    // 12 Consistency
  std::uint8_t loss_policy;    // 13 LossPolicy
  std::uint16_t num_shards;    // 14
  std::uint64_t staleness;     // 16 SSP bound s (0 otherwise)
  std::uint8_t optimizer;      // 24 OptimizerCode
  std::uint8_t nesterov;       // 25 1: Nesterov momentum (optimizer momentum only)
  std::uint8_t reserved[2];    // 26 zero
  // 28: optimizer_check() of the server's configured [optimizer] numbers; a
  // worker refuses servers of one job whose checks differ. 0: not sent.
  std::uint32_t optimizer_check;
};
static_assert(sizeof(JoinReplyBody) == 32);
static_assert(offsetof(JoinReplyBody, staleness) == 16);
static_assert(offsetof(JoinReplyBody, optimizer) == 24);
static_assert(offsetof(JoinReplyBody, optimizer_check) == 28);

// A 32-bit digest (never 0) of an [optimizer] table's numbers: learning_rate
// (as configured, not as set at run time), momentum, beta1, beta2, epsilon,
// weight_decay, initial_accumulator, in that order (server::
// optimizer_numbers, which zeroes those the type does not use), by their bit
// patterns (placement::mix64 chained). Equal numbers give equal checks;
// different ones differ but for a 2^-32 chance.
std::uint32_t optimizer_check(std::span<const double> numbers) noexcept;

// A decoded message: a typed header, the shape and the payload, both views
// into the decoded bytes (valid as long as those bytes are).
struct MessageView {
  Header header;
  std::array<std::uint64_t, kMaxDims> dims{};  // first header.ndim are valid
  std::span<const std::byte> payload;
  // A request with kFlagInPlace: its placement (the payload is then empty).
  std::optional<ReplyPlacement> placement;

  std::span<const std::uint64_t> shape() const { return {dims.data(), header.ndim}; }
  // Payload as text (error replies).
  std::string_view text() const {
    return {reinterpret_cast<const char*>(payload.data()), payload.size()};
  }
};

// Validates `bytes` as one message and returns a view of it. Checks, in
// order: length >= 64; magic; version (kVersionMismatch); type, flags,
// dtype, reserved, ndim; then the rules of the message type (payload length
// equals num_elements * dtype bytes for data messages, chunk_index <
// num_chunks, offset + num_elements <= product of the shape, the shape's
// product without overflow and <= kMaxElements, fixed bodies of the right
// length, error text <= kMaxErrorTextBytes, status kOk in requests; the
// in-place flag only on pull and payload-follows push_pull requests with a
// 16-byte placement (ReplyPlacement), and on successful pull and
// push_pull replies without data).
// Errors: kMalformedFrame naming the field and its value; kVersionMismatch.
[[nodiscard]] Result<MessageView> decode(std::span<const std::byte> bytes);

// Bytes of tensor data the message carries (num_elements * dtype bytes),
// inline or following. Meaningful for a decoded message.
constexpr std::uint64_t tensor_bytes(const Header& header) noexcept {
  return header.num_elements * dtype_bytes(header.dtype);
}

// Bytes that encode_prefix writes: 64 + 8 * header.ndim.
constexpr std::size_t prefix_bytes(const Header& header) noexcept {
  return kHeaderBytes + 8u * header.ndim;
}

// Writes the header and `dims` (header.ndim of them) at the start of `out`.
// pre: dims.size() == header.ndim <= kMaxDims, out.size() >= prefix_bytes().
// The caller writes the payload right after (zero-copy senders reserve
// prefix_bytes() of headroom in front of their payload).
void encode_prefix(const Header& header, std::span<const std::uint64_t> dims,
                   std::span<std::byte> out);

// Whole message in a new vector: prefix then payload (one copy of payload;
// for tests, control messages and error replies).
std::vector<std::byte> encode_message(const Header& header, std::span<const std::uint64_t> dims,
                                      std::span<const std::byte> payload);

// A reply header for `request`: same type, request id, key, chunk fields and
// rank, kFlagReply set, dtype kNone, no shape, status kOk.
Header reply_header(const Header& request) noexcept;

// An error reply to `request` carrying `error`'s code and message (truncated
// to kMaxErrorTextBytes).
std::vector<std::byte> encode_error_reply(const Header& request, const Error& error);

// Bodies to and from their wire images.
std::array<std::byte, sizeof(JoinRequestBody)> encode_body(const JoinRequestBody& body);
std::array<std::byte, sizeof(JoinReplyBody)> encode_body(const JoinReplyBody& body);
JoinRequestBody decode_join_request(std::span<const std::byte, sizeof(JoinRequestBody)> bytes);
JoinReplyBody decode_join_reply(std::span<const std::byte, sizeof(JoinReplyBody)> bytes);
std::array<std::byte, sizeof(ReplyPlacement)> encode_body(const ReplyPlacement& body);
std::array<std::byte, 8> encode_f64(double value);
double decode_f64(std::span<const std::byte, 8> bytes);

// "push key=7 chunk=0/1 step=3 rank=1" for log lines.
std::string describe(const Header& header);

}  // namespace ember::proto
