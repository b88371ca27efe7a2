// The C ABI (ember.h) over ember::Worker: handle wrappers, argument checks,
// the thread-local last error, and the exception boundary.
//
// Invariant: no C++ exception leaves an extern "C" function. Every entry
// point runs its body through `guard`, which turns an Error into a status
// code plus the thread's last-error text, and any exception (bad_alloc,
// anything thrown below) into EMBER_E_INTERNAL with its what().
//
// Ownership model. An ember_worker owns the ember::Worker and, in two
// registries under its mutex, every pool buffer handed out (keyed by data
// pointer, so ember_free can refuse a pointer it does not know instead of
// corrupting the pool) and every open pipeline. ember_worker_destroy releases
// both before the Worker (TensorBuffer and Pipeline must not outlive it). An
// ember_request holds only an ember::Handle (a shared reference to the
// operation's state), so it may outlive its worker.
#include "capi/ember.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/base/error.h"
#include "common/base/logging.h"
#include "worker/handle.h"
#include "worker/worker.h"

// ---------------------------------------------------------------------------
// The codes are ember::ErrorCode's numbers (the ABI promises it).

#define EMBER_CAPI_SAME_CODE(c_name, cpp_name) \
  static_assert(static_cast<int>(c_name) == static_cast<int>(ember::ErrorCode::cpp_name), #c_name)
EMBER_CAPI_SAME_CODE(EMBER_OK, kOk);
EMBER_CAPI_SAME_CODE(EMBER_E_INVALID_ARGUMENT, kInvalidArgument);
EMBER_CAPI_SAME_CODE(EMBER_E_CONFIG, kConfig);
EMBER_CAPI_SAME_CODE(EMBER_E_POOL_EXHAUSTED, kPoolExhausted);
EMBER_CAPI_SAME_CODE(EMBER_E_TOO_LARGE, kTooLarge);
EMBER_CAPI_SAME_CODE(EMBER_E_MALFORMED_FRAME, kMalformedFrame);
EMBER_CAPI_SAME_CODE(EMBER_E_CHECKSUM_MISMATCH, kChecksumMismatch);
EMBER_CAPI_SAME_CODE(EMBER_E_IO, kIo);
EMBER_CAPI_SAME_CODE(EMBER_E_CLOSED, kClosed);
EMBER_CAPI_SAME_CODE(EMBER_E_TIMEOUT, kTimeout);
EMBER_CAPI_SAME_CODE(EMBER_E_NOT_FOUND, kNotFound);
EMBER_CAPI_SAME_CODE(EMBER_E_SHAPE_MISMATCH, kShapeMismatch);
EMBER_CAPI_SAME_CODE(EMBER_E_PROTOCOL, kProtocol);
EMBER_CAPI_SAME_CODE(EMBER_E_AUTH, kAuth);
EMBER_CAPI_SAME_CODE(EMBER_E_VERSION_MISMATCH, kVersionMismatch);
EMBER_CAPI_SAME_CODE(EMBER_E_UNAVAILABLE, kUnavailable);
EMBER_CAPI_SAME_CODE(EMBER_E_WORKER_LOST, kWorkerLost);
EMBER_CAPI_SAME_CODE(EMBER_E_STALE, kStale);
EMBER_CAPI_SAME_CODE(EMBER_E_CANCELLED, kCancelled);
EMBER_CAPI_SAME_CODE(EMBER_E_INTERNAL, kInternal);
EMBER_CAPI_SAME_CODE(EMBER_E_CORRUPT, kCorrupt);
EMBER_CAPI_SAME_CODE(EMBER_E_OUT_OF_STEP, kOutOfStep);
static_assert(EMBER_E_OUT_OF_STEP == static_cast<int>(ember::kLastErrorCode),
              "ember.h lacks the newest ErrorCode");
#undef EMBER_CAPI_SAME_CODE
namespace {

using ember::Error;
using ember::ErrorCode;
using ember::Result;
using ember::Status;

constexpr std::uint64_t kWorkerTag = 0x454d4245525f574bull;    // "EMBER_WK"
constexpr std::uint64_t kRequestTag = 0x454d4245525f5251ull;   // "EMBER_RQ"
constexpr std::uint64_t kPipelineTag = 0x454d4245525f504cull;  // "EMBER_PL"
constexpr std::uint64_t kDeadTag = 0xdeaddeaddeaddeadull;

// This thread's last status and text (see ember_last_error).
struct LastError {
  int code = EMBER_OK;
  std::string text;
};
LastError& last_error() {
  thread_local LastError e;
  return e;
}

int set_error(const Error& e) noexcept {
  LastError& le = last_error();
  le.code = static_cast<int>(e.code());
  try {
    le.text = e.to_string();
  } catch (...) {
    le.text.clear();  // out of memory building the text: the code stands alone
  }
  return le.code;
}

int set_ok() noexcept {
  LastError& le = last_error();
  le.code = EMBER_OK;
  le.text.clear();
  return EMBER_OK;
}

int set_internal(const char* function, const char* what) noexcept {
  LastError& le = last_error();
  le.code = EMBER_E_INTERNAL;
  try {
    le.text = fmt::format("internal: {}: unexpected C++ exception: {}", function, what);
  } catch (...) {
    le.text.clear();
  }
  return le.code;
}

// Runs `body` (returning Status) as the body of C function `function`: the
// one place exceptions stop.
template <typename Body>
int guard(const char* function, Body&& body) noexcept {
  try {
    Status s = body();
    if (!s) {
      Error e = std::move(s).error();
      return set_error(e);
    }
    return set_ok();
  } catch (const std::bad_alloc&) {
    return set_internal(function, "out of memory (std::bad_alloc)");
  } catch (const std::exception& ex) {
    return set_internal(function, ex.what());
  } catch (...) {
    return set_internal(function, "unknown exception");
  }
}

tl::unexpected<Error> invalid(const char* function, std::string_view what) {
  return ember::make_error(ErrorCode::kInvalidArgument, "{}: {}", function, what);
}

}  // namespace

// ---------------------------------------------------------------------------
// Handle types (declared opaque in ember.h).

struct ember_pipeline {
  std::uint64_t tag = kPipelineTag;
  ember_worker* owner = nullptr;
  ember::Pipeline pipeline;
  explicit ember_pipeline(ember_worker* w, ember::Pipeline p) : owner(w), pipeline(std::move(p)) {}
};

struct ember_worker {
  std::uint64_t tag = kWorkerTag;
  std::unique_ptr<ember::Worker> worker;
  // A buffer from ember_alloc, and the asynchronous requests started with a
  // pointer into it: ember_free refuses while one runs. Done requests are
  // pruned when `users` has doubled since the last pruning (amortised O(1)
  // per request: a step issuing N requests into one buffer must not check
  // N^2 handles) and at ember_free.
  struct Live {
    ember::TensorBuffer buffer;
    std::vector<ember::Handle> users;
    std::size_t prune_at = kMinPruneAt;
  };
  static constexpr std::size_t kMinPruneAt = 16;
  mutable std::mutex mutex;  // guards buffers and pipelines
  std::map<const void*, Live> buffers;  // by start address
  std::atomic<std::size_t> num_buffers{0};  // buffers.size(), read without the mutex
  std::unordered_set<ember_pipeline*> pipelines;

  // The live buffer that holds `p`, or null. pre: mutex held.
  Live* holding(const void* p) {
    auto it = buffers.upper_bound(p);
    if (it == buffers.begin()) return nullptr;
    --it;
    const auto start = reinterpret_cast<std::uintptr_t>(it->first);
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    return at - start < it->second.buffer.size_bytes() ? &it->second : nullptr;
  }
  // Records that `h` reads or writes the buffers holding `a` and `b` (either
  // may be null or outside every buffer) until it is done. Best effort: it
  // never throws (out of memory, the request goes unrecorded), and a
  // request started on one thread while another frees its buffer may not be
  // seen in time (ember.h: nothing may be about to use a freed buffer).
  void note_users(const ember::Handle& h, const void* a, const void* b) noexcept {
    if (num_buffers.load(std::memory_order_acquire) == 0 || h.ready()) return;
    try {
      std::lock_guard lock(mutex);
      Live* first = a != nullptr ? holding(a) : nullptr;
      Live* second = b != nullptr ? holding(b) : nullptr;
      if (second == first) second = nullptr;  // one buffer holds both
      for (Live* live : {first, second}) {
        if (live == nullptr) continue;
        if (live->users.size() >= live->prune_at) {
          std::erase_if(live->users, [](const ember::Handle& u) { return u.ready(); });
          live->prune_at = std::max(kMinPruneAt, 2 * live->users.size());
        }
        live->users.push_back(h);
      }
    } catch (...) {
    }
  }
};

struct ember_request {
  std::uint64_t tag = kRequestTag;
  ember::Handle handle;
};

namespace {

// The checks of a handle argument. A tag mismatch catches most uses of a
// destroyed handle (best effort; see ember.h).
Status check_worker(const char* function, const ember_worker* w) {
  if (w == nullptr) return invalid(function, "worker is NULL (create one with ember_worker_create)");
  if (w->tag != kWorkerTag) {
    return invalid(function, "worker is not a live ember_worker (destroyed or not from "
                             "ember_worker_create)");
  }
  return ember::ok_status();
}

Status check_request(const char* function, const ember_request* r) {
  if (r == nullptr) return invalid(function, "request is NULL");
  if (r->tag != kRequestTag) {
    return invalid(function, "request is not a live ember_request (freed or not from an "
                             "ember_*_async / ember_pipeline_* call)");
  }
  return ember::ok_status();
}

Status check_pipeline(const char* function, const ember_pipeline* p) {
  if (p == nullptr) return invalid(function, "pipeline is NULL (open one with ember_pipeline_create)");
  if (p->tag != kPipelineTag) {
    return invalid(function, "pipeline is not a live ember_pipeline (destroyed or not from "
                             "ember_pipeline_create)");
  }
  return ember::ok_status();
}

// A tensor argument: NULL with a non-zero count is refused here (the Worker
// checks the count against the key's element count).
Status check_tensor(const char* function, const char* name, const void* data,
                    std::size_t num_elements) {
  if (data == nullptr && num_elements != 0) {
    return invalid(function, fmt::format("{} is NULL but num_elements is {}", name, num_elements));
  }
  if (num_elements > std::numeric_limits<std::size_t>::max() / sizeof(float)) {
    return invalid(function, fmt::format("num_elements {} overflows a byte count", num_elements));
  }
  return ember::ok_status();
}

std::span<const float> in_span(const float* p, std::size_t n) {
  return p == nullptr ? std::span<const float>() : std::span<const float>(p, n);
}
std::span<float> out_span(float* p, std::size_t n) {
  return p == nullptr ? std::span<float>() : std::span<float>(p, n);
}

// Waits for a Handle (bounded by request_timeout) and stores its step.
Status finish(const ember::Handle& h, std::uint64_t* out_step) {
  Result<std::uint64_t> r = h.wait();
  if (!r) return tl::unexpected(std::move(r).error());
  if (out_step != nullptr) *out_step = *r;
  return ember::ok_status();
}

enum class Op { kPush, kPull, kPushPull };

const char* op_name(Op op, bool async) {
  switch (op) {
    case Op::kPush: return async ? "ember_push_async" : "ember_push";
    case Op::kPull: return async ? "ember_pull_async" : "ember_pull";
    case Op::kPushPull: return async ? "ember_push_pull_async" : "ember_push_pull";
  }
  return "ember_?";
}

// The buffers an operation uses must not be NULL (the Worker checks the
// count against the key's element count).
Status check_op_buffers(const char* fn, Op op, const float* gradient, const float* out,
                        std::size_t n) {
  if (op != Op::kPull && gradient == nullptr) return invalid(fn, "gradient is NULL");
  if (op != Op::kPush && out == nullptr) return invalid(fn, "out is NULL");
  if (n > std::numeric_limits<std::size_t>::max() / sizeof(float)) {
    return invalid(fn, fmt::format("num_elements {} overflows a byte count", n));
  }
  return ember::ok_status();
}

ember::Handle start(ember::Worker& w, Op op, std::uint64_t key, const float* gradient, float* out,
                    std::size_t n) {
  switch (op) {
    case Op::kPush: return w.push(key, in_span(gradient, n));
    case Op::kPull: return w.pull(key, out_span(out, n));
    case Op::kPushPull: return w.push_pull(key, in_span(gradient, n), out_span(out, n));
  }
  return ember::Handle::failed(Error(ErrorCode::kInternal, "unknown operation"));
}

ember::Handle enqueue(ember::Pipeline& p, Op op, std::uint64_t key, const float* gradient,
                      float* out, std::size_t n) {
  switch (op) {
    case Op::kPush: return p.enqueue(key, in_span(gradient, n));
    case Op::kPull: return p.enqueue_pull(key, out_span(out, n));
    case Op::kPushPull: return p.enqueue_push_pull(key, in_span(gradient, n), out_span(out, n));
  }
  return ember::Handle::failed(Error(ErrorCode::kInternal, "unknown operation"));
}

int tensor_op(Op op, ember_worker* w, std::uint64_t key, const float* gradient, float* out,
              std::size_t n, std::uint64_t* out_step) {
  const char* fn = op_name(op, false);
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, w));
    EMBER_TRY(check_op_buffers(fn, op, gradient, out, n));
    return finish(start(*w->worker, op, key, gradient, out, n), out_step);
  });
}

