// FrameDecoder and decode_frame: every malformed class with its exact error
// code and offsets, 1-byte-at-a-time feeding, zero-copy receive with an
// external body, poisoning, truncation, and seeded random round trips.
#include "common/wire/frame_decoder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <memory>
#include <random>

#include "common/wire/batch_encoder.h"
#include "tests/unit/wire/wire_test_util.h"

namespace ember::wire {
namespace {

using ::testing::HasSubstr;
using testing::Bytes;
using testing::RefItem;

struct Received {
  Bytes payload;
  std::uint32_t flags = 0;
  bool operator==(const Received&) const = default;
};

FrameDecoder make_decoder(DecoderOptions options = {}) {
  auto dec = FrameDecoder::create(options);
  EXPECT_TRUE(dec.has_value()) << dec.error().to_string();
  return std::move(*dec);
}

// Takes every ready frame; fails the test on a decoder error.
void drain(FrameDecoder& dec, std::vector<Received>& got) {
  for (;;) {
    auto frame = dec.next();
    ASSERT_TRUE(frame) << frame.error().to_string();
    if (!*frame) return;
    for (Item item : **frame) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(item.payload.data()) % 8, 0u);
      got.push_back({Bytes(item.payload.begin(), item.payload.end()), item.flags});
    }
  }
}

// Feeds `stream` one byte at a time, taking frames as they complete.
// Returns the decoder's error (or an Error with kOk when there was none).
Error feed_bytewise(FrameDecoder& dec, const Bytes& stream, std::vector<Received>* got = nullptr) {
  for (std::byte b : stream) {
    if (auto s = dec.feed({&b, 1}); !s) return s.error();
    for (;;) {
      auto frame = dec.next();
      if (!frame) return frame.error();
      if (!*frame) break;
      if (got) {
        for (Item item : **frame) {
          got->push_back({Bytes(item.payload.begin(), item.payload.end()), item.flags});
        }
      }
    }
  }
  return Error();
}

Bytes good_frame() {
  return testing::reference_frame({RefItem{Bytes(10, std::byte{1}), 1},
                                   RefItem{Bytes(3, std::byte{2}), 2},
                                   RefItem{Bytes(8, std::byte{3}), 3}});
  // 96 bytes: prefix 64, item 0 [64, 74), item 1 [80, 83), item 2 [88, 96).
}

// A valid frame, then `bad`, fed byte by byte; returns the error. Checks that
// the good frame's items came out and no item of the bad frame did.
Error error_after_good_frame(const Bytes& bad, DecoderOptions options = {}) {
  FrameDecoder dec = make_decoder(options);
  Bytes stream = good_frame();
  stream.insert(stream.end(), bad.begin(), bad.end());
  std::vector<Received> got;
  Error e = feed_bytewise(dec, stream, &got);
  EXPECT_EQ(got.size(), 3u) << "items of the bad frame were handed out";
  EXPECT_TRUE(dec.poisoned());
  // Same answer from decode_frame on the bad frame alone.
  auto one_shot = decode_frame(testing::as_span(bad), options);
  EXPECT_FALSE(one_shot);
  if (!one_shot) {
    EXPECT_EQ(one_shot.error().code(), e.code());
  }
  return e;
}

void expect_error(const Error& e, ErrorCode code, const std::string& what,
                  std::size_t frame_byte) {
  EXPECT_EQ(e.code(), code) << e.to_string();
  EXPECT_THAT(e.message(), HasSubstr(what));
  const std::size_t g = good_frame().size();
  EXPECT_THAT(e.message(), HasSubstr(fmt::format("frame at stream byte {}:", g)));
  EXPECT_THAT(e.message(),
              HasSubstr(fmt::format("[at frame byte {}, stream byte {}]", frame_byte, g + frame_byte)));
}

// ----------------------------------------------------------------------------
// Malformed classes

TEST(FrameDecoderMalformed, BadMagic) {
  Bytes bad = good_frame();
  testing::put_u32(bad, 0, 0xDEADBEEF);
  expect_error(error_after_good_frame(bad), ErrorCode::kMalformedFrame, "bad magic 0xdeadbeef", 0);
}

