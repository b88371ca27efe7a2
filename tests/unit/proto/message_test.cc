// Unit tests of the parameter-server protocol: round trips of every message
// type and one test per rejection rule of the decoder.
#include "common/proto/message.h"

#include <cerrno>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

namespace ember::proto {
namespace {

Header push_header(std::uint64_t elements) {
  Header h;
  h.type = MsgType::kPush;
  h.dtype = DType::kFloat32;
  h.request_id = 42;
  h.key = 0x1122334455667788ULL;
  h.step = 9;
  h.chunk_index = 1;
  h.num_chunks = 3;
  h.worker_rank = 2;
  h.num_elements = elements;
  h.offset_elements = 100;
  return h;
}

std::vector<std::byte> floats_bytes(std::vector<float> v) {
  std::vector<std::byte> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST(Proto, PushRoundTripsEveryField) {
  auto payload = floats_bytes({1.5f, -2.0f, 3.25f});
  const Header h = push_header(3);
  auto bytes = encode_message(h, {}, payload);
  ASSERT_EQ(bytes.size(), kHeaderBytes + 12);
  auto m = decode(bytes);
  ASSERT_TRUE(m) << m.error().to_string();
  EXPECT_EQ(m->header.type, MsgType::kPush);
  EXPECT_EQ(m->header.request_id, 42u);
  EXPECT_EQ(m->header.key, 0x1122334455667788ULL);
  EXPECT_EQ(m->header.step, 9u);
  EXPECT_EQ(m->header.chunk_index, 1u);
  EXPECT_EQ(m->header.num_chunks, 3u);
  EXPECT_EQ(m->header.worker_rank, 2u);
  EXPECT_EQ(m->header.num_elements, 3u);
  EXPECT_EQ(m->header.offset_elements, 100u);
  EXPECT_EQ(m->header.dtype, DType::kFloat32);
  ASSERT_EQ(m->payload.size(), 12u);
  float f[3];
  std::memcpy(f, m->payload.data(), 12);
  EXPECT_EQ(f[2], 3.25f);
}

TEST(Proto, WireBytesAreLittleEndianAtDocumentedOffsets) {
  const Header h = push_header(0);
  auto bytes = encode_message(h, {}, {});
  auto u8 = [&](std::size_t i) { return static_cast<unsigned>(bytes[i]); };
  EXPECT_EQ(u8(0), 'E');
  EXPECT_EQ(u8(1), 'M');
  EXPECT_EQ(u8(2), 'P');
  EXPECT_EQ(u8(3), 'S');
  EXPECT_EQ(u8(4), kVersion);
  EXPECT_EQ(u8(5), static_cast<unsigned>(MsgType::kPush));
  EXPECT_EQ(u8(16), 0x88u);  // key, least significant byte first
  EXPECT_EQ(u8(23), 0x11u);
  EXPECT_EQ(u8(24), 9u);     // step
  EXPECT_EQ(u8(36), 3u);     // num_chunks
  EXPECT_EQ(u8(40), 2u);     // worker_rank
  EXPECT_EQ(u8(56), 100u);   // offset_elements
}

TEST(Proto, InitCarriesShape) {
  Header h;
  h.type = MsgType::kInit;
  h.dtype = DType::kFloat32;
  h.ndim = 2;
  h.num_elements = 6;
  const std::uint64_t dims[] = {2, 3};
  auto bytes = encode_message(h, dims, floats_bytes({1, 2, 3, 4, 5, 6}));
  auto m = decode(bytes);
  ASSERT_TRUE(m) << m.error().to_string();
  ASSERT_EQ(m->shape().size(), 2u);
  EXPECT_EQ(m->shape()[0], 2u);
  EXPECT_EQ(m->shape()[1], 3u);
  EXPECT_EQ(m->payload.size(), 24u);
}

TEST(Proto, InitWithoutDataHasEmptyPayload) {
  Header h;
  h.type = MsgType::kInit;
  h.flags = kFlagNoData;
  h.dtype = DType::kFloat32;
  h.ndim = 1;
  h.num_elements = 5;
  const std::uint64_t dims[] = {5};
  EXPECT_TRUE(decode(encode_message(h, dims, {})));
  EXPECT_FALSE(decode(encode_message(h, dims, floats_bytes({1}))));
}

TEST(Proto, ScalarInitHasOneElement) {
  Header h;
  h.type = MsgType::kInit;
  h.dtype = DType::kFloat32;
  h.num_elements = 1;
  EXPECT_TRUE(decode(encode_message(h, {}, floats_bytes({7}))));
  h.num_elements = 2;
  EXPECT_FALSE(decode(encode_message(h, {}, floats_bytes({7, 8}))));
}

TEST(Proto, PayloadFollowsHasNoInlinePayload) {
  Header h = push_header(1000);
  h.flags = kFlagPayloadFollows;
  auto m = decode(encode_message(h, {}, {}));
  ASSERT_TRUE(m) << m.error().to_string();
  EXPECT_EQ(tensor_bytes(m->header), 4000u);
  EXPECT_FALSE(decode(encode_message(h, {}, floats_bytes({1}))));
  Header pull = push_header(1);
  pull.type = MsgType::kPull;
  pull.flags = kFlagPayloadFollows;
  EXPECT_FALSE(decode(encode_message(pull, {}, {})));  // a pull request has no data
  Header reply = reply_header(pull);
  reply.dtype = DType::kFloat32;
  reply.num_elements = 1000;
  reply.flags |= kFlagPayloadFollows;
  EXPECT_TRUE(decode(encode_message(reply, {}, {})));  // its reply may
  Header ack = reply_header(push_header(1));
  ack.flags |= kFlagPayloadFollows;
  EXPECT_FALSE(decode(encode_message(ack, {}, {})));   // a push ack may not
}

TEST(Proto, JoinBodiesRoundTrip) {
  Header h;
  h.type = MsgType::kJoin;
  h.worker_rank = 3;
  JoinRequestBody body{4, 2, 1, partition_check(4u << 20)};
  const auto bytes = encode_message(h, {}, encode_body(body));  // the view points into it
  auto m = decode(bytes);
  ASSERT_TRUE(m);
  auto back = decode_join_request(m->payload.first<sizeof(JoinRequestBody)>());
  EXPECT_EQ(back.num_workers, 4u);
  EXPECT_EQ(back.num_servers, 2u);
  EXPECT_EQ(back.server_index, 1u);
  EXPECT_EQ(back.partition_check, partition_check(4u << 20));
  EXPECT_NE(partition_check(4u << 20), 0u);
  EXPECT_NE(partition_check(4u << 20), partition_check(8u << 10));

  Header r = reply_header(h);
  JoinReplyBody rb{4, 2, 1, static_cast<std::uint8_t>(Consistency::kSsp),
                   static_cast<std::uint8_t>(LossPolicy::kShrink), 3, 5,
                   static_cast<std::uint8_t>(OptimizerCode::kMomentum), 1, {}, 0};
  const double numbers[] = {0.1, 0.9, 0.9, 0.999, 1e-8, 0.0, 0.1};
  rb.optimizer_check = optimizer_check(numbers);
  const auto reply_bytes = encode_message(r, {}, encode_body(rb));
  auto rm = decode(reply_bytes);
  ASSERT_TRUE(rm) << rm.error().to_string();
  auto rback = decode_join_reply(rm->payload.first<sizeof(JoinReplyBody)>());
  EXPECT_EQ(rback.staleness, 5u);
  EXPECT_EQ(rback.num_shards, 3u);
  EXPECT_EQ(rback.consistency, static_cast<std::uint8_t>(Consistency::kSsp));
  EXPECT_EQ(rback.optimizer, static_cast<std::uint8_t>(OptimizerCode::kMomentum));
  EXPECT_EQ(rback.nesterov, 1u);
  EXPECT_EQ(rback.optimizer_check, rb.optimizer_check);
  // The check is never 0 (0 = not stated) and changes with any number.
  EXPECT_NE(rb.optimizer_check, 0u);
  for (std::size_t i = 0; i < std::size(numbers); ++i) {
    double other[std::size(numbers)];
    std::copy(std::begin(numbers), std::end(numbers), other);
    other[i] = other[i] == 0.0 ? 1e-4 : other[i] * 2;
    EXPECT_NE(optimizer_check(other), rb.optimizer_check) << "number " << i;
  }
  EXPECT_EQ(optimizer_name(OptimizerCode::kAdamW), "adamw");
  EXPECT_EQ(optimizer_name(static_cast<OptimizerCode>(9)), "unknown");
  // A 24-byte reply (a server built before the optimizer field) is refused
  // with the size it should have.
  auto short_reply = encode_message(r, {}, std::span<const std::byte>(encode_body(rb)).first(24));
  auto refused = decode(short_reply);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("join reply body is 24 bytes, expected 32"),
            std::string::npos)
      << refused.error().to_string();
}

TEST(Proto, SetLearningRateCarriesOneDouble) {
  Header h;
  h.type = MsgType::kSetLearningRate;
  h.dtype = DType::kFloat64;
  h.num_elements = 1;
  const auto bytes = encode_message(h, {}, encode_f64(0.0125));
  auto m = decode(bytes);
  ASSERT_TRUE(m);
  EXPECT_EQ(decode_f64(m->payload.first<8>()), 0.0125);
  h.num_elements = 2;
  EXPECT_FALSE(decode(encode_message(h, {}, encode_f64(0.1))));
}

TEST(Proto, ErrorReplyCarriesCodeAndText) {
  auto bytes = encode_error_reply(push_header(3), Error(ErrorCode::kStale, "step 3 is over"));
  auto m = decode(bytes);
  ASSERT_TRUE(m) << m.error().to_string();
  EXPECT_TRUE(m->header.is_reply());
  EXPECT_EQ(m->header.status, ErrorCode::kStale);
  EXPECT_EQ(m->text(), "step 3 is over");
  EXPECT_EQ(m->header.request_id, 42u);
}

// A system error's cause reaches the worker (a checkpoint on a full disk
// used to say only "write '...' failed").
TEST(Proto, ErrorReplyOfASystemErrorNamesTheCause) {
  auto bytes = encode_error_reply(push_header(3), Error(ErrorCode::kIo, "write 'x.tmp' failed", ENOSPC));
  auto m = decode(bytes);
  ASSERT_TRUE(m) << m.error().to_string();
  EXPECT_EQ(m->header.status, ErrorCode::kIo);
  EXPECT_EQ(m->text(), "write 'x.tmp' failed: No space left on device (errno 28)");
  // A message too long for the reply is cut before the cause, not the cause.
  auto cut = decode(encode_error_reply(push_header(3), Error(ErrorCode::kIo, std::string(9000, 'x'), ENOSPC)));
  ASSERT_TRUE(cut);
  EXPECT_EQ(cut->payload.size(), kMaxErrorTextBytes);
  EXPECT_TRUE(cut->text().ends_with("xx: No space left on device (errno 28)")) << cut->text().substr(4000);
}

TEST(Proto, ErrorReplyTextIsTruncated) {
  auto bytes = encode_error_reply(push_header(3), Error(ErrorCode::kInternal, std::string(9000, 'x')));
  auto m = decode(bytes);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->payload.size(), kMaxErrorTextBytes);
}

TEST(Proto, PullReplyCarriesData) {
  Header req = push_header(2);
  req.type = MsgType::kPull;
  Header r = reply_header(req);
  r.dtype = DType::kFloat32;
  r.num_elements = 2;
  EXPECT_TRUE(decode(encode_message(r, {}, floats_bytes({1, 2}))));
  EXPECT_FALSE(decode(encode_message(r, {}, floats_bytes({1}))));
}

// --- rejections: one per rule ---

std::vector<std::byte> good_push() { return encode_message(push_header(1), {}, floats_bytes({1})); }

void expect_malformed(const std::vector<std::byte>& bytes, std::string_view needle) {
  auto m = decode(bytes);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().code(), ErrorCode::kMalformedFrame) << m.error().to_string();
  EXPECT_NE(m.error().message().find(needle), std::string::npos) << m.error().message();
}

