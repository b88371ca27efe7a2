// Error values for failures that happen in production (see STYLE.md, Errors).
//
// Every fallible call in Ember returns Result<T> = tl::expected<T, Error>.
// An Error carries a stable numeric code (part of the C ABI: never renumber),
// the errno observed where the failure happened (0 when none), and a message
// built on the cold path that names the thing that failed and what to do.
// Bugs are not Errors: they abort through EMBER_CHECK (common/base/check.h).
//
// Thread-safety: Error and Result are plain values; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <tl/expected.hpp>

namespace ember {

// Stable error codes. Values are part of the wire protocol and the C ABI
// (ember.h mirrors them as EMBER_E_*): append only, never renumber.
enum class ErrorCode : std::uint16_t {
  kOk = 0,
  kInvalidArgument = 1,   // a caller-supplied value is out of range or malformed
  kConfig = 2,            // a configuration file or value is invalid
  kPoolExhausted = 3,     // the page pool has no block of the requested class
  kTooLarge = 4,          // a request exceeds a configured or structural maximum
  kMalformedFrame = 5,    // a frame failed a structural check
  kChecksumMismatch = 6,  // a frame's CRC32C does not match its bytes
  kIo = 7,                // a system call failed (see sys_errno)
  kClosed = 8,            // the peer or the object is closed
  kTimeout = 9,           // a deadline passed
  kNotFound = 10,         // an unknown key, file or peer
  kShapeMismatch = 11,    // a tensor's shape or dtype differs from the registered one
  kProtocol = 12,         // the peer broke the protocol (unexpected message)
  kAuth = 13,             // handshake authentication failed
  kVersionMismatch = 14,  // protocol version differs between peers
  kUnavailable = 15,      // a resource or device is not present (RDMA, GPU)
  kWorkerLost = 16,       // a worker vanished: loss policy "fail", or "wait" past worker_timeout
  kStale = 17,            // a push for a step that is already over
  kCancelled = 18,        // the operation was cancelled by shutdown
  kInternal = 19,         // an invariant failed in a way that is reported, not aborted
  kCorrupt = 20,          // stored data (checkpoint) failed validation
  kOutOfStep = 21,        // a request's step does not follow the server's: the server
                          // restarted from an older checkpoint or the worker lost track;
                          // the error reply's step is the step the server expects
};

// The highest code in use (decoders refuse a status above it).
inline constexpr ErrorCode kLastErrorCode = ErrorCode::kOutOfStep;

// Short stable name of a code, e.g. "pool_exhausted".
std::string_view error_code_name(ErrorCode code) noexcept;

class Error {
 public:
  Error() = default;
  Error(ErrorCode code, std::string message, int sys_errno = 0)
      : code_(code), sys_errno_(sys_errno), message_(std::move(message)) {}

  ErrorCode code() const noexcept { return code_; }
  // errno captured where the failure happened; 0 when not a system error.
  int sys_errno() const noexcept { return sys_errno_; }
  const std::string& message() const noexcept { return message_; }

  // "<code name>: <message>[: <strerror> (errno N)]"
  std::string to_string() const;
  // The system error's part of to_string(): ": <strerror> (errno N)", or ""
  // when sys_errno() is 0. (Error replies carry it in their text.)
  std::string cause() const;

  // Prefixes context to the message ("while X: <old message>"), keeping the
  // code and errno: the caller adds what it was doing, the callee said why.
  Error& with_context(std::string_view context);

 private:
  ErrorCode code_ = ErrorCode::kOk;
  int sys_errno_ = 0;
  std::string message_;
};

template <typename T>
using Result = tl::expected<T, Error>;
using Status = tl::expected<void, Error>;

// Builds an unexpected Error with a fmt-formatted message (cold path).
template <typename... Args>
[[nodiscard]] tl::unexpected<Error> make_error(ErrorCode code, fmt::format_string<Args...> format,
                                               Args&&... args) {
  return tl::unexpected<Error>(Error(code, fmt::format(format, std::forward<Args>(args)...)));
}

// Same, for a failed system call: captures `err` (pass errno) and names it.
template <typename... Args>
[[nodiscard]] tl::unexpected<Error> make_sys_error(int err, fmt::format_string<Args...> format,
                                                   Args&&... args) {
  return tl::unexpected<Error>(
      Error(ErrorCode::kIo, fmt::format(format, std::forward<Args>(args)...), err));
}

inline Status ok_status() { return {}; }

}  // namespace ember

template <>
struct fmt::formatter<ember::Error> : fmt::formatter<std::string> {
  template <typename FormatContext>
  auto format(const ember::Error& e, FormatContext& ctx) const {
    return fmt::formatter<std::string>::format(e.to_string(), ctx);
  }
};

#define EMBER_INTERNAL_CONCAT2(a, b) a##b
#define EMBER_INTERNAL_CONCAT(a, b) EMBER_INTERNAL_CONCAT2(a, b)

// EMBER_TRY(expr): evaluates a Result/Status; returns its error from the
// enclosing function (which must return a Result or Status) on failure.
#define EMBER_TRY(expr)                                              \
  do {                                                               \
    auto&& ember_try_result_ = (expr);                               \
    if (!ember_try_result_) {                                        \
      return ::tl::unexpected<::ember::Error>(                       \
          std::move(ember_try_result_).error());                     \
    }                                                                \
  } while (0)

// EMBER_ASSIGN_OR_RETURN(lhs, expr): `lhs = *expr` or return its error.
// lhs may be a declaration: EMBER_ASSIGN_OR_RETURN(auto pool, PagePool::create(o));
#define EMBER_ASSIGN_OR_RETURN(lhs, expr)                                          \
  EMBER_INTERNAL_ASSIGN_OR_RETURN(EMBER_INTERNAL_CONCAT(ember_aor_, __LINE__), lhs, expr)
#define EMBER_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr)                            \
  auto tmp = (expr);                                                               \
  if (!tmp) return ::tl::unexpected<::ember::Error>(std::move(tmp).error());      \
  lhs = std::move(*tmp)
