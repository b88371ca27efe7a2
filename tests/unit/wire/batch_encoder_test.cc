// BatchEncoder and encode_single: bytes equal to the reference encoder,
// threshold boundaries, max items, in-place items, payload relocation.
#include "common/wire/batch_encoder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <random>

#include <sys/mman.h>

#include "common/wire/frame_decoder.h"
#include "tests/unit/wire/wire_test_util.h"

namespace ember::wire {
namespace {

using testing::Bytes;
using testing::RefItem;

Bytes to_bytes(std::span<const std::byte> s) { return Bytes(s.begin(), s.end()); }

BatchEncoder make_encoder(std::size_t threshold = kDefaultBatchThresholdBytes,
                          std::size_t expected_items = 32) {
  auto enc = BatchEncoder::create({.batch_threshold_bytes = threshold,
                                   .expected_items = expected_items});
  EXPECT_TRUE(enc.has_value());
  return std::move(*enc);
}

TEST(BatchEncoder, CreateRejectsThresholdOutOfRange) {
  auto small = BatchEncoder::create({.batch_threshold_bytes = 63});
  ASSERT_FALSE(small);
  EXPECT_EQ(small.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(small.error().message().find("batch_threshold_bytes = 63"), std::string::npos);
  auto huge = BatchEncoder::create({.batch_threshold_bytes = std::size_t{1} << 33});
  ASSERT_FALSE(huge);
  EXPECT_EQ(huge.error().code(), ErrorCode::kInvalidArgument);
  auto zero = BatchEncoder::create({.expected_items = 0});
  ASSERT_FALSE(zero);
  EXPECT_NE(zero.error().message().find("expected_items"), std::string::npos);
}

TEST(BatchEncoder, MatchesReferenceEncoderByteForByte) {
  std::mt19937_64 rng(testing::test_seed("BatchEncoder.MatchesReferenceEncoder"));
  std::vector<std::byte> out(8192);
  BatchEncoder enc = make_encoder(4096);
  for (int batch = 0; batch < 200; ++batch) {
    enc.begin(out);
    std::vector<RefItem> items;
    for (;;) {
      RefItem item{testing::random_bytes(rng, rng() % (rng() % 4 == 0 ? 900 : 80)),
                   static_cast<std::uint32_t>(rng())};
      if (!enc.try_add(item.payload, item.flags)) break;
      items.push_back(std::move(item));
      if (rng() % 16 == 0) break;
    }
    ASSERT_FALSE(items.empty());
    const auto frame = enc.finish();
    ASSERT_EQ(to_bytes(frame), testing::reference_frame(items)) << "batch " << batch;
    EXPECT_LE(frame.size(), 4096u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(frame.data()) % 8,
              reinterpret_cast<std::uintptr_t>(out.data()) % 8);
  }
}

TEST(BatchEncoder, FrameNeverExceedsThresholdAndFullMeansFull) {
  BatchEncoder enc = make_encoder(1024);
  std::vector<std::byte> out(1024);
  enc.begin(out);
  const Bytes msg(64, std::byte{7});
  int added = 0;
  while (enc.try_add(msg)) ++added;
  // Each 64-byte item costs 64 payload + 12 table bytes: 24 + 76 n <= 1024
  // with 8-byte rounding of the table gives n = 13.
  EXPECT_EQ(added, 13);
  EXPECT_FALSE(enc.fits(64));
  EXPECT_EQ(enc.finish().size(), prefix_bytes(13) + 13 * 64);
}

TEST(BatchEncoder, BoundaryPayloadSizes) {
  constexpr std::size_t kThreshold = 4096;
  BatchEncoder enc = make_encoder(kThreshold);
  EXPECT_EQ(enc.max_batched_payload_bytes(), kThreshold - kMinFrameBytes);
  std::vector<std::byte> out(kThreshold);
  struct Case {
    std::size_t size;
    bool fits_batch;
  };
  const std::size_t max = enc.max_batched_payload_bytes();
  for (const Case c : {Case{0, true}, Case{1, true}, Case{max - 1, true}, Case{max, true},
                       Case{max + 1, false}, Case{kThreshold - 1, false},
                       Case{kThreshold, false}, Case{kThreshold + 1, false}}) {
    SCOPED_TRACE(c.size);
    const Bytes payload(c.size, std::byte{0x5A});
    enc.begin(out);
    EXPECT_EQ(enc.fits(c.size), c.fits_batch);
    EXPECT_EQ(enc.try_add(payload, 9), c.fits_batch);
    if (c.fits_batch) {
      const auto frame = enc.finish();
      EXPECT_LE(frame.size(), kThreshold);
      ASSERT_EQ(to_bytes(frame), testing::reference_frame({RefItem{payload, 9}}));
    } else {
      EXPECT_TRUE(enc.empty());
      enc.abandon();
      std::array<std::byte, kSinglePrefixBytes> prefix;
      auto single = encode_single(prefix, payload, 9);
      ASSERT_TRUE(single);
      Bytes wire = to_bytes(single->prefix);
      wire.insert(wire.end(), payload.begin(), payload.end());
      wire.insert(wire.end(), single->padding.begin(), single->padding.end());
      EXPECT_EQ(wire.size(), single->frame_bytes);
      EXPECT_EQ(wire, testing::reference_frame({RefItem{payload, 9}}, FrameKind::kSingle));
    }
  }
}

TEST(BatchEncoder, MaxItemsAreZeroLengthItemsFillingTheTable) {
  BatchEncoder enc = make_encoder(4096);
  std::vector<std::byte> out(4096);
  enc.begin(out);
  std::size_t n = 0;
  while (enc.try_add({}, static_cast<std::uint32_t>(n))) ++n;
  EXPECT_EQ(n, max_items_in(4096));
  EXPECT_EQ(n, 339u);
  const auto frame = enc.finish();
  EXPECT_EQ(frame.size(), 4096u);
  auto decoded = decode_frame(frame);
  ASSERT_TRUE(decoded) << decoded.error().to_string();
  ASSERT_EQ(decoded->size(), 339u);
  EXPECT_EQ(decoded->item(338).flags, 338u);
  EXPECT_TRUE(decoded->item(338).payload.empty());
}

TEST(BatchEncoder, OutputBufferSmallerThanThresholdLimitsTheFrame) {
  BatchEncoder enc = make_encoder(4096);
  std::vector<std::byte> out(1000);  // rounded down to 1000 (already a multiple of 8)
  enc.begin(out);
  EXPECT_EQ(enc.limit_bytes(), 1000u);
  EXPECT_FALSE(enc.try_add(Bytes(1000 - kMinFrameBytes + 1)));
  EXPECT_TRUE(enc.try_add(Bytes(1000 - kMinFrameBytes)));
  EXPECT_EQ(enc.finish().size(), 1000u);
}

TEST(BatchEncoder, ReserveWriteCommitBuildsAnItemInPlace) {
  BatchEncoder enc = make_encoder(4096);
  std::vector<std::byte> out(4096);
  enc.begin(out);
  ASSERT_TRUE(enc.try_add(Bytes(3, std::byte{1}), 1));
  auto space = enc.try_reserve(100);
  ASSERT_TRUE(space.has_value());
  ASSERT_EQ(space->size(), 100u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(space->data()) % 8,
            reinterpret_cast<std::uintptr_t>(out.data()) % 8);
  const Bytes body(37, std::byte{0x42});
  std::memcpy(space->data(), body.data(), body.size());
  enc.commit_reserved(body.size(), 2);
  // A cancelled reservation leaves no trace.
  ASSERT_TRUE(enc.try_reserve(50).has_value());
  enc.cancel_reserved();
  EXPECT_FALSE(enc.try_reserve(4096).has_value());
  ASSERT_TRUE(enc.try_add(Bytes(5, std::byte{3}), 3));
  EXPECT_EQ(to_bytes(enc.finish()),
            testing::reference_frame({RefItem{Bytes(3, std::byte{1}), 1}, RefItem{body, 2},
                                      RefItem{Bytes(5, std::byte{3}), 3}}));
}

TEST(BatchEncoder, UnexpectedItemCountsRelocateButBytesStayCanonical) {
  std::mt19937_64 rng(testing::test_seed("BatchEncoder.UnexpectedItemCounts"));
  // expected_items = 1: the first batch with many items must move its payloads up.
  BatchEncoder enc = make_encoder(4096, 1);
  std::vector<std::byte> out(4096);
  enc.begin(out);
  std::vector<RefItem> items;
  for (int i = 0; i < 40; ++i) {
    items.push_back({testing::random_bytes(rng, 16), static_cast<std::uint32_t>(i)});
    ASSERT_TRUE(enc.try_add(items.back().payload, items.back().flags));
  }
  EXPECT_EQ(to_bytes(enc.finish()), testing::reference_frame(items));
  EXPECT_GT(enc.relocated_bytes(), 0u);

  // Now expecting ~40 items: one large item needs the table room and moves down.
  const std::size_t before = enc.relocated_bytes();
  enc.begin(out);
  items = {RefItem{testing::random_bytes(rng, 16), 1},
           RefItem{testing::random_bytes(rng, enc.max_batched_payload_bytes() - 40), 2}};
  ASSERT_TRUE(enc.try_add(items[0].payload, 1));
  ASSERT_TRUE(enc.try_add(items[1].payload, 2));
  EXPECT_EQ(to_bytes(enc.finish()), testing::reference_frame(items));
  EXPECT_GT(enc.relocated_bytes(), before);
}

TEST(BatchEncoder, SteadyTrafficNeverRelocates) {
  BatchEncoder enc = make_encoder(4096, 1);
  std::vector<std::byte> out(4096);
  const Bytes msg(64, std::byte{1});
  for (int batch = 0; batch < 20; ++batch) {
    enc.begin(out);
    while (enc.try_add(msg)) {
    }
    (void)enc.finish();
  }
  const std::size_t after_warmup = enc.relocated_bytes();
  for (int batch = 0; batch < 20; ++batch) {
    enc.begin(out);
    while (enc.try_add(msg)) {
    }
    (void)enc.finish();
  }
  EXPECT_EQ(enc.relocated_bytes(), after_warmup);
}

TEST(EncodeSingle, GathersPiecesWithoutCopyingAndMatchesReference) {
  std::mt19937_64 rng(testing::test_seed("EncodeSingle.GathersPieces"));
  const Bytes head = testing::random_bytes(rng, 29);
  const Bytes tensor = testing::random_bytes(rng, 100003);
  std::array<std::byte, kSinglePrefixBytes> prefix;
  const std::span<const std::byte> pieces[] = {head, tensor};
  auto single = encode_single(prefix, pieces, 0xABCD);
  ASSERT_TRUE(single);
  EXPECT_EQ(single->prefix.data(), prefix.data());
  EXPECT_EQ(single->frame_bytes, kSinglePrefixBytes + align_up8(head.size() + tensor.size()));
  Bytes payload = head;
  payload.insert(payload.end(), tensor.begin(), tensor.end());
  Bytes wire = to_bytes(single->prefix);
  wire.insert(wire.end(), payload.begin(), payload.end());
  wire.insert(wire.end(), single->padding.begin(), single->padding.end());
  EXPECT_EQ(wire, testing::reference_frame({RefItem{payload, 0xABCD}}, FrameKind::kSingle));
}

TEST(EncodeSingle, PrefixChecksumLeavesThePayloadOutAndMatchesReference) {
  std::mt19937_64 rng(testing::test_seed("EncodeSingle.PrefixChecksum"));
  const Bytes payload = testing::random_bytes(rng, 70001);
  std::array<std::byte, kSinglePrefixBytes> prefix;
  auto single = encode_single(prefix, payload, 0x51, Checksum::kPrefix);
  ASSERT_TRUE(single);
  Bytes wire = to_bytes(single->prefix);
  wire.insert(wire.end(), payload.begin(), payload.end());
  wire.insert(wire.end(), single->padding.begin(), single->padding.end());
  EXPECT_EQ(wire, testing::reference_prefix_checksum_single(RefItem{payload, 0x51}));
  // The payload is not hashed: another payload of the same length gets the
  // same prefix, byte for byte.
  const Bytes other = testing::random_bytes(rng, payload.size());
  std::array<std::byte, kSinglePrefixBytes> prefix2;
  ASSERT_TRUE(encode_single(prefix2, other, 0x51, Checksum::kPrefix));
  EXPECT_EQ(prefix, prefix2);
  // The default still covers the payload.
  ASSERT_TRUE(encode_single(prefix2, other, 0x51));
  EXPECT_NE(prefix, prefix2);
}

TEST(EncodeSingle, RejectsPayloadBeyondTheFormat) {
  // Two 2 GiB pieces (one reserved, never touched mapping) sum past the
  // 32-bit frame size; the size check comes before any byte is read.
  constexpr std::size_t kTwoGiB = std::size_t{1} << 31;
  void* map = ::mmap(nullptr, kTwoGiB, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  const std::span<const std::byte> big(static_cast<const std::byte*>(map), kTwoGiB);
  const std::span<const std::byte> pieces[] = {big, big};
  std::array<std::byte, kSinglePrefixBytes> prefix;
  auto single = encode_single(prefix, pieces);
  ::munmap(map, kTwoGiB);
  ASSERT_FALSE(single);
  EXPECT_EQ(single.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(single.error().message().find("chunks"), std::string::npos);
}

}  // namespace
}  // namespace ember::wire