// --- in place (kFlagInPlace) ---

Header pull_header(std::uint64_t elements) {
  Header h = push_header(elements);
  h.type = MsgType::kPull;
  return h;
}

std::vector<std::byte> placement_bytes(std::uint32_t region, std::uint64_t offset,
                                       std::uint32_t window = 0) {
  const auto b = encode_body(ReplyPlacement{region, window, offset});
  return {b.begin(), b.end()};
}

TEST(Proto, InPlacePullCarriesItsPlacement) {
  Header h = pull_header(1000);
  h.flags = kFlagInPlace;
  const auto bytes = encode_message(h, {}, placement_bytes(3, 0x123456789ULL, 0x5001));
  // Documented layout: region at +64, window at +68, offset at +72, little-endian.
  EXPECT_EQ(bytes.size(), kHeaderBytes + 16);
  EXPECT_EQ(bytes[64], std::byte{3});
  EXPECT_EQ(bytes[68], std::byte{0x01});
  EXPECT_EQ(bytes[69], std::byte{0x50});
  EXPECT_EQ(bytes[72], std::byte{0x89});
  EXPECT_EQ(bytes[76], std::byte{0x01});
  auto m = decode(bytes);
  ASSERT_TRUE(m) << m.error().to_string();
  ASSERT_TRUE(m->placement.has_value());
  EXPECT_EQ(m->placement->region_id, 3u);
  EXPECT_EQ(m->placement->offset_bytes, 0x123456789ULL);
  EXPECT_EQ(m->placement->window, 0x5001u);
  EXPECT_TRUE(m->payload.empty());  // the placement is not tensor data
  // A plain pull has none.
  auto plain = decode(encode_message(pull_header(1000), {}, {}));
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->placement.has_value());
}

