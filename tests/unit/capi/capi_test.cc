// The C ABI without a server: library information, error names tied to
// ember::ErrorCode, the thread-local last error, NULL and dead handles,
// bad config paths, files and overrides, and an absent server. Every failure
// must come back as a code plus a message naming the cause — never a crash.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "capi/ember.h"
#include "common/base/error.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string last() { return ember_last_error(); }

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ember-capi-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const auto p = path_ / name;
    std::ofstream(p, std::ios::trunc) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

TEST(CapiInfo, VersionAndAbi) {
  EXPECT_STREQ(ember_version(), "0.1.0");
  EXPECT_EQ(ember_abi_version(), EMBER_ABI_VERSION);
}

TEST(CapiInfo, ErrorNamesMatchErrorCodeAndNoCodeIsMissing) {
  for (int c = EMBER_OK; c <= EMBER_E_OUT_OF_STEP; ++c) {
    EXPECT_EQ(std::string(ember_error_name(c)),
              std::string(ember::error_code_name(static_cast<ember::ErrorCode>(c))))
        << c;
    EXPECT_STRNE(ember_error_name(c), "unknown") << c;
  }
  // If ember::ErrorCode grows, ember.h must grow with it (EMBER_E_OUT_OF_STEP
  // is the last C code): this fails until it does.
  EXPECT_EQ(ember::error_code_name(static_cast<ember::ErrorCode>(EMBER_E_OUT_OF_STEP + 1)),
            "unknown");
  EXPECT_EQ(static_cast<int>(ember::kLastErrorCode), EMBER_E_OUT_OF_STEP);
  EXPECT_STREQ(ember_error_name(EMBER_PENDING), "pending");
  EXPECT_STREQ(ember_error_name(EMBER_E_OUT_OF_STEP + 1), "unknown");
  EXPECT_STREQ(ember_error_name(EMBER_E_OUT_OF_STEP), "out_of_step");
  EXPECT_STREQ(ember_error_name(-2), "unknown");
  EXPECT_STREQ(ember_error_name(EMBER_E_NOT_FOUND), "not_found");
}

TEST(CapiErrors, LastErrorIsSetOnFailureAndClearedOnSuccess) {
  EXPECT_EQ(ember_set_log_level("no-such-level"), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_last_error_code(), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), StartsWith("invalid_argument: ember_set_log_level: unknown level "
                                 "'no-such-level'"));
  EXPECT_EQ(ember_set_log_level("warn"), EMBER_OK);
  EXPECT_EQ(ember_last_error_code(), EMBER_OK);
  EXPECT_EQ(last(), "");
  EXPECT_EQ(ember_set_log_level(nullptr), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("level is NULL"));
}

