// The configuration schema: one row per TOML key; see schema.h.
#include "common/config/schema.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "common/base/units.h"

namespace ember::config::detail {
namespace {

// A field of a table of Config, e.g. Config::communication.batch_threshold_bytes.
template <typename Sub, typename T>
struct Member {
  Sub Config::*table;
  T Sub::*field;
  T& operator()(Config& c) const { return c.*table.*field; }
  const T& operator()(const Config& c) const { return c.*table.*field; }
};

template <typename T>
Member<CommunicationConfig, T> comm(T CommunicationConfig::*f) { return {&Config::communication, f}; }
template <typename T>
Member<ClusterConfig, T> cluster(T ClusterConfig::*f) { return {&Config::cluster, f}; }
template <typename T>
Member<ServerConfig, T> server(T ServerConfig::*f) { return {&Config::server, f}; }
template <typename T>
Member<OptimizerConfig, T> optimizer(T OptimizerConfig::*f) { return {&Config::optimizer, f}; }
template <typename T>
Member<WorkerConfig, T> worker(T WorkerConfig::*f) { return {&Config::worker, f}; }

constexpr std::uint64_t KiB = std::uint64_t{1} << 10;
constexpr std::uint64_t MiB = std::uint64_t{1} << 20;
constexpr std::uint64_t GiB = std::uint64_t{1} << 30;
constexpr std::uint64_t TiB = std::uint64_t{1} << 40;

// "4KB", "256MB", "513B": the largest binary unit that divides exactly, in
// the spelling parse_size_bytes reads back.
std::string size_text(std::uint64_t bytes) {
  static constexpr std::pair<std::uint64_t, std::string_view> kUnits[] = {
      {std::uint64_t{1} << 40, "TB"}, {std::uint64_t{1} << 30, "GB"}, {MiB, "MB"}, {KiB, "KB"}};
  if (bytes != 0) {
    for (const auto& [mult, name] : kUnits) {
      if (bytes % mult == 0) return fmt::format("{}{}", bytes / mult, name);
    }
  }
  return fmt::format("{}B", bytes);
}

// Shortest decimal that reads back to the same double, always with a '.' or
// an exponent so that TOML sees a float.
std::string double_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

// Whether binding the same port on hosts `a` and `b` would collide: the
// same host ("localhost" being 127.0.0.1), or a wildcard that covers the
// other ("0.0.0.0" every IPv4 host, "::" every host under Linux's default
// dual-stack sockets). Other host names are compared as written.
bool same_socket_host(std::string_view a, std::string_view b) {
  // Address literals in their canonical text, so that every spelling of one
  // address compares equal: "127.1" and "0x7f.1" (inet_aton's forms) are
  // 127.0.0.1, "::ffff:127.0.0.1" (IPv4-mapped) too, "0:0::1" is "::1".
  auto norm = [](std::string_view h) -> std::string {
    if (h == "localhost") return "127.0.0.1";
    const std::string text(h);
    char buf[INET6_ADDRSTRLEN];
    in_addr v4{};
    if (::inet_aton(text.c_str(), &v4) != 0) {
      return ::inet_ntop(AF_INET, &v4, buf, sizeof buf) != nullptr ? buf : text;
    }
    in6_addr v6{};
    if (::inet_pton(AF_INET6, text.c_str(), &v6) == 1) {
      if (IN6_IS_ADDR_V4MAPPED(&v6)) {
        std::memcpy(&v4, &v6.s6_addr[12], 4);
        return ::inet_ntop(AF_INET, &v4, buf, sizeof buf) != nullptr ? buf : text;
      }
      return ::inet_ntop(AF_INET6, &v6, buf, sizeof buf) != nullptr ? buf : text;
    }
    return text;
  };
  const std::string x = norm(a);
  const std::string y = norm(b);
  const auto ipv4 = [](std::string_view h) { return h.find(':') == std::string_view::npos; };
  return x == y || x == "::" || y == "::" || (x == "0.0.0.0" && ipv4(y)) || (y == "0.0.0.0" && ipv4(x));
}

std::string quoted_list(const std::vector<std::string_view>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("\"{}\"", names[i]);
  }
  return out;
}

// ---------------------------------------------------------------------------
// Row builders. Each captures the member and its limits by value.

template <typename Sub>
Field size_field(std::string_view table, std::string_view key, std::string_view doc,
                 Member<Sub, std::uint64_t> m, std::uint64_t min, std::uint64_t max) {
  // The value as format_bytes shows it when that is exact; in bytes when it
  // rounds (4095 B is not "4.00 KiB is below the minimum 4 KiB") or reads
  // like the limit's own text ("1 GiB is above the maximum 1 GiB").
  auto shown = [](std::uint64_t v, std::uint64_t limit) {
    std::string text = format_bytes(v);
    if (text == format_bytes(limit)) return fmt::format("{} B", v);
    return text.find('.') == std::string::npos ? text : fmt::format("{} B ({})", v, text);
  };
  auto in_range = [=](std::uint64_t v) -> Problem {
    if (v < min) {
      return fmt::format("{} is below the minimum {}; use at least \"{}\"", shown(v, min),
                         format_bytes(min), size_text(min));
    }
    if (v > max) {
      return fmt::format("{} is above the maximum {}; use at most \"{}\"", shown(v, max),
                         format_bytes(max), size_text(max));
    }
    return std::nullopt;
  };
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    std::uint64_t bytes = 0;
    if (v.is_integer()) {
      if (v.as_integer() < 0) {
        return fmt::format("{} is negative; write a size such as \"{}\"", v.as_integer(),
                           size_text(min));
      }
      bytes = static_cast<std::uint64_t>(v.as_integer());
    } else if (v.is_string()) {
      auto parsed = parse_size_bytes(v.as_string().str);
      if (!parsed) {
        return fmt::format("{}", parsed.error().message());
      }
      bytes = *parsed;
    } else {
      return fmt::format(
          "must be a size, got {}; write a string with a unit such as \"4KB\" or \"1MB\" "
          "(binary units) or an integer number of bytes",
          describe(v));
    }
    if (auto p = in_range(bytes)) return p;
    m(c) = bytes;
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return in_range(m(c)); };
  f.print = [=](const Config& c) { return quote(size_text(m(c))); };
  return f;
}