TEST(Proto, InPlacePushPullNeedsPayloadFollows) {
  Header h = push_header(1000);
  h.type = MsgType::kPushPull;
  h.flags = kFlagInPlace | kFlagPayloadFollows;
  auto m = decode(encode_message(h, {}, placement_bytes(0, 4096)));
  ASSERT_TRUE(m) << m.error().to_string();
  ASSERT_TRUE(m->placement.has_value());
  EXPECT_EQ(m->placement->offset_bytes, 4096u);
  // With its gradient inline there is no room for a placement.
  h.num_elements = 4;
  h.flags = kFlagInPlace;
  std::vector<std::byte> both = floats_bytes({1, 2, 3, 4});
  expect_malformed(encode_message(h, {}, both), "in-place flag outside");
}

TEST(Proto, InPlaceReplyCarriesNoData) {
  Header r = reply_header(pull_header(1000));
  r.dtype = DType::kFloat32;
  r.num_elements = 1000;
  r.flags |= kFlagInPlace;
  auto m = decode(encode_message(r, {}, {}));
  ASSERT_TRUE(m) << m.error().to_string();
  EXPECT_EQ(tensor_bytes(m->header), 4000u);
  EXPECT_FALSE(m->placement.has_value());
  expect_malformed(encode_message(r, {}, floats_bytes({1})), "expected no payload");
  Header follows = r;
  follows.flags |= kFlagPayloadFollows;
  expect_malformed(encode_message(follows, {}, {}), "in-place flag on a reply");
  Header ack = reply_header(push_header(1));
  ack.flags |= kFlagInPlace;
  expect_malformed(encode_message(ack, {}, {}), "in-place flag on a reply");
  Header err = reply_header(pull_header(1));
  err.status = ErrorCode::kNotFound;
  err.flags |= kFlagInPlace;
  expect_malformed(encode_message(err, {}, {}), "in-place flag on a reply");
}

