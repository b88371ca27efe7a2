// FrameDecoder and decode_frame (see frame_decoder.h for the contract).
//
// Receive buffer invariants: buf_[begin_, end_) holds received bytes not yet
// released; begin_ is the first byte of the current frame and a multiple of 8
// (frames are multiples of 8 bytes and compaction moves to offset 0), so
// payloads keep the 8-byte alignment the format gives them. The frame checks
// are shared by the streaming decoder and decode_frame: check_header_fields,
// check_table, crc_error.
#include "common/wire/frame_decoder.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/base/check.h"
#include "common/wire/crc32c.h"

namespace ember::wire {
namespace {

// "wire: frame at stream byte S: <what> at frame byte B (stream byte S+B)<tail>"
template <typename... Args>
tl::unexpected<Error> frame_error(ErrorCode code, std::uint64_t frame_offset,
                                  std::size_t frame_byte, fmt::format_string<Args...> what,
                                  Args&&... args) {
  return tl::unexpected<Error>(
      Error(code, fmt::format("wire: frame at stream byte {}: {} [at frame byte {}, stream byte {}]",
                              frame_offset, fmt::format(what, std::forward<Args>(args)...),
                              frame_byte, frame_offset + frame_byte)));
}

Status check_options(const DecoderOptions& o) {
  if (o.max_frame_bytes < kMinFrameBytes || o.max_frame_bytes > kMaxFrameBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "wire: DecoderOptions::max_frame_bytes = {} is out of range [{}, {}]",
                      o.max_frame_bytes, kMinFrameBytes, kMaxFrameBytes);
  }
  if (o.receive_buffer_bytes < kMinFrameBytes || o.receive_buffer_bytes > kMaxFrameBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "wire: DecoderOptions::receive_buffer_bytes = {} is out of range [{}, {}]",
                      o.receive_buffer_bytes, kMinFrameBytes, kMaxFrameBytes);
  }
  if (o.external_body_min_bytes < kMinFrameBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "wire: DecoderOptions::external_body_min_bytes = {} is below {}",
                      o.external_body_min_bytes, kMinFrameBytes);
  }
  return ok_status();
}

