// PeerServer: the peer front of a cluster node ([cluster] peer_listen). Accepts TCP
// connections from other nodes, authenticates them with the cluster credential
// (cluster/peer_wire.h) and hands their storage-key operations to a PeerHandler.
//
// One thread per connection (peer connections are few: a pool per peer node), at most
// connections_max at once (more are closed at once, counted). A connection is closed when:
//   - it has not completed HELLO and AUTH within frame_timeout_ms of the start of Serve (after
//     the TLS handshake, which has its own deadline), however it spaces its bytes;
//   - a started frame is not whole frame_timeout_ms after its first byte arrived, whether or
//     not more bytes keep arriving (a peer trickling bytes cannot hold a slot);
//   - it is authenticated and idle (no frame in progress) for idle_timeout_ms.
// Frames are limited to kPeerPreauthFrameBytesMax before AUTH and frame_bytes_max after.
//
// With tls set (mutual TLS, [cluster] peer_tls), each connection's thread first completes a
// TLS handshake (daemon::TlsConnection::Accept, bounded by tls->handshake_timeout_ms) that
// requires a client certificate chaining to tls->ca_file; a connection that fails it is
// closed and counted (tls_failures) before any frame is read. The cluster credential is
// still required inside the TLS stream, which the connection's thread drives itself
// (cluster/peer_socket.h: no relay).
//
// Thread safety: Start/Stop from one thread; stats() from any. Handler methods are called
// concurrently from connection threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/tls_client.h"
#include "cluster/peer_socket.h"
#include "cluster/peer_wire.h"
#include "common/accept_backoff.h"
#include "common/clock.h"
#include "common/status.h"

