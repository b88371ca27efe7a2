#include "common/transport/accept_pacer.h"

#include <utility>

#include <spdlog/spdlog.h>

namespace ember::transport {

AcceptPacer::AcceptPacer(std::shared_ptr<spdlog::logger> log, std::string what)
    : log_(std::move(log)), what_(std::move(what)) {}

AcceptPacer::~AcceptPacer() { cancel(); }

void AcceptPacer::failed(boost::asio::io_context& ctx, std::string_view error,
                         std::function<void()> retry) {
  if (!failing_) {
    failing_ = true;
    log_->warn(
        "{}: cannot accept a connection ({}); retrying every {} ms until it can (out of file "
        "descriptors? raise LimitNOFILE / ulimit -n)",
        what_, error, kRetry.count());
  }
  if (!timer_) timer_ = std::make_unique<boost::asio::steady_timer>(ctx);
  timer_->expires_after(kRetry);
  timer_->async_wait([retry = std::move(retry)](const boost::system::error_code& e) {
    if (!e) retry();
  });
}

void AcceptPacer::succeeded() {
  if (!failing_) return;
  failing_ = false;
  log_->info("{}: accepting connections again", what_);
}

void AcceptPacer::cancel() {
  if (timer_) timer_->cancel();
  timer_.reset();
}

}  // namespace ember::transport
