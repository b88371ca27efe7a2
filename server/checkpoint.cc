// Checkpoint serialisation, atomic write and validated load; see checkpoint.h.
#include "server/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/logging.h"
#include "common/wire/crc32c.h"

namespace ember::server {
namespace {

constexpr char kFileMagic[8] = {'E', 'M', 'B', 'R', 'C', 'K', 'P', 'T'};
constexpr char kFooterMagic[8] = {'E', 'M', 'B', 'R', 'D', 'O', 'N', 'E'};
// Format 2 added the optimizer's hyper-parameters to the file header; format
// 1 files (64-byte header) are still read.
constexpr std::uint32_t kFormatVersion = 2;
constexpr std::size_t kFileHeaderBytes = 128;
constexpr std::size_t kFileHeaderBytesV1 = 64;
constexpr std::size_t kEntryHeaderBytes = 64;
constexpr std::size_t kFooterBytes = 16;
constexpr std::uint32_t kMaxClocks = 1u << 20;
constexpr std::uint32_t kMaxSlots = 8;

static_assert(std::endian::native == std::endian::little,
              "checkpoint serialisation assumes a little-endian host");

// Appends little-endian values to a byte vector.
class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof v);
  }
  void bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    out_.insert(out_.end(), p, p + n);
  }
  void zeros(std::size_t n) { out_.insert(out_.end(), n, std::byte{0}); }
  std::size_t size() const { return out_.size(); }

 private:
  std::vector<std::byte>& out_;
};

// Reads little-endian values with bounds checks.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  std::size_t pos() const { return pos_; }
  std::size_t left() const { return bytes_.size() - pos_; }
  template <typename T>
  bool get(T& v) {
    if (left() < sizeof v) return false;
    std::memcpy(&v, bytes_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return true;
  }
  bool take(std::size_t n, std::span<const std::byte>& out) {
    if (left() < n) return false;
    out = bytes_.subspan(pos_, n);
    pos_ += n;
    return true;
  }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
};

tl::unexpected<Error> corrupt(std::string message) {
  return tl::unexpected(Error(ErrorCode::kCorrupt, std::move(message)));
}

void put_floats(Writer& w, const std::vector<float>& v) { w.bytes(v.data(), v.size() * sizeof(float)); }

Result<EntrySnapshot> parse_entry(std::span<const std::byte> body, std::size_t index,
                                  std::size_t count) {
  Reader r(body);
  EntrySnapshot e;
  std::uint8_t dtype = 0, ndim = 0, num_slots = 0, reserved8 = 0;
  std::uint32_t num_clocks = 0, reserved32 = 0;
  std::uint64_t num_elements = 0, num_updates = 0;
  bool ok = r.get(e.key) && r.get(e.chunk_index) && r.get(e.num_chunks) &&
            r.get(e.offset_elements) && r.get(num_elements) && r.get(e.version) &&
            r.get(num_updates) && r.get(dtype) && r.get(ndim) && r.get(num_slots) &&
            r.get(reserved8) && r.get(num_clocks) && r.get(reserved32);
  std::uint32_t pad = 0;
  ok = ok && r.get(pad);
  if (!ok || r.pos() != kEntryHeaderBytes) {
    return corrupt(fmt::format("entry {} of {}: record shorter than its {}-byte header", index,
                               count, kEntryHeaderBytes));
  }
  const std::string name = fmt::format("entry {} of {} (key {} chunk {})", index, count, e.key,
                                       e.chunk_index);
  if (dtype != static_cast<std::uint8_t>(proto::DType::kFloat32)) {
    return corrupt(fmt::format("{}: dtype {} is not float32", name, dtype));
  }
  e.dtype = proto::DType::kFloat32;
  if (ndim > proto::kMaxDims || num_slots > kMaxSlots || num_clocks > kMaxClocks ||
      num_elements > proto::kMaxElements) {
    return corrupt(fmt::format("{}: ndim {}, slots {}, clocks {} or elements {} out of range",
                               name, ndim, num_slots, num_clocks, num_elements));
  }
  // Everything that follows must be exactly the rest of the body.
  const std::uint64_t need = 8ull * ndim + 8ull * num_clocks +
                             4ull * num_elements * (1ull + num_slots);
  if (need != r.left()) {
    return corrupt(fmt::format("{}: body holds {} bytes after its header, layout needs {}", name,
                               r.left(), need));
  }
  e.shape.resize(ndim);
  for (auto& d : e.shape) r.get(d);
  // The chunk must lie within its tensor (what the writer always produces);
  // a file that says otherwise is refused here, as corrupt, so that the
  // loader sets it aside and tries an older one.
  std::uint64_t total = 1;
  for (const std::uint64_t d : e.shape) {
    if (d != 0 && total > proto::kMaxElements / d) {
      return corrupt(fmt::format("{}: shape {} holds more than {} elements", name,
                                 fmt::join(e.shape, "x"), proto::kMaxElements));
    }
    total *= d;
  }
  if (e.num_chunks == 0 || e.chunk_index >= e.num_chunks || e.offset_elements > total ||
      num_elements > total - e.offset_elements) {
    return corrupt(fmt::format("{}: chunk {} of {} at elements [{}, +{}) does not fit its shape "
                               "of {} elements",
                               name, e.chunk_index, e.num_chunks, e.offset_elements, num_elements,
                               total));
  }
  e.clocks.resize(num_clocks);
  for (auto& c : e.clocks) r.get(c);
  std::span<const std::byte> raw;
  e.params.resize(num_elements);
  r.take(num_elements * 4, raw);
  if (!raw.empty()) std::memcpy(e.params.data(), raw.data(), raw.size());
  e.optimizer.num_updates = num_updates;
  e.optimizer.slots.resize(num_slots);
  for (auto& slot : e.optimizer.slots) {
    slot.resize(num_elements);
    r.take(num_elements * 4, raw);
    if (!raw.empty()) std::memcpy(slot.data(), raw.data(), raw.size());
  }
  return e;
}

