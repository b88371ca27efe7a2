// TOML in and out: parse_config, load_config_file, validate, to_toml and the
// override helpers, all driven by the schema (schema.h).
//
// toml11 is called only through parse_toml() below, which pre-scans the text
// (toml11 3.7 recurses once per nesting level and per dotted-key part and
// overflows the stack on deep input) and turns every exception into an Error.
#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "common/config/config.h"
#include "common/config/schema.h"

namespace ember::config {
namespace {

using detail::Field;
using detail::Problem;

constexpr std::size_t kMaxInputBytes = std::size_t{16} << 20;
constexpr int kMaxNesting = 64;
constexpr int kMaxDottedParts = 64;

struct Issue {
  std::uint32_t line = 0;  // 0: no line
  std::string message;
};

tl::unexpected<Error> config_error(std::string message, int sys_errno = 0) {
  return tl::unexpected<Error>(Error(ErrorCode::kConfig, std::move(message), sys_errno));
}

// `text` with control characters other than newline and tab as TOML
// escapes (\u0000): a value quoted in a message may hold a NUL, which would
// end the message where a C string or a terminal stops. Newlines stay: a
// syntax error's excerpt (toml11's) spans lines, with a marker line.
std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) {
      out += fmt::format("\\u{:04x}", u);
    } else {
      out += c;
    }
  }
  return out;
}

// Joins issues sorted by line as "<source>:<line>: <message>" lines.
tl::unexpected<Error> issues_error(std::string_view source, std::vector<Issue> issues) {
  std::stable_sort(issues.begin(), issues.end(),
                   [](const Issue& a, const Issue& b) { return a.line < b.line; });
  std::string out;
  for (const Issue& issue : issues) {
    if (!out.empty()) out += '\n';
    if (issue.line > 0) {
      out += fmt::format("{}:{}: {}", source, issue.line, printable(issue.message));
    } else {
      out += fmt::format("{}: {}", source, printable(issue.message));
    }
  }
  return config_error(std::move(out));
}

// Pre-scan: the deepest bracket/brace nesting and the longest dotted key
// outside strings and comments must stay within the limits. Returns the
// offending line and a description, or nullopt. Conservative: it counts every
// '[' and '{' that toml11 could recurse on.
std::optional<Issue> check_depth(std::string_view s) {
  int depth = 0;
  int chain = 0;            // parts of the dotted key being read
  bool after_token = false; // the last significant thing was a key part
  bool after_dot = false;   // ... followed by '.'
  std::uint32_t line = 1;
  std::size_t i = 0;
  const std::size_t n = s.size();
  auto reset = [&] {
    chain = 0;
    after_token = after_dot = false;
  };
  auto token_done = [&]() -> bool {
    chain = after_dot ? chain + 1 : 1;
    after_dot = false;
    after_token = true;
    return chain <= kMaxDottedParts;
  };
  auto too_deep_key = [&] {
    return Issue{line, fmt::format("a dotted key has more than {} parts; a config key has two "
                                   "(table.key): check the file",
                                   kMaxDottedParts)};
  };
  while (i < n) {
    const char c = s[i];
    if (c == '\n') {
      ++line;
      reset();
      ++i;
    } else if (c == ' ' || c == '\t' || c == '\r') {
      ++i;
    } else if (c == '#') {
      while (i < n && s[i] != '\n') ++i;
    } else if (c == '"' || c == '\'') {
      const std::string_view triple = c == '"' ? "\"\"\"" : "'''";
      if (s.substr(i, 3) == triple) {
        i += 3;
        while (i < n) {
          if (c == '"' && s[i] == '\\') {
            ++i;
            if (i < n && s[i] == '\n') ++line;
            if (i < n) ++i;
          } else if (s.substr(i, 3) == triple) {
            i += 3;
            for (int extra = 0; extra < 2 && i < n && s[i] == c; ++extra) ++i;
            break;
          } else {
            if (s[i] == '\n') ++line;
            ++i;
          }
        }
      } else {
        ++i;
        while (i < n && s[i] != '\n') {
          if (s[i] == c) {
            ++i;
            break;
          }
          if (c == '"' && s[i] == '\\' && i + 1 < n && s[i + 1] != '\n') ++i;
          ++i;
        }
      }
      if (!token_done()) return too_deep_key();
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) {
        return Issue{line, fmt::format("arrays, tables or inline tables nest deeper than {} "
                                       "levels; a config nests at most 2: check the file",
                                       kMaxNesting)};
      }
      reset();
      ++i;
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;
      reset();
      ++i;
    } else if (c == '.') {
      if (after_token) {
        after_dot = true;
        after_token = false;
      } else {
        reset();
      }
      ++i;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-') {
      while (i < n && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' ||
                       s[i] == '-')) {
        ++i;
      }
      if (!token_done()) return too_deep_key();
    } else {
      reset();
      ++i;
    }
  }
  return std::nullopt;
}