int tensor_op_async(Op op, ember_worker* w, std::uint64_t key, const float* gradient, float* out,
                    std::size_t n, ember_request** out_request) {
  const char* fn = op_name(op, true);
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, w));
    if (out_request == nullptr) return invalid(fn, "out_request is NULL (it is required)");
    EMBER_TRY(check_op_buffers(fn, op, gradient, out, n));
    // Allocate the request first: once started, the operation must be
    // reachable by the caller (a bad_alloc after starting would orphan it).
    auto r = std::make_unique<ember_request>();
    r->handle = start(*w->worker, op, key, gradient, out, n);
    w->note_users(r->handle, gradient, out);
    *out_request = r.release();
    return ember::ok_status();
  });
}

int pipeline_op(Op op, ember_pipeline* p, std::uint64_t key, const float* gradient, float* out,
                std::size_t n, ember_request** out_request) {
  const char* fn = op == Op::kPush   ? "ember_pipeline_push"
                   : op == Op::kPull ? "ember_pipeline_pull"
                                     : "ember_pipeline_push_pull";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_pipeline(fn, p));
    EMBER_TRY(check_op_buffers(fn, op, gradient, out, n));
    std::unique_ptr<ember_request> r;
    if (out_request != nullptr) r = std::make_unique<ember_request>();
    ember::Handle h = enqueue(p->pipeline, op, key, gradient, out, n);
    p->owner->note_users(h, gradient, out);
    if (r) {
      r->handle = std::move(h);
      *out_request = r.release();
    }
    return ember::ok_status();
  });
}

