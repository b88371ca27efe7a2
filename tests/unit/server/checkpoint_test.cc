// Checkpoint format and files: round trip, truncation and corruption refused
// with a clear reason, atomic write, keep-last-K, newest valid restored.
#include "server/checkpoint.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <span>
#include <random>

#include <fmt/format.h>
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
  d.hyper_parameters = OptimizerHyperParameters{0.5, true, 0.8, 0.99, 1e-6, 0.25, 0.125};
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

// Files written before the hyper-parameters were stored (format 1, a 64-byte
// header) are still read, without them.
TEST(Checkpoint, FormatOneFilesAreStillRead) {
  CheckpointData d = sample(5);
  d.hyper_parameters.reset();
  const auto v1 = serialize_checkpoint(d);
  const auto v2 = serialize_checkpoint(sample(5));
  EXPECT_EQ(v1[8], std::byte{1});
  EXPECT_EQ(v2[8], std::byte{2});
  EXPECT_EQ(v2.size(), v1.size() + 64);
  auto parsed = parse_checkpoint(v1);
  ASSERT_TRUE(parsed) << parsed.error().to_string();
  EXPECT_EQ(*parsed, d);
  for (std::size_t len = 0; len < v1.size(); ++len) {
    EXPECT_FALSE(parse_checkpoint(std::span(v1).first(len))) << len;
  }
  auto future = v2;
  future[8] = std::byte{3};
  auto refused = parse_checkpoint(future);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("format version 3 (this build reads 1 and 2)"),
            std::string::npos)
      << refused.error().message();
}

TEST(Checkpoint, HyperParametersNoServerWritesAreCorrupt) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int field = 0; field < 6; ++field) {
    CheckpointData d = sample(2);
    OptimizerHyperParameters& h = *d.hyper_parameters;
    switch (field) {
      case 0: h.momentum = 1.0; break;
      case 1: h.beta1 = -0.1; break;
      case 2: h.beta2 = nan; break;
      case 3: h.epsilon = 0.0; break;
      case 4: h.weight_decay = -1.0; break;
      case 5: h.initial_accumulator = std::numeric_limits<double>::infinity(); break;
    }
    auto parsed = parse_checkpoint(serialize_checkpoint(d));
    ASSERT_FALSE(parsed) << field;
    EXPECT_EQ(parsed.error().code(), ErrorCode::kCorrupt) << field;
    EXPECT_NE(parsed.error().message().find("optimizer hyper-parameters no server writes"),
              std::string::npos)
        << parsed.error().message();
  }
}

// Only what the configured type uses is compared: an sgd server does not
// care about beta2. epsilon and weight_decay compare as resolved.
TEST(Checkpoint, ChangedHyperParametersNamesWhatTheTypeUses) {
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdamW;
  const OptimizerHyperParameters written = OptimizerHyperParameters::of(c);
  EXPECT_EQ(written.weight_decay, 0.01);
  EXPECT_EQ(written.epsilon, 1e-8);
  EXPECT_EQ(changed_hyper_parameters(written, c), "");
  c.beta2 = 0.99;
  c.weight_decay = 0.0;
  c.momentum = 0.5;  // not used by adamw
  EXPECT_EQ(changed_hyper_parameters(written, c), "beta2 0.999 (now 0.99), weight_decay 0.01 (now 0)");
  c.type = config::OptimizerType::kSgd;
  c.weight_decay = 0.01;
  EXPECT_EQ(changed_hyper_parameters(written, c), "");
  c.type = config::OptimizerType::kMomentum;
  c.nesterov = true;
  EXPECT_EQ(changed_hyper_parameters(written, c),
            "momentum 0.9 (now 0.5), nesterov false (now true)");
}

