// Metrics: counters, gauges and histograms, rendered in the Prometheus text
// exposition format 0.0.4 (https://prometheus.io/docs/instrumenting/exposition_formats/).
//
// A Registry owns metric families (one name, one type, one help text, one set
// of label names) and, in each family, one series per distinct set of label
// values (e.g. channel="3"). Registering returns a reference to the series'
// metric object, stable for the registry's lifetime: look it up once, keep the
// reference, and update it on the hot path without any lookup or lock.
//
// Thread-safety and cost:
//   - Counter::inc, Gauge::set/add, Histogram::observe: any thread, lock-free,
//     never block, never allocate. Counter::inc is one relaxed fetch_add
//     (a few ns uncontended; threads hammering the same counter bounce its
//     cache line, so give each channel/thread its own series via a label).
//     Gauge::add and Histogram::observe's sum use a compare-exchange loop on
//     a double. Histogram::observe is a binary search over the bounds plus
//     one relaxed integer add (the bucket) and that CAS (the sum).
//   - Registry::counter/gauge/histogram: any thread; take a mutex and may
//     allocate (first registration of a series). Not for hot paths.
//   - Registry::render: any thread, concurrently with updates and
//     registrations; takes the registry mutex (registrations wait, updates do
//     not) and allocates the output. Values are read with relaxed loads, so a
//     render taken during updates is a consistent-enough snapshot per value:
//     each number is one that the metric held, a histogram's _count always
//     equals its +Inf bucket, but _sum may lag or lead its buckets by the
//     observations in flight.
// Every non-seq_cst atomic here is relaxed: metrics publish no other data, so
// there is nothing to pair with; render only needs each load to be atomic.
//
// Misuse is a bug and aborts (EMBER_CHECK) with the name and the conflict: an
// invalid metric or label name, one name registered as two types, with two
// help texts, two label-name sets or two bucket layouts, or histogram bounds
// that are not finite and strictly increasing.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/base/constants.h"

namespace ember::metrics {

// Label pairs (name, value) of one series, e.g. {{"channel", "3"}}. Order does
// not matter: series are identified and rendered with labels sorted by name.
// Label names match [a-zA-Z_][a-zA-Z0-9_]* and do not start with "__"; "le" is
// reserved for histograms. Values are any UTF-8 text (escaped on render).
using Labels = std::vector<std::pair<std::string, std::string>>;

// Monotonic count (events, bytes). Padded to its own 128-byte slot so that
// per-thread or per-channel counters never share a cache line.
class alignas(kFalseSharingBytes) Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds n. Any thread; lock-free; wraps modulo 2^64 (not reachable in practice).
  void inc(std::uint64_t n = 1) noexcept { value_.fetch_add(n, std::memory_order_relaxed); }
  // For a counter that mirrors a count kept elsewhere (a transport's
  // per-connection statistics, sampled at scrape time; as Prometheus
  // collectors export /proc counters): the value becomes max(value, total),
  // so a sample that briefly reads less (a connection's count moving to a
  // running sum) never makes the counter go down. Any thread; lock-free.
  void raise_to(std::uint64_t total) noexcept {
    std::uint64_t cur = value_.load(std::memory_order_relaxed);
    while (cur < total &&
           !value_.compare_exchange_weak(cur, total, std::memory_order_relaxed)) {
    }
  }
  std::uint64_t value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> value_{0};
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free &&
                  std::atomic<double>::is_always_lock_free,
              "metrics updates must be lock-free");

// A value that goes up and down (queue depth, pool bytes in use, connected
// workers, step). Double-valued as Prometheus gauges are; integers up to 2^53
// are exact.
class alignas(kFalseSharingBytes) Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  // Any thread; lock-free. add/sub use a CAS loop (C++20 atomic<double>).
  void set(double v) noexcept { value_.store(v, std::memory_order_relaxed); }
  void add(double d) noexcept { value_.fetch_add(d, std::memory_order_relaxed); }
  void sub(double d) noexcept { value_.fetch_sub(d, std::memory_order_relaxed); }
  // Sets the value to max(value, v) (a CAS loop): a high-water mark that
  // several threads raise.
  void raise_to(double v) noexcept {
    double now = value_.load(std::memory_order_relaxed);
    while (now < v && !value_.compare_exchange_weak(now, v, std::memory_order_relaxed)) {
    }
  }
  double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Distribution over fixed buckets: bucket i counts observations v with
