// ember-test-worker: a scripted worker process for the integration tests
// that need to kill or restart a worker.
//
//   ember-test-worker --config FILE --rank R --key K --elements N --steps S [--value V]
//                     [--stop-after T]
//
// inits key K (rank 0 with values 0..N-1), then for each step from the
// resume step the server reports up to S: push a gradient of V everywhere,
// print "pushed <step>", pull, print "pulled <step> <first element>".
// With --stop-after T it stops after "pushed T" and waits for a signal (the
// test kills it there: a worker lost mid-round). Errors end it with
// "error <message>" and exit code 1; success prints "done" and exits 0.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "worker/worker.h"

int main(int argc, char** argv) {
  CLI::App app{"ember-test-worker"};
  std::string config_path;
  std::uint32_t rank = 0;
  std::uint64_t key = 1, elements = 4, steps = 10;
  float value = 1.0f;
  long long stop_after = -1;
  app.add_option("--config", config_path)->required();
  app.add_option("--rank", rank);
  app.add_option("--key", key);
  app.add_option("--elements", elements);
  app.add_option("--steps", steps);
  app.add_option("--value", value);
  app.add_option("--stop-after", stop_after);
  CLI11_PARSE(app, argc, argv);
  auto say = [](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  const std::string rank_set = "worker.rank=" + std::to_string(rank);
  const std::string sets[] = {rank_set};
  auto w = ember::Worker::create_from_file(config_path, sets);
  if (!w) {
    say("error " + w.error().to_string());
    return 1;
  }
  std::vector<float> init(elements), params(elements), grad(elements, value);
  for (std::uint64_t i = 0; i < elements; ++i) init[i] = static_cast<float>(i);
  const std::uint64_t shape[] = {elements};
  auto r = (*w)->init(key, shape, rank == 0 ? std::span<const float>(init) : std::span<const float>())
               .wait();
  if (!r) {
    say("error " + r.error().to_string());
    return 1;
  }
  say("ready " + std::to_string(*r));
  for (std::uint64_t step = *r; step < steps; ++step) {
    auto p = (*w)->push(key, grad).wait();
    if (!p) {
      say("error " + p.error().to_string());
      return 1;
    }
    say("pushed " + std::to_string(step));
    if (stop_after >= 0 && step == static_cast<std::uint64_t>(stop_after)) {
      for (;;) ::pause();  // killed here by the test
    }
    auto q = (*w)->pull(key, params).wait();
    if (!q) {
      say("error " + q.error().to_string());
      return 1;
    }
    say("pulled " + std::to_string(step) + " " + std::to_string(params[0]));
  }
  say("done");
  return 0;
}