// Durations: min is inclusive unless positive (then > 0 is required).
template <typename Sub>
Field duration_field(std::string_view table, std::string_view key, std::string_view doc,
                     Member<Sub, std::chrono::nanoseconds> m, std::chrono::nanoseconds max,
                     bool positive) {
  auto in_range = [=](std::chrono::nanoseconds d) -> Problem {
    if (d.count() < 0) return fmt::format("is negative; use a duration such as \"1s\"");
    if (positive && d.count() == 0) {
      return std::string("must be longer than zero; use a duration such as \"1s\"");
    }
    if (d > max) {
      return fmt::format("\"{}\" is above the maximum \"{}\"; use a shorter duration",
                         duration_text(d), duration_text(max));
    }
    return std::nullopt;
  };
  const Config defaults;
  const std::string example = duration_text(m(defaults));
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_string()) {
      if (v.is_integer() || v.is_floating()) {
        return fmt::format("{} has no unit; write a string with a unit: ns, us, ms, s, m or h "
                           "(e.g. \"{}\")",
                           describe(v), example);
      }
      return fmt::format("must be a duration, got {}; write a string with a unit such as \"{}\"",
                         describe(v), example);
    }
    auto parsed = parse_duration(v.as_string().str);
    if (!parsed) return parsed.error().message();
    if (auto p = in_range(*parsed)) return p;
    m(c) = *parsed;
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return in_range(m(c)); };
  f.print = [=](const Config& c) { return quote(duration_text(m(c))); };
  return f;
}

// Unsigned 32-bit counts. `extra` adds a rule (power of two) beyond min..max.
template <typename Sub>
Field uint_field(std::string_view table, std::string_view key, std::string_view doc,
                 Member<Sub, std::uint32_t> m, std::uint32_t min, std::uint32_t max,
                 std::string_view hint, std::function<Problem(std::uint32_t)> extra = {}) {
  auto in_range = [=](std::int64_t v) -> Problem {
    if (v < min || v > max) {
      return fmt::format("{} is outside {} .. {}; {}", v, min, max, hint);
    }
    if (extra) return extra(static_cast<std::uint32_t>(v));
    return std::nullopt;
  };
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_integer()) return fmt::format("must be an integer, got {}; {}", describe(v), hint);
    const std::int64_t x = v.as_integer();
    if (auto p = in_range(x)) return p;
    m(c) = static_cast<std::uint32_t>(x);
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return in_range(m(c)); };
  f.print = [=](const Config& c) { return fmt::format("{}", m(c)); };
  return f;
}

// A TOML float or integer as a double; nullopt for any other type.
std::optional<double> number_of(const toml::value& v) {
  if (v.is_floating()) return v.as_floating();
  if (v.is_integer()) return static_cast<double>(v.as_integer());
  return std::nullopt;
}

template <typename Sub>
Field double_field(std::string_view table, std::string_view key, std::string_view doc,
                   Member<Sub, double> m, std::function<Problem(double)> in_range) {
  const Config defaults;
  const std::string example = double_text(m(defaults));
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    const std::optional<double> x = number_of(v);
    if (!x) {
      return fmt::format("must be a number, got {}; write e.g. {} = {}", describe(v), key,
                         example);
    }
    if (auto p = in_range(*x)) return p;
    m(c) = *x;
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return in_range(m(c)); };
  f.print = [=](const Config& c) { return double_text(m(c)); };
  return f;
}

// A double that may be left to a default chosen elsewhere: a number, or
// "auto" (unset, printed as "auto").
template <typename Sub>
Field auto_double_field(std::string_view table, std::string_view key, std::string_view doc,
                        Member<Sub, std::optional<double>> m, std::function<Problem(double)> in_range,
                        std::string_view example) {
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (v.is_string() && v.as_string().str == "auto") {
      m(c).reset();
      return std::nullopt;
    }
    const std::optional<double> x = number_of(v);
    if (!x) {
      return fmt::format("must be a number or \"auto\", got {}; write e.g. {} = {}", describe(v),
                         key, example);
    }
    if (auto p = in_range(*x)) return p;
    m(c) = *x;
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return m(c) ? in_range(*m(c)) : Problem{}; };
  f.print = [=](const Config& c) { return m(c) ? double_text(*m(c)) : quote("auto"); };
  return f;
}

// Range rule for doubles: lo <= x (or lo < x), x < hi (or x <= hi), finite.
std::function<Problem(double)> double_range(double lo, bool lo_open, double hi, bool hi_open,
                                            std::string_view hint) {
  return [=](double x) -> Problem {
    const bool ok = std::isfinite(x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
    if (ok) return std::nullopt;
    const std::string hi_text = std::isinf(hi) ? "" : fmt::format(" and {} {}", hi_open ? "<" : "<=", hi);
    return fmt::format("{} is out of range: it must be finite, {} {}{}; {}", double_text(x),
                       lo_open ? ">" : ">=", lo, hi_text, hint);
  };
}

template <typename Sub>
Field bool_field(std::string_view table, std::string_view key, std::string_view doc,
                 Member<Sub, bool> m) {
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_boolean()) {
      return fmt::format("must be true or false, got {}; write {} = true or {} = false (no quotes)",
                         describe(v), key, key);
    }
    m(c) = v.as_boolean();
    return std::nullopt;
  };
  f.check = [](const Config&) -> Problem { return std::nullopt; };
  f.print = [=](const Config& c) { return std::string(m(c) ? "true" : "false"); };
  return f;
}

