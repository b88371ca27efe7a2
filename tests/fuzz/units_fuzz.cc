// Fuzz target: size and duration parsers never crash, and any accepted size
// re-parses from its decimal byte form to the same value.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/check.h"
#include "common/base/units.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto bytes = ember::parse_size_bytes(text)) {
    auto again = ember::parse_size_bytes(std::to_string(*bytes));
    EMBER_CHECK(again && *again == *bytes);
  } else {
    EMBER_CHECK(!bytes.error().message().empty());
  }
  (void)ember::parse_duration(text);
  return 0;
}
