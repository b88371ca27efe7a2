// Encoding and the trust-nothing decoder of parameter-server messages; see
// message.h and docs/wire-format.md.
#include "common/proto/message.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "common/base/check.h"
#include "common/placement/placement.h"

namespace ember::proto {
namespace {

// Little-endian loads and stores that are correct on either byte order.
template <typename T>
T from_le(T v) noexcept {
  if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
    T out{};
    auto* src = reinterpret_cast<const unsigned char*>(&v);
    auto* dst = reinterpret_cast<unsigned char*>(&out);
    for (std::size_t i = 0; i < sizeof(T); ++i) dst[i] = src[sizeof(T) - 1 - i];
    return out;
  } else {
    return v;
  }
}
template <typename T>
T to_le(T v) noexcept {
  return from_le(v);
}

bool is_keyed(MsgType t) {
  return t == MsgType::kInit || t == MsgType::kPush || t == MsgType::kPull ||
         t == MsgType::kPushPull;
}

// Payload must be exactly num_elements of a tensor dtype (inline), or empty
// when it follows as the next message.
Status check_tensor_payload(const Header& h, std::size_t payload_bytes) {
  if (!is_tensor_dtype(h.dtype)) {
    return make_error(ErrorCode::kMalformedFrame, "{}: dtype {} cannot carry tensor data",
                      describe(h), dtype_name(h.dtype));
  }
  if (h.num_elements > kMaxElements) {
    return make_error(ErrorCode::kMalformedFrame, "{}: num_elements {} exceeds the limit {}",
                      describe(h), h.num_elements, kMaxElements);
  }
  std::uint64_t want = h.num_elements * dtype_bytes(h.dtype);  // no overflow: <= 2^43
  if ((h.flags & kFlagPayloadFollows) != 0) want = 0;
  if (payload_bytes != want) {
    return make_error(ErrorCode::kMalformedFrame,
                      "{}: payload is {} bytes but {} elements of {} need {}", describe(h),
                      payload_bytes, h.num_elements, dtype_name(h.dtype), want);
  }
  return ok_status();
}

Status check_empty_payload(const Header& h, std::size_t payload_bytes) {
  if (payload_bytes != 0) {
    return make_error(ErrorCode::kMalformedFrame, "{}: expected no payload, got {} bytes",
                      describe(h), payload_bytes);
  }
  return ok_status();
}

Status check_chunk_fields(const Header& h) {
  if (h.num_chunks == 0 || h.chunk_index >= h.num_chunks) {
    return make_error(ErrorCode::kMalformedFrame, "{}: chunk_index {} not below num_chunks {}",
                      describe(h), h.chunk_index, h.num_chunks);
  }
  if (h.num_elements > kMaxElements || h.offset_elements > kMaxElements) {
    return make_error(ErrorCode::kMalformedFrame,
                      "{}: num_elements {} or offset_elements {} exceeds the limit {}",
                      describe(h), h.num_elements, h.offset_elements, kMaxElements);
  }
  return ok_status();
}

Status check_request(const MessageView& m) {
  const Header& h = m.header;
  const std::size_t n = m.payload.size();
  if (h.status != ErrorCode::kOk) {
    return make_error(ErrorCode::kMalformedFrame, "{}: request carries status {}", describe(h),
                      static_cast<unsigned>(h.status));
  }
  if (h.type != MsgType::kInit && h.ndim != 0) {
    return make_error(ErrorCode::kMalformedFrame, "{}: only init carries a shape (ndim {})",
                      describe(h), h.ndim);
  }
  if ((h.flags & kFlagNoData) != 0 && h.type != MsgType::kInit) {
    return make_error(ErrorCode::kMalformedFrame, "{}: no-data flag outside init", describe(h));
  }
  if ((h.flags & kFlagPayloadFollows) != 0) {
    const bool data_request = h.type == MsgType::kPush || h.type == MsgType::kPushPull ||
                              (h.type == MsgType::kInit && (h.flags & kFlagNoData) == 0);
    if (!data_request) {
      return make_error(ErrorCode::kMalformedFrame,
                        "{}: payload-follows flag on a message without tensor data", describe(h));
    }
  }
  if ((h.flags & kFlagInPlace) != 0) {
    const bool placeable = h.type == MsgType::kPull ||
                           (h.type == MsgType::kPushPull && (h.flags & kFlagPayloadFollows) != 0);
    if (!placeable) {
      return make_error(ErrorCode::kMalformedFrame,
                        "{}: in-place flag outside a pull or a payload-follows push_pull",
                        describe(h));
    }
    if (n != sizeof(ReplyPlacement)) {
      return make_error(ErrorCode::kMalformedFrame, "{}: reply placement is {} bytes, expected {}",
                        describe(h), n, sizeof(ReplyPlacement));
    }
    EMBER_DCHECK(m.placement.has_value());
    // What follows checks the payload as if the placement were not there.
    MessageView rest = m;
    rest.payload = {};
    rest.header.flags &= static_cast<std::uint8_t>(~kFlagInPlace);
    return check_request(rest);
  }
  if (is_keyed(h.type)) EMBER_TRY(check_chunk_fields(h));
  switch (h.type) {
    case MsgType::kJoin:
      if (n != sizeof(JoinRequestBody)) {
        return make_error(ErrorCode::kMalformedFrame, "{}: join body is {} bytes, expected {}",
                          describe(h), n, sizeof(JoinRequestBody));
      }
      return ok_status();
    case MsgType::kInit: {
      // Shape product, overflow-checked, bounds the chunk.
      std::uint64_t total = 1;
      for (std::size_t i = 0; i < h.ndim; ++i) {
        const std::uint64_t d = m.dims[i];
        if (d > kMaxElements || (d != 0 && total > kMaxElements / d)) {
          return make_error(ErrorCode::kMalformedFrame,
                            "{}: shape dimension {} = {} makes the tensor exceed {} elements",
                            describe(h), i, d, kMaxElements);
        }
        total *= d;
      }
      if (h.offset_elements > total || h.num_elements > total - h.offset_elements) {
        return make_error(ErrorCode::kMalformedFrame,
                          "{}: chunk [{}, +{}) lies outside a tensor of {} elements", describe(h),
                          h.offset_elements, h.num_elements, total);
      }
      if (!is_tensor_dtype(h.dtype)) {
        return make_error(ErrorCode::kMalformedFrame, "{}: dtype {} is not a tensor type",
                          describe(h), dtype_name(h.dtype));
      }
      if ((h.flags & kFlagNoData) != 0) return check_empty_payload(h, n);
      return check_tensor_payload(h, n);
    }
    case MsgType::kPush:
    case MsgType::kPushPull:
      return check_tensor_payload(h, n);
    case MsgType::kPull:
      if (!is_tensor_dtype(h.dtype)) {
        return make_error(ErrorCode::kMalformedFrame, "{}: dtype {} is not a tensor type",
                          describe(h), dtype_name(h.dtype));
      }
      return check_empty_payload(h, n);
    case MsgType::kBarrier:
    case MsgType::kCheckpoint:
      return check_empty_payload(h, n);
    case MsgType::kSetLearningRate:
      if (h.dtype != DType::kFloat64 || h.num_elements != 1 || n != 8) {
        return make_error(ErrorCode::kMalformedFrame,
                          "{}: expected one float64 (dtype {}, {} elements, {} bytes)",
                          describe(h), dtype_name(h.dtype), h.num_elements, n);
      }
      return ok_status();
  }
  return make_error(ErrorCode::kMalformedFrame, "unknown type");  // unreachable: type checked
}

Status check_reply(const MessageView& m) {
  const Header& h = m.header;
  const std::size_t n = m.payload.size();
  if (h.ndim != 0 || (h.flags & kFlagNoData) != 0) {
    return make_error(ErrorCode::kMalformedFrame, "{}: reply with a shape or a no-data flag",
                      describe(h));
  }
  if ((h.flags & kFlagPayloadFollows) != 0 &&
      (h.status != ErrorCode::kOk || (h.type != MsgType::kPull && h.type != MsgType::kPushPull))) {
    return make_error(ErrorCode::kMalformedFrame,
                      "{}: payload-follows flag on a reply without tensor data", describe(h));
  }
  if ((h.flags & kFlagInPlace) != 0) {
    if (h.status != ErrorCode::kOk || (h.type != MsgType::kPull && h.type != MsgType::kPushPull) ||
        (h.flags & kFlagPayloadFollows) != 0) {
      return make_error(ErrorCode::kMalformedFrame,
                        "{}: in-place flag on a reply other than a pull or push_pull with data "
                        "written in place",
                        describe(h));
    }
    EMBER_TRY(check_chunk_fields(h));
    if (!is_tensor_dtype(h.dtype)) {
      return make_error(ErrorCode::kMalformedFrame, "{}: dtype {} cannot carry tensor data",
                        describe(h), dtype_name(h.dtype));
    }
    return check_empty_payload(h, n);
  }
  if (h.status != ErrorCode::kOk) {
    if (h.dtype != DType::kNone) {
      return make_error(ErrorCode::kMalformedFrame, "{}: error reply with dtype {}", describe(h),
                        dtype_name(h.dtype));
    }
    if (n > kMaxErrorTextBytes) {
      return make_error(ErrorCode::kMalformedFrame, "{}: error text of {} bytes exceeds {}",
                        describe(h), n, kMaxErrorTextBytes);
    }
    return ok_status();
  }
  switch (h.type) {
    case MsgType::kJoin:
      if (n != sizeof(JoinReplyBody)) {
        return make_error(ErrorCode::kMalformedFrame,
                          "{}: join reply body is {} bytes, expected {}", describe(h), n,
                          sizeof(JoinReplyBody));
      }
      return ok_status();
    case MsgType::kPull:
    case MsgType::kPushPull:
      EMBER_TRY(check_chunk_fields(h));
      return check_tensor_payload(h, n);
    case MsgType::kInit:
    case MsgType::kPush:
      EMBER_TRY(check_chunk_fields(h));
      return check_empty_payload(h, n);
    case MsgType::kBarrier:
    case MsgType::kSetLearningRate:
    case MsgType::kCheckpoint:
      return check_empty_payload(h, n);
  }
  return make_error(ErrorCode::kMalformedFrame, "unknown type");  // unreachable: type checked
}

}  // namespace