// What is wrong with `s` as a string value: not UTF-8, or, for a path, a
// NUL (a path stops at a NUL for the system: "a\u0000b" would create "a";
// a token is opaque bytes, sent with its length: a NUL is a byte).
Problem text_problem(const std::string& s, bool is_path) {
  if (first_invalid_utf8(s)) return std::string("is not valid UTF-8; write the value as UTF-8 text");
  if (const auto at = s.find('\0'); is_path && at != std::string::npos) {
    return fmt::format("holds a NUL character (\\u0000) at byte {}; remove it", at);
  }
  return std::nullopt;
}

// `v` as a string value (text_problem's rules) into `out`, or its problem.
Problem read_text(const toml::value& v, bool is_path, std::string& out) {
  if (!v.is_string()) {
    return fmt::format("must be a string, got {}; write it in double quotes", describe(v));
  }
  if (auto p = text_problem(v.as_string().str, is_path)) return p;
  out = v.as_string().str;
  return std::nullopt;
}

template <typename Sub>
Field string_field(std::string_view table, std::string_view key, std::string_view doc,
                   Member<Sub, std::string> m, bool is_path = false) {
  Field f{table, key, doc, OverrideText::kString};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    std::string text;
    if (auto p = read_text(v, is_path, text)) return p;
    m(c) = std::move(text);
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return text_problem(m(c), is_path); };
  f.print = [=](const Config& c) { return quote(m(c)); };
  return f;
}

// [communication] auth_token and auth_token_file: one secret, given inline
// or read from a file (a Kubernetes or Docker secret mounted as a file keeps
// it off command lines, which any local user can read in /proc). The file's
// token lands in auth_token, which every consumer reads; auth_token then
// prints as "" (the secret stays in its file). Giving both is an error,
// whatever the order of the lines or overrides.
constexpr std::size_t kMaxAuthTokenBytes = 1024;  // as the handshake allows

Field auth_token_field() {
  Field f{"communication", "auth_token",
          "shared secret checked at handshake; \"\" = none (loopback only); printed as \"\" "
          "when auth_token_file gives it",
          OverrideText::kString};
  f.set = [](Config& c, const toml::value& v) -> Problem {
    std::string token;
    if (auto p = read_text(v, false, token)) return p;
    if (!c.communication.auth_token_file.empty()) {
      if (token.empty()) return std::nullopt;  // as printed: the file's token stays
      return fmt::format("auth_token_file = {} gives the token already; give auth_token or "
                         "auth_token_file, not both",
                         quote(c.communication.auth_token_file));
    }
    if (token.size() > kMaxAuthTokenBytes) {
      return fmt::format("is {} bytes; at most {}", token.size(), kMaxAuthTokenBytes);
    }
    c.communication.auth_token = std::move(token);
    return std::nullopt;
  };
  f.check = [](const Config& c) { return text_problem(c.communication.auth_token, false); };
  f.print = [](const Config& c) {
    return c.communication.auth_token_file.empty() ? quote(c.communication.auth_token)
                                                   : std::string("\"\"");
  };
  return f;
}

// The token in `path`: its bytes, less one trailing newline ("\n" or
// "\r\n", as `echo` and editors leave it).
Result<std::string> read_auth_token_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return make_error(ErrorCode::kConfig, "'{}' is a directory; name the token file in it (a "
                      "mounted Kubernetes Secret holds one file per key, e.g. '{}/token')",
                      path, path);
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno != 0 ? errno : EIO;
    return make_error(ErrorCode::kConfig, "cannot open '{}': {}; check the path and that this "
                      "process may read it", path, std::strerror(err));
  }
  std::string token(kMaxAuthTokenBytes + 3, '\0');
  in.read(token.data(), static_cast<std::streamsize>(token.size()));
  if (in.bad()) {
    return make_error(ErrorCode::kConfig, "cannot read '{}': {}", path, std::strerror(EIO));
  }
  token.resize(static_cast<std::size_t>(in.gcount()));
  if (token.ends_with('\n')) token.pop_back();
  if (token.ends_with('\r')) token.pop_back();
  if (token.size() > kMaxAuthTokenBytes) {
    return make_error(ErrorCode::kConfig, "'{}' holds more than {} bytes; a token is at most {}",
                      path, kMaxAuthTokenBytes, kMaxAuthTokenBytes);
  }
  if (token.empty()) {
    return make_error(ErrorCode::kConfig, "'{}' is empty; write the job's token into it (e.g. "
                      "od -An -N16 -tx1 /dev/urandom | tr -d ' \\n' > FILE)", path);
  }
  if (first_invalid_utf8(token)) {
    return make_error(ErrorCode::kConfig, "'{}' is not valid UTF-8 text", path);
  }
  return token;
}

Field auth_token_file_field() {
  Field f{"communication", "auth_token_file",
          "file holding the shared secret (instead of auth_token; one trailing newline ignored); "
          "\"\" = none",
          OverrideText::kString};
  f.set = [](Config& c, const toml::value& v) -> Problem {
    std::string path;
    if (auto p = read_text(v, true, path)) return p;
    CommunicationConfig& comm = c.communication;
    if (path.empty()) {
      if (!comm.auth_token_file.empty()) comm.auth_token.clear();  // it came from the file
      comm.auth_token_file.clear();
      return std::nullopt;
    }
    if (!comm.auth_token.empty() && comm.auth_token_file.empty()) {
      return std::string("auth_token gives the token already; give auth_token or auth_token_file, "
                         "not both");
    }
    auto token = read_auth_token_file(path);
    if (!token) return token.error().message();
    comm.auth_token = std::move(*token);
    comm.auth_token_file = std::move(path);
    return std::nullopt;
  };
  f.check = [](const Config&) -> Problem { return std::nullopt; };
  f.print = [](const Config& c) { return quote(c.communication.auth_token_file); };
  return f;
}

