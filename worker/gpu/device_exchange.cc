// DeviceExchange; see device_exchange.h for the data path and its copies.
//
// Objects per direction:
//   push: `push_packer` (the backend: tensors → push SymBuffer send rings,
//         compressed), `push_receiver` (CpuPacker over the same plan: recv
//         rings → fp32 push image; it mirrors the sender's delta references
//         the way a receiving server would), the push image (page pool).
//   pull: `pull_encoder` (CpuPacker over the fp32 pull plan: pull image →
//         send rings; for init_device also recv rings → image), `pull_backend`
//         (the backend over the pull plan: recv rings → tensors; for
//         init_device also tensors → send rings), the pull image.
// Each step ends with every ring of its SymBuffer empty; a failed step
// resets the positions so the next one starts clean.
//
// Completion: a job per call (the Worker's Handles plus, for pulls, the
// unpack) runs on `completer`, in call order; it finishes the Handle the
// caller holds.
#include "worker/gpu/device_exchange.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "common/base/logging.h"
#include "common/config/config.h"
#include "worker/gpu/cpu_packer.h"
#include "worker/gpu/exchange_backend.h"
#include "worker/gpu/host_symbuffer.h"

namespace ember::gpu {

std::string_view backend_name(ExchangeBackend backend) {
  switch (backend) {
    case ExchangeBackend::kAuto: return "auto";
    case ExchangeBackend::kCpu: return "cpu";
    case ExchangeBackend::kCuda: return "cuda";
  }
  return "unknown";
}

namespace {

// Image elements of a tensor slot: a multiple of 4 floats, so every tensor
// of an image starts 16-byte aligned.
constexpr std::uint64_t kImageAlignElements = 4;

// A page-pool buffer of at least `bytes`, and the 128-byte aligned span of
// `bytes` inside it (the pool hands out 4 KiB aligned blocks; a heap
// fallback may be less aligned, hence the slack).
struct AlignedRegion {
  TensorBuffer buffer;
  std::span<std::byte> bytes;
};

AlignedRegion aligned_region(Worker& worker, std::uint64_t bytes) {
  AlignedRegion r;
  r.buffer = worker.allocate(bytes + kRegionAlignBytes);
  const auto address = reinterpret_cast<std::uintptr_t>(r.buffer.bytes().data());
  const std::uint64_t skip = (kRegionAlignBytes - address % kRegionAlignBytes) % kRegionAlignBytes;
  r.bytes = r.buffer.bytes().subspan(skip, bytes);
  return r;
}

// Checks one call's views against the plan and collects their pointers.
template <typename View, typename Pointer>
Status collect_pointers(std::span<const View> views, const PackPlan& plan, std::string_view call,
                        std::vector<Pointer>* out) {
  const auto tensors = plan.tensors();
  if (views.size() != tensors.size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: got {} tensors but the exchange was created with {}; pass one view per "
                      "tensor, in the order given to DeviceExchange::create",
                      call, views.size(), tensors.size());
  }
  out->resize(views.size());
  for (std::size_t i = 0; i < views.size(); ++i) {
    const View& v = views[i];
    const TensorDesc& t = tensors[i];
    if (v.key != t.key) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: tensor {} has key {} but the exchange's tensor {} has key {}; pass the "
                        "tensors in the order given to DeviceExchange::create",
                        call, i, v.key, i, t.key);
    }
    if (v.num_elements != t.num_elements) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: tensor {} (key {}) has {} elements but was registered with {}; a "
                        "tensor's size is fixed at DeviceExchange::create",
                        call, i, t.key, v.num_elements, t.num_elements);
    }
    if (v.data == nullptr && v.num_elements != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: tensor {} (key {}, {} elements) has a null data pointer", call, i,
                        t.key, v.num_elements);
    }
    (*out)[i] = v.data;
  }
  return ok_status();
}

}  // namespace

struct DeviceExchange::Impl {
  struct Job {
    std::vector<Handle> handles;
    std::shared_ptr<worker_detail::Op> op;
    std::function<Status()> after;  // runs once every handle succeeded (pull: unpack)
  };

  Impl(Worker& w, DeviceExchangeOptions o) : worker(w), options(std::move(o)) {}

