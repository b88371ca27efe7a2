// Names and formatting of Error values (cold path only).
#include "common/base/error.h"

#include <cstring>

namespace ember {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kConfig: return "config";
    case ErrorCode::kPoolExhausted: return "pool_exhausted";
    case ErrorCode::kTooLarge: return "too_large";
    case ErrorCode::kMalformedFrame: return "malformed_frame";
    case ErrorCode::kChecksumMismatch: return "checksum_mismatch";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kClosed: return "closed";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kShapeMismatch: return "shape_mismatch";
    case ErrorCode::kProtocol: return "protocol";
    case ErrorCode::kAuth: return "auth";
    case ErrorCode::kVersionMismatch: return "version_mismatch";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kWorkerLost: return "worker_lost";
    case ErrorCode::kStale: return "stale";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kInternal: return "internal";
    case ErrorCode::kCorrupt: return "corrupt";
    case ErrorCode::kOutOfStep: return "out_of_step";
  }
  return "unknown";
}

std::string Error::cause() const {
  if (sys_errno_ == 0) return {};
  char buf[128];
  // GNU strerror_r returns the message pointer (may not use buf).
  const char* text = ::strerror_r(sys_errno_, buf, sizeof buf);
  return fmt::format(": {} (errno {})", text, sys_errno_);
}

std::string Error::to_string() const {
  return fmt::format("{}: {}{}", error_code_name(code_), message_, cause());
}

Error& Error::with_context(std::string_view context) {
  message_ = fmt::format("{}: {}", context, message_);
  return *this;
}

}  // namespace ember
