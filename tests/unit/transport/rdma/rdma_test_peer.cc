// rdma_test_peer: the other process of the rdma peer-death tests. It is
// killed (SIGKILL) by the test mid-transfer, so its death is a real process
// death: the kernel tears its queue pairs and rdma_cm ids down.
//
//   rdma_test_peer client <address> <message_bytes>
//     connects (one channel), prints "CONNECTED", then sends messages of
//     message_bytes from a registered page pool, back to back, forever.
//   rdma_test_peer server <ip>
//     listens on ip:0, prints "LISTENING <address>", then prints
//     "RECEIVED <bytes>" for each message.
// Exit status 2 on a set-up error (printed to stderr).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "common/memory/page_pool.h"
#include "common/transport/pool_buffer.h"
#include "common/transport/transport.h"
#include "tests/unit/transport/rdma/rdma_test_util.h"

using namespace ember;
using namespace ember::transport;

namespace {

int fail(const std::string& what, const Error& e) {
  std::fprintf(stderr, "rdma_test_peer: %s: %s\n", what.c_str(), e.to_string().c_str());
  return 2;
}

Handlers quiet_handlers(bool print_received) {
  Handlers h;
  h.on_message = [print_received](Connection&, Incoming&& m) {
    if (print_received) {
      std::printf("RECEIVED %zu\n", m.bytes.size());
      std::fflush(stdout);
    }
  };
  h.on_closed = [](Connection&, const Error&) {};
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: rdma_test_peer client <address> <bytes> | server <ip>\n");
    return 2;
  }
  const std::string mode = argv[1];
  memory::PoolOptions po;
  po.prealloc_pages = 48;  // 96 MiB
  po.backing = memory::BackingRequest::kPlain;
  auto pool = memory::PagePool::create(po);
  if (!pool) return fail("page pool", pool.error());
  Options o = rdma::testing::suite_options(1);
  o.max_queued_bytes = std::uint64_t{32} << 20;  // send() waits before the pool runs dry
  o.receive_allocator = pool_receive_allocator(**pool);
  auto transport = Transport::create(o);
  if (!transport) return fail("transport", transport.error());
  auto region = register_pool(**transport, **pool);
  if (!region) return fail("register_memory", region.error());

  if (mode == "client" && argc >= 4) {
    const std::size_t bytes = std::strtoull(argv[3], nullptr, 10);
    auto conn = (*transport)->connect(argv[2], {Role::kWorker, 7}, quiet_handlers(false));
    if (!conn) return fail("connect", conn.error());
    std::printf("CONNECTED\n");
    std::fflush(stdout);
    for (;;) {
      auto b = allocate_buffer(**pool, bytes, *region);
      if (!b) return fail("allocate", b.error());
      if (Status s = (*conn)->send(0, std::move(*b)); !s) return fail("send", s.error());
    }
  }
  if (mode == "server") {
    auto listener = (*transport)->listen(std::string(argv[2]) + ":0", {Role::kServer, 0},
                                         [](std::shared_ptr<Connection>) {}, quiet_handlers(true));
    if (!listener) return fail("listen", listener.error());
    std::printf("LISTENING %s\n", (*listener)->address().c_str());
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));  // until killed
  }
  std::fprintf(stderr, "rdma_test_peer: unknown mode '%s'\n", mode.c_str());
  return 2;
}
