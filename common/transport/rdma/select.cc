// choose_auto: the transport = "auto" policy (no verbs calls; built always).
#include <fmt/format.h>

#include "common/transport/rdma/device.h"

namespace ember::transport::rdma {

AutoChoice choose_auto(bool peer_on_same_host, const Availability& rdma) {
  AutoChoice c;
  if (rdma.available) {
    c.kind = Kind::kRdma;
    c.reason = fmt::format("transport = \"auto\": using rdma: {}", rdma.detail);
    return c;
  }
  c.kind = peer_on_same_host ? Kind::kShm : Kind::kTcp;
  c.reason = fmt::format("transport = \"auto\": using {} ({}); not rdma: {}", kind_name(c.kind),
                         peer_on_same_host ? "the peer is on this host" : "remote peer",
                         rdma.detail);
  return c;
}

}  // namespace ember::transport::rdma