std::once_flag g_default_logging;
std::mutex g_logging_mutex;  // serializes spdlog default-logger replacement
bool g_logging_set = false;   // guarded by g_logging_mutex

}  // namespace

// ---------------------------------------------------------------------------
// Library information and errors.

extern "C" {

EMBER_API const char* ember_version(void) { return EMBER_CAPI_VERSION; }

EMBER_API int ember_abi_version(void) { return EMBER_ABI_VERSION; }

EMBER_API const char* ember_error_name(int code) {
  if (code == EMBER_PENDING) return "pending";
  if (code < 0 || code > EMBER_E_OUT_OF_STEP) return "unknown";
  // error_code_name returns views of string literals: NUL-terminated.
  return ember::error_code_name(static_cast<ErrorCode>(code)).data();
}

EMBER_API const char* ember_last_error(void) { return last_error().text.c_str(); }

EMBER_API int ember_last_error_code(void) { return last_error().code; }

EMBER_API int ember_set_log_level(const char* level) {
  return guard("ember_set_log_level", [&]() -> Status {
    if (level == nullptr) return invalid("ember_set_log_level", "level is NULL");
    static constexpr const char* kLevels[] = {"trace", "debug", "info",    "warn",
                                              "error", "critical", "off"};
    bool known = false;
    for (const char* l : kLevels) known = known || std::strcmp(l, level) == 0;
    if (!known) {
      return invalid("ember_set_log_level",
                     fmt::format("unknown level '{}'; use trace, debug, info, warn, error, "
                                 "critical or off",
                                 level));
    }
    std::lock_guard lock(g_logging_mutex);
    ember::log::init_program_logging(level);
    g_logging_set = true;
    return ember::ok_status();
  });
}

// ---------------------------------------------------------------------------
// Worker lifetime.

EMBER_API int ember_worker_create(const char* config_path, int64_t rank,
                                  const char* const* overrides, size_t num_overrides,
                                  ember_worker** out_worker) {
  constexpr const char* fn = "ember_worker_create";
  return guard(fn, [&]() -> Status {
    if (out_worker == nullptr) return invalid(fn, "out_worker is NULL (it is required)");
    if (config_path == nullptr) {
      return invalid(fn, "config_path is NULL; pass the path of the job's TOML config "
                         "(e.g. config/ember.toml)");
    }
    if (overrides == nullptr && num_overrides > 0) {
      return invalid(fn, fmt::format("overrides is NULL but num_overrides is {}", num_overrides));
    }
    if (rank < EMBER_RANK_FROM_CONFIG || rank > std::numeric_limits<std::uint32_t>::max()) {
      return invalid(fn, fmt::format("rank {} is out of range (0 .. 2^32-1, or "
                                     "EMBER_RANK_FROM_CONFIG = -1)",
                                     rank));
    }
    std::vector<std::string> sets;
    sets.reserve(num_overrides + 1);
    for (std::size_t i = 0; i < num_overrides; ++i) {
      if (overrides[i] == nullptr) return invalid(fn, fmt::format("overrides[{}] is NULL", i));
      sets.emplace_back(overrides[i]);
    }
    {
      std::lock_guard lock(g_logging_mutex);
      std::call_once(g_default_logging, [] {
        // A library must not print info lines on a host program's stdout
        // (spdlog's built-in default logger, unnamed, on stdout): stderr,
        // warnings and worse — unless the caller chose a level first, or the
        // host program installed its own default logger (libspdlog is shared,
        // so its registry is the whole process's).
        if (!g_logging_set && spdlog::default_logger()->name().empty()) {
          ember::log::init_program_logging("warn");
        }
      });
    }
    // The rank is set after the overrides, so it wins over one of
    // worker.rank; the whole is validated once, then, so the rank may be
    // what makes the overrides valid (or not: the message names both).
    EMBER_ASSIGN_OR_RETURN(ember::config::Config config, ember::config::load_config_file(config_path));
    EMBER_TRY(ember::config::set_values(config, sets));
    if (rank >= 0) ember::config::set_worker_rank(config, static_cast<std::uint32_t>(rank));
    EMBER_TRY(ember::config::validate(
        config, rank >= 0 ? fmt::format("overrides, with the rank argument {}", rank)
                          : std::string("overrides")));
    auto created = ember::Worker::create(config);
    if (!created) return tl::unexpected(std::move(created).error());
    auto w = std::make_unique<ember_worker>();
    w->worker = std::move(*created);
    *out_worker = w.release();
    return ember::ok_status();
  });
}

EMBER_API void ember_worker_destroy(ember_worker* worker) {
  if (worker == nullptr || worker->tag != kWorkerTag) return;
  try {
    worker->tag = kDeadTag;
    // Pipelines and buffers refer to the Worker: release them first.
    for (ember_pipeline* p : worker->pipelines) {
      p->tag = kDeadTag;
      delete p;  // flushes what is queued
    }
    worker->pipelines.clear();
    worker->buffers.clear();
    worker->worker.reset();
  } catch (...) {
    // Destructors here are noexcept in practice; nothing to report to.
  }
  delete worker;
}

EMBER_API int ember_worker_info(const ember_worker* worker, uint32_t* out_rank,
                                uint32_t* out_num_workers, uint32_t* out_num_servers) {
  return guard("ember_worker_info", [&]() -> Status {
    EMBER_TRY(check_worker("ember_worker_info", worker));
    if (out_rank != nullptr) *out_rank = worker->worker->rank();
    if (out_num_workers != nullptr) *out_num_workers = worker->worker->num_workers();
    if (out_num_servers != nullptr) *out_num_servers = worker->worker->num_servers();
    return ember::ok_status();
  });
}

EMBER_API int ember_step(const ember_worker* worker, uint64_t key, uint64_t* out_step) {
  return guard("ember_step", [&]() -> Status {
    EMBER_TRY(check_worker("ember_step", worker));
    if (out_step == nullptr) return invalid("ember_step", "out_step is NULL (it is required)");
    *out_step = worker->worker->step(key);
    return ember::ok_status();
  });
}

// ---------------------------------------------------------------------------
// Pool buffers.

EMBER_API int ember_alloc(ember_worker* worker, size_t bytes, void** out_data) {
  constexpr const char* fn = "ember_alloc";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (out_data == nullptr) return invalid(fn, "out_data is NULL (it is required)");
    if (bytes == 0) return invalid(fn, "bytes is 0; ask for at least one byte");
    // Worker::allocate rounds heap requests up to 4 KiB: a size near
    // SIZE_MAX would wrap. Nothing that large can exist anyway.
    if (bytes > static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max()) - 4096) {
      return ember::make_error(ErrorCode::kTooLarge, "{}: {} bytes cannot be allocated", fn, bytes);
    }
    ember::TensorBuffer b;
    try {
      b = worker->worker->allocate(bytes);
    } catch (const std::bad_alloc&) {
      return ember::make_error(ErrorCode::kTooLarge,
                               "{}: {} bytes: neither the page pool nor the heap has them "
                               "(pool: [communication] prealloc_pages)",
                               fn, bytes);
    }
    void* data = b.bytes().data();
    std::lock_guard lock(worker->mutex);
    worker->buffers.emplace(data, ember_worker::Live{std::move(b), {}});
    worker->num_buffers.store(worker->buffers.size(), std::memory_order_release);
    *out_data = data;
    return ember::ok_status();
  });
}