template <typename Sub, typename E>
Field enum_field(std::string_view table, std::string_view key, std::string_view doc,
                 Member<Sub, E> m, std::vector<E> values) {
  std::vector<std::string_view> names;
  for (const E e : values) names.push_back(to_string(e));
  Field f{table, key, doc};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_string()) {
      return fmt::format("must be a string, got {}; use one of {}", describe(v), quoted_list(names));
    }
    const std::string& s = v.as_string().str;
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (s == names[i]) {
        m(c) = values[i];
        return std::nullopt;
      }
    }
    for (const std::string_view name : names) {
      if (s.size() == name.size() &&
          std::equal(s.begin(), s.end(), name.begin(), [](char a, char b) {
            return std::tolower(static_cast<unsigned char>(a)) == b;
          })) {
        return fmt::format("\"{}\" is not a valid {}; names are lower case: write \"{}\"", s, key,
                           name);
      }
    }
    return fmt::format("\"{}\" is not a valid {}; use one of {}", s, key, quoted_list(names));
  };
  f.check = [=](const Config& c) -> Problem {
    if (std::find(values.begin(), values.end(), m(c)) == values.end()) {
      return fmt::format("holds the out-of-range enum value {}; use one of {}",
                         static_cast<int>(m(c)), quoted_list(names));
    }
    return std::nullopt;
  };
  f.print = [=](const Config& c) { return quote(to_string(m(c))); };
  return f;
}

// Optional host:port; "" means unset.
template <typename Sub>
Field address_field(std::string_view table, std::string_view key, std::string_view doc,
                    Member<Sub, std::optional<HostPort>> m) {
  auto valid = [](const std::optional<HostPort>& hp) -> Problem {
    if (!hp) return std::nullopt;
    auto again = parse_host_port(hp->to_string(), /*allow_port_zero=*/true);
    if (!again || !(*again == *hp)) {
      return fmt::format("host '{}' is not a valid host name or IP address; write host:port, "
                         "e.g. \"127.0.0.1:7070\"",
                         hp->host);
    }
    return std::nullopt;
  };
  Field f{table, key, doc, OverrideText::kString};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_string()) {
      return fmt::format("must be a string \"host:port\" (or \"\" for the default), got {}",
                         describe(v));
    }
    const std::string& s = v.as_string().str;
    if (s.empty()) {
      m(c).reset();
      return std::nullopt;
    }
    auto hp = parse_host_port(s, /*allow_port_zero=*/true);
    if (!hp) return hp.error().message();
    m(c) = *hp;
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return valid(m(c)); };
  f.print = [=](const Config& c) { return quote(m(c) ? m(c)->to_string() : std::string()); };
  return f;
}

Problem check_server_list(const std::vector<HostPort>& servers) {
  if (servers.empty()) {
    return std::string("is empty; list at least one server, e.g. [\"127.0.0.1:7070\"]");
  }
  for (std::size_t i = 0; i < servers.size(); ++i) {
    auto again = parse_host_port(servers[i].to_string(), /*allow_port_zero=*/false);
    if (!again || !(*again == servers[i])) {
      return fmt::format("element [{}] \"{}\" is not a valid host:port with a port from 1 to "
                         "65535; write e.g. \"127.0.0.1:7070\"",
                         i, servers[i].to_string());
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (servers[j] == servers[i]) {
        return fmt::format("\"{}\" is listed twice (elements [{}] and [{}]); list each server once",
                           servers[i].to_string(), j, i);
      }
      if (servers[j].port == servers[i].port && same_socket_host(servers[j].host, servers[i].host)) {
        return fmt::format("\"{}\" (element [{}]) is the same server as \"{}\" (element [{}]) "
                           "under another name; list each server once",
                           servers[i].to_string(), i, servers[j].to_string(), j);
      }
    }
  }
  return std::nullopt;
}

Field server_list_field() {
  const auto m = cluster(&ClusterConfig::servers);
  Field f{"cluster", "servers", "[\"host:port\", ...] in server_index order; >= 1, no duplicates",
          OverrideText::kList};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_array()) {
      return fmt::format("must be an array of \"host:port\" strings, got {}; write e.g. servers = "
                         "[\"127.0.0.1:7070\"]",
                         describe(v));
    }
    std::vector<HostPort> out;
    const auto& arr = v.as_array();
    for (std::size_t i = 0; i < arr.size(); ++i) {
      if (!arr[i].is_string()) {
        return fmt::format("element [{}] must be a \"host:port\" string, got {}", i,
                           describe(arr[i]));
      }
      auto hp = parse_host_port(arr[i].as_string().str, /*allow_port_zero=*/false);
      if (!hp) return fmt::format("element [{}]: {}", i, hp.error().message());
      out.push_back(std::move(*hp));
    }
    if (auto p = check_server_list(out)) return p;
    m(c) = std::move(out);
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return check_server_list(m(c)); };
  f.print = [=](const Config& c) {
    std::string out = "[";
    for (std::size_t i = 0; i < m(c).size(); ++i) {
      if (i > 0) out += ", ";
      out += quote(m(c)[i].to_string());
    }
    return out + "]";
  };
  return f;
}

// Whose affinity mask a CPU list is checked against when it is parsed:
// kEveryProcess lists (communication.cpu_affinity) pin threads of whichever
// process loads the file; kServerOnly lists (server.shard_cpu_affinity) pin
// only ember-server's threads, which checks its own mask at start.
enum class CpuScope { kEveryProcess, kServerOnly };

