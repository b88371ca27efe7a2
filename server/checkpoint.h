// Checkpoints of a server's parameters and optimizer state.
//
// One file per checkpoint and server: <dir>/ckpt-s<server:3>-<sequence:10>.ember.
// Written atomically: a temporary file in the same directory is written,
// fsync()ed, renamed over the final name, and the directory is fsync()ed, so
// a crash leaves either the previous set of checkpoints or the new one, never
// a half-written file under a final name. After a successful write the files
// beyond the newest `keep` of this server are deleted; only well-named
// checkpoint files count, and restore renames the files it refuses aside
// ("<name>.corrupt"), so corrupt files never displace valid ones.
//
// Checksums are CRC32C (RFC 3720 B.4; common/wire/crc32c.h).
//
// Layout (little-endian; docs/checkpoint-format.md has the table):
//   file header   128 bytes (format 2; 64 in format 1): magic "EMBRCKPT",
//                 format version, server index, sequence, creation time,
//                 entry count, worker count, optimizer type, consistency,
//                 learning rate, (format 2) the other optimizer
//                 hyper-parameters, CRC32C of the preceding header bytes
//   entry record  u64 body length, body, u32 CRC32C of the body; the body is
//                 a 64-byte entry header (key, chunk, layout, version,
//                 optimizer update count, dtype, ndim, slot count, clock
//                 count), the shape, the per-rank clocks, the parameters and
//                 each optimizer slot (float32)
//   footer        16 bytes: magic "EMBRDONE", entry count, CRC32C of the
//                 file header
// A file that ends early, has a bad magic, a record CRC that does not match
// (naming the key), a count that disagrees or trailing bytes is refused.
//
// Trust nothing: parse_checkpoint bounds every length by the bytes present
// before using it (checkpoint_fuzz exercises it).
//
// Thread-safety: free functions; write and load block on file I/O and are
// meant for the checkpoint thread and for start-up.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/base/error.h"
#include "common/config/config.h"
#include "server/shard_core.h"

namespace ember::server {

// The optimizer settings a checkpoint was written under, besides the type
// and the learning rate: what config::OptimizerConfig holds, with epsilon and
// weight_decay resolved (epsilon_or_default, weight_decay_or_default).
struct OptimizerHyperParameters {
  double momentum = 0.0;
  bool nesterov = false;
  double beta1 = 0.0;
  double beta2 = 0.0;
  double epsilon = 0.0;
  double weight_decay = 0.0;
  double initial_accumulator = 0.0;

  // From a config, epsilon and weight_decay resolved.
  static OptimizerHyperParameters of(const config::OptimizerConfig& c);
  bool operator==(const OptimizerHyperParameters&) const = default;
};

// The [optimizer] numbers that `now` uses and that differ from what a
// checkpoint was written with, as "beta2 0.999 (now 0.99), ..." (the
// checkpoint's value first); "" when none does. The server logs them on
// restore: the restored moments continue under the new values.
std::string changed_hyper_parameters(const OptimizerHyperParameters& written,
                                     const config::OptimizerConfig& now);

// For a format 1 checkpoint (no hyper-parameters stored): the [optimizer]
// defaults that changed since the builds that wrote format 1 and that `now`
// leaves to them (adamw weight_decay 0 -> 0.01, adagrad epsilon 1e-8 ->
// 1e-10 and initial_accumulator 0.1 -> 0), each with the line that keeps the
// old value; "" when none applies.
std::string format1_default_changes(const config::OptimizerConfig& now);

struct CheckpointData {
  std::uint32_t server_index = 0;
  std::uint64_t sequence = 0;
  std::uint64_t created_unix_ns = 0;
  std::uint32_t num_workers = 0;
  config::OptimizerType optimizer = config::OptimizerType::kSgd;
  proto::Consistency consistency = proto::Consistency::kBsp;
  double learning_rate = 0.0;
  // Written and read in format 2. nullopt: a format 1 file (written before
  // they were stored); serialize_checkpoint then writes format 1.
  std::optional<OptimizerHyperParameters> hyper_parameters;
  std::vector<EntrySnapshot> entries;