// Header checks, in the documented order. Fills *info on success.
Status check_header_fields(const FrameHeaderWire& h, std::uint64_t at,
                           const DecoderOptions& options, FrameInfo* info) {
  if (h.magic != kMagic) {
    return frame_error(ErrorCode::kMalformedFrame, at, 0,
                       "bad magic 0x{:08x}, expected 0x{:08x} (\"EMBF\"): the peer does not speak "
                       "Ember's frame protocol, or the stream lost sync",
                       h.magic, kMagic);
  }
  if (h.version != kVersion) {
    return frame_error(ErrorCode::kVersionMismatch, at, 8,
                       "unsupported wire version {}, this build speaks version {}: run the same "
                       "Ember release on both ends",
                       h.version, kVersion);
  }
  if (h.kind != static_cast<std::uint8_t>(FrameKind::kBatch) &&
      h.kind != static_cast<std::uint8_t>(FrameKind::kSingle)) {
    return frame_error(ErrorCode::kMalformedFrame, at, 9,
                       "unknown frame kind {}, expected 1 (batch) or 2 (single)", h.kind);
  }
  if ((h.flags & ~kKnownFrameFlags) != 0) {
    return frame_error(ErrorCode::kMalformedFrame, at, 10,
                       "unknown frame flags 0x{:04x}; this build knows 0x{:04x} (prefix-only "
                       "checksum): run the same Ember release on both ends",
                       h.flags, kKnownFrameFlags);
  }
  if ((h.flags & kFrameFlagPrefixChecksum) != 0 &&
      h.kind != static_cast<std::uint8_t>(FrameKind::kSingle)) {
    return frame_error(ErrorCode::kMalformedFrame, at, 10,
                       "frame flag 0x{:04x} (prefix-only checksum) on a frame of kind {}: only "
                       "single frames (kind 2) may leave their payload out of the checksum",
                       kFrameFlagPrefixChecksum, h.kind);
  }
  if (h.reserved != 0) {
    return frame_error(ErrorCode::kMalformedFrame, at, 20,
                       "reserved field is 0x{:08x}, must be 0 in wire version 1", h.reserved);
  }
  if (h.frame_bytes > options.max_frame_bytes) {
    return frame_error(ErrorCode::kTooLarge, at, 16,
                       "frame_bytes {} exceeds max_frame_bytes {}: raise the receiver's "
                       "DecoderOptions::max_frame_bytes or send smaller chunks (partition_bytes)",
                       h.frame_bytes, options.max_frame_bytes);
  }
  if (h.frame_bytes < kMinFrameBytes || h.frame_bytes % kAlignBytes != 0) {
    return frame_error(ErrorCode::kMalformedFrame, at, 16,
                       "frame_bytes {} is invalid: frames are a multiple of {} bytes and at "
                       "least {}",
                       h.frame_bytes, kAlignBytes, kMinFrameBytes);
  }
  if (h.item_count == 0) {
    return frame_error(ErrorCode::kMalformedFrame, at, 12,
                       "zero items: item_count is 0, a frame carries at least one item");
  }
  const std::size_t fit = max_items_in(h.frame_bytes);
  if (h.item_count > fit) {
    return frame_error(ErrorCode::kMalformedFrame, at, 12,
                       "item count too large: item_count {} needs a {}-byte header and table but "
                       "frame_bytes is {} (at most {} items fit)",
                       h.item_count, kHeaderBytes + kItemEntryBytes * std::size_t{h.item_count},
                       h.frame_bytes, fit);
  }
  if (h.kind == static_cast<std::uint8_t>(FrameKind::kSingle) && h.item_count != 1) {
    return frame_error(ErrorCode::kMalformedFrame, at, 12,
                       "item count {} in a single frame (kind 2), which carries exactly 1",
                       h.item_count);
  }
  info->kind = static_cast<FrameKind>(h.kind);
  info->flags = h.flags;
  info->item_count = h.item_count;
  info->frame_bytes = h.frame_bytes;
  info->prefix_bytes = static_cast<std::uint32_t>(prefix_bytes(h.item_count));
  info->stream_offset = at;
  return ok_status();
}

// Every table entry: canonical offset, length inside the frame, and the
// frame ending right after the last payload's padding. `prefix` holds at
// least info.prefix_bytes bytes.
Status check_table(const std::byte* prefix, const FrameInfo& info) {
  const std::uint64_t at = info.stream_offset;
  std::size_t expected = info.prefix_bytes;
  std::size_t end = info.prefix_bytes;
  for (std::size_t i = 0; i < info.item_count; ++i) {
    const ItemEntryWire e = load_entry(prefix, i);
    const std::size_t field = kHeaderBytes + i * kItemEntryBytes;
    if (e.offset < info.prefix_bytes || e.offset > info.frame_bytes) {
      return frame_error(ErrorCode::kMalformedFrame, at, field,
                         "item {} offset {} is out of range: payloads lie in [{}, {}) "
                         "(after the table, inside frame_bytes)",
                         i, e.offset, info.prefix_bytes, info.frame_bytes);
    }
    if (e.offset != expected) {
      return frame_error(ErrorCode::kMalformedFrame, at, field,
                         "item {} offset {} is not where packing puts it ({}): items follow the "
                         "table in order, each at the next multiple of 8",
                         i, e.offset, expected);
    }
    if (e.length > info.frame_bytes - e.offset) {
      return frame_error(ErrorCode::kMalformedFrame, at, field + 4,
                         "item {} length {} is out of range: [{}, {}) runs past frame_bytes {}", i,
                         e.length, e.offset, std::size_t{e.offset} + e.length, info.frame_bytes);
    }
    end = std::size_t{e.offset} + e.length;
    expected = align_up8(end);
  }
  if (expected != info.frame_bytes) {
    return frame_error(ErrorCode::kMalformedFrame, at, 16,
                       "frame_bytes {} does not match the payloads: the last item ends at {}, "
                       "so frame_bytes must be {}",
                       info.frame_bytes, end, expected);
  }
  return ok_status();
}

