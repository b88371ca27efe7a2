// BatchEncoder and encode_single (see batch_encoder.h).
//
// The table sits in front of the payloads but its size is known only at
// finish(). The encoder therefore writes payloads into a payload area that
// starts at out_[base_], leaving room for the table of the expected number of
// items in front of it; finish() writes header and table right before the
// area, so the frame starts at out_[base_ - prefix_bytes(n)]. When the batch
// ends up with more items than that room holds, or a large item needs the
// room, the payloads are moved once (memmove, counted in relocated_bytes_);
// the expectation then adapts to the traffic so steady streams never move.
#include "common/wire/batch_encoder.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>

#include "common/base/check.h"
#include "common/wire/crc32c.h"

namespace ember::wire {
namespace {

constexpr std::size_t floor8(std::size_t n) { return n & ~std::size_t{7}; }

constexpr std::array<std::byte, kAlignBytes> kZeroPadding{};

}  // namespace

Result<BatchEncoder> BatchEncoder::create(const EncoderOptions& options) {
  if (options.batch_threshold_bytes < kMinBatchThresholdBytes ||
      options.batch_threshold_bytes > kMaxFrameBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "wire: batch_threshold_bytes = {} is out of range [{}, {}]; set "
                      "[communication] batch_threshold to a size such as \"4KB\"",
                      options.batch_threshold_bytes, kMinBatchThresholdBytes, kMaxFrameBytes);
  }
  if (options.expected_items == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "wire: EncoderOptions::expected_items must be >= 1 (it is a hint; use the "
                      "default 32 when unsure)");
  }
  return BatchEncoder(floor8(options.batch_threshold_bytes), options.expected_items);
}

BatchEncoder::BatchEncoder(std::size_t threshold, std::size_t expected_items)
    : threshold_(threshold),
      expected_items_(std::min(expected_items, max_items_in(threshold))) {
  entries_.resize(max_items_in(threshold_));
}

void BatchEncoder::begin(std::span<std::byte> out) {
  EMBER_CHECK_MSG(!open_, "BatchEncoder::begin on an open batch: finish() or abandon() it first");
  EMBER_CHECK_MSG(out.size() >= kMinFrameBytes, "BatchEncoder::begin: buffer of {} bytes < {}",
                  out.size(), kMinFrameBytes);
  out_ = out;
  limit_ = std::min(threshold_, floor8(out.size()));
  base_ = std::min(prefix_bytes(expected_items_), prefix_bytes(max_items_in(limit_)));
  payload_end_ = 0;
  count_ = 0;
  open_ = true;
  reservation_ = false;
}

// Checks whether a payload of `payload_bytes` can be the next item. When it
// fits logically but not where the payload area sits now, moves the area to
// the smallest base that works. On success stores the item's area offset.
inline bool BatchEncoder::room_for(std::size_t payload_bytes, std::size_t* area_offset) {
  const std::size_t at = align_up8(payload_end_);
  if (payload_bytes > limit_) return false;  // also keeps the sums below from overflowing
  const std::size_t end_aligned = align_up8(at + payload_bytes);
  const std::size_t new_prefix = prefix_bytes(count_ + 1);
  if (new_prefix + end_aligned > limit_) return false;
  if (base_ + end_aligned > floor8(out_.size())) {
    // Fits the frame, not the area: the table room in front is larger than
    // needed. new_prefix + end_aligned <= limit_ <= floor8(size) guarantees success.
    move_payloads_to(new_prefix);
  }
  *area_offset = at;
  return true;
}

__attribute__((noinline, cold)) void BatchEncoder::move_payloads_to(std::size_t new_base) {
  if (new_base == base_) return;
  // Copy (named): payloads already in the batch move within `out`.
  std::memmove(out_.data() + new_base, out_.data() + base_, payload_end_);
  relocated_bytes_ += payload_end_;
  base_ = new_base;
}

bool BatchEncoder::fits(std::size_t payload_bytes) const noexcept {
  EMBER_DCHECK(open_);
  if (payload_bytes > limit_) return false;
  return prefix_bytes(count_ + 1) + align_up8(align_up8(payload_end_) + payload_bytes) <= limit_;
}