  bool operator==(const CheckpointData&) const = default;
};

// Serialises `data` to its file image (used by write_checkpoint and tests).
std::vector<std::byte> serialize_checkpoint(const CheckpointData& data);

// Parses a file image, format 1 or 2. Errors: kCorrupt with what is wrong and where
// ("truncated: ends at byte 812 inside entry 3 of 6", "checksum mismatch in
// the record of key 7 chunk 0").
[[nodiscard]] Result<CheckpointData> parse_checkpoint(std::span<const std::byte> bytes);

// "ckpt-s000-0000000012.ember"
std::string checkpoint_file_name(std::uint32_t server_index, std::uint64_t sequence);

// The highest sequence number a server writes (2^53: at one checkpoint a
// second, 285 million years). load_newest_checkpoint refuses a file named
// above it, which a server never wrote: numbering after it would wrap.
inline constexpr std::uint64_t kMaxCheckpointSequence = std::uint64_t{1} << 53;

// Writes `data` atomically into `dir` (created if missing) and prunes older
// files of the same server beyond `keep` (>= 1). Returns the final path.
// Errors: kIo naming the path and the failed call (the temporary file is
// removed); kTooLarge when data.sequence > kMaxCheckpointSequence.
[[nodiscard]] Result<std::filesystem::path> write_checkpoint(const std::filesystem::path& dir,
                                                             const CheckpointData& data,
                                                             std::uint32_t keep);

// Checkpoint files of `server_index` in `dir`, newest (highest sequence)
// first. A missing directory is an empty list. Errors: kIo.
[[nodiscard]] Result<std::vector<std::pair<std::uint64_t, std::filesystem::path>>>
list_checkpoints(const std::filesystem::path& dir, std::uint32_t server_index);

struct LoadResult {
  std::optional<CheckpointData> data;  // the newest valid checkpoint, if any
  std::filesystem::path path;          // its file
  // One past the highest sequence seen (valid or not), of those not above
  // kMaxCheckpointSequence.
  std::uint64_t next_sequence = 1;
  std::vector<std::string> refused;    // "<path>: <reason>" for each file refused
  // Where each refused file now lies (kMoveAside only), in the order refused.
  std::vector<std::filesystem::path> moved_aside;
};

// What load_newest_checkpoint does with a file it refuses.
enum class RefusedFiles {
  // Rename it to "<name>.corrupt" (or "<name>.corrupt.<n>" when that exists)
  // in the same directory, keeping it as evidence: it no longer has a
  // checkpoint name, so pruning after the next write counts (and deletes)
  // only valid checkpoints, and the restored one stays the newest file.
  kMoveAside,
  // Leave it in place (read-only inspection).
  kLeave,
};

// Tries this server's checkpoints newest first and returns the first that
// parses; each refused file (foreign, corrupt, truncated, or written by
// another server) is logged at error level once ("refusing checkpoint
// <path>: <reason>; moved it to '<path>.corrupt', trying an older one" under
// kMoveAside, "refusing checkpoint <path>: <reason>; trying an older one"
// under kLeave). Errors: kIo when the directory cannot be listed, when a
// refused file cannot be moved aside (naming it: it would otherwise count
// toward the files pruning keeps and cost a valid checkpoint), or when a file
// cannot be opened or read, or is larger than this process can allocate: it
// may be a good checkpoint, so it is left in place and the start fails,
// naming it, rather than fall back to an older one.
[[nodiscard]] Result<LoadResult> load_newest_checkpoint(
    const std::filesystem::path& dir, std::uint32_t server_index,
    RefusedFiles refused_files = RefusedFiles::kMoveAside);

// Creates `dir` (and its parents) when missing and proves that files can be
// created in it: creates and removes an empty ".ember-write-probe-<pid>"
// file (no fsync). Blocks on file I/O; meant for start-up, before the first
// checkpoint is due. Errors: kIo naming `dir`, the failed step ("cannot
// create directory", "is not a directory", "cannot create a file in it",
// "cannot remove probe file") and the errno.
[[nodiscard]] Status prepare_checkpoint_dir(const std::filesystem::path& dir);

// Exclusive use of a checkpoint directory by one server index, for as long
// as the object lives: an flock(2) on "<dir>/.ember-s000.lock" (the index in
// the name), which also holds the owner's pid for the error below. Two live
// servers with the same index and directory (two jobs given one
// checkpoint_dir) would restore each other's state, number their files alike
// and replace each other's checkpoints; the second one is refused instead.
// The kernel drops the lock when its process dies (kill -9 included), so a
// restarted server finds it free. Servers of other indexes share a
// directory freely (their files have other names). Move-only.
class CheckpointDirLock {
 public:
  CheckpointDirLock() = default;
  explicit CheckpointDirLock(int fd) : fd_(fd) {}
  CheckpointDirLock(CheckpointDirLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  CheckpointDirLock& operator=(CheckpointDirLock&& o) noexcept;
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  ~CheckpointDirLock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Takes the lock of `server_index` in the existing directory `dir` without
// waiting. Blocks on file I/O only. On a file system without flock (ENOLCK,
// ENOSYS, EOPNOTSUPP, EINVAL) it logs a warning and returns a lock that is
// not held(): checkpoints work, a second server is not detected. Errors:
// kUnavailable when another
// process holds it ("checkpoint_dir '<dir>' is in use by another
// ember-server with server_index 0 (pid 1234): give each job its own
// checkpoint_dir, or stop that server first"); kIo naming the lock file and
// the errno when it cannot be created or locked.
[[nodiscard]] Result<CheckpointDirLock> lock_checkpoint_dir(const std::filesystem::path& dir,
                                                            std::uint32_t server_index);

// Whether a live process holds `dir`'s lock of `server_index`, without
// creating or writing anything: the lock file is opened read-only (none:
// free) and flock'ed and unlocked at once. For --check-config. Errors:
// kUnavailable with lock_checkpoint_dir's message (naming the holder's pid).
[[nodiscard]] Status check_checkpoint_dir_free(const std::filesystem::path& dir,
                                               std::uint32_t server_index);

// Whether this process can create (and remove) a file in the existing
// directory `dir`: creates and unlinks ".ember-write-probe-<pid>" (a
// leftover of that name is overwritten). Errors: kIo with errno, naming the
// directory or the probe file.
[[nodiscard]] Status probe_writable(const std::filesystem::path& dir);

}  // namespace ember::server