Status sys_fail(int err, std::string_view what, const std::filesystem::path& path) {
  return make_sys_error(err, "checkpoint: {} '{}' failed", what, path.string());
}

Status write_all(int fd, const std::byte* data, std::size_t n, const std::filesystem::path& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return sys_fail(errno, "write", path);
    }
    data += w;
    n -= static_cast<std::size_t>(w);
  }
  return ok_status();
}

Status fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return sys_fail(errno, "open directory", dir);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return sys_fail(err, "fsync directory", dir);
  return ok_status();
}

// Parses "ckpt-s<server>-<seq>.ember"; nullopt when the name does not match.
std::optional<std::uint64_t> sequence_of(const std::string& name, std::uint32_t server_index) {
  const std::string prefix = fmt::format("ckpt-s{:03}-", server_index);
  const std::string suffix = ".ember";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size() - suffix.size();
  std::uint64_t seq = 0;
  auto [ptr, ec] = std::from_chars(first, last, seq);
  if (ec != std::errc() || ptr != last) return std::nullopt;
  return seq;
}

}  // namespace

std::string checkpoint_file_name(std::uint32_t server_index, std::uint64_t sequence) {
  return fmt::format("ckpt-s{:03}-{:010}.ember", server_index, sequence);
}

OptimizerHyperParameters OptimizerHyperParameters::of(const config::OptimizerConfig& c) {
  OptimizerHyperParameters h;
  h.momentum = c.momentum;
  h.nesterov = c.nesterov;
  h.beta1 = c.beta1;
  h.beta2 = c.beta2;
  h.epsilon = c.epsilon_or_default();
  h.weight_decay = c.weight_decay_or_default();
  h.initial_accumulator = c.initial_accumulator;
  return h;
}

std::string changed_hyper_parameters(const OptimizerHyperParameters& written,
                                     const config::OptimizerConfig& now) {
  const OptimizerUses u = optimizer_uses(now.type);
  const OptimizerHyperParameters n = OptimizerHyperParameters::of(now);
  std::vector<std::string> out;
  auto number = [&](bool used, const char* name, double was, double is) {
    if (used && was != is) out.push_back(fmt::format("{} {} (now {})", name, was, is));
  };
  number(u.momentum, "momentum", written.momentum, n.momentum);
  if (u.momentum && written.nesterov != n.nesterov) {
    out.push_back(fmt::format("nesterov {} (now {})", written.nesterov, n.nesterov));
  }
  number(u.betas, "beta1", written.beta1, n.beta1);
  number(u.betas, "beta2", written.beta2, n.beta2);
  number(u.epsilon, "epsilon", written.epsilon, n.epsilon);
  number(true, "weight_decay", written.weight_decay, n.weight_decay);
  number(u.initial_accumulator, "initial_accumulator", written.initial_accumulator,
         n.initial_accumulator);
  return fmt::format("{}", fmt::join(out, ", "));
}