// A format 1 file's builds had other defaults; only what the config leaves
// to the (changed) default is named.
TEST(Checkpoint, FormatOneDefaultChangesNameWhatTheConfigLeavesUnset) {
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdamW;
  EXPECT_EQ(format1_default_changes(c),
            "adamw's weight_decay is 0.01 now (was 0); write weight_decay = 0 to keep it");
  c.weight_decay = 0.0;
  EXPECT_EQ(format1_default_changes(c), "");
  c.type = config::OptimizerType::kAdagrad;
  const std::string adagrad = format1_default_changes(c);
  EXPECT_NE(adagrad.find("adagrad's epsilon is 1e-10 now (was 1e-8)"), std::string::npos) << adagrad;
  EXPECT_NE(adagrad.find("initial_accumulator is 0 now (was 0.1 unless set)"), std::string::npos)
      << adagrad;
  c.epsilon = 1e-8;
  c.initial_accumulator = 0.1;
  EXPECT_EQ(format1_default_changes(c), "");
  c.type = config::OptimizerType::kAdam;
  c.epsilon.reset();
  EXPECT_EQ(format1_default_changes(c), "");  // adam's defaults did not change
}

TEST(Checkpoint, EmptyCheckpointRoundTrips) {
  CheckpointData d;
  d.sequence = 1;
  d.learning_rate = 0.5;  // a server always writes a rate > 0
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

// A file under a checkpoint name that is not one is refused by its magic
// before it is read: a sparse 1 TiB file of zeros made start-up end with a
// bare std::bad_alloc (helper-82), naming no file, with valid checkpoints
// beside it.
TEST(Checkpoint, AHugeForeignFileIsRefusedByItsMagicWithoutBeingRead) {
  const auto dir = temp_dir("huge-foreign");
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 5));
  const auto huge = dir / checkpoint_file_name(2, 9);
  { std::ofstream(huge).put('\0'); }
  std::error_code ec;
  std::filesystem::resize_file(huge, std::uintmax_t{1} << 40, ec);
  if (ec) GTEST_SKIP() << "no sparse 1 TiB file here: " << ec.message();
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 1u);
  ASSERT_EQ(loaded->refused.size(), 1u);
  EXPECT_NE(loaded->refused[0].find("not an Ember checkpoint (bad magic)"), std::string::npos)
      << loaded->refused[0];
  ASSERT_EQ(loaded->moved_aside.size(), 1u);
  EXPECT_EQ(loaded->moved_aside[0].filename().string(), checkpoint_file_name(2, 9) + ".corrupt");
  std::filesystem::remove_all(dir);
}

// A file with valid checksums whose entry contradicts itself (a chunk
// outside its tensor: what a hand-edited or buggy writer could produce) is
// corrupt like a damaged one: refused with the entry named, and set aside by
// the loader for the previous checkpoint. It used to pass the reader and
// stop the server's start instead.
TEST(Checkpoint, AnEntryOutsideItsShapeIsCorruptAndTheLoaderFallsBack) {
  struct Case {
    const char* what;
    void (*edit)(EntrySnapshot&);
  };
  const Case cases[] = {
      {"chunk index past the count", [](EntrySnapshot& e) { e.chunk_index = 5; }},
      {"no chunks", [](EntrySnapshot& e) { e.num_chunks = 0; }},
      {"offset past the tensor", [](EntrySnapshot& e) { e.offset_elements = ~std::uint64_t{0} - 7; }},
      {"more elements than the shape", [](EntrySnapshot& e) { e.shape = {2}; }},
      {"shape over the element limit", [](EntrySnapshot& e) { e.shape = {1u << 21, 1u << 21}; }},
  };
  for (const Case& c : cases) {
    CheckpointData d = sample(2);
    c.edit(d.entries[1]);
    auto parsed = parse_checkpoint(serialize_checkpoint(d));
    ASSERT_FALSE(parsed) << c.what;
    EXPECT_EQ(parsed.error().code(), ErrorCode::kCorrupt) << c.what;
    EXPECT_NE(parsed.error().message().find("key 101 chunk"), std::string::npos)
        << c.what << ": " << parsed.error().message();
  }
  const auto dir = temp_dir("inconsistent");
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 5));
  CheckpointData bad = sample(2);
  bad.entries[0].chunk_index = 9;
  ASSERT_TRUE(write_checkpoint(dir, bad, 5));
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 1u);
  ASSERT_EQ(loaded->refused.size(), 1u);
  EXPECT_NE(loaded->refused[0].find("does not fit its shape"), std::string::npos) << loaded->refused[0];
  EXPECT_TRUE(std::filesystem::exists(dir / (checkpoint_file_name(2, 2) + ".corrupt")));
  std::filesystem::remove_all(dir);
}

