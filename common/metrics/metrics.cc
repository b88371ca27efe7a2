// Metrics registry and Prometheus text rendering; see metrics.h.
//
// Layout: families_ maps name -> Family (sorted, so render walks names in
// order); each Family maps its label values -> Series in "natural" order
// (digit runs compared as numbers). A Series owns exactly one metric object
// whose address never changes, which is what makes the returned references
// stable.
#include "common/metrics/metrics.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "common/base/check.h"

namespace ember::metrics {
namespace {

bool is_metric_name(std::string_view s) {
  if (s.empty()) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool ok = std::isalpha(c) || c == '_' || c == ':' || (i > 0 && std::isdigit(c));
    if (!ok) return false;
  }
  return true;
}

bool is_label_name(std::string_view s) {
  if (s.empty() || s.starts_with("__")) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool ok = std::isalpha(c) || c == '_' || (i > 0 && std::isdigit(c));
    if (!ok) return false;
  }
  return true;
}

// Three-way "natural" comparison: runs of digits compare by numeric value
// (leading zeros ignored, then by length), everything else bytewise. Ties
// (e.g. "01" vs "1") are broken bytewise so the order is a strict total
// order consistent with string equality.
int natural_compare(std::string_view a, std::string_view b) {
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool db = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (da && db) {
      std::size_t ie = i;
      std::size_t je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      std::string_view na = a.substr(i, ie - i);
      std::string_view nb = b.substr(j, je - j);
      while (na.size() > 1 && na.front() == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb.front() == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size() ? -1 : 1;
      if (const int c = na.compare(nb); c != 0) return c < 0 ? -1 : 1;
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) {
      return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]) ? -1 : 1;
    }
    ++i;
    ++j;
  }
  if (i < a.size() || j < b.size()) return i < a.size() ? 1 : -1;
  const int c = a.compare(b);
  return c < 0 ? -1 : (c > 0 ? 1 : 0);
}

struct NaturalLess {
  bool operator()(const std::vector<std::string>& a, const std::vector<std::string>& b) const {
    const std::size_t n = std::min(a.size(), b.size());
    for (std::size_t k = 0; k < n; ++k) {
      if (const int c = natural_compare(a[k], b[k]); c != 0) return c < 0;
    }
    return a.size() < b.size();
  }
};

// Shortest text that parses back to the same double; Prometheus spellings
// for the special values.
std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