std::string format1_default_changes(const config::OptimizerConfig& now) {
  using T = config::OptimizerType;
  std::vector<std::string> out;
  if (now.type == T::kAdamW && !now.weight_decay) {
    out.push_back("adamw's weight_decay is 0.01 now (was 0); write weight_decay = 0 to keep it");
  }
  if (now.type == T::kAdagrad && !now.epsilon) {
    out.push_back("adagrad's epsilon is 1e-10 now (was 1e-8); write epsilon = 1e-8 to keep it");
  }
  if (now.type == T::kAdagrad && now.initial_accumulator == 0.0) {
    out.push_back("initial_accumulator is 0 now (was 0.1 unless set), for keys init-ed from now "
                  "on; write initial_accumulator = 0.1 to keep it");
  }
  return fmt::format("{}", fmt::join(out, "; "));
}

std::vector<std::byte> serialize_checkpoint(const CheckpointData& data) {
  std::vector<std::byte> out;
  const bool v2 = data.hyper_parameters.has_value();
  const std::size_t header_bytes = v2 ? kFileHeaderBytes : kFileHeaderBytesV1;
  std::size_t total = header_bytes + kFooterBytes;
  for (const auto& e : data.entries) {
    total += 12 + kEntryHeaderBytes + 8 * (e.shape.size() + e.clocks.size()) +
             4 * e.params.size() * (1 + e.optimizer.slots.size());
  }
  out.reserve(total);
  Writer w(out);
  w.bytes(kFileMagic, 8);
  w.put<std::uint32_t>(v2 ? kFormatVersion : 1);
  w.put<std::uint32_t>(data.server_index);
  w.put<std::uint64_t>(data.sequence);
  w.put<std::uint64_t>(data.created_unix_ns);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(data.entries.size()));
  w.put<std::uint32_t>(data.num_workers);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(data.optimizer));
  w.put<std::uint8_t>(static_cast<std::uint8_t>(data.consistency));
  w.zeros(6);
  w.put<double>(data.learning_rate);
  if (v2) {
    const OptimizerHyperParameters& h = *data.hyper_parameters;
    w.put<double>(h.momentum);
    w.put<double>(h.beta1);
    w.put<double>(h.beta2);
    w.put<double>(h.epsilon);
    w.put<double>(h.weight_decay);
    w.put<double>(h.initial_accumulator);
    w.put<std::uint8_t>(h.nesterov ? 1 : 0);
  }
  w.zeros(header_bytes - 4 - w.size());
  const std::uint32_t header_crc = wire::crc32c(std::span<const std::byte>(out.data(), w.size()));
  w.put<std::uint32_t>(header_crc);

  for (const auto& e : data.entries) {
    const std::size_t len_at = w.size();
    w.put<std::uint64_t>(0);  // body length, patched below
    const std::size_t body_at = w.size();
    w.put<std::uint64_t>(e.key);
    w.put<std::uint32_t>(e.chunk_index);
    w.put<std::uint32_t>(e.num_chunks);
    w.put<std::uint64_t>(e.offset_elements);
    w.put<std::uint64_t>(e.params.size());
    w.put<std::uint64_t>(e.version);
    w.put<std::uint64_t>(e.optimizer.num_updates);
    w.put<std::uint8_t>(static_cast<std::uint8_t>(e.dtype));
    w.put<std::uint8_t>(static_cast<std::uint8_t>(e.shape.size()));
    w.put<std::uint8_t>(static_cast<std::uint8_t>(e.optimizer.slots.size()));
    w.put<std::uint8_t>(0);
    w.put<std::uint32_t>(static_cast<std::uint32_t>(e.clocks.size()));
    w.put<std::uint32_t>(0);
    w.put<std::uint32_t>(0);
    for (auto d : e.shape) w.put<std::uint64_t>(d);
    for (auto c : e.clocks) w.put<std::uint64_t>(c);
    put_floats(w, e.params);
    for (const auto& slot : e.optimizer.slots) put_floats(w, slot);
    const std::uint64_t body_len = w.size() - body_at;
    std::memcpy(out.data() + len_at, &body_len, 8);
    const std::uint32_t crc =
        wire::crc32c(std::span<const std::byte>(out.data() + body_at, body_len));
    w.put<std::uint32_t>(crc);
  }
  w.bytes(kFooterMagic, 8);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(data.entries.size()));
  w.put<std::uint32_t>(header_crc);
  return out;
}

