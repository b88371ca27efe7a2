#include "common/base/logging.h"

#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

namespace ember::log {
namespace {

TEST(Logging, NamedLoggerSharesDefaultSinks) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("root", sink));
  spdlog::drop("logging-test");
  auto l = logger("logging-test");
  EXPECT_EQ(l->name(), "logging-test");
  l->warn("hello {}", 42);
  l->flush();
  EXPECT_NE(out.str().find("hello 42"), std::string::npos);
  EXPECT_EQ(logger("logging-test").get(), l.get()) << "second call returns the same logger";
  spdlog::drop("logging-test");
  spdlog::set_default_logger(previous);
}

}  // namespace
}  // namespace ember::log