void append_escaped_label_value(std::string& out, std::string_view v) {
  for (const char c : v) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

void append_escaped_help(std::string& out, std::string_view v) {
  for (const char c : v) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

std::string_view type_name(int type) {
  switch (type) {
    case 0: return "counter";
    case 1: return "gauge";
    default: return "histogram";
  }
}

void check_bounds(std::span<const double> bounds) {
  for (std::size_t i = 0; i < bounds.size(); ++i) {
    EMBER_CHECK_MSG(std::isfinite(bounds[i]), "histogram bound {} is {}: bounds must be finite "
                    "(+Inf is implicit)", i, bounds[i]);
    if (i > 0) {
      EMBER_CHECK_MSG(bounds[i - 1] < bounds[i],
                      "histogram bounds must increase strictly: bound {} = {} follows {}", i,
                      bounds[i], bounds[i - 1]);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
Histogram::Histogram(std::span<const double> bounds)
    : bounds_(bounds.begin(), bounds.end()), buckets_(new Bucket[bounds.size() + 1]) {
  check_bounds(bounds_);
}

void Histogram::observe(double v) noexcept {
  // lower_bound: first bound >= v, i.e. the bucket with v <= le.
  std::size_t index = bounds_.size();  // +Inf (also for NaN)
  if (!std::isnan(v)) {
    index = static_cast<std::size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) -
                                     bounds_.begin());
  }
  buckets_[index].count.fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(bounds_.size() + 1);
  std::uint64_t running = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].count.load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> exponential_buckets(double start, double factor, std::size_t count) {
  EMBER_CHECK_MSG(start > 0 && factor > 1 && count >= 1,
                  "exponential_buckets(start={}, factor={}, count={}): need start > 0, factor > 1, "
                  "count >= 1", start, factor, count);
  std::vector<double> out;
  out.reserve(count);
  double v = start;
  for (std::size_t i = 0; i < count; ++i, v *= factor) out.push_back(v);
  return out;
}

std::vector<double> linear_buckets(double start, double width, std::size_t count) {
  EMBER_CHECK_MSG(width > 0 && count >= 1,
                  "linear_buckets(start={}, width={}, count={}): need width > 0, count >= 1", start,
                  width, count);
  std::vector<double> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) out.push_back(start + width * static_cast<double>(i));
  return out;
}

std::vector<double> latency_us_buckets() {
  std::vector<double> out;
  for (double decade = 1; decade <= 1e7; decade *= 10) {
    out.push_back(decade);
    if (decade < 1e7) {
      out.push_back(2 * decade);
      out.push_back(5 * decade);
    }
  }
  return out;
}

std::vector<double> size_bytes_buckets() { return exponential_buckets(64, 4, 13); }  // 64 B .. 1 GiB

// ---------------------------------------------------------------------------
struct Registry::Series {
  Labels labels;  // sorted by name
  std::unique_ptr<Counter> counter;
  std::unique_ptr<Gauge> gauge;
  std::unique_ptr<Histogram> histogram;
};

struct Registry::Family {
  std::string name;
  std::string help;
  Type type = Type::kCounter;
  std::vector<std::string> label_names;  // sorted
  std::vector<double> bounds;            // histograms only
  std::map<std::vector<std::string>, std::unique_ptr<Series>, NaturalLess> series;  // by values
};

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Series& Registry::series(std::string_view name, std::string_view help, Type type,
                                   const Labels& labels, std::span<const double> bounds) {
  EMBER_CHECK_MSG(is_metric_name(name), "metric name '{}' must match [a-zA-Z_:][a-zA-Z0-9_:]*",
                  name);
  Labels sorted = labels;
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> names;
  std::vector<std::string> values;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const std::string& label = sorted[i].first;
    EMBER_CHECK_MSG(is_label_name(label),
                    "metric '{}': label name '{}' must match [a-zA-Z_][a-zA-Z0-9_]* and not start "
                    "with '__'", name, label);
    EMBER_CHECK_MSG(!(type == Type::kHistogram && label == "le"),
                    "histogram '{}': label name 'le' is reserved for bucket bounds", name);
    EMBER_CHECK_MSG(i == 0 || sorted[i - 1].first != label, "metric '{}': label '{}' given twice",
                    name, label);
    names.push_back(label);
    values.push_back(sorted[i].second);
  }
  if (type == Type::kHistogram) check_bounds(bounds);

  std::lock_guard lock(mutex_);
  auto it = families_.find(name);
  if (it == families_.end()) {
    auto family = std::make_unique<Family>();
    family->name = std::string(name);
    family->help = std::string(help);
    family->type = type;
    family->label_names = names;
    family->bounds.assign(bounds.begin(), bounds.end());
    it = families_.emplace(family->name, std::move(family)).first;
  }
  Family& family = *it->second;
  EMBER_CHECK_MSG(family.type == type, "metric '{}' registered as {} and again as {}", name,
                  type_name(static_cast<int>(family.type)), type_name(static_cast<int>(type)));
  EMBER_CHECK_MSG(family.help == help, "metric '{}' registered with help '{}' and again with '{}'",
                  name, family.help, help);
  EMBER_CHECK_MSG(family.label_names == names,
                  "metric '{}' registered with labels [{}] and again with [{}]", name,
                  fmt::join(family.label_names, ","), fmt::join(names, ","));
  if (type == Type::kHistogram) {
    EMBER_CHECK_MSG(std::equal(family.bounds.begin(), family.bounds.end(), bounds.begin(),
                               bounds.end()),
                    "histogram '{}' registered with bounds [{}] and again with [{}]", name,
                    fmt::join(family.bounds, ","), fmt::join(bounds, ","));
  }
  auto sit = family.series.find(values);
  if (sit == family.series.end()) {
    auto s = std::make_unique<Series>();
    s->labels = std::move(sorted);
    switch (type) {
      case Type::kCounter: s->counter = std::make_unique<Counter>(); break;
      case Type::kGauge: s->gauge = std::make_unique<Gauge>(); break;
      case Type::kHistogram: s->histogram = std::make_unique<Histogram>(family.bounds); break;
    }
    sit = family.series.emplace(std::move(values), std::move(s)).first;
  }
  return *sit->second;
}

Counter& Registry::counter(std::string_view name, std::string_view help, const Labels& labels) {
  return *series(name, help, Type::kCounter, labels, {}).counter;
}

Gauge& Registry::gauge(std::string_view name, std::string_view help, const Labels& labels) {
  return *series(name, help, Type::kGauge, labels, {}).gauge;
}

Histogram& Registry::histogram(std::string_view name, std::string_view help,
                               std::span<const double> bounds, const Labels& labels) {
  return *series(name, help, Type::kHistogram, labels, bounds).histogram;
}

std::size_t Registry::num_families() const {
  std::lock_guard lock(mutex_);
  return families_.size();
}

namespace {

// Appends `{a="x",b="y"}` (or nothing for no labels), plus an optional extra
// label last (le for histogram buckets).
void append_labels(std::string& out, const Labels& labels, std::string_view extra_name = {},
                   std::string_view extra_value = {}) {
  if (labels.empty() && extra_name.empty()) return;
  out += '{';
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out += k;
    out += "=\"";
    append_escaped_label_value(out, v);
    out += '"';
  }
  if (!extra_name.empty()) {
    if (!first) out += ',';
    out += extra_name;
    out += "=\"";
    append_escaped_label_value(out, extra_value);
    out += '"';
  }
  out += '}';
}

}  // namespace

