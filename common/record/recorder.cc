// Recorder: counters updated by the hooks, a sampler thread that writes the
// ones that changed; see recorder.h. Invariant: every line in the file is
// written by one thread at a time (the sampler, or the owner after joining
// it), so the file needs no lock.
#include "common/record/recorder.h"

#include <pthread.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace ember::record {

namespace {

constexpr std::uint32_t kMaxChannels = 1024;
constexpr std::uint32_t kMaxRanks = config::kMaxRecordedRanks;
constexpr std::chrono::nanoseconds kMinInterval = std::chrono::microseconds(10);
constexpr std::chrono::nanoseconds kMaxInterval = std::chrono::minutes(1);

}  // namespace

Recorder::Recorder(RecorderOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<Recorder>> Recorder::create(RecorderOptions options) {
  if (options.path.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "recorder: no file given; set communication.record_path");
  }
  if (options.num_channels < 1 || options.num_channels > kMaxChannels) {
    return make_error(ErrorCode::kInvalidArgument, "recorder: {} channels; must be 1 .. {}",
                      options.num_channels, kMaxChannels);
  }
  if (options.num_ranks < 1 || options.num_ranks > kMaxRanks) {
    return make_error(ErrorCode::kInvalidArgument, "recorder: {} ranks; must be 1 .. {}",
                      options.num_ranks, kMaxRanks);
  }
  if (options.sample_interval < kMinInterval || options.sample_interval > kMaxInterval) {
    return make_error(ErrorCode::kInvalidArgument,
                      "recorder: sample interval {} ns; must be 10 us .. 1 min",
                      options.sample_interval.count());
  }
  if (options.source.find_first_of("\r\n") != std::string::npos) {
    return make_error(ErrorCode::kInvalidArgument,
                      "recorder: the source name must be one line (got '{}')", options.source);
  }
  std::FILE* file = std::fopen(options.path.c_str(), "w");
  if (file == nullptr) {
    const int err = errno;
    return make_sys_error(err, "recorder: cannot create '{}' (communication.record_path)",
                          options.path.string());
  }
  std::unique_ptr<Recorder> r(new Recorder(std::move(options)));
  r->file_ = file;
  r->num_channels_ = r->options_.num_channels;
  r->num_ranks_ = r->options_.num_ranks;
  r->channels_ = std::make_unique<ChannelCounters[]>(r->num_channels_);
  r->ranks_ = std::make_unique<RankCounters[]>(r->num_ranks_);
  const std::size_t num_counts = std::size_t{r->num_channels_} * kNumSizeBuckets;
  r->size_counts_ = std::make_unique<std::atomic<std::uint64_t>[]>(num_counts);
  for (std::size_t i = 0; i < num_counts; ++i) r->size_counts_[i].store(0, std::memory_order_relaxed);
  r->last_channel_.resize(r->num_channels_);
  r->last_rank_.resize(r->num_ranks_);
  r->start_ = std::chrono::steady_clock::now();
  const auto unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  const std::string header = fmt::format(
      "{} {}\n# communication pattern recording; scripts/plot_channels.py renders it\n"
      "source {}\nstart_unix_ns {}\nchannels {}\nranks {}\nsample_interval_ns {}\ndata\n",
      kMagic, kFormatVersion, r->options_.source, unix_ns, r->num_channels_, r->num_ranks_,
      r->options_.sample_interval.count());
  r->write_line(header.data(), header.size());
  r->write_samples(true);  // t = 0: every channel and rank at zero
  r->sampler_ = std::thread([raw = r.get()] { raw->sampler_loop(); });
  return r;
}

std::filesystem::path recording_path(std::string_view record_path, std::string_view role,
                                     std::uint32_t index) {
  return std::filesystem::path(fmt::format("{}.{}{}", record_path, role, index));
}

Result<std::unique_ptr<Recorder>> Recorder::from_config(const config::Config& config,
                                                        std::string_view role, std::uint32_t index,
                                                        std::uint32_t num_channels,
                                                        std::chrono::nanoseconds sample_interval) {
  if (!config.communication.record_pattern) return std::unique_ptr<Recorder>();
  if (role.empty() || role.find_first_not_of("abcdefghijklmnopqrstuvwxyz") != std::string_view::npos) {
    return make_error(ErrorCode::kInvalidArgument,
                      "recorder: process role '{}' must be lowercase letters (e.g. \"server\")",
                      role);
  }
  RecorderOptions o;
  // An empty record_path stays empty: create() names the setting.
  if (!config.communication.record_path.empty()) {
    o.path = recording_path(config.communication.record_path, role, index);
  }
  o.source = fmt::format("{} {}", role, index);
  o.num_channels = num_channels;
  o.num_ranks = config.cluster.num_workers;
  o.sample_interval = sample_interval;
  return create(std::move(o));
}

