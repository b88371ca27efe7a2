// Which RDMA devices this host has, and the choice `transport = "auto"`
// makes from that.
//
// probe_devices() lists the verbs devices (ibv_get_device_list) with each
// port's state (ibv_query_port), link layer, and the network device and IPv4
// addresses behind it (sysfs gid_attrs/ndevs, getifaddrs) — the addresses a
// listener binds and rdma_cm peers connect to (for Soft-RoCE: the netdev rxe
// sits on, never 127.0.0.1). probe_rdma() reduces that to: is there a device
// with an ACTIVE port, which, and if not, why not, in words for the log and
// for the kUnavailable error of transport = "rdma".
//
// choose_auto() is the policy of transport = "auto": shm for a peer on this
// host (it copies nothing; rdma would go through the device); otherwise rdma
// when a device has an active port; otherwise tcp. The reason names the
// device or says why there is none. Pure, so every branch is tested on any
// machine.
//
// Thread-safety: probe functions open and close device contexts (blocking,
// milliseconds; cold path) and may be called from any thread. In a build
// without rdma-core (EMBER_WITH_RDMA=OFF) they report no device and say why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/transport/transport.h"

namespace ember::transport::rdma {

struct PortInfo {
  std::uint8_t port_num = 0;       // 1-based, as verbs numbers ports
  bool active = false;             // IBV_PORT_ACTIVE
  std::string state;               // "ACTIVE", "DOWN", ... (ibv_port_state_str)
  std::string link_layer;          // "InfiniBand" or "Ethernet"
  std::string netdev;              // the RoCE netdev ("" for InfiniBand or unknown)
  std::vector<std::string> ipv4;   // IPv4 addresses of netdev
};

struct DeviceInfo {
  std::string name;                // "rxe0", "mlx5_0"
  std::vector<PortInfo> ports;
};

struct Availability {
  bool available = false;          // a device with an active port exists
  std::string device;              // its name (when available)
  std::uint8_t port_num = 0;
  std::string address;             // an IPv4 address of its netdev, "" if none is known
  // "rxe0 port 1 (ACTIVE, Ethernet, netdev d0, 198.18.0.1)" when available;
  // otherwise why not ("no RDMA device (ibv_get_device_list found none)", or
  // each device and its ports' states).
  std::string detail;
};

// True when this build has the rdma transport (EMBER_WITH_RDMA).
bool built_with_rdma() noexcept;

std::vector<DeviceInfo> probe_devices();
Availability probe_rdma();

struct AutoChoice {
  Kind kind = Kind::kTcp;
  std::string reason;  // one line for the log: which transport and why
};
AutoChoice choose_auto(bool peer_on_same_host, const Availability& rdma);

}  // namespace ember::transport::rdma
