// Recorder and recording reader: exact totals after concurrent hooks, the
// file round trip, size buckets against a brute-force reference, and every
// malformed input the reader refuses.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/config/config.h"
#include "common/record/recorder.h"
#include "common/record/recording.h"

namespace ember::record {
namespace {

namespace fs = std::filesystem;

class TempFile {
 public:
  TempFile() {
    path_ = fs::temp_directory_path() /
            ("ember-record-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
  }
  explicit TempFile(fs::path path) : path_(std::move(path)) {}
  ~TempFile() { fs::remove(path_); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(SizeBucket, MatchesBruteForceBoundsForEverySizeUpTo70000) {
  for (std::uint64_t s = 0; s < 70000; ++s) {
    const std::uint32_t b = size_bucket(s);
    const BucketBounds bb = bucket_bounds(b);
    ASSERT_LE(bb.lo_bytes, s) << "size " << s;
    ASSERT_LT(s, bb.hi_bytes) << "size " << s;
    if (s > 0) {
      // Buckets are contiguous and ordered.
      ASSERT_GE(b, size_bucket(s - 1));
    }
  }
}

TEST(SizeBucket, RelativeWidthAtMostAQuarter) {
  for (std::uint32_t b = 4; b < kNumSizeBuckets - 1; ++b) {
    const BucketBounds bb = bucket_bounds(b);
    EXPECT_LE(static_cast<double>(bb.hi_bytes - bb.lo_bytes) / static_cast<double>(bb.lo_bytes), 0.25)
        << "bucket " << b;
    EXPECT_EQ(bb.hi_bytes, bucket_bounds(b + 1).lo_bytes) << "bucket " << b;
  }
}

TEST(Recorder, ConcurrentHooksGiveExactTotalsInTheFile) {
  TempFile f;
  RecorderOptions o;
  o.path = f.path();
  o.source = "unit test";
  o.num_channels = 3;
  o.num_ranks = 4;
  o.sample_interval = std::chrono::microseconds(200);
  auto rec = Recorder::create(o);
  ASSERT_TRUE(rec) << rec.error().to_string();

  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (std::uint32_t rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::uint32_t channel = static_cast<std::uint32_t>(i) % 3;
        (*rec)->on_enqueue(channel, rank, 100 + rank);
        (*rec)->on_dequeue(channel, 1, 100 + rank);
      }
    });
  }
  for (auto& t : threads) t.join();
  (*rec)->on_enqueue(7, 0, 1);   // out of range: counted, not recorded
  (*rec)->on_enqueue(0, 99, 1);  // out of range
  ASSERT_TRUE((*rec)->close());

