// Placement: which live nodes own a unit. A pure function of (storage key, membership, R):
// every node that sees the same membership computes the same owners, with no coordination.
//
// Weighted rendezvous hashing (highest random weight): each member scores
//   score(key, node) = -weight(node) / ln(u),  u = hash(key, node_id) mapped into (0, 1),
// and the R highest scores own the key. A member's expected share of keys is proportional to
// its weight (MemberInfo::Weight, its capacity); a member with weight 0 (draining) owns
// nothing. Adding a member only moves keys to it; removing one only moves its keys away.
//
// Failure domains: owners are picked in score order, first skipping members whose failure
// domain an earlier owner already has (an empty label counts as a domain of its own), then,
// when there are fewer domains than R, filling with the best remaining members. With
// labels, join/leave stability holds per domain but not exactly across them.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "cluster/member.h"

namespace kvtier::cluster {

// Rendezvous score of key on a member with the given weight (0 for weight <= 0).
double RendezvousScore(std::string_view key, std::string_view node_id, double weight);

// Indices into members of the key's owners, best first: min(replicas, members with weight >
// 0) of them, distinct. members need not be sorted; equal scores are broken by node id.
std::vector<size_t> PlaceOwners(std::string_view key, std::span<const MemberInfo> members,
                                uint32_t replicas);

}  // namespace kvtier::cluster
