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
// choose_auto() is the policy of transport = "auto" (issue 8): shm when the
// peer is on this host (a loopback address, which no RDMA port can reach;
// a deviation from the issue, which says rdma else tcp); else rdma when a
// device has an active port; else tcp. The reason names the device or says
// why there is none.
// availability_of() and choose_auto() are pure, so every branch is tested on
// any machine with injected device lists.
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
// availability_of(probe_devices()) in a build with rdma-core; otherwise
// unavailable, with a detail that says the build has no rdma.
Availability probe_rdma();

// The first device (in list order) with an ACTIVE port, or why there is
// none: "no RDMA device (...)" for an empty list, otherwise "no RDMA device
// has an active port: " and every port as describe_port() writes it. Pure.
Availability availability_of(const std::vector<DeviceInfo>& devices);
// "rxe0 port 1 (ACTIVE, Ethernet, netdev d0, 198.18.0.1)".
std::string describe_port(const DeviceInfo& device, const PortInfo& port);

struct AutoChoice {
  Kind kind = Kind::kTcp;
  // One line for the log, to be logged once where the choice is made
  // (component "transport", level info): 'transport = "auto": using
  // <rdma|shm|tcp> ...'; for shm and tcp it ends "; not rdma: <why not>".
  std::string reason;
};
// The policy of transport = "auto", in this order:
//  1. rdma when `rdma.available` (a device has an ACTIVE port), also for a
//     peer on this host: the reason then says that the addresses must be
//     the device's (rdma_cm cannot use 127.0.0.1 on Soft-RoCE) and that
//     transport = "shm" keeps such traffic off the device;
//  2. shm when `peer_on_same_host` and `shm_built`. This deviates from issue
//     8, which says tcp whenever no RDMA port is active: on one host shm
//     copies nothing (the peer maps our pool) and is strictly faster than
//     tcp, so auto keeps it;
//  3. tcp otherwise.
// `shm_built` is true in every build of this tree (shm has no build switch);
// a build without shm passes false. Pure: any thread, no allocation beyond
// the reason.
AutoChoice choose_auto(bool peer_on_same_host, const Availability& rdma, bool shm_built = true);
// The same from a device list (as probe_devices() returns): choose_auto(
// peer_on_same_host, availability_of(devices), shm_built).
AutoChoice choose_auto(bool peer_on_same_host, const std::vector<DeviceInfo>& devices,
                       bool shm_built = true);

}  // namespace ember::transport::rdma
