// Prometheus text format reader; see prometheus.h.
#include "tools/emberctl/prometheus.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

namespace ember::emberctl {

namespace {

bool is_name_start(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}
bool is_name_char(char c) { return is_name_start(c) || std::isdigit(static_cast<unsigned char>(c)); }

std::optional<double> parse_float(std::string_view t) {
  if (t == "+Inf" || t == "Inf") return std::numeric_limits<double>::infinity();
  if (t == "-Inf") return -std::numeric_limits<double>::infinity();
  if (t == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (t.empty()) return std::nullopt;
  const std::string s(t);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return v;
}

std::string unescape_help(std::string_view t) {
  std::string out;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '\\' && i + 1 < t.size() && (t[i + 1] == '\\' || t[i + 1] == 'n')) {
      out += t[i + 1] == 'n' ? '\n' : '\\';
      ++i;
    } else {
      out += t[i];
    }
  }
  return out;
}

tl::unexpected<Error> line_error(std::size_t line_no, std::string_view line, std::string_view what) {
  return make_error(ErrorCode::kInvalidArgument, "metrics text line {}: {}: '{}'", line_no, what, line);
}

Result<Sample> parse_sample(std::string_view line, std::size_t line_no) {
  Sample s;
  std::size_t i = 0;
  if (line.empty() || !is_name_start(line[0])) return line_error(line_no, line, "no metric name");
  while (i < line.size() && is_name_char(line[i])) ++i;
  s.name = std::string(line.substr(0, i));
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      while (i < line.size() && line[i] == ' ') ++i;
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      const std::size_t name_start = i;
      while (i < line.size() && is_name_char(line[i])) ++i;
      if (i == name_start) return line_error(line_no, line, "bad label name");
      std::string label(line.substr(name_start, i - name_start));
      if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') {
        return line_error(line_no, line, "label needs =\"value\"");
      }
      i += 2;
      std::string value;
      bool closed = false;
      while (i < line.size()) {
        const char c = line[i++];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\') {
          if (i >= line.size()) break;
          const char e = line[i++];
          if (e == '\\' || e == '"') {
            value += e;
          } else if (e == 'n') {
            value += '\n';
          } else {
            return line_error(line_no, line, "bad escape in a label value");
          }
        } else {
          value += c;
        }
      }
      if (!closed) return line_error(line_no, line, "unterminated label value");
      s.labels[std::move(label)] = std::move(value);
      if (i < line.size() && line[i] == ',') ++i;
      if (i >= line.size()) return line_error(line_no, line, "unterminated label set");
    }
  }
  while (i < line.size() && line[i] == ' ') ++i;
  std::size_t end = line.find(' ', i);
  const std::string_view value_text = line.substr(i, end == std::string_view::npos ? end : end - i);
  const auto v = parse_float(value_text);
  if (!v) return line_error(line_no, line, "bad value");
  s.value = *v;
  if (end != std::string_view::npos) {
    std::string_view rest = line.substr(end);
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    if (!rest.empty() && !parse_float(rest)) return line_error(line_no, line, "bad timestamp");
  }
  return s;
}

bool labels_include(const std::map<std::string, std::string>& have,
                    const std::map<std::string, std::string>& want) {
  for (const auto& [k, v] : want) {
    auto it = have.find(k);
    if (it == have.end() || it->second != v) return false;
  }
  return true;
}

}  // namespace

std::optional<double> Exposition::value(std::string_view name,
                                        const std::map<std::string, std::string>& labels) const {
  for (const Sample& s : samples) {
    if (s.name == name && labels_include(s.labels, labels)) return s.value;
  }
  return std::nullopt;
}

std::vector<const Sample*> Exposition::all(std::string_view name) const {
  std::vector<const Sample*> out;
  for (const Sample& s : samples) {
    if (s.name == name) out.push_back(&s);
  }
  return out;
}

Result<Exposition> parse_exposition(std::string_view text) {
  Exposition e;
  std::size_t pos = 0;
  std::size_t line_no = 0;
  while (pos < text.size()) {
    const std::size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string_view::npos ? nl : nl - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::string_view rest = line.substr(1);
      while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
      const bool is_help = rest.starts_with("HELP ");
      const bool is_type = rest.starts_with("TYPE ");
      if (!is_help && !is_type) continue;
      rest.remove_prefix(5);
      const std::size_t sp = rest.find(' ');
      const std::string name(rest.substr(0, sp));
      const std::string_view body = sp == std::string_view::npos ? "" : rest.substr(sp + 1);
      if (name.empty()) return line_error(line_no, line, "HELP/TYPE without a metric name");
      if (is_help) {
        e.help[name] = unescape_help(body);
      } else {
        if (body != "counter" && body != "gauge" && body != "histogram" && body != "summary" &&
            body != "untyped") {
          return line_error(line_no, line, "unknown metric type");
        }
        e.types[name] = std::string(body);
      }
      continue;
    }
    EMBER_ASSIGN_OR_RETURN(Sample s, parse_sample(line, line_no));
    e.samples.push_back(std::move(s));
  }
  return e;
}

std::optional<double> Histogram::quantile(double q) const {
  if (count <= 0.0 || buckets.empty()) return std::nullopt;
  const double rank = std::clamp(q, 0.0, 1.0) * count;
  double prev_bound = 0.0;
  double prev_count = 0.0;
  double largest_finite = 0.0;
  for (const auto& [bound, cumulative] : buckets) {
    if (std::isfinite(bound)) largest_finite = bound;
    if (cumulative >= rank && cumulative > prev_count) {
      if (!std::isfinite(bound)) return largest_finite;
      return prev_bound + (bound - prev_bound) * (rank - prev_count) / (cumulative - prev_count);
    }
    prev_bound = std::isfinite(bound) ? bound : prev_bound;
    prev_count = cumulative;
  }
  return largest_finite;
}

std::optional<double> Histogram::mean() const {
  if (count <= 0.0) return std::nullopt;
  return sum / count;
}

std::vector<Histogram> histograms(const Exposition& e, std::string_view name) {
  std::vector<Histogram> out;
  auto series = [&](std::map<std::string, std::string> labels) -> Histogram& {
    labels.erase("le");
    for (Histogram& h : out) {
      if (h.labels == labels) return h;
    }
    out.push_back(Histogram{});
    out.back().labels = std::move(labels);
    return out.back();
  };
  const std::string bucket = fmt::format("{}_bucket", name);
  const std::string sum = fmt::format("{}_sum", name);
  const std::string count = fmt::format("{}_count", name);
  for (const Sample& s : e.samples) {
    if (s.name == bucket) {
      auto le = s.labels.find("le");
      if (le == s.labels.end()) continue;
      const auto bound = parse_float(le->second);
      if (!bound) continue;
      series(s.labels).buckets.emplace_back(*bound, s.value);
    } else if (s.name == sum) {
      series(s.labels).sum = s.value;
    } else if (s.name == count) {
      series(s.labels).count = s.value;
    }
  }
  for (Histogram& h : out) std::sort(h.buckets.begin(), h.buckets.end());
  return out;
}

}  // namespace ember::emberctl
