// Named logger registry over spdlog; see logging.h.
#include "common/base/logging.h"

#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace ember::log {

std::shared_ptr<spdlog::logger> logger(std::string_view subsystem) {
  const std::string name(subsystem);
  if (auto existing = spdlog::get(name)) return existing;
  auto base = spdlog::default_logger();
  auto made = std::make_shared<spdlog::logger>(name, base->sinks().begin(), base->sinks().end());
  made->set_level(base->level());
  // Another thread may have registered the same name meanwhile: keep theirs.
  try {
    spdlog::register_logger(made);
  } catch (const spdlog::spdlog_ex&) {
    if (auto existing = spdlog::get(name)) return existing;
  }
  return made;
}

void init_program_logging(std::string_view level) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto root = std::make_shared<spdlog::logger>("ember", sink);
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") lvl = spdlog::level::info;
  root->set_level(lvl);
  spdlog::set_default_logger(root);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] [%n] %v");
  spdlog::set_level(lvl);
}

}  // namespace ember::log