template <typename Sub>
Field cpu_list_field(std::string_view table, std::string_view key, std::string_view doc,
                     Member<Sub, std::vector<std::uint32_t>> m, CpuScope scope) {
  const std::string full = fmt::format("{}.{}", table, key);
  auto valid = [=](const std::vector<std::uint32_t>& cpus) -> Problem {
    auto st = scope == CpuScope::kEveryProcess ? check_cpus_available(cpus, full)
                                               : check_cpus_exist(cpus, full);
    if (!st) {
      // The message starts with "key '<full>': "; the caller adds that prefix again.
      std::string msg = st.error().message();
      const std::string prefix = fmt::format("key '{}': ", full);
      if (msg.starts_with(prefix)) msg.erase(0, prefix.size());
      return msg;
    }
    return std::nullopt;
  };
  Field f{table, key, doc, OverrideText::kList};
  f.set = [=](Config& c, const toml::value& v) -> Problem {
    if (!v.is_array()) {
      return fmt::format("must be an array of CPU ids, got {}; write e.g. {} = [0, 1] (or [] for "
                         "no pinning)",
                         describe(v), key);
    }
    std::vector<std::uint32_t> cpus;
    const auto& arr = v.as_array();
    for (std::size_t i = 0; i < arr.size(); ++i) {
      if (!arr[i].is_integer() || arr[i].as_integer() < 0 ||
          arr[i].as_integer() > std::numeric_limits<std::int32_t>::max()) {
        return fmt::format("element [{}] must be a CPU id (an integer >= 0), got {}", i,
                           describe(arr[i]));
      }
      cpus.push_back(static_cast<std::uint32_t>(arr[i].as_integer()));
    }
    if (auto p = valid(cpus)) return p;
    m(c) = std::move(cpus);
    return std::nullopt;
  };
  f.check = [=](const Config& c) { return valid(m(c)); };
  f.print = [=](const Config& c) { return fmt::format("[{}]", fmt::join(m(c), ", ")); };
  return f;
}