TEST(FrameDecoderMalformed, BadVersion) {
  Bytes bad = good_frame();
  testing::put_u8(bad, 8, 2);
  testing::refresh_crc(bad);
  expect_error(error_after_good_frame(bad), ErrorCode::kVersionMismatch,
               "unsupported wire version 2", 8);
}

TEST(FrameDecoderMalformed, UnknownKindFlagsOrReserved) {
  Bytes kind = good_frame();
  testing::put_u8(kind, 9, 7);
  testing::refresh_crc(kind);
  expect_error(error_after_good_frame(kind), ErrorCode::kMalformedFrame, "unknown frame kind 7", 9);
  Bytes flags = good_frame();
  testing::put_u16(flags, 10, 0x8000);
  testing::refresh_crc(flags);
  expect_error(error_after_good_frame(flags), ErrorCode::kMalformedFrame,
               "unknown frame flags 0x8000", 10);
  Bytes reserved = good_frame();
  testing::put_u32(reserved, 20, 1);
  testing::refresh_crc(reserved);
  expect_error(error_after_good_frame(reserved), ErrorCode::kMalformedFrame,
               "reserved field is 0x00000001", 20);
}

TEST(FrameDecoderMalformed, PrefixChecksumFlagOnABatchFrame) {
  Bytes batch = good_frame();
  testing::put_u16(batch, 10, kFrameFlagPrefixChecksum);
  testing::refresh_crc(batch);
  expect_error(error_after_good_frame(batch), ErrorCode::kMalformedFrame,
               "only single frames (kind 2) may leave their payload out of the checksum", 10);
}

TEST(FrameDecoderMalformed, ZeroItems) {
  Bytes bad = good_frame();
  testing::put_u32(bad, 12, 0);
  testing::refresh_crc(bad);
  expect_error(error_after_good_frame(bad), ErrorCode::kMalformedFrame, "zero items", 12);
}

TEST(FrameDecoderMalformed, CountTooLarge) {
  Bytes bad = good_frame();  // 96 bytes: at most (96 - 24) / 12 = 6 items fit
  ASSERT_EQ(bad.size(), 96u);
  testing::put_u32(bad, 12, 7);
  testing::refresh_crc(bad);
  expect_error(error_after_good_frame(bad), ErrorCode::kMalformedFrame,
               "item count too large: item_count 7 needs a 108-byte header and table but "
               "frame_bytes is 96 (at most 6 items fit)",
               12);
  Bytes huge = good_frame();
  testing::put_u32(huge, 12, 0xFFFFFFFF);
  testing::refresh_crc(huge);
  expect_error(error_after_good_frame(huge), ErrorCode::kMalformedFrame,
               "item count too large: item_count 4294967295", 12);
}

TEST(FrameDecoderMalformed, SingleFrameWithTwoItems) {
  Bytes bad = testing::reference_frame({RefItem{Bytes(8), 0}, RefItem{Bytes(8), 0}},
                                       FrameKind::kSingle);
  expect_error(error_after_good_frame(bad), ErrorCode::kMalformedFrame,
               "item count 2 in a single frame", 12);
}

TEST(FrameDecoderMalformed, OffsetOutOfRange) {
  Bytes past = good_frame();  // item 1's entry is at frame byte 24 + 12 = 36
  testing::put_u32(past, 36, 0x1000);
  testing::refresh_crc(past);
  expect_error(error_after_good_frame(past), ErrorCode::kMalformedFrame,
               "item 1 offset 4096 is out of range: payloads lie in [64, 96)", 36);
  Bytes into_table = good_frame();
  testing::put_u32(into_table, 24, 8);  // item 0 pointing into the header
  testing::refresh_crc(into_table);
  expect_error(error_after_good_frame(into_table), ErrorCode::kMalformedFrame,
               "item 0 offset 8 is out of range", 24);
  Bytes overlap = good_frame();
  testing::put_u32(overlap, 36, 64);  // item 1 overlapping item 0
  testing::refresh_crc(overlap);
  expect_error(error_after_good_frame(overlap), ErrorCode::kMalformedFrame,
               "item 1 offset 64 is not where packing puts it (80)", 36);
}