// A header whose checksum holds but whose learning rate no server writes
// (set_learning_rate keeps it finite and > 0) is refused as corrupt, so the
// loader restores the previous checkpoint instead of a NaN rate.
TEST(Checkpoint, ALearningRateNoServerWritesIsCorruptAndTheLoaderFallsBack) {
  for (const double lr : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                          0.0, -0.1}) {
    CheckpointData d = sample(2);
    d.learning_rate = lr;
    auto parsed = parse_checkpoint(serialize_checkpoint(d));
    ASSERT_FALSE(parsed) << lr;
    EXPECT_EQ(parsed.error().code(), ErrorCode::kCorrupt) << lr;
    EXPECT_NE(parsed.error().message().find("learning rate"), std::string::npos)
        << lr << ": " << parsed.error().message();
  }
  const auto dir = temp_dir("bad-rate");
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 5));
  CheckpointData bad = sample(2);
  bad.learning_rate = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(write_checkpoint(dir, bad, 5));
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 1u);
  EXPECT_EQ(loaded->data->learning_rate, 0.001);
  ASSERT_EQ(loaded->refused.size(), 1u);
  EXPECT_NE(loaded->refused[0].find("learning rate nan"), std::string::npos) << loaded->refused[0];
  std::filesystem::remove_all(dir);
}

std::vector<std::byte> read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

void write_bytes(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Valid 1 and 2, then 3 truncated, 4 with one bit flipped, 5 random bytes,
// 6 empty (the reviewer's repro).
void write_repro(const std::filesystem::path& dir) {
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 10));
  ASSERT_TRUE(write_checkpoint(dir, sample(2), 10));
  std::vector<std::byte> image = serialize_checkpoint(sample(3));
  write_bytes(dir / checkpoint_file_name(2, 3), std::span(image).first(image.size() / 2));
  image = serialize_checkpoint(sample(4));
  image[image.size() / 2] ^= std::byte{0x10};
  write_bytes(dir / checkpoint_file_name(2, 4), image);
  std::mt19937 rng(5);
  for (auto& b : image) b = static_cast<std::byte>(rng());
  write_bytes(dir / checkpoint_file_name(2, 5), image);
  write_bytes(dir / checkpoint_file_name(2, 6), {});
}

TEST(Checkpoint, RefusedFilesAreMovedAsideAndPruningKeepsValidOnes) {
  const auto dir = temp_dir("prune-corrupt");
  write_repro(dir);
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 2u);
  EXPECT_EQ(loaded->path.filename(), checkpoint_file_name(2, 2));
  EXPECT_EQ(loaded->next_sequence, 7u);
  ASSERT_EQ(loaded->refused.size(), 4u);
  ASSERT_EQ(loaded->moved_aside.size(), 4u);
  for (std::uint64_t seq = 3; seq <= 6; ++seq) {
    // Newest first: 6 is refused first.
    const auto& moved = loaded->moved_aside[6 - seq];
    EXPECT_EQ(moved.filename().string(), checkpoint_file_name(2, seq) + ".corrupt");
    EXPECT_TRUE(std::filesystem::exists(moved)) << moved;
    EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_file_name(2, seq)));
  }
  EXPECT_NE(loaded->refused[3].find("truncated"), std::string::npos) << loaded->refused[3];
  EXPECT_NE(loaded->refused[2].find("checksum mismatch"), std::string::npos) << loaded->refused[2];
  // The evidence is byte for byte what was refused.
  EXPECT_TRUE(read_bytes(loaded->moved_aside[3]).size() ==
              serialize_checkpoint(sample(3)).size() / 2);
  EXPECT_TRUE(read_bytes(loaded->moved_aside[0]).empty());

  // The final checkpoint 7 with keep 3: the valid 1 and 2 stay.
  ASSERT_TRUE(write_checkpoint(dir, sample(7), 3));
  auto files = list_checkpoints(dir, 2);
  ASSERT_TRUE(files);
  ASSERT_EQ(files->size(), 3u);
  EXPECT_EQ((*files)[0].first, 7u);
  EXPECT_EQ((*files)[1].first, 2u);
  EXPECT_EQ((*files)[2].first, 1u);
  for (const auto& moved : loaded->moved_aside) EXPECT_TRUE(std::filesystem::exists(moved)) << moved;
  // The restored 2 goes only once keep (here 2) newer valid ones exist.
  ASSERT_TRUE(write_checkpoint(dir, sample(8), 2));
  files = list_checkpoints(dir, 2);
  ASSERT_TRUE(files);
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[0].first, 8u);
  EXPECT_EQ((*files)[1].first, 7u);
  // A restart now restores 8 and refuses nothing.
  auto again = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(again);
  ASSERT_TRUE(again->data);
  EXPECT_EQ(again->data->sequence, 8u);
  EXPECT_TRUE(again->refused.empty());
  std::filesystem::remove_all(dir);
}

