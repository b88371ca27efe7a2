// Enum spellings, host:port parsing, CPU checks and derived values; see config.h.
#include "common/config/config.h"

#include <sched.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace ember::config {

std::string_view to_string(Transport v) noexcept {
  switch (v) {
    case Transport::kTcp: return "tcp";
    case Transport::kShm: return "shm";
    case Transport::kRdma: return "rdma";
    case Transport::kAuto: return "auto";
  }
  return "?";
}

std::string_view to_string(PoolBacking v) noexcept {
  switch (v) {
    case PoolBacking::kAuto: return "auto";
    case PoolBacking::kHugetlb: return "hugetlb";
    case PoolBacking::kThp: return "thp";
    case PoolBacking::kPlain: return "plain";
  }
  return "?";
}

std::string_view to_string(ZeroCopy v) noexcept {
  switch (v) {
    case ZeroCopy::kWritev: return "writev";
    case ZeroCopy::kSendfile: return "sendfile";
  }
  return "?";
}

std::string_view to_string(Consistency v) noexcept {
  switch (v) {
    case Consistency::kBsp: return "bsp";
    case Consistency::kAsp: return "asp";
    case Consistency::kSsp: return "ssp";
  }
  return "?";
}

std::string_view to_string(WorkerLossPolicy v) noexcept {
  switch (v) {
    case WorkerLossPolicy::kWait: return "wait";
    case WorkerLossPolicy::kShrink: return "shrink";
    case WorkerLossPolicy::kFail: return "fail";
  }
  return "?";
}

std::string_view to_string(OptimizerType v) noexcept {
  switch (v) {
    case OptimizerType::kSgd: return "sgd";
    case OptimizerType::kMomentum: return "momentum";
    case OptimizerType::kAdam: return "adam";
    case OptimizerType::kAdamW: return "adamw";
    case OptimizerType::kAdagrad: return "adagrad";
  }
  return "?";
}

std::string_view to_string(LogLevel v) noexcept {
  switch (v) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kCritical: return "critical";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

// ---------------------------------------------------------------------------
std::string HostPort::to_string() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

namespace {

constexpr std::string_view kHostPortExample = "write host:port, e.g. '127.0.0.1:7070'";

bool is_name_host(std::string_view h) {
  if (h.empty() || h.size() > 253) return false;
  return std::all_of(h.begin(), h.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return std::isalnum(u) || c == '-' || c == '.' || c == '_';
  });
}

bool is_ipv6_literal(std::string_view h) {
  if (h.size() < 2 || h.size() > 45 || h.find(':') == std::string_view::npos) return false;
  return std::all_of(h.begin(), h.end(), [](char c) {
    return std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
  });
}

}  // namespace

Result<HostPort> parse_host_port(std::string_view text, bool allow_port_zero) {
  if (text.empty()) {
    return make_error(ErrorCode::kConfig, "the address is empty; {}", kHostPortExample);
  }
  HostPort out;
  std::string_view port_text;
  if (text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string_view::npos) {
      return make_error(ErrorCode::kConfig, "'{}' has '[' without ']'; write an IPv6 address as "
                        "'[::1]:7070'", text);
    }
    const std::string_view host = text.substr(1, close - 1);
    if (!is_ipv6_literal(host)) {
      return make_error(ErrorCode::kConfig, "'{}': '{}' inside brackets is not an IPv6 address; "
                        "write e.g. '[::1]:7070'", text, host);
    }
    if (close + 1 >= text.size() || text[close + 1] != ':') {
      return make_error(ErrorCode::kConfig, "'{}' has no port after ']'; write e.g. '[::1]:7070'",
                        text);
    }
    out.host = std::string(host);
    port_text = text.substr(close + 2);
  } else {
    const std::size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      return make_error(ErrorCode::kConfig, "'{}' has no port; {}", text, kHostPortExample);
    }
    const std::string_view host = text.substr(0, colon);
    if (host.find(':') != std::string_view::npos) {
      return make_error(ErrorCode::kConfig, "'{}': an IPv6 address needs brackets; write e.g. "
                        "'[::1]:7070'", text);
    }
    if (!is_name_host(host)) {
      return make_error(ErrorCode::kConfig, "'{}': '{}' is not a host name or IPv4 address "
                        "(letters, digits, '.', '-', '_'); {}", text, host, kHostPortExample);
    }
    out.host = std::string(host);
    port_text = text.substr(colon + 1);
  }
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; })) {
    return make_error(ErrorCode::kConfig, "'{}': port '{}' is not a number from {} to 65535; {}",
                      text, port_text, allow_port_zero ? 0 : 1, kHostPortExample);
  }
  unsigned port = 0;
  for (const char c : port_text) port = port * 10 + static_cast<unsigned>(c - '0');
  if (port > 65535 || (port == 0 && !allow_port_zero)) {
    return make_error(ErrorCode::kConfig, "'{}': port {} is not in {} .. 65535; {}", text, port,
                      allow_port_zero ? 0 : 1, kHostPortExample);
  }
  out.port = static_cast<std::uint16_t>(port);
  return out;
}