EMBER_API int ember_free(ember_worker* worker, void* data) {
  constexpr const char* fn = "ember_free";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (data == nullptr) return ember::ok_status();
    ember::TensorBuffer doomed;  // released after the lock is dropped
    {
      std::lock_guard lock(worker->mutex);
      auto it = worker->buffers.find(data);
      if (it == worker->buffers.end()) {
        return invalid(fn, fmt::format("{} is not a live buffer of this worker (freed twice, "
                                       "from another worker, or not the start of a buffer); "
                                       "nothing was freed",
                                       data));
      }
      std::erase_if(it->second.users, [](const ember::Handle& u) { return u.ready(); });
      if (!it->second.users.empty()) {
        return invalid(fn, fmt::format("{} is still used by {} running request(s) (an "
                                       "ember_*_async or pipeline operation given a pointer "
                                       "into it); wait for them first (ember_wait; a pipelined "
                                       "one: ember_pipeline_wait, or ember_pipeline_flush then "
                                       "ember_wait); nothing was freed",
                                       data, it->second.users.size()));
      }
      doomed = std::move(it->second.buffer);
      worker->buffers.erase(it);
      worker->num_buffers.store(worker->buffers.size(), std::memory_order_release);
    }
    return ember::ok_status();
  });
}

EMBER_API int ember_buffer_info(const ember_worker* worker, const void* data, size_t* out_bytes,
                                int* out_in_pool) {
  constexpr const char* fn = "ember_buffer_info";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (data == nullptr) return invalid(fn, "data is NULL");
    std::lock_guard lock(worker->mutex);
    auto it = worker->buffers.find(data);
    if (it == worker->buffers.end()) {
      return ember::make_error(ErrorCode::kNotFound,
                               "{}: {} is not the start of a live buffer of this worker", fn, data);
    }
    if (out_bytes != nullptr) *out_bytes = it->second.buffer.size_bytes();
    if (out_in_pool != nullptr) *out_in_pool = it->second.buffer.in_pool() ? 1 : 0;
    return ember::ok_status();
  });
}

