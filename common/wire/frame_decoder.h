// FrameDecoder: a pure state machine that turns a byte stream into verified
// frames; decode_frame: the same checks on one frame already in memory.
//
// Trust nothing: before any item is handed out, the decoder has checked the
// magic, version, kind, flags, reserved field, frame_bytes against
// DecoderOptions::max_frame_bytes, the item count against what fits in the
// frame, every item's offset and length against the frame (canonical packing,
// see wire_format.h), and the CRC32C over the whole frame (over its header
// and table only for a single frame with kFrameFlagPrefixChecksum; the
// decoder still waits for the whole frame before handing it out). It never reads or
// writes outside the bytes it was given. Checks run in that order and the
// first failure is reported:
//   kMalformedFrame    bad magic, unknown kind/flags, reserved != 0, frame_bytes
//                      not a multiple of 8 or < 40, zero items, count too large,
//                      item offset/length out of range or not packed, truncated
//                      stream (end_of_stream inside a frame)
//   kVersionMismatch   version byte is not kVersion (the peer runs another release)
//   kTooLarge          frame_bytes > max_frame_bytes
//   kChecksumMismatch  CRC32C differs
//   (any code)         returned by BodyAllocator::allocate_body
// The message names the field, its value, the expected value, and where:
// "frame byte B" (within the frame) and "stream byte S" (since the decoder's
// first byte). After an error the decoder is poisoned: every later call
// returns the same error (prepare() returns an empty span); drop the
// connection — there is no resynchronisation inside a byte stream.
//
// Two ways to put bytes in:
//   * copying: feed(bytes) — any chunking, 1 byte at a time works;
//   * zero-copy receive: span = prepare(); n = recv(fd, span); commit(n).
//     Small frames land in the decoder's receive buffer (several per recv);
//     the body of a frame of at least external_body_min_bytes lands in a
//     buffer from DecoderOptions::body_allocator (e.g. a page-pool block), so
//     a 64 MiB payload is received straight into its final place. The only
//     copy on this path: body bytes that arrived in the receive buffer in the
//     same recv as the frame's header (at most one prepare() span, typically
//     < receive_buffer_bytes) are copied into the allocated body.
// and one way to take frames out: next(), until it returns nullopt.
//
//   for (;;) {
//     auto span = dec.prepare();
//     ssize_t n = ::recv(fd, span.data(), span.size(), 0);
//     if (n == 0) { EMBER_TRY(dec.end_of_stream()); break; }
//     EMBER_TRY(dec.commit(n));
//     for (;;) {
//       EMBER_ASSIGN_OR_RETURN(std::optional<Frame> frame, dec.next());
//       if (!frame) break;
//       for (Item item : *frame) dispatch(item.payload, item.flags);
//     }
//   }
//
// Lifetime of what next() returns: the Frame and the item spans point into the
// decoder's receive buffer (or the external body) and are valid until the next
// call of feed(), prepare(), commit(), next() or end_of_stream() on this
// decoder, or its destruction. Copy what must outlive that, or use an external
// body: when Frame::external_body() is non-empty, next() has transferred that
// buffer to the caller, and its bytes stay valid until the caller frees it.
//
// Thread-safety: one thread at a time per decoder (an I/O thread owns its
// connection's decoder). Allocation: the receive buffer grows (amortised,
// cold) to hold the largest frame received without an external body; nothing
// else allocates on the hot path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <span>

#include "common/base/error.h"
#include "common/wire/wire_format.h"

