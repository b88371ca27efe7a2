// Checks for bugs (not for failures: those are Error values, see error.h).
//
// EMBER_CHECK(cond) aborts with file:line and the condition when cond is
// false, in every build. EMBER_CHECK_MSG(cond, fmt, args...) adds values.
// EMBER_DCHECK* are the same in debug builds and compile to nothing (the
// condition is not evaluated) under NDEBUG. No side effects inside checks.
#pragma once

#include <string>

#include <fmt/format.h>

namespace ember::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* condition,
                               const std::string& message);
}  // namespace ember::detail

#define EMBER_CHECK(cond)                                                         \
  do {                                                                            \
    if (__builtin_expect(!(cond), 0))                                             \
      ::ember::detail::check_failed(__FILE__, __LINE__, #cond, std::string());    \
  } while (0)

#define EMBER_CHECK_MSG(cond, ...)                                                \
  do {                                                                            \
    if (__builtin_expect(!(cond), 0))                                             \
      ::ember::detail::check_failed(__FILE__, __LINE__, #cond,                    \
                                    ::fmt::format(__VA_ARGS__));                  \
  } while (0)

#ifdef NDEBUG
#define EMBER_DCHECK(cond) \
  do {                     \
  } while (0)
#define EMBER_DCHECK_MSG(cond, ...) \
  do {                              \
  } while (0)
#else
#define EMBER_DCHECK(cond) EMBER_CHECK(cond)
#define EMBER_DCHECK_MSG(cond, ...) EMBER_CHECK_MSG(cond, __VA_ARGS__)
#endif
