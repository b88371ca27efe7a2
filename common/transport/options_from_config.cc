#include "common/transport/options_from_config.h"

#include "common/base/logging.h"
#include "common/transport/rdma/device.h"

namespace ember::transport {

Result<Options> options_from_config(const config::CommunicationConfig& comm,
                                    bool peer_on_same_host) {
  Options o;
  switch (comm.transport) {
    case config::Transport::kTcp:
      o.kind = Kind::kTcp;
      break;
    case config::Transport::kShm:
      o.kind = Kind::kShm;
      break;
    case config::Transport::kRdma:
      o.kind = Kind::kRdma;  // no device: Transport::create says so (kUnavailable)
      break;
    case config::Transport::kAuto: {
      const rdma::AutoChoice choice = rdma::choose_auto(peer_on_same_host, rdma::probe_rdma());
      o.kind = choice.kind;
      log::logger("transport")->info("{}", choice.reason);
      break;
    }
  }
  o.batch_threshold_bytes = comm.batch_threshold_bytes;
  o.flush_interval = comm.flush_interval;
  o.busy_poll = comm.busy_poll;
  o.ring_slots = comm.ring_buffer_slots;
  o.num_channels = config::resolved_num_channels(comm);
  o.zero_copy = comm.zero_copy == config::ZeroCopy::kSendfile ? ZeroCopy::kSendfile : ZeroCopy::kWritev;
  o.inline_write_bytes = comm.inline_write_bytes;
  o.payload_checksum = comm.payload_checksum;
  o.cpu_affinity.assign(comm.cpu_affinity.begin(), comm.cpu_affinity.end());
  o.num_io_threads = comm.num_io_threads;
  o.heartbeat_interval = comm.heartbeat_interval;
  o.heartbeat_timeout = comm.heartbeat_timeout;
  o.max_message_bytes = comm.max_message_bytes;
  o.max_queued_bytes = comm.max_queued_bytes;
  o.auth_token = comm.auth_token;
  EMBER_TRY(o.validate());
  return o;
}

}  // namespace ember::transport
