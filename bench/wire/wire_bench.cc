// ember-bench-wire: throughput of Ember's batch framer beside naive framers,
// in one process, checksums included.
//
// Ember: BatchEncoder (small messages packed into 4 KiB batches, one CRC32C
// per batch), encode_single (large: CRC over the caller's buffer, no copy;
// the prefix goes out with a gathered write), FrameDecoder (prepare/commit
// receive; large bodies land in a caller-supplied block).
// Peers, the usual hand-rolled framing: every message gets its own
// [u32 length][u32 checksum] header and is copied into one send buffer; the
// receiver parses, verifies and, for large messages, copies the payload out
// to its destination. Checksum: CRC32C by ISA-L ("naive_crc32c", same CRC as
// Ember: isolates the framing) or zlib's crc32 ("naive_zlib", the common choice).
//
// A "socket" is simulated by memcpy in 64 KiB reads for every decoder alike
// (the kernel's copy), so decode rates include one copy of every byte.
// Each case runs every implementation once per repetition, interleaved;
// the table shows medians. Timings never fail the run; wrong bytes do.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <zlib.h>

#include "common/base/check.h"
#include "common/wire/batch_encoder.h"
#include "common/wire/crc32c.h"
#include "common/wire/frame_decoder.h"

namespace {

using Bytes = std::vector<std::byte>;
using Clock = std::chrono::steady_clock;
namespace wire = ember::wire;

constexpr std::size_t kRecvBytes = 64 << 10;  // one simulated recv()

std::uint64_t g_sink = 0;  // consumed bytes feed it so no work is optimised away

void consume(std::span<const std::byte> p) {
  g_sink += p.size() + (p.empty() ? 0 : static_cast<std::uint8_t>(p[0]) +
                                            static_cast<std::uint8_t>(p[p.size() - 1]));
}

std::uint32_t zlib_crc(std::span<const std::byte> b) {
  // zlib's crc32 takes a uInt length; our pieces are < 4 GiB.
  return static_cast<std::uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(b.data()), static_cast<uInt>(b.size())));
}

using CrcFn = std::uint32_t (*)(std::span<const std::byte>);
std::uint32_t isal_crc(std::span<const std::byte> b) { return wire::crc32c(b); }

// ---------------------------------------------------------------------------
// Naive per-message framing: [u32 length][u32 crc][payload].

// Writes one message at dst (room for 8 + payload bytes); returns the bytes written.
std::size_t naive_encode(std::byte* dst, std::span<const std::byte> payload, CrcFn crc) {
  const std::uint32_t len = static_cast<std::uint32_t>(payload.size());
  const std::uint32_t sum = crc(payload);
  std::memcpy(dst, &len, 4);
  std::memcpy(dst + 4, &sum, 4);
  std::memcpy(dst + 8, payload.data(), payload.size());
  return 8 + payload.size();
}

void naive_append(Bytes& out, std::span<const std::byte> payload, CrcFn crc) {
  const std::size_t at = out.size();
  out.resize(at + 8 + payload.size());
  naive_encode(out.data() + at, payload, crc);
}

class NaiveDecoder {
 public:
  explicit NaiveDecoder(CrcFn crc) : crc_(crc), buf_(kRecvBytes * 2) {}
  std::span<std::byte> prepare() {
    if (buf_.size() - end_ < kRecvBytes) {
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
      if (buf_.size() - end_ < kRecvBytes) buf_.resize(end_ + kRecvBytes);
    }
    return {buf_.data() + end_, buf_.size() - end_};
  }
  // on_message(payload) for each complete, verified message.
  template <typename F>
  void commit(std::size_t n, F&& on_message) {
    end_ += n;
    while (end_ - begin_ >= 8) {
      std::uint32_t len = 0, sum = 0;
      std::memcpy(&len, buf_.data() + begin_, 4);
      std::memcpy(&sum, buf_.data() + begin_ + 4, 4);
      if (end_ - begin_ < 8 + std::size_t{len}) {
        if (buf_.size() - begin_ < 8 + std::size_t{len}) {  // grow to hold it
          std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
          end_ -= begin_;
          begin_ = 0;
          buf_.resize(std::max(buf_.size(), 8 + std::size_t{len} + kRecvBytes));
        }
        return;
      }
      const std::span<const std::byte> payload(buf_.data() + begin_ + 8, len);
      EMBER_CHECK(crc_(payload) == sum);
      on_message(payload);
      begin_ += 8 + len;
    }
  }