  auto loaded = load_recording(f.path());
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  EXPECT_TRUE(loaded->complete);
  EXPECT_EQ(loaded->source, "unit test");
  EXPECT_EQ(loaded->num_channels, 3u);
  EXPECT_EQ(loaded->num_ranks, 4u);
  EXPECT_EQ(loaded->out_of_range, 2u);
  const Totals t = final_totals(*loaded);
  std::uint64_t msgs = 0, bytes = 0;
  for (const auto& c : t.channels) {
    EXPECT_EQ(c.head_msgs, c.tail_msgs);
    EXPECT_EQ(c.head_bytes, c.tail_bytes);
    msgs += c.tail_msgs;
    bytes += c.tail_bytes;
  }
  EXPECT_EQ(msgs, 4u * kPerThread);
  EXPECT_EQ(bytes, std::uint64_t{kPerThread} * (100 + 101 + 102 + 103));
  for (std::uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ(t.ranks[r].messages_sent, std::uint64_t{kPerThread});
    EXPECT_EQ(t.ranks[r].bytes_sent, std::uint64_t{kPerThread} * (100 + r));
  }
  // Sizes 100..103 share the bucket [96, 112) (64..127 in four 16-byte
  // sub-buckets): one bucket per channel.
  std::uint64_t counted = 0;
  for (const auto& b : loaded->size_buckets) {
    EXPECT_EQ(b.lo_bytes, 96u);
    EXPECT_EQ(b.hi_bytes, 112u);
    counted += b.count;
  }
  EXPECT_EQ(counted, 4u * kPerThread);
  // Positions never go backwards per channel in the file.
  std::vector<std::uint64_t> last_tail(3, 0);
  for (const auto& s : loaded->channel_samples) {
    EXPECT_GE(s.tail_msgs, last_tail[s.channel]);
    last_tail[s.channel] = s.tail_msgs;
  }
}

TEST(Recorder, IdleChannelsWriteNoSamplesBetweenStartAndEnd) {
  TempFile f;
  RecorderOptions o;
  o.path = f.path();
  o.source = "idle";
  o.num_channels = 2;
  o.num_ranks = 1;
  o.sample_interval = std::chrono::microseconds(50);
  auto rec = Recorder::create(o);
  ASSERT_TRUE(rec);
  (*rec)->on_enqueue(1, 0, 10);
  ASSERT_TRUE((*rec)->close());
  auto loaded = load_recording(f.path());
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  // Channel 0 never changed: its samples are the one at t = 0 and the final one.
  int channel0 = 0;
  for (const auto& s : loaded->channel_samples) channel0 += s.channel == 0 ? 1 : 0;
  EXPECT_EQ(channel0, 2);
  EXPECT_EQ(final_totals(*loaded).channels[1].tail_bytes, 10u);
}

TEST(Recorder, CloseIsIdempotent) {
  TempFile f;
  RecorderOptions o;
  o.path = f.path();
  auto rec = Recorder::create(o);
  ASSERT_TRUE(rec);
  EXPECT_TRUE((*rec)->close());
  EXPECT_TRUE((*rec)->close());
  const std::string text = slurp(f.path());
  EXPECT_EQ(text.find("end "), text.rfind("end "));  // one end line
}

TEST(Recorder, RefusesBadOptionsWithClearErrors) {
  TempFile f;
  RecorderOptions o;
  o.path = f.path();
  o.num_channels = 0;
  auto r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("channels"), std::string::npos);

  o.num_channels = 1;
  o.num_ranks = 70000;
  r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("ranks"), std::string::npos);

  o.num_ranks = 1;
  o.sample_interval = std::chrono::nanoseconds(10);
  r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("interval"), std::string::npos);

  o.sample_interval = std::chrono::milliseconds(1);
  o.source = "two\nlines";
  r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("one line"), std::string::npos);

  o.source = "x";
  o.path = "/nonexistent-dir-ember/rec.txt";
  r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo);
  EXPECT_NE(r.error().message().find("/nonexistent-dir-ember/rec.txt"), std::string::npos);

  o.path.clear();
  r = Recorder::create(o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("record_path"), std::string::npos);
}

TEST(Recorder, FromConfigIsNullWhenRecordingIsOff) {
  config::Config c;
  c.communication.record_path = "/tmp/never-written.rec";
  auto r = Recorder::from_config(c, "server", 0, 2);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->get(), nullptr);
  EXPECT_FALSE(fs::exists("/tmp/never-written.rec.server0"));
}

TEST(Recorder, FromConfigWritesOneFilePerProcessNextToRecordPath) {
  TempFile base;
  TempFile server_file(base.path().string() + ".server1");
  TempFile worker_file(base.path().string() + ".worker3");
  config::Config c;
  c.communication.record_pattern = true;
  c.communication.record_path = base.path().string();
  c.cluster.num_workers = 5;
  auto server = Recorder::from_config(c, "server", 1, 2);
  ASSERT_TRUE(server) << server.error().to_string();
  ASSERT_NE(server->get(), nullptr);
  auto worker = Recorder::from_config(c, "worker", 3, 4);
  ASSERT_TRUE(worker) << worker.error().to_string();
  ASSERT_NE(worker->get(), nullptr);
  EXPECT_EQ((*server)->path(), server_file.path());
  EXPECT_EQ((*worker)->path(), worker_file.path());
  (*worker)->on_enqueue(3, 3, 100);
  ASSERT_TRUE((*server)->close());
  ASSERT_TRUE((*worker)->close());
  EXPECT_FALSE(fs::exists(base.path())) << "record_path itself is never written";

  auto s = load_recording(server_file.path());
  ASSERT_TRUE(s) << s.error().to_string();
  EXPECT_EQ(s->source, "server 1");
  EXPECT_EQ(s->num_ranks, 5u);
  EXPECT_EQ(s->num_channels, 2u);
  auto w = load_recording(worker_file.path());
  ASSERT_TRUE(w) << w.error().to_string();
  EXPECT_EQ(w->source, "worker 3");
  EXPECT_EQ(w->num_channels, 4u);
  const Totals t = final_totals(*w);
  EXPECT_EQ(t.ranks[3].bytes_sent, 100u);
  EXPECT_EQ(t.channels[3].tail_msgs, 1u);
}

