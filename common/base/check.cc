// Abort path of EMBER_CHECK: print file:line, the condition and values to
// stderr (not through spdlog: the logger may be the thing that is broken).
#include "common/base/check.h"

#include <cstdio>
#include <cstdlib>

namespace ember::detail {

void check_failed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "EMBER_CHECK failed at %s:%d: %s%s%s\n", file, line, condition,
               message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace ember::detail