TEST(FrameDecoderMalformed, LengthOutOfRange) {
  Bytes bad = good_frame();  // item 2's entry is at frame byte 48: offset 88, length 8
  ASSERT_EQ(testing::get_u32(bad, 48), 88u);
  testing::put_u32(bad, 52, 9);  // [88, 97) past frame_bytes 96
  testing::refresh_crc(bad);
  expect_error(error_after_good_frame(bad), ErrorCode::kMalformedFrame,
               "item 2 length 9 is out of range: [88, 97) runs past frame_bytes 96", 52);
  Bytes huge = good_frame();
  testing::put_u32(huge, 28, 0xFFFFFFF0);
  testing::refresh_crc(huge);
  expect_error(error_after_good_frame(huge), ErrorCode::kMalformedFrame,
               "item 0 length 4294967280 is out of range", 28);
}

TEST(FrameDecoderMalformed, FrameBytesNotMatchingThePayloads) {
  Bytes longer = good_frame();
  longer.resize(longer.size() + 8, std::byte{0});
  testing::put_u32(longer, 16, static_cast<std::uint32_t>(longer.size()));
  testing::refresh_crc(longer);
  expect_error(error_after_good_frame(longer), ErrorCode::kMalformedFrame,
               "frame_bytes 104 does not match the payloads: the last item ends at 96, so frame_bytes must be 96", 16);
  Bytes unaligned = good_frame();
  testing::put_u32(unaligned, 16, 95);
  testing::refresh_crc(unaligned);
  expect_error(error_after_good_frame(unaligned), ErrorCode::kMalformedFrame,
               "frame_bytes 95 is invalid", 16);
}

TEST(FrameDecoderMalformed, LengthOverTheMaximumFailsBeforeTheBody) {
  Bytes bad = testing::reference_frame({RefItem{Bytes(5000, std::byte{1}), 0}});
  DecoderOptions options;
  options.max_frame_bytes = 4096;
  expect_error(error_after_good_frame(bad, options), ErrorCode::kTooLarge,
               "frame_bytes 5040 exceeds max_frame_bytes 4096", 16);
  // Only the header was needed: the decoder fails as soon as it has 24 bytes.
  FrameDecoder dec = make_decoder(options);
  auto s = dec.feed(std::span<const std::byte>(bad).first(kHeaderBytes));
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kTooLarge);
}

TEST(FrameDecoderMalformed, ChecksumMismatchInPayloadOrField) {
  Bytes payload_flip = good_frame();
  payload_flip[70] ^= std::byte{0x10};
  const Error e = error_after_good_frame(payload_flip);
  expect_error(e, ErrorCode::kChecksumMismatch, "checksum mismatch: the header says crc32c 0x", 4);
  EXPECT_THAT(e.message(), HasSubstr("frame bytes [8, 96) (3 items)"));
  Bytes field_flip = good_frame();
  field_flip[5] ^= std::byte{0x01};
  expect_error(error_after_good_frame(field_flip), ErrorCode::kChecksumMismatch,
               "checksum mismatch", 4);
  Bytes padding_flip = good_frame();  // bytes [74, 80) pad item 0
  padding_flip[77] ^= std::byte{0x01};
  expect_error(error_after_good_frame(padding_flip), ErrorCode::kChecksumMismatch,
               "checksum mismatch", 4);
}

