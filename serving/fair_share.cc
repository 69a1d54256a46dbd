#include "serving/fair_share.h"

#include <algorithm>
#include <cmath>

namespace kvtier::serving {

std::vector<uint64_t> FairShares(std::span<const uint64_t> demand, std::span<const uint32_t> weight,
                                 uint64_t budget, std::vector<double>* credit) {
  const size_t n = demand.size();
  credit->resize(n, 0.0);
  std::vector<uint64_t> given(n, 0);
  std::vector<size_t> open;
  for (size_t i = 0; i < n; ++i) {
    if (demand[i] > 0) {
      open.push_back(i);
    } else {
      (*credit)[i] = 0;
    }
  }
  uint64_t left = budget;
  while (!open.empty() && left > 0) {
    double w = 0;
    for (size_t i : open) w += std::max<uint32_t>(1, weight[i]);
    // Tenants whose remaining demand fits in their share take it all; split again.
    std::vector<size_t> still;
    uint64_t used = 0;
    for (size_t i : open) {
      const double share = static_cast<double>(left) * std::max<uint32_t>(1, weight[i]) / w;
      if (static_cast<double>(demand[i]) <= share) {
        given[i] = demand[i];
        used += demand[i];
        (*credit)[i] = 0;
      } else {
        still.push_back(i);
      }
    }
    if (used > 0) {
      left -= used;
      open = std::move(still);
      continue;
    }
    // Every open tenant wants more than its share: floor of the exact share each, the
    // remainder one token each to the largest fractional part plus credit.
    std::vector<double> exact(n, 0.0);
    uint64_t floors = 0;
    for (size_t i : open) {
      exact[i] = static_cast<double>(left) * std::max<uint32_t>(1, weight[i]) / w;
      given[i] = std::min<uint64_t>(demand[i], static_cast<uint64_t>(std::floor(exact[i])));
      floors += given[i];
    }
    std::vector<size_t> order = open;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return exact[a] - std::floor(exact[a]) + (*credit)[a] >
             exact[b] - std::floor(exact[b]) + (*credit)[b];
    });
    for (size_t k = 0; k < order.size() && floors < left; ++k) {
      if (given[order[k]] < demand[order[k]]) {
        ++given[order[k]];
        ++floors;
      }
    }
    for (size_t i : open) (*credit)[i] += exact[i] - static_cast<double>(given[i]);
    break;
  }
  return given;
}

}  // namespace kvtier::serving