TEST(CapiErrors, LastErrorIsPerThread) {
  ASSERT_EQ(ember_set_log_level("bogus"), EMBER_E_INVALID_ARGUMENT);
  std::string other_before, other_after;
  int other_code = -100;
  std::thread t([&] {
    other_before = ember_last_error();  // a new thread starts clean
    ember_worker* w = nullptr;
    other_code = ember_worker_create(nullptr, EMBER_RANK_FROM_CONFIG, nullptr, 0, &w);
    other_after = ember_last_error();
  });
  t.join();
  EXPECT_EQ(other_before, "");
  EXPECT_EQ(other_code, EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(other_after, HasSubstr("config_path is NULL"));
  // This thread still sees its own error.
  EXPECT_THAT(last(), HasSubstr("unknown level 'bogus'"));
}

TEST(CapiErrors, NullHandlesAreInvalidArgumentsNamingTheFunction) {
  uint64_t step = 0;
  float f[4] = {};
  ember_request* req = nullptr;
  ember_pipeline* pipe = nullptr;
  void* data = nullptr;
  const uint64_t shape[] = {4};

  struct Case {
    const char* fn;
    int rc;
  };
  const Case cases[] = {
      {"ember_worker_info", ember_worker_info(nullptr, nullptr, nullptr, nullptr)},
      {"ember_step", ember_step(nullptr, 1, &step)},
      {"ember_alloc", ember_alloc(nullptr, 16, &data)},
      {"ember_free", ember_free(nullptr, f)},
      {"ember_buffer_info", ember_buffer_info(nullptr, f, nullptr, nullptr)},
      {"ember_init", ember_init(nullptr, 1, shape, 1, f, 4, &step)},
      {"ember_push", ember_push(nullptr, 1, f, 4, &step)},
      {"ember_pull", ember_pull(nullptr, 1, f, 4, &step)},
      {"ember_push_pull", ember_push_pull(nullptr, 1, f, f, 4, &step)},
      {"ember_push_async", ember_push_async(nullptr, 1, f, 4, &req)},
      {"ember_pull_async", ember_pull_async(nullptr, 1, f, 4, &req)},
      {"ember_push_pull_async", ember_push_pull_async(nullptr, 1, f, f, 4, &req)},
      {"ember_barrier", ember_barrier(nullptr, &step)},
      {"ember_set_learning_rate", ember_set_learning_rate(nullptr, 0.1)},
      {"ember_checkpoint", ember_checkpoint(nullptr, &step)},
      {"ember_wait", ember_wait(nullptr, 0, &step)},
      {"ember_pipeline_create", ember_pipeline_create(nullptr, &pipe)},
      {"ember_pipeline_push", ember_pipeline_push(nullptr, 1, f, 4, &req)},
      {"ember_pipeline_pull", ember_pipeline_pull(nullptr, 1, f, 4, &req)},
      {"ember_pipeline_push_pull", ember_pipeline_push_pull(nullptr, 1, f, f, 4, &req)},
      {"ember_pipeline_flush", ember_pipeline_flush(nullptr)},
      {"ember_pipeline_wait", ember_pipeline_wait(nullptr)},
  };
  // The message of the last call only is kept; check each code, then one
  // message per call by calling again.
  for (const Case& c : cases) EXPECT_EQ(c.rc, EMBER_E_INVALID_ARGUMENT) << c.fn;
  EXPECT_EQ(ember_push(nullptr, 1, f, 4, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("ember_push: worker is NULL"));
  EXPECT_EQ(ember_wait(nullptr, 0, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("ember_wait: request is NULL"));
  EXPECT_EQ(ember_pipeline_flush(nullptr), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("ember_pipeline_flush: pipeline is NULL"));
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(pipe, nullptr);
  EXPECT_EQ(data, nullptr);
  EXPECT_EQ(step, 0u);
  // Destroy/free functions accept NULL.
  ember_worker_destroy(nullptr);
  ember_request_free(nullptr);
  ember_pipeline_destroy(nullptr);
}

TEST(CapiErrors, NonHandlePointersAreRefusedByTag) {
  // Memory that is not a handle (zeroed, the size of a tag) is caught by the
  // tag check rather than used.
  alignas(16) unsigned char junk[256] = {};
  auto* w = reinterpret_cast<ember_worker*>(junk);
  uint64_t step = 0;
  EXPECT_EQ(ember_step(w, 1, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("not a live ember_worker"));
  EXPECT_EQ(ember_wait(reinterpret_cast<ember_request*>(junk), 0, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("not a live ember_request"));
  EXPECT_EQ(ember_pipeline_wait(reinterpret_cast<ember_pipeline*>(junk)), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("not a live ember_pipeline"));
  ember_worker_destroy(w);  // ignored, not freed
  ember_request_free(reinterpret_cast<ember_request*>(junk));
  ember_pipeline_destroy(reinterpret_cast<ember_pipeline*>(junk));
}

TEST(CapiCreate, RequiredArgumentsAndRankRange) {
  ember_worker* w = nullptr;
  EXPECT_EQ(ember_worker_create("x.toml", EMBER_RANK_FROM_CONFIG, nullptr, 0, nullptr),
            EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("out_worker is NULL"));
  EXPECT_EQ(ember_worker_create(nullptr, 0, nullptr, 0, &w), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("config_path is NULL"));
  EXPECT_EQ(ember_worker_create("x.toml", -2, nullptr, 0, &w), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("rank -2 is out of range"));
  EXPECT_EQ(ember_worker_create("x.toml", int64_t{1} << 33, nullptr, 0, &w),
            EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_worker_create("x.toml", 0, nullptr, 2, &w), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("overrides is NULL but num_overrides is 2"));
  const char* sets[] = {"worker.rank=0", nullptr};
  EXPECT_EQ(ember_worker_create("x.toml", 0, sets, 2, &w), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("overrides[1] is NULL"));
  EXPECT_EQ(w, nullptr);
}

TEST(CapiCreate, MissingConfigFileIsConfigErrorNamingThePath) {
  ember_worker* w = nullptr;
  const int rc =
      ember_worker_create("/nonexistent/dir/ember.toml", EMBER_RANK_FROM_CONFIG, nullptr, 0, &w);
  EXPECT_EQ(rc, EMBER_E_CONFIG);
  EXPECT_EQ(ember_last_error_code(), EMBER_E_CONFIG);
  EXPECT_THAT(last(), StartsWith("config: "));
  EXPECT_THAT(last(), HasSubstr("/nonexistent/dir/ember.toml"));
  EXPECT_EQ(w, nullptr);
}

TEST(CapiCreate, InvalidConfigFileIsConfigErrorWithLine) {
  TempDir dir;
  const auto path = dir.write("bad.toml", "[communication]\nbatch_treshold = \"4KB\"\n");
  ember_worker* w = nullptr;
  EXPECT_EQ(ember_worker_create(path.c_str(), 0, nullptr, 0, &w), EMBER_E_CONFIG);
  EXPECT_THAT(last(), HasSubstr("bad.toml:2"));
  EXPECT_THAT(last(), HasSubstr("batch_treshold"));
  EXPECT_EQ(w, nullptr);
}

TEST(CapiCreate, BadOverrideAndRankBeyondNumWorkersAreConfigErrors) {
  TempDir dir;
  const auto path = dir.write("ok.toml", "[cluster]\nnum_workers = 2\n");
  ember_worker* w = nullptr;
  const char* bad[] = {"worker.no_such_key=1"};
  EXPECT_EQ(ember_worker_create(path.c_str(), 0, bad, 1, &w), EMBER_E_CONFIG);
  EXPECT_THAT(last(), HasSubstr("no_such_key"));
  EXPECT_EQ(ember_worker_create(path.c_str(), 2, nullptr, 0, &w), EMBER_E_CONFIG);
  // Named as the argument it was.
  EXPECT_THAT(last(), HasSubstr("with the rank argument 2: key 'worker.rank': 2 is not below "
                                "cluster.num_workers = 2"));
  // The argument wins over an override of worker.rank.
  const char* rank0[] = {"worker.rank=0"};
  EXPECT_EQ(ember_worker_create(path.c_str(), 3, rank0, 1, &w), EMBER_E_CONFIG);
  EXPECT_THAT(last(), HasSubstr("with the rank argument 3"));
  EXPECT_EQ(w, nullptr);
}

// The config is validated once, after the overrides and the rank argument:
// an override that is valid only with the argument's rank is accepted (here
// the creation fails later, at connecting, not at validation).
TEST(CapiCreate, TheRankArgumentIsAppliedBeforeTheOverridesAreValidated) {
  TempDir dir;
  const auto path = dir.write(
      "ok.toml", "[cluster]\nservers = [\"127.0.0.1:1\"]\nnum_workers = 2\n[worker]\nrank = 1\n"
                 "connect_retries = 0\nconnect_timeout = \"100ms\"\n");
  ember_worker* w = nullptr;
  const char* one_worker[] = {"cluster.num_workers=1"};
  EXPECT_NE(ember_worker_create(path.c_str(), 0, one_worker, 1, &w), EMBER_E_CONFIG) << last();
  const char* bad_rank[] = {"worker.rank=7"};
  EXPECT_NE(ember_worker_create(path.c_str(), 1, bad_rank, 1, &w), EMBER_E_CONFIG) << last();
  EXPECT_EQ(w, nullptr);
}

// A TCP port bound on 127.0.0.1 but not listening: connections to it are
// refused for as long as the socket is open (no race with other tests).
class RefusingPort {
 public:
  RefusingPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) std::abort();
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~RefusingPort() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(CapiCreate, AbsentServerIsAnErrorNamingTheServerAndTheKnobs) {
  RefusingPort port;
  TempDir dir;
  const auto path = dir.write(
      "absent.toml", "[cluster]\nservers = [\"127.0.0.1:" + std::to_string(port.port()) +
                         "\"]\n[worker]\nconnect_timeout = \"1s\"\nconnect_retries = 1\n");
  ember_worker* w = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = ember_worker_create(path.c_str(), 0, nullptr, 0, &w);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(rc == EMBER_E_IO || rc == EMBER_E_TIMEOUT) << rc << " " << last();
  EXPECT_THAT(last(), HasSubstr("cannot connect to server 0 at 127.0.0.1:" +
                                std::to_string(port.port())));
  EXPECT_THAT(last(), HasSubstr("2 attempt(s)"));
  EXPECT_THAT(last(), HasSubstr("connect_retries"));
  EXPECT_EQ(w, nullptr);
  EXPECT_LT(took, std::chrono::seconds(10));
}

TEST(CapiCreate, RetriesCanBeOverriddenPerCall) {
  RefusingPort port;
  TempDir dir;
  const auto path = dir.write(
      "absent.toml", "[cluster]\nservers = [\"127.0.0.1:" + std::to_string(port.port()) + "\"]\n");
  const char* sets[] = {"worker.connect_retries=0", "worker.connect_timeout=1s"};
  ember_worker* w = nullptr;
  const int rc = ember_worker_create(path.c_str(), 0, sets, 2, &w);
  EXPECT_TRUE(rc == EMBER_E_IO || rc == EMBER_E_TIMEOUT) << rc << " " << last();
  EXPECT_THAT(last(), HasSubstr("1 attempt(s)"));
  EXPECT_EQ(w, nullptr);
}

}  // namespace