Result<CheckpointData> parse_checkpoint(std::span<const std::byte> bytes) {
  Reader r(bytes);
  CheckpointData d;
  char magic[8];
  std::span<const std::byte> raw;
  if (!r.take(8, raw)) {
    return corrupt(fmt::format("truncated: {} bytes, shorter than the file header", bytes.size()));
  }
  std::memcpy(magic, raw.data(), 8);
  if (std::memcmp(magic, kFileMagic, 8) != 0) return corrupt("not an Ember checkpoint (bad magic)");
  std::uint32_t version = 0, num_entries = 0, header_crc = 0;
  std::uint8_t opt = 0, consistency = 0;
  bool ok = r.get(version) && r.get(d.server_index) && r.get(d.sequence) &&
            r.get(d.created_unix_ns) && r.get(num_entries) && r.get(d.num_workers) &&
            r.get(opt) && r.get(consistency) && r.take(6, raw) && r.get(d.learning_rate);
  if (ok && version != 1 && version != kFormatVersion) {
    return corrupt(fmt::format("format version {} (this build reads 1 and {})", version,
                               kFormatVersion));
  }
  const std::size_t header_bytes = version == 1 ? kFileHeaderBytesV1 : kFileHeaderBytes;
  OptimizerHyperParameters h;
  std::uint8_t nesterov = 0;
  if (ok && version == kFormatVersion) {
    ok = r.get(h.momentum) && r.get(h.beta1) && r.get(h.beta2) && r.get(h.epsilon) &&
         r.get(h.weight_decay) && r.get(h.initial_accumulator) && r.get(nesterov);
  }
  ok = ok && r.take(header_bytes - 4 - r.pos(), raw) && r.get(header_crc);
  if (!ok) {
    return corrupt(fmt::format("truncated: {} bytes, shorter than the file header", bytes.size()));
  }
  if (wire::crc32c(bytes.first(header_bytes - 4)) != header_crc) {
    return corrupt("checksum mismatch in the file header");
  }
  if (version == kFormatVersion) {
    // What a server writes passed config validation; anything else did not
    // come from one.
    auto in = [](double v, double lo, bool lo_open, double hi) {
      return std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v < hi;
    };
    const double inf = std::numeric_limits<double>::infinity();
    if (!in(h.momentum, 0, false, 1) || !in(h.beta1, 0, false, 1) || !in(h.beta2, 0, false, 1) ||
        !in(h.epsilon, 0, true, inf) || !in(h.weight_decay, 0, false, inf) ||
        !in(h.initial_accumulator, 0, false, inf) || nesterov > 1) {
      return corrupt(fmt::format(
          "optimizer hyper-parameters no server writes in the file header (momentum {}, beta1 {}, "
          "beta2 {}, epsilon {}, weight_decay {}, initial_accumulator {}, nesterov {})",
          h.momentum, h.beta1, h.beta2, h.epsilon, h.weight_decay, h.initial_accumulator,
          nesterov));
    }
    h.nesterov = nesterov == 1;
    d.hyper_parameters = h;
  }
  if (opt > static_cast<std::uint8_t>(config::OptimizerType::kAdagrad) ||
      consistency > static_cast<std::uint8_t>(proto::Consistency::kSsp)) {
    return corrupt(fmt::format("unknown optimizer {} or consistency {}", opt, consistency));
  }
  d.optimizer = static_cast<config::OptimizerType>(opt);
  d.consistency = static_cast<proto::Consistency>(consistency);
  // The writer records the rate in force, which Optimizer::set_learning_rate
  // keeps finite and > 0: anything else was not written by a server.
  if (!std::isfinite(d.learning_rate) || d.learning_rate <= 0.0) {
    return corrupt(fmt::format("learning rate {} in the file header (a server writes a finite rate > 0)",
                               d.learning_rate));
  }
  // Each record takes at least 12 + 64 bytes: bound the count before reserving.
  if (num_entries > r.left() / (12 + kEntryHeaderBytes)) {
    return corrupt(fmt::format("truncated: header announces {} entries but only {} bytes follow",
                               num_entries, r.left()));
  }
  d.entries.reserve(num_entries);
  for (std::uint32_t i = 0; i < num_entries; ++i) {
    const std::size_t at = r.pos();
    std::uint64_t body_len = 0;
    std::uint32_t crc = 0;
    if (!r.get(body_len) || body_len > r.left() || !r.take(body_len, raw) || !r.get(crc)) {
      return corrupt(fmt::format("truncated: ends at byte {} inside entry {} of {} (record at {})",
                                 bytes.size(), i, num_entries, at));
    }
    if (wire::crc32c(raw) != crc) {
      std::uint64_t key = 0;
      std::uint32_t chunk = 0;
      if (raw.size() >= 12) {
        std::memcpy(&key, raw.data(), 8);
        std::memcpy(&chunk, raw.data() + 8, 4);
      }
      return corrupt(fmt::format("checksum mismatch in the record of key {} chunk {} (entry {} of "
                                 "{}, at byte {})",
                                 key, chunk, i, num_entries, at));
    }
    EMBER_ASSIGN_OR_RETURN(EntrySnapshot e, parse_entry(raw, i, num_entries));
    d.entries.push_back(std::move(e));
  }
  std::uint32_t footer_count = 0, footer_crc = 0;
  if (!r.take(8, raw) || !r.get(footer_count) || !r.get(footer_crc)) {
    return corrupt(fmt::format("truncated: ends at byte {} before the footer", bytes.size()));
  }
  if (std::memcmp(raw.data(), kFooterMagic, 8) != 0 || footer_count != num_entries ||
      footer_crc != header_crc) {
    return corrupt("footer does not match the header (bad magic, count or checksum)");
  }
  if (r.left() != 0) {
    return corrupt(fmt::format("{} unexpected bytes after the footer", r.left()));
  }
  return d;
}