// ---------------------------------------------------------------------------
// Tensors.

EMBER_API int ember_init(ember_worker* worker, uint64_t key, const uint64_t* shape, size_t ndim,
                         const float* values, size_t num_values, uint64_t* out_step) {
  constexpr const char* fn = "ember_init";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (shape == nullptr && ndim > 0) {
      return invalid(fn, fmt::format("shape is NULL but ndim is {}", ndim));
    }
    EMBER_TRY(check_tensor(fn, "values", values, num_values));
    const std::span<const std::uint64_t> dims =
        shape == nullptr ? std::span<const std::uint64_t>() : std::span(shape, ndim);
    return finish(worker->worker->init(key, dims, in_span(values, num_values)), out_step);
  });
}

EMBER_API int ember_push(ember_worker* worker, uint64_t key, const float* gradient,
                         size_t num_elements, uint64_t* out_step) {
  return tensor_op(Op::kPush, worker, key, gradient, nullptr, num_elements, out_step);
}

EMBER_API int ember_pull(ember_worker* worker, uint64_t key, float* out, size_t num_elements,
                         uint64_t* out_step) {
  return tensor_op(Op::kPull, worker, key, nullptr, out, num_elements, out_step);
}

EMBER_API int ember_push_pull(ember_worker* worker, uint64_t key, const float* gradient,
                              float* out, size_t num_elements, uint64_t* out_step) {
  return tensor_op(Op::kPushPull, worker, key, gradient, out, num_elements, out_step);
}