tl::unexpected<Error> crc_error(const FrameInfo& info, std::uint32_t in_header,
                                std::uint32_t computed) {
  return frame_error(ErrorCode::kChecksumMismatch, info.stream_offset, 4,
                     "checksum mismatch: the header says crc32c 0x{:08x} but frame bytes [8, {}) "
                     "({} items{}) hash to 0x{:08x}: corrupted in transit or by the sender",
                     in_header, info.crc_end(), info.item_count,
                     info.crc_covers_body() ? "" : ", header and table only", computed);
}

}  // namespace

Item Frame::item(std::size_t index) const noexcept {
  EMBER_DCHECK(index < info_.item_count);
  const ItemEntryWire e = load_entry(prefix_, index);
  return Item{std::span<const std::byte>(body_ + (e.offset - info_.prefix_bytes), e.length),
              e.flags};
}

Result<Frame> decode_frame(std::span<const std::byte> bytes, const DecoderOptions& options) {
  EMBER_TRY(check_options(options));
  if (bytes.size() < kHeaderBytes) {
    return make_error(ErrorCode::kMalformedFrame,
                      "wire: truncated frame: {} bytes, less than the {}-byte header",
                      bytes.size(), kHeaderBytes);
  }
  const FrameHeaderWire h = load_header(bytes.data());
  Frame frame;
  EMBER_TRY(check_header_fields(h, 0, options, &frame.info_));
  if (bytes.size() < frame.info_.frame_bytes) {
    return make_error(ErrorCode::kMalformedFrame,
                      "wire: truncated frame: {} bytes, but its header (frame_bytes at frame byte "
                      "16) declares {}",
                      bytes.size(), frame.info_.frame_bytes);
  }
  EMBER_TRY(check_table(bytes.data(), frame.info_));
  const std::uint32_t computed = crc32c(bytes.subspan(kCrcCoverageBegin,
                                                      frame.info_.crc_end() - kCrcCoverageBegin));
  if (computed != h.crc32c) return crc_error(frame.info_, h.crc32c, computed);
  frame.prefix_ = bytes.data();
  frame.body_ = bytes.data() + frame.info_.prefix_bytes;
  return frame;
}

// ---------------------------------------------------------------------------
// FrameDecoder

Result<FrameDecoder> FrameDecoder::create(const DecoderOptions& options) {
  EMBER_TRY(check_options(options));
  return FrameDecoder(options);
}

FrameDecoder::FrameDecoder(const DecoderOptions& options)
    : options_(options),
      buf_(new std::byte[2 * align_up8(options.receive_buffer_bytes)]),
      capacity_(2 * align_up8(options.receive_buffer_bytes)) {}

FrameDecoder::FrameDecoder(FrameDecoder&& other) noexcept { *this = std::move(other); }

FrameDecoder& FrameDecoder::operator=(FrameDecoder&& other) noexcept {
  if (this == &other) return *this;
  if (state_ != State::kHandedOut) release_external_body();
  options_ = other.options_;
  buf_ = std::move(other.buf_);
  capacity_ = std::exchange(other.capacity_, 0);
  begin_ = std::exchange(other.begin_, 0);
  end_ = std::exchange(other.end_, 0);
  state_ = std::exchange(other.state_, State::kHeader);
  info_ = other.info_;
  header_crc_ = other.header_crc_;
  frame_stream_offset_ = other.frame_stream_offset_;
  frame_buffer_bytes_ = other.frame_buffer_bytes_;
  ext_body_ = std::exchange(other.ext_body_, {});
  ext_filled_ = other.ext_filled_;
  ext_crc_ = other.ext_crc_;
  prepare_pending_ = std::exchange(other.prepare_pending_, false);
  last_prepare_external_ = other.last_prepare_external_;
  last_prepare_bytes_ = std::exchange(other.last_prepare_bytes_, 0);
  stream_bytes_ = other.stream_bytes_;
  error_ = std::move(other.error_);
  return *this;
}