namespace kvtier::cluster {

class PeerHandler {
 public:
  virtual ~PeerHandler() = default;
  // Tier of each key held here (kPeerTierAbsent when not).
  virtual std::vector<uint8_t> Lookup(std::span<const PeerKey> keys) = 0;
  virtual Status Get(const PeerKey& key, std::vector<uint8_t>* value) = 0;
  // Get, and *ttl_left_ms the unit's remaining TTL (0: none) for the TTL trailer
  // (peer_wire.h). The default (handlers that keep no TTLs) reports 0.
  virtual Status GetWithTtl(const PeerKey& key, std::vector<uint8_t>* value,
                            uint64_t* ttl_left_ms) {
    *ttl_left_ms = 0;
    return Get(key, value);
  }
  // Stores put.value under put.key. A repair copy (put.repair) is stored only if this node
  // holds no unit of the key (the sender read it before the call, and a newer write may have
  // reached this node since): when one is held it is kept, nothing is stored, *held is set
  // and the result is OK (this node holds a version, the newest it has seen). *held (never
  // null, false on entry) is left false otherwise.
  virtual Status Put(const PeerPut& put, bool* held) = 0;
  // One flag per key: 1 when it existed here.
  virtual StatusOr<std::vector<uint8_t>> Delete(std::span<const PeerKey> keys) = 0;
  virtual Status DeleteTenant(std::string_view tenant) = 0;
  // Drops this node's GET copies of keys (docs/CLUSTER.md, "Copies"); never a unit held as
  // an owner. The default is for handlers that keep no copies.
  virtual Status DropCopies(std::span<const PeerKey> keys) {
    (void)keys;
    return Status::Ok();
  }
  // Deletes what this node holds of keys (its units and GET copies) because a newer version
  // of each was written to its current owners, which this node is not (DROP_OLDER;
  // docs/CLUSTER.md, "Versions"): no delete is noted (RecentDeletes), no tombstone recorded.
  // The default is for handlers that hold no units: Unavailable (the writer then records a
  // tombstone for this node).
  virtual Status DropOlder(std::span<const PeerKey> keys) {
    (void)keys;
    return Status::Unavailable("this node cannot drop older versions");
  }
  // GET_STAGED from the node that named itself reader_node in HELLO (it proved it holds the
  // cluster credential): stages the held keys for a one-sided read (cluster/staging_server.h).
  // The default is for handlers without a staging region: the caller falls back to GET.
  virtual StatusOr<StagedReply> GetStaged(const std::string& reader_node,
                                          std::span<const PeerKey> keys) {
    (void)reader_node;
    (void)keys;
    return Status::Unavailable("this node exports no staging region");
  }
};

struct PeerServerOptions {
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;  // 0: any free port (port() tells)
  std::vector<uint8_t> credential;
  uint32_t connections_max = 64;
  uint64_t idle_timeout_ms = 300000;
  uint64_t frame_timeout_ms = 10000;
  uint64_t frame_bytes_max = (64ull << 20) + (1ull << 20);
  std::optional<daemon::TlsAcceptOptions> tls;  // nullopt: plain TCP
  // Unix time, for the expiry a repair copy carries (peer_wire.h, kPeerFlagExpiresAt) and the
  // CLOCK reply; null: the system clock. Tests set one that runs ahead or behind.
  const kvtier::Clock* unix_clock = nullptr;
  // Kept reply buffers (the daemon's ReplyBuffers, shared with its native front): a GET's
  // reply is built in take_reply_buffer()'s buffer (empty, with the capacity of an earlier
  // reply) and handed to give_reply_buffer once sent, so that a batch of units is not copied
  // into freshly faulted pages, and regrown, at every GET. Both or neither; neither (default):
  // a new buffer per reply. Called on connection threads, concurrently.
  std::function<std::vector<uint8_t>()> take_reply_buffer;
  std::function<void(std::vector<uint8_t>)> give_reply_buffer;
};

struct PeerServerStats {
  uint64_t connections = 0, refused_over_max = 0, auth_failures = 0, requests = 0, bad_frames = 0;
  uint64_t tls_failures = 0;      // TLS handshakes that failed (no / bad certificate, plaintext)
  uint64_t accept_waits = 0;      // failed accepts that paused accepting (no descriptor or memory)
  uint64_t open_connections = 0;  // gauge: connections being served now (closed ones are not)
};

class PeerServer {
 public:
  // Binds and starts accepting. IOError naming the address when it cannot bind;
  // InvalidArgument for a credential shorter than kCredentialBytesMin, or TLS files that
  // cannot be used (daemon::CheckTlsFiles).
  static StatusOr<std::unique_ptr<PeerServer>> Start(PeerServerOptions options,
                                                     PeerHandler* handler);
  ~PeerServer();
  // Closes the listener and every connection; waits for their threads.
  void Stop();
  uint16_t port() const { return port_; }
  PeerServerStats stats() const;

 private:
  PeerServer(PeerServerOptions options, PeerHandler* handler);
  void AcceptLoop();
  // The connection's thread: the TLS handshake when configured, then Serve; closes fd.
  void ServeConnection(int fd);
  void Serve(PeerSocket& sock);
  // Executes one authenticated request; fills the response body (status first).
  // peer_node: the node id the peer gave in HELLO.
  void Execute(const daemon::wire::Frame& frame, const std::string& peer_node,
               daemon::wire::Writer* w);
  // options_.unix_clock, or the system clock.
  const kvtier::Clock& UnixClock() const {
    return options_.unix_clock != nullptr ? *options_.unix_clock : DefaultSystemClock();
  }

  PeerServerOptions options_;
  PeerHandler* handler_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> active_{0};
  std::atomic<uint64_t> connections_{0}, refused_{0}, auth_failures_{0}, requests_{0},
      bad_frames_{0}, tls_failures_{0}, accept_waits_{0};
  AcceptBackoff accept_backoff_{"cluster peer front"};  // AcceptLoop's only
  std::thread acceptor_;
  std::mutex mu_;
  uint64_t next_worker_ = 0;
  std::map<uint64_t, std::thread> workers_;  // guarded by mu_
  std::vector<uint64_t> finished_;           // workers that returned; joined by AcceptLoop
  void ReapFinished();
};

}  // namespace kvtier::cluster
