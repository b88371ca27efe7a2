// Sync points (sync_point.h): a map from name to callback under one mutex,
// and a count of callbacks set, read first by pass() so that a build with the
// points compiled in and none set takes no lock.
#include "common/base/sync_point.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>

namespace ember::sync_point {
namespace {

struct Registry {
  std::mutex mutex;
  std::condition_variable idle;  // notified when `running` drops
  std::map<std::string, std::shared_ptr<std::function<void()>>, std::less<>> callbacks;
  int running = 0;  // callbacks between their start and their end
  // callbacks.size(), written under `mutex` (release) and read without it
  // by pass() (acquire): a point passed after set() returned sees the count.
  std::atomic<std::size_t> armed{0};
};

Registry& registry() {
  // Leaked on purpose: a thread may pass a point during static destruction.
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

void set(std::string name, std::function<void()> callback) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.callbacks[std::move(name)] = std::make_shared<std::function<void()>>(std::move(callback));
  r.armed.store(r.callbacks.size(), std::memory_order_release);
}

void clear_all() {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  r.callbacks.clear();
  r.armed.store(0, std::memory_order_release);
  r.idle.wait(lock, [&] { return r.running == 0; });
}

void pass(const char* name) {
  Registry& r = registry();
  if (r.armed.load(std::memory_order_acquire) == 0) return;
  std::shared_ptr<std::function<void()>> callback;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.callbacks.find(std::string_view(name));
    if (it == r.callbacks.end()) return;
    callback = it->second;
    ++r.running;
  }
  struct Done {  // also when the callback throws
    Registry& r;
    std::shared_ptr<std::function<void()>>& callback;
    ~Done() {
      // Its captures die before clear_all() can return (this may be the
      // last reference once clear_all() emptied the map).
      callback.reset();
      {
        std::lock_guard lock(r.mutex);
        --r.running;
      }
      r.idle.notify_all();
    }
  } done{r, callback};
  (*callback)();
}

}  // namespace ember::sync_point
