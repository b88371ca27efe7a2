// Fuzz target: the frame decoder never reads out of bounds or crashes, and
// its three entry points agree on any input.
//
// Input: byte 0 is a control byte, the rest is a byte stream.
//   bit 0   repair CRCs: walk the stream frame by frame (by frame_bytes) and
//           write the correct CRC32C into each, so the fuzzer gets past the
//           checksum into the table checks and the success paths
//   bit 1   decoder B uses an external-body allocator
//   bit 2   small max_frame_bytes (4 KiB) instead of 1 MiB
//   bits 3+ seed of the chunk sizes
// Checks (EMBER_CHECK aborts, which the fuzzer reports):
//   * decoder A (feed(), random chunks) and decoder B (prepare()/commit(),
//     random short reads) yield the same frames, items and final error text;
//   * every frame equals decode_frame() on the same bytes, and the frame
//     where A failed fails decode_frame() with the same code;
//   * every external body is handed out or released exactly once.
// The corpus (tests/fuzz/corpus/wire) is written by wire_make_corpus
// (tests/unit/wire/make_wire_corpus.cc).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/base/check.h"
#include "common/wire/crc32c.h"
#include "common/wire/frame_decoder.h"

namespace {

using ember::wire::BodyAllocator;
using ember::wire::DecoderOptions;
using ember::wire::FrameDecoder;
using ember::wire::FrameInfo;

struct Outcome {
  struct FrameRecord {
    std::uint64_t stream_offset = 0;
    std::uint32_t frame_bytes = 0;
    std::vector<std::pair<std::vector<std::byte>, std::uint32_t>> items;
    bool operator==(const FrameRecord&) const = default;
  };
  std::vector<FrameRecord> frames;
  std::optional<ember::Error> error;  // nullopt: stream ended cleanly
};

class TrackingAllocator : public BodyAllocator {
 public:
  ember::Result<std::span<std::byte>> allocate_body(const FrameInfo& info,
                                                    std::size_t body_bytes) override {
    EMBER_CHECK(info.body_bytes() == body_bytes);
    blocks_.push_back({std::make_unique<std::byte[]>(body_bytes), body_bytes, 0});
    return std::span<std::byte>(blocks_.back().data.get(), body_bytes);
  }
  void release_body(std::span<std::byte> body) noexcept override { mark(body.data(), 1); }
  void handed_out(std::byte* p) { mark(p, 2); }
  // Every block ended in exactly one of the two ways.
  void check_all_settled() const {
    for (const auto& b : blocks_) EMBER_CHECK_MSG(b.fate != 0, "external body leaked");
  }