// The line toml11 reports in a syntax error's text (" 12 | ..."), else 0.
std::uint32_t line_in_toml_message(std::string_view what) {
  std::size_t pos = 0;
  while (pos < what.size()) {
    std::size_t end = what.find('\n', pos);
    if (end == std::string_view::npos) end = what.size();
    std::string_view l = what.substr(pos, end - pos);
    std::size_t k = 0;
    while (k < l.size() && l[k] == ' ') ++k;
    std::size_t d = k;
    while (d < l.size() && std::isdigit(static_cast<unsigned char>(l[d]))) ++d;
    if (d > k && d - k < 10 && l.substr(d).starts_with(" |")) {
      return static_cast<std::uint32_t>(std::stoul(std::string(l.substr(k, d - k))));
    }
    pos = end + 1;
  }
  return 0;
}

// Parses TOML text with toml11, never throwing. On failure the issue carries
// the line (when known) and a message.
Result<toml::value> parse_toml(std::string_view text, std::string_view source) {
  if (text.size() > kMaxInputBytes) {
    return config_error(fmt::format("{}: {} bytes is larger than the 16 MiB a config file may "
                                    "have; check that this is the right file",
                                    source, text.size()));
  }
  // toml11 3.7 mishandles invalid UTF-8 inside strings (it rewinds an
  // iterator into a different buffer: undefined behaviour), and TOML must be
  // UTF-8 anyway, so the whole text is checked first.
  if (const auto bad = detail::first_invalid_utf8(text)) {
    const std::string_view before = text.substr(0, *bad);
    const auto line = static_cast<std::uint32_t>(std::count(before.begin(), before.end(), '\n') + 1);
    const std::size_t line_start = before.rfind('\n');
    const std::size_t column = line_start == std::string_view::npos ? *bad + 1 : *bad - line_start;
    return issues_error(source, {{line, fmt::format("byte 0x{:02X} at column {} is not valid "
                                                    "UTF-8; a TOML file must be UTF-8: save it "
                                                    "as UTF-8",
                                                    static_cast<unsigned char>(text[*bad]),
                                                    column)}});
  }
  if (auto issue = check_depth(text)) return issues_error(source, {*issue});
  try {
    std::istringstream in{std::string(text)};
    return toml::parse(in, std::string(source));
  } catch (const toml::syntax_error& e) {
    std::string what = e.what();
    std::uint32_t line = line_in_toml_message(what);
    if (line == 0) line = e.location().line();
    // toml11: "[error] <summary>\n --> file\n   |\n 4 | x = = 3\n   |     ^--- here"
    std::string summary = what.substr(0, what.find('\n'));
    if (summary.starts_with("[error] ")) summary.erase(0, 8);
    while (!summary.empty() && (summary.back() == '.' || summary.back() == ' ')) summary.pop_back();
    std::string excerpt;
    if (const std::size_t nl = what.find('\n'); nl != std::string::npos) excerpt = what.substr(nl);
    return issues_error(source, {{line, fmt::format("TOML syntax error: {}; fix the syntax at the "
                                                    "marked place{}",
                                                    summary, excerpt)}});
  } catch (const std::exception& e) {
    return config_error(fmt::format("{}: cannot parse the TOML: {}; fix the file", source,
                                    e.what()));
  } catch (...) {
    return config_error(fmt::format("{}: cannot parse the TOML (unknown error); fix the file",
                                    source));
  }
}

// The source text of a scalar value (toml11 keeps the line and the column).
std::string raw_token(const toml::value& v) {
  const toml::source_location loc = v.location();
  const std::string& line = loc.line_str();
  const std::size_t begin = loc.column() > 0 ? loc.column() - 1 : 0;
  if (begin >= line.size()) return std::string();
  return line.substr(begin, loc.region());
}

