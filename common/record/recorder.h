// Recorder: communication pattern recording ([communication] record_pattern).
//
// Off by default. When on, the data path calls two hooks per message and a
// sampler thread writes the positions they maintain to a file (format in
// recording.h) every sample_interval:
//
//   on_enqueue(channel, rank, bytes)   a message entered `channel` (pushed into
//                                      its ring / send queue) on behalf of
//                                      worker `rank`: the channel's tail
//                                      advances by one message and `bytes`;
//                                      the size goes to the channel's
//                                      histogram; the rank's totals grow.
//   on_dequeue(channel, msgs, bytes)   the channel's consumer took `msgs`
//                                      messages of `bytes` in total out (sent
//                                      them, or handed them on): the head
//                                      advances.
//
// Where the hooks are called (a null Recorder* means recording is off and
// costs one predictable branch; message bytes = encoded header and dims plus
// tensor bytes):
//   worker (worker/worker.cc): on_enqueue when a request is put into its
//              channel's ring (Pipeline::enqueue), rank = this worker's rank;
//              on_dequeue when flush_ring takes it off the ring and hands it
//              to the transport. A request sent at once (push, pull, init,
//              barrier, ... outside a pipeline; or a pipeline request that
//              found its ring full) passes through: on_enqueue and
//              on_dequeue together. Channel ids are per server link; the
//              rings of channel c towards every server count as channel c.
//   server (server/server.cc, server/shard.cc): on_enqueue when the I/O
//              thread posts a request to its shard's ring, on the channel it
//              arrived on, with the sender's rank (bytes per rank = what each
//              worker sent to this server); on_dequeue when the shard has
//              handled it. tail - head is then what waits in shard rings.
// Call on_enqueue before the message becomes visible to the consumer, so
// that head <= tail holds in samples.
//
// Cost when on: on_enqueue is five relaxed fetch_adds (the channel's tail
// line, its size-histogram bucket, the rank's line); on_dequeue two on the
// channel's head line, which no producer writes. Never blocks, allocates or makes a system call. All file I/O happens
// on the sampler thread; a sample is written only for a channel or rank
// whose numbers changed, so an idle job writes nothing.
//
// Thread-safety: the hooks from any thread, concurrently (producers and
// consumers of many channels at once). create(), close() and the destructor
// from the owning thread, not concurrently with each other; hooks must not
// be running when close() or the destructor runs (they would be lost, not
// unsafe: the counters outlive the sampler, so a late hook only misses the
// file).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/base/constants.h"
#include "common/base/error.h"
#include "common/config/config.h"
#include "common/record/recording.h"

namespace ember::record {

struct RecorderOptions {
  // File to write; created or truncated. Its directory must exist.
  std::filesystem::path path;
  // Who records, written to the file ("ember-server 0", "worker 3"). One line.
  std::string source;
  // Channel ids 0 .. num_channels-1; 1 .. 1024.
  std::uint32_t num_channels = 1;
  // Rank ids 0 .. num_ranks-1; 1 .. 65536.
  std::uint32_t num_ranks = 1;
  // Sampler period; 10 us .. 1 min. 1 ms keeps an hour of a busy 8-channel
  // job to a few hundred MB; raise it for long runs.
  std::chrono::nanoseconds sample_interval{std::chrono::milliseconds(1)};
};

// The file process `role` `index` records to: record_path with
// ".<role><index>" appended ("/tmp/ember.rec" -> "/tmp/ember.rec.server0",
// "/tmp/ember.rec.worker3"). Pure.
std::filesystem::path recording_path(std::string_view record_path, std::string_view role,
                                     std::uint32_t index);

class Recorder {
 public:
  // Validates the options, creates the file, writes the header and starts
  // the sampler thread. Errors: kInvalidArgument (a value out of range, a
  // source with a newline, an empty path), kIo (cannot create the file,
  // naming the path and errno).
  [[nodiscard]] static Result<std::unique_ptr<Recorder>> create(RecorderOptions options);

