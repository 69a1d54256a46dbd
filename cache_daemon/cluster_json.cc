#include "cache_daemon/cluster_json.h"

#include <charconv>
#include <map>
#include <nlohmann/json.hpp>

#include "cache_daemon/cluster_node.h"

namespace kvtier::daemon {
namespace {

constexpr std::string_view kPrefix = "kvtier_cluster_";

nlohmann::ordered_json MetricsObject(std::string_view text) {
  std::map<std::string, std::string, std::less<>> types;  // family -> "gauge"/"counter"/...
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  size_t samples = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (line.rfind("# TYPE ", 0) == 0) {
      std::string_view rest = line.substr(7);
      size_t sp = rest.find(' ');
      if (sp != std::string_view::npos)
        types[std::string(rest.substr(0, sp))] = rest.substr(sp + 1);
      continue;
    }
    if (line.empty() || line[0] == '#' || line.rfind(kPrefix, 0) != 0) continue;
    // "<name>[{labels}] <value>": the series is everything before the last space.
    size_t sp = line.rfind(' ');
    if (sp == std::string_view::npos) continue;
    std::string_view series = line.substr(0, sp), value_text = line.substr(sp + 1);
    double value = 0;
    auto [ptr, ec] =
        std::from_chars(value_text.data(), value_text.data() + value_text.size(), value);
    if (ec != std::errc() || ptr != value_text.data() + value_text.size()) continue;
    std::string_view family = series.substr(0, series.find('{'));
    auto t = types.find(family);
    if (++samples > kClusterJsonSamplesMax) break;
    out[std::string(series)] = {{"type", t == types.end() ? "untyped" : t->second},
                                {"value", value}};
  }
  return out;
}

}  // namespace

std::string ClusterMetricsJson(std::string_view prometheus_text) {
  return MetricsObject(prometheus_text).dump();
}

std::string ClusterJson(const ClusterNode* node) {
  if (node == nullptr) return R"({"clustered":false})";
  auto view = node->view();
  cluster::MembershipStats ms = node->membership_stats();
  nlohmann::ordered_json j;
  j["clustered"] = true;
  j["node_id"] = node->node_id();
  j["etcd_reachable"] = ms.etcd_reachable;
  j["registered"] = ms.registered;
  j["view_revision"] = view->revision;
  auto& members = j["members"] = nlohmann::ordered_json::array();
  for (const cluster::MemberInfo& m : view->members) {
    members.push_back({{"node_id", m.node_id},
                       {"peer_endpoint", m.peer_endpoint},
                       {"failure_domain", m.failure_domain},
                       {"dram_bytes", m.dram_bytes},
                       {"ssd_bytes", m.ssd_bytes},
                       {"draining", m.draining},
                       {"self", m.node_id == node->node_id()}});
  }
  j["metrics"] = MetricsObject(node->RenderPrometheus());
  return j.dump();
}

}  // namespace kvtier::daemon
