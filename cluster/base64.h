// Standard base64 (RFC 4648, with padding), as etcd's JSON gateway encodes bytes fields.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier::cluster {

std::string Base64Encode(std::string_view bytes);
// Corruption for a length that is not a multiple of 4, a character outside the alphabet or
// misplaced padding.
StatusOr<std::string> Base64Decode(std::string_view text);

}  // namespace kvtier::cluster
