// Parsing of sizes and durations with units, as written in TOML config files
// and on command lines.
//
// Sizes: a non-negative integer or decimal followed by an optional unit.
//   (none) or "B" = bytes; "K"/"KB"/"KiB" = 1024; "M"/"MB"/"MiB" = 1024^2;
//   "G"/"GB"/"GiB" = 1024^3; "T"/"TB"/"TiB" = 1024^4. Units are
//   case-insensitive; spaces between number and unit are allowed. Decimal
//   units are binary on purpose: "4KB" in a buffer setting means one 4096-byte
//   page to every systems engineer who writes it (as in nginx and Redis).
//   A fractional value must come out as a whole number of bytes ("1.5KB" is
//   1536, "0.3B" is an error).
// Durations: a number followed by "ns", "us", "ms", "s", "m" or "h"
//   ("50us", "1.5s"; spaces between number and unit are allowed, as for
//   sizes: "10 ms"; units are case-insensitive, and "m" is minutes). A bare
//   number is an error: the unit is required.
//
// Errors: ErrorCode::kInvalidArgument naming the text and what was expected;
// ErrorCode::kTooLarge when the value overflows 64 bits.
// Thread-safety: pure functions. No allocation except for error messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/error.h"

namespace ember {

[[nodiscard]] Result<std::uint64_t> parse_size_bytes(std::string_view text);
[[nodiscard]] Result<std::chrono::nanoseconds> parse_duration(std::string_view text);

// Human form of a byte count: "4 KiB", "1.5 MiB", "123 B".
std::string format_bytes(std::uint64_t bytes);

// A duration in the spelling parse_duration reads back, with the largest
// unit that divides it exactly: "20us", "1s", "2m", "0s", "1500ns".
std::string duration_text(std::chrono::nanoseconds d);

}  // namespace ember
