// Sync points (common/base/sync_point.h): the registry works in every build
// (pass() is a plain function); the macro runs callbacks only where
// EMBER_SYNC_POINTS is defined.
#include "common/base/sync_point.h"

#include <atomic>
#include <future>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

namespace ember::sync_point {
namespace {

TEST(SyncPoint, PassRunsTheCallbackSetForItsNameOnly) {
  ScopedClear clear;
  int a = 0, b = 0;
  set("A", [&] { ++a; });
  set("B", [&] { ++b; });
  pass("A");
  pass("A");
  pass("C");  // nothing set
  EXPECT_EQ(a, 2);
  EXPECT_EQ(b, 0);
  set("A", [&] { a += 10; });  // replaces
  pass("A");
  EXPECT_EQ(a, 12);
}

TEST(SyncPoint, NothingRunsAfterClearAll) {
  int a = 0;
  set("A", [&] { ++a; });
  clear_all();
  pass("A");
  EXPECT_EQ(a, 0);
}

TEST(SyncPoint, ClearAllWaitsForARunningCallback) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> let_go{false};
  set("A", [&] {
    entered.set_value();
    released.wait();
  });
  std::thread passer([] { pass("A"); });
  entered.get_future().wait();
  // clear_all() must not return while the callback (and what it captures) is in use.
  auto cleared = std::async(std::launch::async, [&] {
    clear_all();
    return let_go.load();
  });
  EXPECT_EQ(cleared.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  let_go = true;
  release.set_value();
  EXPECT_TRUE(cleared.get());
  passer.join();
}

TEST(SyncPoint, AThrowingCallbackDoesNotBlockClearAll) {
  set("A", [] { throw std::runtime_error("from the callback"); });
  EXPECT_THROW(pass("A"), std::runtime_error);
  clear_all();  // returns: the callback counts as finished
}

TEST(SyncPoint, TheMacroPassesThePointOnlyWhereCompiledIn) {
  ScopedClear clear;
  int a = 0;
  set("Macro", [&] { ++a; });
  EMBER_SYNC_POINT("Macro");
  EXPECT_EQ(a, kCompiled ? 1 : 0);
}

}  // namespace
}  // namespace ember::sync_point
