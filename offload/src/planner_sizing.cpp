// What a plan means for the machine: the largest model of a family that fits
// its budgets, and how long its drives last at a plan's NVMe writes.
#include <cmath>
#include <limits>
#include <utility>

#include "tierzero/offload/planner.h"

namespace tz {
namespace {

// 365 days a year, as drive warranties count them (DWPD x capacity x 365 x years).
constexpr double kDaysPerYear = 365.0;
constexpr double kBytesPerTb = 1e12;

struct Trial {
  Expected<Plan> plan;
  PlanInput input;
};

Expected<Trial> try_size(const PlanInput& base, const BlocksOf& blocks_of, std::uint64_t params) {
  Trial trial{invalid_argument("not planned"), base};
  TZ_ASSIGN_OR_RETURN(trial.input.block_numel, blocks_of(params));
  trial.plan = plan_placement(trial.input);
  // Only "does not fit" is an answer of the search; anything else is the input's fault.
  if (!trial.plan.ok() && trial.plan.status().code() != ErrorCode::kOutOfMemory) return trial.plan.status();
  return trial;
}

}  // namespace

Expected<LargestModel> find_largest_model(const PlanInput& base, const BlocksOf& blocks_of, std::uint64_t min_params,
                                          std::uint64_t max_params, double relative_tolerance) {
  if (min_params < 1 || max_params < min_params) {
    return invalid_argument("the search range [{}, {}] parameters is empty", min_params, max_params);
  }
  if (!(relative_tolerance > 0) || !std::isfinite(relative_tolerance)) {
    return invalid_argument("relative_tolerance is {}; it must be a positive number", relative_tolerance);
  }
  TZ_ASSIGN_OR_RETURN(Trial low, try_size(base, blocks_of, min_params));
  if (!low.plan.ok()) return std::move(low.plan).status();
  LargestModel best{min_params, *std::move(low.plan), std::move(low.input), 0, ok_status()};
  // Double until a size does not fit (or the range ends), then bisect between
  // the last that fit and the first that did not.
  std::uint64_t high = 0;
  while (high == 0 && best.params < max_params) {
    const std::uint64_t next = best.params > max_params / 2 ? max_params : best.params * 2;
    TZ_ASSIGN_OR_RETURN(Trial t, try_size(base, blocks_of, next));
    if (t.plan.ok()) {
      best = {next, *std::move(t.plan), std::move(t.input), 0, ok_status()};
    } else {
      high = next;
      best.next_params = next;
      best.next_status = std::move(t.plan).status();
    }
  }
  while (high != 0 && static_cast<double>(high - best.params) > relative_tolerance * static_cast<double>(best.params) &&
         high - best.params > 1) {
    const std::uint64_t mid = best.params + (high - best.params) / 2;
    TZ_ASSIGN_OR_RETURN(Trial t, try_size(base, blocks_of, mid));
    if (t.plan.ok()) {
      best.params = mid;
      best.plan = *std::move(t.plan);
      best.input = std::move(t.input);
    } else {
      high = mid;
      best.next_params = mid;
      best.next_status = std::move(t.plan).status();
    }
  }
  return best;
}

Expected<DriveEndurance> endurance_from_tbw(double tbw) {
  if (!(tbw > 0) || !std::isfinite(tbw)) return invalid_argument("a rating of {} TBW: it must be a positive number of TB", tbw);
  return DriveEndurance{tbw * kBytesPerTb, fmt::format("{:g} TBW", tbw)};
}

Expected<DriveEndurance> endurance_from_dwpd(double dwpd, std::uint64_t capacity_bytes, double warranty_years) {
  if (!(dwpd > 0) || !std::isfinite(dwpd)) return invalid_argument("a rating of {} DWPD: it must be a positive number", dwpd);
  if (capacity_bytes == 0) return invalid_argument("a drive capacity of 0 bytes: a DWPD rating needs the drive's capacity");
  if (!(warranty_years > 0) || !std::isfinite(warranty_years)) {
    return invalid_argument("a warranty of {} years: it must be a positive number", warranty_years);
  }
  const double bytes = dwpd * static_cast<double>(capacity_bytes) * kDaysPerYear * warranty_years;
  return DriveEndurance{bytes, fmt::format("{:g} DWPD x {:.2f} TB x 365 days x {:g} years = {:.0f} TBW", dwpd,
                                           static_cast<double>(capacity_bytes) / kBytesPerTb, warranty_years,
                                           bytes / kBytesPerTb)};
}

DriveWear drive_wear(const Plan& plan, const PlanInput& input, double step_seconds, const DriveEndurance& endurance) {
  DriveWear w;
  const auto ranks = static_cast<std::uint64_t>(input.effective_ranks_per_node());
  const std::uint64_t per_rank = plan.traffic.nvme_write_bytes;
  w.written_per_step_bytes = per_rank > std::numeric_limits<std::uint64_t>::max() / ranks
                                 ? std::numeric_limits<std::uint64_t>::max()
                                 : per_rank * ranks;
  w.step_seconds = step_seconds;
  if (w.written_per_step_bytes == 0 || !(step_seconds > 0)) {
    w.days_to_rating = std::numeric_limits<double>::infinity();
    return w;
  }
  w.written_per_hour_bytes = static_cast<double>(w.written_per_step_bytes) * 3600.0 / step_seconds;
  w.days_to_rating = endurance.rated_bytes / (w.written_per_hour_bytes * 24.0);
  return w;
}

double nvme_bound_seconds(const Plan& plan, const PlanInput& input) {
  return static_cast<double>(plan.traffic.nvme_read_bytes) / input.links.nvme_read_Bps +
         static_cast<double>(plan.traffic.nvme_write_bytes) / input.links.nvme_write_Bps;
}

}  // namespace tz