TEST(ProtoDecode, RejectsMisplacedInPlaceFlag) {
  Header push = push_header(1);
  push.flags = kFlagInPlace;
  expect_malformed(encode_message(push, {}, floats_bytes({1, 2, 3, 4})), "in-place flag outside");
  Header barrier;
  barrier.type = MsgType::kBarrier;
  barrier.flags = kFlagInPlace;
  expect_malformed(encode_message(barrier, {}, placement_bytes(0, 0)), "in-place flag outside");
}

TEST(ProtoDecode, RejectsBadPlacementBody) {
  Header h = pull_header(8);
  h.flags = kFlagInPlace;
  expect_malformed(encode_message(h, {}, {}), "reply placement is 0 bytes");
  auto longer = placement_bytes(0, 0);
  longer.resize(24);
  expect_malformed(encode_message(h, {}, longer), "reply placement is 24 bytes");
  // The rest of the request is still checked.
  h.dtype = DType::kFloat64;
  expect_malformed(encode_message(h, {}, placement_bytes(0, 0)), "not a tensor type");
}


TEST(ProtoDecode, RejectsShortMessage) {
  auto b = good_push();
  b.resize(63);
  expect_malformed(b, "shorter");
}

TEST(ProtoDecode, RejectsBadMagic) {
  auto b = good_push();
  b[0] = std::byte{'X'};
  expect_malformed(b, "magic");
}

