// ember-transport-peer: the other process of the transport integration
// tests. Connects to a listener as a worker and then behaves as asked:
//   echo   send every message back on its channel (large ones from the
//          received Buffer itself: no copy)
//   hold   keep every large message (never release it)
//   hold-then-release
//          keep every large message until the connection closes, then
//          release them, print "RELEASED" and stay alive until killed (a
//          stalled peer that woke up and dropped what it viewed)
//   flood  send 4 MiB messages as fast as possible
// Prints "READY" once connected and "GOT <n>" after each message, flushed,
// so the test can wait on its stdout. Exits 0 when the connection closes in
// order, 1 otherwise.
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <thread>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/base/logging.h"
#include "common/transport/transport.h"

using namespace ember;
using namespace ember::transport;

int main(int argc, char** argv) {
  std::string mode = "tcp", address, behaviour = "echo";
  std::uint32_t channels = 1, rank = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--mode") mode = v;
    else if (k == "--connect") address = v;
    else if (k == "--behaviour") behaviour = v;
    else if (k == "--channels") channels = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--rank") rank = static_cast<std::uint32_t>(std::stoul(v));
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  log::init_program_logging("warn");
  Options o;
  o.kind = mode == "shm" ? Kind::kShm : Kind::kTcp;
  o.zero_copy = mode == "tcp-sendfile" ? ZeroCopy::kSendfile : ZeroCopy::kWritev;
  o.num_channels = channels;
  o.max_message_bytes = std::uint64_t{128} << 20;
  o.heartbeat_interval = std::chrono::milliseconds(100);
  o.heartbeat_timeout = std::chrono::seconds(5);
  auto t = Transport::create(o);
  if (!t) {
    std::fprintf(stderr, "%s\n", t.error().to_string().c_str());
    return 1;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool closed = false;
  bool orderly = false;
  std::uint64_t got = 0;
  std::vector<Buffer> held;
  // Echoes go out from this thread, as a server's shard threads reply: a
  // send may wait for room, which an I/O thread must never do.
  struct Echo {
    std::uint32_t channel;
    Buffer payload;
  };
  std::deque<Echo> echoes;
  Handlers h;
  h.on_message = [&](Connection&, Incoming&& m) {
    if (behaviour == "echo") {
      Buffer copy;
      if (m.is_large()) {
        copy = std::move(m.owned);
      } else {
        copy = Buffer::heap(m.bytes.size());  // small: the span dies with the callback
        std::memcpy(copy.data(), m.bytes.data(), m.bytes.size());
      }
      std::lock_guard lock(mu);
      echoes.push_back(Echo{m.channel, std::move(copy)});
      cv.notify_all();
    } else if ((behaviour == "hold" || behaviour == "hold-then-release") && m.is_large()) {
      std::lock_guard lock(mu);
      held.push_back(std::move(m.owned));
    }
    std::lock_guard lock(mu);
    std::printf("GOT %llu\n", static_cast<unsigned long long>(++got));
    std::fflush(stdout);
  };
  h.on_closed = [&](Connection&, const Error& e) {
    std::lock_guard lock(mu);
    closed = true;
    orderly = e.code() == ErrorCode::kClosed;
    if (!orderly) std::fprintf(stderr, "closed: %s\n", e.to_string().c_str());
    cv.notify_all();
  };
  auto conn = (*t)->connect(address, {Role::kWorker, rank}, h);
  if (!conn) {
    std::fprintf(stderr, "%s\n", conn.error().to_string().c_str());
    return 1;
  }
  std::printf("READY\n");
  std::fflush(stdout);
  if (behaviour == "flood") {
    std::vector<std::byte> payload(std::size_t{4} << 20, std::byte{7});
    while (true) {
      if (!(*conn)->send(0, payload)) break;
    }
  }
  if (behaviour == "hold-then-release") {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return closed; });
    held.clear();
    std::printf("RELEASED\n");
    std::fflush(stdout);
    for (;;) ::pause();
  }
  std::unique_lock lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return closed || !echoes.empty(); });
    if (echoes.empty()) break;
    Echo e = std::move(echoes.front());
    echoes.pop_front();
    lock.unlock();
    (void)(*conn)->send(e.channel, std::move(e.payload));
    (void)(*conn)->flush(e.channel);
    lock.lock();
  }
  return orderly ? 0 : 1;
}
