// The rdma transport: rdma-core verbs over reliable-connected queue pairs,
// connections managed with rdma_cm, behind the Transport interface.
//
// Device and memory. create() picks the first device with an ACTIVE port
// (device.h), allocates one protection domain on it, and starts the I/O
// threads (the completion pollers) and one rdma_cm event thread. Without such
// a device create() fails with kUnavailable, saying what was found and how to
// get a device or use tcp. register_memory() registers a region (the page
// pool's whole memfd mapping) once with ibv_reg_mr (local write, remote
// write), after checking RLIMIT_MEMLOCK (memlock.h): a limit that is too
// small is a kConfig error that says how to raise it. Nothing is registered
// on the data path and there is no per-address registration cache.
//
// Channels. One RC queue pair (and one completion queue) per channel; order
// per channel is the queue pair's order. Per channel each side posts a ring
// of receive buffers of batch size, taken from Options::receive_allocator
// (the page pool) when that memory lies in a registered region, else from
// memory the transport registers for the connection (checked against
// RLIMIT_MEMLOCK too).
//  * Small messages: the common/wire framer packs them into a send slot of
//    the channel's registered send ring (the one copy of the small path);
//    each batch is one SEND into a posted receive buffer.
//  * Flow control: credits. A sender posts only as many SENDs and WRITEs
//    with immediate as the peer has receive buffers posted; the receiver
//    returns credits in the immediate of its own SENDs, or, when it has
//    nothing to send, in a credit-only SEND for which it keeps spare
//    receive buffers (channel.h has the accounting and why it cannot
//    deadlock). A sender never overruns the peer's receive ring.
//    max_queued_bytes bounds what waits for credits, as for tcp.
//  * Large messages from registered memory: rendezvous. The sender asks
//    (RTS) for a block of the message's size; the receiver takes one from
//    its receive allocator and grants it (address, rkey, slot); the sender
//    RDMA-WRITEs the message straight into it with the slot as immediate,
//    and the receiver hands that block to on_message as Incoming::owned.
//    After each delivery the receiver re-arms the slot with a fresh block of
//    the same size, so a stream of same-sized messages (one key's pushes, or
//    its pull replies) needs one rendezvous per channel and peer, not one per
//    message. The transport does not see keys: a cached slot serves the next
//    message of a close size (capacity in [size, 2 x size]); a message whose
//    size changed asks again, and slots left unused are released (the
//    receiver frees their blocks). At most kMaxCachedSlots per channel, and
//    only for messages up to 16 MiB (a 64 MiB block held for a message that
//    may never come costs more than one round trip beside its transfer).
//  * Large messages from unregistered memory (a heap Buffer, or a receiver
//    without an RDMA-writable allocator): fragments of slot size through
//    the send ring (one more copy, named in channel.cc).
//  * Completions: each I/O thread polls the completion queues of its
//    channels, spins for kSpinBeforeBlock when idle, then arms them and
//    blocks on its completion channel, whose fd is awaited from the thread's
//    Boost.Asio io_context (so timers and posted work run on the same thread).
//
// Connections. connect() resolves the address and route and connects each
// channel with rdma_cm; transient failures (address or route errors,
// unreachable, connect errors) are retried with exponential backoff until
// connect_timeout; a rejection is an error at once: from a listener, with
// its reason (kAuth, kVersionMismatch, kProtocol, kUnavailable); from a host
// where nothing listens on that port, kIo ("connection refused"). The
// handshake travels in the CM private data (protocol.h). Every CM event is
// handled: DISCONNECTED after the peer's goodbye is an orderly close, before
// it an error (kIo: the peer crashed or reset); DEVICE_REMOVAL closes every
// connection with kUnavailable; TIMEWAIT_EXIT and ADDR_CHANGE are logged.
// Heartbeats and heartbeat_timeout work as for tcp.
//
// Addresses: "host:port" with the IP of the RDMA device's netdev (for
// Soft-RoCE the netdev rxe sits on, never 127.0.0.1). As for tcp, a listener
// on a non-loopback address needs an auth token.
//
// ConnectionStats: write_syscalls counts ibv_post_send calls, read_syscalls
// ibv_poll_cq calls that returned work; frames_sent counts SENDs and WRITEs
// carrying messages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "common/base/error.h"
#include "common/transport/transport.h"

namespace ember::transport::rdma {

// Slots a sender keeps granted per channel (see above).
inline constexpr std::uint32_t kMaxCachedSlots = 4;

// pre: options.kind == Kind::kRdma and options.validate() succeeded
// (Transport::create checks both). Errors: kUnavailable (no device with an
// active port, or a build without rdma-core), kIo (a verbs/rdma_cm call or a
// thread failed).
Result<std::unique_ptr<Transport>> create_rdma_transport(Options options);

// rdma-specific counters of one Connection, monotonic. For tests and metrics.
struct RdmaStats {
  std::uint64_t sends_posted = 0;          // SENDs of every type
  std::uint64_t writes_posted = 0;         // RDMA WRITEs with immediate (large messages)
  std::uint64_t rts_sent = 0;              // rendezvous requests
  std::uint64_t grants_received = 0;       // answered and unsolicited
  std::uint64_t cached_slot_writes = 0;    // writes into a slot granted ahead of time
  std::uint64_t slots_released = 0;        // cached slots given back unused
  std::uint64_t fragments_sent = 0;        // large messages sent as fragments (count of messages)
  std::uint64_t credit_messages_sent = 0;  // credit-only SENDs
  std::uint64_t credit_stalls = 0;         // times a channel had work but no credit
};
// nullopt when `connection` was not made by the rdma transport.
std::optional<RdmaStats> rdma_stats(const Connection& connection);

// Per channel, one line of internal state (credits, queues, posted work
// requests), for failure messages of tests and for debugging; "" for
// another kind of Connection. Any thread; racy reads, diagnostics only.
std::string rdma_debug_state(Connection& connection);

}  // namespace ember::transport::rdma
