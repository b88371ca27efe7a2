// DeviceExchange on the CPU reference path against a real server (in this
// process, TCP on 127.0.0.1): push_device / pull_device of many tensors give
// the values a plain Worker push / pull of the same tensors gives — fp32 bit
// for bit, bf16 / fp16 / int8 within the codec's stated bound, error
// feedback with a bounded drift — and bad input is a clear error.
#include <algorithm>
#include <chrono>

#include "tests/integration/gpu/exchange_support.h"

namespace ember::gpu::test {
namespace {

constexpr std::uint64_t kPlainKeys = 1'000'000;  // plain Worker keys: exchange key + this

DeviceExchangeOptions cpu_options(std::vector<CompressionOptions> groups = {CompressionOptions{}}) {
  DeviceExchangeOptions o;
  o.backend = ExchangeBackend::kCpu;
  o.groups = std::move(groups);
  return o;
}

// Runs `steps` of push → pull through a DeviceExchange (keys of `model`)
// and through the plain Worker (keys + kPlainKeys), with the same initial
// values and gradients; calls check(step, exchange_params, plain_params,
// grads) after each step.
template <typename Check, typename NextGrads>
void run_side_by_side(Worker& w, DeviceExchange& ex, const HostModel& init, int steps,
                      NextGrads&& next_grads, Check&& check) {
  PlainReference plain{w, kPlainKeys};
  auto ih = ex.init_device(init.const_views());
  ASSERT_TRUE(plain.init(init));
  auto ir = ih.wait();
  ASSERT_TRUE(ir) << ir.error().to_string();
  HostModel grads = init;
  HostModel ex_params = init, plain_params = init;
  for (int s = 0; s < steps; ++s) {
    next_grads(grads, s);
    auto ph = ex.push_device(grads.const_views());
    auto pushed = ph.wait();
    ASSERT_TRUE(pushed) << pushed.error().to_string();
    EXPECT_EQ(*pushed, static_cast<std::uint64_t>(s));
    ASSERT_TRUE(plain.push(grads));
    auto views = ex_params.views();
    auto pr = ex.pull_device(views).wait();
    ASSERT_TRUE(pr) << pr.error().to_string();
    EXPECT_EQ(*pr, static_cast<std::uint64_t>(s + 1));
    ASSERT_TRUE(plain.pull(plain_params));
    check(s, ex_params, plain_params, grads);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(DeviceExchange, ReportsTheCpuBackendWithoutAGpu) {
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  HostModel m = make_model({3}, 1);
  DeviceExchangeOptions o;  // kAuto
  auto ex = DeviceExchange::create(*w, m.descs, o);
  ASSERT_TRUE(ex) << ex.error().to_string();
  if ((*ex)->backend() == ExchangeBackend::kCuda) {
    EXPECT_EQ((*ex)->backend_name(), "cuda");
    EXPECT_TRUE((*ex)->cpu_fallback_reason().empty());
  } else {
    EXPECT_EQ((*ex)->backend_name(), "cpu");
    EXPECT_FALSE((*ex)->cpu_fallback_reason().empty());
  }
  // The plan's channel count is the Worker's.
  EXPECT_EQ((*ex)->push_plan().layout().num_channels, 2u);
  EXPECT_EQ((*ex)->pull_plan().layout().num_channels, 2u);
}

TEST(DeviceExchange, Fp32MatchesThePlainWorkerBitForBit) {
  LocalServer s(exchange_config(3));
  auto w = s.worker();
  ASSERT_TRUE(w);
  std::mt19937_64 rng(1);
  // Sizes 0, 1, odd, a whole chunk, several chunks (1024-element chunks), unaligned.
  HostModel init = make_model({0, 1, 7, 1023, 1024, 5001, 3, 2048, 0, 4099}, 10);
  fill_random(init, rng, 0.5f, 4.0f);
  auto ex = DeviceExchange::create(*w, init.descs, cpu_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  std::size_t steps_checked = 0;
  run_side_by_side(
      *w, **ex, init, 3, [&](HostModel& g, int) { fill_random(g, rng, 1e-3f, 2.0f); },
      [&](int, const HostModel& a, const HostModel& b, const HostModel&) {
        EXPECT_TRUE(bits_equal(a, b));
        ++steps_checked;
      });
  EXPECT_EQ(steps_checked, 3u);
}

TEST(DeviceExchange, TenThousandSmallTensorsMatchBitForBit) {
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  std::mt19937_64 rng(2);
  std::uniform_int_distribution<std::uint64_t> size(0, 24);
  std::vector<std::uint64_t> sizes(10'000);
  for (auto& n : sizes) n = size(rng);
  HostModel init = make_model(sizes, 100'000);
  fill_random(init, rng, 0.5f, 4.0f);
  auto ex = DeviceExchange::create(*w, init.descs, cpu_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t steps_checked = 0;
  run_side_by_side(
      *w, **ex, init, 1, [&](HostModel& g, int) { fill_random(g, rng, 1e-3f, 2.0f); },
      [&](int, const HostModel& a, const HostModel& b, const HostModel&) {
        EXPECT_TRUE(bits_equal(a, b));
        ++steps_checked;
      });
  EXPECT_EQ(steps_checked, 1u);
  std::printf("10,000 tensors: init + push + pull on both paths in %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Per-element bound of one codec on |x| (codec.h): bf16 2^-8·|x|, fp16
// 2^-11·|x| (2^-25 below the normal range), int8 (0.5 + 2^-15)·s.
double codec_bound(Codec c, double x, double int8_scale) {
  switch (c) {
    case Codec::kFp32: return 0.0;
    case Codec::kBf16: return std::ldexp(std::fabs(x), -8);
    case Codec::kFp16: return std::max(std::ldexp(std::fabs(x), -11), std::ldexp(1.0, -25));
    case Codec::kInt8: return (0.5 + std::ldexp(1.0, -15)) * int8_scale;
  }
  return 0.0;
}

TEST(DeviceExchange, CompressedGroupsStayWithinTheCodecBound) {
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  // Groups: bf16, fp16, int8, fp16 prescaled by 1/3 (undone before the push).
  std::vector<CompressionOptions> groups = {{Codec::kBf16}, {Codec::kFp16}, {Codec::kInt8},
                                            {Codec::kFp16, false, false, 1.0f / 3.0f}};
  const std::vector<std::uint32_t> group_of = {0, 1, 2, 3};
  HostModel init = make_model({1, 7, 1500, 3000, 0, 33, 5000, 2}, 50, group_of);
  std::mt19937_64 rng(3);
  fill_random(init, rng, 0.5f, 4.0f);
  auto ex = DeviceExchange::create(*w, init.descs, cpu_options(groups));
  ASSERT_TRUE(ex) << ex.error().to_string();
  const PackPlan& plan = (*ex)->push_plan();
  std::size_t inexact = 0;
  std::size_t checked = 0;
  run_side_by_side(
      *w, **ex, init, 1, [&](HostModel& g, int) { fill_random(g, rng, 1e-3f, 2.0f); },
      [&](int, const HostModel& a, const HostModel& b, const HostModel& g) {
        for (std::uint32_t t = 0; t < plan.tensors().size(); ++t) {
          const Codec codec = groups[plan.tensors()[t].group].codec;
          const float prescale = plan.groups()[plan.tensors()[t].group].prescale;
          for (std::uint32_t r : plan.tensor_records(t)) {
            const PlanRecord& rec = plan.records()[r];
            double absmax = 0;
            for (std::uint64_t i = 0; i < rec.num_elements; ++i) {
              absmax = std::max(absmax, std::fabs(double{g.values[t][rec.elem_offset + i]}));
            }
            for (std::uint64_t i = rec.elem_offset; i < rec.elem_offset + rec.num_elements; ++i) {
              const double gi = g.values[t][i];
              // The codec works on v = g·prescale; the error is divided back.
              double bound = codec_bound(codec, gi * prescale, absmax * prescale / 127.0) / prescale;
              // fp32 rounding of g·prescale, of the division, and of the update p − g.
              bound += std::ldexp(std::fabs(gi), -22) +
                       std::ldexp(std::fabs(double{b.values[t][i]}) + std::fabs(gi), -23);
              const double err = std::fabs(double{a.values[t][i]} - double{b.values[t][i]});
              EXPECT_LE(err, bound) << "tensor " << t << " codec " << codec_name(codec)
                                    << " element " << i << " g " << gi;
              inexact += a.values[t][i] != b.values[t][i];
              ++checked;
            }
          }
        }
      });
  EXPECT_EQ(checked, 1500u + 3000u + 7u + 1u + 33u + 5000u + 2u);
  EXPECT_GT(inexact, 0u);  // the codecs did round: the comparison is not vacuous
}

// Same gradient every step: without error feedback int8's rounding error
// repeats and the parameters drift linearly; with it the drift stays within
// one quantisation step (the current residual).
TEST(DeviceExchange, ErrorFeedbackKeepsTheDriftWithinOneQuantisationStep) {
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  std::vector<CompressionOptions> groups = {{Codec::kInt8, false, true},
                                            {Codec::kInt8, false, false}};
  HostModel init = make_model({2500, 2500}, 70, {0, 1});
  std::mt19937_64 rng(4);
  fill_random(init, rng, 0.5f, 1.0f);
  HostModel fixed = init;
  fill_random(fixed, rng, 1e-3f, 1.0f);
  auto ex = DeviceExchange::create(*w, init.descs, cpu_options(groups));
  ASSERT_TRUE(ex) << ex.error().to_string();
  const int kSteps = 40;
  double drift_with_ef = 0, drift_without = 0;
  run_side_by_side(
      *w, **ex, init, kSteps, [&](HostModel& g, int) { g = fixed; },
      [&](int step, const HostModel& a, const HostModel& b, const HostModel&) {
        double d[2] = {0, 0};
        for (int t = 0; t < 2; ++t) {
          for (std::size_t i = 0; i < a.values[t].size(); ++i) {
            d[t] = std::max(d[t], std::fabs(double{a.values[t][i]} - double{b.values[t][i]}));
          }
        }
        // One quantisation step of |v| ≤ 1 + residual: s ≤ 1.01/127; plus
        // the fp32 rounding of the updates (|p| ≤ 42), accumulated.
        const double bound = 0.51 * 1.01 / 127.0 + (step + 1) * std::ldexp(84.0, -23);
        EXPECT_LE(d[0], bound) << "step " << step;
        drift_with_ef = d[0];
        drift_without = d[1];
      });
  // Without feedback the same rounding adds up every step.
  EXPECT_GT(drift_without, 4 * drift_with_ef)
      << "with " << drift_with_ef << " without " << drift_without;
}

TEST(DeviceExchange, BadInputIsAClearErrorAndTouchesNothing) {
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  HostModel m = make_model({4, 3000, 1}, 300);
  std::mt19937_64 rng(5);
  fill_random(m, rng, 0.5f, 2.0f);

  // create: duplicate keys, unknown group, negative timeout, bad prescale.
  HostModel dup = make_model({1, 1}, 7);
  dup.descs[1].key = 7;
  auto e1 = DeviceExchange::create(*w, dup.descs, cpu_options());
  ASSERT_FALSE(e1);
  EXPECT_EQ(e1.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e1.error().message().find("key 7"), std::string::npos) << e1.error().to_string();
  HostModel bad_group = make_model({1}, 8, {5});
  auto e2 = DeviceExchange::create(*w, bad_group.descs, cpu_options());
  ASSERT_FALSE(e2);
  EXPECT_NE(e2.error().message().find("group 5"), std::string::npos) << e2.error().to_string();
  DeviceExchangeOptions neg = cpu_options();
  neg.backpressure_timeout = std::chrono::nanoseconds(-1);
  auto e3 = DeviceExchange::create(*w, m.descs, neg);
  ASSERT_FALSE(e3);
  EXPECT_NE(e3.error().message().find("backpressure_timeout"), std::string::npos);
  auto e4 = DeviceExchange::create(
      *w, m.descs, cpu_options({{Codec::kBf16, false, false, -1.0f}}));
  ASSERT_FALSE(e4);
  EXPECT_NE(e4.error().message().find("prescale"), std::string::npos) << e4.error().to_string();

  auto ex = DeviceExchange::create(*w, m.descs, cpu_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  DeviceExchange& x = **ex;

  // Push before init: the Worker's kNotFound comes back in the Handle.
  auto not_init = x.push_device(m.const_views()).wait();
  ASSERT_FALSE(not_init);
  EXPECT_EQ(not_init.error().code(), ErrorCode::kNotFound) << not_init.error().to_string();
  // Rank 0 without initial values.
  auto no_values = x.init_device({}).wait();
  ASSERT_FALSE(no_values);
  EXPECT_EQ(no_values.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(no_values.error().message().find("rank 0"), std::string::npos);
  // A failed pull leaves the destinations alone.
  HostModel dst = m;
  for (auto& t : dst.values) std::fill(t.begin(), t.end(), -7.0f);
  auto dst_views = dst.views();
  auto pull_missing = x.pull_device(dst_views).wait();
  ASSERT_FALSE(pull_missing);
  EXPECT_EQ(pull_missing.error().code(), ErrorCode::kNotFound);
  for (auto& t : dst.values) {
    EXPECT_TRUE(std::all_of(t.begin(), t.end(), [](float v) { return v == -7.0f; }));
  }

  ASSERT_TRUE(x.init_device(m.const_views()).wait());
  auto views = m.const_views();
  auto expect_invalid = [&](std::span<const ConstTensorView> v, std::string_view needle) {
    auto r = x.push_device(v).wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << r.error().to_string();
    EXPECT_NE(r.error().message().find(needle), std::string::npos) << r.error().to_string();
  };
  // Tensor list mismatch: too few, reordered.
  expect_invalid(std::span(views).first(2), "got 2 tensors but the exchange was created with 3");
  auto swapped = views;
  std::swap(swapped[0], swapped[1]);
  expect_invalid(swapped, "has key 301 but the exchange's tensor 0 has key 300");
  // Wrong size.
  auto wrong = views;
  wrong[1].num_elements = 2999;
  expect_invalid(wrong, "tensor 1 (key 301) has 2999 elements but was registered with 3000");
  // Null data.
  auto null_data = views;
  null_data[2].data = nullptr;
  expect_invalid(null_data, "null data pointer");
  // Pull with a wrong size.
  auto pviews = dst.views();
  pviews[0].num_elements = 5;
  auto bad_pull = x.pull_device(pviews).wait();
  ASSERT_FALSE(bad_pull);
  EXPECT_EQ(bad_pull.error().code(), ErrorCode::kInvalidArgument);

  // None of that pushed anything: the first real push is step 0.
  auto first = x.push_device(views).wait();
  ASSERT_TRUE(first) << first.error().to_string();
  EXPECT_EQ(*first, 0u);
}

TEST(DeviceExchange, CudaBackendWithoutADeviceIsUnavailable) {
  LocalServer s(exchange_config(1));
  auto w = s.worker();
  ASSERT_TRUE(w);
  HostModel m = make_model({3}, 1);
  DeviceExchangeOptions o;
  auto probe = DeviceExchange::create(*w, m.descs, o);
  ASSERT_TRUE(probe);
  if ((*probe)->backend() == ExchangeBackend::kCuda) GTEST_SKIP() << "a CUDA device is present";
  o.backend = ExchangeBackend::kCuda;
  auto ex = DeviceExchange::create(*w, m.descs, o);
  ASSERT_FALSE(ex);
  EXPECT_EQ(ex.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(ex.error().message().find("backend cpu"), std::string::npos) << ex.error().to_string();
}

TEST(DeviceExchange, EmptyModelCompletesAtOnce) {
  LocalServer s(exchange_config(1));
  auto w = s.worker();
  ASSERT_TRUE(w);
  auto ex = DeviceExchange::create(*w, {}, cpu_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  EXPECT_TRUE((*ex)->init_device({}).wait());
  EXPECT_TRUE((*ex)->push_device({}).wait());
  EXPECT_TRUE((*ex)->pull_device({}).wait());
}

}  // namespace
}  // namespace ember::gpu::test