// toml11 3.7 saturates numbers that do not fit (an integer to INT64_MAX/MIN, a
// float to +-DBL_MAX) instead of failing; such a value is refused here, with
// its text. Arrays are checked element by element.
Problem overflow_problem(const toml::value& v) {
  if (v.is_array()) {
    for (const toml::value& item : v.as_array()) {
      if (Problem p = overflow_problem(item)) return p;
    }
    return std::nullopt;
  }
  if (v.is_integer()) {
    const std::int64_t x = v.as_integer();
    if (x != std::numeric_limits<std::int64_t>::max() &&
        x != std::numeric_limits<std::int64_t>::min()) {
      return std::nullopt;
    }
    const std::string token = raw_token(v);
    std::string digits;
    for (const char c : token) {
      if (c != '_') digits += c;
    }
    bool negative = false;
    std::size_t i = 0;
    if (i < digits.size() && (digits[i] == '+' || digits[i] == '-')) negative = digits[i++] == '-';
    int base = 10;
    if (digits.size() > i + 1 && digits[i] == '0' && std::isalpha(static_cast<unsigned char>(digits[i + 1]))) {
      base = digits[i + 1] == 'x' ? 16 : (digits[i + 1] == 'o' ? 8 : 2);
      i += 2;
    }
    std::uint64_t magnitude = 0;
    const char* first = digits.data() + i;
    const char* last = digits.data() + digits.size();
    const auto [ptr, ec] = std::from_chars(first, last, magnitude, base);
    const std::uint64_t limit = negative ? (std::uint64_t{1} << 63)
                                         : static_cast<std::uint64_t>(
                                               std::numeric_limits<std::int64_t>::max());
    if (ec == std::errc::result_out_of_range || (ec == std::errc() && magnitude > limit)) {
      return fmt::format("{} does not fit in a 64-bit integer; use a smaller value", token);
    }
    return std::nullopt;
  }
  if (v.is_floating()) {
    const double x = v.as_floating();
    if (std::abs(x) != std::numeric_limits<double>::max()) return std::nullopt;
    const std::string token = raw_token(v);
    std::string digits;
    for (const char c : token) {
      if (c != '_') digits += c;
    }
    errno = 0;
    (void)std::strtod(digits.c_str(), nullptr);
    if (errno == ERANGE) {
      return fmt::format("{} does not fit in a double (max ~1.8e308); use a smaller value", token);
    }
  }
  return std::nullopt;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The candidate closest to `word` if it is close enough to be a likely typo
// (edit distance <= max(2, len/3), or one contains the other).
std::optional<std::string_view> closest(std::string_view word,
                                        const std::vector<std::string_view>& candidates) {
  std::optional<std::string_view> best;
  std::size_t best_distance = 0;
  for (const std::string_view c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (!best || d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  if (!best) return std::nullopt;
  const std::size_t limit = std::max<std::size_t>(2, word.size() / 3);
  if (best_distance <= limit) return best;
  for (const std::string_view c : candidates) {
    if (word.size() >= 3 && (c.find(word) != std::string_view::npos ||
                             word.find(c) != std::string_view::npos)) {
      return c;
    }
  }
  return std::nullopt;
}

const Field* find_field(std::string_view table, std::string_view key) {
  for (const Field& f : detail::fields()) {
    if (f.table == table && f.key == key) return &f;
  }
  return nullptr;
}

std::vector<std::string_view> keys_of(std::string_view table) {
  std::vector<std::string_view> out;
  for (const Field& f : detail::fields()) {
    if (f.table == table) out.push_back(f.key);
  }
  return out;
}

std::vector<std::string_view> tables_having(std::string_view key) {
  std::vector<std::string_view> out;
  for (const Field& f : detail::fields()) {
    if (f.key == key) out.push_back(f.table);
  }
  return out;
}

std::string unknown_key_message(std::string_view table, std::string_view key) {
  const std::string full = fmt::format("{}.{}", table, key);
  if (const auto elsewhere = tables_having(key); !elsewhere.empty()) {
    return fmt::format("key '{}': unknown key in [{}]; '{}' belongs in [{}]: move it there", full,
                       table, key, elsewhere.front());
  }
  const auto keys = keys_of(table);
  if (const auto best = closest(key, keys)) {
    return fmt::format("key '{}': unknown key in [{}]; did you mean '{}'?", full, table, *best);
  }
  return fmt::format("key '{}': unknown key in [{}]; known keys are: {}", full, table,
                     fmt::join(keys, ", "));
}

std::string unknown_table_message(std::string_view name, const toml::value& value) {
  if (const auto owners = tables_having(name); !owners.empty() && !value.is_table()) {
    return fmt::format("key '{}': keys must be inside a table; move it under [{}] (as {}.{})",
                       name, owners.front(), owners.front(), name);
  }
  const auto& tables = detail::table_names();
  if (const auto best = closest(name, tables)) {
    return fmt::format("key '{}': unknown table [{}]; did you mean [{}]?", name, name, *best);
  }
  std::vector<std::string> bracketed;
  for (const auto t : tables) bracketed.push_back(fmt::format("[{}]", t));
  return fmt::format("key '{}': unknown table [{}]; the tables are {}", name, name,
                     fmt::join(bracketed, ", "));
}

struct Entry {
  std::string key;
  const toml::value* value;
  std::uint32_t line;
  std::uint32_t column;
};

// The entries of a table in file order. location() is computed once per
// entry: toml11 counts lines from the start of the file on every call.
template <typename Map>
std::vector<Entry> by_line(const Map& table) {
  std::vector<Entry> out;
  out.reserve(table.size());
  for (const auto& [k, v] : table) {
    const toml::source_location loc = v.location();
    out.push_back({k, &v, loc.line(), loc.column()});
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) {
    if (a.line != b.line) return a.line < b.line;
    if (a.column != b.column) return a.column < b.column;
    return a.key < b.key;
  });
  return out;
}

// Runs the cross-field rules; `line_of` maps "table.key" to a line (0 = absent).
template <typename LineOf>
void check_cross(const Config& config, LineOf line_of, std::vector<Issue>& issues) {
  for (const detail::CrossRule& rule : detail::cross_rules()) {
    if (const Problem p = rule.check(config)) {
      std::uint32_t line = 0;
      for (const std::string_view k : rule.keys) {
        line = line_of(k);
        if (line != 0) break;
      }
      issues.push_back({line, fmt::format("key '{}': {}", rule.keys.front(), *p)});
    }
  }
}

Result<Config> config_from_toml(const toml::value& root, std::string_view source) {
  Config config;
  std::vector<Issue> issues;
  std::vector<std::pair<std::string, std::uint32_t>> lines;  // "table.key" -> line
  if (!root.is_table()) return config_error(fmt::format("{}: the document is not a table", source));
  for (const Entry& table_entry : by_line(root.as_table())) {
    const std::string& name = table_entry.key;
    const toml::value* value = table_entry.value;
    const std::uint32_t table_line = table_entry.line;
    const auto& tables = detail::table_names();
    if (std::find(tables.begin(), tables.end(), name) == tables.end()) {
      issues.push_back({table_line, unknown_table_message(name, *value)});
      continue;
    }
    if (!value->is_table()) {
      issues.push_back({table_line, fmt::format("key '{}' must be a table, got {}; write it as a "
                                                "[{}] section",
                                                name, detail::describe(*value), name)});
      continue;
    }
    for (const Entry& entry : by_line(value->as_table())) {
      const std::string& key = entry.key;
      const toml::value* v = entry.value;
      const std::uint32_t line = entry.line;
      const Field* field = find_field(name, key);
      if (field == nullptr) {
        issues.push_back({line, unknown_key_message(name, key)});
        continue;
      }
      lines.emplace_back(field->full_key(), line);
      if (const Problem p = overflow_problem(*v)) {
        issues.push_back({line, fmt::format("key '{}': {}", field->full_key(), *p)});
        continue;
      }
      if (const Problem p = field->set(config, *v)) {
        issues.push_back({line, fmt::format("key '{}': {}", field->full_key(), *p)});
      }
    }
  }
  if (issues.empty()) {
    check_cross(config,
                [&](std::string_view k) -> std::uint32_t {
                  for (const auto& [full, line] : lines) {
                    if (full == k) return line;
                  }
                  return 0;
                },
                issues);
  }
  if (!issues.empty()) return issues_error(source, std::move(issues));
  return config;
}

// A TOML value for an override's text; see set_value in config.h.
Result<toml::value> override_value(const Field& field, std::string_view text) {
  auto as_toml = [](std::string_view t) -> std::optional<toml::value> {
    if (t.find('\n') != std::string_view::npos || t.find('\r') != std::string_view::npos) {
      return std::nullopt;
    }
    auto parsed = parse_toml(fmt::format("v = {}\n", t), "override");
    if (!parsed || !parsed->is_table()) return std::nullopt;
    const auto& table = parsed->as_table();
    const auto it = table.find("v");
    if (it == table.end() || table.size() != 1) return std::nullopt;
    switch (it->second.type()) {
      case toml::value_t::boolean:
      case toml::value_t::integer:
      case toml::value_t::floating:
      case toml::value_t::string:
      case toml::value_t::array: return it->second;
      default: return std::nullopt;  // dates, tables: take the text as a string
    }
  };
  auto trimmed = [](std::string_view t) {
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.front()))) t.remove_prefix(1);
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.remove_suffix(1);
    return t;
  };
  switch (field.override_text) {
    case detail::OverrideText::kString:
      if (text.size() >= 2 && (text.front() == '"' || text.front() == '\'')) {
        if (auto v = as_toml(text); v && v->is_string()) return *v;
      }
      return toml::value(std::string(text));
    case detail::OverrideText::kList: {
      if (auto v = as_toml(text); v && v->is_array()) return *v;
      toml::array items;
      std::string_view rest = trimmed(text);
      while (!rest.empty()) {
        const std::size_t comma = rest.find(',');
        const std::string_view item = trimmed(rest.substr(0, comma));
        auto v = as_toml(item);
        items.push_back(v && !v->is_array() ? *v : toml::value(std::string(item)));
        if (comma == std::string_view::npos) break;
        rest = rest.substr(comma + 1);
      }
      return toml::value(std::move(items));
    }
    case detail::OverrideText::kScalar:
      if (auto v = as_toml(text)) return *v;
      return toml::value(std::string(trimmed(text)));
  }
  return toml::value(std::string(text));
}

}  // namespace

