// Internal to common/config: the schema, one row per TOML key.
//
// Every key of every table is described once here: how a TOML value becomes
// the C++ field (type, unit, enum spelling), which range it must lie in, how
// it prints back, and a one-line doc used by to_toml. The loader, validate(),
// to_toml() and the override helpers are all driven by this table, so adding
// a knob is adding one row in schema.cc (and a member in config.h).
//
// Problem texts returned by `set` and `check` are "<what is wrong>; <what to
// do>"; the caller prefixes "<file>:<line>: key '<table>.<key>': ".
//
// Thread-safety: the tables are built once (function-local statics) and are
// read-only afterwards.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <toml.hpp>

#include "common/config/config.h"

namespace ember::config::detail {

using Problem = std::optional<std::string>;

// How set_value() turns command-line text into a TOML value for this field.
enum class OverrideText : std::uint8_t {
  kScalar,  // TOML scalar if the text parses as one, else the text as a string
  kString,  // the text verbatim (a quoted TOML string literal is unquoted)
  kList,    // a TOML array, or comma-separated items
};

struct Field {
  Field(std::string_view table_name, std::string_view key_name, std::string_view doc_text,
        OverrideText text = OverrideText::kScalar)
      : table(table_name), key(key_name), doc(doc_text), override_text(text) {}

  std::string_view table;  // "communication"
  std::string_view key;    // "batch_threshold"
  std::string_view doc;    // unit and range, printed as a comment by to_toml
  OverrideText override_text = OverrideText::kScalar;
  // Converts `value` (any TOML type) and stores it; checks the type, unit,
  // enum spelling and range. Returns a problem text on failure (config unchanged).
  std::function<Problem(Config&, const toml::value&)> set;
  // Checks the stored value (range, machine CPUs) for validate().
  std::function<Problem(const Config&)> check;
  // The stored value as a TOML literal that `set` accepts back.
  std::function<std::string(const Config&)> print;

  std::string full_key() const;
};

// A rule over several fields. keys[0] is the one the message is about; the
// first of `keys` present in a file gives the line.
struct CrossRule {
  std::vector<std::string_view> keys;  // "communication.zero_copy", ...
  std::function<Problem(const Config&)> check;
};

const std::vector<Field>& fields();
const std::vector<CrossRule>& cross_rules();
// Table names in print order ("communication", "cluster", ...).
const std::vector<std::string_view>& table_names();

// "integer 5", "string \"abc\"", "array", ... for messages.
std::string describe(const toml::value& value);
// Offset of the first byte that is not part of well-formed UTF-8 (RFC 3629:
// no overlongs, no surrogates, <= U+10FFFF), or nullopt when all of `s` is.
std::optional<std::size_t> first_invalid_utf8(std::string_view s);
// TOML basic string literal, escaping '"', '\' and control characters.
std::string quote(std::string_view text);

}  // namespace ember::config::detail
