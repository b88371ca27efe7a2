// choose_auto: the transport = "auto" policy (no verbs calls; built always).
#include <fmt/format.h>

#include "common/transport/rdma/device.h"

namespace ember::transport::rdma {

AutoChoice choose_auto(bool peer_on_same_host, const Availability& rdma) {
  AutoChoice c;
  if (peer_on_same_host) {
    // Same host: shm moves nothing at all (the peer maps our pool); rdma
    // would still copy through the device, and rdma_cm cannot use 127.0.0.1
    // on Soft-RoCE.
    c.kind = Kind::kShm;
    c.reason = fmt::format("transport = \"auto\": using shm (the peer is on this host; rdma {})",
                           rdma.available ? "is up but shm copies less" : "is not available");
    return c;
  }
  if (rdma.available) {
    c.kind = Kind::kRdma;
    c.reason = fmt::format("transport = \"auto\": using rdma: {}", rdma.detail);
    return c;
  }
  c.kind = Kind::kTcp;
  c.reason = fmt::format("transport = \"auto\": using tcp (remote peer); not rdma: {}", rdma.detail);
  return c;
}

}  // namespace ember::transport::rdma
