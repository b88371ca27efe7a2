// Device probe over libibverbs (built with EMBER_WITH_RDMA).
#include "common/transport/rdma/device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

namespace ember::transport::rdma {
namespace {

// The netdev behind a RoCE port: the first GID entry that names one.
std::string port_netdev(const char* device, int port) {
  for (int i = 0; i < 16; ++i) {
    std::ifstream in(fmt::format("/sys/class/infiniband/{}/ports/{}/gid_attrs/ndevs/{}", device,
                                 port, i));
    std::string name;
    if (in && std::getline(in, name) && !name.empty()) return name;
  }
  return "";
}

std::vector<std::string> ipv4_of(const std::string& netdev) {
  std::vector<std::string> out;
  if (netdev.empty()) return out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (netdev != a->ifa_name) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text) != nullptr) out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

}  // namespace

bool built_with_rdma() noexcept { return true; }

std::vector<DeviceInfo> probe_devices() {
  std::vector<DeviceInfo> out;
  int num = 0;
  ibv_device** list = ::ibv_get_device_list(&num);
  if (list == nullptr) return out;
  for (int i = 0; i < num; ++i) {
    DeviceInfo d;
    d.name = ::ibv_get_device_name(list[i]);
    ibv_context* ctx = ::ibv_open_device(list[i]);
    if (ctx == nullptr) {
      out.push_back(std::move(d));
      continue;
    }
    ibv_device_attr attr{};
    if (::ibv_query_device(ctx, &attr) == 0) {
      for (int p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (::ibv_query_port(ctx, static_cast<std::uint8_t>(p), &pa) != 0) continue;
        PortInfo port;
        port.port_num = static_cast<std::uint8_t>(p);
        port.active = pa.state == IBV_PORT_ACTIVE;
        port.state = ::ibv_port_state_str(pa.state);
        if (port.state.rfind("PORT_", 0) == 0) port.state = port.state.substr(5);
        port.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
        port.netdev = port_netdev(d.name.c_str(), p);
        port.ipv4 = ipv4_of(port.netdev);
        d.ports.push_back(std::move(port));
      }
    }
    ::ibv_close_device(ctx);
    out.push_back(std::move(d));
  }
  ::ibv_free_device_list(list);
  return out;
}

Availability probe_rdma() { return availability_of(probe_devices()); }

}  // namespace ember::transport::rdma
