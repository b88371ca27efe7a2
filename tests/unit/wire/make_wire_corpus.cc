// Writes the seed corpus of wire_decoder_fuzz: valid streams built with the
// real encoder (small batches, max items, single frames, mixed streams) and a
// few malformed ones, each prefixed by the fuzz target's control byte.
// Usage: wire_make_corpus <dir>   (e.g. tests/fuzz/corpus/wire)
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/wire/batch_encoder.h"

namespace {

using Bytes = std::vector<std::byte>;
using ember::wire::BatchEncoder;

Bytes batch(const std::vector<Bytes>& payloads, std::size_t threshold) {
  auto enc = BatchEncoder::create({.batch_threshold_bytes = threshold});
  Bytes out(threshold), stream;
  enc->begin(out);
  std::uint32_t flags = 0;
  for (const Bytes& p : payloads) {
    if (!enc->try_add(p, flags++)) {
      auto f = enc->finish();
      stream.insert(stream.end(), f.begin(), f.end());
      enc->begin(out);
      if (!enc->try_add(p, flags)) std::abort();
    }
  }
  auto f = enc->finish();
  stream.insert(stream.end(), f.begin(), f.end());
  return stream;
}

Bytes single(const Bytes& payload,
             ember::wire::Checksum checksum = ember::wire::Checksum::kFrame) {
  std::array<std::byte, ember::wire::kSinglePrefixBytes> prefix;
  auto s = ember::wire::encode_single(prefix, payload, 5, checksum);
  Bytes out(s->prefix.begin(), s->prefix.end());
  out.insert(out.end(), payload.begin(), payload.end());
  out.insert(out.end(), s->padding.begin(), s->padding.end());
  return out;
}

Bytes fill(std::size_t n, std::mt19937& rng) {
  Bytes b(n);
  for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng()));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  std::filesystem::create_directories(argv[1]);
  std::mt19937 rng(1);
  std::vector<std::pair<std::string, Bytes>> seeds;
  seeds.push_back({"one_item", batch({fill(5, rng)}, 4096)});
  seeds.push_back({"zero_length_item", batch({Bytes()}, 4096)});
  std::vector<Bytes> small;
  for (int i = 0; i < 40; ++i) small.push_back(fill(rng() % 70, rng));
  seeds.push_back({"small_batches", batch(small, 512)});
  seeds.push_back({"max_items", batch(std::vector<Bytes>(ember::wire::max_items_in(1024), Bytes()), 1024)});
  seeds.push_back({"single_frame", single(fill(1000, rng))});
  Bytes mixed = batch({fill(3, rng), fill(64, rng)}, 256);
  Bytes big = single(fill(700, rng));
  mixed.insert(mixed.end(), big.begin(), big.end());
  Bytes tail = batch({fill(8, rng)}, 256);
  mixed.insert(mixed.end(), tail.begin(), tail.end());
  seeds.push_back({"mixed_stream", mixed});
  Bytes bad_crc = batch({fill(20, rng)}, 256);
  bad_crc[50] ^= std::byte{1};
  seeds.push_back({"bad_crc", bad_crc});
  Bytes bad_offset = batch({fill(20, rng), fill(9, rng)}, 256);
  bad_offset[36] = std::byte{0xFF};
  seeds.push_back({"bad_offset", bad_offset});
  Bytes truncated = batch({fill(30, rng)}, 256);
  truncated.resize(truncated.size() - 3);
  seeds.push_back({"truncated", truncated});
  seeds.push_back({"single_prefix_checksum", single(fill(1000, rng), ember::wire::Checksum::kPrefix)});

  // Control bytes: 0x00 plain; 0x01 repair CRCs; 0x0B repair + external
  // bodies + other chunking; 0x05 repair + 4 KiB max frame.
  const std::uint8_t controls[] = {0x00, 0x01, 0x0B, 0x05};
  int written = 0;
  for (const auto& [name, stream] : seeds) {
    for (std::uint8_t c : controls) {
      char suffix[8];
      std::snprintf(suffix, sizeof suffix, "_%02x", c);
      std::ofstream out(std::filesystem::path(argv[1]) / (name + suffix), std::ios::binary);
      out.put(static_cast<char>(c));
      out.write(reinterpret_cast<const char*>(stream.data()),
                static_cast<std::streamsize>(stream.size()));
      ++written;
    }
  }
  std::printf("wrote %d corpus files to %s\n", written, argv[1]);
  return 0;
}