EMBER_API int ember_push_async(ember_worker* worker, uint64_t key, const float* gradient,
                               size_t num_elements, ember_request** out_request) {
  return tensor_op_async(Op::kPush, worker, key, gradient, nullptr, num_elements, out_request);
}

EMBER_API int ember_pull_async(ember_worker* worker, uint64_t key, float* out,
                               size_t num_elements, ember_request** out_request) {
  return tensor_op_async(Op::kPull, worker, key, nullptr, out, num_elements, out_request);
}

EMBER_API int ember_push_pull_async(ember_worker* worker, uint64_t key, const float* gradient,
                                    float* out, size_t num_elements,
                                    ember_request** out_request) {
  return tensor_op_async(Op::kPushPull, worker, key, gradient, out, num_elements, out_request);
}

EMBER_API int ember_barrier(ember_worker* worker, uint64_t* out_generation) {
  return guard("ember_barrier", [&]() -> Status {
    EMBER_TRY(check_worker("ember_barrier", worker));
    return finish(worker->worker->barrier(), out_generation);
  });
}

EMBER_API int ember_set_learning_rate(ember_worker* worker, double learning_rate) {
  constexpr const char* fn = "ember_set_learning_rate";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (!std::isfinite(learning_rate) || learning_rate <= 0.0) {
      return invalid(fn, fmt::format("learning_rate must be > 0 and finite (got {})",
                                     learning_rate));
    }
    return finish(worker->worker->set_learning_rate(learning_rate), nullptr);
  });
}