// A stray file named with the largest sequence (copied in by hand, or
// hostile) used to make the next sequence wrap to 0: the checkpoint written
// next sorted oldest, and a restart restored an older one (helper-76).
TEST(Checkpoint, ASequenceAboveTheMaximumIsRefusedAndNumberingGoesOn) {
  const auto dir = temp_dir("seq-max");
  ASSERT_TRUE(write_checkpoint(dir, sample(2), 5));
  const std::uint64_t stray = std::numeric_limits<std::uint64_t>::max();
  // Valid contents: only its number is wrong.
  write_bytes(dir / checkpoint_file_name(2, stray), serialize_checkpoint(sample(stray)));
  auto loaded = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(loaded) << loaded.error().to_string();
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 2u);
  EXPECT_EQ(loaded->next_sequence, 3u);
  ASSERT_EQ(loaded->refused.size(), 1u);
  EXPECT_NE(loaded->refused[0].find("above 9007199254740992"), std::string::npos)
      << loaded->refused[0];
  ASSERT_EQ(loaded->moved_aside.size(), 1u);
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_file_name(2, stray)));
  // The highest sequence a server writes is still taken.
  const auto top = dir / checkpoint_file_name(2, kMaxCheckpointSequence);
  write_bytes(top, serialize_checkpoint(sample(kMaxCheckpointSequence)));
  auto again = load_newest_checkpoint(dir, 2);
  ASSERT_TRUE(again);
  ASSERT_TRUE(again->data);
  EXPECT_EQ(again->data->sequence, kMaxCheckpointSequence);
  EXPECT_EQ(again->next_sequence, kMaxCheckpointSequence + 1);
  // ... and the one past it is not written (it would be refused on load).
  auto past = write_checkpoint(dir, sample(kMaxCheckpointSequence + 1), 5);
  ASSERT_FALSE(past);
  EXPECT_EQ(past.error().code(), ErrorCode::kTooLarge) << past.error().to_string();
  // A stray file appearing while the server runs does not count as the
  // newest when pruning: with keep 1 the file just written stays.
  std::filesystem::remove(top);
  write_bytes(dir / checkpoint_file_name(2, stray), serialize_checkpoint(sample(stray)));
  auto written = write_checkpoint(dir, sample(7), 1);
  ASSERT_TRUE(written) << written.error().to_string();
  EXPECT_TRUE(std::filesystem::exists(*written));
  EXPECT_TRUE(std::filesystem::exists(dir / checkpoint_file_name(2, stray)));
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_file_name(2, 2)));  // pruned
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, MovingAsideNeverOverwritesEarlierEvidence) {
  const auto dir = temp_dir("aside-twice");
  ASSERT_TRUE(write_checkpoint(dir, sample(1), 10));
  for (int round = 0; round < 2; ++round) {
    write_bytes(dir / checkpoint_file_name(2, 2), std::vector<std::byte>(static_cast<std::size_t>(round + 1)));
    auto loaded = load_newest_checkpoint(dir, 2);
    ASSERT_TRUE(loaded) << loaded.error().to_string();
    ASSERT_EQ(loaded->moved_aside.size(), 1u);
    EXPECT_EQ(loaded->moved_aside[0].filename().string(),
              checkpoint_file_name(2, 2) + (round == 0 ? ".corrupt" : ".corrupt.1"));
    EXPECT_EQ(read_bytes(loaded->moved_aside[0]).size(), static_cast<std::size_t>(round + 1));
  }
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, LeaveModeKeepsRefusedFilesInPlace) {
  const auto dir = temp_dir("leave");
  write_repro(dir);
  auto loaded = load_newest_checkpoint(dir, 2, RefusedFiles::kLeave);
  ASSERT_TRUE(loaded);
  ASSERT_TRUE(loaded->data);
  EXPECT_EQ(loaded->data->sequence, 2u);
  EXPECT_EQ(loaded->refused.size(), 4u);
  EXPECT_TRUE(loaded->moved_aside.empty());
  EXPECT_EQ(list_checkpoints(dir, 2)->size(), 6u);
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, PrepareDirCreatesItAndLeavesNoProbe) {
  const auto dir = temp_dir("prepare") / "a" / "b";
  ASSERT_TRUE(prepare_checkpoint_dir(dir));
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  ASSERT_TRUE(prepare_checkpoint_dir(dir));  // existing: fine
  std::filesystem::remove_all(temp_dir("prepare"));
}