Result<std::filesystem::path> write_checkpoint(const std::filesystem::path& dir,
                                               const CheckpointData& data, std::uint32_t keep) {
  if (data.sequence > kMaxCheckpointSequence) {
    return make_error(ErrorCode::kTooLarge,
                      "checkpoint: sequence number {} is above {}, the highest a server writes; "
                      "move the checkpoints in '{}' elsewhere to number from 1 again",
                      data.sequence, kMaxCheckpointSequence, dir.string());
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return make_sys_error(ec.value(), "checkpoint: cannot create directory '{}'", dir.string());
  }
  const std::filesystem::path final_path =
      dir / checkpoint_file_name(data.server_index, data.sequence);
  // (fmt, not "." + string: GCC 12's -Wrestrict misfires on that at -O2.)
  const std::filesystem::path tmp_path = dir / fmt::format(".{}.tmp", final_path.filename().string());
  const std::vector<std::byte> image = serialize_checkpoint(data);

  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return tl::unexpected(sys_fail(errno, "create", tmp_path).error());
  Status st = write_all(fd, image.data(), image.size(), tmp_path);
  if (st && ::fsync(fd) != 0) st = sys_fail(errno, "fsync", tmp_path);
  if (::close(fd) != 0 && st) st = sys_fail(errno, "close", tmp_path);
  if (st && ::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    st = sys_fail(errno, "rename to " + final_path.string(), tmp_path);
  }
  if (!st) {
    ::unlink(tmp_path.c_str());
    return tl::unexpected(st.error());
  }
  EMBER_TRY(fsync_dir(dir));

  // Keep the newest `keep` of this server. A file numbered above the
  // maximum (put there by hand while it runs) is not one it wrote: neither
  // counted nor deleted (the next start refuses it).
  EMBER_ASSIGN_OR_RETURN(auto files, list_checkpoints(dir, data.server_index));
  std::erase_if(files, [](const auto& f) { return f.first > kMaxCheckpointSequence; });
  for (std::size_t i = std::max<std::uint32_t>(keep, 1); i < files.size(); ++i) {
    std::filesystem::remove(files[i].second, ec);
    if (ec) {
      log::logger("checkpoint")->warn("cannot delete old checkpoint '{}': {}",
                                      files[i].second.string(), ec.message());
    }
  }
  return final_path;
}