TEST(FrameDecoderMalformed, TruncatedFrame) {
  const Bytes good = good_frame();
  for (std::size_t cut : {std::size_t{1}, std::size_t{23}, std::size_t{24}, std::size_t{60},
                          good.size() - 1}) {
    SCOPED_TRACE(cut);
    FrameDecoder dec = make_decoder();
    Bytes stream = good;
    stream.insert(stream.end(), good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    std::vector<Received> got;
    Error none = feed_bytewise(dec, stream, &got);
    EXPECT_EQ(none.code(), ErrorCode::kOk) << none.to_string();
    EXPECT_EQ(got.size(), 3u);  // the partial frame handed out nothing
    EXPECT_FALSE(dec.idle());
    auto s = dec.end_of_stream();
    ASSERT_FALSE(s);
    EXPECT_EQ(s.error().code(), ErrorCode::kMalformedFrame);
    EXPECT_THAT(s.error().message(), HasSubstr(fmt::format(
        "truncated frame: the stream ended at stream byte {} inside the frame that starts at "
        "stream byte 96: {} of ",
        96 + cut, cut)));
    if (cut >= kHeaderBytes) {
      EXPECT_THAT(s.error().message(), HasSubstr("of its 96 bytes"));
    }
    auto one_shot = decode_frame(std::span<const std::byte>(good).first(cut));
    ASSERT_FALSE(one_shot);
    EXPECT_EQ(one_shot.error().code(), ErrorCode::kMalformedFrame);
    EXPECT_THAT(one_shot.error().message(), HasSubstr("truncated frame"));
  }
}

TEST(FrameDecoderMalformed, EndOfStreamBetweenFramesIsClean) {
  FrameDecoder dec = make_decoder();
  std::vector<Received> got;
  ASSERT_EQ(feed_bytewise(dec, good_frame(), &got).code(), ErrorCode::kOk);
  EXPECT_TRUE(dec.idle());
  EXPECT_TRUE(dec.end_of_stream());
}

TEST(FrameDecoderMalformed, PoisonedDecoderKeepsItsError) {
  FrameDecoder dec = make_decoder();
  Bytes bad = good_frame();
  testing::put_u32(bad, 0, 1);
  ASSERT_FALSE(dec.feed(bad));
  ASSERT_TRUE(dec.poisoned());
  const std::string first = dec.error().message();
  auto again = dec.feed(good_frame());
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().message(), first);
  auto frame = dec.next();
  ASSERT_FALSE(frame);
  EXPECT_EQ(frame.error().message(), first);
  EXPECT_TRUE(dec.prepare().empty());
  EXPECT_FALSE(dec.end_of_stream());
}

TEST(FrameDecoder, CreateRejectsBadOptions) {
  auto tiny = FrameDecoder::create({.max_frame_bytes = 8});
  ASSERT_FALSE(tiny);
  EXPECT_EQ(tiny.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(tiny.error().message(), HasSubstr("max_frame_bytes = 8"));
  auto buffer = FrameDecoder::create({.receive_buffer_bytes = 0});
  ASSERT_FALSE(buffer);
  EXPECT_THAT(buffer.error().message(), HasSubstr("receive_buffer_bytes = 0"));
  auto ext = FrameDecoder::create({.external_body_min_bytes = 1});
  ASSERT_FALSE(ext);
  EXPECT_THAT(ext.error().message(), HasSubstr("external_body_min_bytes = 1"));
}

// ----------------------------------------------------------------------------
// Round trips

// Encodes `messages` the way a sender does (batches, singles for large ones)
// and returns the byte stream.
Bytes encode_stream(const std::vector<RefItem>& messages, std::size_t threshold,
                    std::mt19937_64& rng) {
  auto enc = BatchEncoder::create({.batch_threshold_bytes = threshold});
  EXPECT_TRUE(enc);
  Bytes stream;
  std::vector<std::byte> block(threshold + static_cast<std::size_t>(rng() % 64));
  enc->begin(block);
  auto flush = [&] {
    if (enc->empty()) return;
    auto frame = enc->finish();
    stream.insert(stream.end(), frame.begin(), frame.end());
    enc->begin(block);
  };
  for (const RefItem& m : messages) {
    if (m.payload.size() > enc->max_batched_payload_bytes()) {
      flush();  // keep order: the batch so far goes first
      std::array<std::byte, kSinglePrefixBytes> prefix;
      auto single = encode_single(prefix, m.payload, m.flags);
      EXPECT_TRUE(single);
      stream.insert(stream.end(), single->prefix.begin(), single->prefix.end());
      stream.insert(stream.end(), m.payload.begin(), m.payload.end());
      stream.insert(stream.end(), single->padding.begin(), single->padding.end());
      continue;
    }
    if (rng() % 2 == 0) {
      if (!enc->try_add(m.payload, m.flags)) {
        flush();
        EXPECT_TRUE(enc->try_add(m.payload, m.flags));
      }
    } else {  // in place, reserving a little more than needed
      auto space = enc->try_reserve(m.payload.size() + rng() % 16);
      if (!space) {
        flush();
        space = enc->try_reserve(m.payload.size());
        EXPECT_TRUE(space);
      }
      if (!m.payload.empty()) std::memcpy(space->data(), m.payload.data(), m.payload.size());
      enc->commit_reserved(m.payload.size(), m.flags);
    }
    if (rng() % 50 == 0) flush();  // a flush_interval tick
  }
  flush();
  enc->abandon();
  return stream;
}

std::vector<RefItem> random_messages(std::mt19937_64& rng, std::size_t count,
                                     std::size_t threshold) {
  std::vector<RefItem> messages;
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t size = 0;
    switch (rng() % 8) {
      case 0: size = 0; break;
      case 1: size = threshold - kMinFrameBytes + (rng() % 3) - 1; break;  // around the limit
      case 2: size = threshold + rng() % (4 * threshold); break;            // large
      default: size = rng() % 200; break;
    }
    messages.push_back({testing::random_bytes(rng, size), static_cast<std::uint32_t>(rng())});
  }
  return messages;
}

