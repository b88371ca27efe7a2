// A test sink on the "worker" logger: lets a test wait (with a deadline) for
// a line of the worker's log. Shared by the server and worker integration
// tests.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include <spdlog/sinks/base_sink.h>

#include "common/base/logging.h"

namespace ember::testing {

// Collects the messages logged through it; wait_for(text) waits until one
// contains `text`. Thread-safe.
class LogWatch : public spdlog::sinks::base_sink<std::mutex> {
 public:
  bool wait_for(const std::string& text, std::chrono::milliseconds timeout) {
    std::unique_lock lock(seen_mutex_);
    return cv_.wait_for(lock, timeout, [&] { return seen_.find(text) != std::string::npos; });
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    {
      std::lock_guard lock(seen_mutex_);
      seen_.append(msg.payload.data(), msg.payload.size());
      seen_ += '\n';
    }
    cv_.notify_all();
  }
  void flush_() override {}

 private:
  std::mutex seen_mutex_;
  std::condition_variable cv_;
  std::string seen_;
};

// Adds a LogWatch to the "worker" logger for its lifetime. Declare it before
// the Workers (so it is destroyed after them): spdlog's sink list must not
// change while another thread logs through it (a data race under TSan).
struct WorkerLogWatch {
  std::shared_ptr<LogWatch> watch = std::make_shared<LogWatch>();
  std::shared_ptr<spdlog::logger> log = ember::log::logger("worker");
  WorkerLogWatch() { log->sinks().push_back(watch); }
  ~WorkerLogWatch() { log->sinks().pop_back(); }
  WorkerLogWatch(const WorkerLogWatch&) = delete;
  WorkerLogWatch& operator=(const WorkerLogWatch&) = delete;
};

}  // namespace ember::testing