bool BatchEncoder::try_add(std::span<const std::byte> payload, std::uint32_t item_flags) {
  EMBER_CHECK_MSG(open_ && !reservation_, "BatchEncoder::try_add needs an open batch and no "
                                          "pending reservation");
  std::size_t at = 0;
  if (!room_for(payload.size(), &at)) return false;
  std::byte* area = out_.data() + base_;
  if (at != payload_end_) std::memset(area + payload_end_, 0, at - payload_end_);  // padding
  // Copy (named): the one copy of a small message, into the batch.
  if (!payload.empty()) std::memcpy(area + at, payload.data(), payload.size());
  entries_[count_] = ItemEntryWire{static_cast<std::uint32_t>(at),
                                   static_cast<std::uint32_t>(payload.size()), item_flags};
  payload_end_ = at + payload.size();
  ++count_;
  return true;
}

std::optional<std::span<std::byte>> BatchEncoder::try_reserve(std::size_t max_bytes) {
  EMBER_CHECK_MSG(open_ && !reservation_, "BatchEncoder::try_reserve needs an open batch and no "
                                          "pending reservation");
  std::size_t at = 0;
  if (!room_for(max_bytes, &at)) return std::nullopt;
  std::byte* area = out_.data() + base_;
  if (at != payload_end_) std::memset(area + payload_end_, 0, at - payload_end_);
  reservation_ = true;
  reserved_bytes_ = max_bytes;
  return std::span<std::byte>(area + at, max_bytes);
}

void BatchEncoder::commit_reserved(std::size_t used_bytes, std::uint32_t item_flags) {
  EMBER_CHECK_MSG(reservation_, "BatchEncoder::commit_reserved without try_reserve");
  EMBER_CHECK_MSG(used_bytes <= reserved_bytes_,
                  "BatchEncoder::commit_reserved: used {} bytes of a {}-byte reservation",
                  used_bytes, reserved_bytes_);
  const std::size_t at = align_up8(payload_end_);
  entries_[count_] = ItemEntryWire{static_cast<std::uint32_t>(at),
                                   static_cast<std::uint32_t>(used_bytes), item_flags};
  payload_end_ = at + used_bytes;
  ++count_;
  reservation_ = false;
}

void BatchEncoder::cancel_reserved() {
  EMBER_CHECK_MSG(reservation_, "BatchEncoder::cancel_reserved without try_reserve");
  reservation_ = false;
}

std::size_t BatchEncoder::frame_bytes() const noexcept {
  return count_ == 0 ? 0 : prefix_bytes(count_) + align_up8(payload_end_);
}

std::span<std::byte> BatchEncoder::finish() {
  EMBER_CHECK_MSG(open_ && !reservation_, "BatchEncoder::finish needs an open batch and no "
                                          "pending reservation");
  EMBER_CHECK_MSG(count_ > 0, "BatchEncoder::finish on an empty batch (zero-item frames are "
                              "malformed): check empty() first");
  const std::size_t prefix = prefix_bytes(count_);
  if (prefix > base_) move_payloads_to(prefix);  // more items than the room expected
  const std::size_t body = align_up8(payload_end_);
  const std::size_t frame_bytes = prefix + body;
  EMBER_DCHECK(frame_bytes <= limit_);
  std::byte* frame = out_.data() + (base_ - prefix);
  std::memset(frame + prefix + payload_end_, 0, body - payload_end_);  // trailing padding

  FrameHeaderWire header{};
  header.magic = kMagic;
  header.version = kVersion;
  header.kind = static_cast<std::uint8_t>(FrameKind::kBatch);
  header.item_count = static_cast<std::uint32_t>(count_);
  header.frame_bytes = static_cast<std::uint32_t>(frame_bytes);
  store_header(frame, header);
  // The staged entries hold offsets relative to the payload area: copy the
  // table in one go, then make the offsets frame-relative in place (4-byte
  // loads and stores; rebuilding each 12-byte entry through a temporary
  // stalled on store forwarding and cost ~10 ns per item).
  std::byte* table = frame + kHeaderBytes;
  std::memcpy(table, entries_.data(), kItemEntryBytes * count_);
  for (std::size_t i = 0; i < count_; ++i) {
    std::byte* field = table + i * kItemEntryBytes + offsetof(ItemEntryWire, offset);
    std::uint32_t offset;
    std::memcpy(&offset, field, sizeof offset);
    offset += static_cast<std::uint32_t>(prefix);
    std::memcpy(field, &offset, sizeof offset);
  }
  const std::size_t table_end = kHeaderBytes + kItemEntryBytes * count_;
  std::memset(frame + table_end, 0, prefix - table_end);
  header.crc32c = crc32c(std::span<const std::byte>(frame + kCrcCoverageBegin,
                                                    frame_bytes - kCrcCoverageBegin));
  store_header(frame, header);

  // Next batch: make room for as many items as this one had, shrinking slowly
  // so that one short batch (a flush on a timer) does not cause moves later.
  expected_items_ = std::max({std::size_t{1}, count_, expected_items_ - expected_items_ / 4});
  open_ = false;
  return {frame, frame_bytes};
}