std::vector<Field> build_fields() {
  using std::chrono::hours;
  using std::chrono::seconds;
  std::vector<Field> f;
  // [communication]
  f.push_back(enum_field("communication", "transport", "\"tcp\" | \"shm\" | \"rdma\" | \"auto\"",
                         comm(&CommunicationConfig::transport),
                         std::vector{Transport::kTcp, Transport::kShm, Transport::kRdma,
                                     Transport::kAuto}));
  f.push_back(size_field("communication", "batch_threshold",
                         "bytes per batch of small messages; 512B .. 1MB",
                         comm(&CommunicationConfig::batch_threshold_bytes), 512, MiB));
  f.push_back(duration_field("communication", "flush_interval",
                             "a partly filled batch is sent after this long; 0s .. 1s",
                             comm(&CommunicationConfig::flush_interval), seconds(1), false));
  f.push_back(duration_field("communication", "busy_poll",
                             "poll this long for the next message before sleeping; 0s .. 10ms",
                             comm(&CommunicationConfig::busy_poll),
                             std::chrono::milliseconds(10), false));
  f.push_back(uint_field(
      "communication", "ring_buffer_size", "slots per channel ring; a power of two, 2 .. 16777216",
      comm(&CommunicationConfig::ring_buffer_slots), 2, 1u << 24,
      "use a power of two from 2 to 16777216, e.g. 1024", [](std::uint32_t v) -> Problem {
        if ((v & (v - 1)) != 0) {
          std::uint32_t up = 1;
          while (up < v) up <<= 1;
          return fmt::format("{} is not a power of two; use {} or {}", v, up >> 1, up);
        }
        return std::nullopt;
      }));
  f.push_back(uint_field("communication", "prealloc_pages",
                         "2 MiB pages reserved for the page pool at start; 1 .. 1048576",
                         comm(&CommunicationConfig::prealloc_pages), 1, 1u << 20,
                         "use at least 1 page (2 MiB each)"));
  f.push_back(enum_field("communication", "pool_backing",
                         "\"auto\" | \"hugetlb\" | \"thp\" | \"plain\"",
                         comm(&CommunicationConfig::pool_backing),
                         std::vector{PoolBacking::kAuto, PoolBacking::kHugetlb, PoolBacking::kThp,
                                     PoolBacking::kPlain}));
  f.push_back(uint_field("communication", "channels",
                         "independent lanes; 0 = auto (number of comm cores), else 1 .. 64",
                         comm(&CommunicationConfig::num_channels), 0, 64,
                         "use 0 (auto) or a count from 1 to 64"));
  f.push_back(size_field("communication", "inline_write",
                         "bytes a sending thread writes to a tcp socket before the I/O thread "
                         "takes over; 0 .. 1GB (0: the I/O thread writes everything)",
                         comm(&CommunicationConfig::inline_write_bytes), 0, GiB));
  f.push_back(enum_field("communication", "zero_copy", "\"writev\" | \"sendfile\"",
                         comm(&CommunicationConfig::zero_copy),
                         std::vector{ZeroCopy::kWritev, ZeroCopy::kSendfile}));
  f.push_back(bool_field("communication", "payload_checksum",
                         "tcp: CRC32C over large payloads too (false: header and table only)",
                         comm(&CommunicationConfig::payload_checksum)));
  f.push_back(cpu_list_field("communication", "cpu_affinity",
                             "CPU ids for the I/O threads; [] = not pinned",
                             comm(&CommunicationConfig::cpu_affinity), CpuScope::kEveryProcess));
  f.push_back(uint_field("communication", "io_threads", "I/O threads; 1 .. 256",
                         comm(&CommunicationConfig::num_io_threads), 1, 256,
                         "use 1 to 256 I/O threads"));
  f.push_back(duration_field("communication", "heartbeat_interval",
                             "a heartbeat after this much silence; > 0, <= 24h",
                             comm(&CommunicationConfig::heartbeat_interval), hours(24), true));
  f.push_back(duration_field("communication", "heartbeat_timeout",
                             "a peer silent this long is dead; > heartbeat_interval, <= 24h",
                             comm(&CommunicationConfig::heartbeat_timeout), hours(24), true));
  f.push_back(size_field("communication", "max_message_size",
                         "largest message sent or accepted; >= batch_threshold and >= "
                         "partition_bytes",
                         comm(&CommunicationConfig::max_message_bytes), 512, TiB));
  f.push_back(size_field("communication", "max_queued_bytes",
                         "bytes queued for a slow receiver before the sender waits; >= "
                         "max_message_size",
                         comm(&CommunicationConfig::max_queued_bytes), 512, TiB));
  f.push_back(auth_token_field());
  f.push_back(auth_token_file_field());
  f.push_back(bool_field("communication", "record_pattern",
                         "record per-channel positions and message sizes",
                         comm(&CommunicationConfig::record_pattern)));
  f.push_back(string_field("communication", "record_path",
                           "file for the recording; required when record_pattern = true",
                           comm(&CommunicationConfig::record_path), /*is_path=*/true));
  // [cluster]
  f.push_back(server_list_field());
  f.push_back(uint_field("cluster", "num_workers", "workers in the job; 1 .. 1048576",
                         cluster(&ClusterConfig::num_workers), 1, 1u << 20,
                         "set it to the number of worker processes (at least 1)"));
  // [server]
  f.push_back(address_field("server", "listen",
                            "\"host:port\" to bind; \"\" = cluster.servers[server_index]",
                            server(&ServerConfig::listen)));
  f.push_back(uint_field("server", "server_index",
                         "this server's position in cluster.servers; < number of servers",
                         server(&ServerConfig::server_index), 0, 1u << 20,
                         "use this server's 0-based position in cluster.servers"));
  f.push_back(enum_field("server", "consistency", "\"bsp\" | \"asp\" | \"ssp\"",
                         server(&ServerConfig::consistency),
                         std::vector{Consistency::kBsp, Consistency::kAsp, Consistency::kSsp}));
  f.push_back(uint_field("server", "staleness", "ssp bound in steps; 0 .. 1000000",
                         server(&ServerConfig::staleness_steps), 0, 1'000'000,
                         "use a bound from 0 to 1000000 steps"));
  f.push_back(uint_field("server", "shards", "shard threads; 1 .. 1024",
                         server(&ServerConfig::num_shards), 1, 1024,
                         "use 1 to 1024 shard threads"));
  f.push_back(cpu_list_field("server", "shard_cpu_affinity",
                             "CPU ids for the shard threads; [] = not pinned",
                             server(&ServerConfig::shard_cpu_affinity), CpuScope::kServerOnly));
  f.push_back(size_field("server", "partition_bytes",
                         "tensors larger than this are cut into chunks; >= 4KB",
                         server(&ServerConfig::partition_bytes), 4 * KiB, TiB));
  f.push_back(string_field("server", "checkpoint_dir", "checkpoint directory; \"\" = off",
                           server(&ServerConfig::checkpoint_dir), /*is_path=*/true));
  f.push_back(duration_field("server", "checkpoint_interval",
                             "time between checkpoints; \"0s\" = only on SIGTERM; else 1s .. 365 days",
                             server(&ServerConfig::checkpoint_interval), hours(24 * 365), false));
  f.push_back(uint_field("server", "checkpoint_keep", "newest checkpoints kept; 1 .. 1000000",
                         server(&ServerConfig::checkpoint_keep), 1, 1'000'000,
                         "keep at least 1 checkpoint"));
  f.push_back(enum_field("server", "on_worker_loss", "\"wait\" | \"shrink\" | \"fail\"",
                         server(&ServerConfig::on_worker_loss),
                         std::vector{WorkerLossPolicy::kWait, WorkerLossPolicy::kShrink,
                                     WorkerLossPolicy::kFail}));
  f.push_back(duration_field("server", "worker_timeout",
                             "how long \"wait\" waits for a lost worker; > 0, <= 365 days",
                             server(&ServerConfig::worker_timeout), hours(24 * 365), true));
  f.push_back(address_field("server", "metrics_listen",
                            "\"host:port\" of the Prometheus endpoint; \"\" = off",
                            server(&ServerConfig::metrics_listen)));
  f.push_back(enum_field(
      "server", "log_level",
      "\"trace\" | \"debug\" | \"info\" | \"warn\" | \"error\" | \"critical\" | \"off\"",
      server(&ServerConfig::log_level),
      std::vector{LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn,
                  LogLevel::kError, LogLevel::kCritical, LogLevel::kOff}));
  // [optimizer]
  f.push_back(enum_field(
      "optimizer", "type", "\"sgd\" | \"momentum\" | \"adam\" | \"adamw\" | \"adagrad\"",
      optimizer(&OptimizerConfig::type),
      std::vector{OptimizerType::kSgd, OptimizerType::kMomentum, OptimizerType::kAdam,
                  OptimizerType::kAdamW, OptimizerType::kAdagrad}));
  const double inf = std::numeric_limits<double>::infinity();
  f.push_back(double_field("optimizer", "learning_rate", "> 0",
                           optimizer(&OptimizerConfig::learning_rate),
                           double_range(0, true, inf, false, "use a positive rate such as 0.01")));
  f.push_back(double_field("optimizer", "momentum", "0 <= momentum < 1 (type = \"momentum\")",
                           optimizer(&OptimizerConfig::momentum),
                           double_range(0, false, 1, true, "use e.g. 0.9")));
  f.push_back(bool_field("optimizer", "nesterov", "Nesterov momentum; only with type = \"momentum\"",
                         optimizer(&OptimizerConfig::nesterov)));
  f.push_back(double_field("optimizer", "beta1", "0 <= beta1 < 1 (adam, adamw)",
                           optimizer(&OptimizerConfig::beta1),
                           double_range(0, false, 1, true, "use e.g. 0.9")));
  f.push_back(double_field("optimizer", "beta2", "0 <= beta2 < 1 (adam, adamw)",
                           optimizer(&OptimizerConfig::beta2),
                           double_range(0, false, 1, true, "use e.g. 0.999")));
  f.push_back(auto_double_field(
      "optimizer", "epsilon",
      "> 0 (adam, adamw, adagrad); \"auto\": PyTorch's default, 1e-10 for adagrad, else 1e-8",
      optimizer(&OptimizerConfig::epsilon),
      double_range(0, true, inf, false, "use e.g. 1e-8, or \"auto\""), "1e-8"));
  f.push_back(auto_double_field(
      "optimizer", "weight_decay",
      ">= 0 (adamw: decoupled; others: L2); \"auto\": PyTorch's default, 0.01 for adamw, else 0",
      optimizer(&OptimizerConfig::weight_decay),
      double_range(0, false, inf, false, "use 0 (off), e.g. 1e-4, or \"auto\""), "1e-4"));
  f.push_back(double_field("optimizer", "initial_accumulator", ">= 0 (adagrad)",
                           optimizer(&OptimizerConfig::initial_accumulator),
                           double_range(0, false, inf, false, "use 0 (PyTorch's default) or e.g. 0.1")));
  // [worker]
  f.push_back(uint_field("worker", "rank", "this worker's rank; < cluster.num_workers",
                         worker(&WorkerConfig::rank), 0, (1u << 20) - 1,
                         "use this worker's 0-based rank, below cluster.num_workers"));
  f.push_back(duration_field("worker", "request_timeout",
                             "an unanswered push/pull/barrier fails after this long; > 0, <= 365 days",
                             worker(&WorkerConfig::request_timeout), hours(24 * 365), true));
  f.push_back(duration_field("worker", "connect_timeout", "one connection attempt; > 0, <= 24h",
                             worker(&WorkerConfig::connect_timeout), hours(24), true));
  f.push_back(uint_field("worker", "connect_retries",
                         "further attempts after a failed connect; 0 .. 1000000",
                         worker(&WorkerConfig::connect_retries), 0, 1'000'000,
                         "use 0 to 1000000 retries"));
  f.push_back(uint_field("worker", "resend_attempts",
                         "re-sends of a request after its connection was lost; 0 .. 100",
                         worker(&WorkerConfig::resend_attempts), 0, 100,
                         "use 0 (fail at once) to 100 re-sends"));
  return f;
}