TEST(Checkpoint, PrepareDirRefusesUncreatableAndFileParents) {
  // Tests may run as root: permissions do not stop root, /proc and a file
  // used as a parent do.
  auto r = prepare_checkpoint_dir("/proc/ember-nope/ckpt");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo);
  EXPECT_NE(r.error().sys_errno(), 0);
  EXPECT_NE(r.error().to_string().find("'/proc/ember-nope/ckpt'"), std::string::npos)
      << r.error().to_string();
  const auto dir = temp_dir("file-parent");
  std::filesystem::create_directories(dir);
  write_bytes(dir / "file", {});
  r = prepare_checkpoint_dir(dir / "file" / "ckpt");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().sys_errno(), ENOTDIR) << r.error().to_string();
  r = prepare_checkpoint_dir(dir / "file");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().to_string().find("file'"), std::string::npos) << r.error().to_string();
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, DirLockIsExclusivePerServerIndexUntilReleased) {
  const auto dir = temp_dir("lock");
  std::filesystem::create_directories(dir);
  auto first = lock_checkpoint_dir(dir, 0);
  ASSERT_TRUE(first) << first.error().to_string();
  EXPECT_TRUE(first->held());
  // Another open file description, as another process would have.
  auto second = lock_checkpoint_dir(dir, 0);
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(second.error().to_string().find(fmt::format(
                "checkpoint_dir '{}' is in use by another ember-server with server_index 0 (pid {})",
                dir.string(), ::getpid())),
            std::string::npos)
      << second.error().to_string();
  auto other_index = lock_checkpoint_dir(dir, 1);  // other file names: shared freely
  EXPECT_TRUE(other_index) << other_index.error().to_string();
  CheckpointDirLock moved = std::move(*first);
  EXPECT_FALSE(lock_checkpoint_dir(dir, 0));  // still held, by `moved`
  moved = CheckpointDirLock();                // released
  EXPECT_TRUE(lock_checkpoint_dir(dir, 0));
  // The lock file has no checkpoint name: the loader ignores it.
  auto loaded = load_newest_checkpoint(dir, 0);
  ASSERT_TRUE(loaded);
  EXPECT_FALSE(loaded->data.has_value());
  EXPECT_TRUE(loaded->refused.empty());
  auto missing = lock_checkpoint_dir(dir / "missing", 0);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code(), ErrorCode::kIo);
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
