#include "cluster/placement.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

namespace kvtier::cluster {

double RendezvousScore(std::string_view key, std::string_view node_id, double weight) {
  if (!(weight > 0)) return 0.0;
  // Seeding the key hash with the node id's hash keeps the two inputs from running together.
  uint64_t seed = XXH3_64bits(node_id.data(), node_id.size());
  uint64_t h = XXH3_64bits_withSeed(key.data(), key.size(), seed);
  // 53 high bits -> (0, 1): never 0 (log undefined) nor 1 (score infinite).
  double u = (static_cast<double>(h >> 11) + 0.5) / 9007199254740992.0;
  return -weight / std::log(u);
}

std::vector<size_t> PlaceOwners(std::string_view key, std::span<const MemberInfo> members,
                                uint32_t replicas) {
  struct Scored {
    double score;
    size_t index;
  };
  std::vector<Scored> scored;
  scored.reserve(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    double w = members[i].Weight();
    if (w > 0) scored.push_back({RendezvousScore(key, members[i].node_id, w), i});
  }
  std::sort(scored.begin(), scored.end(), [&](const Scored& a, const Scored& b) {
    if (a.score != b.score) return a.score > b.score;
    return members[a.index].node_id < members[b.index].node_id;
  });
  std::vector<size_t> owners;
  size_t want = std::min<size_t>(replicas, scored.size());
  owners.reserve(want);
  std::set<std::string_view> domains;
  std::vector<bool> taken(scored.size(), false);
  for (size_t i = 0; i < scored.size() && owners.size() < want; ++i) {
    const MemberInfo& m = members[scored[i].index];
    if (!m.failure_domain.empty() && !domains.insert(m.failure_domain).second) continue;
    owners.push_back(scored[i].index);
    taken[i] = true;
  }
  for (size_t i = 0; i < scored.size() && owners.size() < want; ++i) {
    if (!taken[i]) owners.push_back(scored[i].index);
  }
  return owners;
}

}  // namespace kvtier::cluster