std::vector<CrossRule> build_cross_rules() {
  std::vector<CrossRule> r;
  // One key, but a rule on its value rather than its range: 0 is allowed.
  r.push_back({{"server.checkpoint_interval"}, [](const Config& c) -> Problem {
                 const auto d = c.server.checkpoint_interval;
                 if (d.count() == 0 || d >= std::chrono::seconds(1)) return std::nullopt;
                 return fmt::format(
                     "\"{}\" is below \"1s\": each checkpoint writes and fsyncs every tensor of "
                     "the server; use \"0s\" (only on SIGTERM and on request) or at least \"1s\"",
                     duration_text(d));
               }});
  r.push_back({{"communication.heartbeat_timeout", "communication.heartbeat_interval"},
               [](const Config& c) -> Problem {
                 const auto& m = c.communication;
                 if (m.heartbeat_timeout > m.heartbeat_interval) return std::nullopt;
                 return fmt::format(
                     "\"{}\" must exceed heartbeat_interval \"{}\", or a healthy peer is declared "
                     "dead between two heartbeats; use a timeout of several intervals, e.g. \"{}\"",
                     duration_text(m.heartbeat_timeout), duration_text(m.heartbeat_interval),
                     duration_text(m.heartbeat_interval * 10));
               }});
  r.push_back({{"communication.max_message_size", "communication.batch_threshold"},
               [](const Config& c) -> Problem {
                 const auto& m = c.communication;
                 if (m.max_message_bytes >= m.batch_threshold_bytes) return std::nullopt;
                 return fmt::format("\"{}\" is smaller than batch_threshold \"{}\"; raise "
                                    "max_message_size or lower batch_threshold",
                                    size_text(m.max_message_bytes),
                                    size_text(m.batch_threshold_bytes));
               }});
  r.push_back({{"communication.max_message_size", "server.partition_bytes"},
               [](const Config& c) -> Problem {
                 // A large chunk's data is a message of its own (its header
                 // goes first, in another): partition_bytes is the largest.
                 if (c.communication.max_message_bytes >= c.server.partition_bytes) {
                   return std::nullopt;
                 }
                 return fmt::format("\"{}\" is smaller than [server] partition_bytes \"{}\", so "
                                    "a full chunk of a large tensor could never be sent; raise "
                                    "max_message_size to at least partition_bytes or lower "
                                    "partition_bytes",
                                    size_text(c.communication.max_message_bytes),
                                    size_text(c.server.partition_bytes));
               }});
  r.push_back({{"communication.max_queued_bytes", "communication.max_message_size"},
               [](const Config& c) -> Problem {
                 const auto& m = c.communication;
                 if (m.max_queued_bytes >= m.max_message_bytes) return std::nullopt;
                 return fmt::format("\"{}\" cannot hold one message of max_message_size \"{}\", "
                                    "so such a message could never be sent; raise "
                                    "max_queued_bytes to at least max_message_size",
                                    size_text(m.max_queued_bytes), size_text(m.max_message_bytes));
               }});
  r.push_back({{"communication.zero_copy", "communication.pool_backing"},
               [](const Config& c) -> Problem {
                 const auto& m = c.communication;
                 if (!(m.zero_copy == ZeroCopy::kSendfile &&
                       m.pool_backing == PoolBacking::kHugetlb)) {
                   return std::nullopt;
                 }
                 return std::string(
                     "\"sendfile\" cannot be used with pool_backing = \"hugetlb\": a hugetlb memfd "
                     "cannot feed sendfile (the kernel returns EINVAL); use pool_backing = \"thp\" "
                     "or zero_copy = \"writev\"");
               }});
  r.push_back({{"communication.record_pattern", "communication.record_path"},
               [](const Config& c) -> Problem {
                 const auto& m = c.communication;
                 if (!m.record_pattern || !m.record_path.empty()) return std::nullopt;
                 return std::string("is true but record_path is empty; set record_path to the "
                                    "file the recording goes to, e.g. \"/tmp/ember-pattern.bin\"");
               }});
  r.push_back({{"communication.record_pattern", "cluster.num_workers"},
               [](const Config& c) -> Problem {
                 if (!c.communication.record_pattern ||
                     c.cluster.num_workers <= kMaxRecordedRanks) {
                   return std::nullopt;
                 }
                 return fmt::format("is true but cluster.num_workers = {} is above the {} ranks a "
                                    "recording holds; record a job of at most {} workers, or set "
                                    "record_pattern = false",
                                    c.cluster.num_workers, kMaxRecordedRanks, kMaxRecordedRanks);
               }});
  r.push_back({{"server.server_index", "cluster.servers"}, [](const Config& c) -> Problem {
                 if (c.server.server_index < c.cluster.servers.size()) return std::nullopt;
                 return fmt::format("{} is not a position in cluster.servers, which lists {} "
                                    "server(s); use 0 .. {}",
                                    c.server.server_index, c.cluster.servers.size(),
                                    c.cluster.servers.size() - 1);
               }});
  r.push_back({{"worker.rank", "cluster.num_workers"}, [](const Config& c) -> Problem {
                 if (c.worker.rank < c.cluster.num_workers) return std::nullopt;
                 return fmt::format("{} is not below cluster.num_workers = {}; ranks are 0 .. {} "
                                    "(raise num_workers or lower the rank)",
                                    c.worker.rank, c.cluster.num_workers,
                                    c.cluster.num_workers - 1);
               }});
  r.push_back({{"optimizer.nesterov", "optimizer.type"}, [](const Config& c) -> Problem {
                 if (!c.optimizer.nesterov || c.optimizer.type == OptimizerType::kMomentum) {
                   return std::nullopt;
                 }
                 return fmt::format("is true but type = \"{}\"; Nesterov applies only to type = "
                                    "\"momentum\": set type = \"momentum\" or nesterov = false",
                                    to_string(c.optimizer.type));
               }});
  r.push_back({{"server.metrics_listen", "server.listen"}, [](const Config& c) -> Problem {
                 if (!c.server.metrics_listen || c.server.metrics_listen->port == 0 ||
                     c.server.server_index >= c.cluster.servers.size()) {
                   return std::nullopt;
                 }
                 const HostPort data = effective_listen(c);
                 const HostPort& metrics = *c.server.metrics_listen;
                 // Only tcp data addresses are TCP sockets (shm listens on an
                 // abstract unix socket named after the address, rdma on
                 // rdma_cm): for those, only the same text is refused.
                 const bool tcp_data = c.communication.transport == Transport::kTcp ||
                                       c.communication.transport == Transport::kAuto;
                 if (data.port != metrics.port ||
                     !(data == metrics || (tcp_data && same_socket_host(data.host, metrics.host)))) {
                   return std::nullopt;
                 }
                 return data == metrics
                            ? fmt::format("\"{}\" is also the server's data address; give the "
                                          "metrics endpoint its own port",
                                          data.to_string())
                            : fmt::format("\"{}\" takes the same port as the server's data address "
                                          "\"{}\" on the same host; give the metrics endpoint its "
                                          "own port",
                                          metrics.to_string(), data.to_string());
               }});
  return r;
}

}  // namespace

