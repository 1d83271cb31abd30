// Private to the planner's .cpp files: what planner.cpp (search) and
// planner_report.cpp (messages and reports) share.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "tierzero/offload/planner.h"

namespace tz::planner_internal {

// One tier per StateClass, indexed by StateClass.
using Placement = std::array<Tier, kNumStateClasses>;

// Bytes, needs, traffic and summary of one placement (fits or not).
Plan evaluate_placement(const PlanInput& in, const PlanLayout& layout, const Placement& placement);

// "params gpu, grads cpu, master nvme, moments nvme"
std::string placement_text(const Plan& plan);
// The one-line Plan::summary.
std::string plan_summary(const Plan& plan);

// kOutOfMemory for auto mode: `least` is each tier's smallest need over the
// `candidates` placements tried whose faster tiers fit (UINT64_MAX: none did).
Status no_fit_error(const PlanInput& in, const PlanLayout& layout,
                    const std::array<std::uint64_t, kNumTiers>& least, std::size_t candidates);
// kOutOfMemory for a DeepSpeed plan that does not fit; `alternative` is auto
// mode's plan (nullptr when none fits, with `alternative_status` saying why).
Status deepspeed_error(const PlanInput& in, const Plan& plan, const Plan* alternative,
                       const Status& alternative_status);

}  // namespace tz::planner_internal