// ---------------------------------------------------------------------------
std::uint32_t resolved_num_channels(const CommunicationConfig& comm) noexcept {
  std::size_t n = comm.num_channels;
  if (n == 0) n = comm.cpu_affinity.empty() ? comm.num_io_threads : comm.cpu_affinity.size();
  return static_cast<std::uint32_t>(std::clamp<std::size_t>(n, 1, 64));
}

HostPort effective_listen(const Config& config) {
  if (config.server.listen) return *config.server.listen;
  return config.cluster.servers.at(config.server.server_index);
}

namespace {

// "0-3,6,8-9" for a sorted list of ids.
std::string cpu_ranges(const std::vector<std::uint32_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", ids[i]) : fmt::format("{}-{}", ids[i], ids[j]);
    i = j + 1;
  }
  return out.empty() ? std::string("none") : out;
}

}  // namespace

Status check_cpus_exist(std::span<const std::uint32_t> cpus, std::string_view key) {
  const int num_conf = std::max(1, get_nprocs_conf());
  for (std::size_t i = 0; i < cpus.size(); ++i) {
    const std::uint32_t cpu = cpus[i];
    for (std::size_t j = 0; j < i; ++j) {
      if (cpus[j] == cpu) {
        return make_error(ErrorCode::kConfig, "key '{}': CPU {} is listed twice; list each CPU "
                          "once", key, cpu);
      }
    }
    if (cpu >= static_cast<std::uint32_t>(num_conf)) {
      return make_error(ErrorCode::kConfig, "key '{}': CPU {} does not exist on this machine "
                        "(CPUs 0-{}); use CPU ids from `lscpu` or leave {} empty for no pinning",
                        key, cpu, num_conf - 1, key);
    }
  }
  return ok_status();
}

Status check_cpus_available(std::span<const std::uint32_t> cpus, std::string_view key) {
  if (cpus.empty()) return ok_status();
  EMBER_TRY(check_cpus_exist(cpus, key));
  const int num_conf = std::max(1, get_nprocs_conf());
  // The kernel's mask may be larger than the configured count; grow until it fits.
  std::vector<std::uint32_t> allowed;
  for (int bits = std::max(num_conf, 1024); bits <= (1 << 20); bits *= 2) {
    cpu_set_t* set = CPU_ALLOC(bits);
    if (set == nullptr) return make_error(ErrorCode::kConfig, "key '{}': out of memory", key);
    const std::size_t bytes = CPU_ALLOC_SIZE(bits);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      for (int c = 0; c < bits; ++c) {
        if (CPU_ISSET_S(static_cast<std::size_t>(c), bytes, set)) {
          allowed.push_back(static_cast<std::uint32_t>(c));
        }
      }
      CPU_FREE(set);
      break;
    }
    const int err = errno;
    CPU_FREE(set);
    if (err != EINVAL) {
      return tl::unexpected(Error(ErrorCode::kConfig,
                                  fmt::format("key '{}': cannot read this process's CPU affinity "
                                              "(sched_getaffinity: {}); leave {} empty",
                                              key, std::strerror(err), key),
                                  err));
    }
  }
  for (const std::uint32_t cpu : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), cpu)) {
      return make_error(ErrorCode::kConfig, "key '{}': CPU {} is not in this process's allowed "
                        "CPUs ({}, set by taskset or the cgroup cpuset); use allowed CPUs only",
                        key, cpu, cpu_ranges(allowed));
    }
  }
  return ok_status();
}

}  // namespace ember::config