Result<std::vector<std::pair<std::uint64_t, std::filesystem::path>>> list_checkpoints(
    const std::filesystem::path& dir, std::uint32_t server_index) {
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> out;
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return out;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file()) continue;
    if (auto seq = sequence_of(entry.path().filename().string(), server_index)) {
      out.emplace_back(*seq, entry.path());
    }
  }
  if (ec) {
    return make_sys_error(ec.value(), "checkpoint: cannot list directory '{}'", dir.string());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

namespace {

// Reads the whole file into `image`. Returns "" when read, or the reason the
// file is not a checkpoint (a foreign file: refused without being read or
// allocated; a sparse 1 TiB file ended start-up with a bare bad_alloc).
// Errors (the file may well be a good checkpoint, so it must be neither
// refused nor moved aside): kIo when it cannot be opened or read, or when its
// size does not fit in this process's memory.
Result<std::string> read_whole_file(const std::filesystem::path& path, std::vector<std::byte>& image) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_sys_error(errno, "cannot open checkpoint '{}'", path.string());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return make_sys_error(errno, "cannot stat checkpoint '{}'", path.string());
  char magic[sizeof kFileMagic] = {};
  const ssize_t head = ::pread(fd, magic, sizeof magic, 0);
  if (head == static_cast<ssize_t>(sizeof magic) && std::memcmp(magic, kFileMagic, sizeof magic) != 0) {
    return std::string("not an Ember checkpoint (bad magic)");
  }
  try {
    image.resize(static_cast<std::size_t>(st.st_size));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kIo,
                      "checkpoint '{}' has {} bytes, more than this process can allocate: give the "
                      "server more memory (or raise ulimit -v / LimitAS), or move the file out of "
                      "the directory to start from an older checkpoint",
                      path.string(), st.st_size);
  }
  std::size_t got = 0;
  while (got < image.size()) {
    const ssize_t n = ::read(fd, image.data() + got, image.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return make_sys_error(errno, "cannot read checkpoint '{}' at byte {}", path.string(), got);
    }
    if (n == 0) break;  // shrank since fstat: parsed as truncated
    got += static_cast<std::size_t>(n);
  }
  image.resize(got);
  return std::string();
}

// Renames `path` to "<path>.corrupt" or, when taken, "<path>.corrupt.<n>".
Result<std::filesystem::path> move_aside(const std::filesystem::path& path) {
  std::error_code ec;
  for (int n = 0; n < 1000; ++n) {
    std::filesystem::path to = path;
    to += n == 0 ? std::string(".corrupt") : fmt::format(".corrupt.{}", n);
    if (std::filesystem::exists(to, ec) || ec) continue;
    if (::rename(path.c_str(), to.c_str()) != 0) {
      return make_sys_error(errno,
                            "checkpoint: cannot move refused checkpoint '{}' aside to '{}' (move or "
                            "delete it by hand; left in place it would count toward "
                            "[server] checkpoint_keep)",
                            path.string(), to.string());
    }
    return to;
  }
  return make_error(ErrorCode::kIo,
                    "checkpoint: cannot move refused checkpoint '{}' aside: '{}.corrupt' to "
                    "'{}.corrupt.999' all exist; delete old ones",
                    path.string(), path.string(), path.string());
}

}  // namespace

Result<LoadResult> load_newest_checkpoint(const std::filesystem::path& dir,
                                          std::uint32_t server_index, RefusedFiles refused_files) {
  EMBER_ASSIGN_OR_RETURN(auto files, list_checkpoints(dir, server_index));
  LoadResult result;
  for (const auto& f : files) {
    if (f.first <= kMaxCheckpointSequence) {
      result.next_sequence = f.first + 1;  // files are newest first
      break;
    }
  }
  auto log = log::logger("checkpoint");
  for (const auto& [seq, path] : files) {
    std::vector<std::byte> image;
    std::string reason;
    if (seq > kMaxCheckpointSequence) {
      // Numbering after it would wrap to 0, and the next restart would
      // restore an older file than the one written last.
      reason = fmt::format("its sequence number {} is above {}, the highest a server writes, so "
                           "no server wrote it",
                           seq, kMaxCheckpointSequence);
    } else {
      auto read = read_whole_file(path, image);
      if (!read) {
        log->error("cannot restore checkpoint '{}': {}", path.string(), read.error().to_string());
        return tl::unexpected(read.error());
      }
      reason = std::move(*read);
    }
    if (reason.empty()) {
      auto parsed = parse_checkpoint(image);
      if (parsed && parsed->server_index != server_index) {
        reason = fmt::format("written by server {}, this is server {}", parsed->server_index,
                             server_index);
      } else if (parsed) {
        result.data = std::move(*parsed);
        result.path = path;
        break;
      } else {
        reason = parsed.error().message();
      }
    }
    result.refused.push_back(fmt::format("{}: {}", path.string(), reason));
    if (refused_files == RefusedFiles::kLeave) {
      log->error("refusing checkpoint '{}': {}; trying an older one", path.string(), reason);
      continue;
    }
    auto moved = move_aside(path);
    if (!moved) {
      log->error("refusing checkpoint '{}': {}", path.string(), reason);
      Error err = moved.error();
      err.with_context(fmt::format("refused checkpoint '{}' ({})", path.string(), reason));
      return tl::unexpected(err);
    }
    log->error("refusing checkpoint '{}': {}; moved it to '{}', trying an older one",
               path.string(), reason, moved->string());
    result.moved_aside.push_back(std::move(*moved));
  }
  if (!result.moved_aside.empty()) EMBER_TRY(fsync_dir(dir));
  return result;
}

