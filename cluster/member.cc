#include "cluster/member.h"

#include <nlohmann/json.hpp>

#include "cluster/http_client.h"

namespace kvtier::cluster {
namespace {

bool IsLabelChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

Status ValidateLabel(std::string_view what, std::string_view value, size_t bytes_max,
                     bool allow_empty) {
  if (value.empty() && !allow_empty) return Status::InvalidArgument(std::string(what) + " empty");
  if (value.size() > bytes_max) {
    return Status::InvalidArgument(std::string(what) + " over " + std::to_string(bytes_max) +
                                   " bytes");
  }
  for (char c : value) {
    if (!IsLabelChar(c)) {
      return Status::InvalidArgument(std::string(what) + " '" + std::string(value) +
                                     "': only A-Z a-z 0-9 . _ - allowed");
    }
  }
  return Status::Ok();
}

}  // namespace

double MemberInfo::Weight() const {
  if (draining) return 0.0;
  double gib = static_cast<double>(dram_bytes + ssd_bytes) / static_cast<double>(1ull << 30);
  return gib < 1.0 / 1024 ? 1.0 / 1024 : gib;
}

Status ValidateNodeId(std::string_view node_id) {
  return ValidateLabel("node id", node_id, kNodeIdBytesMax, false);
}

Status ValidateMember(const MemberInfo& m) {
  KVTIER_RETURN_IF_ERROR(ValidateNodeId(m.node_id));
  KVTIER_RETURN_IF_ERROR(
      ValidateLabel("failure domain", m.failure_domain, kFailureDomainBytesMax, true));
  if (m.peer_endpoint.size() > kPeerEndpointBytesMax) {
    return Status::InvalidArgument("peer endpoint too long");
  }
  KVTIER_RETURN_IF_ERROR(ParseHttpEndpoint(m.peer_endpoint).status());
  if (!m.admin_endpoint.empty()) {
    if (m.admin_endpoint.size() > kPeerEndpointBytesMax) {
      return Status::InvalidArgument("admin endpoint too long");
    }
    KVTIER_RETURN_IF_ERROR(ParseHttpEndpoint(m.admin_endpoint).status());
  }
  if (m.dram_bytes > (1ull << 60) || m.ssd_bytes > (1ull << 60)) {
    return Status::InvalidArgument("capacity over 2^60 bytes");
  }
  return Status::Ok();
}

std::string EncodeMember(const MemberInfo& m) {
  nlohmann::json j = {{"node_id", m.node_id},
                      {"peer_endpoint", m.peer_endpoint},
                      {"failure_domain", m.failure_domain},
                      {"dram_bytes", m.dram_bytes},
                      {"ssd_bytes", m.ssd_bytes},
                      {"draining", m.draining}};
  if (!m.admin_endpoint.empty()) j["admin_endpoint"] = m.admin_endpoint;
  if (m.keeps_copies) j["keeps_copies"] = true;
  return j.dump();
}

StatusOr<MemberInfo> DecodeMember(std::string_view text) {
  if (text.size() > kMemberRecordBytesMax) return Status::Corruption("member record too long");
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("member record not JSON");
  auto str = [&](const char* k) -> const nlohmann::json* {
    auto it = j.find(k);
    return it != j.end() && it->is_string() ? &*it : nullptr;
  };
  auto num = [&](const char* k) -> const nlohmann::json* {
    auto it = j.find(k);
    return it != j.end() && it->is_number_unsigned() ? &*it : nullptr;
  };
  if (!str("node_id") || !str("peer_endpoint") || !str("failure_domain") || !num("dram_bytes") ||
      !num("ssd_bytes")) {
    return Status::Corruption("member record: missing or mistyped field");
  }
  MemberInfo m;
  m.node_id = j["node_id"].get<std::string>();
  m.peer_endpoint = j["peer_endpoint"].get<std::string>();
  m.failure_domain = j["failure_domain"].get<std::string>();
  m.dram_bytes = j["dram_bytes"].get<uint64_t>();
  m.ssd_bytes = j["ssd_bytes"].get<uint64_t>();
  // Optional (records of older nodes lack it); mistyped is as bad as any other field.
  if (auto a = j.find("admin_endpoint"); a != j.end()) {
    if (!a->is_string()) return Status::Corruption("member record: admin_endpoint not a string");
    m.admin_endpoint = a->get<std::string>();
  }
  if (auto c = j.find("keeps_copies"); c != j.end()) {
    if (!c->is_boolean()) return Status::Corruption("member record: keeps_copies not a boolean");
    m.keeps_copies = c->get<bool>();
  }
  auto d = j.find("draining");
  m.draining = d != j.end() && d->is_boolean() && d->get<bool>();
  Status s = ValidateMember(m);
  if (!s.ok()) return Status::Corruption("member record: " + s.message());
  return m;
}

}  // namespace kvtier::cluster
