// The dashboard page's files, embedded into kvtierd at build time (cache_daemon/dashboard/ and
// the plotting library from Debian's libjs-dygraphs; cmake/EmbedAssets.cmake writes the table).
// Served by the HTTP admin front (http_admin.cc) at their url paths; "/" is the page.
// Thread safety: immutable static data.
#pragma once

#include <string_view>

namespace kvtier::daemon {

struct DashboardAsset {
  std::string_view path;          // url path, e.g. "/" or "/dashboard/dashboard.js"
  std::string_view content_type;  // media type (text/html, text/css, text/javascript); UTF-8
  std::string_view body;
};

// The asset served at `path` (query string already removed); nullptr when none.
const DashboardAsset* FindDashboardAsset(std::string_view path);

}  // namespace kvtier::daemon