TEST(ProtoDecode, RejectsOtherVersionWithVersionMismatch) {
  auto b = good_push();
  b[4] = std::byte{kVersion + 1};
  auto m = decode(b);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().code(), ErrorCode::kVersionMismatch);
}

TEST(ProtoDecode, RejectsUnknownType) {
  auto b = good_push();
  b[5] = std::byte{0};
  expect_malformed(b, "type");
  b[5] = std::byte{kMaxMsgType + 1};
  expect_malformed(b, "type");
}

TEST(ProtoDecode, RejectsUnknownFlags) {
  auto b = good_push();
  b[6] = std::byte{0x80};
  expect_malformed(b, "flag");
}

TEST(ProtoDecode, RejectsUnknownDType) {
  auto b = good_push();
  b[7] = std::byte{kMaxDType + 1};
  expect_malformed(b, "dtype");
}

TEST(ProtoDecode, RejectsNonZeroReserved) {
  auto b = good_push();
  b[47] = std::byte{1};
  expect_malformed(b, "reserved");
}

TEST(ProtoDecode, RejectsTooManyDims) {
  auto b = good_push();
  b[46] = std::byte{kMaxDims + 1};
  expect_malformed(b, "ndim");
}

TEST(ProtoDecode, RejectsUnknownStatus) {
  auto b = good_push();
  b[44] = std::byte{200};
  expect_malformed(b, "status");
}

TEST(ProtoDecode, RejectsStatusInRequest) {
  Header h = push_header(1);
  h.status = ErrorCode::kStale;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "request carries status");
}

TEST(ProtoDecode, RejectsPayloadLengthMismatch) {
  expect_malformed(encode_message(push_header(2), {}, floats_bytes({1})), "payload");
  expect_malformed(encode_message(push_header(1), {}, floats_bytes({1, 2})), "payload");
}

TEST(ProtoDecode, RejectsHugeElementCountWithoutOverflow) {
  Header h = push_header(~std::uint64_t{0} / 4 + 1);  // times 4 wraps to 0
  expect_malformed(encode_message(h, {}, {}), "exceeds");
}