EMBER_API int ember_checkpoint(ember_worker* worker, uint64_t* out_sequence) {
  return guard("ember_checkpoint", [&]() -> Status {
    EMBER_TRY(check_worker("ember_checkpoint", worker));
    return finish(worker->worker->checkpoint(), out_sequence);
  });
}

// ---------------------------------------------------------------------------
// Requests.

EMBER_API int ember_wait(ember_request* request, int64_t timeout_ms, uint64_t* out_step) {
  constexpr const char* fn = "ember_wait";
  int pending = 0;
  const int rc = guard(fn, [&]() -> Status {
    EMBER_TRY(check_request(fn, request));
    if (timeout_ms < EMBER_WAIT_FOREVER) {
      return invalid(fn, fmt::format("timeout_ms {} is negative (use EMBER_WAIT_FOREVER = -1 "
                                     "to wait until done)",
                                     timeout_ms));
    }
    const ember::Handle& h = request->handle;
    // Milliseconds past a year would overflow as nanoseconds (INT64_MAX is
    // a common "forever"); wait_for waits like wait() from a year on.
    const auto timeout = std::chrono::milliseconds(timeout_ms);
    Result<std::uint64_t> r =
        timeout_ms == EMBER_WAIT_FOREVER || timeout >= ember::Handle::kWaitAsLongAsAnyRequest
            ? h.wait()
            : h.wait_for(timeout);
    if (!r && r.error().code() == ErrorCode::kTimeout && timeout_ms != EMBER_WAIT_FOREVER) {
      // wait_for's kTimeout means either "still running" or "the operation
      // itself timed out": ready() tells them apart; a request that finished
      // just now is read again (done: returns at once).
      if (!h.ready()) {
        pending = 1;
        return ember::ok_status();
      }
      r = h.wait();
    }
    if (!r) return tl::unexpected(std::move(r).error());
    if (out_step != nullptr) *out_step = *r;
    return ember::ok_status();
  });
  if (rc == EMBER_OK && pending != 0) {
    last_error().code = EMBER_PENDING;
    return EMBER_PENDING;
  }
  return rc;
}