// ---------------------------------------------------------------------------
Result<Config> parse_config(std::string_view toml_text, std::string_view source_name) {
  const std::string_view source = source_name.empty() ? std::string_view("<config>") : source_name;
  try {
    EMBER_ASSIGN_OR_RETURN(const toml::value root, parse_toml(toml_text, source));
    return config_from_toml(root, source);
  } catch (const std::exception& e) {  // bad_alloc and anything toml11 throws while reading
    return config_error(fmt::format("{}: cannot read the configuration: {}", source, e.what()));
  }
}

Result<Config> load_config_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return config_error(fmt::format("{}: the config file does not exist; check the path (e.g. "
                                    "--config config/ember.toml)",
                                    path.string()),
                        ENOENT);
  }
  if (std::filesystem::is_directory(status)) {
    return config_error(fmt::format("{}: is a directory, not a config file; name the .toml file "
                                    "inside it",
                                    path.string()),
                        EISDIR);
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno != 0 ? errno : EIO;
    return config_error(fmt::format("{}: cannot open the config file: {}; check its permissions",
                                    path.string(), std::strerror(err)),
                        err);
  }
  // Bounded: a config file is a few KB, and a path such as /dev/urandom or
  // a FIFO that never ends must be an error, not a process that reads
  // until memory runs out.
  std::string text;
  try {
    std::array<char, 64 * 1024> chunk;
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto n = static_cast<std::size_t>(in.gcount());
      if (n == 0) break;
      if (text.size() + n > kMaxConfigFileBytes) {
        return config_error(
            fmt::format("{}: more than {} MiB, which no config file is (they are a few KB); "
                        "check that --config names the .toml file",
                        path.string(), kMaxConfigFileBytes >> 20),
            EFBIG);
      }
      text.append(chunk.data(), n);
    }
  } catch (const std::exception& e) {
    return config_error(fmt::format("{}: cannot read the config file: {}", path.string(), e.what()));
  }
  if (in.bad()) {
    return config_error(fmt::format("{}: cannot read the config file: {}", path.string(),
                                    std::strerror(EIO)),
                        EIO);
  }
  return parse_config(text, path.string());
}

