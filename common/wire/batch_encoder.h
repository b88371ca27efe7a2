// Frame encoders: BatchEncoder packs small messages into one batch frame;
// encode_single frames one large message without copying it.
//
// Layout and checksum: common/wire/wire_format.h and docs/wire-format.md.
//
// Typical sender loop (one BatchEncoder per channel):
//
//   BatchEncoder enc = *BatchEncoder::create({.batch_threshold_bytes = 4096});
//   enc.begin(block);                      // caller's buffer, e.g. a pool block
//   for (msg : ring) {
//     if (msg.size() > enc.max_batched_payload_bytes()) {   // large: its own frame
//       std::array<std::byte, kSinglePrefixBytes> prefix;
//       auto single = encode_single(prefix, msg, flags);     // then writev(prefix, msg, padding)
//       continue;
//     }
//     if (!enc.try_add(msg, flags)) {      // batch full: send it, start the next one
//       send(enc.finish());  enc.begin(next_block);  (void)enc.try_add(msg, flags);
//     }
//   }
//   if (!enc.empty()) send(enc.finish());  // on flush_interval or when asked to flush
//
// In-place items (no intermediate buffer): try_reserve(max) hands out the
// writable bytes of the next payload; write the message header and body into
// them, then commit_reserved(used, flags) (or cancel_reserved()).
//
// Memory: the encoder owns no buffer (only a small table of pending entries,
// allocated once in create()). Payload bytes are copied once, by try_add, from
// the caller's message into the output buffer (or not at all with
// try_reserve); the frame is then sent from that buffer.
//
// Thread-safety: a BatchEncoder is used by one thread at a time (no internal
// locking); distinct encoders are independent. encode_single is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "common/base/error.h"
#include "common/wire/wire_format.h"

namespace ember::wire {

inline constexpr std::size_t kDefaultBatchThresholdBytes = 4096;
// Smallest accepted batch_threshold_bytes: room for a 24-byte payload.
inline constexpr std::size_t kMinBatchThresholdBytes = 64;

struct EncoderOptions {
  // A batch frame never exceeds this many bytes (header, table, padding and
  // payloads all counted). Rounded down to a multiple of 8. Config key
  // [communication] batch_threshold. Valid: [kMinBatchThresholdBytes, kMaxFrameBytes].
  std::size_t batch_threshold_bytes = kDefaultBatchThresholdBytes;
  // How many items the encoder first expects per batch; it reserves table
  // space for that many in front of the payloads and then adapts to the last
  // batch's count. Only affects how often finish() must move payloads (see
  // BatchEncoder::relocated_bytes), never the bytes on the wire. >= 1.
  std::size_t expected_items = 32;
};

class BatchEncoder {
 public:
  // Errors: kInvalidArgument when batch_threshold_bytes is outside
  // [kMinBatchThresholdBytes, kMaxFrameBytes] or expected_items is 0.
  // Allocates the pending-entry table (max_items_in(threshold) entries).
  static Result<BatchEncoder> create(const EncoderOptions& options);

  // Starts a batch written into `out` (caller-owned; it must stay valid until
  // finish() or abandon()). The batch's frame is limited to
  // limit_bytes() = min(batch threshold, out.size() rounded down to 8).
  // pre: !is_open(); out.size() >= kMinFrameBytes. No allocation.
  void begin(std::span<std::byte> out);

  // Appends one item: copies `payload` into the batch. Returns false, changing
  // nothing, when it does not fit in this batch (then finish() and retry in a
  // new batch; a payload larger than max_batched_payload_bytes() never fits:
  // send it with encode_single). pre: is_open(), no pending reservation.
  [[nodiscard]] bool try_add(std::span<const std::byte> payload, std::uint32_t item_flags = 0);

  // Reserves up to `max_bytes` writable bytes for the next item's payload and
  // returns them (8-byte aligned when `out` was), or nullopt when max_bytes do
  // not fit in this batch. The span is valid until commit_reserved() or
  // cancel_reserved(), which must come next. pre: is_open(), no pending reservation.
  [[nodiscard]] std::optional<std::span<std::byte>> try_reserve(std::size_t max_bytes);
  // Makes the first `used_bytes` of the reservation an item. pre: a pending
  // reservation, used_bytes <= its size.
  void commit_reserved(std::size_t used_bytes, std::uint32_t item_flags = 0);
  // Drops the pending reservation; the batch is as before try_reserve.
  void cancel_reserved();

  // Would try_add of `payload_bytes` succeed now? pre: is_open().
  bool fits(std::size_t payload_bytes) const noexcept;