std::string_view msg_type_name(MsgType type) noexcept {
  switch (type) {
    case MsgType::kJoin: return "join";
    case MsgType::kInit: return "init";
    case MsgType::kPush: return "push";
    case MsgType::kPull: return "pull";
    case MsgType::kPushPull: return "push_pull";
    case MsgType::kBarrier: return "barrier";
    case MsgType::kSetLearningRate: return "set_learning_rate";
    case MsgType::kCheckpoint: return "checkpoint";
  }
  return "unknown";
}

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kNone: return "none";
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

std::string_view consistency_name(Consistency c) noexcept {
  switch (c) {
    case Consistency::kBsp: return "bsp";
    case Consistency::kAsp: return "asp";
    case Consistency::kSsp: return "ssp";
  }
  return "unknown";
}

std::string_view optimizer_name(OptimizerCode o) noexcept {
  switch (o) {
    case OptimizerCode::kSgd: return "sgd";
    case OptimizerCode::kMomentum: return "momentum";
    case OptimizerCode::kAdam: return "adam";
    case OptimizerCode::kAdamW: return "adamw";
    case OptimizerCode::kAdagrad: return "adagrad";
  }
  return "unknown";
}

std::string_view loss_policy_name(LossPolicy p) noexcept {
  switch (p) {
    case LossPolicy::kWait: return "wait";
    case LossPolicy::kShrink: return "shrink";
    case LossPolicy::kFail: return "fail";
  }
  return "unknown";
}