std::vector<Received> as_received(const std::vector<RefItem>& messages) {
  std::vector<Received> r;
  for (const auto& m : messages) r.push_back({m.payload, m.flags});
  return r;
}

TEST(FrameDecoderRoundTrip, RandomBatchesInRandomChunks) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderRoundTrip.RandomBatchesInRandomChunks"));
  for (int run = 0; run < 20; ++run) {
    const std::size_t threshold = std::size_t{64} << (rng() % 8);  // 64 B .. 8 KiB
    const auto messages = random_messages(rng, 300, threshold);
    const Bytes stream = encode_stream(messages, threshold, rng);
    FrameDecoder dec = make_decoder({.receive_buffer_bytes = 64 + rng() % 5000});
    std::vector<Received> got;
    for (std::size_t at = 0; at < stream.size();) {
      const std::size_t n = std::min<std::size_t>(stream.size() - at, 1 + rng() % 3000);
      ASSERT_TRUE(dec.feed(std::span<const std::byte>(stream).subspan(at, n)));
      at += n;
      drain(dec, got);
    }
    ASSERT_TRUE(dec.end_of_stream());
    ASSERT_EQ(got, as_received(messages)) << "run " << run << " threshold " << threshold;
    EXPECT_EQ(dec.stream_bytes(), stream.size());
  }
}

TEST(FrameDecoderRoundTrip, OneByteAtATime) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderRoundTrip.OneByteAtATime"));
  const auto messages = random_messages(rng, 120, 256);
  const Bytes stream = encode_stream(messages, 256, rng);
  FrameDecoder dec = make_decoder();
  std::vector<Received> got;
  const Error e = feed_bytewise(dec, stream, &got);
  ASSERT_EQ(e.code(), ErrorCode::kOk) << e.to_string();
  EXPECT_EQ(got, as_received(messages));
  EXPECT_TRUE(dec.idle());
}

TEST(FrameDecoderRoundTrip, PrepareCommitWithShortReads) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderRoundTrip.PrepareCommitWithShortReads"));
  const auto messages = random_messages(rng, 400, 4096);
  const Bytes stream = encode_stream(messages, 4096, rng);
  FrameDecoder dec = make_decoder({.receive_buffer_bytes = 1024});
  std::vector<Received> got;
  for (std::size_t at = 0; at < stream.size();) {
    auto span = dec.prepare();
    ASSERT_FALSE(span.empty());
    ASSERT_GE(span.size(), std::min<std::size_t>(1024, stream.size() - at) > 0 ? 1u : 0u);
    // A "socket" that returns between 1 byte and the whole span.
    const std::size_t n =
        std::min({span.size(), stream.size() - at, std::size_t{1} + rng() % span.size()});
    std::memcpy(span.data(), stream.data() + at, n);
    at += n;
    ASSERT_TRUE(dec.commit(n));
    drain(dec, got);
  }
  EXPECT_EQ(got, as_received(messages));
}