Recorder::~Recorder() { (void)close(); }

std::uint64_t Recorder::now_ns() const {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - start_)
                                        .count());
}

void Recorder::write_line(const char* text, std::size_t length) {
  if (write_errno_ != 0) return;
  if (std::fwrite(text, 1, length, file_) != length) write_errno_ = errno != 0 ? errno : EIO;
}

void Recorder::write_samples(bool force) {
  const std::uint64_t t = now_ns();
  fmt::memory_buffer out;
  for (std::uint32_t c = 0; c < num_channels_; ++c) {
    const ChannelCounters& cc = channels_[c];
    // Head before tail: both only grow, so a head read earlier than the tail
    // cannot exceed it unless a consumer hook ran before its producer's
    // (see recording.h).
    LastChannel now;
    now.head_msgs = cc.head_msgs.load(std::memory_order_relaxed);
    now.head_bytes = cc.head_bytes.load(std::memory_order_relaxed);
    now.tail_msgs = cc.tail_msgs.load(std::memory_order_relaxed);
    now.tail_bytes = cc.tail_bytes.load(std::memory_order_relaxed);
    LastChannel& last = last_channel_[c];
    if (force || now.head_msgs != last.head_msgs || now.tail_msgs != last.tail_msgs ||
        now.head_bytes != last.head_bytes || now.tail_bytes != last.tail_bytes) {
      fmt::format_to(std::back_inserter(out), "c {} {} {} {} {} {}\n", t, c, now.head_msgs,
                     now.tail_msgs, now.head_bytes, now.tail_bytes);
      last = now;
      ++samples_written_;
    }
  }
  for (std::uint32_t r = 0; r < num_ranks_; ++r) {
    LastRank now;
    now.bytes = ranks_[r].bytes.load(std::memory_order_relaxed);
    now.messages = ranks_[r].messages.load(std::memory_order_relaxed);
    LastRank& last = last_rank_[r];
    if (force || now.bytes != last.bytes || now.messages != last.messages) {
      fmt::format_to(std::back_inserter(out), "r {} {} {} {}\n", t, r, now.bytes, now.messages);
      last = now;
      ++samples_written_;
    }
  }
  write_line(out.data(), out.size());
}

void Recorder::sampler_loop() {
  pthread_setname_np(pthread_self(), "ember-record");
  std::unique_lock lock(mutex_);
  auto next = std::chrono::steady_clock::now() + options_.sample_interval;
  while (!stop_) {
    if (cv_.wait_until(lock, next, [this] { return stop_; })) break;
    next += options_.sample_interval;
    const auto now = std::chrono::steady_clock::now();
    if (next < now) next = now + options_.sample_interval;  // fell behind: skip, do not burst
    lock.unlock();
    write_samples(false);
    lock.lock();
  }
}

Status Recorder::close() {
  if (closed_) return close_result_;
  closed_ = true;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (sampler_.joinable()) sampler_.join();
  write_samples(true);
  fmt::memory_buffer out;
  for (std::uint32_t c = 0; c < num_channels_; ++c) {
    for (std::uint32_t b = 0; b < kNumSizeBuckets; ++b) {
      const std::uint64_t n =
          size_counts_[std::size_t{c} * kNumSizeBuckets + b].load(std::memory_order_relaxed);
      if (n == 0) continue;
      const BucketBounds bounds = bucket_bounds(b);
      fmt::format_to(std::back_inserter(out), "h {} {} {} {}\n", c, bounds.lo_bytes,
                     bounds.hi_bytes, n);
    }
  }
  fmt::format_to(std::back_inserter(out), "end {} {} {}\n", now_ns(), samples_written_,
                 out_of_range_.load(std::memory_order_relaxed));
  write_line(out.data(), out.size());
  if (write_errno_ == 0 && std::fflush(file_) != 0) write_errno_ = errno != 0 ? errno : EIO;
  if (std::fclose(file_) != 0 && write_errno_ == 0) write_errno_ = errno != 0 ? errno : EIO;
  file_ = nullptr;
  if (write_errno_ != 0) {
    close_result_ = make_sys_error(write_errno_, "recorder: writing '{}' failed",
                                   options_.path.string());
  }
  return close_result_;
}

}  // namespace ember::record
