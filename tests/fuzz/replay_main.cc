// Driver for fuzz targets in non-fuzz builds (gcc, sanitizer presets).
//
// Runs LLVMFuzzerTestOneInput over every file of the corpus directories given
// as arguments, then over EMBER_FUZZ_REPLAY_RUNS (default 20000) seeded
// random inputs: random bytes, and mutations (bit flips, truncation,
// splices) of corpus entries. The seed is printed and can be replayed with
// EMBER_FUZZ_SEED=<n>. A crash or sanitizer report fails the test.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

int main(int argc, char** argv) {
  std::vector<std::vector<std::uint8_t>> corpus;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(argv[i], ec)) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      corpus.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  for (const auto& input : corpus) LLVMFuzzerTestOneInput(input.data(), input.size());

  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("EMBER_FUZZ_SEED")) seed = std::strtoull(s, nullptr, 10);
  long runs = 20000;
  if (const char* r = std::getenv("EMBER_FUZZ_REPLAY_RUNS")) runs = std::strtol(r, nullptr, 10);
  std::printf("replay: %zu corpus inputs, %ld random runs, EMBER_FUZZ_SEED=%llu\n", corpus.size(),
              runs, static_cast<unsigned long long>(seed));
  std::fflush(stdout);

  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> buf;
  for (long run = 0; run < runs; ++run) {
    if (!corpus.empty() && rng() % 4 != 0) {
      buf = corpus[rng() % corpus.size()];
      const int mutations = 1 + static_cast<int>(rng() % 8);
      for (int m = 0; m < mutations; ++m) {
        switch (rng() % 4) {
          case 0:  // bit flip
            if (!buf.empty()) buf[rng() % buf.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
            break;
          case 1:  // truncate
            if (!buf.empty()) buf.resize(rng() % buf.size());
            break;
          case 2:  // random byte
            if (!buf.empty()) buf[rng() % buf.size()] = static_cast<std::uint8_t>(rng());
            break;
          default:  // splice of another corpus entry
            {
              const auto& other = corpus[rng() % corpus.size()];
              if (!other.empty()) {
                const std::size_t from = rng() % other.size();
                buf.insert(buf.begin() + static_cast<std::ptrdiff_t>(buf.empty() ? 0 : rng() % buf.size()),
                           other.begin() + static_cast<std::ptrdiff_t>(from), other.end());
              }
            }
            break;
        }
      }
    } else {
      buf.resize(rng() % 512);
      for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
    }
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("replay: done\n");
  return 0;
}