 private:
  CrcFn crc_;
  Bytes buf_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
};

// ---------------------------------------------------------------------------
// Timing helpers

double seconds_of(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Copies `stream` into a receiver through prepare()/commit() in kRecvBytes reads.
template <typename Prepare, typename Commit>
void pump(std::span<const std::byte> stream, Prepare&& prepare, Commit&& commit) {
  for (std::size_t at = 0; at < stream.size();) {
    std::span<std::byte> dst = prepare();
    const std::size_t n = std::min({dst.size(), kRecvBytes, stream.size() - at});
    std::memcpy(dst.data(), stream.data() + at, n);  // the kernel's copy in a real recv
    at += n;
    commit(n);
  }
}

// A BodyAllocator handing out one reusable block (a page-pool block stand-in).
class OneBlock : public wire::BodyAllocator {
 public:
  explicit OneBlock(std::size_t bytes) : block_(bytes, std::byte{0}) {}
  ember::Result<std::span<std::byte>> allocate_body(const wire::FrameInfo&,
                                                    std::size_t body_bytes) override {
    EMBER_CHECK(body_bytes <= block_.size());
    return std::span<std::byte>(block_);
  }
  void release_body(std::span<std::byte>) noexcept override {}

 private:
  Bytes block_;
};

void drain_frames(wire::FrameDecoder& dec, std::size_t* messages) {
  for (;;) {
    auto frame = dec.next();
    EMBER_CHECK_MSG(frame.has_value(), "{}", frame ? "" : frame.error().to_string());
    if (!*frame) return;
    for (wire::Item item : **frame) {
      consume(item.payload);
      ++*messages;
    }
  }
}

struct Options {
  int reps = 7;
  std::size_t large_bytes = 4 << 20;
  std::size_t large_count = 16;
  std::size_t small_bytes = 64;
  std::size_t small_count = 300000;
  std::size_t threshold = wire::kDefaultBatchThresholdBytes;
};

struct Row {
  std::string name;
  std::string unit;
  std::map<std::string, std::vector<double>> samples;  // impl -> per-rep value
  double med(const std::string& impl) const {
    auto it = samples.find(impl);
    return it == samples.end() ? 0 : median(it->second);
  }
};

const char* const kImpls[] = {"ember", "naive_crc32c", "naive_zlib"};

}  // namespace

