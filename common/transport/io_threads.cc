#include "common/transport/io_threads.h"

#include <pthread.h>
#include <sched.h>

#include <string>
#include <system_error>

#include <fmt/format.h>

#include "common/base/logging.h"

namespace ember::transport {
namespace {
// The IoThreads whose thread this is (nullptr on other threads).
thread_local const IoThreads* t_current = nullptr;
}  // namespace

namespace {
// Runs `ctx` until it is stopped or out of work. See the header: polls for
// up to `busy_poll` after the last handler before blocking.
void run_context(boost::asio::io_context& ctx, std::chrono::nanoseconds busy_poll) {
  if (busy_poll.count() <= 0) {
    ctx.run();
    return;
  }
  using Clock = std::chrono::steady_clock;
  auto last_work = Clock::now();
  for (;;) {
    if (ctx.poll() != 0) {
      last_work = Clock::now();
      continue;
    }
    if (ctx.stopped()) return;  // stop(), or out of work after join_when_idle()
    if (Clock::now() - last_work < busy_poll) {
      sched_yield();
      continue;
    }
    if (ctx.run_one() == 0) return;  // blocks; 0: stopped or out of work
    last_work = Clock::now();
  }
}
}  // namespace

Result<std::unique_ptr<IoThreads>> IoThreads::start(std::uint32_t num_threads,
                                                    const std::vector<int>& cpu_affinity,
                                                    std::chrono::nanoseconds busy_poll) {
  std::unique_ptr<IoThreads> io(new IoThreads());
  for (std::uint32_t i = 0; i < num_threads; ++i) {
    io->contexts_.push_back(std::make_unique<boost::asio::io_context>(1));
    io->guards_.emplace_back(io->contexts_.back()->get_executor());
  }
  for (std::uint32_t i = 0; i < num_threads; ++i) {
    const int cpu = cpu_affinity.empty() ? -1 : cpu_affinity[i % cpu_affinity.size()];
    boost::asio::io_context* ctx = io->contexts_[i].get();
    const IoThreads* self = io.get();
    try {
      io->threads_.emplace_back([ctx, self, cpu, i, busy_poll] {
        t_current = self;
        const std::string name = fmt::format("ember-io-{}", i);
        pthread_setname_np(pthread_self(), name.c_str());
        if (cpu >= 0) {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(cpu, &set);
          if (int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set); rc != 0) {
            log::logger("transport")->warn("I/O thread {} could not be pinned to CPU {}: {}", i,
                                           cpu, std::error_code(rc, std::generic_category()).message());
          }
        }
        // Handlers never throw (STYLE: nothing throws across a completion
        // handler); run() returning means stop().
        run_context(*ctx, busy_poll);
      });
    } catch (const std::system_error& e) {
      io->stop();
      return make_sys_error(e.code().value(), "cannot start I/O thread {} of {}", i, num_threads);
    }
  }
  return io;
}

IoThreads::~IoThreads() { stop(); }


bool IoThreads::on_io_thread() const noexcept { return t_current == this; }

void IoThreads::close_gate() noexcept {
  gate_closed_.store(true, std::memory_order_seq_cst);
  // Pairs with post()'s release decrement: what those posters queued is in
  // the contexts before the guards go.
  while (posting_.load(std::memory_order_seq_cst) != 0) sched_yield();
}

void IoThreads::join_when_idle() {
  if (stopped_) return;
  stopped_ = true;
  // Before the guards: a post accepted up to here is in a context whose
  // thread still runs, and runs it before it leaves.
  close_gate();
  guards_.clear();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void IoThreads::stop() {
  if (stopped_) return;
  stopped_ = true;
  close_gate();
  guards_.clear();
  for (auto& ctx : contexts_) ctx->stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

}  // namespace ember::transport
