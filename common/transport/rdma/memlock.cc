#include "common/transport/rdma/memlock.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <limits>
#include <string>

#include "common/base/units.h"

namespace ember::transport::rdma {
namespace {

std::uint64_t read_vm_pin_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmPin:", 0) == 0) {
      try {
        return std::stoull(line.substr(6)) * 1024;  // "VmPin:  1234 kB"
      } catch (...) {
        return 0;
      }
    }
  }
  return 0;
}

bool thread_has_cap_ipc_lock() {
  __user_cap_header_struct header{};
  header.version = _LINUX_CAPABILITY_VERSION_3;
  header.pid = 0;  // the calling thread
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

}  // namespace

Result<MemlockLimit> read_memlock_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return make_sys_error(errno, "getrlimit(RLIMIT_MEMLOCK)");
  MemlockLimit l;
  l.unlimited = rl.rlim_cur == RLIM_INFINITY;
  l.soft_bytes = l.unlimited ? std::numeric_limits<std::uint64_t>::max() : rl.rlim_cur;
  l.hard_bytes = rl.rlim_max == RLIM_INFINITY ? std::numeric_limits<std::uint64_t>::max() : rl.rlim_max;
  l.cap_ipc_lock = thread_has_cap_ipc_lock();
  l.pinned_bytes = read_vm_pin_bytes();
  return l;
}

Status check_memlock(std::uint64_t needed_bytes, std::string_view what, const MemlockLimit& limit) {
  if (limit.unlimited || limit.cap_ipc_lock) return ok_status();
  const std::uint64_t total = limit.pinned_bytes + needed_bytes;
  if (total >= limit.pinned_bytes && total <= limit.soft_bytes) return ok_status();
  // Round the advice up to whole MiB (ulimit -l counts KiB).
  const std::uint64_t advise_mib = (total + (std::uint64_t{1} << 20) - 1) >> 20;
  std::string hard_note;
  if (limit.hard_bytes != std::numeric_limits<std::uint64_t>::max() &&
      limit.hard_bytes < total) {
    hard_note = fmt::format(" (the hard limit, {}, is also too small: only root or the service "
                            "manager can raise it)",
                            format_bytes(limit.hard_bytes));
  }
  return make_error(
      ErrorCode::kConfig,
      "RLIMIT_MEMLOCK is too small for RDMA: the limit is {} but the rdma transport must pin {} "
      "for {} on top of the {} this process has pinned already, {} in all{}. Raise the limit: "
      "LimitMEMLOCK=infinity (or at least {}M) in the [Service] section of the systemd unit "
      "(deploy/), `ulimit -l unlimited` (or `ulimit -l {}`, in KiB) in the shell that starts "
      "Ember, or --ulimit memlock=-1 for a container; or use transport = \"tcp\"",
      format_bytes(limit.soft_bytes), format_bytes(needed_bytes), what,
      format_bytes(limit.pinned_bytes), format_bytes(total), hard_note, advise_mib,
      advise_mib * 1024);
}

Status check_memlock(std::uint64_t needed_bytes, std::string_view what) {
  EMBER_ASSIGN_OR_RETURN(MemlockLimit limit, read_memlock_limit());
  return check_memlock(needed_bytes, what, limit);
}

}  // namespace ember::transport::rdma
