// RLIMIT_MEMLOCK: how much memory this process may pin for RDMA, checked
// before the rdma transport registers memory, so that a too-small limit is a
// start-up error that says what to change instead of an ENOMEM from
// ibv_reg_mr (or, worse, a failure at the first connection).
//
// The kernel charges every registration (ib_umem_get) to the process's
// pinned pages (/proc/self/status VmPin) and refuses one that would take them
// over the soft RLIMIT_MEMLOCK, unless the calling thread has CAP_IPC_LOCK.
// check_memlock applies the same rule.
//
// Thread-safety: read_memlock_limit reads process state (any thread; the
// capability part is the calling thread's, as the kernel's check is);
// check_memlock is pure.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/base/error.h"

namespace ember::transport::rdma {

struct MemlockLimit {
  bool unlimited = false;          // soft limit is RLIM_INFINITY
  std::uint64_t soft_bytes = 0;    // meaningful when !unlimited
  std::uint64_t hard_bytes = 0;    // UINT64_MAX when unlimited
  bool cap_ipc_lock = false;       // the calling thread may exceed the limit
  std::uint64_t pinned_bytes = 0;  // already pinned by this process (VmPin)
};

// Errors: kIo when getrlimit fails. A missing /proc (VmPin) or capability
// query counts as 0 pinned / no capability.
Result<MemlockLimit> read_memlock_limit();

// Ok when pinning `needed_bytes` more fits under `limit`. Otherwise kConfig,
// naming the limit, the amount needed (`what`, e.g. "the page pool 'pool' of
// 128.0 MiB"), what is already pinned, and how to raise the limit:
// LimitMEMLOCK= in the systemd unit, `ulimit -l` in a shell, --ulimit
// memlock= for a container.
Status check_memlock(std::uint64_t needed_bytes, std::string_view what, const MemlockLimit& limit);

// read_memlock_limit() then check_memlock().
Status check_memlock(std::uint64_t needed_bytes, std::string_view what);

}  // namespace ember::transport::rdma