TEST(FrameDecoderRoundTrip, DecodeFrameWalksBackToBackFrames) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderRoundTrip.DecodeFrameWalks"));
  const auto messages = random_messages(rng, 200, 1024);
  const Bytes stream = encode_stream(messages, 1024, rng);
  std::vector<Received> got;
  for (std::size_t at = 0; at < stream.size();) {
    auto frame = decode_frame(std::span<const std::byte>(stream).subspan(at));
    ASSERT_TRUE(frame) << frame.error().to_string();
    for (Item item : *frame) got.push_back({Bytes(item.payload.begin(), item.payload.end()), item.flags});
    at += frame->info().frame_bytes;
  }
  EXPECT_EQ(got, as_received(messages));
}

// ----------------------------------------------------------------------------
// External bodies

// Hands out heap blocks and records what happens to them.
class RecordingAllocator : public BodyAllocator {
 public:
  Result<std::span<std::byte>> allocate_body(const FrameInfo& info, std::size_t body_bytes) override {
    EXPECT_EQ(info.body_bytes(), body_bytes);
    if (fail_next) {
      fail_next = false;
      return make_error(ErrorCode::kPoolExhausted, "test pool: no block of {} bytes", body_bytes);
    }
    if (decline) return std::span<std::byte>();
    blocks.push_back(std::make_unique<std::byte[]>(body_bytes + 64));
    live.push_back(blocks.back().get());
    return std::span<std::byte>(blocks.back().get(), body_bytes + 64);
  }
  void release_body(std::span<std::byte> body) noexcept override {
    released.push_back(body.data());
  }
  bool fail_next = false;
  bool decline = false;
  std::vector<std::unique_ptr<std::byte[]>> blocks;
  std::vector<std::byte*> live;
  std::vector<std::byte*> released;
};

TEST(FrameDecoderExternalBody, LargePayloadLandsInTheAllocatedBlock) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderExternalBody.LargePayloadLands"));
  RecordingAllocator alloc;
  FrameDecoder dec = make_decoder({.receive_buffer_bytes = 4096,
                                   .external_body_min_bytes = 8192,
                                   .body_allocator = &alloc});
  const Bytes big = testing::random_bytes(rng, 300001);
  Bytes stream = good_frame();
  std::array<std::byte, kSinglePrefixBytes> prefix;
  auto single = encode_single(prefix, big, 77);
  ASSERT_TRUE(single);
  stream.insert(stream.end(), single->prefix.begin(), single->prefix.end());
  stream.insert(stream.end(), big.begin(), big.end());
  stream.insert(stream.end(), single->padding.begin(), single->padding.end());
  const Bytes tail = good_frame();
  stream.insert(stream.end(), tail.begin(), tail.end());

  std::vector<Received> small;
  std::size_t at = 0;
  std::size_t body_recv_bytes = 0;  // bytes received straight into the block
  bool saw_big = false;
  while (at < stream.size()) {
    auto span = dec.prepare();
    const bool into_block = !alloc.live.empty() && span.data() >= alloc.live.back() &&
                            span.data() < alloc.live.back() + big.size() + 64;
    const std::size_t n = std::min(span.size(), stream.size() - at);
    std::memcpy(span.data(), stream.data() + at, n);
    at += n;
    if (into_block) body_recv_bytes += n;
    ASSERT_TRUE(dec.commit(n));
    for (;;) {
      auto frame = dec.next();
      ASSERT_TRUE(frame) << frame.error().to_string();
      if (!*frame) break;
      if (!(*frame)->external_body().empty()) {
        saw_big = true;
        ASSERT_EQ((*frame)->size(), 1u);
        const Item item = (*frame)->item(0);
        EXPECT_EQ(item.payload.data(), alloc.live.back());  // at the block's first byte
        EXPECT_EQ(item.flags, 77u);
        EXPECT_TRUE(std::equal(item.payload.begin(), item.payload.end(), big.begin(), big.end()));
        EXPECT_EQ((*frame)->external_body().data(), alloc.live.back());
      } else {
        for (Item item : **frame) small.push_back({Bytes(item.payload.begin(), item.payload.end()), item.flags});
      }
    }
  }
  EXPECT_TRUE(saw_big);
  EXPECT_EQ(small.size(), 6u);
  EXPECT_EQ(alloc.live.size(), 1u);
  EXPECT_TRUE(alloc.released.empty());  // handed out: the caller owns it
  // All but the first receive's worth went straight into the block.
  EXPECT_GE(body_recv_bytes, big.size() - 2 * 4096);
}