std::string Registry::render() const {
  std::string out;
  std::lock_guard lock(mutex_);
  for (const auto& [name, family] : families_) {
    out += "# HELP ";
    out += name;
    out += ' ';
    append_escaped_help(out, family->help);
    out += "\n# TYPE ";
    out += name;
    out += ' ';
    out += type_name(static_cast<int>(family->type));
    out += '\n';
    for (const auto& [values, s] : family->series) {
      switch (family->type) {
        case Type::kCounter:
          out += name;
          append_labels(out, s->labels);
          out += fmt::format(" {}\n", s->counter->value());
          break;
        case Type::kGauge:
          out += name;
          append_labels(out, s->labels);
          out += ' ';
          out += format_value(s->gauge->value());
          out += '\n';
          break;
        case Type::kHistogram: {
          const Histogram::Snapshot snap = s->histogram->snapshot();
          for (std::size_t i = 0; i <= snap.bounds.size(); ++i) {
            out += name;
            out += "_bucket";
            const std::string le =
                i < snap.bounds.size() ? format_value(snap.bounds[i]) : std::string("+Inf");
            append_labels(out, s->labels, "le", le);
            out += fmt::format(" {}\n", snap.cumulative[i]);
          }
          out += name;
          out += "_sum";
          append_labels(out, s->labels);
          out += ' ';
          out += format_value(snap.sum);
          out += '\n';
          out += name;
          out += "_count";
          append_labels(out, s->labels);
          out += fmt::format(" {}\n", snap.count);
          break;
        }
      }
    }
  }
  return out;
}

Registry& global_registry() {
  static Registry* const registry = new Registry();  // never destroyed: see metrics.h
  return *registry;
}

}  // namespace ember::metrics