  // Closes the batch: writes header, item table and CRC32C (one pass over the
  // frame) and returns the frame: a subspan of the `out` given to begin(), not
  // necessarily at its start (8-byte aligned relative to out.data()).
  // After it, is_open() is false; the bytes stay in `out`, owned by the caller.
  // pre: is_open(), item_count() >= 1 (zero-item frames are malformed: check
  // empty() first), no pending reservation. No allocation.
  [[nodiscard]] std::span<std::byte> finish();

  // Closes the batch without producing a frame (the caller reuses `out`).
  void abandon() noexcept;

  bool is_open() const noexcept { return open_; }
  bool empty() const noexcept { return count_ == 0; }
  std::size_t item_count() const noexcept { return count_; }
  // Size finish() would return now (0 when empty).
  std::size_t frame_bytes() const noexcept;
  // Frame size limit of the open batch (see begin()).
  std::size_t limit_bytes() const noexcept { return limit_; }
  // The threshold, rounded down to a multiple of 8.
  std::size_t batch_threshold_bytes() const noexcept { return threshold_; }
  // Largest payload that fits an empty batch of the full threshold:
  // threshold - kMinFrameBytes. Anything larger goes with encode_single.
  std::size_t max_batched_payload_bytes() const noexcept { return threshold_ - kMinFrameBytes; }
  // Bytes moved inside `out` because the table outgrew the space reserved for
  // it (or a large item needed that space); 0 in steady traffic.
  std::size_t relocated_bytes() const noexcept { return relocated_bytes_; }

 private:
  BatchEncoder(std::size_t threshold, std::size_t expected_items);
  // Whether a payload of payload_bytes can be the next item; moves the
  // payload area when only that makes it fit. Sets *area_offset (the item's
  // offset from the payload area's start) on success.
  bool room_for(std::size_t payload_bytes, std::size_t* area_offset);
  // memmove of the payload area to out_[new_base] (counted in relocated_bytes_).
  void move_payloads_to(std::size_t new_base);

  std::size_t threshold_;
  std::size_t expected_items_;
  std::vector<ItemEntryWire> entries_;  // max_items_in(threshold_) slots; area-relative offsets

  std::span<std::byte> out_;
  std::size_t limit_ = 0;
  std::size_t base_ = 0;          // out_ offset of the payload area (frame offset prefix)
  std::size_t payload_end_ = 0;   // bytes used in the payload area (frame-relative
                                  // end of the last payload minus prefix)
  std::size_t count_ = 0;
  std::size_t reserved_bytes_ = 0;
  bool open_ = false;
  bool reservation_ = false;
  std::size_t relocated_bytes_ = 0;
};

// A one-item frame around a caller-owned payload, for a gathered write:
// prefix, then the payload bytes (in order, for each piece), then padding.
struct SingleFrame {
  std::span<const std::byte> prefix;   // header + table, kSinglePrefixBytes, in prefix_out
  std::span<const std::byte> padding;  // 0..7 zero bytes after the payload (static storage)
  std::size_t frame_bytes = 0;         // prefix + payload + padding
};

// What a single frame's CRC32C covers.
enum class Checksum : std::uint8_t {
  kFrame,   // the whole frame, payload included (frame flags 0)
  kPrefix,  // header and table only (kFrameFlagPrefixChecksum): the payload's
            // bytes are not read, saving one pass over them on each end
};

// Writes the header and one-entry table of a kSingle frame whose payload is
// the concatenation of `payload_pieces` (e.g. a message header and a tensor
// in a pool block) into `prefix_out`. With Checksum::kFrame reads every
// payload byte once for the CRC32C; with kPrefix reads none. Copies none. The
// pieces must not change until the frame is sent.
// Errors: kTooLarge when the payload exceeds kMaxFrameBytes - kSinglePrefixBytes
// bytes (a multiple of 8, so the padded frame still fits; the receiver's DecoderOptions::max_frame_bytes is usually lower:
// chunk large tensors). Any thread; no allocation.
Result<SingleFrame> encode_single(std::span<std::byte, kSinglePrefixBytes> prefix_out,
                                  std::span<const std::span<const std::byte>> payload_pieces,
                                  std::uint32_t item_flags = 0,
                                  Checksum checksum = Checksum::kFrame);
Result<SingleFrame> encode_single(std::span<std::byte, kSinglePrefixBytes> prefix_out,
                                  std::span<const std::byte> payload, std::uint32_t item_flags = 0,
                                  Checksum checksum = Checksum::kFrame);

}  // namespace ember::wire