int run(const Options& o) {
  std::mt19937_64 rng(42);
  auto random_bytes = [&](std::size_t n) {
    Bytes b(n);
    for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng()));
    return b;
  };

  // Inputs.
  std::vector<Bytes> large(o.large_count);
  for (auto& b : large) b = random_bytes(o.large_bytes);
  // Small messages: small_count sends drawn in turn from kSmallDistinct
  // buffers (256 KiB at 64 B: cache-resident, like messages fresh in a ring),
  // so the rate measures framing rather than DRAM reads of the sources.
  constexpr std::size_t kSmallDistinct = 4096;
  std::vector<Bytes> distinct(kSmallDistinct);
  for (auto& b : distinct) b = random_bytes(o.small_bytes);
  std::vector<std::span<const std::byte>> small(o.small_count);
  for (std::size_t i = 0; i < small.size(); ++i) small[i] = distinct[i % kSmallDistinct];
  const double large_total = static_cast<double>(o.large_bytes * o.large_count);
  const double small_total = static_cast<double>(o.small_bytes * o.small_count);

  auto enc = wire::BatchEncoder::create({.batch_threshold_bytes = o.threshold});
  EMBER_CHECK_MSG(enc.has_value(), "{}", enc ? "" : enc.error().to_string());
  EMBER_CHECK_MSG(o.large_bytes > enc->max_batched_payload_bytes(),
                  "--large-bytes must exceed the batch threshold");
  EMBER_CHECK_MSG(o.small_bytes <= enc->max_batched_payload_bytes(),
                  "--small-bytes must fit a batch");

  // Wire streams, built once (outside timing) for the decode cases.
  Bytes ember_large_stream, ember_small_stream;
  for (const Bytes& b : large) {
    std::array<std::byte, wire::kSinglePrefixBytes> prefix;
    auto s = wire::encode_single(prefix, b);
    ember_large_stream.insert(ember_large_stream.end(), s->prefix.begin(), s->prefix.end());
    ember_large_stream.insert(ember_large_stream.end(), b.begin(), b.end());
    ember_large_stream.insert(ember_large_stream.end(), s->padding.begin(), s->padding.end());
  }
  Bytes block(o.threshold);
  {
    enc->begin(block);
    for (const auto& m : small) {
      if (!enc->try_add(m)) {
        auto f = enc->finish();
        ember_small_stream.insert(ember_small_stream.end(), f.begin(), f.end());
        enc->begin(block);
        EMBER_CHECK(enc->try_add(m));
      }
    }
    auto f = enc->finish();
    ember_small_stream.insert(ember_small_stream.end(), f.begin(), f.end());
  }
  std::map<std::string, Bytes> naive_large_stream, naive_small_stream;
  const std::map<std::string, CrcFn> crc_of = {{"naive_crc32c", &isal_crc},
                                               {"naive_zlib", &zlib_crc}};
  for (const auto& [impl, crc] : crc_of) {
    for (const Bytes& b : large) naive_append(naive_large_stream[impl], b, crc);
    for (const auto& m : small) naive_append(naive_small_stream[impl], m, crc);
  }

  // Work areas reused by every repetition.
  Bytes large_dest(o.large_bytes);      // where a received large payload must end up
  constexpr std::size_t kSendBlocks = 64;  // a ring of send blocks, as a channel has
  Bytes arena(o.threshold * kSendBlocks);
  // The naive sender's buffer: every message copied in back to back.
  Bytes naive_send(std::max(o.large_bytes + 8, o.threshold) * o.large_count +
                   (o.small_bytes + 8) * o.small_count);
  OneBlock one_block(o.large_bytes + 8);
  // Fault every page in now, so no timed section pays first-touch faults.
  std::memset(arena.data(), 0, arena.size());
  std::memset(naive_send.data(), 0, naive_send.size());
  std::memset(large_dest.data(), 0, large_dest.size());

  std::vector<Row> rows = {
      {"large encode (checksum; ember: no copy)", "GB/s", {}},
      {"large decode (recv copy + checksum + place)", "GB/s", {}},
      {"small encode (64 B messages)", "GB/s", {}},
      {"small decode", "GB/s", {}},
      {"small encode+decode rate", "Mmsg/s", {}},
  };
  std::map<std::string, std::vector<double>> raw_crc;

  for (int rep = 0; rep < o.reps; ++rep) {
    // Raw checksum speed, for context.
    raw_crc["crc32c (ISA-L)"].push_back(
        large_total / 1e9 / seconds_of([&] {
          for (const Bytes& b : large) g_sink += wire::crc32c(b);
        }));
    raw_crc["crc32 (zlib)"].push_back(large_total / 1e9 / seconds_of([&] {
      for (const Bytes& b : large) g_sink += zlib_crc(b);
    }));

    for (const char* impl : kImpls) {
      const std::string name = impl;
      const bool ember = name == "ember";
      const CrcFn crc = ember ? nullptr : crc_of.at(name);

      // Large encode.
      double t = seconds_of([&] {
        if (ember) {
          for (const Bytes& b : large) {
            std::array<std::byte, wire::kSinglePrefixBytes> prefix;
            auto s = wire::encode_single(prefix, b);
            g_sink += s->frame_bytes + static_cast<std::uint8_t>(s->prefix[4]);
          }
        } else {
          std::size_t pos = 0;
          for (const Bytes& b : large) pos += naive_encode(naive_send.data() + pos, b, crc);
          g_sink += pos;
        }
      });
      rows[0].samples[name].push_back(large_total / 1e9 / t);

      // Large decode: the payload must end up in large_dest (a pool block).
      t = seconds_of([&] {
        std::size_t messages = 0;
        if (ember) {
          auto dec = wire::FrameDecoder::create({.max_frame_bytes = o.large_bytes + 4096,
                                                 .receive_buffer_bytes = kRecvBytes,
                                                 .body_allocator = &one_block});
          pump(ember_large_stream, [&] { return dec->prepare(); },
               [&](std::size_t n) {
                 EMBER_CHECK(dec->commit(n).has_value());
                 drain_frames(*dec, &messages);
               });
        } else {
          NaiveDecoder dec(crc);
          pump(naive_large_stream.at(name), [&] { return dec.prepare(); },
               [&](std::size_t n) {
                 dec.commit(n, [&](std::span<const std::byte> p) {
                   std::memcpy(large_dest.data(), p.data(), p.size());  // to its destination
                   consume({large_dest.data(), p.size()});
                   ++messages;
                 });
               });
        }
        EMBER_CHECK(messages == o.large_count);
      });
      rows[1].samples[name].push_back(large_total / 1e9 / t);

      // Small encode.
      t = seconds_of([&] {
        if (ember) {
          std::size_t slot = 0;
          enc->begin(std::span<std::byte>(arena).subspan(0, o.threshold));
          for (const auto& m : small) {
            if (!enc->try_add(m)) {
              g_sink += enc->finish().size();
              slot = (slot + 1) % kSendBlocks;
              enc->begin(std::span<std::byte>(arena).subspan(slot * o.threshold, o.threshold));
              (void)enc->try_add(m);
            }
          }
          g_sink += enc->finish().size();
        } else {
          std::size_t pos = 0;
          for (const auto& m : small) pos += naive_encode(naive_send.data() + pos, m, crc);
          g_sink += pos;
        }
      });
      rows[2].samples[name].push_back(small_total / 1e9 / t);

      // Small decode.
      t = seconds_of([&] {
        std::size_t messages = 0;
        if (ember) {
          auto dec = wire::FrameDecoder::create({.receive_buffer_bytes = kRecvBytes});
          pump(ember_small_stream, [&] { return dec->prepare(); },
               [&](std::size_t n) {
                 EMBER_CHECK(dec->commit(n).has_value());
                 drain_frames(*dec, &messages);
               });
        } else {
          NaiveDecoder dec(crc);
          pump(naive_small_stream.at(name), [&] { return dec.prepare(); },
               [&](std::size_t n) {
                 dec.commit(n, [&](std::span<const std::byte> p) {
                   consume(p);
                   ++messages;
                 });
               });
        }
        EMBER_CHECK(messages == o.small_count);
      });
      rows[3].samples[name].push_back(small_total / 1e9 / t);

      // Small encode + decode in one loop: each full send buffer (a batch, or
      // 4 KiB of naive frames) is handed to the receiver with a copy.
      t = seconds_of([&] {
        std::size_t messages = 0;
        if (ember) {
          auto dec = wire::FrameDecoder::create({.receive_buffer_bytes = kRecvBytes});
          enc->begin(block);
          auto ship = [&] {
            const auto frame = enc->finish();
            EMBER_CHECK(dec->feed(frame).has_value());
            drain_frames(*dec, &messages);
            enc->begin(block);
          };
          for (const auto& m : small) {
            if (!enc->try_add(m)) {
              ship();
              (void)enc->try_add(m);
            }
          }
          ship();
          enc->abandon();
        } else {
          NaiveDecoder dec(crc);
          std::size_t pos = 0;
          auto ship = [&] {
            auto dst = dec.prepare();
            EMBER_CHECK(dst.size() >= pos);
            std::memcpy(dst.data(), naive_send.data(), pos);
            dec.commit(pos, [&](std::span<const std::byte> p) {
              consume(p);
              ++messages;
            });
            pos = 0;
          };
          for (const auto& m : small) {
            if (pos + 8 + m.size() > o.threshold) ship();
            pos += naive_encode(naive_send.data() + pos, m, crc);
          }
          ship();
        }
        EMBER_CHECK(messages == o.small_count);
      });
      rows[4].samples[name].push_back(static_cast<double>(o.small_count) / 1e6 / t);
    }
  }

  // Table.
  fmt::print("ember-bench-wire: {} reps (median), large {} x {} B, small {} x {} B, "
             "batch_threshold {} B, recv {} B\n",
             o.reps, o.large_count, o.large_bytes, o.small_count, o.small_bytes, o.threshold,
             kRecvBytes);
  fmt::print("{:<46} {:>7} {:>10} {:>13} {:>11}\n", "case", "unit", "ember", "naive_crc32c",
             "naive_zlib");
  for (const Row& r : rows) {
    fmt::print("{:<46} {:>7} {:>10.2f} {:>13.2f} {:>11.2f}\n", r.name, r.unit, r.med("ember"),
               r.med("naive_crc32c"), r.med("naive_zlib"));
  }
  for (const auto& [name, v] : raw_crc) {
    fmt::print("{:<46} {:>7} {:>10.2f}\n", "raw checksum " + name, "GB/s", median(v));
  }
  fmt::print("(sink {})\n", g_sink % 10);

  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  fmt::print(
      "SUMMARY large_encode_gbps={:.2f} large_decode_gbps={:.2f} small_encode_gbps={:.2f} "
      "small_decode_gbps={:.2f} small_rate_mmsgs={:.2f} "
      "large_encode_vs_zlib={:.2f} large_decode_vs_zlib={:.2f} small_rate_vs_zlib={:.2f} "
      "large_encode_vs_naive_crc32c={:.2f} large_decode_vs_naive_crc32c={:.2f} "
      "small_rate_vs_naive_crc32c={:.2f}\n",
      rows[0].med("ember"), rows[1].med("ember"), rows[2].med("ember"), rows[3].med("ember"),
      rows[4].med("ember"), ratio(rows[0].med("ember"), rows[0].med("naive_zlib")),
      ratio(rows[1].med("ember"), rows[1].med("naive_zlib")),
      ratio(rows[4].med("ember"), rows[4].med("naive_zlib")),
      ratio(rows[0].med("ember"), rows[0].med("naive_crc32c")),
      ratio(rows[1].med("ember"), rows[1].med("naive_crc32c")),
      ratio(rows[4].med("ember"), rows[4].med("naive_crc32c")));
  return 0;
}

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"ember-bench-wire: batch framer throughput beside naive framers"};
  app.add_option("--reps", o.reps, "interleaved repetitions (median reported)")->check(CLI::Range(1, 1000));
  app.add_option("--large-bytes", o.large_bytes, "bytes per large message");
  app.add_option("--large-count", o.large_count, "large messages per repetition")->check(CLI::Range(1, 100000));
  app.add_option("--small-bytes", o.small_bytes, "bytes per small message");
  app.add_option("--small-count", o.small_count, "small messages per repetition")->check(CLI::Range(1, 100000000));
  app.add_option("--batch-threshold", o.threshold, "batch_threshold in bytes");
  try {
    app.parse(argc, argv);
    return run(o);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ember-bench-wire: %s\n", e.what());
    return 1;
  }
}
