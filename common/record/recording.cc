// Reader of recording files; the format is described in recording.h.
// Invariant: a returned Recording only holds ids inside its declared ranges.
#include "common/record/recording.h"

#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace ember::record {

namespace {

std::vector<std::string_view> split_fields(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    if (i == line.size()) break;
    const std::size_t j = line.find(' ', i);
    const std::size_t end = j == std::string_view::npos ? line.size() : j;
    out.push_back(line.substr(i, end - i));
    i = end;
  }
  return out;
}

bool parse_u64(std::string_view text, std::uint64_t& out) {
  if (text.empty()) return false;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && ptr == text.data() + text.size();
}

class Parser {
 public:
  Parser(std::string_view text, std::string_view source_name) : text_(text), name_(source_name) {}

  Result<Recording> run() {
    std::string_view line;
    if (!next_line(line) || line != fmt::format("{} {}", kMagic, kFormatVersion)) {
      if (line.substr(0, kMagic.size()) == kMagic) {
        return fail("unsupported recording version '{}' (this build reads version {})", line,
                    kFormatVersion);
      }
      return fail("not an Ember recording: the first line must be '{} {}'", kMagic, kFormatVersion);
    }
    bool have_channels = false, have_ranks = false, have_start = false, have_interval = false,
         have_source = false, in_data = false;
    while (next_line(line)) {
      if (line.empty() || line[0] == '#') continue;
      if (!in_data) {
        if (line == "data") {
          if (!have_channels || !have_ranks || !have_start || !have_interval || !have_source) {
            return fail("header incomplete before 'data': needs source, start_unix_ns, channels, "
                        "ranks and sample_interval_ns");
          }
          in_data = true;
          continue;
        }
        const std::size_t sp = line.find(' ');
        const std::string_view key = line.substr(0, sp);
        const std::string_view value = sp == std::string_view::npos ? "" : line.substr(sp + 1);
        if (key == "source") {
          rec_.source = std::string(value);
          have_source = true;
          continue;
        }
        std::uint64_t v = 0;
        if (!parse_u64(value, v)) return fail("header field '{}' needs a number, got '{}'", key, value);
        if (key == "start_unix_ns") {
          rec_.start_unix_ns = v;
          have_start = true;
        } else if (key == "channels" || key == "ranks") {
          if (v < 1 || v > 65536) return fail("'{}' must be 1 .. 65536, got {}", key, v);
          (key == "channels" ? rec_.num_channels : rec_.num_ranks) = static_cast<std::uint32_t>(v);
          (key == "channels" ? have_channels : have_ranks) = true;
        } else if (key == "sample_interval_ns") {
          rec_.sample_interval_ns = v;
          have_interval = true;
        } else {
          return fail("unknown header field '{}'", key);
        }
        continue;
      }
      if (rec_.complete) return fail("data after the 'end' line");
      EMBER_TRY(parse_record(line));
    }
    if (!in_data) return fail("no 'data' line: the header is incomplete");
    return std::move(rec_);
  }

 private:
  Status parse_record(std::string_view line) {
    const auto f = split_fields(line);
    if (f.empty()) return fail("a line of only spaces");
    std::uint64_t v[6] = {};
    auto numbers = [&](std::size_t expected) -> Status {
      if (f.size() != expected + 1) {
        return fail("'{}' record needs {} fields, got {}", f[0], expected, f.size() - 1);
      }
      for (std::size_t i = 0; i < expected; ++i) {
        if (!parse_u64(f[i + 1], v[i])) return fail("field {} '{}' is not a number", i + 1, f[i + 1]);
      }
      return ok_status();
    };
    auto channel_ok = [&](std::uint64_t c) -> Status {
      if (c >= rec_.num_channels) return fail("channel {} outside 0 .. {}", c, rec_.num_channels - 1);
      return ok_status();
    };
    if (f[0] == "c") {
      EMBER_TRY(numbers(6));
      EMBER_TRY(channel_ok(v[1]));
      rec_.channel_samples.push_back(
          ChannelSample{v[0], static_cast<std::uint32_t>(v[1]), v[2], v[3], v[4], v[5]});
    } else if (f[0] == "r") {
      EMBER_TRY(numbers(4));
      if (v[1] >= rec_.num_ranks) return fail("rank {} outside 0 .. {}", v[1], rec_.num_ranks - 1);
      rec_.rank_samples.push_back(RankSample{v[0], static_cast<std::uint32_t>(v[1]), v[2], v[3]});
    } else if (f[0] == "h") {
      EMBER_TRY(numbers(4));
      EMBER_TRY(channel_ok(v[0]));
      if (v[2] <= v[1]) return fail("size bucket [{}, {}) is empty", v[1], v[2]);
      rec_.size_buckets.push_back(SizeBucketCount{static_cast<std::uint32_t>(v[0]), v[1], v[2], v[3]});
    } else if (f[0] == "end") {
      EMBER_TRY(numbers(3));
      rec_.complete = true;
      rec_.duration_ns = v[0];
      rec_.out_of_range = v[2];
    } else {
      return fail("unknown record type '{}'", f[0]);
    }
    return ok_status();
  }

  bool next_line(std::string_view& line) {
    if (pos_ >= text_.size()) return false;
    const std::size_t nl = text_.find('\n', pos_);
    const std::size_t end = nl == std::string_view::npos ? text_.size() : nl;
    line = text_.substr(pos_, end - pos_);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    pos_ = end + 1;
    ++line_no_;
    return true;
  }

  template <typename... Args>
  tl::unexpected<Error> fail(fmt::format_string<Args...> format, Args&&... args) const {
    return tl::unexpected<Error>(
        Error(ErrorCode::kCorrupt, fmt::format("{}:{}: {}", name_, line_no_,
                                               fmt::format(format, std::forward<Args>(args)...))));
  }

  std::string_view text_;
  std::string_view name_;
  std::size_t pos_ = 0;
  std::size_t line_no_ = 0;
  Recording rec_;
};

}  // namespace

Result<Recording> parse_recording(std::string_view text, std::string_view source_name) {
  return Parser(text, source_name).run();
}

Result<Recording> load_recording(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    return make_sys_error(err, "cannot read recording '{}'", path.string());
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return make_sys_error(EIO, "cannot read recording '{}'", path.string());
  return parse_recording(ss.str(), path.string());
}

Totals final_totals(const Recording& recording) {
  Totals t;
  t.channels.resize(recording.num_channels);
  for (std::uint32_t c = 0; c < recording.num_channels; ++c) t.channels[c].channel = c;
  t.ranks.resize(recording.num_ranks);
  for (std::uint32_t r = 0; r < recording.num_ranks; ++r) t.ranks[r].rank = r;
  for (const ChannelSample& s : recording.channel_samples) {
    if (s.t_ns >= t.channels[s.channel].t_ns) t.channels[s.channel] = s;
  }
  for (const RankSample& s : recording.rank_samples) {
    if (s.t_ns >= t.ranks[s.rank].t_ns) t.ranks[s.rank] = s;
  }
  return t;
}

}  // namespace ember::record