FrameDecoder::~FrameDecoder() {
  if (state_ != State::kHandedOut) release_external_body();
}

void FrameDecoder::release_external_body() noexcept {
  if (!ext_body_.empty() && options_.body_allocator != nullptr) {
    options_.body_allocator->release_body(ext_body_);
  }
  ext_body_ = {};
}

Status FrameDecoder::fail(Error error) {
  if (state_ != State::kHandedOut) release_external_body();
  state_ = State::kFailed;
  error_ = std::move(error);
  return tl::unexpected<Error>(error_);
}

void FrameDecoder::release_handed_out() noexcept {
  if (state_ != State::kHandedOut) return;
  begin_ += frame_buffer_bytes_;
  frame_stream_offset_ += info_.frame_bytes;
  ext_body_ = {};  // owned by the caller since next()
  ext_filled_ = 0;
  if (begin_ == end_) begin_ = end_ = 0;  // empty: restart at the front, no copy
  state_ = State::kHeader;
}

std::size_t FrameDecoder::unit_goal() const noexcept {
  switch (state_) {
    case State::kHeader: return kHeaderBytes;
    case State::kTable: return info_.prefix_bytes;
    case State::kBody: return info_.frame_bytes;
    default: return 0;
  }
}

void FrameDecoder::reserve_tail(std::size_t bytes) {
  if (capacity_ - end_ >= bytes) return;
  const std::size_t live = end_ - begin_;
  if (begin_ > 0 && capacity_ - live >= bytes) {
    // Copy (named): the unreleased tail (at most one partial frame plus what
    // arrived with it) moves to the front of the receive buffer.
    std::memmove(buf_.get(), buf_.get() + begin_, live);
  } else {
    // Cold: the buffer grows to hold a frame larger than any before.
    const std::size_t capacity = align_up8(std::max(capacity_ * 2, live + bytes));
    std::unique_ptr<std::byte[]> grown(new std::byte[capacity]);
    if (live > 0) std::memcpy(grown.get(), buf_.get() + begin_, live);
    buf_ = std::move(grown);
    capacity_ = capacity;
  }
  begin_ = 0;
  end_ = live;
}

void FrameDecoder::extend_body_crc(std::span<const std::byte> bytes) noexcept {
  if (info_.crc_covers_body()) ext_crc_ = crc32c_extend(ext_crc_, bytes);
}

Status FrameDecoder::check_crc(std::uint32_t computed) {
  if (computed != header_crc_) return fail(crc_error(info_, header_crc_, computed).value());
  state_ = State::kReady;
  return ok_status();
}

