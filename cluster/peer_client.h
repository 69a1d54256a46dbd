// PeerClient: the calling side of the peer protocol (cluster/peer_wire.h), with a small pool
// of authenticated connections per peer endpoint.
//
// Every call has a deadline (timeout_ms, connect + handshake + request + response). A
// connection that fails in any way is dropped, never reused. An idle pooled connection the
// peer has closed meanwhile (its idle timeout) is found closed before it is used, and
// dropped. A call is not retried here (the router decides), with one exception: a call on a
// pooled connection that the peer closed or reset before any byte of the reply is made once
// more on a new connection when the peer cannot have received the whole request, or when the
// operation is safe to repeat (LOOKUP, GET, GET_STAGED, DROP_COPIES; never a PUT, DELETE or
// DELETE_TENANT that was sent whole). Errors: Unavailable (cannot connect / connection lost /
// timeout), PermissionDenied (the peer refused our credential, or failed to prove it holds it),
// Corruption (malformed response), or the peer's own status.
//
// With tls set ([cluster] peer_tls), each new connection completes a TLS handshake
// (daemon::TlsConnection::Connect; the calling thread drives it, cluster/peer_socket.h)
// before the credential handshake: the peer's certificate must chain to tls->ca_file and,
// with tls->verify_hostname, name the endpoint's host; ours (tls->cert_file) is presented. A
// handshake failure is PermissionDenied (the peer's certificate did not verify) or Unavailable; a
// peer that refuses our certificate closes the connection, which fails the call as Unavailable.
//
// A call that times out marks its endpoint suspect (cluster/peer_health.h): until a
// background probe (a new authenticated connection, kept for the next call) or a call still
// in flight gets an answer, calls to it fail at once with Unavailable instead of each waiting
// timeout_ms. probe_interval_ms 0 turns this off.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cache_daemon/tls_client.h"
#include "cluster/peer_health.h"
#include "cluster/peer_wire.h"
#include "common/clock.h"
#include "common/status.h"

namespace kvtier::cluster {

// Bytes read from a peer that views point into, shared by those who hold the views; the last
// holder to let go frees them (or gives them back to where they were taken from).
using PeerBytes = std::shared_ptr<const std::vector<uint8_t>>;

struct PeerClientOptions {
  std::string node_id;  // ours, sent in HELLO (for the peer's logs)
  std::vector<uint8_t> credential;
  uint64_t timeout_ms = 2000;
  uint64_t probe_interval_ms = 0;  // between probes of a suspect endpoint; 0: no suspicion
  uint32_t idle_connections_per_peer_max = 8;
  uint64_t frame_bytes_max = (64ull << 20) + (1ull << 20);  // one response
  // Unix time, for Clock's samples; null: the system clock. Tests set one that runs ahead.
  const kvtier::Clock* unix_clock = nullptr;
  // nullopt: plain TCP. server_name is ignored (each endpoint's host is verified).
  std::optional<daemon::TlsClientOptions> tls;
  // Kept buffers for GET replies (the daemon's ReplyBuffers): a GET's reply is read into
  // take_reply_buffer()'s buffer (what it holds is overwritten; up to its size it is not
  // zeroed first) and handed to give_reply_buffer once the last holder of its result lets go
  // (GetResult::held), so its pages are not faulted in again at every GET. Both or neither;
  // neither (default): a new buffer per reply. Called on the calling threads and wherever a
  // result is dropped, concurrently.
  std::function<std::vector<uint8_t>()> take_reply_buffer;
  std::function<void(std::vector<uint8_t>)> give_reply_buffer;
};

class PeerClient {
 public:
  explicit PeerClient(PeerClientOptions options);
  ~PeerClient();