Status prepare_checkpoint_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return make_sys_error(ec.value(), "checkpoint directory '{}': cannot create directory",
                          dir.string());
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return make_sys_error(ec ? ec.value() : ENOTDIR, "checkpoint directory '{}': is not a directory",
                          dir.string());
  }
  if (Status st = probe_writable(dir); !st) {
    Error err = st.error();
    err.with_context(fmt::format("checkpoint directory '{}'", dir.string()));
    return tl::unexpected(err);
  }
  return ok_status();
}

CheckpointDirLock& CheckpointDirLock::operator=(CheckpointDirLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

namespace {

std::filesystem::path lock_path(const std::filesystem::path& dir, std::uint32_t server_index) {
  return dir / fmt::format(".ember-s{:03}.lock", server_index);
}

// kUnavailable: `dir`'s lock of `server_index` is held; `fd` is the lock
// file, whose content names the holder's pid.
Error dir_in_use(const std::filesystem::path& dir, std::uint32_t server_index, int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string owner(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!owner.empty() && (owner.back() == '\n' || owner.back() == ' ')) owner.pop_back();
  return Error(ErrorCode::kUnavailable,
               fmt::format("checkpoint_dir '{}' is in use by another ember-server with server_index "
                           "{}{}: give each job its own checkpoint_dir, or stop that server first",
                           dir.string(), server_index,
                           owner.empty() ? std::string() : fmt::format(" (pid {})", owner)));
}

}  // namespace

Status check_checkpoint_dir_free(const std::filesystem::path& dir, std::uint32_t server_index) {
  const int fd = ::open(lock_path(dir, server_index).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ok_status();  // no lock file (or none readable): nobody to name
  Status result = ok_status();
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) result = tl::unexpected(dir_in_use(dir, server_index, fd));
  }  // else: taken, and given back by the close
  ::close(fd);
  return result;
}

Result<CheckpointDirLock> lock_checkpoint_dir(const std::filesystem::path& dir,
                                              std::uint32_t server_index) {
  const std::filesystem::path path = lock_path(dir, server_index);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return make_sys_error(errno, "cannot create the lock file '{}'", path.string());
  CheckpointDirLock lock(fd);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {
      // A file system without flock (NFSv3 without lockd, Lustre without
      // -o flock, some FUSE mounts): checkpoints work as before, unguarded.
      log::logger("checkpoint")->warn(
          "checkpoint_dir '{}' does not support flock ({}): a second server with server_index {} "
          "on it would not be detected; give each job its own checkpoint_dir",
          dir.string(), std::strerror(err), server_index);
      return CheckpointDirLock();
    }
    if (err != EWOULDBLOCK) {
      return make_sys_error(err, "cannot lock '{}'", path.string());
    }
    return tl::unexpected(dir_in_use(dir, server_index, fd));
  }
  // The owner's pid, for the message above: informational (the flock
  // decides), so a full file system only leaves it out.
  const std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    log::logger("checkpoint")->warn("could not write this server's pid into the lock file '{}'",
                                path.string());
  }
  return lock;
}

Status probe_writable(const std::filesystem::path& dir) {
  const std::filesystem::path probe = dir / fmt::format(".ember-write-probe-{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return make_sys_error(errno, "cannot create a file in '{}'", dir.string());
  ::close(fd);
  if (::unlink(probe.c_str()) != 0) {
    return make_sys_error(errno, "cannot remove the probe file '{}'", probe.string());
  }
  return ok_status();
}

}  // namespace ember::server