Status validate(const Config& config, std::string_view source_name) {
  std::vector<Issue> issues;
  for (const Field& f : detail::fields()) {
    if (const Problem p = f.check(config)) {
      issues.push_back({0, fmt::format("key '{}': {}", f.full_key(), *p)});
    }
  }
  if (issues.empty()) {
    check_cross(config, [](std::string_view) -> std::uint32_t { return 0; }, issues);
  }
  if (!issues.empty()) return issues_error(source_name, std::move(issues));
  return ok_status();
}

std::string to_toml(const Config& config) {
  std::string out =
      "# Ember effective configuration: every key, defaults included.\n"
      "# Sizes use binary units (\"4KB\" = 4096 bytes); durations need a unit (ns, us, ms, s, m, "
      "h).\n";
  std::string_view table;
  for (const Field& f : detail::fields()) {
    if (f.table != table) {
      table = f.table;
      out += fmt::format("\n[{}]\n", table);
    }
    out += fmt::format("{} = {}  # {}\n", f.key, f.print(config), f.doc);
  }
  return out;
}

std::vector<std::string> known_keys() {
  std::vector<std::string> out;
  for (const Field& f : detail::fields()) out.push_back(f.full_key());
  return out;
}

Status set_value(Config& config, std::string_view dotted_key, std::string_view value) {
  const std::size_t dot = dotted_key.find('.');
  const Field* field = nullptr;
  if (dot != std::string_view::npos) {
    field = find_field(dotted_key.substr(0, dot), dotted_key.substr(dot + 1));
  }
  if (field == nullptr) {
    std::vector<std::string> keys = known_keys();
    std::vector<std::string_view> views(keys.begin(), keys.end());
    if (const auto best = closest(dotted_key, views)) {
      return config_error(fmt::format("override: key '{}' is unknown; did you mean '{}'?",
                                      dotted_key, *best));
    }
    const std::string_view leaf = dot == std::string_view::npos ? dotted_key
                                                                : dotted_key.substr(dot + 1);
    if (const auto owners = tables_having(leaf); !owners.empty()) {
      return config_error(fmt::format("override: key '{}' is unknown; did you mean '{}.{}'?",
                                      dotted_key, owners.front(), leaf));
    }
    if (dot != std::string_view::npos) {
      // A known table: its keys (as an unknown key in a file is answered).
      const std::string_view table = dotted_key.substr(0, dot);
      const auto& tables = detail::table_names();
      if (std::find(tables.begin(), tables.end(), table) != tables.end()) {
        return config_error(fmt::format("override: key '{}' is unknown; [{}] has: {}", dotted_key,
                                        table, fmt::join(keys_of(table), ", ")));
      }
    }
    return config_error(fmt::format("override: key '{}' is unknown; keys are written table.key "
                                    "with a table of {}, e.g. 'communication.batch_threshold' "
                                    "(see config/ember.toml)",
                                    dotted_key, fmt::join(detail::table_names(), ", ")));
  }
  try {
    EMBER_ASSIGN_OR_RETURN(const toml::value v, override_value(*field, value));
    if (const Problem p = overflow_problem(v)) {
      return config_error(fmt::format("override: key '{}': {}", field->full_key(), *p));
    }
    if (const Problem p = field->set(config, v)) {
      return config_error(fmt::format("override: key '{}': {}", field->full_key(), *p));
    }
  } catch (const std::exception& e) {
    return config_error(fmt::format("override: key '{}': cannot read '{}': {}", field->full_key(),
                                    value, e.what()));
  }
  return ok_status();
}

