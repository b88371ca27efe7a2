// Transport::create: validates the options and builds the chosen transport.
#include "common/transport/rdma/rdma_transport.h"
#include "common/transport/shm/shm_transport.h"
#include "common/transport/tcp/tcp_transport.h"
#include "common/transport/transport.h"

namespace ember::transport {

Result<std::unique_ptr<Transport>> Transport::create(Options options) {
  EMBER_TRY(options.validate());
  switch (options.kind) {
    case Kind::kTcp:
      return tcp::create_tcp_transport(std::move(options));
    case Kind::kShm:
      return shm::create_shm_transport(std::move(options));
    case Kind::kRdma:
      return rdma::create_rdma_transport(std::move(options));
  }
  return make_error(ErrorCode::kInvalidArgument, "unknown transport kind {}",
                    static_cast<int>(options.kind));
}

}  // namespace ember::transport