namespace ember::wire {

// Default for DecoderOptions::max_frame_bytes: a 64 MiB payload in a kSingle
// frame plus its prefix (and slack).
inline constexpr std::size_t kDefaultMaxFrameBytes = (std::size_t{64} << 20) + 4096;
inline constexpr std::size_t kDefaultReceiveBufferBytes = std::size_t{64} << 10;

// Validated header fields of a frame.
struct FrameInfo {
  FrameKind kind = FrameKind::kBatch;
  std::uint32_t item_count = 0;
  std::uint32_t frame_bytes = 0;   // whole frame
  std::uint32_t prefix_bytes = 0;  // header + table + padding; the body is the rest
  std::uint64_t stream_offset = 0; // stream byte of the frame's first byte (0 for decode_frame)
  std::uint16_t flags = 0;         // frame flags (0 or kFrameFlagPrefixChecksum)
  std::uint32_t body_bytes() const noexcept { return frame_bytes - prefix_bytes; }
  // End of the CRC's coverage: frame_bytes, or prefix_bytes when the body is
  // not covered (kFrameFlagPrefixChecksum).
  std::uint32_t crc_end() const noexcept {
    return static_cast<std::uint32_t>(wire::crc_end(flags, item_count, frame_bytes));
  }
  bool crc_covers_body() const noexcept { return (flags & kFrameFlagPrefixChecksum) == 0; }
};

// One item of a verified frame.
struct Item {
  std::span<const std::byte> payload;  // 8-byte aligned when the frame is
  std::uint32_t flags = 0;             // the sender's item_flags
};

// Supplies destinations for large frame bodies (the transport implements it
// over its page pool). Called by the decoder's thread, inside prepare(),
// commit(), feed() or next().
class BodyAllocator {
 public:
  virtual ~BodyAllocator() = default;
  // A writable buffer of at least body_bytes (= info.body_bytes()) for the
  // payloads of the frame `info` (header and table already checked; CRC not
  // yet). Item i's payload will start at buffer offset
  // entry.offset - info.prefix_bytes, so a kSingle frame's payload starts at
  // the buffer's first byte. Return an empty span to let the decoder use its
  // own receive buffer instead; return an error (e.g. kPoolExhausted) to
  // fail the frame (the decoder is then poisoned with that error).
  virtual Result<std::span<std::byte>> allocate_body(const FrameInfo& info,
                                                     std::size_t body_bytes) = 0;
  // The decoder gives up a buffer from allocate_body without handing it out:
  // the frame failed (CRC) or the decoder was destroyed mid-frame. Must not throw.
  virtual void release_body(std::span<std::byte> body) noexcept = 0;
};

struct DecoderOptions {
  // Frames larger than this fail with kTooLarge before their body is read.
  // Valid: [kMinFrameBytes, kMaxFrameBytes].
  std::size_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Free space prepare() offers in the receive buffer (one recv's worth).
  // Valid: >= kMinFrameBytes.
  std::size_t receive_buffer_bytes = kDefaultReceiveBufferBytes;
  // Frames of at least this many bytes get their body from body_allocator
  // (when set), unless the body is empty (all items zero-length).
  // Valid: >= kMinFrameBytes.
  std::size_t external_body_min_bytes = kDefaultReceiveBufferBytes;
  // Not owned; must outlive the decoder. nullptr: every frame lands in the
  // receive buffer.
  BodyAllocator* body_allocator = nullptr;
};

// A verified frame: a view of its header fields and items.
class Frame {
 public:
  class Iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Item;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    Iterator(const Frame* frame, std::size_t index) : frame_(frame), index_(index) {}
    Item operator*() const { return frame_->item(index_); }
    Iterator& operator++() { ++index_; return *this; }
    Iterator operator++(int) { Iterator t = *this; ++index_; return t; }
    bool operator==(const Iterator& o) const { return index_ == o.index_; }
   private:
    const Frame* frame_ = nullptr;
    std::size_t index_ = 0;
  };

  Frame() = default;
  const FrameInfo& info() const noexcept { return info_; }
  std::size_t size() const noexcept { return info_.item_count; }
  // Item `index`. pre: index < size(). Reads one table entry; no allocation.
  Item item(std::size_t index) const noexcept;
  Iterator begin() const noexcept { return {this, 0}; }
  Iterator end() const noexcept { return {this, size()}; }
  // Non-empty when the payloads were received into a BodyAllocator buffer:
  // that buffer (as allocate_body returned it), now owned by the caller.
  std::span<std::byte> external_body() const noexcept { return external_body_; }

 private:
  friend class FrameDecoder;
  friend Result<Frame> decode_frame(std::span<const std::byte>, const DecoderOptions&);
  FrameInfo info_;
  const std::byte* prefix_ = nullptr;  // the frame's header and table
  const std::byte* body_ = nullptr;    // frame byte prefix_bytes (payload area)
  std::span<std::byte> external_body_;
};

// Verifies the frame at the start of `bytes` (all checks above, CRC included)
// and returns a view of it; bytes past info().frame_bytes are ignored, so a
// buffer of back-to-back frames is walked by advancing info().frame_bytes.
// For frames already in memory (shared-memory ring, RDMA-written buffer).
// The Frame points into `bytes`. Errors: as FrameDecoder, with "truncated"
// (kMalformedFrame) when bytes is shorter than the header or frame_bytes, and
// kInvalidArgument for invalid options. No allocation (except the error).
Result<Frame> decode_frame(std::span<const std::byte> bytes,
                           const DecoderOptions& options = DecoderOptions{});

class FrameDecoder {
 public:
  // Errors: kInvalidArgument naming the option when options are out of range.
  // Allocates the receive buffer (receive_buffer_bytes).
  static Result<FrameDecoder> create(const DecoderOptions& options = DecoderOptions{});

