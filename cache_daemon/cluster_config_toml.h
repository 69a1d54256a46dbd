// The [cluster] table reader, shared by config.cc and cluster_config.cc only (keeps toml++
// out of config.h).
#pragma once

#include <toml++/toml.h>

#include "cache_daemon/cluster_config.h"

namespace kvtier::daemon {

// Reads the [cluster] table. InvalidArgument naming the key for an unknown key or a value of
// the wrong type.
Status ReadClusterTable(const toml::table& table, ClusterServeOptions* out);

}  // namespace kvtier::daemon
