// Transport Options from the [communication] table of an Ember config.
//
// Maps every [communication] key the transport uses: transport, batch_threshold,
// flush_interval, ring_buffer_size (slots per shm lane), channels (0 = auto,
// resolved with config::resolved_num_channels), zero_copy, cpu_affinity,
// io_threads, heartbeat_interval, heartbeat_timeout, max_message_size,
// max_queued_bytes, auth_token. The caller adds receive_allocator (usually
// pool_receive_allocator) and may change connect_timeout.
//
// transport = "auto" picks shm when `peer_on_same_host` (and shm is built),
// else rdma when an RDMA device has an active port, else tcp
// (rdma::choose_auto); the choice and
// why are logged once, per call. transport = "rdma" gives Kind::kRdma; without a device,
// Transport::create fails with kUnavailable.
//
// Thread-safety: any thread; "auto" probes the RDMA devices (opens and
// closes them: milliseconds). Errors: kConfig from Options::validate() for
// combinations the config check does not cover.
#pragma once

#include "common/config/config.h"
#include "common/transport/transport.h"

namespace ember::transport {

Result<Options> options_from_config(const config::CommunicationConfig& comm,
                                    bool peer_on_same_host = false);

}  // namespace ember::transport