 private:
  void mark(std::byte* p, int fate) {
    for (auto& b : blocks_) {
      if (b.data.get() == p) {
        EMBER_CHECK_MSG(b.fate == 0, "external body settled twice");
        b.fate = fate;
        return;
      }
    }
    EMBER_CHECK_MSG(false, "unknown external body");
  }
  struct Block {
    std::unique_ptr<std::byte[]> data;
    std::size_t bytes;
    int fate;  // 0 pending, 1 released, 2 handed out
  };
  std::vector<Block> blocks_;
};

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::size_t chunk(std::uint64_t& s, std::size_t left) {
  const std::uint64_t r = splitmix(s);
  const std::size_t n = (r & 3) == 0 ? 1 : 1 + (r >> 8) % 700;
  return n < left ? n : left;
}

// Takes every ready frame into `out`; returns false on a decoder error.
bool drain(FrameDecoder& dec, Outcome& out, TrackingAllocator* alloc) {
  for (;;) {
    auto frame = dec.next();
    if (!frame) {
      out.error = frame.error();
      return false;
    }
    if (!*frame) return true;
    Outcome::FrameRecord rec;
    rec.stream_offset = (*frame)->info().stream_offset;
    rec.frame_bytes = (*frame)->info().frame_bytes;
    for (ember::wire::Item item : **frame) {
      // Copying every payload byte is the out-of-bounds probe.
      rec.items.emplace_back(std::vector<std::byte>(item.payload.begin(), item.payload.end()),
                             item.flags);
    }
    if (!(*frame)->external_body().empty()) {
      EMBER_CHECK(alloc != nullptr);
      alloc->handed_out((*frame)->external_body().data());
    }
    out.frames.push_back(std::move(rec));
  }
}

Outcome run_feed(std::span<const std::byte> stream, const DecoderOptions& options,
                 std::uint64_t seed) {
  Outcome out;
  auto dec = FrameDecoder::create(options);
  EMBER_CHECK(dec.has_value());
  for (std::size_t at = 0; at < stream.size();) {
    const std::size_t n = chunk(seed, stream.size() - at);
    if (auto s = dec->feed(stream.subspan(at, n)); !s) {
      out.error = s.error();
      return out;
    }
    at += n;
    if (!drain(*dec, out, nullptr)) return out;
  }
  if (auto s = dec->end_of_stream(); !s) out.error = s.error();
  return out;
}

Outcome run_prepare_commit(std::span<const std::byte> stream, DecoderOptions options,
                           std::uint64_t seed, TrackingAllocator* alloc) {
  Outcome out;
  options.body_allocator = alloc;
  {
    auto dec = FrameDecoder::create(options);
    EMBER_CHECK(dec.has_value());
    for (std::size_t at = 0; at < stream.size();) {
      auto span = dec->prepare();
      EMBER_CHECK(!span.empty());
      std::size_t n = chunk(seed, stream.size() - at);
      if (n > span.size()) n = span.size();
      std::memcpy(span.data(), stream.data() + at, n);
      at += n;
      if (auto s = dec->commit(n); !s) {
        out.error = s.error();
        break;
      }
      if (!drain(*dec, out, alloc)) break;
    }
    if (!out.error) {
      if (auto s = dec->end_of_stream(); !s) out.error = s.error();
    }
  }  // destroying the decoder settles a pending body
  if (alloc != nullptr) alloc->check_all_settled();
  return out;
}

// Writes the correct CRC32C into each frame that frame_bytes delimits.
void repair_crcs(std::vector<std::byte>& s) {
  std::size_t at = 0;
  while (s.size() - at >= ember::wire::kHeaderBytes) {
    std::uint32_t frame_bytes = 0;
    std::memcpy(&frame_bytes, s.data() + at + 16, 4);
    if (frame_bytes < ember::wire::kMinFrameBytes || frame_bytes > s.size() - at) return;
    std::uint16_t flags = 0;
    std::uint32_t item_count = 0;
    std::memcpy(&flags, s.data() + at + 10, 2);
    std::memcpy(&item_count, s.data() + at + 12, 4);
    // Under the prefix-only flag the CRC ends after the table (clamped, so a
    // mutated item_count still repairs something inside the frame).
    const std::size_t end =
        std::min<std::size_t>(frame_bytes, ember::wire::crc_end(flags, std::min<std::uint32_t>(item_count, frame_bytes), frame_bytes));
    const std::uint32_t crc = ember::wire::crc32c(
        std::span<const std::byte>(s).subspan(at + 8, end - 8));
    std::memcpy(s.data() + at + 4, &crc, 4);
    at += frame_bytes;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t control = data[0];
  std::vector<std::byte> stream(reinterpret_cast<const std::byte*>(data + 1),
                                reinterpret_cast<const std::byte*>(data + size));
  if (control & 1) repair_crcs(stream);

  DecoderOptions options;
  options.max_frame_bytes = (control & 4) ? 4096 : (1u << 20);
  options.receive_buffer_bytes = 64 + (control >> 3) * 8;
  options.external_body_min_bytes = 256;
  const std::uint64_t seed = control >> 3;

  const Outcome a = run_feed(stream, options, seed);
  TrackingAllocator alloc;
  const Outcome b = run_prepare_commit(stream, options, seed * 7 + 1,
                                       (control & 2) ? &alloc : nullptr);

  EMBER_CHECK_MSG(a.frames == b.frames, "feed and prepare/commit disagree on frames ({} vs {})",
                  a.frames.size(), b.frames.size());
  EMBER_CHECK_MSG(a.error.has_value() == b.error.has_value() &&
                      (!a.error || a.error->message() == b.error->message()),
                  "feed and prepare/commit disagree: '{}' vs '{}'",
                  a.error ? a.error->message() : "ok", b.error ? b.error->message() : "ok");

  // decode_frame agrees frame by frame, and on the failing frame's code.
  std::uint64_t at = 0;
  for (const auto& rec : a.frames) {
    EMBER_CHECK(rec.stream_offset == at);
    auto frame = ember::wire::decode_frame(std::span<const std::byte>(stream).subspan(at), options);
    EMBER_CHECK_MSG(frame.has_value(), "decode_frame rejects a frame the decoder accepted: {}",
                    frame.error().message());
    EMBER_CHECK(frame->info().frame_bytes == rec.frame_bytes && frame->size() == rec.items.size());
    for (std::size_t i = 0; i < rec.items.size(); ++i) {
      const auto item = frame->item(i);
      EMBER_CHECK(item.flags == rec.items[i].second);
      EMBER_CHECK(std::equal(item.payload.begin(), item.payload.end(),
                             rec.items[i].first.begin(), rec.items[i].first.end()));
    }
    at += rec.frame_bytes;
  }
  if (a.error) {
    auto frame = ember::wire::decode_frame(std::span<const std::byte>(stream).subspan(at), options);
    EMBER_CHECK_MSG(!frame.has_value() && frame.error().code() == a.error->code(),
                    "decode_frame and the decoder disagree on the frame at {}: '{}' vs '{}'", at,
                    frame ? "ok" : frame.error().message(), a.error->message());
  } else {
    EMBER_CHECK(at == stream.size());
  }
  return 0;
}