std::string describe(const Header& h) {
  std::string out = fmt::format("{}{} key={} chunk={}/{} step={} rank={} req={}",
                                msg_type_name(h.type), h.is_reply() ? " reply" : "", h.key,
                                h.chunk_index, h.num_chunks, h.step, h.worker_rank, h.request_id);
  return out;
}

Result<MessageView> decode(std::span<const std::byte> bytes) {
  if (bytes.size() < kHeaderBytes) {
    return make_error(ErrorCode::kMalformedFrame, "message of {} bytes is shorter than the {}-byte header",
                      bytes.size(), kHeaderBytes);
  }
  WireHeader w;
  std::memcpy(&w, bytes.data(), sizeof w);
  if (from_le(w.magic) != kMagic) {
    return make_error(ErrorCode::kMalformedFrame, "bad magic {:#010x} (expected {:#010x})",
                      from_le(w.magic), kMagic);
  }
  if (w.version != kVersion) {
    return make_error(ErrorCode::kVersionMismatch,
                      "protocol version {} but this build speaks {}; run the same Ember version "
                      "on workers and servers",
                      w.version, kVersion);
  }
  if (w.type == 0 || w.type > kMaxMsgType) {
    return make_error(ErrorCode::kMalformedFrame, "unknown message type {}", w.type);
  }
  if ((w.flags & ~kKnownFlags) != 0) {
    return make_error(ErrorCode::kMalformedFrame, "unknown flag bits {:#04x}", w.flags);
  }
  if (w.dtype > kMaxDType) {
    return make_error(ErrorCode::kMalformedFrame, "unknown dtype {}", w.dtype);
  }
  if (w.reserved != 0) {
    return make_error(ErrorCode::kMalformedFrame, "reserved header byte is {} (must be 0)",
                      w.reserved);
  }
  if (w.ndim > kMaxDims) {
    return make_error(ErrorCode::kMalformedFrame, "ndim {} exceeds {}", w.ndim, kMaxDims);
  }
  const std::uint16_t status = from_le(w.status);
  if (status > static_cast<std::uint16_t>(kLastErrorCode)) {
    return make_error(ErrorCode::kMalformedFrame, "unknown status code {}", status);
  }
  MessageView m;
  Header& h = m.header;
  h.type = static_cast<MsgType>(w.type);
  h.flags = w.flags;
  h.dtype = static_cast<DType>(w.dtype);
  h.request_id = from_le(w.request_id);
  h.key = from_le(w.key);
  h.step = from_le(w.step);
  h.chunk_index = from_le(w.chunk_index);
  h.num_chunks = from_le(w.num_chunks);
  h.worker_rank = from_le(w.worker_rank);
  h.status = static_cast<ErrorCode>(status);
  h.ndim = w.ndim;
  h.num_elements = from_le(w.num_elements);
  h.offset_elements = from_le(w.offset_elements);

  const std::size_t prefix = prefix_bytes(h);
  if (bytes.size() < prefix) {
    return make_error(ErrorCode::kMalformedFrame, "{}: message of {} bytes ends inside its shape",
                      describe(h), bytes.size());
  }
  for (std::size_t i = 0; i < h.ndim; ++i) {
    std::uint64_t d;
    std::memcpy(&d, bytes.data() + kHeaderBytes + 8 * i, 8);
    m.dims[i] = from_le(d);
  }
  m.payload = bytes.subspan(prefix);
  if (!h.is_reply() && (h.flags & kFlagInPlace) != 0 && m.payload.size() == sizeof(ReplyPlacement)) {
    ReplyPlacement p;
    std::memcpy(&p, m.payload.data(), sizeof p);
    p.region_id = from_le(p.region_id);
    p.window = from_le(p.window);
    p.offset_bytes = from_le(p.offset_bytes);
    m.placement = p;
  }
  EMBER_TRY(h.is_reply() ? check_reply(m) : check_request(m));
  if (m.placement) m.payload = {};
  return m;
}

