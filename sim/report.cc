#include "sim/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "common/json_text.h"

namespace kvtier::sim {
namespace {

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

double XOf(const ReportRow& r) {
  return r.capacity_fraction >= 0 ? r.capacity_fraction
                                  : static_cast<double>(r.result.capacity_units);
}

Status WriteFile(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::IOError("cannot write '" + path + "'");
  size_t n = std::fwrite(text.data(), 1, text.size(), f);
  int rc = std::fclose(f);
  if (n != text.size() || rc != 0) return Status::IOError("short write to '" + path + "'");
  return Status::Ok();
}

}  // namespace

std::string Label(const SimResult& r) {
  return r.structure == Structure::kPrefix ? r.policy + "+prefix" : r.policy;
}

std::string FormatJson(const std::vector<ReportRow>& rows, const std::string& trace_path) {
  nlohmann::ordered_json out;
  out["trace"] = trace_path;
  auto& results = out["results"] = nlohmann::ordered_json::array();
  for (const auto& row : rows) {
    const SimResult& r = row.result;
    nlohmann::ordered_json j;
    j["policy"] = r.policy;
    j["structure"] = r.structure == Structure::kPrefix ? "prefix" : "plain";
    j["capacity_blocks"] = r.capacity_units;
    if (row.capacity_fraction >= 0) j["capacity_fraction"] = row.capacity_fraction;
    j["prefix_token_hit_ratio"] = r.prefix_token_hit_ratio;
    j["money_saved_usd"] = r.money_saved_usd;
    j["block_miss_ratio"] = r.block_miss_ratio;
    j["partial_refs"] = r.partial_refs;
    j["leaf_swaps"] = r.leaf_swaps;
    j["orphans_dropped"] = r.orphans_dropped;
    j["unusable_hits"] = r.unusable_hits;
    j["unique_blocks"] = r.unique_units;
    j["requests"] = r.requests;
    j["block_refs"] = r.read_refs;
    j["misses"] = r.misses;
    j["dram_hits"] = r.dram_hits;
    j["ssd_hits"] = r.ssd_hits;
    j["ssd_capacity_blocks"] = r.ssd_capacity_units;
    if (r.ssd_capacity_units > 0) {
      j["ssd_policy"] = r.ssd_policy;
      j["admission"] = r.admission;
    }
    j["ssd_bytes_written"] = r.ssd_bytes_written;
    j["ssd_admitted"] = r.ssd_admitted;
    j["ssd_rejected"] = r.ssd_rejected;
    j["input_tokens"] = r.input_tokens;
    j["prefill_tokens_saved"] = r.prefix_hit_tokens;
    j["cost_no_cache_usd"] = r.cost_no_cache_usd;
    j["cost_with_cache_usd"] = r.cost_with_cache_usd;
    results.push_back(std::move(j));
  }
  return JsonText(out, 2) + "\n";
}

std::string FormatText(const std::vector<ReportRow>& rows) {
  std::string s;
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%-17s %9s %10s %8s %10s %8s %10s %10s %12s\n", "policy",
                "fraction", "capacity", "prefix", "saved_usd", "miss", "dram_hits", "ssd_hits",
                "ssd_written");
  s += buf;
  for (const auto& row : rows) {
    const SimResult& r = row.result;
    std::string frac = row.capacity_fraction >= 0 ? Fmt("%.4f", row.capacity_fraction) : "-";
    std::snprintf(buf, sizeof(buf), "%-17s %9s %10llu %8.4f %10.4f %8.4f %10llu %10llu %12s\n",
                  Label(r).c_str(), frac.c_str(), static_cast<unsigned long long>(r.capacity_units),
                  r.prefix_token_hit_ratio, r.money_saved_usd, r.block_miss_ratio,
                  static_cast<unsigned long long>(r.dram_hits),
                  static_cast<unsigned long long>(r.ssd_hits),
                  (Fmt("%.3f", static_cast<double>(r.ssd_bytes_written) / 1e9) + " GB").c_str());
    s += buf;
  }
  return s;
}

std::string FormatCsv(const std::vector<ReportRow>& rows) {
  std::string s =
      "policy,capacity_fraction,capacity_blocks,block_miss_ratio,prefix_token_hit_ratio,"
      "ssd_bytes_written,money_saved_usd\n";
  char buf[256];
  for (const auto& row : rows) {
    const SimResult& r = row.result;
    std::snprintf(buf, sizeof(buf), "%s,%.6f,%llu,%.6f,%.6f,%llu,%.6f\n", Label(r).c_str(),
                  row.capacity_fraction, static_cast<unsigned long long>(r.capacity_units),
                  r.block_miss_ratio, r.prefix_token_hit_ratio,
                  static_cast<unsigned long long>(r.ssd_bytes_written), r.money_saved_usd);
    s += buf;
  }
  return s;
}

