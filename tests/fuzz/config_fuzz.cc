// Fuzz target: arbitrary bytes into the config loader never crash and no
// exception escapes (toml11's are converted inside common/config). Properties
// checked on every input:
//   - a refused input yields ErrorCode::kConfig with a non-empty message;
//   - an accepted input validates, and to_toml() of it parses back to an
//     equal Config (the --print-config round trip);
//   - set_value() with the input split at its first '=' (key=value) either
//     fails with kConfig or leaves a config whose fields all pass their checks
//     or fail validate() with kConfig (never a crash).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/check.h"
#include "common/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  auto parsed = ember::config::parse_config(text, "fuzz.toml");
  if (parsed) {
    EMBER_CHECK(ember::config::validate(*parsed).has_value());
    const std::string printed = ember::config::to_toml(*parsed);
    auto again = ember::config::parse_config(printed, "printed.toml");
    EMBER_CHECK_MSG(again.has_value(), "to_toml output does not load back: {}\n{}",
                    again ? std::string() : again.error().message(), printed);
    EMBER_CHECK_MSG(*again == *parsed, "to_toml round trip changed the config:\n{}", printed);
  } else {
    EMBER_CHECK(parsed.error().code() == ember::ErrorCode::kConfig);
    EMBER_CHECK(!parsed.error().message().empty());
  }

  const std::size_t eq = text.find('=');
  if (eq != std::string_view::npos && eq < 64) {
    ember::config::Config config;
    auto st = ember::config::set_value(config, text.substr(0, eq), text.substr(eq + 1));
    if (!st) {
      EMBER_CHECK(st.error().code() == ember::ErrorCode::kConfig);
    } else if (auto valid = ember::config::validate(config); !valid) {
      EMBER_CHECK(valid.error().code() == ember::ErrorCode::kConfig);
    }
  }
  return 0;
}
