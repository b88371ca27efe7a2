// The rdma transport in a build without rdma-core (EMBER_WITH_RDMA=OFF):
// every entry point says so, so transport = "rdma" is a clear error and
// transport = "auto" falls back with a reason.
#include "common/transport/rdma/device.h"
#include "common/transport/rdma/rdma_transport.h"

namespace ember::transport::rdma {
namespace {
constexpr const char* kNotBuilt =
    "this build has no rdma transport (EMBER_WITH_RDMA=OFF: install libibverbs-dev and "
    "librdmacm-dev, or scripts/install-deps.sh, and reconfigure)";
}

bool built_with_rdma() noexcept { return false; }

std::vector<DeviceInfo> probe_devices() { return {}; }

Availability probe_rdma() {
  Availability a;
  a.detail = kNotBuilt;
  return a;
}

Result<std::unique_ptr<Transport>> create_rdma_transport(Options options) {
  (void)options;
  return make_error(ErrorCode::kUnavailable, "transport = \"rdma\": {}; or use transport = \"tcp\"",
                    kNotBuilt);
}

std::string rdma_debug_state(Connection& connection) {
  (void)connection;
  return "";
}

std::optional<RdmaStats> rdma_stats(const Connection& connection) {
  (void)connection;
  return std::nullopt;
}

}  // namespace ember::transport::rdma
