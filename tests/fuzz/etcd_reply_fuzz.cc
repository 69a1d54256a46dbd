// libFuzzer target: etcd's JSON gateway replies (cluster/etcd_reply.h) and the member records
// other nodes keep in etcd (cluster/member.h). kvtierd reads both from the network: a reply
// comes from whatever answers at an etcd endpoint, a record from any node that can write to
// etcd.
//
// Input: a reply's text, and optionally a NUL byte and "retype" bytes. Those replace values of
// the reply (when it parses as JSON) with values of other JSON types, one byte per value in a
// depth-first walk, and the readers run on that reply too: a field of the wrong type is one
// byte away, where byte-level mutations of the text seldom make one.
//
// Invariants, beyond no crash, no exception escaping (a thrown exception ends the run as a
// crash), no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - every reader returns a Status; errors are of the documented codes;
//   - a range and a watch message read back the same when written again the way etcd writes
//     them (base64 bytes, int64 as strings), and a decoded member record encodes and decodes to
//     itself;
//   - base64 that decodes encodes to text that decodes to the same bytes.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_etcd_reply_fuzz
//   build/fuzz/tests/fuzz/kvtier_etcd_reply_fuzz -max_total_time=60 -len_control=0 -max_len=2048 \
//       -dict=tests/fuzz/etcd_reply.dict NEW_CORPUS_DIR tests/fuzz/seeds/etcd_reply
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cluster/base64.h"
#include "cluster/etcd_reply.h"
#include "cluster/member.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using json = nlohmann::json;
using kvtier::Status;
using kvtier::StatusCode;
using kvtier::fuzz::Require;
namespace cluster = kvtier::cluster;
namespace etcd_reply = kvtier::cluster::etcd_reply;

// A Status whose code is one of codes.
bool CodeIn(const Status& s, std::initializer_list<StatusCode> codes) {
  for (StatusCode c : codes) {
    if (s.code() == c) return true;
  }
  return false;
}

json KeyValueJson(const cluster::EtcdKeyValue& kv) {
  return {{"key", cluster::Base64Encode(kv.key)},
          {"value", cluster::Base64Encode(kv.value)},
          {"mod_revision", std::to_string(kv.mod_revision)},
          {"lease", std::to_string(kv.lease)}};
}

void CheckRange(std::string_view text) {
  auto range = etcd_reply::Range(text);
  if (!range.ok()) {
    Require(CodeIn(range.status(), {StatusCode::kCorruption}));
    return;
  }
  json kvs = json::array();
  for (const auto& kv : range->kvs) kvs.push_back(KeyValueJson(kv));
  json again = {{"header", {{"revision", std::to_string(range->revision)}}}, {"kvs", kvs}};
  auto back = etcd_reply::Range(again.dump());
  Require(back.ok() && back->revision == range->revision && back->kvs == range->kvs);
}

void CheckWatch(std::string_view text) {
  auto message = etcd_reply::WatchMessage(text);
  if (!message.ok()) {
    Require(CodeIn(message.status(), {StatusCode::kCorruption, StatusCode::kRejected,
                                      StatusCode::kIOError, StatusCode::kNotFound}));
    return;
  }
  json events = json::array();
  for (const auto& e : message->events) {
    events.push_back({{"type", e.type == cluster::EtcdEvent::Type::kDelete ? "DELETE" : "PUT"},
                      {"kv", KeyValueJson(e.kv)}});
  }
  json again = {
      {"result",
       {{"header", {{"revision", std::to_string(message->revision)}}}, {"events", events}}}};
  auto back = etcd_reply::WatchMessage(again.dump());
  Require(back.ok() && back->revision == message->revision && back->events == message->events);
}

void CheckMember(std::string_view text) {
  auto member = cluster::DecodeMember(text);
  if (!member.ok()) {
    Require(member.status().IsCorruption());
    return;
  }
  auto back = cluster::DecodeMember(cluster::EncodeMember(*member));
  Require(back.ok() && *back == *member);
}

void CheckBase64(std::string_view text) {
  auto bytes = cluster::Base64Decode(text);
  if (!bytes.ok()) return;
  auto back = cluster::Base64Decode(cluster::Base64Encode(*bytes));
  Require(back.ok() && *back == *bytes);
}

// Replaces values in j by the next choice byte each: a byte below the number of replacements
// picks one, any other leaves the value and walks into it.
void Retype(json* j, std::string_view* choices) {
  static const json kReplacements[] = {
      nullptr,       true,           0,          -1,     1.5,  "x",
      json::array(), json::object(), UINT64_MAX, "YQ==", "-1", "9223372036854775808"};
  if (choices->empty()) return;
  const auto c = static_cast<uint8_t>(choices->front());
  choices->remove_prefix(1);
  if (c < std::size(kReplacements)) {
    *j = kReplacements[c];
  } else if (j->is_object() || j->is_array()) {
    for (auto& v : *j) Retype(&v, choices);
  }
}

void CheckReply(std::string_view text) {
  for (int status : {200, 404}) {
    Status s = etcd_reply::CheckUnary(status, text);
    Require(
        s.ok() ? status == 200
               : CodeIn(s, {StatusCode::kCorruption, StatusCode::kIOError, StatusCode::kNotFound}));
  }
  CheckRange(text);
  CheckWatch(text);
  CheckMember(text);
  CheckBase64(text);
  auto kv = etcd_reply::FirstKeyValue(text);
  Require(kv.ok() || CodeIn(kv.status(), {StatusCode::kCorruption, StatusCode::kNotFound}));
  auto lease = etcd_reply::LeaseGranted(text);
  Require(lease.ok() ? lease->id != 0 && lease->ttl_s > 0 : lease.status().IsCorruption());
  auto ttl = etcd_reply::KeepAliveTtl(text);
  Require(ttl.ok() ? *ttl >= 0 : ttl.status().IsCorruption());
  auto left = etcd_reply::TimeToLive(text);
  Require(left.ok() ? *left >= -1 : left.status().IsCorruption());
  auto succeeded = etcd_reply::TxnSucceeded(text);
  Require(succeeded.ok() || succeeded.status().IsCorruption());
  auto deleted = etcd_reply::Deleted(text);
  Require(deleted.ok() || deleted.status().IsCorruption());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view text = input.substr(0, nul);
  CheckReply(text);
  if (nul == std::string_view::npos) return 0;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  std::string_view choices = input.substr(nul + 1);
  Retype(&j, &choices);
  CheckReply(j.dump());
  return 0;
}