TEST(FrameDecoderExternalBody, FeedOneByteAtATime) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderExternalBody.FeedOneByteAtATime"));
  RecordingAllocator alloc;
  FrameDecoder dec = make_decoder({.external_body_min_bytes = 1024, .body_allocator = &alloc});
  std::vector<RefItem> messages = {{testing::random_bytes(rng, 5000), 1}};
  Bytes stream = testing::reference_frame(messages, FrameKind::kSingle);
  std::vector<Received> got;
  ASSERT_EQ(feed_bytewise(dec, stream, &got).code(), ErrorCode::kOk);
  EXPECT_EQ(got, as_received(messages));
  EXPECT_EQ(alloc.live.size(), 1u);
}

TEST(FrameDecoderExternalBody, ChecksumFailureReleasesTheBlock) {
  RecordingAllocator alloc;
  FrameDecoder dec = make_decoder({.external_body_min_bytes = 1024, .body_allocator = &alloc});
  Bytes bad = testing::reference_frame({RefItem{Bytes(5000, std::byte{9}), 1}}, FrameKind::kSingle);
  bad[3000] ^= std::byte{1};
  auto s = dec.feed(bad);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kChecksumMismatch);
  ASSERT_EQ(alloc.released.size(), 1u);
  EXPECT_EQ(alloc.released[0], alloc.live[0]);
}

// kFrameFlagPrefixChecksum: the payload is not hashed on any receive path
// (decode_frame, the receive buffer, an external body filled by feed() or by
// prepare()/commit()), while the header and table still are, the flag itself
// included.
TEST(FrameDecoderPrefixChecksum, PayloadIsLeftToTheTransportHeaderIsChecked) {
  std::mt19937_64 rng(testing::test_seed("FrameDecoderPrefixChecksum.Payload"));
  const RefItem item{testing::random_bytes(rng, 5000), 3};
  Bytes flipped = testing::reference_prefix_checksum_single(item);
  flipped[40 + 1234] ^= std::byte{0x20};  // a payload byte: not covered
  RefItem seen = item;
  seen.payload[1234] ^= std::byte{0x20};
  const std::vector<RefItem> expected{seen};

  auto one_shot = decode_frame(testing::as_span(flipped));
  ASSERT_TRUE(one_shot) << one_shot.error().to_string();
  EXPECT_EQ(one_shot->info().flags, kFrameFlagPrefixChecksum);
  EXPECT_EQ(one_shot->info().crc_end(), 40u);
  for (std::size_t min_external : {std::size_t{1} << 20, std::size_t{1024}}) {
    RecordingAllocator alloc;
    FrameDecoder bytewise = make_decoder({.external_body_min_bytes = min_external, .body_allocator = &alloc});
    std::vector<Received> got;
    ASSERT_EQ(feed_bytewise(bytewise, flipped, &got).code(), ErrorCode::kOk);
    EXPECT_EQ(got, as_received(expected));
    EXPECT_EQ(alloc.live.size(), min_external == 1024 ? 1u : 0u);
  }
  {
    RecordingAllocator alloc;
    FrameDecoder dec = make_decoder({.receive_buffer_bytes = 1024,
                                     .external_body_min_bytes = 1024,
                                     .body_allocator = &alloc});
    std::vector<Received> got;
    for (std::size_t at = 0; at < flipped.size();) {
      auto span = dec.prepare();
      const std::size_t n = std::min({span.size(), flipped.size() - at, std::size_t{700}});
      std::memcpy(span.data(), flipped.data() + at, n);
      at += n;
      ASSERT_TRUE(dec.commit(n));
    }
    drain(dec, got);
    EXPECT_EQ(got, as_received(expected));
    EXPECT_EQ(alloc.live.size(), 1u);
  }

  // A table byte (the item's flags) and the frame flag itself are covered.
  Bytes table_flip = testing::reference_prefix_checksum_single(item);
  table_flip[32] ^= std::byte{0x01};
  FrameDecoder d1 = make_decoder();
  const Error e1 = feed_bytewise(d1, table_flip);
  EXPECT_EQ(e1.code(), ErrorCode::kChecksumMismatch) << e1.to_string();
  EXPECT_THAT(e1.message(), HasSubstr("frame bytes [8, 40) (1 items, header and table only)"));
  Bytes flag_cleared = testing::reference_prefix_checksum_single(item);
  testing::put_u16(flag_cleared, 10, 0);
  FrameDecoder d2 = make_decoder();
  EXPECT_EQ(feed_bytewise(d2, flag_cleared).code(), ErrorCode::kChecksumMismatch);
  EXPECT_FALSE(decode_frame(testing::as_span(flag_cleared)));
}