// The table is checked: decide where the body goes.
Status FrameDecoder::enter_body() {
  const std::size_t prefix = info_.prefix_bytes;
  const std::size_t body = info_.body_bytes();
  if (options_.body_allocator != nullptr && body > 0 &&
      info_.frame_bytes >= options_.external_body_min_bytes) {
    auto dest = options_.body_allocator->allocate_body(info_, body);
    if (!dest) {
      Error e = std::move(dest).error();
      e.with_context(fmt::format("wire: allocating the {}-byte body of the frame at stream byte {}",
                                 body, info_.stream_offset));
      return fail(std::move(e));
    }
    if (!dest->empty()) {
      EMBER_CHECK_MSG(dest->size() >= body,
                      "BodyAllocator::allocate_body returned {} bytes for a {}-byte body",
                      dest->size(), body);
      ext_body_ = *dest;
      const std::size_t arrived = end_ - begin_ - prefix;
      const std::size_t k = std::min(arrived, body);
      // Copy (named): body bytes that arrived with the header in the receive
      // buffer (at most one receive's worth) move to the external body.
      if (k > 0) std::memcpy(ext_body_.data(), buf_.get() + begin_ + prefix, k);
      ext_filled_ = k;
      ext_crc_ = crc32c(std::span<const std::byte>(buf_.get() + begin_ + kCrcCoverageBegin,
                                                   prefix - kCrcCoverageBegin));
      extend_body_crc(ext_body_.first(k));
      if (k == body) {
        frame_buffer_bytes_ = info_.frame_bytes;  // the next frame starts after the stale body
      } else {
        frame_buffer_bytes_ = prefix;  // every received byte went to the body
        end_ = begin_ + prefix;
      }
      state_ = State::kExternalBody;
      return ok_status();
    }
  }
  // Receive buffer: make the whole frame fit contiguously from begin_.
  const std::size_t have = end_ - begin_;
  if (info_.frame_bytes > have) reserve_tail(info_.frame_bytes - have);
  frame_buffer_bytes_ = info_.frame_bytes;
  state_ = State::kBody;
  return ok_status();
}

Status FrameDecoder::advance() {
  for (;;) {
    switch (state_) {
      case State::kFailed:
        return tl::unexpected<Error>(error_);
      case State::kReady:
        return ok_status();
      case State::kHandedOut:
        release_handed_out();
        break;
      case State::kHeader: {
        if (end_ - begin_ < kHeaderBytes) return ok_status();
        const FrameHeaderWire h = load_header(buf_.get() + begin_);
        if (auto s = check_header_fields(h, frame_stream_offset_, options_, &info_); !s) {
          return fail(std::move(s).error());
        }
        header_crc_ = h.crc32c;
        state_ = State::kTable;
        break;
      }
      case State::kTable: {
        if (end_ - begin_ < info_.prefix_bytes) return ok_status();
        if (auto s = check_table(buf_.get() + begin_, info_); !s) return fail(std::move(s).error());
        EMBER_TRY(enter_body());
        break;
      }
      case State::kBody: {
        if (end_ - begin_ < info_.frame_bytes) return ok_status();
        return check_crc(crc32c(std::span<const std::byte>(
            buf_.get() + begin_ + kCrcCoverageBegin, info_.crc_end() - kCrcCoverageBegin)));
      }
      case State::kExternalBody: {
        if (ext_filled_ < info_.body_bytes()) return ok_status();
        return check_crc(ext_crc_);
      }
    }
  }
}

Status FrameDecoder::feed(std::span<const std::byte> bytes) {
  EMBER_CHECK_MSG(!prepare_pending_, "FrameDecoder::feed between prepare() and commit()");
  if (state_ == State::kFailed) return tl::unexpected<Error>(error_);
  release_handed_out();
  while (!bytes.empty()) {
    std::size_t n = 0;
    if (state_ == State::kExternalBody) {
      n = std::min(bytes.size(), info_.body_bytes() - ext_filled_);
      // Copy (named): feed() is the copying API.
      std::memcpy(ext_body_.data() + ext_filled_, bytes.data(), n);
      extend_body_crc(bytes.first(n));
      ext_filled_ += n;
    } else {
      // Take just what completes the current step, so a large frame's body
      // goes straight to its external buffer; after a ready frame take it all.
      const std::size_t goal = unit_goal();
      n = goal > 0 ? std::min(bytes.size(), goal - (end_ - begin_)) : bytes.size();
      reserve_tail(n);
      std::memcpy(buf_.get() + end_, bytes.data(), n);  // Copy (named): feed() copies.
      end_ += n;
    }
    stream_bytes_ += n;
    bytes = bytes.subspan(n);
    EMBER_TRY(advance());
  }
  return ok_status();
}

