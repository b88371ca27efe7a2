// Checkpoint format and files: round trip, truncation and corruption refused
// with a clear reason, atomic write, keep-last-K, newest valid restored.
#include "server/checkpoint.h"

#include <fstream>
#include <random>

#include <gtest/gtest.h>

namespace ember::server {
namespace {

CheckpointData sample(std::uint64_t seq) {
  CheckpointData d;
  d.server_index = 2;
  d.sequence = seq;
  d.created_unix_ns = 123456789;
  d.num_workers = 2;
  d.optimizer = config::OptimizerType::kAdam;
  d.consistency = proto::Consistency::kBsp;
  d.learning_rate = 0.001;
  for (std::uint64_t k = 0; k < 3; ++k) {
    EntrySnapshot e;
    e.key = 100 + k;
    e.chunk_index = static_cast<std::uint32_t>(k);
    e.num_chunks = 3;
    e.offset_elements = k * 4;
    e.shape = {3, 4};
    e.version = 7 + k;
    e.clocks = {7, 7};
    e.params = {1.0f * k, 2, 3, 4};
    e.optimizer.num_updates = 7;
    e.optimizer.slots = {{0.1f, 0.2f, 0.3f, 0.4f}, {1, 2, 3, static_cast<float>(seq)}};
    d.entries.push_back(e);
  }
  return d;
}

std::filesystem::path temp_dir(const char* name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("ember-ckpt-" + std::string(name) + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(Checkpoint, RoundTripsEveryField) {
  const auto d = sample(5);
  auto parsed = parse_checkpoint(serialize_checkpoint(d));
  ASSERT_TRUE(parsed) << parsed.error().to_string();
  EXPECT_EQ(*parsed, d);
}

TEST(Checkpoint, EmptyCheckpointRoundTrips) {
  CheckpointData d;
  d.sequence = 1;
  auto parsed = parse_checkpoint(serialize_checkpoint(d));
  ASSERT_TRUE(parsed);
  EXPECT_EQ(*parsed, d);
}

TEST(Checkpoint, EveryTruncationIsRefused) {
  const auto image = serialize_checkpoint(sample(5));
  for (std::size_t len = 0; len < image.size(); ++len) {
    auto parsed = parse_checkpoint(std::span(image).first(len));
    ASSERT_FALSE(parsed) << "accepted a checkpoint cut at " << len << " of " << image.size();
    EXPECT_EQ(parsed.error().code(), ErrorCode::kCorrupt);
  }
  auto cut = parse_checkpoint(std::span(image).first(image.size() / 2));
  EXPECT_NE(cut.error().message().find("truncated"), std::string::npos) << cut.error().message();
}

TEST(Checkpoint, FlippedParameterByteNamesTheKey) {
  auto image = serialize_checkpoint(sample(5));
  // Last record's parameters sit ~100 bytes before the footer; flip one there.
  image[image.size() - 16 - 4 - 40] ^= std::byte{0x01};
  auto parsed = parse_checkpoint(image);
  ASSERT_FALSE(parsed);
  EXPECT_NE(parsed.error().message().find("checksum mismatch in the record of key 102"),
            std::string::npos)
      << parsed.error().message();
}

TEST(Checkpoint, TrailingBytesAreRefused) {
  auto image = serialize_checkpoint(sample(5));
  image.push_back(std::byte{0});
  EXPECT_FALSE(parse_checkpoint(image));
}

TEST(Checkpoint, RandomCorruptionNeverAccepted) {
  const auto base = serialize_checkpoint(sample(5));
  const std::uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 2000; ++i) {
    auto image = base;
    image[rng() % image.size()] ^= std::byte(1u << (rng() % 8));
    EXPECT_FALSE(parse_checkpoint(image)) << "seed " << seed << " iteration " << i;
  }
}

TEST(Checkpoint, WriteIsAtomicAndKeepsLastK) {
  const auto dir = temp_dir("keep");
  for (std::uint64_t seq = 1; seq <= 5; ++seq) {
    auto path = write_checkpoint(dir, sample(seq), 3);
    ASSERT_TRUE(path) << path.error().to_string();
    EXPECT_EQ(path->filename(), checkpoint_file_name(2, seq));
  }
  auto files = list_checkpoints(dir, 2);
  ASSERT_TRUE(files);
  ASSERT_EQ(files->size(), 3u);
  EXPECT_EQ((*files)[0].first, 5u);
  EXPECT_EQ((*files)[2].first, 3u);
  // No temporary files remain.
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(e.path().extension(), ".ember") << e.path();
  }
  // Other servers' files are not listed.
  EXPECT_TRUE(list_checkpoints(dir, 1)->empty());
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, LoadSkipsTruncatedNewestAndUsesPrevious) {
  const auto dir = temp_dir("load");
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 5));
  auto newest = write_checkpoint(dir, sample(2), 5);
  ASSERT_TRUE(newest);
  std::filesystem::resize_file(*newest, std::filesystem::file_size(*newest) - 10);
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded);
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 1u);
  EXPECT_EQ(loaded->next_sequence, 3u);
  ASSERT_EQ(loaded->refused.size(), 1u);
  EXPECT_NE(loaded->refused[0].find("truncated"), std::string::npos) << loaded->refused[0];
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, LoadFromEmptyOrMissingDirectoryFindsNothing) {
  auto loaded = load_newest_checkpoint(temp_dir("missing"), 0);
  ASSERT_TRUE(loaded);
  EXPECT_FALSE(loaded->data);
  EXPECT_EQ(loaded->next_sequence, 1u);
}

TEST(Checkpoint, WriteIntoUnwritablePathFailsWithIo) {
  auto r = write_checkpoint("/proc/ember-no-such-dir", sample(1), 1);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo);
}

}  // namespace
}  // namespace ember::server
