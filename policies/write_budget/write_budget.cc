#include "policies/write_budget/write_budget.h"

#include "policies/internal/params.h"

namespace kvtier::policies {

StatusOr<std::unique_ptr<AdmissionPolicy>> WriteBudgetPolicy::Make(const PolicyParams& params) {
  WriteBudgetOptions o;
  internal::ParamReader r("write-budget", params);
  KVTIER_RETURN_IF_ERROR(r.Uint("bytes_per_day", &o.bytes_per_day, 0, UINT64_MAX));
  KVTIER_RETURN_IF_ERROR(r.Uint("window_ms", &o.window_ms, 1, 365ull * 24 * 3600 * 1000));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<AdmissionPolicy>(new WriteBudgetPolicy(o));
}

bool WriteBudgetPolicy::Admit(const ObjectInfo& info, uint64_t now_us) {
  uint64_t window = now_us / (options_.window_ms * 1000);
  if (window != window_) {
    window_ = window;
    spent_bytes_ = 0;
  }
  if (spent_bytes_ > options_.bytes_per_day ||
      info.size_bytes > options_.bytes_per_day - spent_bytes_) {
    return false;
  }
  spent_bytes_ += info.size_bytes;
  return true;
}

std::optional<AdmissionPolicy::ByteBudget> WriteBudgetPolicy::Budget(uint64_t now_us) const {
  const bool same_window = now_us / (options_.window_ms * 1000) == window_;
  return ByteBudget{.bytes_per_window = options_.bytes_per_day,
                    .window_ms = options_.window_ms,
                    .spent_bytes = same_window ? spent_bytes_ : 0};
}

void WriteBudgetPolicy::CarryOver(const AdmissionPolicy& previous, uint64_t now_us) {
  const std::optional<ByteBudget> b = previous.Budget(now_us);
  if (!b) return;
  window_ = now_us / (options_.window_ms * 1000);
  spent_bytes_ = b->spent_bytes;
}

}  // namespace kvtier::policies
