// RemoteEngramRowSource against RowServers on loopback TCP serving the files written by
// ExportEngramTables: rows and engine logits equal the local table's bit for bit, a row
// server restarted between steps is reconnected transparently, and a server that stays
// down is a clear error (never zeros).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/temp_dir.h"
#include "engine/config.h"
#include "engine/engram.h"
#include "engine/engram_export.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/weights.h"
#include "rdma/engram_table.h"
#include "rdma/row_server.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Prompt;
const EngineConfig& Config() { return testutil::MiniConfig(); }
std::shared_ptr<const ModelWeights> Weights() { return testutil::MiniWeights(); }

constexpr uint32_t kShards = 3;
const char* kTenant = "engine-a";

class RemoteEngramTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok()) << tmp_.status().ToString();
    dir_ = tmp_.path();
    // Start first (port 0) so the shard map can name the bound port.
    server_ = std::make_unique<rdma::RowServer>(rdma::RowServerOptions{});
    ASSERT_TRUE(server_->Start().ok());
    port_ = server_->port();
    EngramExportOptions eo;
    eo.out_dir = dir_;
    eo.shards = kShards;
    eo.endpoints = {"127.0.0.1:" + std::to_string(port_)};
    auto r = ExportEngramTables(Config(), *Weights(), eo);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    export_ = *r;
    ASSERT_EQ(export_.files.size(), Config().engram_layer_ids.size() * kShards);
    for (const auto& f : export_.files) {
      ASSERT_TRUE(server_->RegisterTable(f.region, f.path).ok());
      auto tok = server_->IssueGrant(f.region, kTenant, 600000);
      ASSERT_TRUE(tok.ok());
      tokens_[f.region] = *tok;
    }
  }
  void TearDown() override {
    source_.reset();
    if (server_) server_->Stop();
  }

  // A new server on the same port with the same tables and grants (a restarted row server).
  void RestartServer(uint32_t response_delay_ms = 0) {
    server_->Stop();
    server_.reset();
    rdma::RowServerOptions o;
    o.port = port_;
    o.TEST_response_delay_ms = response_delay_ms;
    server_ = std::make_unique<rdma::RowServer>(o);
    for (const auto& f : export_.files) {
      ASSERT_TRUE(server_->RegisterTable(f.region, f.path).ok());
      ASSERT_TRUE(server_->AddGrant(tokens_[f.region], f.region, kTenant, 600000).ok());
    }
    Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(server_->port(), port_);
  }

  RemoteEngramRowSource* Connect(RemoteEngramOptions o = {}) {
    RemoteEngramConfig rc;
    rc.shard_map_toml = export_.shard_map_toml;
    rc.layer_ids = Config().engram_layer_ids;
    rc.tenant = kTenant;
    rc.tokens = tokens_;
    auto s = RemoteEngramRowSource::Connect(Config().engram_head_dim, rc, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return nullptr;
    source_ = std::move(*s);
    return source_.get();
  }

  std::unique_ptr<Engine> MakeEngine(EngramRowSource* rows, int chunk = 256, int lookahead = 1) {
    EngineOptions o;
    o.threads = 2;
    o.engram_rows = rows;
    o.prefill_chunk_tokens = chunk;
    o.engram_lookahead_chunks = lookahead;
    auto e = Engine::Create(Config(), Weights(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }

  // Prefill of `prompt` then `decode_steps` greedy-free decode steps of fixed tokens;
  // every step's logits concatenated. `between` runs after the prefill.
  Status Run(Engine* e, const std::vector<int32_t>& prompt, int decode_steps,
             std::vector<float>* all, const std::function<void()>& between = {}) {
    SequenceState st = e->NewSequence();
    std::vector<float> logits;
    KVTIER_RETURN_IF_ERROR(e->Forward(&st, prompt, true, &logits));
    all->insert(all->end(), logits.begin(), logits.end());
    const std::vector<int32_t> next = Prompt(decode_steps, 99);
    for (int i = 0; i < decode_steps; ++i) {
      if (between && i == 1) between();
      KVTIER_RETURN_IF_ERROR(e->Decode(&st, next[i], &logits));
      all->insert(all->end(), logits.begin(), logits.end());
    }
    return Status::Ok();
  }

  TempDir tmp_{"kvtier_engram_"};  // removed after the server has stopped (declared first)
  std::string dir_;
  uint16_t port_ = 0;
  std::unique_ptr<rdma::RowServer> server_;
  EngramExportResult export_;
  std::map<std::string, rdma::wire::GrantToken> tokens_;
  std::unique_ptr<RemoteEngramRowSource> source_;
};

TEST_F(RemoteEngramTest, ExportedFilesHoldTheWeightsRows) {
  const int rd = Config().engram_head_dim;
  for (const auto& f : export_.files) {
    auto t = rdma::MappedTable::Open(f.path);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const auto& h = (*t)->header();
    EXPECT_EQ(h.row_dim, static_cast<uint32_t>(rd));
    EXPECT_EQ(h.row_begin, f.row_begin);
    EXPECT_EQ(h.row_count, f.row_end - f.row_begin);
    EXPECT_EQ(h.layer_id, static_cast<uint32_t>(f.layer_id));
    const std::string p = "layers." + std::to_string(f.layer_id) + ".engram.";
    const Tensor* d = Weights()->Find(p + "table");
    const Tensor* s = Weights()->Find(p + "table_scale");
    ASSERT_NE(d, nullptr);
    ASSERT_NE(s, nullptr);
    for (uint64_t r = 0; r < h.row_count; ++r) {
      const uint8_t* row = (*t)->rows().data() + r * h.row_stride_bytes;
      const uint64_t g = h.row_begin + r;
      ASSERT_EQ(std::memcmp(row, d->bytes.data() + g * rd, rd), 0) << f.region << " row " << g;
      ASSERT_EQ(std::memcmp(row + rd, s->bytes.data() + g * (rd / 32), rd / 32), 0);
    }
  }
}

TEST_F(RemoteEngramTest, RemoteRowsEqualLocalRowsBitForBit) {
  RemoteEngramRowSource* remote = Connect();
  ASSERT_NE(remote, nullptr);
  auto rows = EngramTableRows(Config());
  ASSERT_TRUE(rows.ok());
  std::vector<LocalEngramRowSource::Table> tables;
  for (int l : Config().engram_layer_ids) {
    const std::string p = "layers." + std::to_string(l) + ".engram.";
    tables.push_back({Weights()->Find(p + "table")->bytes.data(),
                      Weights()->Find(p + "table_scale")->bytes.data(),
                      Weights()->Find(p + "table")->shape[0]});
  }
  LocalEngramRowSource local(Config().engram_head_dim, tables);
  std::mt19937_64 rng(3);
  for (int slot = 0; slot < static_cast<int>(tables.size()); ++slot) {
    const int64_t n = (*rows)[slot];
    EngramRowBatch a, b;
    a.slot = b.slot = slot;
    // Edges, shard boundaries, duplicates and random rows.
    a.row_ids = {0, n - 1, n / 3, n / 3 - 1, 2 * n / 3, 0, n - 1};
    for (int i = 0; i < 3000; ++i) a.row_ids.push_back(static_cast<int64_t>(rng() % n));
    b.row_ids = a.row_ids;
    ASSERT_TRUE(remote->Request(&a).ok());
    ASSERT_TRUE(local.Request(&b).ok());
    Status s = remote->Wait(&a);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(local.Wait(&b).ok());
    ASSERT_EQ(a.data.size(), b.data.size());
    ASSERT_EQ(a.scales.size(), b.scales.size());
    EXPECT_EQ(std::memcmp(a.data.data(), b.data.data(), a.data.size()), 0);
    EXPECT_EQ(std::memcmp(a.scales.data(), b.scales.data(), a.scales.size()), 0);
    // A row outside the table is refused up front.
    EngramRowBatch bad;
    bad.slot = slot;
    bad.row_ids = {n};
    EXPECT_TRUE(remote->Request(&bad).IsInvalidArgument());
  }
  const RemoteEngramStats st = remote->stats();
  EXPECT_EQ(st.requests, 2u);
  EXPECT_GT(st.fetch.rows_deduplicated, 0u);
  EXPECT_GT(st.fetch.rows_read, 0u);
}

TEST_F(RemoteEngramTest, LargeBatchesAreSplitIntoFetchesAndBoundedByStaging) {
  RemoteEngramOptions o;
  o.fetcher.rows_per_fetch_max = 500;  // a 2900-row batch becomes 6 fetches
  o.staging_rows_max = 3000;
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  const std::string p = "layers." + std::to_string(Config().engram_layer_ids[1]) + ".engram.";
  const Tensor* d = Weights()->Find(p + "table");
  const Tensor* sc = Weights()->Find(p + "table_scale");
  const int rd = Config().engram_head_dim;
  EngramRowBatch b;
  b.slot = 1;
  for (int64_t i = 0; i < 2900; ++i) b.row_ids.push_back((i * 7919) % d->shape[0]);
  ASSERT_TRUE(remote->Request(&b).ok());
  // The same batch cannot be outstanding twice; a second one that does not fit in the
  // rest of the slot's staging ring (2900 + 101 > 3000 rows) is Rejected at once.
  EXPECT_TRUE(remote->Request(&b).IsInvalidArgument());
  EngramRowBatch again;
  again.slot = 1;
  again.row_ids.assign(101, 7);
  EXPECT_TRUE(remote->Request(&again).IsRejected());
  again.row_ids.assign(100, 7);  // fits: two requests in flight on one slot
  ASSERT_TRUE(remote->Request(&again).ok());
  Status s = remote->Wait(&b);
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (size_t i = 0; i < b.row_ids.size(); ++i) {
    ASSERT_EQ(std::memcmp(b.data.data() + i * rd, d->bytes.data() + b.row_ids[i] * rd, rd), 0);
    ASSERT_EQ(b.scales[i], sc->bytes[b.row_ids[i]]);  // one scale per 32-element row
  }
  ASSERT_TRUE(remote->Wait(&again).ok());
  ASSERT_EQ(again.data.size(), 100u * rd);
  EXPECT_EQ(std::memcmp(again.data.data(), d->bytes.data() + 7 * rd, rd), 0);
  EngramRowBatch big;
  big.slot = 0;
  big.row_ids.assign(3001, 5);
  EXPECT_TRUE(remote->Request(&big).IsRejected());
  EXPECT_EQ(remote->stats().in_flight, 0u);
  EXPECT_EQ(remote->stats().in_flight_max, 2u);
  EXPECT_EQ(remote->stats().rejected, 2u);
}

TEST_F(RemoteEngramTest, EngineLogitsWithRemoteRowsEqualLocal) {
  const auto prompt = Prompt(40, 5);
  std::vector<float> local_logits, remote_logits;
  auto local = MakeEngine(nullptr);
  ASSERT_TRUE(Run(local.get(), prompt, 4, &local_logits).ok());
  RemoteEngramRowSource* remote = Connect();
  ASSERT_NE(remote, nullptr);
  auto e = MakeEngine(remote);
  Status s = Run(e.get(), prompt, 4, &remote_logits);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(local_logits.size(), remote_logits.size());
  EXPECT_EQ(
      std::memcmp(local_logits.data(), remote_logits.data(), local_logits.size() * sizeof(float)),
      0);
  const RemoteEngramStats st = remote->stats();
  // Prefill + 4 decode steps, two Engram layers each.
  EXPECT_EQ(st.requests, 10u);
  EXPECT_EQ(st.waits, 10u);
  EXPECT_EQ(st.failures, 0u);
  EXPECT_GT(st.fetch.rows_read, 0u);
}

// The slots' shards at one row server share one connection, and a step's batches of both
// Engram layers leave in one send (HoldRequests, on in the default options); without sharing,
// one send per layer. The logits stay equal to the local table's either way.
TEST_F(RemoteEngramTest, AStepsSlotsShareOneConnectionAndOneSend) {
  const auto prompt = Prompt(40, 5);
  std::vector<float> local_logits;
  auto local = MakeEngine(nullptr);
  ASSERT_TRUE(Run(local.get(), prompt, 4, &local_logits).ok());
  for (bool share : {true, false}) {
    SCOPED_TRACE(share ? "shared" : "one connection per shard");
    RemoteEngramOptions o;  // hold_step_requests: the default
    o.share_connections = share;
    RemoteEngramRowSource* remote = Connect(o);
    ASSERT_NE(remote, nullptr);
    std::vector<rdma::Transport*> transports;
    for (int slot = 0; slot < remote->num_slots(); ++slot) {
      for (size_t i = 0; i < remote->fetcher(slot).num_shards(); ++i) {
        rdma::Transport* t = &remote->fetcher(slot).transport(i);
        if (std::find(transports.begin(), transports.end(), t) == transports.end())
          transports.push_back(t);
      }
    }
    ASSERT_EQ(remote->num_slots(), 2);
    ASSERT_EQ(remote->fetcher(0).num_shards(), static_cast<size_t>(kShards));  // one server
    EXPECT_EQ(transports.size(), share ? 1u : 2u * kShards);
    auto sends = [&] {
      uint64_t n = 0;
      for (rdma::Transport* t : transports) n += t->counters().sends;
      return n;
    };
    auto e = MakeEngine(remote);
    SequenceState st = e->NewSequence();
    std::vector<float> logits, all;
    ASSERT_TRUE(e->Forward(&st, prompt, true, &logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
    const uint64_t before = sends();
    const std::vector<int32_t> next = Prompt(4, 99);
    for (int i = 0; i < 4; ++i) {
      Status s = e->Decode(&st, next[i], &logits);
      ASSERT_TRUE(s.ok()) << s.ToString();
      all.insert(all.end(), logits.begin(), logits.end());
    }
    // Shared: one send per step. Otherwise one per shard with rows of the step (two or more).
    if (share) {
      EXPECT_EQ(sends() - before, 4u);
    } else {
      EXPECT_GE(sends() - before, 8u);
    }
    ASSERT_EQ(all.size(), local_logits.size());
    EXPECT_EQ(std::memcmp(all.data(), local_logits.data(), all.size() * sizeof(float)), 0);
  }
}

// A Wait inside a HoldRequests bracket ends the bracket first: the kept requests are sent and
// the rows arrive (never a wait on a request that was not sent).
TEST_F(RemoteEngramTest, WaitInsideAHoldSendsTheKeptRequests) {
  RemoteEngramOptions o;
  o.hold_step_requests = true;
  o.fetcher.fetch_timeout_ms = 3000;
  o.fetcher.retries_max = 0;
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  EngramRowBatch a, b;
  a.slot = 0;
  b.slot = 1;
  a.row_ids = {1, 2, 3};
  b.row_ids = {4, 5};
  remote->HoldRequests(true);
  ASSERT_TRUE(remote->Request(&a).ok());
  ASSERT_TRUE(remote->Request(&b).ok());
  Status s = remote->Wait(&a);
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = remote->Wait(&b);
  ASSERT_TRUE(s.ok()) << s.ToString();
  remote->HoldRequests(false);  // already ended: no effect
  EXPECT_EQ(a.data.size(), 3u * Config().engram_head_dim);
  EXPECT_EQ(b.data.size(), 2u * Config().engram_head_dim);
  EngramRowBatch c;
  c.slot = 0;
  c.row_ids = {7};
  ASSERT_TRUE(remote->Request(&c).ok());  // not held: sent at once
  ASSERT_TRUE(remote->Wait(&c).ok());
  EXPECT_EQ(remote->stats().failures, 0u);
}

TEST_F(RemoteEngramTest, RowServerRestartedMidRunIsReconnected) {
  const auto prompt = Prompt(32, 8);
  std::vector<float> local_logits, remote_logits;
  auto local = MakeEngine(nullptr);
  ASSERT_TRUE(Run(local.get(), prompt, 4, &local_logits).ok());
  RemoteEngramOptions o;
  o.fetcher.hot_cache_bytes = 0;  // every step must really read from the server
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  auto e = MakeEngine(remote);
  Status s = Run(e.get(), prompt, 4, &remote_logits, [&] { RestartServer(); });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(
      std::memcmp(local_logits.data(), remote_logits.data(), local_logits.size() * sizeof(float)),
      0);
  // The new server served the later steps: the transports connected again.
  EXPECT_GT(server_->counters().ops_served, 0u);
  uint64_t connects = 0;
  for (int slot = 0; slot < remote->num_slots(); ++slot)
    for (size_t sh = 0; sh < kShards; ++sh)
      connects += remote->fetcher(slot).transport(sh).counters().connects;
  EXPECT_GT(connects, static_cast<uint64_t>(remote->num_slots()) * kShards);
}

TEST_F(RemoteEngramTest, ServerThatStaysDownIsAClearErrorNotZeros) {
  RemoteEngramOptions o;
  o.fetcher.hot_cache_bytes = 0;
  o.fetcher.retries_max = 2;
  o.fetcher.retry_backoff_ms = 5;
  o.fetcher.fetch_timeout_ms = 3000;
  o.transport.connect_timeout_ms = 300;
  o.transport.request_timeout_ms = 1000;
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  auto e = MakeEngine(remote);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, Prompt(16, 2), false, &logits).ok());
  server_->Stop();
  Status s = e->Decode(&st, 40, &logits);
  ASSERT_FALSE(s.ok());
  std::printf("decode with the row server down: %s\n", s.ToString().c_str());
  EXPECT_NE(s.message().find("engram slot"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("no zeros"), std::string::npos) << s.ToString();
  // Directly: a failed batch comes back empty, never zero-filled.
  EngramRowBatch b;
  b.slot = 0;
  b.row_ids = {1, 2, 3};
  Status r = remote->Request(&b);
  if (r.ok()) r = remote->Wait(&b);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(b.data.empty());
  EXPECT_TRUE(b.scales.empty());
  EXPECT_GE(remote->stats().failures, 1u);
}

// Forwards to the remote source and calls `after_request(n)` after the n-th successful Request
// (n from 1): the hook to restart or stop the row server while prefetched reads are in flight.
class HookedSource : public EngramRowSource {
 public:
  explicit HookedSource(EngramRowSource* inner) : inner_(inner) {}
  int row_dim() const override { return inner_->row_dim(); }
  Status Request(EngramRowBatch* b) override {
    Status s = inner_->Request(b);
    if (s.ok() && after_request) after_request(++requests_);
    return s;
  }
  Status Wait(EngramRowBatch* b) override { return inner_->Wait(b); }
  std::function<void(int)> after_request;

 private:
  EngramRowSource* inner_;
  int requests_ = 0;
};

// Chunked prefill (8-token chunks) with the lookahead reaching 0, 1, 2 chunks ahead: remote
// rows give the local table's logits bit for bit, and with a lookahead several requests per
// slot are really in flight at once.
TEST_F(RemoteEngramTest, ChunkedPrefillWithLookaheadEqualsLocal) {
  const auto prompt = Prompt(44, 6);
  std::vector<float> local_logits;
  auto local = MakeEngine(nullptr);
  ASSERT_TRUE(Run(local.get(), prompt, 3, &local_logits).ok());
  RemoteEngramRowSource* remote = Connect();
  ASSERT_NE(remote, nullptr);
  for (int la : {0, 1, 2}) {
    SCOPED_TRACE("lookahead " + std::to_string(la));
    const RemoteEngramStats before = remote->stats();
    auto e = MakeEngine(remote, 8, la);
    std::vector<float> remote_logits;
    Status s = Run(e.get(), prompt, 3, &remote_logits);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(local_logits.size(), remote_logits.size());
    EXPECT_EQ(
        std::memcmp(local_logits.data(), remote_logits.data(), local_logits.size() * sizeof(float)),
        0);
    const RemoteEngramStats st = remote->stats();
    // 6 chunks + 3 decode steps, two Engram layers each; nothing requested twice.
    EXPECT_EQ(st.requests - before.requests, 18u);
    EXPECT_EQ(st.waits - before.waits, 18u);
    EXPECT_EQ(st.failures, 0u);
    EXPECT_EQ(st.in_flight, 0u);
    EXPECT_EQ(e->stats().engram_prefetches_issued, la == 0 ? 0u : 10u);
    EXPECT_EQ(e->stats().engram_prefetches_consumed, e->stats().engram_prefetches_issued);
    if (la > 0) {
      EXPECT_GE(st.in_flight_max, static_cast<uint64_t>(la + 1));
    }
  }
}

// The row server restarts while the lookahead's reads are in flight (each read response is
// delayed 150 ms): those reads fail, the fetcher reconnects and retries, and the output is
// still exact.
TEST_F(RemoteEngramTest, RowServerRestartedWhilePrefetchedReadsAreInFlight) {
  const auto prompt = Prompt(32, 14);  // 4 chunks of 8
  std::vector<float> local_logits;
  auto local = MakeEngine(nullptr);
  ASSERT_TRUE(Run(local.get(), prompt, 2, &local_logits).ok());
  RestartServer(/*response_delay_ms=*/150);  // slow reads from here on
  RemoteEngramOptions o;
  o.fetcher.hot_cache_bytes = 0;  // every step must really read from the server
  o.fetcher.retry_backoff_ms = 5;
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  HookedSource hooked(remote);
  // Lookahead 1: Requests 1-2 are chunk 0's, 3-4 chunk 1's (prefetch), 5-6 chunk 2's, issued
  // when chunk 1 starts; restart right after them, while they wait for the delayed response.
  hooked.after_request = [&](int n) {
    if (n == 6) RestartServer(/*response_delay_ms=*/150);
  };
  auto e = MakeEngine(&hooked, 8, 1);
  std::vector<float> remote_logits;
  Status s = Run(e.get(), prompt, 2, &remote_logits);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(local_logits.size(), remote_logits.size());
  EXPECT_EQ(
      std::memcmp(local_logits.data(), remote_logits.data(), local_logits.size() * sizeof(float)),
      0);
  const RemoteEngramStats st = remote->stats();
  EXPECT_GT(st.fetch.retries, 0u);                // reads in flight failed and were read again
  EXPECT_EQ(st.failures, 0u);                     // ... within the fetcher's bounded retries
  EXPECT_GT(st.stalls, 0u);                       // the delayed rows were late
  EXPECT_GT(server_->counters().ops_served, 0u);  // the new server served them
  uint64_t connects = 0;
  for (int slot = 0; slot < remote->num_slots(); ++slot)
    for (size_t sh = 0; sh < kShards; ++sh)
      connects += remote->fetcher(slot).transport(sh).counters().connects;
  EXPECT_GT(connects, static_cast<uint64_t>(remote->num_slots()) * kShards);
  EXPECT_GT(e->stats().engram_stalls, 0u);
  EXPECT_GT(e->stats().engram_stall_us, 0u);
}

// The row server goes away while the lookahead's reads are in flight and stays down: the
// prefetched read fails, is asked once more, fails again, and the call stops with an error
// naming the Engram layer and the positions; no logits come back (never zeros).
TEST_F(RemoteEngramTest, ServerDownDuringPrefetchStopsTheCallNamingTheLayer) {
  RestartServer(/*response_delay_ms=*/150);
  RemoteEngramOptions o;
  o.fetcher.hot_cache_bytes = 0;
  o.fetcher.retries_max = 1;
  o.fetcher.retry_backoff_ms = 5;
  o.fetcher.fetch_timeout_ms = 2000;
  o.transport.connect_timeout_ms = 200;
  o.transport.request_timeout_ms = 500;
  RemoteEngramRowSource* remote = Connect(o);
  ASSERT_NE(remote, nullptr);
  HookedSource hooked(remote);
  hooked.after_request = [&](int n) {
    if (n == 6) server_->Stop();
  };
  auto e = MakeEngine(&hooked, 8, 1);
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  Status s = e->Forward(&st, Prompt(32, 15), true, &logits);
  ASSERT_FALSE(s.ok());
  std::printf("prefill with the row server gone: %s\n", s.ToString().c_str());
  // Chunk 1's or chunk 2's rows (both prefetched; chunk 0's were read before the stop).
  EXPECT_NE(s.message().find("engram layer 1 (slot 0), positions ["), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find("no zeros"), std::string::npos) << s.ToString();
  EXPECT_TRUE(logits.empty());
  EXPECT_GE(e->stats().engram_prefetches_failed, 1u);
  EXPECT_GE(remote->stats().failures, 2u);
}

}  // namespace
}  // namespace kvtier::engine