TEST(FrameDecoderExternalBody, DestroyedMidFrameReleasesTheBlock) {
  RecordingAllocator alloc;
  {
    FrameDecoder dec = make_decoder({.external_body_min_bytes = 1024, .body_allocator = &alloc});
    Bytes frame = testing::reference_frame({RefItem{Bytes(5000), 1}}, FrameKind::kSingle);
    ASSERT_TRUE(dec.feed(std::span<const std::byte>(frame).first(2000)));
    ASSERT_EQ(alloc.live.size(), 1u);
    FrameDecoder moved = std::move(dec);  // ownership of the pending block moves too
    EXPECT_TRUE(alloc.released.empty());
  }
  ASSERT_EQ(alloc.released.size(), 1u);
  EXPECT_EQ(alloc.released[0], alloc.live[0]);
}

TEST(FrameDecoderExternalBody, AllocatorErrorPoisonsWithContext) {
  RecordingAllocator alloc;
  alloc.fail_next = true;
  FrameDecoder dec = make_decoder({.external_body_min_bytes = 1024, .body_allocator = &alloc});
  Bytes frame = testing::reference_frame({RefItem{Bytes(5000), 1}}, FrameKind::kSingle);
  auto s = dec.feed(frame);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kPoolExhausted);
  EXPECT_THAT(s.error().message(), HasSubstr("allocating the 5000-byte body of the frame at stream byte 0"));
  EXPECT_THAT(s.error().message(), HasSubstr("test pool: no block"));
}

TEST(FrameDecoderExternalBody, DeclinedAllocationUsesTheReceiveBuffer) {
  RecordingAllocator alloc;
  alloc.decline = true;
  FrameDecoder dec = make_decoder({.external_body_min_bytes = 1024, .body_allocator = &alloc});
  std::vector<RefItem> messages = {{Bytes(5000, std::byte{4}), 1}};
  ASSERT_TRUE(dec.feed(testing::reference_frame(messages, FrameKind::kSingle)));
  std::vector<Received> got;
  auto frame = dec.next();
  ASSERT_TRUE(frame && *frame);
  EXPECT_TRUE((*frame)->external_body().empty());
  EXPECT_EQ((*frame)->item(0).payload.size(), 5000u);
}

TEST(FrameDecoder, NoItemBeforeTheLastByteArrives) {
  const Bytes frame = good_frame();
  FrameDecoder dec = make_decoder();
  ASSERT_TRUE(dec.feed(std::span<const std::byte>(frame).first(frame.size() - 1)));
  auto none = dec.next();
  ASSERT_TRUE(none);
  EXPECT_FALSE(*none);
  ASSERT_TRUE(dec.feed(std::span<const std::byte>(frame).last(1)));
  auto some = dec.next();
  ASSERT_TRUE(some && *some);
  EXPECT_EQ((*some)->size(), 3u);
  EXPECT_EQ((*some)->info().kind, FrameKind::kBatch);
  EXPECT_EQ((*some)->info().frame_bytes, 96u);
}

}  // namespace
}  // namespace ember::wire
