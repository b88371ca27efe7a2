// Turns a StepStatus (written by a kernel or by the CPU reference when a
// pack/unpack step stops) into an Error whose message names the ring
// (channel, rank), its head and tail, and what to do.
//
// Codes: kSendRingFull, kRecvRingEmpty → ErrorCode::kTimeout;
// kHeaderMismatch, kMisaligned → kProtocol; kRingCorrupt → kInternal;
// kNoSpace → kTooLarge.
// Thread-safety: pure function.
#pragma once

#include <string_view>

#include "common/base/error.h"
#include "worker/gpu/pack_plan.h"
#include "worker/gpu/plan_types.h"

namespace ember::gpu {

// pre: status.code != kOk. `operation` is "pack", "unpack" or "loopback".
Error status_to_error(const StepStatus& status, const PackPlan& plan, std::string_view operation);

// Same, for a status about a bare layout (loopback has no plan).
Error status_to_error(const StepStatus& status, const SymBufferLayout& layout,
                      std::string_view operation);

}  // namespace ember::gpu
