// The sending side of a close race (close_race_test.cc, and rdma's in
// rdma/rdma_transport_test.cc): counts sends accepted and completions, and
// checks transport.h's promises when the sender's Transport is destroyed
// while senders run.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/transport/transport.h"

namespace ember::transport::testing {

// What the sending side saw: completions (each id at most once), whether
// on_closed had run when each one came, and the close itself.
struct SenderSide {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> runs;         // per send id: how many times its completion ran
  int accepted = 0;              // sends that returned ok
  int completed = 0;             // completions that ran
  int completed_after_close = 0; // ... after on_closed had run
  int closed_during_completion = 0;  // on_closed ran while a completion ran
  // Each completion yields the CPU this many times before it ends: it widens
  // the window in which an on_closed that does not wait for completions
  // running on a caller's thread is seen (set before the senders start). The
  // lingering also ends after linger_limit: on a loaded machine one yield can
  // give the CPU away for a whole time slice, which is window enough, and 20
  // of them per completion made a test run for minutes.
  int linger_yields = 0;
  std::chrono::microseconds linger_limit{200};
  int closed_calls = 0;
  std::vector<std::string> refused;  // errors of refused sends

  Handlers handlers() {
    Handlers h;
    h.on_message = [](Connection&, Incoming&&) {};
    h.on_closed = [this](Connection&, const Error&) {
      std::lock_guard lock(mu);
      ++closed_calls;
      cv.notify_all();
    };
    return h;
  }
  // A new send id and its completion.
  std::pair<std::size_t, SendCompletion> next() {
    std::lock_guard lock(mu);
    const std::size_t id = runs.size();
    runs.push_back(0);
    return {id, [this, id](const Status&) {
              std::unique_lock done_lock(mu);
              ++runs[id];

              ++completed;
              if (closed_calls > 0) ++completed_after_close;
              cv.notify_all();
              if (linger_yields == 0) return;
              const int closed_before = closed_calls;
              done_lock.unlock();
              const auto until = std::chrono::steady_clock::now() + linger_limit;
              for (int i = 0; i < linger_yields && std::chrono::steady_clock::now() < until; ++i) {
                std::this_thread::yield();
              }
              done_lock.lock();
              if (closed_calls != closed_before) ++closed_during_completion;
            }};
  }
  // Why send() refused (the senders stop there); for failure messages.
  void note_refusal(const Error& e) {
    std::lock_guard lock(mu);
    refused.push_back(e.to_string());
  }
  std::string refusals() {
    std::lock_guard lock(mu);
    std::string all = "send() refused " + std::to_string(refused.size()) + " time(s)";
    for (const auto& r : refused) all += "; " + r;
    return all;
  }
  void count_accepted() {
    std::lock_guard lock(mu);
    ++accepted;
    cv.notify_all();
  }
  bool wait_in_flight_below(int n, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return accepted - completed < n || closed_calls > 0; });
  }
  bool wait_accepted(int n, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return accepted >= n; });
  }
  // Destroys the sending side's Transport (`client_tx`) while senders run,
  // then `join_senders()`, and checks transport.h's promises: on_closed ran
  // during ~Transport, every accepted send completed once, before on_closed,
  // and none after ~Transport returned.
  template <class Link, class Join>
  void check_close_during_transport_destruction(Link& link, Join&& join_senders) {
    link.client_tx.reset();
    int completed_at_return;
    {
      std::lock_guard lock(mu);
      completed_at_return = completed;
      EXPECT_EQ(closed_calls, 1) << "on_closed must have run during ~Transport";
    }
    join_senders();
    std::lock_guard lock(mu);
    EXPECT_EQ(completed_after_close, 0)
        << "send completions ran after on_closed (of " << completed << ")";
    EXPECT_EQ(closed_during_completion, 0) << "on_closed ran while a send completion was running";
    EXPECT_EQ(completed, completed_at_return) << "completions ran after ~Transport returned";
    EXPECT_EQ(completed, accepted) << "every accepted send completes";
    for (std::size_t id = 0; id < runs.size(); ++id) {
      EXPECT_LE(runs[id], 1) << "send " << id << " completed twice";
    }
  }
};

}  // namespace ember::transport::testing