void encode_prefix(const Header& h, std::span<const std::uint64_t> dims, std::span<std::byte> out) {
  EMBER_CHECK_MSG(dims.size() == h.ndim && h.ndim <= kMaxDims, "dims {} ndim {}", dims.size(),
                  h.ndim);
  EMBER_CHECK_MSG(out.size() >= prefix_bytes(h), "out {} < prefix {}", out.size(),
                  prefix_bytes(h));
  WireHeader w{};
  w.magic = to_le(kMagic);
  w.version = kVersion;
  w.type = static_cast<std::uint8_t>(h.type);
  w.flags = h.flags;
  w.dtype = static_cast<std::uint8_t>(h.dtype);
  w.request_id = to_le(h.request_id);
  w.key = to_le(h.key);
  w.step = to_le(h.step);
  w.chunk_index = to_le(h.chunk_index);
  w.num_chunks = to_le(h.num_chunks);
  w.worker_rank = to_le(h.worker_rank);
  w.status = to_le(static_cast<std::uint16_t>(h.status));
  w.ndim = h.ndim;
  w.reserved = 0;
  w.num_elements = to_le(h.num_elements);
  w.offset_elements = to_le(h.offset_elements);
  std::memcpy(out.data(), &w, sizeof w);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::uint64_t d = to_le(dims[i]);
    std::memcpy(out.data() + kHeaderBytes + 8 * i, &d, 8);
  }
}

std::vector<std::byte> encode_message(const Header& header, std::span<const std::uint64_t> dims,
                                      std::span<const std::byte> payload) {
  std::vector<std::byte> out(prefix_bytes(header) + payload.size());
  encode_prefix(header, dims, out);
  if (!payload.empty()) {
    std::memcpy(out.data() + prefix_bytes(header), payload.data(), payload.size());
  }
  return out;
}