TEST(ProtoDecode, RejectsChunkIndexOutOfRange) {
  Header h = push_header(1);
  h.chunk_index = 3;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "chunk_index");
  h.chunk_index = 0;
  h.num_chunks = 0;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "chunk_index");
}

TEST(ProtoDecode, RejectsShapeOnPush) {
  Header h = push_header(1);
  h.ndim = 1;
  const std::uint64_t dims[] = {1};
  expect_malformed(encode_message(h, dims, floats_bytes({1})), "shape");
}

TEST(ProtoDecode, RejectsMessageEndingInsideShape) {
  Header h;
  h.type = MsgType::kInit;
  h.dtype = DType::kFloat32;
  h.ndim = 3;
  const std::uint64_t dims[] = {1, 1, 1};
  auto b = encode_message(h, dims, {});
  b.resize(kHeaderBytes + 8);
  expect_malformed(b, "shape");
}

TEST(ProtoDecode, RejectsShapeProductOverflow) {
  Header h;
  h.type = MsgType::kInit;
  h.flags = kFlagNoData;
  h.dtype = DType::kFloat32;
  h.ndim = 2;
  const std::uint64_t dims[] = {std::uint64_t{1} << 32, std::uint64_t{1} << 32};
  expect_malformed(encode_message(h, dims, {}), "exceed");
}

TEST(ProtoDecode, RejectsChunkOutsideTensor) {
  Header h;
  h.type = MsgType::kInit;
  h.flags = kFlagNoData;
  h.dtype = DType::kFloat32;
  h.ndim = 1;
  h.num_elements = 4;
  h.offset_elements = 8;
  const std::uint64_t dims[] = {10};
  expect_malformed(encode_message(h, dims, {}), "outside");
}

TEST(ProtoDecode, RejectsInitWithNonTensorDType) {
  Header h;
  h.type = MsgType::kInit;
  h.flags = kFlagNoData;
  h.dtype = DType::kFloat64;
  h.num_elements = 1;
  expect_malformed(encode_message(h, {}, {}), "tensor");
}

TEST(ProtoDecode, RejectsNoDataFlagOutsideInit) {
  Header h = push_header(1);
  h.flags = kFlagNoData;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "no-data");
}

TEST(ProtoDecode, RejectsPayloadOnPull) {
  Header h = push_header(1);
  h.type = MsgType::kPull;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "no payload");
}

TEST(ProtoDecode, RejectsWrongJoinBody) {
  Header h;
  h.type = MsgType::kJoin;
  expect_malformed(encode_message(h, {}, floats_bytes({1})), "join body");
}

TEST(ProtoDecode, RejectsErrorReplyWithDTypeOrLongText) {
  Header r = reply_header(push_header(1));
  r.status = ErrorCode::kStale;
  r.dtype = DType::kFloat32;
  expect_malformed(encode_message(r, {}, {}), "dtype");
  r.dtype = DType::kNone;
  std::vector<std::byte> text(kMaxErrorTextBytes + 1, std::byte{'a'});
  expect_malformed(encode_message(r, {}, text), "error text");
}

// Property: anything decode() accepts re-encodes to the same bytes.
TEST(ProtoDecode, AcceptedMessagesReencodeIdentically) {
  const std::uint64_t seed = std::random_device{}();
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const auto base = good_push();
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    auto b = base;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= std::byte(1u << (rng() % 8));
    auto m = decode(b);
    if (!m) continue;
    ++accepted;
    auto again = encode_message(m->header, m->shape(),
                                m->placement ? placement_bytes(m->placement->region_id,
                                                               m->placement->offset_bytes)
                                             : std::vector<std::byte>(m->payload.begin(),
                                                                      m->payload.end()));
    ASSERT_EQ(again, b) << "seed " << seed << " iteration " << i;
  }
  EXPECT_GT(accepted, 0);
}

}  // namespace
}  // namespace ember::proto
