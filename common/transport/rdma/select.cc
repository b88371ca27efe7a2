// The transport = "auto" policy and the device-list reduction behind it.
// Pure functions (no verbs calls), built in every build, so each branch is
// tested on any machine with injected device lists.
#include <fmt/format.h>

#include "common/transport/rdma/device.h"

namespace ember::transport::rdma {

std::string describe_port(const DeviceInfo& device, const PortInfo& port) {
  std::string s = fmt::format("{} port {} ({}, {}", device.name, port.port_num, port.state,
                              port.link_layer);
  if (!port.netdev.empty()) s += fmt::format(", netdev {}", port.netdev);
  for (const auto& ip : port.ipv4) s += ", " + ip;
  return s + ")";
}

Availability availability_of(const std::vector<DeviceInfo>& devices) {
  Availability a;
  if (devices.empty()) {
    a.detail = "no RDMA device (ibv_get_device_list found none; see `ibv_devices`, `rdma link`)";
    return a;
  }
  std::string seen;
  for (const DeviceInfo& d : devices) {
    for (const PortInfo& p : d.ports) {
      if (p.active && !a.available) {
        a.available = true;
        a.device = d.name;
        a.port_num = p.port_num;
        a.address = p.ipv4.empty() ? "" : p.ipv4.front();
        a.detail = describe_port(d, p);
      }
      seen += (seen.empty() ? "" : "; ") + describe_port(d, p);
    }
    if (d.ports.empty()) seen += (seen.empty() ? "" : "; ") + d.name + " (cannot be opened)";
  }
  if (!a.available) a.detail = "no RDMA device has an active port: " + seen;
  return a;
}

AutoChoice choose_auto(bool peer_on_same_host, const Availability& rdma, bool shm_built) {
  AutoChoice c;
  if (peer_on_same_host && shm_built) {
    // Deviation from issue 8 (which says rdma, else tcp): a same-host peer is
    // one named by a loopback address (common/proto/runtime.cc), which no
    // RDMA port can reach (rdma_cm resolves 127.0.0.1 to no device), and on
    // one host shm moves nothing at all (the peer maps our pool), so it
    // beats both.
    c.kind = Kind::kShm;
    if (rdma.available) {
      c.reason = fmt::format(
          "transport = \"auto\": using shm (the peer is on this host, at a loopback address no "
          "RDMA port can reach; shm copies nothing); rdma is available ({}) for peers on other "
          "hosts",
          rdma.detail);
    } else {
      c.reason = fmt::format(
          "transport = \"auto\": using shm (the peer is on this host: shm copies nothing, so it "
          "replaces tcp there); not rdma: {}",
          rdma.detail);
    }
    return c;
  }
  if (rdma.available) {
    c.kind = Kind::kRdma;
    c.reason = fmt::format("transport = \"auto\": using rdma: {}", rdma.detail);
    if (peer_on_same_host) {
      // Only without shm: rdma needs the device's address, not 127.0.0.1.
      c.reason += "; the peer is on this host and this build has no shm (listen and connect on "
                  "the device's address, not 127.0.0.1)";
    }
    return c;
  }
  c.kind = Kind::kTcp;
  c.reason = fmt::format("transport = \"auto\": using tcp ({}); not rdma: {}",
                         peer_on_same_host ? "the peer is on this host but this build has no shm"
                                           : "the peer is on another host",
                         rdma.detail);
  return c;
}

AutoChoice choose_auto(bool peer_on_same_host, const std::vector<DeviceInfo>& devices,
                       bool shm_built) {
  return choose_auto(peer_on_same_host, availability_of(devices), shm_built);
}

}  // namespace ember::transport::rdma
