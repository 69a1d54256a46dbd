// etcd_reply: the replies a real etcd sends (captured from etcd 3.4.23's JSON gateway with curl,
// 2026-12-04), and replies of the wrong shape, which must be errors, never exceptions.
#include "cluster/etcd_reply.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier::cluster::etcd_reply {
namespace {

const char kHeader[] =
    R"("header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437",)"
    R"("revision":"5","raft_term":"2"})";

std::string Reply(const std::string& fields) {
  return "{" + std::string(kHeader) + (fields.empty() ? "" : ",") + fields + "}";
}

TEST(EtcdReplyTest, ReadsWhatEtcdSends) {
  auto range = Range(
      Reply(R"("kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"2","version":"1",)"
            R"("value":"Yg=="},{"key":"Yw==","mod_revision":"4","lease":"7587899355078471176"}],)"
            R"("count":"2")"));
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  EXPECT_EQ(range->revision, 5);
  ASSERT_EQ(range->kvs.size(), 2u);
  EXPECT_EQ(range->kvs[0], (EtcdKeyValue{"a", "b", 2, 0}));
  EXPECT_EQ(range->kvs[1], (EtcdKeyValue{"c", "", 4, 7587899355078471176}));

  EXPECT_FALSE(range->more);
  // A limited range with keys left over (what a paged read continues after).
  auto page = Range(Reply(R"("kvs":[{"key":"YQ==","mod_revision":"2"}],"more":true,"count":"3")"));
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_TRUE(page->more);

  auto empty = Range(Reply(""));
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->kvs.empty());
  EXPECT_FALSE(empty->more);
  EXPECT_TRUE(FirstKeyValue(Reply("")).status().IsNotFound());
  EXPECT_EQ(FirstKeyValue(Reply(R"("kvs":[{"key":"YQ==","value":"Yg=="}])"))->value, "b");

  EXPECT_EQ(*Deleted(Reply(R"("deleted":"1")")), 1);
  EXPECT_EQ(*Deleted(Reply("")), 0);
  EXPECT_TRUE(*TxnSucceeded(Reply(R"("succeeded":true,"responses":[{"response_put":{}}])")));
  EXPECT_FALSE(*TxnSucceeded(Reply("")));  // a failed compare: the field is left out

  auto lease = LeaseGranted(Reply(R"("ID":"7587899355078471176","TTL":"30")"));
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->id, 7587899355078471176);
  EXPECT_EQ(lease->ttl_s, 30);
  EXPECT_EQ(
      *KeepAliveTtl("{\"result\":" + Reply(R"("ID":"7587899355078471178","TTL":"30")") + "}\n"),
      30);
  EXPECT_EQ(*KeepAliveTtl("{\"result\":" + Reply(R"("ID":"12345")") + "}\n"), 0);  // expired
  EXPECT_EQ(*TimeToLive(Reply(R"("ID":"7587899355078471178","TTL":"29","grantedTTL":"30")")), 29);
  EXPECT_EQ(*TimeToLive(Reply(R"("ID":"12345","TTL":"-1")")), -1);

  auto created = WatchMessage("{\"result\":" + Reply(R"("created":true)") + "}");
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->revision, 5);
  EXPECT_TRUE(created->events.empty());
  auto events = WatchMessage(
      "{\"result\":" +
      Reply(R"("events":[{"kv":{"key":"YQ==","create_revision":"4","mod_revision":"4",)"
            R"("version":"1","value":"Yg=="}},{"type":"DELETE","kv":{"key":"YQ==",)"
            R"("mod_revision":"6"}}])") +
      "}");
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  ASSERT_EQ(events->events.size(), 2u);
  EXPECT_EQ(events->events[0], (EtcdEvent{EtcdEvent::Type::kPut, {"a", "b", 4, 0}}));
  EXPECT_EQ(events->events[1], (EtcdEvent{EtcdEvent::Type::kDelete, {"a", "", 6, 0}}));
  // etcd's answer to a watch from a compacted revision: compacted wins over canceled.
  EXPECT_TRUE(WatchMessage(R"({"result":{"header":{"raft_term":"2"},"canceled":true,)"
                           R"("compact_revision":"3"}})")
                  .status()
                  .IsRejected());
  EXPECT_TRUE(WatchMessage(R"({"result":{"canceled":true}})").status().IsIOError());
}

