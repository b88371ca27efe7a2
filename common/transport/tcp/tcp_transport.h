// The tcp transport: Boost.Asio over TCP, one TCP connection per channel.
//
// Per channel stream (after the handshake of common/transport/handshake.h):
// a sequence of common/wire frames. Small messages are packed by a
// wire::BatchEncoder into the channel's batch buffer (the one copy of the
// small-message path) and sent when the batch is full, when flush_interval
// passes, or at flush(); a large message is one kSingle frame written with a
// gathered write of [frame prefix, payload, padding] straight from the
// caller's Buffer (or, when zero_copy = sendfile and the payload is at least
// 256 KiB, with sendfile() from its memfd). Heartbeats and the goodbye of an orderly close are control items
// (common/transport/control.h) in the same stream.
//
// Writing: whoever makes a frame ready (a sending thread, or the channel's
// I/O thread for timers) writes it at once with a non-blocking sendmsg when
// no write is in progress; what the socket does not take is finished by the
// I/O thread when the socket becomes writable. So a send costs no thread
// hop when the socket has room, and never blocks on the socket.
//
// Reading: the channel's I/O thread reads into the wire::FrameDecoder's
// buffer (zero-copy prepare/commit); the body of a large frame is read
// straight into a Buffer from Options::receive_allocator.
//
// Sockets: TCP_NODELAY on every channel; SIGPIPE is set to be ignored
// process-wide when it is at its default (a write to a reset peer must be an
// error value, not a signal: sendfile cannot pass MSG_NOSIGNAL).
#pragma once

#include <memory>

#include "common/base/error.h"
#include "common/transport/transport.h"

namespace ember::transport::tcp {

// pre: options.kind == Kind::kTcp (Transport::create checks it). Starts the
// I/O threads. Errors: kConfig (options.validate(), checked here too), kIo
// (an I/O thread could not be started).
Result<std::unique_ptr<Transport>> create_tcp_transport(Options options);

}  // namespace ember::transport::tcp
