// A reader of the Prometheus text exposition format 0.0.4, the format
// ember-server's metrics endpoint serves (common/metrics renders it).
//
// Grammar handled (https://prometheus.io/docs/instrumenting/exposition_formats/):
//   # HELP <name> <text>         (escapes \\ and \n)
//   # TYPE <name> counter|gauge|histogram|summary|untyped
//   # <anything else>            comment, ignored
//   <name>[{l="v",...}] <value> [<timestamp ms>]
// Label values unescape \\, \" and \n. Values are floats, including "+Inf",
// "-Inf" and "NaN". Blank lines are skipped.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"

namespace ember::emberctl {

struct Sample {
  std::string name;                           // e.g. "ember_server_request_latency_us_bucket"
  std::map<std::string, std::string> labels;  // sorted by name
  double value = 0.0;
};

struct Exposition {
  std::vector<Sample> samples;               // in text order
  std::map<std::string, std::string> types;  // family name -> "counter", "gauge", ...
  std::map<std::string, std::string> help;   // family name -> help text

  // The first sample named `name` whose labels include every pair of
  // `labels`; nullopt when none.
  std::optional<double> value(std::string_view name,
                              const std::map<std::string, std::string>& labels = {}) const;
  // Every sample named `name`, in text order.
  std::vector<const Sample*> all(std::string_view name) const;
};

// Parses exposition text. Errors (kInvalidArgument): a line that is not a
// comment and not "<name>[{labels}] <value>", an unterminated label set or
// string, a bad escape, a bad number — naming "line N" and the text.
[[nodiscard]] Result<Exposition> parse_exposition(std::string_view text);

// A histogram family read back from its _bucket/_sum/_count samples for one
// label set (without "le").
struct Histogram {
  std::map<std::string, std::string> labels;  // the series' labels, "le" removed
  std::vector<std::pair<double, double>> buckets;  // (upper bound, cumulative count), ascending, +Inf last
  double sum = 0.0;
  double count = 0.0;

  // The q-quantile (0 <= q <= 1) by linear interpolation inside the bucket
  // that holds it, as Prometheus' histogram_quantile() does; the lower edge
  // of the first bucket is 0; a quantile in the +Inf bucket returns the
  // largest finite bound. nullopt when count == 0.
  std::optional<double> quantile(double q) const;
  std::optional<double> mean() const;
};

// Every series of histogram family `name` (samples name_bucket, name_sum,
// name_count), grouped by their labels other than "le"; buckets sorted.
std::vector<Histogram> histograms(const Exposition& e, std::string_view name);

}  // namespace ember::emberctl
