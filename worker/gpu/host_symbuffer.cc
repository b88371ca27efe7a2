// Host SymBuffer and ring views; see host_symbuffer.h.
#include "worker/gpu/host_symbuffer.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/base/check.h"
#include "worker/gpu/codec.h"
#include "worker/gpu/plan_types.h"
#include "worker/gpu/status.h"

namespace ember::gpu {

std::uint64_t load_position_acquire(const std::uint64_t& position) {
  // Pairs with store_position_release (or a kernel's release store) of the
  // other side of the ring.
  return std::atomic_ref<std::uint64_t>(const_cast<std::uint64_t&>(position))
      .load(std::memory_order_acquire);
}

void store_position_release(std::uint64_t& position, std::uint64_t value) {
  // Pairs with load_position_acquire of the other side: publishes the bytes
  // written (producer) or frees the bytes read (consumer) before it.
  std::atomic_ref<std::uint64_t>(position).store(value, std::memory_order_release);
}

RingView::RingView(const SymBufferView& view, std::uint64_t ring, Direction direction)
    : meta_(view.layout.meta(view.base, ring, direction)),
      data_(view.layout.data(view.base, ring, direction)),
      capacity_(view.layout.ring_bytes) {
  EMBER_CHECK_MSG(ring < view.layout.num_rings(), "ring {} of {}", ring, view.layout.num_rings());
}

std::uint64_t RingView::head() const { return load_position_acquire(meta_->head); }
std::uint64_t RingView::tail() const { return load_position_acquire(meta_->tail); }

RingView::Bytes RingView::range(std::uint64_t from, std::uint64_t length) const {
  const std::uint64_t slot = from % capacity_;
  const std::uint64_t first = std::min(length, capacity_ - slot);
  Bytes b;
  b.first = std::span<std::byte>(data_ + slot, first);
  b.second = std::span<std::byte>(data_, length - first);
  return b;
}

RingView::Bytes RingView::readable() const {
  const std::uint64_t h = meta_->head;  // our own position (consumer)
  const std::uint64_t t = load_position_acquire(meta_->tail);
  EMBER_CHECK_MSG(t - h <= capacity_, "ring positions corrupt: head={} tail={} capacity={}", h, t,
                  capacity_);
  return range(h, t - h);
}

void RingView::consume(std::uint64_t bytes) {
  const std::uint64_t h = meta_->head;
  const std::uint64_t t = load_position_acquire(meta_->tail);
  EMBER_CHECK_MSG(bytes <= t - h, "consume {} bytes but only {} readable (head={} tail={})", bytes,
                  t - h, h, t);
  store_position_release(meta_->head, h + bytes);
}

RingView::Bytes RingView::writable() const {
  const std::uint64_t t = meta_->tail;  // our own position (producer)
  const std::uint64_t h = load_position_acquire(meta_->head);
  EMBER_CHECK_MSG(t - h <= capacity_, "ring positions corrupt: head={} tail={} capacity={}", h, t,
                  capacity_);
  return range(t, capacity_ - (t - h));
}

void RingView::commit(std::uint64_t bytes) {
  const std::uint64_t t = meta_->tail;
  const std::uint64_t h = load_position_acquire(meta_->head);
  EMBER_CHECK_MSG(bytes <= capacity_ - (t - h), "commit {} bytes but only {} free (head={} tail={})",
                  bytes, capacity_ - (t - h), h, t);
  store_position_release(meta_->tail, t + bytes);
}

void HostSymBuffer::Free::operator()(std::byte* p) const { std::free(p); }

void reset_positions(const SymBufferView& view) {
  for (std::uint64_t ring = 0; ring < view.layout.num_rings(); ++ring) {
    for (Direction d : {Direction::kSend, Direction::kRecv}) {
      ChannelMeta* m = view.layout.meta(view.base, ring, d);
      store_position_release(m->head, 0);
      store_position_release(m->tail, 0);
    }
  }
}

void HostSymBuffer::reset_positions() { gpu::reset_positions(view_); }

Result<HostSymBuffer> HostSymBuffer::allocate(const SymBufferLayout& layout) {
  if (!layout.valid()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer layout {} channels x {} ranks x {} ring bytes is invalid (ring "
                      "bytes must be a positive multiple of 128)",
                      layout.num_channels, layout.num_ranks, layout.ring_bytes);
  }
  const std::uint64_t bytes = round_up(layout.total_bytes(), 4096);
  auto* p = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
  if (p == nullptr) {
    return make_sys_error(ENOMEM, "SymBuffer: cannot allocate {} bytes of host memory", bytes);
  }
  std::memset(p, 0, bytes);
  HostSymBuffer b;
  b.owned_.reset(p);
  b.view_ = SymBufferView{layout, p};
  return b;
}

Result<HostSymBuffer> HostSymBuffer::wrap(const SymBufferLayout& layout,
                                          std::span<std::byte> region) {
  if (!layout.valid()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer layout {} channels x {} ranks x {} ring bytes is invalid",
                      layout.num_channels, layout.num_ranks, layout.ring_bytes);
  }
  if (reinterpret_cast<std::uintptr_t>(region.data()) % kRegionAlignBytes != 0 ||
      region.size() < layout.total_bytes()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer: region at {} of {} bytes must be {}-byte aligned and hold {} "
                      "bytes",
                      static_cast<const void*>(region.data()), region.size(), kRegionAlignBytes,
                      layout.total_bytes());
  }
  HostSymBuffer b;
  b.view_ = SymBufferView{layout, region.data()};
  b.reset_positions();
  return b;
}

Status loopback(const SymBufferView& view) {
  for (std::uint64_t ring = 0; ring < view.layout.num_rings(); ++ring) {
    RingView send(view, ring, Direction::kSend);
    RingView recv(view, ring, Direction::kRecv);
    const RingView::Bytes in = send.readable();
    const RingView::Bytes out = recv.writable();
    if (out.size() < in.size()) {
      StepStatus s{};
      s.code = static_cast<std::uint32_t>(StepStatusCode::kNoSpace);
      s.ring = static_cast<std::uint32_t>(ring);
      s.direction = static_cast<std::uint32_t>(Direction::kRecv);
      s.head = recv.head();
      s.tail = recv.tail();
      s.need_bytes = in.size();
      return tl::unexpected(status_to_error(s, view.layout, "loopback"));
    }
    // Copy (the transport's one copy in this stand-in): in → out, both
    // possibly split at their ring's end.
    std::uint64_t copied = 0;
    for (std::span<std::byte> src : {in.first, in.second}) {
      std::uint64_t done = 0;
      while (done < src.size()) {
        std::span<std::byte> dst = copied < out.first.size()
                                       ? out.first.subspan(copied)
                                       : out.second.subspan(copied - out.first.size());
        const std::uint64_t n = std::min<std::uint64_t>(dst.size(), src.size() - done);
        std::memcpy(dst.data(), src.data() + done, n);
        done += n;
        copied += n;
      }
    }
    recv.commit(in.size());
    send.consume(in.size());
  }
  return ok_status();
}

}  // namespace ember::gpu
