#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/ops.h"

namespace kvtier::engine {

double Sampler::NextUniform() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

int Sampler::Nucleus(std::span<const float> logits, std::vector<double>* p,
                     std::vector<int32_t>* order) const {
  const int n = static_cast<int>(logits.size());
  const double mx = *std::max_element(logits.begin(), logits.end());
  p->assign(n, 0.0);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    (*p)[i] = std::exp((logits[i] - mx) / temperature_);
    sum += (*p)[i];
  }
  order->resize(n);
  std::iota(order->begin(), order->end(), 0);
  std::stable_sort(order->begin(), order->end(),
                   [&](int32_t a, int32_t b) { return (*p)[a] > (*p)[b]; });
  const double top_p = std::clamp(top_p_, 1e-9, 1.0);
  double cum = 0;
  int keep = 0;
  while (keep < n) {
    cum += (*p)[(*order)[keep]] / sum;
    ++keep;
    if (cum >= top_p) break;
  }
  return keep;
}

int32_t Sampler::Sample(std::span<const float> logits) {
  const int n = static_cast<int>(logits.size());
  if (n == 0) return -1;
  if (temperature_ <= 0) {
    return static_cast<int32_t>(ArgMax(logits.data(), n));
  }
  std::vector<double> p;
  std::vector<int32_t> order;
  const int keep = Nucleus(logits, &p, &order);
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += p[order[i]];
  double r = NextUniform() * kept;
  for (int i = 0; i < keep; ++i) {
    r -= p[order[i]];
    if (r < 0) return order[i];
  }
  return order[keep - 1];
}

std::vector<double> Sampler::Probabilities(std::span<const float> logits) const {
  const int n = static_cast<int>(logits.size());
  std::vector<double> out(n, 0.0);
  if (n == 0) return out;
  if (temperature_ <= 0) {
    out[ArgMax(logits.data(), n)] = 1.0;
    return out;
  }
  std::vector<double> p;
  std::vector<int32_t> order;
  const int keep = Nucleus(logits, &p, &order);
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += p[order[i]];
  for (int i = 0; i < keep; ++i) out[order[i]] = p[order[i]] / kept;
  return out;
}

int32_t Sampler::SampleFrom(const std::vector<double>& p) {
  double sum = 0;
  int32_t last = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0) {
      sum += p[i];
      last = static_cast<int32_t>(i);
    }
  }
  if (last < 0) return -1;
  double r = NextUniform() * sum;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0) continue;
    r -= p[i];
    if (r < 0) return static_cast<int32_t>(i);
  }
  return last;
}

}  // namespace kvtier::engine