std::string FormatSvg(const std::vector<ReportRow>& rows, const std::string& title,
                      CurveMetric metric) {
  const bool miss = metric == CurveMetric::kBlockMissRatio;
  constexpr double kW = 640, kH = 400, kL = 60, kR = 150, kT = 40, kB = 50;
  std::map<std::string, std::vector<std::pair<double, double>>> lines;
  double xmax = 0, ymin = 1, ymax = 0;
  for (const auto& row : rows) {
    double x = XOf(row), y = miss ? row.result.block_miss_ratio : row.result.prefix_token_hit_ratio;
    lines[Label(row.result)].emplace_back(x, y);
    xmax = std::max(xmax, x);
    ymin = std::min(ymin, y);
    ymax = std::max(ymax, y);
  }
  if (xmax <= 0) xmax = 1;
  ymin = std::max(0.0, std::floor(ymin * 10) / 10);
  ymax = std::min(1.0, std::ceil(ymax * 10) / 10);
  if (ymax <= ymin) ymax = ymin + 0.1;
  auto px = [&](double x) { return kL + x / xmax * (kW - kL - kR); };
  auto py = [&](double y) { return kT + (ymax - y) / (ymax - ymin) * (kH - kT - kB); };
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  std::string s;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
                "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
                "height=\"100%%\" fill=\"white\"/>\n<text x=\"%g\" y=\"20\" "
                "font-size=\"14\">",
                kW, kH, kL);
  s += buf;
  for (char c : title) {
    if (c == '<') {
      s += "&lt;";
    } else if (c == '&') {
      s += "&amp;";
    } else {
      s += c;
    }
  }
  s += "</text>\n";
  std::snprintf(buf, sizeof(buf),
                "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n"
                "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n",
                kL, kH - kB, kW - kR, kH - kB, kL, kT, kL, kH - kB);
  s += buf;
  for (int i = 0; i <= 4; ++i) {
    double y = ymin + (ymax - ymin) * i / 4, x = xmax * i / 4;
    std::snprintf(buf, sizeof(buf),
                  "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.2f</text>\n"
                  "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%.3g</text>\n",
                  kL - 5, py(y) + 4, y, px(x), kH - kB + 16, x);
    s += buf;
  }
  std::snprintf(buf, sizeof(buf),
                "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">cache size (fraction of unique "
                "blocks)</text>\n<text x=\"14\" y=\"%g\" transform=\"rotate(-90 14 %g)\" "
                "text-anchor=\"middle\">%s</text>\n",
                (kL + kW - kR) / 2, kH - 12, (kT + kH - kB) / 2, (kT + kH - kB) / 2,
                miss ? "block miss ratio" : "prefix-token hit ratio");
  s += buf;
  // One colour per policy; its run under the prefix structure is the same colour, dashed.
  std::map<std::string, size_t> color_of;
  for (const auto& [name, pts] : lines) {
    (void)pts;
    const std::string base = name.substr(0, name.find('+'));
    color_of.emplace(base, color_of.size());
  }
  size_t i = 0;
  for (auto& [name, pts] : lines) {
    std::sort(pts.begin(), pts.end());
    const size_t plus = name.find('+');
    const char* color = kColors[color_of[name.substr(0, plus)] % 10];
    s += "<polyline fill=\"none\" stroke-width=\"2\" ";
    if (plus != std::string::npos) s += "stroke-dasharray=\"6,3\" ";
    s += "stroke=\"";
    s += color;
    s += "\" points=\"";
    for (const auto& [x, y] : pts) {
      std::snprintf(buf, sizeof(buf), "%.1f,%.1f ", px(x), py(y));
      s += buf;
    }
    s += "\"/>\n";
    std::snprintf(buf, sizeof(buf), "<text x=\"%g\" y=\"%g\" fill=\"%s\">%s</text>\n", kW - kR + 10,
                  kT + 16.0 * static_cast<double>(i), color, name.c_str());
    s += buf;
    ++i;
  }
  s += "</svg>\n";
  return s;
}

Status WriteCurves(const std::vector<ReportRow>& rows, const std::string& prefix,
                   const std::string& title) {
  KVTIER_RETURN_IF_ERROR(WriteFile(prefix + ".csv", FormatCsv(rows)));
  KVTIER_RETURN_IF_ERROR(WriteFile(prefix + ".svg", FormatSvg(rows, "miss ratio: " + title)));
  return WriteFile(prefix + "_prefix.svg", FormatSvg(rows, "prefix-token hit ratio: " + title,
                                                     CurveMetric::kPrefixTokenHitRatio));
}

}  // namespace kvtier::sim