  FrameDecoder(FrameDecoder&&) noexcept;
  FrameDecoder& operator=(FrameDecoder&&) noexcept;
  FrameDecoder(const FrameDecoder&) = delete;
  FrameDecoder& operator=(const FrameDecoder&) = delete;
  // Releases (BodyAllocator::release_body) an external body not yet handed out.
  ~FrameDecoder();

  // Copying input: takes all of `bytes` (copies them into the receive buffer or
  // an external body) and checks every frame header, table and CRC it
  // completes up to the next frame ready for next(). Returns the first error.
  Status feed(std::span<const std::byte> bytes);

  // Zero-copy input: where the next received bytes should go. Either free
  // space in the receive buffer (>= receive_buffer_bytes, or the rest of the
  // current frame when larger) or the missing part of an external body.
  // Empty only when the decoder is poisoned. May allocate (receive buffer growth).
  // Drain next() before calling it, or the external-body path is not taken for
  // the frames still buffered (they stay correct, only copied).
  std::span<std::byte> prepare();
  // `n` bytes were written at the start of the last prepare() span.
  // pre: n <= that span's size, no feed() in between. Errors: as feed().
  Status commit(std::size_t n);

  // The next verified frame, or nullopt when more bytes are needed. Errors:
  // the decoder's error, if any (also for one found by this call).
  Result<std::optional<Frame>> next();

  // The peer closed the stream. OK when it ended between frames; kMalformedFrame
  // ("truncated frame", naming the frame's stream offset, how many bytes of it
  // arrived and how many it declares) when inside one, or the decoder's error.
  // Frames completed before the end must be taken with next() first.
  Status end_of_stream();

  // True when no partial frame is buffered and no verified frame waits.
  bool idle() const noexcept;
  // Bytes accepted so far (feed + commit).
  std::uint64_t stream_bytes() const noexcept { return stream_bytes_; }
  bool poisoned() const noexcept { return state_ == State::kFailed; }
  // The error the decoder is poisoned with. pre: poisoned().
  const Error& error() const noexcept { return error_; }

 private:
  enum class State : std::uint8_t {
    kHeader,        // waiting for kHeaderBytes
    kTable,         // header checked; waiting for prefix_bytes
    kBody,          // table checked; body lands in the receive buffer
    kExternalBody,  // table checked; body lands in ext_body_
    kReady,         // verified; next() hands it out
    kHandedOut,     // next() returned it; released at the next call
    kFailed,        // poisoned with error_
  };

  FrameDecoder() = default;  // moved-into state; create() builds usable ones
  explicit FrameDecoder(const DecoderOptions& options);
  void release_handed_out() noexcept;
  void release_external_body() noexcept;
  // Runs the state machine over buffered bytes until it needs more or a frame is ready.
  Status advance();
  Status fail(Error error);
  Status check_crc(std::uint32_t computed);
  // Adds external-body bytes to ext_crc_ when the frame's CRC covers its body.
  void extend_body_crc(std::span<const std::byte> bytes) noexcept;
  Status enter_body();
  // Makes room for `bytes` more bytes at buf_[end_] (compaction or growth).
  void reserve_tail(std::size_t bytes);
  // Bytes of the current frame the receive buffer needs before the next step.
  std::size_t unit_goal() const noexcept;

  DecoderOptions options_;
  std::unique_ptr<std::byte[]> buf_;
  std::size_t capacity_ = 0;
  std::size_t begin_ = 0;  // receive-buffer offset of the current frame's first byte (multiple of 8)
  std::size_t end_ = 0;    // receive-buffer offset one past the last received byte
  State state_ = State::kHeader;
  FrameInfo info_;                       // current frame, valid from kTable on
  std::uint32_t header_crc_ = 0;         // its crc32c field
  std::uint64_t frame_stream_offset_ = 0;  // stream byte of buf_[begin_]
  std::size_t frame_buffer_bytes_ = 0;   // bytes of the current frame kept at buf_[begin_]
  std::span<std::byte> ext_body_;        // external body of the current frame
  std::size_t ext_filled_ = 0;
  std::uint32_t ext_crc_ = 0;            // CRC32C of frame bytes [8, prefix + ext_filled_)
                                         // (of [8, prefix) when the body is not covered)
  bool prepare_pending_ = false;
  bool last_prepare_external_ = false;
  std::size_t last_prepare_bytes_ = 0;
  std::uint64_t stream_bytes_ = 0;
  Error error_;
};

}  // namespace ember::wire
