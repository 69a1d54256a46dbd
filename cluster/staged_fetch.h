// StagedFetcher: the reader's side of the cluster's bulk data path (docs/CLUSTER.md, "Bulk
// data over the region transport"). Get() has PeerClient::Get's contract and result; the
// bytes move differently:
//
//   1. GET_STAGED to the owner over the peer protocol (control: authenticated, maybe TLS):
//      the owner stages each held unit in its ring and answers the records and a grant.
//   2. The records are read with rdma::Transport (TcpTransport, or VerbsTransport: RDMA
//      READ) from the owner's staging region into one registered buffer of this call.
//   3. Each record is verified (StagingRing::Verify: generation, length, xxh3-64 of the
//      value); a verified value is returned as GET would return it.
//   4. Every unit that did not arrive verified (slot reused before or during the read,
//      not staged by the owner, transport error, GET_STAGED refused) is fetched with a plain
//      GET from the same owner, in one call, and counted. A wrong value is never returned.
//
// One transport per owner endpoint, made on first use and remade when the owner answers
// another grant or port (a new grant means the old one is about to expire or the owner
// restarted); batches of different calls share it. A call reads at most bytes_per_call_max
// of records: the units past it answer Retry (the router asks again), like a full GET reply.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "cluster/peer_client.h"
#include "cluster/peer_wire.h"
#include "common/status.h"
#include "rdma/transport.h"
#include "rdma/transport_factory.h"

namespace kvtier::cluster {

struct StagedFetcherOptions {
  std::string node_id;  // ours (as in PeerClientOptions): owners grant to this identity
  rdma::TransportKind kind = rdma::TransportKind::kTcp;  // kTcp or kVerbs (never kAuto)
  uint32_t timeout_ms = 2000;                            // connect and one read batch
  uint64_t bytes_per_call_max = 64ull << 20;             // records read by one Get()
};

struct StagedFetchStats {
  uint64_t calls = 0;             // Get() calls
  uint64_t units = 0;             // units read over the region transport and verified
  uint64_t bytes = 0;             // their value bytes
  uint64_t reused = 0;            // records that failed Verify (slot reused): fetched by GET
  uint64_t fallback_units = 0;    // all units fetched by GET instead (reused ones included)
  uint64_t transport_errors = 0;  // connects, opens and read batches that failed
  uint64_t refused = 0;           // GET_STAGED calls the owner did not answer with records
};

class StagedFetcher {
 public:
  StagedFetcher(PeerClient* peers, StagedFetcherOptions options);
  ~StagedFetcher();

  StatusOr<PeerClient::GetResult> Get(const std::string& endpoint, std::span<const PeerKey> keys);
  StagedFetchStats stats() const;
  const char* transport_name() const { return rdma::TransportKindName(options_.kind); }

 private:
  struct Remote;
  // The transport and opened region of `endpoint` for reply's grant (made or remade here).
  StatusOr<std::pair<std::shared_ptr<rdma::Transport>, rdma::RegionId>> RegionFor(
      const std::string& endpoint, const StagedReply& reply);

  PeerClient* peers_;
  const StagedFetcherOptions options_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Remote>> remotes_;  // by endpoint; guarded by mu_
  std::atomic<uint64_t> calls_{0}, units_{0}, bytes_{0}, reused_{0}, fallback_units_{0},
      transport_errors_{0}, refused_{0};
};

}  // namespace kvtier::cluster
