// ReceiveBodies: the bridge from the framer's BodyAllocator (raw spans) to
// the transport's ReceiveAllocator (owning Buffers). The decoder asks for a
// body span; this keeps the Buffer that owns it until the frame is handed
// out (take) or given up (release_body).
//
// Thread-safety: one decoder's thread (the channel's I/O thread).
#pragma once

#include <span>
#include <utility>
#include <vector>

#include "common/transport/transport.h"
#include "common/wire/frame_decoder.h"

namespace ember::transport {

class ReceiveBodies final : public wire::BodyAllocator {
 public:
  explicit ReceiveBodies(const ReceiveAllocator* allocate) : allocate_(allocate) {}

  Result<std::span<std::byte>> allocate_body(const wire::FrameInfo& info,
                                             std::size_t body_bytes) override {
    (void)info;
    Result<Buffer> buffer = (allocate_ != nullptr && *allocate_) ? (*allocate_)(body_bytes)
                                                                 : Result<Buffer>(Buffer::heap_lazy(body_bytes));
    if (!buffer) {
      Error e = std::move(buffer).error();
      e.with_context(fmt::format("while allocating {} bytes for a received large message", body_bytes));
      return tl::unexpected<Error>(std::move(e));
    }
    if (buffer->size() < body_bytes) {
      return make_error(ErrorCode::kInternal,
                        "the receive allocator returned {} bytes for a request of {}", buffer->size(),
                        body_bytes);
    }
    std::span<std::byte> span = buffer->bytes().first(body_bytes);
    pending_.emplace_back(std::move(*buffer));
    return span;
  }

  void release_body(std::span<std::byte> body) noexcept override { (void)take(body); }

  // The Buffer whose bytes start at body.data() (empty if unknown).
  Buffer take(std::span<std::byte> body) noexcept {
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->data() == body.data()) {
        Buffer b = std::move(*it);
        pending_.erase(it);
        return b;
      }
    }
    return Buffer();
  }

 private:
  const ReceiveAllocator* allocate_;
  std::vector<Buffer> pending_;  // at most a couple: the frame being received, one handed out
};

}  // namespace ember::transport