Status apply_overrides(Config& config, std::span<const std::string> assignments) {
  EMBER_TRY(set_values(config, assignments));
  return validate(config, "overrides");
}

Status set_values(Config& config, std::span<const std::string> assignments) {
  for (const std::string& a : assignments) {
    const std::size_t eq = a.find('=');
    if (eq == std::string::npos) {
      return config_error(fmt::format("override '{}' has no '='; write table.key=value, e.g. "
                                      "communication.transport=shm",
                                      a));
    }
    std::string_view key = std::string_view(a).substr(0, eq);
    while (!key.empty() && key.back() == ' ') key.remove_suffix(1);
    while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
    std::string_view value = std::string_view(a).substr(eq + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    EMBER_TRY(set_value(config, key, value));
  }
  return ok_status();
}

void set_worker_rank(Config& config, std::uint32_t rank) noexcept { config.worker.rank = rank; }

Status set_listen(Config& config, std::string_view host_port) {
  return set_value(config, "server.listen", host_port);
}

Status set_servers(Config& config, std::span<const std::string> host_ports) {
  const Field* field = find_field("cluster", "servers");
  toml::array items;
  for (const std::string& hp : host_ports) items.emplace_back(hp);
  if (const Problem p = field->set(config, toml::value(std::move(items)))) {
    return config_error(fmt::format("override: key 'cluster.servers': {}", *p));
  }
  return ok_status();
}

}  // namespace ember::config