void BatchEncoder::abandon() noexcept {
  open_ = false;
  reservation_ = false;
  count_ = 0;
  payload_end_ = 0;
}

Result<SingleFrame> encode_single(std::span<std::byte, kSinglePrefixBytes> prefix_out,
                                  std::span<const std::span<const std::byte>> payload_pieces,
                                  std::uint32_t item_flags, Checksum checksum) {
  constexpr std::size_t kMaxPayload = kMaxFrameBytes - kSinglePrefixBytes;
  std::size_t payload_bytes = 0;
  for (const auto& piece : payload_pieces) {
    if (piece.size() > kMaxPayload - payload_bytes) {
      return make_error(ErrorCode::kTooLarge,
                        "wire: a single frame's payload of more than {} bytes does not fit the "
                        "format (frame_bytes is 32-bit); cut the tensor into chunks "
                        "(partition_bytes)",
                        kMaxPayload);
    }
    payload_bytes += piece.size();
  }
  const std::size_t body = align_up8(payload_bytes);
  std::byte* p = prefix_out.data();
  FrameHeaderWire header{};
  header.magic = kMagic;
  header.version = kVersion;
  header.kind = static_cast<std::uint8_t>(FrameKind::kSingle);
  header.flags = checksum == Checksum::kPrefix ? kFrameFlagPrefixChecksum : 0;
  header.item_count = 1;
  header.frame_bytes = static_cast<std::uint32_t>(kSinglePrefixBytes + body);
  store_header(p, header);
  store_entry(p, 0, ItemEntryWire{static_cast<std::uint32_t>(kSinglePrefixBytes),
                                  static_cast<std::uint32_t>(payload_bytes), item_flags});
  const std::size_t table_end = kHeaderBytes + kItemEntryBytes;
  std::memset(p + table_end, 0, kSinglePrefixBytes - table_end);

  std::uint32_t crc = crc32c(std::span<const std::byte>(p + kCrcCoverageBegin,
                                                        kSinglePrefixBytes - kCrcCoverageBegin));
  const std::span<const std::byte> padding(kZeroPadding.data(), body - payload_bytes);
  if (checksum == Checksum::kFrame) {
    for (const auto& piece : payload_pieces) crc = crc32c_extend(crc, piece);
    crc = crc32c_extend(crc, padding);
  }
  header.crc32c = crc;
  store_header(p, header);
  return SingleFrame{std::span<const std::byte>(p, kSinglePrefixBytes), padding,
                     kSinglePrefixBytes + body};
}

Result<SingleFrame> encode_single(std::span<std::byte, kSinglePrefixBytes> prefix_out,
                                  std::span<const std::byte> payload, std::uint32_t item_flags,
                                  Checksum checksum) {
  const std::span<const std::byte> pieces[1] = {payload};
  return encode_single(prefix_out, std::span<const std::span<const std::byte>>(pieces),
                       item_flags, checksum);
}

}  // namespace ember::wire
