// Sync points: named places in Ember's code where a test runs code of its
// own, to stall one thread inside a race window until another thread has
// done something. An interleaving the scheduler produces once in a million
// runs then happens on every run, so a fix for it gets a test that fails
// without the fix. After RocksDB's TEST_SYNC_POINT (test_util/sync_point.h)
// and Seastar's failure injection.
//
//   EMBER_SYNC_POINT("Worker::send:before_connection");   // in the library
//   sync_point::set("Worker::send:before_connection", [&] { ... });  // in a test
//
// The macro compiles to nothing unless the build defines EMBER_SYNC_POINTS
// (the CMake option of that name: ON in the dev, asan and tsan presets, OFF
// in release), so production builds pay nothing. Compiled in, a point with
// no callback set anywhere costs one atomic load. Tests that need a point
// check `sync_point::kCompiled` and GTEST_SKIP() without it.
//
// Names are "Class::function:where". Each point is documented where it is
// placed: which thread passes it and what holds there.
//
// Thread-safety: every function may be called from any thread. A callback
// runs on the thread that passes its point, outside this module's lock, and
// may block (that is what it is for); it must not call set() or clear_all().
// Allocation: set() allocates; pass() does not.
#pragma once

#include <functional>
#include <string>

namespace ember::sync_point {

#if defined(EMBER_SYNC_POINTS)
inline constexpr bool kCompiled = true;
#else
inline constexpr bool kCompiled = false;
#endif

// Runs `callback` on every thread that passes the point `name` from now on,
// until clear_all(). Replaces the point's previous callback. Without
// EMBER_SYNC_POINTS nothing ever passes a point and the callback never runs.
void set(std::string name, std::function<void()> callback);

// Removes every callback, then blocks until no callback is running any more
// (so a test's state that callbacks capture can be destroyed after it). A
// callback blocked forever makes this block forever: release it first.
void clear_all();

// Called by EMBER_SYNC_POINT: runs the callback set for `name`, if any.
void pass(const char* name);

// Clears every sync point when it goes out of scope (a test's first line).
class ScopedClear {
 public:
  ScopedClear() = default;
  ~ScopedClear() { clear_all(); }
  ScopedClear(const ScopedClear&) = delete;
  ScopedClear& operator=(const ScopedClear&) = delete;
};

}  // namespace ember::sync_point

#if defined(EMBER_SYNC_POINTS)
#define EMBER_SYNC_POINT(name) ::ember::sync_point::pass(name)
#else
#define EMBER_SYNC_POINT(name) \
  do {                         \
  } while (false)
#endif
