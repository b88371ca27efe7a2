// The shm transport: a worker and a server on the same host exchange
// messages through shared memory, with no copy for large messages.
//
// Setup: the listener is a Unix-domain SOCK_SEQPACKET socket (a path, or
// "@name" in the abstract namespace). After the handshake of
// common/transport/handshake.h (kind shm, one stream for all channels) each
// side sends a setup message with, as SCM_RIGHTS descriptors: for every
// channel its outgoing lane (shm/lane.h: a slot ring in a memfd) and the
// eventfd it sleeps on (its doorbell), and the memfd of every region it
// registered (Transport::register_memory, before listen/connect). Each side
// maps the peer's lanes and regions. The socket stays open as the control
// link: heartbeats, the goodbye of an orderly close, and crash detection (the
// kernel closes it when the peer dies).
//
// Data path per channel and direction (one lane):
//  * small messages are packed by a wire::BatchEncoder directly into the next
//    free slot of the lane (the one copy), published when the batch is full,
//    after flush_interval, or at flush();
//  * a large message whose Buffer lies in a registered region is sent as a
//    descriptor (region, offset, length, token): the receiver reads the
//    sender's memory in place through its mapping, and the Incoming Buffer it
//    gets puts the token on the lane's release ring when destroyed, which
//    tells the sender to release its Buffer (a push of 64 MiB copies nothing);
//  * a large message from unregistered memory is copied through the ring in
//    slot-sized fragments and reassembled into a receive-allocator Buffer
//    (two copies; pass pool Buffers to avoid them).
// One-sided writes: Connection::write_peer_memory copies into any region the
// peer registered (the mapping above), so a server can write a pull reply's
// parameters straight into the worker's destination (proto::kFlagInPlace)
// and send only the header after them. Each write is counted in the peer's
// channel-0 lane and refused once the peer revoked writes (lane.h:
// memory_revoked, set when its side of the connection ends), and, when it
// names a write window (Connection::open_write_window, one per request,
// lane.h WriteWindow), once the peer closed that window.
// Wake-ups: a consumer spins briefly, then sets its sleeping flag and waits
// on its doorbell eventfd (from its io_context); a producer writes the
// doorbell only when that flag is set.
//
// Flow control: small messages are bounded by the ring (a sender waits for a
// free slot); lent large payloads by max_queued_bytes and by the token count
// (ring_slots per channel).
//
// A received large payload (Incoming::owned) is a read-only view of the
// sender's memory: do not write to it. The sender may reuse that memory once
// the Connection is closed, so copy what must outlive the Connection.
//
// Peer death: the control socket closes (a crash) or goes silent for
// heartbeat_timeout (a hang); the Connection then closes with kIo or
// kTimeout, the lanes and the peer's regions are unmapped (regions once the
// last Incoming Buffer that views them is gone) and the descriptors closed.
// A peer that only stalled (SIGSTOP, a long page-in) may wake up later with
// our memory still mapped, so two things wait for it, bounded:
//  * payloads we lent and it has not given back are quarantined: they go
//    back to their owner (the page pool) only when the peer puts their
//    token on the release ring (it still can, after the close) or its
//    process exits (a pidfd from SO_PEERCRED); a log line says how many
//    bytes are held. Destroying the Transport gives them back regardless.
//  * on_closed waits until no write of the peer into our memory is in
//    progress (write_peer_memory), up to heartbeat_timeout.
//
#pragma once

#include <memory>

#include "common/base/error.h"
#include "common/transport/transport.h"

namespace ember::transport::shm {

// pre: options.kind == Kind::kShm and options.validate() succeeded.
Result<std::unique_ptr<Transport>> create_shm_transport(Options options);

}  // namespace ember::transport::shm