Header reply_header(const Header& request) noexcept {
  Header h;
  h.type = request.type;
  h.flags = kFlagReply;
  h.dtype = DType::kNone;
  h.request_id = request.request_id;
  h.key = request.key;
  h.step = request.step;
  h.chunk_index = request.chunk_index;
  h.num_chunks = request.num_chunks;
  h.worker_rank = request.worker_rank;
  h.status = ErrorCode::kOk;
  h.ndim = 0;
  h.num_elements = 0;
  h.offset_elements = request.offset_elements;
  return h;
}

std::vector<std::byte> encode_error_reply(const Header& request, const Error& error) {
  Header h = reply_header(request);
  h.status = error.code() == ErrorCode::kOk ? ErrorCode::kInternal : error.code();
  h.num_elements = 0;
  // The reply carries no errno field: a system error's cause goes into the
  // text ("...: No space left on device (errno 28)"), as in to_string(). A
  // long message is cut before the cause, so the cause always arrives.
  const std::string cause = error.cause().substr(0, kMaxErrorTextBytes);
  const std::string& message = error.message();
  std::string text = message.substr(0, kMaxErrorTextBytes - cause.size()) + cause;
  return encode_message(h, {}, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

std::array<std::byte, sizeof(JoinRequestBody)> encode_body(const JoinRequestBody& body) {
  JoinRequestBody w{to_le(body.num_workers), to_le(body.num_servers), to_le(body.server_index),
                    to_le(body.partition_check)};
  std::array<std::byte, sizeof w> out;
  std::memcpy(out.data(), &w, sizeof w);
  return out;
}

std::array<std::byte, sizeof(JoinReplyBody)> encode_body(const JoinReplyBody& body) {
  JoinReplyBody w = body;
  w.num_workers = to_le(body.num_workers);
  w.num_servers = to_le(body.num_servers);
  w.server_index = to_le(body.server_index);
  w.num_shards = to_le(body.num_shards);
  w.staleness = to_le(body.staleness);
  w.optimizer_check = to_le(body.optimizer_check);
  std::array<std::byte, sizeof w> out;
  std::memcpy(out.data(), &w, sizeof w);
  return out;
}

std::array<std::byte, sizeof(ReplyPlacement)> encode_body(const ReplyPlacement& body) {
  ReplyPlacement w{to_le(body.region_id), to_le(body.window), to_le(body.offset_bytes)};
  std::array<std::byte, sizeof w> out;
  std::memcpy(out.data(), &w, sizeof w);
  return out;
}

JoinRequestBody decode_join_request(std::span<const std::byte, sizeof(JoinRequestBody)> bytes) {
  JoinRequestBody w;
  std::memcpy(&w, bytes.data(), sizeof w);
  return {from_le(w.num_workers), from_le(w.num_servers), from_le(w.server_index),
          from_le(w.partition_check)};
}

std::uint32_t partition_check(std::uint64_t partition_bytes) noexcept {
  const std::uint64_t h = placement::mix64(partition_bytes);
  return static_cast<std::uint32_t>(h ^ (h >> 32)) | 1u;
}

std::uint32_t optimizer_check(std::span<const double> numbers) noexcept {
  std::uint64_t h = placement::mix64(numbers.size());
  for (double d : numbers) h = placement::mix64(h ^ std::bit_cast<std::uint64_t>(d));
  return static_cast<std::uint32_t>(h ^ (h >> 32)) | 1u;
}

JoinReplyBody decode_join_reply(std::span<const std::byte, sizeof(JoinReplyBody)> bytes) {
  JoinReplyBody w;
  std::memcpy(&w, bytes.data(), sizeof w);
  w.num_workers = from_le(w.num_workers);
  w.num_servers = from_le(w.num_servers);
  w.server_index = from_le(w.server_index);
  w.num_shards = from_le(w.num_shards);
  w.staleness = from_le(w.staleness);
  w.optimizer_check = from_le(w.optimizer_check);
  return w;
}

std::array<std::byte, 8> encode_f64(double value) {
  std::uint64_t bits = to_le(std::bit_cast<std::uint64_t>(value));
  std::array<std::byte, 8> out;
  std::memcpy(out.data(), &bits, 8);
  return out;
}

double decode_f64(std::span<const std::byte, 8> bytes) {
  std::uint64_t bits;
  std::memcpy(&bits, bytes.data(), 8);
  return std::bit_cast<double>(from_le(bits));
}

}  // namespace ember::proto