  ~Impl() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    if (completer.joinable()) completer.join();
  }

  Status init(std::span<const TensorDesc> tensors);
  Status select_backend();
  Handle submit(std::vector<Handle> handles, std::function<Status()> after);
  void run_completer();
  static void finish(Job& job);

  Status pack_push(std::span<const float* const> sources);
  Status unpack_pull(std::span<float* const> destinations);
  Status stage_init(std::span<const float* const> values);

  std::span<float> push_tensor(std::size_t i) const {
    return {push_image_base + image_offsets[i], push_plan->tensors()[i].num_elements};
  }
  std::span<float> pull_tensor(std::size_t i) const {
    return {pull_image_base + image_offsets[i], pull_plan->tensors()[i].num_elements};
  }

  Worker& worker;
  DeviceExchangeOptions options;
  ExchangeBackend backend = ExchangeBackend::kCpu;
  std::string fallback_reason;
  std::shared_ptr<const PackPlan> push_plan;
  std::shared_ptr<const PackPlan> pull_plan;

  // Memory first: the packers below point into it and go first.
  AlignedRegion push_region;
  AlignedRegion pull_region;
  TensorBuffer push_image;
  TensorBuffer pull_image;
  float* push_image_base = nullptr;
  float* pull_image_base = nullptr;
  std::vector<std::uint64_t> image_offsets;  // per tensor, in floats (both images)
  std::vector<float*> push_image_ptrs;
  std::vector<float*> pull_image_ptrs;
  std::vector<const float*> pull_image_const_ptrs;

  std::unique_ptr<detail::PackBackend> push_packer;
  std::unique_ptr<CpuPacker> push_receiver;
  std::unique_ptr<detail::PackBackend> pull_backend;
  std::unique_ptr<CpuPacker> pull_encoder;

  // Caller-thread state.
  std::vector<const float*> sources;
  std::vector<float*> destinations;
  Handle last_push;
  Handle last_pull;  // pull_device or init_device

  // Completion thread.
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Job> jobs;
  bool stopping = false;
  std::thread completer;
};

Status DeviceExchange::Impl::select_backend() {
  switch (options.backend) {
    case ExchangeBackend::kCpu:
      backend = ExchangeBackend::kCpu;
      return ok_status();
    case ExchangeBackend::kCuda: {
      std::string why;
      if (!detail::cuda_device_usable(options.device, &why)) {
        return make_error(ErrorCode::kUnavailable,
                          "device exchange: backend cuda requested but CUDA device {} is not "
                          "usable: {}; use backend cpu (host tensors) or auto",
                          options.device, why);
      }
      backend = ExchangeBackend::kCuda;
      return ok_status();
    }
    case ExchangeBackend::kAuto: {
      std::string why;
      if (detail::cuda_device_usable(options.device, &why)) {
        backend = ExchangeBackend::kCuda;
      } else {
        backend = ExchangeBackend::kCpu;
        fallback_reason = why;
      }
      return ok_status();
    }
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "device exchange: unknown backend value {}; use kAuto, kCpu or kCuda",
                    static_cast<unsigned>(options.backend));
}

Status DeviceExchange::Impl::init(std::span<const TensorDesc> tensors) {
  if (options.backpressure_timeout.count() < 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "device exchange: backpressure_timeout is negative ({} ns); use 0 or more",
                      options.backpressure_timeout.count());
  }
  EMBER_TRY(select_backend());

  const config::Config& cfg = worker.config();
  PlanOptions po;
  po.num_channels = options.num_channels;
  if (po.num_channels == 0) {
    po.num_channels = config::resolved_num_channels(cfg.communication);
    if (backend == ExchangeBackend::kCuda) {
      // Each GPU channel is a pack and an unpack block: at most half the SMs.
      const int sm = detail::cuda_sm_count(options.device);
      const std::uint32_t cap = sm >= 2 ? static_cast<std::uint32_t>(sm / 2) : 1u;
      po.num_channels = std::min(po.num_channels, cap);
    }
  }
  po.num_servers = worker.num_servers();
  po.num_workers = worker.num_workers();
  po.partition_bytes = cfg.server.partition_bytes;
  po.groups = options.groups;
  EMBER_ASSIGN_OR_RETURN(PackPlan push, PackPlan::build(tensors, po));
  push_plan = std::make_shared<const PackPlan>(std::move(push));

  std::vector<TensorDesc> fp32_tensors(tensors.begin(), tensors.end());
  for (TensorDesc& t : fp32_tensors) t.group = 0;
  po.groups = {CompressionOptions{}};
  EMBER_ASSIGN_OR_RETURN(PackPlan pull, PackPlan::build(fp32_tensors, po));
  pull_plan = std::make_shared<const PackPlan>(std::move(pull));

  // fp32 images of the model in the page pool.
  image_offsets.resize(tensors.size());
  std::uint64_t image_elements = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    image_offsets[i] = image_elements;
    image_elements += round_up(tensors[i].num_elements, kImageAlignElements);
  }
  const std::uint64_t image_bytes = std::max<std::uint64_t>(image_elements * sizeof(float), 16);
  push_image = worker.allocate(image_bytes);
  pull_image = worker.allocate(image_bytes);
  push_image_base = push_image.floats().data();
  pull_image_base = pull_image.floats().data();
  push_image_ptrs.resize(tensors.size());
  pull_image_ptrs.resize(tensors.size());
  pull_image_const_ptrs.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    push_image_ptrs[i] = push_image_base + image_offsets[i];
    pull_image_ptrs[i] = pull_image_base + image_offsets[i];
    pull_image_const_ptrs[i] = pull_image_ptrs[i];
  }

  // SymBuffers in the page pool; the backends and the CPU receivers.
  push_region = aligned_region(worker, push_plan->layout().total_bytes());
  pull_region = aligned_region(worker, pull_plan->layout().total_bytes());
  const auto timeout = options.backpressure_timeout;
  if (backend == ExchangeBackend::kCuda) {
    EMBER_ASSIGN_OR_RETURN(push_packer, detail::make_cuda_backend(push_plan, push_region.bytes,
                                                                  options.device, timeout));
    EMBER_ASSIGN_OR_RETURN(pull_backend, detail::make_cuda_backend(pull_plan, pull_region.bytes,
                                                                   options.device, timeout));
  } else {
    EMBER_ASSIGN_OR_RETURN(push_packer,
                           detail::make_cpu_backend(push_plan, push_region.bytes, timeout));
    EMBER_ASSIGN_OR_RETURN(pull_backend,
                           detail::make_cpu_backend(pull_plan, pull_region.bytes, timeout));
  }
  CpuPackerOptions co;
  co.backpressure_timeout = timeout;
  EMBER_ASSIGN_OR_RETURN(CpuPacker receiver, CpuPacker::create(push_plan, co));
  push_receiver = std::make_unique<CpuPacker>(std::move(receiver));
  EMBER_ASSIGN_OR_RETURN(CpuPacker encoder, CpuPacker::create(pull_plan, co));
  pull_encoder = std::make_unique<CpuPacker>(std::move(encoder));

  completer = std::thread([this] { run_completer(); });
  log::logger("gpu")->info(
      "device exchange: {} tensors ({} elements), {} channel(s) x {} server(s), backend {}{}{}",
      tensors.size(), push_plan->total_elements(), po.num_channels, po.num_servers,
      gpu::backend_name(backend), fallback_reason.empty() ? "" : " — no GPU: ", fallback_reason);
  return ok_status();
}

