// CpuPacker: the plain C++ reference of the SymBuffer packing path. Same
// layout, record format, compression and error feedback as the CUDA kernels
// (GpuPacker), written independently of their work split (it walks records
// one by one; the kernels split them into warp tiles), so tests can compare
// the two bit for bit. The worker uses it when no GPU is present.
//
// A step: pack() waits (bounded) until every send ring has room for the
// whole step, then writes every record and publishes each ring's tail; a
// transport reads the records from the rings (RingView), sends them, and
// delivers the server's reply into the recv rings; unpack() waits (bounded)
// until every recv ring holds a whole step, checks every record header
// against the plan, then decodes into the destination tensors and publishes
// each ring's head. Both are all-or-nothing: when they fail, no ring
// position, tensor or state element has changed.
//
// State (owned here, per the plan's arenas, zero at creation): the residual
// of each error-feedback tensor, the send reference and the recv reference of
// each delta tensor.
//
// Thread-safety: one thread calls pack/unpack at a time; other threads may
// drain send rings and fill recv rings (RingView) meanwhile.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/base/error.h"
#include "worker/gpu/host_symbuffer.h"
#include "worker/gpu/pack_plan.h"

namespace ember::gpu {

struct CpuPackerOptions {
  // How long one pack() waits for ring space and one unpack() for data
  // before failing with kTimeout: one bound for the step, however many
  // rings it waits for. Zero: fail at once.
  std::chrono::nanoseconds backpressure_timeout = std::chrono::seconds(5);
};

class CpuPacker {
 public:
  // Allocates the state arenas (plan.residual_arena_elements() +
  // 2 x plan.ref_arena_elements() floats). Errors: kInvalidArgument for a
  // null plan or a negative timeout.
  static Result<CpuPacker> create(std::shared_ptr<const PackPlan> plan,
                                  const CpuPackerOptions& options = {});

  const PackPlan& plan() const { return *plan_; }

  // Packs one step. sources[i]: tensor i of the plan, plan.tensors()[i]
  // .num_elements fp32 values, host memory, any alignment (null allowed only
  // for an empty tensor); read only. Blocks up to backpressure_timeout
  // while a send ring lacks room for the step. Errors: kInvalidArgument
  // (wrong count, null source, buffer laid out differently from the plan);
  // kTimeout (a ring stayed full: names channel, rank, head, tail);
  // kProtocol / kInternal (ring positions misaligned or corrupt).
  Status pack(std::span<const float* const> sources, const SymBufferView& buffer);

  // Unpacks one step from the recv rings into destinations[i] (same shapes
  // as the sources; written only). Blocks up to backpressure_timeout while a
  // recv ring holds less than the step. Errors: kInvalidArgument (as pack);
  // kTimeout (names channel, rank, head, tail); kProtocol (a record header
  // does not match the plan: names the record, expected and found).
  Status unpack(std::span<float* const> destinations, const SymBufferView& buffer);

  // State arenas, indexed by PlanRecord::residual_offset / ref_offset.
  std::span<const float> residuals() const { return residuals_; }
  std::span<const float> send_refs() const { return send_refs_; }
  std::span<const float> recv_refs() const { return recv_refs_; }
  // Zeroes all state (a fresh start, e.g. after a parameter reload).
  void reset_state();

 private:
  CpuPacker() = default;
  Status check_buffer(const SymBufferView& buffer, std::size_t num_tensors) const;

  std::shared_ptr<const PackPlan> plan_;
  CpuPackerOptions options_{};
  std::vector<float> residuals_;
  std::vector<float> send_refs_;
  std::vector<float> recv_refs_;
  std::vector<std::uint64_t> bases_;  // per ring, scratch of one step
};

}  // namespace ember::gpu
