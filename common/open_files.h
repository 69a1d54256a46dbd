// The process's open-file limit (RLIMIT_NOFILE) and the descriptors it holds.
//
// A server holds one descriptor per connection beside its files; Linux's default soft limit
// (1024) is below kvtierd's default limits.max_connections plus its files, while the hard
// limit is usually far higher (systemd units set both with LimitNOFILE=). A server therefore
// raises its soft limit to the hard one at start, as Go's runtime does for every program.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvtier {

struct OpenFilesLimit {
  uint64_t soft = 0;  // in force; RLIM_INFINITY reads as UINT64_MAX
  uint64_t hard = 0;
};

// Raises the soft RLIMIT_NOFILE to the hard one (no change when that fails: the limit in
// force is still returned). Returns the limits in force afterwards.
OpenFilesLimit RaiseOpenFilesLimit();

// Descriptors this process has open now (entries of /proc/self/fd); 0 when unknown.
uint64_t OpenFilesNow();

// Logs a warning when `limit` is below the descriptors open now plus `connection_fds` (those
// the server's connection limits allow it to hold): at the limit its fronts pause their
// accepts (common/accept_backoff.h), counted in `metric`; `remedy` says which limit to lower.
// Returns whether it warned.
bool WarnIfOpenFilesShort(const OpenFilesLimit& limit, uint64_t connection_fds,
                          std::string_view metric, std::string_view remedy);

}  // namespace kvtier