// Push step: tensors → send rings (backend, compressed) → recv rings
// (loopback copy) → fp32 push image (CPU receiver), then undo the prescale.
Status DeviceExchange::Impl::pack_push(std::span<const float* const> srcs) {
  const SymBufferView view = push_packer->host_view();
  Status st = push_packer->pack(srcs);
  if (st) st = loopback(view);
  if (st) st = push_receiver->unpack(push_image_ptrs, view);
  if (!st) {
    (void)push_packer->reset_positions();
    return st;
  }
  const auto tensors = push_plan->tensors();
  const auto groups = push_plan->groups();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const float prescale = groups[tensors[i].group].prescale;
    if (prescale == 1.0f) continue;  // fp32 without prescale stays bit for bit
    for (float& x : push_tensor(i)) x = div_rn(x, prescale);
  }
  return ok_status();
}

// Pull completion: fp32 pull image → send rings (CPU encoder) → recv rings
// (loopback copy) → destinations (backend).
Status DeviceExchange::Impl::unpack_pull(std::span<float* const> dsts) {
  const SymBufferView view = pull_backend->host_view();
  Status st = pull_encoder->pack(pull_image_const_ptrs, view);
  if (st) st = loopback(view);
  if (st) st = pull_backend->unpack(dsts);
  if (!st) (void)pull_backend->reset_positions();
  return st;
}

// Init: values (backend memory) → send rings (backend) → recv rings →
// fp32 pull image (CPU encoder's unpack), from which Worker::init sends.
Status DeviceExchange::Impl::stage_init(std::span<const float* const> values) {
  const SymBufferView view = pull_backend->host_view();
  Status st = pull_backend->pack(values);
  if (st) st = loopback(view);
  if (st) st = pull_encoder->unpack(pull_image_ptrs, view);
  if (!st) (void)pull_backend->reset_positions();
  return st;
}

Handle DeviceExchange::Impl::submit(std::vector<Handle> handles, std::function<Status()> after) {
  Job job;
  job.handles = std::move(handles);
  job.op = std::make_shared<worker_detail::Op>(1);
  job.after = std::move(after);
  Handle h(job.op);
  {
    std::lock_guard lock(mutex);
    jobs.push_back(std::move(job));
  }
  cv.notify_one();
  return h;
}

void DeviceExchange::Impl::finish(Job& job) {
  Status first;
  std::optional<std::uint64_t> step;
  for (const Handle& h : job.handles) {
    auto r = h.wait();  // bounded by the Worker's request_timeout
    if (!r) {
      if (first) first = tl::unexpected(r.error());
    } else {
      step = step ? std::min(*step, *r) : *r;
    }
  }
  if (first && job.after) first = job.after();
  if (!first) {
    job.op->fail(first.error());
  } else {
    job.op->complete_part(step);
  }
}