std::string Field::full_key() const { return fmt::format("{}.{}", table, key); }

const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = build_fields();
  return kFields;
}

const std::vector<CrossRule>& cross_rules() {
  static const std::vector<CrossRule> kRules = build_cross_rules();
  return kRules;
}

const std::vector<std::string_view>& table_names() {
  static const std::vector<std::string_view> kNames = [] {
    std::vector<std::string_view> names;
    for (const Field& f : fields()) {
      if (std::find(names.begin(), names.end(), f.table) == names.end()) names.push_back(f.table);
    }
    return names;
  }();
  return kNames;
}

std::string describe(const toml::value& v) {
  auto clip = [](std::string s) {
    if (s.size() > 40) s = s.substr(0, 37) + "...";
    return s;
  };
  switch (v.type()) {
    case toml::value_t::boolean: return v.as_boolean() ? "boolean true" : "boolean false";
    case toml::value_t::integer: return fmt::format("integer {}", v.as_integer());
    case toml::value_t::floating: return fmt::format("float {}", double_text(v.as_floating()));
    case toml::value_t::string: return fmt::format("string {}", clip(quote(v.as_string().str)));
    case toml::value_t::offset_datetime:
    case toml::value_t::local_datetime:
    case toml::value_t::local_date:
    case toml::value_t::local_time: return "a date/time";
    case toml::value_t::array: return "an array";
    case toml::value_t::table: return "a table";
    default: return "an empty value";
  }
}

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7F) {
          out += fmt::format("\\u{:04X}", c);
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

std::optional<std::size_t> first_invalid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > s.size()) return i;
    for (std::size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return i;
    }
    i += len;
  }
  return std::nullopt;
}

}  // namespace ember::config::detail
