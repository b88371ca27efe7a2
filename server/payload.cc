// Payload construction; see payload.h.
#include "server/payload.h"

#include <cstring>
#include <vector>

#include "common/base/check.h"

namespace ember::server {

Payload Payload::copy_of(std::span<const std::byte> bytes) {
  EMBER_DCHECK(bytes.size() % sizeof(float) == 0);
  std::vector<float> copy(bytes.size() / sizeof(float));
  if (!copy.empty()) std::memcpy(copy.data(), bytes.data(), copy.size() * sizeof(float));
  Payload p;
  p.data_ = copy.data();  // stays valid: moving a vector keeps its heap block
  p.size_ = copy.size();
  p.owner_ = transport::Buffer::adopt(std::as_writable_bytes(std::span<float>(copy)),
                                      transport::MemoryLocation{}, std::move(copy));
  p.is_copy_ = true;
  return p;
}

void Payload::detach() {
  if (is_copy_ || empty()) return;
  *this = copy_of(std::as_bytes(values()));  // the old buffer is released by the move
}

Payload Payload::adopt(transport::Buffer buffer, std::size_t offset_bytes, std::size_t num_elements) {
  EMBER_CHECK_MSG(offset_bytes <= buffer.size() &&
                      num_elements <= (buffer.size() - offset_bytes) / sizeof(float),
                  "payload [{}, +{} floats) outside a buffer of {} bytes", offset_bytes,
                  num_elements, buffer.size());
  const std::byte* start = buffer.data() + offset_bytes;
  if (reinterpret_cast<std::uintptr_t>(start) % alignof(float) != 0) {
    return copy_of(std::span<const std::byte>(start, num_elements * sizeof(float)));
  }
  Payload p;
  p.data_ = reinterpret_cast<const float*>(start);
  p.size_ = num_elements;
  p.owner_ = std::move(buffer);
  return p;
}

Payload Payload::of(std::span<const float> values) { return copy_of(std::as_bytes(values)); }

}  // namespace ember::server