void DeviceExchange::Impl::run_completer() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return stopping || !jobs.empty(); });
      if (jobs.empty()) return;  // stopping, and every job is finished
      job = std::move(jobs.front());
      jobs.pop_front();
    }
    finish(job);
  }
}

// ---------------------------------------------------------------------------

DeviceExchange::DeviceExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceExchange::~DeviceExchange() = default;

Result<std::unique_ptr<DeviceExchange>> DeviceExchange::create(
    Worker& worker, std::span<const TensorDesc> tensors, const DeviceExchangeOptions& options) {
  auto impl = std::make_unique<Impl>(worker, options);
  EMBER_TRY(impl->init(tensors));
  return std::unique_ptr<DeviceExchange>(new DeviceExchange(std::move(impl)));
}

ExchangeBackend DeviceExchange::backend() const noexcept { return impl_->backend; }
std::string_view DeviceExchange::backend_name() const noexcept {
  return gpu::backend_name(impl_->backend);
}
std::string_view DeviceExchange::cpu_fallback_reason() const noexcept {
  return impl_->fallback_reason;
}
const PackPlan& DeviceExchange::push_plan() const noexcept { return *impl_->push_plan; }
const PackPlan& DeviceExchange::pull_plan() const noexcept { return *impl_->pull_plan; }

Handle DeviceExchange::init_device(std::span<const ConstTensorView> values) {
  Impl& m = *impl_;
  const auto tensors = m.pull_plan->tensors();
  const bool with_values = !values.empty() || tensors.empty();
  if (!with_values && m.worker.rank() == 0) {
    return Handle::failed(Error(
        ErrorCode::kInvalidArgument,
        fmt::format("init_device: rank 0 must pass the initial values of all {} tensors (other "
                    "ranks pass none)",
                    tensors.size())));
  }
  std::vector<const float*> ptrs;
  if (with_values) {
    if (auto st = collect_pointers(values, *m.pull_plan, "init_device", &ptrs); !st) {
      return Handle::failed(st.error());
    }
  }
  if (m.last_pull.valid()) (void)m.last_pull.wait();  // the pull image is reused
  if (with_values) {
    if (auto st = m.stage_init(ptrs); !st) return Handle::failed(st.error());
  }
  std::vector<Handle> handles;
  handles.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uint64_t shape[1] = {tensors[i].num_elements};
    const std::span<const float> init_values =
        with_values ? std::span<const float>(m.pull_tensor(i)) : std::span<const float>();
    handles.push_back(m.worker.init(tensors[i].key, shape, init_values));
  }
  m.last_pull = m.submit(std::move(handles), nullptr);
  return m.last_pull;
}

Handle DeviceExchange::push_device(std::span<const ConstTensorView> gradients) {
  Impl& m = *impl_;
  if (auto st = collect_pointers(gradients, *m.push_plan, "push_device", &m.sources); !st) {
    return Handle::failed(st.error());
  }
  if (m.last_push.valid()) (void)m.last_push.wait();  // the push image is reused
  if (auto st = m.pack_push(m.sources); !st) return Handle::failed(st.error());
  const auto tensors = m.push_plan->tensors();
  std::vector<Handle> handles;
  handles.reserve(tensors.size());
  {
    // Small chunks go into their channel's batches; the image is pool
    // memory, so large ones leave from it without a copy (tcp).
    Pipeline pipeline = m.worker.pipeline();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      handles.push_back(pipeline.enqueue(tensors[i].key, m.push_tensor(i)));
    }
    (void)pipeline.flush();  // a send error is in the handles too
  }
  m.last_push = m.submit(std::move(handles), nullptr);
  return m.last_push;
}

Handle DeviceExchange::pull_device(std::span<const TensorView> parameters) {
  Impl& m = *impl_;
  std::vector<float*> dsts;
  if (auto st = collect_pointers(parameters, *m.pull_plan, "pull_device", &dsts); !st) {
    return Handle::failed(st.error());
  }
  if (m.last_pull.valid()) (void)m.last_pull.wait();  // the pull image is reused
  const auto tensors = m.pull_plan->tensors();
  std::vector<Handle> handles;
  handles.reserve(tensors.size());
  {
    Pipeline pipeline = m.worker.pipeline();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      handles.push_back(pipeline.enqueue_pull(tensors[i].key, m.pull_tensor(i)));
    }
    (void)pipeline.flush();
  }
  m.last_pull = m.submit(std::move(handles), [&m, dsts = std::move(dsts)] {
    return m.unpack_pull(dsts);
  });
  return m.last_pull;
}

}  // namespace ember::gpu