TEST(EtcdReplyTest, ErrorRepliesBecomeTheirStatus) {
  EXPECT_TRUE(CheckUnary(200, Reply("")).ok());
  const char lease_gone[] =
      R"({"error":"etcdserver: requested lease not found","message":"etcdserver: requested )"
      R"(lease not found","code":5})";
  Status s = CheckUnary(200, lease_gone);
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_NE(s.message().find("requested lease not found"), std::string::npos);
  s = CheckUnary(400,
                 R"({"error":"invalid character 'b'","message":"invalid character 'b'","code":3})");
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_NE(s.message().find("invalid character"), std::string::npos);
  // A non-200 status is an error even without an error field (grpc-gateway v2 leaves it out).
  EXPECT_TRUE(CheckUnary(503, R"({"code":14,"message":"etcdserver: leader changed"})").IsIOError());
  // A stream's error is an object.
  s = WatchMessage(R"({"error":{"grpc_code":5,"http_code":404,"message":"gone"}})").status();
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_NE(s.message().find("gone"), std::string::npos);
}

TEST(EtcdReplyTest, RepliesOfTheWrongShapeAreCorruption) {
  for (const char* body : {"", "null", "[]", "\"x\"", "{bad", "{\"header\":{}} trailing"}) {
    EXPECT_TRUE(CheckUnary(200, body).IsCorruption()) << body;
    EXPECT_TRUE(Range(body).status().IsCorruption()) << body;
    EXPECT_TRUE(WatchMessage(body).status().IsCorruption()) << body;
  }
  const char* ranges[] = {
      R"({})",                                             // no header
      R"({"header":[]})",                                  // header not an object
      R"({"header":{"revision":"x"}})",                    // not an integer
      R"({"header":{"revision":"9223372036854775808"}})",  // over int64
      R"({"header":{"revision":18446744073709551615}})",   // over int64, as a number
      R"({"header":{"revision":1.5}})",                    // not an integer
      R"({"header":{},"kvs":{}})",                         // kvs not an array
      R"({"header":{},"kvs":[1]})",                        // a kv not an object
      R"({"header":{},"kvs":[{"key":7}]})",                // bytes not a string
      R"({"header":{},"kvs":[{"key":"YQ="}]})",            // not base64
      R"({"header":{},"kvs":[{"lease":true}]})",           // not an integer
      R"({"header":{},"more":"true"})",                    // not a boolean
  };
  for (const char* body : ranges) {
    EXPECT_TRUE(Range(body).status().IsCorruption()) << body;
  }
  EXPECT_TRUE(TxnSucceeded(R"({"succeeded":"yes"})").status().IsCorruption());
  EXPECT_TRUE(Deleted(R"({"deleted":[1]})").status().IsCorruption());
  EXPECT_TRUE(LeaseGranted(R"({"ID":"0","TTL":"5"})").status().IsCorruption());
  EXPECT_TRUE(LeaseGranted(R"({"ID":"1","TTL":"0"})").status().IsCorruption());
  EXPECT_TRUE(KeepAliveTtl(R"({"result":[]})").status().IsCorruption());
  EXPECT_TRUE(TimeToLive(R"({"TTL":{}})").status().IsCorruption());
  const char* watches[] = {
      R"({"result":[]})",
      R"({"result":{"canceled":"yes"}})",
      R"({"result":{"compact_revision":"x"}})",
      R"({"result":{"header":[]}})",
      R"({"result":{"events":{}}})",
      R"({"result":{"events":[{"type":"PUT"}]}})",
      R"({"result":{"events":[{"type":3,"kv":{}}]}})",
      R"({"result":{"events":[{"type":"MOVE","kv":{}}]}})",
      R"({"result":{"events":[{"kv":{"value":5}}]}})",
  };
  for (const char* line : watches) {
    EXPECT_TRUE(WatchMessage(line).status().IsCorruption()) << line;
  }
  // Error fields of any type are still errors (never an exception).
  for (const char* body :
       {R"({"error":1})", R"({"error":"x","code":"5"})", R"({"error":"x","message":["m"]})",
        R"({"error":null})", R"({"error":{"code":[]}})"}) {
    Status st = CheckUnary(200, body);
    EXPECT_TRUE(st.IsIOError() || st.IsNotFound()) << body << ": " << st.ToString();
    st = WatchMessage(body).status();
    EXPECT_TRUE(st.IsIOError() || st.IsNotFound()) << body << ": " << st.ToString();
  }
}

}  // namespace
}  // namespace kvtier::cluster::etcd_reply
