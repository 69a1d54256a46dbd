// Reports for `kvtier sim`: human-readable table, JSON, and miss-ratio curves (CSV + SVG).
// Pure formatting except WriteCurves, which writes two files.
// Thread safety: stateless functions.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "sim/simulator.h"

namespace kvtier::sim {

struct ReportRow {
  SimResult result;
  double capacity_fraction = -1;  // < 0 when the capacity was not given as a fraction
};

// {"results": [{"policy", "capacity_blocks", "block_miss_ratio", "prefix_token_hit_ratio",
//   ...more fields}]}, pretty-printed.
std::string FormatJson(const std::vector<ReportRow>& rows, const std::string& trace_path);
std::string FormatText(const std::vector<ReportRow>& rows);
std::string FormatCsv(const std::vector<ReportRow>& rows);
// "lru", or "lru+prefix" for a run under the prefix structure (SimOptions::structure).
std::string Label(const SimResult& r);

enum class CurveMetric : uint8_t { kBlockMissRatio, kPrefixTokenHitRatio };
// A metric against capacity (fraction of unique units when known), one line per policy and
// structure, as a self-contained SVG document.
std::string FormatSvg(const std::vector<ReportRow>& rows, const std::string& title,
                      CurveMetric metric = CurveMetric::kBlockMissRatio);

// Writes PREFIX.csv, PREFIX.svg (block miss ratio) and PREFIX_prefix.svg (prefix-token hit
// ratio); `title` names the trace. IOError if any cannot be written.
Status WriteCurves(const std::vector<ReportRow>& rows, const std::string& prefix,
                   const std::string& title);

}  // namespace kvtier::sim