TEST(Recorder, FromConfigRejectsABadRoleAndAnEmptyPath) {
  config::Config c;
  c.communication.record_pattern = true;
  c.communication.record_path = "/tmp/x.rec";
  for (const char* role : {"", "Server", "worker 1", "a/b"}) {
    auto r = Recorder::from_config(c, role, 0, 1);
    ASSERT_FALSE(r) << role;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message().find("lowercase letters"), std::string::npos) << r.error().message();
  }
  c.communication.record_path.clear();
  auto r = Recorder::from_config(c, "worker", 0, 1);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("record_path"), std::string::npos) << r.error().message();
}

TEST(RecordingPath, AppendsRoleAndIndex) {
  EXPECT_EQ(recording_path("/tmp/ember.rec", "server", 0), fs::path("/tmp/ember.rec.server0"));
  EXPECT_EQ(recording_path("run", "worker", 12), fs::path("run.worker12"));
}

constexpr const char* kHeader =
    "ember-record 1\nsource s\nstart_unix_ns 1\nchannels 2\nranks 2\nsample_interval_ns 1000\ndata\n";

TEST(ParseRecording, CutShortFileIsIncompleteNotAnError) {
  auto r = parse_recording(std::string(kHeader) + "c 5 1 0 3 0 30\n", "t");
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_FALSE(r->complete);
  ASSERT_EQ(r->channel_samples.size(), 1u);
  EXPECT_EQ(r->channel_samples[0].tail_bytes, 30u);
}

TEST(ParseRecording, RefusesMalformedInputNamingTheLine) {
  struct Case {
    std::string text;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"hello\n", "not an Ember recording"},
      {"ember-record 9\n", "unsupported recording version"},
      {"ember-record 1\nsource s\ndata\n", "header incomplete"},
      {"ember-record 1\nchannels x\n", "needs a number"},
      {"ember-record 1\nchannels 0\n", "must be 1 .. 65536"},
      {"ember-record 1\nbogus 1\n", "unknown header field"},
      {"ember-record 1\nsource s\n", "no 'data' line"},
      {std::string(kHeader) + "c 1 2 0 0 0 0\n", "channel 2 outside 0 .. 1"},
      {std::string(kHeader) + "r 1 5 0 0\n", "rank 5 outside 0 .. 1"},
      {std::string(kHeader) + "c 1 0 0 0\n", "needs 6 fields"},
      {std::string(kHeader) + "c 1 0 0 0 0 -3\n", "is not a number"},
      {std::string(kHeader) + "h 0 10 10 1\n", "is empty"},
      {std::string(kHeader) + "z 1\n", "unknown record type"},
      {std::string(kHeader) + "   \n", "only spaces"},
      {std::string(kHeader) + "end 1 0 0\nc 1 0 0 0 0 0\n", "after the 'end' line"},
  };
  for (const Case& c : cases) {
    auto r = parse_recording(c.text, "file.rec");
    ASSERT_FALSE(r) << c.text;
    EXPECT_EQ(r.error().code(), ErrorCode::kCorrupt);
    EXPECT_NE(r.error().message().find(c.expect), std::string::npos)
        << "got: " << r.error().message() << "\nfor: " << c.text;
    EXPECT_EQ(r.error().message().rfind("file.rec:", 0), 0u) << r.error().message();
  }
}

TEST(LoadRecording, MissingFileIsAnIoErrorNamingIt) {
  auto r = load_recording("/nonexistent-ember/x.rec");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo);
  EXPECT_NE(r.error().message().find("/nonexistent-ember/x.rec"), std::string::npos);
}

}  // namespace
}  // namespace ember::record
