// The human-readable forms of kvtierd's JSON replies (`kvtier stats`, `kvtier policy`). A reply
// comes over a socket, from whatever listens there: it is read without trusting its shape. A
// reply that is not a JSON object is Corruption; a field that is absent or of another type
// prints as 0 (numbers) or "?" (names), and never ends the command.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier::cli {

// Tier occupancy, misses, policy and tenant bytes of a stats reply, one line each.
StatusOr<std::string> FormatStats(std::string_view reply);
// "eviction=... admission=... params={...}" of a policy reply.
StatusOr<std::string> FormatPolicy(std::string_view reply);

}  // namespace kvtier::cli