EMBER_API void ember_request_free(ember_request* request) {
  if (request == nullptr || request->tag != kRequestTag) return;
  request->tag = kDeadTag;
  delete request;
}

// ---------------------------------------------------------------------------
// Pipelines.

EMBER_API int ember_pipeline_create(ember_worker* worker, ember_pipeline** out_pipeline) {
  constexpr const char* fn = "ember_pipeline_create";
  return guard(fn, [&]() -> Status {
    EMBER_TRY(check_worker(fn, worker));
    if (out_pipeline == nullptr) return invalid(fn, "out_pipeline is NULL (it is required)");
    auto p = std::make_unique<ember_pipeline>(worker, worker->worker->pipeline());
    std::lock_guard lock(worker->mutex);
    worker->pipelines.insert(p.get());
    *out_pipeline = p.release();
    return ember::ok_status();
  });
}

EMBER_API int ember_pipeline_push(ember_pipeline* pipeline, uint64_t key, const float* gradient,
                                  size_t num_elements, ember_request** out_request) {
  return pipeline_op(Op::kPush, pipeline, key, gradient, nullptr, num_elements, out_request);
}

EMBER_API int ember_pipeline_pull(ember_pipeline* pipeline, uint64_t key, float* out,
                                  size_t num_elements, ember_request** out_request) {
  return pipeline_op(Op::kPull, pipeline, key, nullptr, out, num_elements, out_request);
}

EMBER_API int ember_pipeline_push_pull(ember_pipeline* pipeline, uint64_t key,
                                       const float* gradient, float* out, size_t num_elements,
                                       ember_request** out_request) {
  return pipeline_op(Op::kPushPull, pipeline, key, gradient, out, num_elements, out_request);
}

EMBER_API int ember_pipeline_flush(ember_pipeline* pipeline) {
  return guard("ember_pipeline_flush", [&]() -> Status {
    EMBER_TRY(check_pipeline("ember_pipeline_flush", pipeline));
    return pipeline->pipeline.flush();
  });
}

EMBER_API int ember_pipeline_wait(ember_pipeline* pipeline) {
  return guard("ember_pipeline_wait", [&]() -> Status {
    EMBER_TRY(check_pipeline("ember_pipeline_wait", pipeline));
    return pipeline->pipeline.wait();
  });
}

EMBER_API void ember_pipeline_destroy(ember_pipeline* pipeline) {
  if (pipeline == nullptr || pipeline->tag != kPipelineTag) return;
  try {
    ember_worker* w = pipeline->owner;
    {
      std::lock_guard lock(w->mutex);
      w->pipelines.erase(pipeline);
    }
    pipeline->tag = kDeadTag;
    delete pipeline;  // ~Pipeline flushes
  } catch (...) {
    // Locking a mutex can throw std::system_error only on a broken mutex.
  }
}

}  // extern "C"