  // From a validated Config, for process `role` `index` ("server" 0,
  // "worker" 3): nullptr (no error) when record_pattern is false, else
  // create() with path = recording_path(record_path, role, index), source
  // "<role> <index>", num_ranks = cluster.num_workers. Every process of a
  // job loads the same config, so each writes its own file next to
  // record_path. Errors: create()'s (a validated config keeps num_workers
  // within config::kMaxRecordedRanks when recording), and kInvalidArgument
  // for a role that is empty or not lowercase letters.
  [[nodiscard]] static Result<std::unique_ptr<Recorder>> from_config(
      const config::Config& config, std::string_view role, std::uint32_t index,
      std::uint32_t num_channels,
      std::chrono::nanoseconds sample_interval = std::chrono::milliseconds(1));

  ~Recorder();  // close(), ignoring its error (log it yourself: call close())
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // The hooks (see the file comment). Any thread; lock-free; noexcept. An
  // out-of-range channel or rank is not recorded and is counted (written as
  // out_of_range at the end).
  void on_enqueue(std::uint32_t channel, std::uint32_t rank, std::uint64_t bytes) noexcept {
    if (channel >= num_channels_ || rank >= num_ranks_) {
      out_of_range_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    ChannelCounters& c = channels_[channel];
    // All relaxed: the sampler only needs each value atomically; nothing
    // else is published through these counters.
    c.tail_msgs.fetch_add(1, std::memory_order_relaxed);
    c.tail_bytes.fetch_add(bytes, std::memory_order_relaxed);
    size_counts_[std::size_t{channel} * kNumSizeBuckets + size_bucket(bytes)].fetch_add(
        1, std::memory_order_relaxed);
    RankCounters& r = ranks_[rank];
    r.bytes.fetch_add(bytes, std::memory_order_relaxed);
    r.messages.fetch_add(1, std::memory_order_relaxed);
  }
  void on_dequeue(std::uint32_t channel, std::uint64_t messages, std::uint64_t bytes) noexcept {
    if (channel >= num_channels_) {
      out_of_range_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    ChannelCounters& c = channels_[channel];
    c.head_msgs.fetch_add(messages, std::memory_order_relaxed);  // relaxed: as above
    c.head_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  // Stops the sampler, writes a last sample of everything, the size
  // histograms and the `end` line, and closes the file. Idempotent (later
  // calls return the first result). Errors: kIo for any failed write,
  // flush or close since create() (the first one, naming the path).
  Status close();

  const std::filesystem::path& path() const noexcept { return options_.path; }

 private:
  struct alignas(kFalseSharingBytes) ChannelCounters {
    // Producer side (tail) and consumer side (head) on separate lines.
    std::atomic<std::uint64_t> tail_msgs{0};
    std::atomic<std::uint64_t> tail_bytes{0};
    alignas(kFalseSharingBytes) std::atomic<std::uint64_t> head_msgs{0};
    std::atomic<std::uint64_t> head_bytes{0};
  };
  struct alignas(kCacheLineBytes) RankCounters {
    std::atomic<std::uint64_t> bytes{0};
    std::atomic<std::uint64_t> messages{0};
  };
  struct LastChannel {
    std::uint64_t head_msgs = 0, tail_msgs = 0, head_bytes = 0, tail_bytes = 0;
  };
  struct LastRank {
    std::uint64_t bytes = 0, messages = 0;
  };

  explicit Recorder(RecorderOptions options);
  void sampler_loop();
  // Writes the samples that changed (all of them when `force`). Sampler
  // thread, or the owner after the sampler stopped.
  void write_samples(bool force);
  void write_line(const char* text, std::size_t length);
  std::uint64_t now_ns() const;

  RecorderOptions options_;
  std::uint32_t num_channels_ = 0;
  std::uint32_t num_ranks_ = 0;
  std::unique_ptr<ChannelCounters[]> channels_;
  std::unique_ptr<RankCounters[]> ranks_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> size_counts_;  // [channel * kNumSizeBuckets + bucket]
  std::atomic<std::uint64_t> out_of_range_{0};

  std::chrono::steady_clock::time_point start_;
  std::FILE* file_ = nullptr;
  std::vector<LastChannel> last_channel_;
  std::vector<LastRank> last_rank_;
  std::uint64_t samples_written_ = 0;
  int write_errno_ = 0;  // first failed write's errno (0: none)

  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread sampler_;
  bool closed_ = false;
  Status close_result_;
};

}  // namespace ember::record