std::span<std::byte> FrameDecoder::prepare() {
  prepare_pending_ = false;
  last_prepare_bytes_ = 0;
  if (state_ == State::kFailed) return {};
  release_handed_out();
  if (!advance()) return {};
  if (state_ == State::kExternalBody) {
    last_prepare_external_ = true;
    last_prepare_bytes_ = info_.body_bytes() - ext_filled_;
    prepare_pending_ = true;
    return ext_body_.subspan(ext_filled_, last_prepare_bytes_);
  }
  std::size_t want = options_.receive_buffer_bytes;
  if (state_ == State::kBody) want = std::max(want, info_.frame_bytes - (end_ - begin_));
  reserve_tail(want);
  last_prepare_external_ = false;
  last_prepare_bytes_ = capacity_ - end_;
  prepare_pending_ = true;
  return {buf_.get() + end_, last_prepare_bytes_};
}

Status FrameDecoder::commit(std::size_t n) {
  EMBER_CHECK_MSG(prepare_pending_, "FrameDecoder::commit without prepare()");
  EMBER_CHECK_MSG(n <= last_prepare_bytes_, "FrameDecoder::commit({}) after prepare() offered {}",
                  n, last_prepare_bytes_);
  prepare_pending_ = false;
  if (last_prepare_external_) {
    extend_body_crc(ext_body_.subspan(ext_filled_, n));
    ext_filled_ += n;
  } else {
    end_ += n;
  }
  stream_bytes_ += n;
  return advance();
}

Result<std::optional<Frame>> FrameDecoder::next() {
  EMBER_CHECK_MSG(!prepare_pending_, "FrameDecoder::next between prepare() and commit()");
  release_handed_out();
  EMBER_TRY(advance());
  if (state_ != State::kReady) return std::optional<Frame>();
  Frame frame;
  frame.info_ = info_;
  frame.prefix_ = buf_.get() + begin_;
  if (ext_body_.empty()) {
    frame.body_ = buf_.get() + begin_ + info_.prefix_bytes;
  } else {
    frame.body_ = ext_body_.data();
    frame.external_body_ = ext_body_;
  }
  state_ = State::kHandedOut;
  return std::optional<Frame>(frame);
}

Status FrameDecoder::end_of_stream() {
  EMBER_CHECK_MSG(!prepare_pending_, "FrameDecoder::end_of_stream between prepare() and commit()");
  release_handed_out();
  EMBER_TRY(advance());
  EMBER_CHECK_MSG(state_ != State::kReady,
                  "FrameDecoder::end_of_stream with a verified frame not taken: drain next() first");
  if (state_ == State::kHeader && end_ == begin_) return ok_status();
  const std::uint64_t at = frame_stream_offset_;
  if (state_ == State::kHeader) {
    return fail(Error(ErrorCode::kMalformedFrame,
                      fmt::format("wire: truncated frame: the stream ended at stream byte {} inside "
                                  "the frame that starts at stream byte {}: {} of the {} header "
                                  "bytes arrived",
                                  stream_bytes_, at, end_ - begin_, kHeaderBytes)));
  }
  const std::size_t have = state_ == State::kExternalBody ? info_.prefix_bytes + ext_filled_
                                                          : end_ - begin_;
  return fail(Error(ErrorCode::kMalformedFrame,
                    fmt::format("wire: truncated frame: the stream ended at stream byte {} inside "
                                "the frame that starts at stream byte {}: {} of its {} bytes "
                                "(frame_bytes) arrived",
                                stream_bytes_, at, have, info_.frame_bytes)));
}

bool FrameDecoder::idle() const noexcept {
  if (state_ == State::kHeader) return end_ == begin_;
  if (state_ == State::kHandedOut) return end_ - begin_ == frame_buffer_bytes_;
  return false;
}

}  // namespace ember::wire
