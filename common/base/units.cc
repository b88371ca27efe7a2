// Size and duration parsing; see units.h for the grammar.
#include "common/base/units.h"

#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

namespace ember {
namespace {

struct Number {
  std::uint64_t whole = 0;
  std::uint64_t frac_num = 0;  // fractional digits as an integer
  std::uint64_t frac_den = 1;  // 10^digits
  std::string_view rest;       // unit text, trimmed
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

// `examples` completes the error message ("e.g. ..."), so a duration error
// shows durations and a size error shows sizes.
Result<Number> parse_number(std::string_view original, std::string_view what,
                            std::string_view examples) {
  std::string_view s = trim(original);
  Number n;
  std::size_t i = 0;
  bool any_digit = false;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    const std::uint64_t d = static_cast<std::uint64_t>(s[i] - '0');
    if (n.whole > (std::numeric_limits<std::uint64_t>::max() - d) / 10) {
      return make_error(ErrorCode::kTooLarge, "{} '{}' does not fit in 64 bits", what, original);
    }
    n.whole = n.whole * 10 + d;
    any_digit = true;
    ++i;
  }
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (n.frac_den < 1'000'000'000'000ULL) {  // keep 12 digits, ignore the rest
        n.frac_num = n.frac_num * 10 + static_cast<std::uint64_t>(s[i] - '0');
        n.frac_den *= 10;
      }
      any_digit = true;
      ++i;
    }
  }
  if (!any_digit) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} '{}' must start with a non-negative number (e.g. {})", what, original,
                      examples);
  }
  n.rest = trim(s.substr(i));
  return n;
}

// value * multiplier, exact, or an error if not whole / overflowing.
Result<std::uint64_t> scale(const Number& n, std::uint64_t multiplier, std::string_view original,
                            std::string_view what, std::string_view unit_name) {
  if (n.whole != 0 && multiplier > std::numeric_limits<std::uint64_t>::max() / n.whole) {
    return make_error(ErrorCode::kTooLarge, "{} '{}' does not fit in 64 bits", what, original);
  }
  std::uint64_t value = n.whole * multiplier;
  if (n.frac_num != 0) {
    // frac_num / frac_den * multiplier must be a whole number.
    __extension__ using u128 = unsigned __int128;
    const u128 prod = static_cast<u128>(n.frac_num) * multiplier;
    if (prod % n.frac_den != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{} '{}' is not a whole number of {}", what, original, unit_name);
    }
    const u128 add = prod / n.frac_den;
    if (add > std::numeric_limits<std::uint64_t>::max() - value) {
      return make_error(ErrorCode::kTooLarge, "{} '{}' does not fit in 64 bits", what, original);
    }
    value += static_cast<std::uint64_t>(add);
  }
  return value;
}

}  // namespace

Result<std::uint64_t> parse_size_bytes(std::string_view text) {
  EMBER_ASSIGN_OR_RETURN(const Number n, parse_number(text, "size", "'4KB', '1.5MiB'"));
  struct Unit {
    std::string_view names[3];
    std::uint64_t multiplier;
  };
  static constexpr Unit kUnits[] = {
      {{"", "b", "b"}, 1},
      {{"k", "kb", "kib"}, std::uint64_t{1} << 10},
      {{"m", "mb", "mib"}, std::uint64_t{1} << 20},
      {{"g", "gb", "gib"}, std::uint64_t{1} << 30},
      {{"t", "tb", "tib"}, std::uint64_t{1} << 40},
  };
  for (const Unit& u : kUnits) {
    for (std::string_view name : u.names) {
      if (iequals(n.rest, name)) return scale(n, u.multiplier, text, "size", "bytes");
    }
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "size '{}' has unknown unit '{}'; use B, KB, MB, GB or TB (binary: 1KB = 1024 "
                    "bytes), e.g. '4KB'",
                    text, n.rest);
}

Result<std::chrono::nanoseconds> parse_duration(std::string_view text) {
  EMBER_ASSIGN_OR_RETURN(const Number n, parse_number(text, "duration", "'50us', '1s'"));
  struct Unit {
    std::string_view name;
    std::uint64_t ns;
  };
  static constexpr Unit kUnits[] = {
      {"ns", 1},
      {"us", 1'000},
      {"ms", 1'000'000},
      {"s", 1'000'000'000},
      {"m", 60'000'000'000ULL},
      {"h", 3'600'000'000'000ULL},
  };
  if (n.rest.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "duration '{}' needs a unit: ns, us, ms, s, m or h (e.g. '50us')", text);
  }
  for (const Unit& u : kUnits) {
    if (iequals(n.rest, u.name)) {
      EMBER_ASSIGN_OR_RETURN(const std::uint64_t ns,
                             scale(n, u.ns, text, "duration", "nanoseconds"));
      if (ns > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return make_error(ErrorCode::kTooLarge, "duration '{}' is too long", text);
      }
      return std::chrono::nanoseconds(static_cast<std::int64_t>(ns));
    }
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "duration '{}' has unknown unit '{}'; use ns, us, ms, s, m or h", text, n.rest);
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  double value = static_cast<double>(bytes);
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  if (std::fabs(value - std::round(value)) < 1e-9) return fmt::format("{:.0f} {}", value, kNames[unit]);
  return fmt::format("{:.2f} {}", value, kNames[unit]);
}

std::string duration_text(std::chrono::nanoseconds d) {
  const std::int64_t ns = d.count();
  static constexpr std::pair<std::int64_t, std::string_view> kUnits[] = {
      {3'600'000'000'000, "h"}, {60'000'000'000, "m"}, {1'000'000'000, "s"},
      {1'000'000, "ms"},        {1'000, "us"}};
  if (ns == 0) return "0s";
  for (const auto& [mult, name] : kUnits) {
    if (ns % mult == 0) return fmt::format("{}{}", ns / mult, name);
  }
  return fmt::format("{}ns", ns);
}

}  // namespace ember