// bounds[i-1] < v <= bounds[i] (Prometheus "le" semantics); one more bucket
// counts v > bounds.back() (+Inf). NaN observations land in +Inf and make
// _sum NaN from then on (as Prometheus' client libraries do). Units are
// the caller's and belong in the metric name (_us, _bytes).
class Histogram {
 public:
  // pre: bounds finite and strictly increasing (checked; aborts otherwise).
  explicit Histogram(std::span<const double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Any thread; lock-free; no allocation.
  void observe(double v) noexcept;

  struct Snapshot {
    std::vector<double> bounds;              // upper bounds, without +Inf
    std::vector<std::uint64_t> cumulative;   // bounds.size() + 1 entries, last = count
    double sum = 0.0;
    std::uint64_t count = 0;                 // == cumulative.back()
  };
  // Relaxed reads of every bucket (allocates). Any thread.
  Snapshot snapshot() const;
  std::span<const double> bounds() const noexcept { return bounds_; }

 private:
  struct alignas(kCacheLineBytes) Bucket {
    std::atomic<std::uint64_t> count{0};
  };
  std::vector<double> bounds_;
  std::unique_ptr<Bucket[]> buckets_;  // bounds_.size() + 1 (last = +Inf)
  alignas(kCacheLineBytes) std::atomic<double> sum_{0.0};
};

// Bucket layouts. exponential: start, start*factor, ... (count bounds);
// linear: start, start+width, ... (count bounds). pre: start > 0, factor > 1,
// width > 0, count >= 1 (aborts otherwise).
std::vector<double> exponential_buckets(double start, double factor, std::size_t count);
std::vector<double> linear_buckets(double start, double width, std::size_t count);
// 1, 2, 5, 10, 20, 50, ... 10^7 microseconds (1 µs .. 10 s): latencies in µs.
std::vector<double> latency_us_buckets();
// 64 B, 256 B, 1 KiB, ... 4^k ... 1 GiB: message and batch sizes in bytes.
std::vector<double> size_bytes_buckets();

// Owns metric families and renders them. Not copyable or movable (metric
// references point into it).
class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Get-or-create the series `labels` of family `name`. The first call for a
  // name fixes its type, help and label names; later calls must match (else
  // abort). The reference stays valid for the registry's lifetime.
  // Any thread; locks; allocates on first registration.
  // Counter names should end in "_total" (Prometheus convention; not enforced).
  Counter& counter(std::string_view name, std::string_view help, const Labels& labels = {});
  Gauge& gauge(std::string_view name, std::string_view help, const Labels& labels = {});
  // bounds: as for Histogram; must be the same for every series of a family.
  Histogram& histogram(std::string_view name, std::string_view help,
                       std::span<const double> bounds, const Labels& labels = {});

  // Prometheus text exposition format 0.0.4 (Content-Type
  // "text/plain; version=0.0.4; charset=utf-8"): families sorted by name,
  // each with "# HELP" and "# TYPE" lines, series sorted by label values
  // (digit runs compared as numbers, so channel="2" precedes channel="10");
  // histograms as name_bucket{...,le="<bound>"} (cumulative, ending with
  // le="+Inf"), name_sum and name_count. Help text escapes '\' and newline;
  // label values escape '\', '"' and newline. Numbers use the shortest form
  // that reads back exactly; +Inf, -Inf and NaN as Prometheus spells them.
  // Any thread; see the file comment for consistency.
  std::string render() const;

  // Number of families registered. Any thread.
  std::size_t num_families() const;

 private:
  enum class Type : std::uint8_t { kCounter, kGauge, kHistogram };
  struct Family;
  struct Series;
  // Finds or creates the series; checks name, help, type, label names and
  // bounds against the family. Locks mutex_.
  Series& series(std::string_view name, std::string_view help, Type type, const Labels& labels,
                 std::span<const double> bounds);

  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<Family>, std::less<>> families_;  // guarded by mutex_
};

// The process-wide registry, for library layers that are not handed one
// (transport, pool). ember-server renders it on its metrics endpoint.
// Created on first use, never destroyed (usable during static destruction).
Registry& global_registry();

// Content-Type of render()'s output for an HTTP response.
inline constexpr std::string_view kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace ember::metrics