  // Tier per key (kPeerTierAbsent when the peer does not hold it).
  StatusOr<std::vector<uint8_t>> Lookup(const std::string& endpoint, std::span<const PeerKey> keys);
  // One status and value per key (a value the peer could not fit is Retry: ask again), and
  // the remaining TTL of each found unit as the peer reported it (0: none; nullopt: the peer
  // is older than the TTL trailer, peer_wire.h). The values are views of the replies they
  // came in, not copies: valid while the result, or any copy of `held`, lives.
  struct GetResult {
    std::vector<Status> statuses;
    std::vector<std::span<const uint8_t>> values;  // empty where not OK
    std::vector<std::optional<uint64_t>> ttl_left_ms;
    std::vector<PeerBytes> held;  // the replies the values point into
  };
  StatusOr<GetResult> Get(const std::string& endpoint, std::span<const PeerKey> keys);
  // Asks the peer to stage keys in its staging region (GET_STAGED; cluster/staged_fetch.h).
  StatusOr<StagedReply> GetStaged(const std::string& endpoint, std::span<const PeerKey> keys);
  // OK when the peer stored the unit or, for a repair copy (put.repair), already held one of
  // the key and kept it, or found the copy's unit expired on arrival (put.expires_at_unix_ms):
  // *outcome (may be null) says which. A peer older than the expiry refuses a put that
  // carries one as malformed: it is sent once more without (the peer counts ttl_ms from its
  // arrival).
  Status Put(const std::string& endpoint, const PeerPut& put, PeerPutOutcome* outcome = nullptr);
  // One flag per key: 1 when it existed at the peer.
  StatusOr<std::vector<uint8_t>> Delete(const std::string& endpoint, std::span<const PeerKey> keys);
  Status DeleteTenant(const std::string& endpoint, std::string_view tenant);
  // The peer drops its GET copies of keys (a PUT replaced them); OK when it did.
  Status DropCopies(const std::string& endpoint, std::span<const PeerKey> keys);
  // The peer deletes its units and copies of keys, older versions of what a PUT wrote to
  // their current owners (DROP_OLDER); OK when it did.
  Status DropOlder(const std::string& endpoint, std::span<const PeerKey> keys);

  // How far the peer's clock is from ours (CLOCK, peer_wire.h): offset_us = the peer's Unix
  // time minus ours at the moment it answered, estimated as NTP does from one exchange (ours
  // at the exchange's midpoint), so within +- rtt_us / 2. Two exchanges, the shorter kept: the
  // first may include opening a connection. A peer older than CLOCK answers InvalidArgument.
  struct ClockSample {
    int64_t offset_us = 0;
    uint64_t rtt_us = 0;
  };
  StatusOr<ClockSample> Clock(const std::string& endpoint);

  PeerHealthStats health_stats() const { return health_->stats(); }
  // Endpoints whose calls fail at once now, and ms since their call timed out (PeerHealth).
  std::vector<std::pair<std::string, uint64_t>> suspects(size_t max_endpoints) const {
    return health_->Suspects(max_endpoints);
  }

 private:
  struct Conn;
  // Sends one request and returns the response body after an OK status (the status
  // otherwise).
  // Sends `keys` with `op` and reads a reply of one byte per key (LOOKUP tiers, DELETE flags);
  // Corruption(what) when the reply is short or names another count.
  StatusOr<std::vector<uint8_t>> ByteReplyPerKey(const std::string& endpoint, PeerOp op,
                                                 std::span<const PeerKey> keys, const char* what);
  // Call through the endpoint's health: fails at once while it is suspect, and marks it so
  // when the call times out.
  // `into`: an empty buffer the reply's body is read into (its capacity reused; a kept buffer).
  StatusOr<std::vector<uint8_t>> Call(const std::string& endpoint, PeerOp op,
                                      std::span<const uint8_t> body, uint16_t flags = 0,
                                      std::vector<uint8_t> into = {});
  StatusOr<std::vector<uint8_t>> CallOnce(const std::string& endpoint, PeerOp op,
                                          std::span<const uint8_t> body, uint16_t flags,
                                          uint64_t deadline_ms, std::vector<uint8_t> into);
  // PeerHealth's probe: opens and authenticates a connection by the deadline and keeps it.
  bool Probe(const std::string& endpoint);
  void KeepIdle(const std::string& endpoint, std::unique_ptr<Conn> conn);
  StatusOr<std::unique_ptr<Conn>> Connect(const std::string& endpoint, uint64_t deadline_ms);
  // A pooled connection to endpoint the peer has not closed meanwhile (those found closed are
  // dropped); null when there is none.
  std::unique_ptr<Conn> TakeIdle(const std::string& endpoint);

  PeerClientOptions options_;
  std::mutex mu_;
  std::map<std::string, std::vector<std::unique_ptr<Conn>>> idle_;  // guarded by mu_
  std::unique_ptr<PeerHealth> health_;  // last: its probers use the members above
};

}  // namespace kvtier::cluster
