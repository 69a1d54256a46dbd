#include "cache_daemon/cluster_node.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <sstream>

#include "cache_daemon/metrics.h"
#include "cache_daemon/reply_buffers.h"
#include "cluster/http_client.h"
#include "common/config.h"
#include "common/logging.h"
#ifdef KVTIER_WITH_RDMA
#include "rdma/verbs_device.h"
#endif

namespace kvtier::daemon {
namespace {

// Series of kvtier_cluster_peer_suspect_seconds on one page at most.
constexpr size_t kSuspectSeriesMax = 64;
// Peers named by kvtier_cluster_peer_clock_offset_seconds at most.
constexpr size_t kClockSeriesMax = 64;

// Microseconds as seconds with every digit ("-60.001234").
std::string MicrosAsSeconds(int64_t us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", static_cast<double>(us) / 1e6);
  return buf;
}

}  // namespace

// Serves peers from the local store only: a peer's request is never forwarded again.
class ClusterNode::StoreHandler : public cluster::PeerHandler {
 public:
  StoreHandler(Service* service, const TenantRegistry* tenants, cluster::RecentDeletes* recent)
      : service_(service), store_(service->store()), tenants_(tenants), recent_(recent) {}

  // A key held here only as a GET copy (cluster_copies.h) is reported absent: a copy is not a
  // replica (DRAM only, expiring, never repaired from), so a peer's repair scan must not count
  // it as held. It used to: a node that became an owner of units it held as copies (after a
  // join, a loss or a drain) kept only the copies, and a previous owner then dropped its
  // replica; once the copy expired the unit had one replica fewer, or none. Reported absent,
  // the unit's sender copies the replica here, and that PUT replaces the copy (Put: the copy
  // is dropped first).
  // Reads: a GET that reaches this node is still served from the copy; a client LOOKUP
  // through another node finds the unit at the owners (current and previous) holding replicas.
  // Before its first tombstone catch-up (Serving) every key is reported absent.
  std::vector<uint8_t> Lookup(std::span<const cluster::PeerKey> keys) override {
    if (!Serving()) return std::vector<uint8_t>(keys.size(), cluster::kPeerTierAbsent);
    std::vector<uint8_t> tiers;
    tiers.reserve(keys.size());
    ClusterCopies* c = copies();
    for (const auto& k : keys) {
      storage::LookupResult r = store_->Lookup(std::span<const storage::Key>(&k, 1));
      const bool held = r.hit_count == 1 && !r.tiers.empty() && (c == nullptr || !c->IsCopy(k));
      tiers.push_back(held ? static_cast<uint8_t>(r.tiers[0]) : cluster::kPeerTierAbsent);
    }
    return tiers;
  }
  Status Get(const cluster::PeerKey& key, std::vector<uint8_t>* value) override {
    uint64_t ttl_left_ms = 0;
    return GetWithTtl(key, value, &ttl_left_ms);
  }
  // The TTL left is the stored unit's: a copy held here was stored with its own (shorter or
  // equal) TTL.
  Status GetWithTtl(const cluster::PeerKey& key, std::vector<uint8_t>* value,
                    uint64_t* ttl_left_ms) override {
    if (!Serving()) return NotCaughtUp();
    Status s = store_->GetWithTtl(key, value, ttl_left_ms);
    if (ClusterCopies* c = copies(); c != nullptr && s.ok()) {
      std::vector<Status> one = {s};
      c->CheckHits(std::span<const storage::Key>(&key, 1), &one);  // a fenced copy: a miss
      s = one[0];
    }
    return s;
  }
  // Refused before the first tombstone catch-up: a delete applied by it would remove what
  // was written here (the writer's PUT fails, a repair copy is retried).
  Status Put(const cluster::PeerPut& put, bool* held) override {
    if (!Serving()) return NotCaughtUp();
    const Tenant* t = tenants_->FindByName(put.tenant);  // names agree across nodes; ids are local
    if (t == nullptr) return Status::Rejected("peer PUT: unknown tenant " + put.tenant);
    if (put.repair && recent_->RefusesRepair(put.key, put.tenant)) {
      // Retry, not Rejected: nothing is wrong with the copy, it is early. The sender rescans
      // within RepairOptions::waiting_retry_max_ms instead of backing off as from a failure.
      return Status::Retry("peer PUT: repair copy of a unit deleted here moments ago");
    }
    storage::PutOptions po;
    po.tenant = t->id;
    po.kind = static_cast<policies::ObjectKind>(put.kind);
    po.parent = put.parent;
    po.recompute_tokens = put.recompute_tokens;
    po.ttl_ms = put.ttl_ms;
    po.highest_tier = static_cast<storage::Tier>(put.highest_tier);
    po.allow_ssd = put.allow_ssd != 0;
    // A writer whose view takes this node for an owner when its own does not: until the
    // repair scan moves the unit, GETs here ask its owners first (Router::MayHoldUnowned).
    if (cluster::Router* r = router(); r != nullptr && !r->OwnsLocally(put.key)) {
      r->NoteUnownedWrite();
    }
    ClusterCopies* c = copies();
    // Checked again once the unit is here: a view change since the check above may have taken
    // the key from this node after a repair scan under the new view listed the store (and
    // found no unit it does not own), as for a client's PUT (Service::Put).
    auto note_unowned = [&] {
      if (cluster::Router* r = router(); r != nullptr && !r->OwnsLocally(put.key)) {
        r->NoteUnownedWrite();
      }
    };
    if (!put.repair) {
      // A client's write through another node: replaces what is here, an owner's unit now. Not
      // a copy before the put (a repair copy meanwhile then never takes this write for a GET
      // copy and drops it, below) nor after it (a GET copy kept in between, overwritten).
      if (c != nullptr) c->Forget(put.key);
      Status s = store_->Put(put.key, put.value, po);
      if (c != nullptr) c->Forget(put.key);
      note_unowned();
      return s;
    }
    // A repair copy: the sender read its unit before this call, and a client PUT of a newer
    // value may have reached this node since the sender's LOOKUP. Put only if absent: a unit
    // held here is kept (the newer value wins) and the sender counts it as held. A GET copy is
    // not a replica (Lookup reports it absent): it leaves first, and the replica replaces it.
    if (c != nullptr && c->IsCopy(put.key)) c->Drop(std::span<const storage::Key>(&put.key, 1));
    po.if_absent = true;
    po.held = held;
    Status s = store_->Put(put.key, put.value, po);
    note_unowned();
    if (*held) {
      superseded_.fetch_add(1);
      return Status::Ok();
    }
    return s;
  }
  // Repair copies not stored because this node already held the unit.
  uint64_t superseded() const { return superseded_.load(); }
  StatusOr<std::vector<uint8_t>> Delete(std::span<const cluster::PeerKey> keys) override {
    std::vector<uint8_t> existed(keys.size(), 0);
    recent_->NoteKeys(keys);  // before the delete: a repair copy landing after it is refused
    for (size_t i = 0; i < keys.size(); ++i) {
      Status s = store_->Delete(keys[i]);
      if (s.ok()) {
        existed[i] = 1;
      } else if (!s.IsNotFound()) {
        if (ClusterCopies* c = copies(); c != nullptr) c->Drop(keys);
        return s;
      }
    }
    if (ClusterCopies* c = copies(); c != nullptr) c->Drop(keys);
    return existed;
  }
  StatusOr<cluster::StagedReply> GetStaged(const std::string& reader_node,
                                           std::span<const cluster::PeerKey> keys) override {
    if (!Serving()) return NotCaughtUp();
    if (staging_ == nullptr) return cluster::PeerHandler::GetStaged(reader_node, keys);
    return staging_->Stage(reader_node, keys,
                           [this](const cluster::PeerKey& k, std::vector<uint8_t>* v,
                                  uint64_t* ttl_left_ms) { return GetWithTtl(k, v, ttl_left_ms); });
  }
  // Set before the peer front starts (never changed after).
  void SetStaging(cluster::StagingServer* staging) { staging_ = staging; }
  Status DropCopies(std::span<const cluster::PeerKey> keys) override {
    if (ClusterCopies* c = copies(); c != nullptr) c->Drop(keys);
    return Status::Ok();
  }
  // Not a delete of the keys (nothing noted: this node may own them again and take repair
  // copies at once), only of the older versions held here.
  Status DropOlder(std::span<const cluster::PeerKey> keys) override {
    if (ClusterCopies* c = copies(); c != nullptr) c->Drop(keys);
    for (const cluster::PeerKey& k : keys) {
      Status s = store_->Delete(k);
      if (!s.ok() && !s.IsNotFound()) return s;
    }
    return Status::Ok();
  }
  // Set once the copies exist (they need membership, which starts after the peer front).
  void SetCopies(ClusterCopies* copies) { copies_.store(copies, std::memory_order_release); }
  ClusterCopies* copies() const { return copies_.load(std::memory_order_acquire); }
  // Set once the tombstone log exists (it is made after the peer front starts). A node killed
  // and restarted within its lease is still in its peers' views, and they route to it as soon
  // as its peer front listens: until its first catch-up on the log it would serve units
  // deleted or overwritten while it was down. So until then it answers no read and takes no
  // write from a peer (deletes and drops are always applied): GETs are Unavailable (the
  // reader asks the key's next owner), LOOKUPs absent, PUTs refused.
  void SetTombstones(const cluster::TombstoneLog* log) {
    tombstones_.store(log, std::memory_order_release);
  }
  // Set before the tombstone log: after a pause of this process (SIGSTOP, a stalled VM) the
  // same holds until the deletes that timed out on it are applied (cluster/pause_guard.h).
  void SetPauseGuard(const cluster::PauseGuard* guard) {
    pause_guard_.store(guard, std::memory_order_release);
  }
  bool Serving() const {
    const cluster::TombstoneLog* log = tombstones_.load(std::memory_order_acquire);
    const cluster::PauseGuard* guard = pause_guard_.load(std::memory_order_acquire);
    return log != nullptr && log->caught_up() && (guard == nullptr || guard->Current());
  }
  // Peer calls refused because this node had not caught up on the tombstone log yet.
  uint64_t refused_before_catch_up() const { return refused_before_catch_up_.load(); }
  // Set once the router exists (it needs membership, which starts after the peer front).
  void SetRouter(cluster::Router* router) { router_.store(router, std::memory_order_release); }
  cluster::Router* router() const { return router_.load(std::memory_order_acquire); }
  Status DeleteTenant(std::string_view tenant) override {
    const Tenant* t = tenants_->FindByName(tenant);
    if (t == nullptr) return Status::NotFound("peer DELETE_TENANT: unknown tenant");
    recent_->NoteTenant(tenant);
    return service_->DeleteTenantLocal(*t);
  }

 private:
  Service* service_;
  storage::TierManager* store_;
  const TenantRegistry* tenants_;
  cluster::RecentDeletes* recent_;
  std::atomic<ClusterCopies*> copies_{nullptr};
  std::atomic<cluster::Router*> router_{nullptr};
  Status NotCaughtUp() {
    refused_before_catch_up_.fetch_add(1);
    return Status::Unavailable(
        "not caught up on the tombstone log since this node started or was paused");
  }
  cluster::StagingServer* staging_ = nullptr;
  std::atomic<uint64_t> superseded_{0};
  std::atomic<const cluster::TombstoneLog*> tombstones_{nullptr};
  std::atomic<const cluster::PauseGuard*> pause_guard_{nullptr};
  std::atomic<uint64_t> refused_before_catch_up_{0};
};

// "verbs" needs libibverbs in this build and an RDMA device on this host.
Status CheckVerbsDevice() {
#ifdef KVTIER_WITH_RDMA
  if (!rdma::verbs::ListDevices().empty()) return Status::Ok();
  return Status::Unavailable(
      "cluster.peer_data_transport = \"verbs\": no RDMA device on this host "
      "(ibv_get_device_list is empty); use \"tcp_region\" or \"peer\"");
#else
  return Status::Unavailable(
      "cluster.peer_data_transport = \"verbs\": this kvtierd was built without libibverbs "
      "(KVTIER_WITH_RDMA off); use \"tcp_region\" or \"peer\"");
#endif
}

std::string AdminEndpoint(const DaemonOptions& options) {
  if (options.http_port == 0) return "";
  std::string host = options.http_listen;
  if (host == "0.0.0.0" || host == "::" || host == "[::]" || host.empty()) {
    // Listening on every address: peers reach it at the host they reach the peer front at.
    auto peer = cluster::ParseHttpEndpoint(options.cluster.peer_advertise);
    if (!peer.ok()) return "";
    host = peer->host;
  }
  if (host.find(':') != std::string::npos && host.front() != '[') host = "[" + host + "]";
  std::string endpoint = host + ":" + std::to_string(options.http_port);
  return cluster::ParseHttpEndpoint(endpoint).ok() ? endpoint : "";
}

StatusOr<std::vector<uint8_t>> ReadCredentialFile(const std::string& path) {
  auto read = ReadFileBounded(path, cluster::kCredentialBytesMax);
  if (!read.ok()) return read.status().WithContext("cluster.credential_file");
  std::string& bytes = *read;
  while (!bytes.empty() && (bytes.back() == '\n' || bytes.back() == '\r')) bytes.pop_back();
  if (bytes.size() < cluster::kCredentialBytesMin) {
    return Status::InvalidArgument("cluster.credential_file " + path +
                                   " holds fewer than 32 bytes");
  }
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

StatusOr<std::unique_ptr<ClusterNode>> ClusterNode::Start(const DaemonOptions& options,
                                                          Service* service,
                                                          const TenantRegistry* tenants,
                                                          internal::ReplyBuffers* reply_buffers) {
  const ClusterServeOptions& c = options.cluster;
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> credential, ReadCredentialFile(c.credential_file));
  std::unique_ptr<ClusterNode> node(new ClusterNode());
  node->node_id_ = c.node_id;
  node->service_ = service;
  node->recent_deletes_ = std::make_unique<cluster::RecentDeletes>(cluster::RecentDeletesOptions{});
  node->handler_ = std::make_unique<StoreHandler>(service, tenants, node->recent_deletes_.get());

  const bool region_path = c.peer_data_transport != "peer";
  if (region_path) {
    const bool verbs = c.peer_data_transport == "verbs";
    if (verbs) KVTIER_RETURN_IF_ERROR(CheckVerbsDevice());
    KVTIER_ASSIGN_OR_RETURN(node->staging_,
                            cluster::StagingServer::Start(cluster::StagingServerOptions{
                                .listen_host = c.peer_host,
                                .listen_port = c.peer_region_port,
                                .ring_bytes = c.peer_staging_ring_bytes,
                                .grant_ttl_ms = c.peer_staging_grant_ttl_ms,
                                .verbs = verbs,
                                .connections_max = c.peer_connections_max}));
    node->handler_->SetStaging(node->staging_.get());
  }

  cluster::PeerServerOptions so;
  so.listen_host = c.peer_host;
  so.listen_port = c.peer_port;
  so.credential = credential;
  so.connections_max = c.peer_connections_max;
  so.idle_timeout_ms = options.idle_timeout_ms;
  so.frame_timeout_ms = options.frame_timeout_ms;
  so.frame_bytes_max = options.max_frame_bytes;
  if (c.peer_tls) {
    so.tls = TlsAcceptOptions{.cert_file = c.peer_tls_cert_file,
                              .key_file = c.peer_tls_key_file,
                              .ca_file = c.peer_tls_ca_file,
                              .handshake_timeout_ms = c.peer_timeout_ms};
  }
  // GET replies (a batch of units each way) in the daemon's kept buffers, as the native
  // front's: docs/performance/daemon.md, "Cluster GET replies in kept buffers".
  auto take = [reply_buffers] { return reply_buffers->Take(); };
  auto give = [reply_buffers](std::vector<uint8_t> b) { reply_buffers->Give(std::move(b)); };
  if (reply_buffers != nullptr) {
    so.take_reply_buffer = take;
    so.give_reply_buffer = give;
  }
  KVTIER_ASSIGN_OR_RETURN(node->server_, cluster::PeerServer::Start(so, node->handler_.get()));

  std::optional<TlsClientOptions> client_tls;
  if (c.peer_tls) {
    client_tls = TlsClientOptions{.ca_file = c.peer_tls_ca_file,
                                  .verify_hostname = c.peer_tls_verify_hostname,
                                  .cert_file = c.peer_tls_cert_file,
                                  .key_file = c.peer_tls_key_file};
  }
  cluster::PeerClientOptions co{.node_id = c.node_id,
                                .credential = credential,
                                .timeout_ms = c.peer_timeout_ms,
                                .probe_interval_ms = c.peer_probe_interval_ms,
                                .frame_bytes_max = options.max_frame_bytes,
                                .tls = client_tls};
  if (reply_buffers != nullptr) {  // read over whole: no need to zero it first
    co.take_reply_buffer = [reply_buffers] { return reply_buffers->TakeToOverwrite(); };
    co.give_reply_buffer = give;
  }
  node->client_ = std::make_unique<cluster::PeerClient>(std::move(co));

  cluster::EtcdOptions eo;
  eo.endpoints = c.etcd_endpoints;
  eo.request_timeout_ms = c.etcd_timeout_ms;
  node->etcd_ = std::make_unique<cluster::EtcdClient>(eo);
  // Deletes this node missed while it was gone, applied to its own store only.
  StoreHandler* handler = node->handler_.get();
  node->tombstones_ = std::make_unique<cluster::TombstoneLog>(
      node->etcd_.get(),
      cluster::TombstoneOptions{.key_prefix = c.key_prefix,
                                .node_id = c.node_id,
                                .ttl_s = c.tombstone_ttl_s,
                                .state_file = options.data_dir + "/cluster_tombstone_revision"},
      [handler](std::span<const cluster::PeerKey> keys) { (void)handler->Delete(keys); },
      [handler](std::string_view tenant) { (void)handler->DeleteTenant(tenant); });
  // The hold covers every tombstone written for a call this node missed while paused: calls
  // that timed out on it (peer_timeout_ms), and, with suspicion on, calls that failed at once
  // because a peer still suspected it, which go on until that peer's next probe reaches it
  // (at most peer_probe_interval_ms after it runs again); each tombstone is written within
  // etcd_timeout_ms after its call failed.
  node->pause_guard_ = std::make_unique<cluster::PauseGuard>(
      cluster::PauseGuardOptions{
          .pause_ms = std::max<uint64_t>(c.peer_timeout_ms / 2, 1),
          .hold_ms = std::max(c.peer_timeout_ms, c.peer_probe_interval_ms) + c.etcd_timeout_ms},
      [t = node->tombstones_.get()] { return t->CatchUp(); });
  node->pause_guard_->Start();
  handler->SetPauseGuard(node->pause_guard_.get());
  service->SetPauseGuard(node->pause_guard_.get());
  handler->SetTombstones(node->tombstones_.get());
  // A node restarted on its data directory may hold units deleted or overwritten while it was
  // down. The daemon accepts its clients only after this Start returns, so one catch-up now
  // keeps them (and peers) from reading those. When etcd does not answer, the node starts
  // anyway: its membership catches up before it registers, and its local clients may read
  // such units until then (docs/CLUSTER.md, "Not guaranteed").
  if (Status first = node->tombstones_->CatchUp(); !first.ok()) {
    KVTIER_LOG(kWarn) << "cluster: no tombstone catch-up at start (" << first.message()
                      << "): local clients are served from what this node holds until the "
                         "membership's catch-up succeeds";
  }

  cluster::MembershipOptions mo;
  mo.etcd = eo;
  mo.before_register = [t = node->tombstones_.get(), handler] {
    // Copies made under a previous lease may have missed a delete or an overwrite.
    if (ClusterCopies* c = handler->copies(); c != nullptr) c->DropAll();
    // Until every delete this node missed is applied it does not register: as an owner in
    // the view it would serve units deleted or overwritten meanwhile (Membership retries).
    return t->CatchUp();
  };
  mo.key_prefix = c.key_prefix;
  mo.lease_ttl_s = c.lease_ttl_s;
  mo.self.node_id = c.node_id;
  mo.self.peer_endpoint = c.peer_advertise;
  mo.self.failure_domain = c.failure_domain;
  mo.self.admin_endpoint = AdminEndpoint(options);
  mo.self.draining = c.draining;
  mo.self.keeps_copies = c.get_copy_bytes_max > 0;
  mo.self.dram_bytes = options.storage.dram_capacity_bytes;
  mo.self.ssd_bytes = options.storage.ssd_capacity_bytes;
  KVTIER_ASSIGN_OR_RETURN(node->membership_, cluster::Membership::Start(mo));
  if (node->staging_ != nullptr) {
    // Grants go to members only, and are revoked when a member leaves.
    auto members = [s = node->staging_.get()](const cluster::MemberView& v) {
      std::vector<std::string> ids;
      for (const auto& m : v.members) ids.push_back(m.node_id);
      s->SetMembers(ids);
    };
    node->membership_->AddListener(members);
    members(*node->membership_->View());
    node->staged_fetcher_ = std::make_unique<cluster::StagedFetcher>(
        node->client_.get(),
        cluster::StagedFetcherOptions{.node_id = c.node_id,
                                      .kind = c.peer_data_transport == "verbs"
                                                  ? rdma::TransportKind::kVerbs
                                                  : rdma::TransportKind::kTcp,
                                      .timeout_ms = static_cast<uint32_t>(c.peer_timeout_ms),
                                      .bytes_per_call_max = options.max_frame_bytes});
  }
  node->router_ = std::make_unique<cluster::Router>(
      node->membership_.get(), node->client_.get(),
      cluster::RouterOptions{.replicas = c.replicas,
                             .write_acks = c.write_acks,
                             .recent_deletes = node->recent_deletes_.get(),
                             .peer_call_threads = c.peer_call_threads,
                             .peer_call_queue_max = c.peer_call_queue_max,
                             .departed_memory_s = c.tombstone_ttl_s,
                             .staged = node->staged_fetcher_.get()},
      node->tombstones_.get());
  node->tombstones_->StartPolling();
  handler->SetRouter(node->router_.get());
  service->SetRouter(node->router_.get());
  if (c.get_copy_bytes_max > 0) {
    node->copies_ = std::make_unique<ClusterCopies>(
        service->store(), node->membership_.get(), node->recent_deletes_.get(),
        CopyOptions{.bytes_max = c.get_copy_bytes_max, .ttl_ms = c.get_copy_ttl_ms});
    handler->SetCopies(node->copies_.get());
    service->SetClusterCopies(node->copies_.get());
  }
  node->repair_ = std::make_unique<ClusterRepair>(
      service->store(), tenants, node->router_.get(), node->client_.get(),
      RepairOptions{
          .bytes_per_s = c.repair_bytes_per_s,
          .retry_ms = c.repair_retry_ms,
          .interval_s = c.repair_interval_s,
          .catch_up = [t = node->tombstones_.get()] { return t->CatchUp(); },
          .is_copy = [c = node->copies_.get()](
                         const storage::Key& k) { return c != nullptr && c->IsCopy(k); }});
  // Registered after the router's listener: a scan triggered here sees the new view.
  node->membership_->AddListener(
      [r = node->repair_.get()](const cluster::MemberView&) { r->Trigger(); });
  node->repair_->Start();
  node->refetch_ = std::make_unique<ClusterRefetch>(service->store(), tenants, node->router_.get(),
                                                    node->recent_deletes_.get(), RefetchOptions{});
  node->refetch_->Start();
  service->store()->SetChecksumFailureListener(
      [r = node->refetch_.get()](const storage::UnitInfo& u) { r->Report(u); });
  node->clocks_ = std::make_unique<cluster::PeerClocks>(
      cluster::PeerClockOptions{.interval_ms = c.clock_sample_interval_ms},
      [m = node->membership_.get(), self = c.node_id] {
        std::vector<cluster::PeerClocks::Peer> peers;
        // Held while read: a range-for over View()->members would destroy the temporary
        // shared_ptr at once, and a view change could free the members mid-loop.
        const std::shared_ptr<const cluster::MemberView> view = m->View();
        for (const cluster::MemberInfo& info : view->members) {
          if (info.node_id != self) peers.push_back({info.node_id, info.peer_endpoint});
        }
        return peers;
      },
      [client = node->client_.get()](const std::string& endpoint) {
        return client->Clock(endpoint);
      });
  node->clocks_->Start();
  KVTIER_LOG(kInfo) << "cluster: node " << c.node_id << " peer front " << c.peer_host << ":"
                    << node->server_->port() << " etcd " << c.etcd_endpoints.front() << " replicas "
                    << c.replicas;
  return node;
}

ClusterNode::~ClusterNode() { Stop(); }

void ClusterNode::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (clocks_) clocks_->Stop();
  if (refetch_) {
    service_->store()->SetChecksumFailureListener(nullptr);
    refetch_->Stop();
  }
  if (repair_) repair_->Stop();
  if (pause_guard_) pause_guard_->Stop();
  if (tombstones_) tombstones_->Stop();
  if (membership_) membership_->Stop(/*revoke=*/true);
  if (server_) server_->Stop();
  if (staging_) staging_->Stop();
}

std::string ClusterNode::ReadyText() const {
  auto view = membership_->View();
  std::ostringstream os;
  os << "cluster: node " << node_id_ << ", " << view->members.size() << " members, etcd "
     << (etcd_reachable() ? "reachable" : "UNREACHABLE (serving what this node holds)") << "\n";
  return os.str();
}

std::string ClusterNode::RenderPrometheus() const {
  auto view = membership_->View();
  cluster::MembershipStats ms = membership_->Stats();
  cluster::RouterStats rs = router_->stats();
  cluster::PeerServerStats ps = server_->stats();
  std::ostringstream os;
  auto gauge = [&](const char* name, const char* help, uint64_t v) {
    os << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n"
       << name << " " << v << "\n";
  };
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    os << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n"
       << name << " " << v << "\n";
  };
  gauge("kvtier_cluster_etcd_reachable", "1 when the last etcd request succeeded.",
        ms.etcd_reachable ? 1 : 0);
  gauge("kvtier_cluster_registered", "1 while this node's record is in etcd under a live lease.",
        ms.registered ? 1 : 0);
  gauge("kvtier_cluster_members", "Live members in this node's view.", view->members.size());
  counter("kvtier_cluster_registrations_total", "Registrations in etcd (1 + re-registrations).",
          ms.registrations);
  counter("kvtier_cluster_registrations_held_back_total",
          "Registrations not made because the tombstone catch-up before them failed (retried).",
          ms.registrations_held_back);
  counter("kvtier_cluster_etcd_errors_total", "Failed etcd requests and broken watches.",
          ms.etcd_errors);
  counter("kvtier_cluster_bad_member_records_total", "Member records that failed validation.",
          ms.bad_records);
  counter("kvtier_cluster_remote_lookup_hits_total", "Keys found at a peer by LOOKUP.",
          rs.remote_lookup_hits);
  counter("kvtier_cluster_remote_get_hits_total", "Units fetched from a peer by GET.",
          rs.remote_get_hits);
  counter("kvtier_cluster_remote_get_bytes_total", "Bytes of units fetched from peers.",
          rs.remote_get_bytes);
  counter("kvtier_cluster_forwarded_puts_total", "PUTs sent to a peer owner.", rs.forwarded_puts);
  counter("kvtier_cluster_forwarded_put_failures_total", "PUTs a peer owner did not acknowledge.",
          rs.forwarded_put_failures);
  counter("kvtier_cluster_puts_short_of_acks_total",
          "PUTs answered with an error for lack of owner acknowledgements.", rs.puts_short_of_acks);
  counter("kvtier_cluster_peer_errors_total", "Failed calls to peers.", rs.peer_errors);
  const cluster::PeerHealthStats hs = client_->health_stats();
  gauge("kvtier_cluster_peer_suspects",
        "Peers whose last call timed out and that no probe has heard from since: calls to them "
        "fail at once.",
        hs.suspects);
  counter("kvtier_cluster_peer_suspicions_total", "Peers marked suspect after a call timed out.",
          hs.suspicions);
  // One sample per suspect peer, so that an alert or `kvtier cluster status` names it.
  os << "# HELP kvtier_cluster_peer_suspect_seconds Seconds since a call to this peer timed "
        "out, for each peer suspect now (at most "
     << kSuspectSeriesMax
     << ", in endpoint order).\n# TYPE kvtier_cluster_peer_suspect_seconds gauge\n";
  for (const auto& [endpoint, ms] : client_->suspects(kSuspectSeriesMax)) {
    os << "kvtier_cluster_peer_suspect_seconds{peer=\"" << EscapeLabel(endpoint) << "\"} "
       << static_cast<double>(ms) / 1000.0 << "\n";
  }
  // One sample per member whose clock answered lately (cluster/peer_clocks.h), and the
  // largest offset for an alert.
  const std::vector<cluster::PeerClockReading> clocks = clocks_->Readings(kClockSeriesMax);
  os << "# HELP kvtier_cluster_peer_clock_offset_seconds The peer's clock minus this node's, "
        "from its last answer (within half the round trip; at most "
     << kClockSeriesMax
     << " peers, in node order).\n# TYPE kvtier_cluster_peer_clock_offset_seconds gauge\n";
  int64_t offset_abs_max_us = 0;
  for (const cluster::PeerClockReading& r : clocks) {
    os << "kvtier_cluster_peer_clock_offset_seconds{peer=\"" << EscapeLabel(r.node_id) << "\"} "
       << MicrosAsSeconds(r.offset_us) << "\n";
    offset_abs_max_us = std::max(offset_abs_max_us, r.offset_us < 0 ? -r.offset_us : r.offset_us);
  }
  os << "# HELP kvtier_cluster_peer_clock_offset_abs_max_seconds The largest clock offset, "
        "either way, between this node and a peer that answered lately (0: none answered).\n"
        "# TYPE kvtier_cluster_peer_clock_offset_abs_max_seconds gauge\n"
        "kvtier_cluster_peer_clock_offset_abs_max_seconds "
     << MicrosAsSeconds(offset_abs_max_us) << "\n";
  const cluster::PeerClockStats cks = clocks_->stats();
  counter("kvtier_cluster_peer_clock_samples_total", "Peer clocks read (CLOCK answered).",
          cks.samples);
  counter("kvtier_cluster_peer_clock_failures_total",
          "Peer clock reads that got no answer (timeout, suspect peer, malformed reply).",
          cks.failures);
  counter("kvtier_cluster_peer_clock_unsupported_total",
          "Peer clock reads answered by a node older than CLOCK (asked again after 10 min).",
          cks.unsupported);
  counter("kvtier_cluster_peer_calls_failed_fast_total",
          "Calls to a suspect peer failed at once instead of waiting peer_timeout_ms.",
          hs.failed_fast);
  counter("kvtier_cluster_peer_probes_total", "Probes of suspect peers.", hs.probes);
  counter("kvtier_cluster_peer_probes_failed_total", "Probes of suspect peers that timed out.",
          hs.probes_failed);
  counter("kvtier_cluster_peer_recoveries_total",
          "Suspect peers cleared by an answer (a probe or a call in flight).", hs.recoveries);
  counter("kvtier_cluster_peer_suspicions_forgotten_total",
          "Suspect peers forgotten because no call asked for them.", hs.forgotten);
  counter("kvtier_cluster_peer_calls_refused_total",
          "Calls to peers not made: every call thread busy and cluster.peer_call_queue_max "
          "waiting.",
          rs.peer_calls_refused);
  gauge("kvtier_cluster_peer_calls_queued", "Calls to peers waiting for a call thread now.",
        rs.peer_calls_queued);
  cluster::TombstoneStats ts = tombstones_->stats();
  counter("kvtier_cluster_tombstones_recorded_total", "Deleted keys recorded as tombstones.",
          ts.recorded);
  counter("kvtier_cluster_tombstones_applied_total",
          "Deletes this node missed and applied from tombstones.", ts.applied);
  counter("kvtier_cluster_tenant_deletes_applied_total",
          "Tenant deletes this node missed and applied from the log.", ts.tenant_deletes_applied);
  counter("kvtier_cluster_tombstone_watch_wakeups_total",
          "Catch-ups started at once because the log's watch saw a delete this node missed.",
          ts.watch_wakeups);
  counter("kvtier_cluster_peer_requests_total", "Requests served to peers.", ps.requests);
  counter("kvtier_cluster_peer_refused_before_catch_up_total",
          "Peer reads and writes refused before this node's first tombstone catch-up, or after "
          "a pause of this process until the catch-up that follows it.",
          handler_->refused_before_catch_up());
  cluster::PauseGuardStats pg = pause_guard_->stats();
  counter("kvtier_cluster_pauses_total",
          "Times this process did not run for over peer_timeout_ms / 2 (SIGSTOP, a stalled VM "
          "or host).",
          pg.pauses);
  gauge("kvtier_cluster_peer_answers_held",
        "1 while this node serves no read from its store (to peers or its native clients) "
        "after a pause, until its tombstone catch-up.",
        pg.held);
  counter("kvtier_cluster_repair_refused_deleted_total",
          "Repair copies refused because this node deleted the unit (or its tenant) moments ago.",
          recent_deletes_->refused());
  counter("kvtier_cluster_repair_copies_superseded_total",
          "Repair copies not stored because this node already held the unit (written since the "
          "sender's LOOKUP, by a newer PUT: it is kept).",
          handler_->superseded());
  if (copies_ != nullptr) {
    CopyStats cs = copies_->stats();
    gauge("kvtier_cluster_copy_bytes",
          "Bytes of GET copies of other owners' units held in this node's DRAM tier "
          "(at most cluster.get_copy_bytes_max).",
          cs.bytes);
    gauge("kvtier_cluster_copy_units", "GET copies held in this node's DRAM tier.", cs.units);
    counter("kvtier_cluster_copy_kept_total", "Units fetched from an owner and kept as a copy.",
            cs.kept);
    counter("kvtier_cluster_copy_hits_total", "GET hits served from a copy.", cs.hits);
    counter("kvtier_cluster_copy_dropped_total",
            "Copies dropped: deleted, replaced by a PUT, over the byte cap, expired, or with "
            "every copy when the lease was not confirmed.",
            cs.dropped);
    counter("kvtier_cluster_copy_fenced_total",
            "Fetched units not kept: deleted or replaced moments ago, lease not confirmed, "
            "fetch too old, too large, or refused by the store.",
            cs.fenced);
    counter("kvtier_cluster_copy_drop_alls_total",
            "Times every copy was dropped (lease not confirmed, new registration).", cs.drop_alls);
  }
  counter("kvtier_cluster_overwrite_tombstones_total",
          "PUT keys recorded as tombstones for members that may hold an older version (a "
          "departed owner, an owner, previous owner or copy keeper that did not acknowledge).",
          rs.overwrite_tombstones);
  counter("kvtier_cluster_previous_owner_drops_total",
          "Older-version drops (DROP_OLDER) a PUT sent to members that owned its key under the "
          "previous view and no longer do (they may hold it until their hand-over).",
          rs.previous_owner_drops);
  counter("kvtier_cluster_previous_owner_drop_failures_total",
          "Previous-owner drops a member did not answer (recorded as tombstones).",
          rs.previous_owner_drop_failures);
  gauge("kvtier_cluster_unowned_check_active",
        "1 while GETs through this node ask the owners before serving a unit it holds but does "
        "not own (after a membership change, until the repair scan handed every such unit over).",
        router_->MayHoldUnowned() ? 1 : 0);
  counter("kvtier_cluster_copy_invalidations_total",
          "Copy drops a PUT sent to members that keep copies.", rs.copy_invalidations);
  counter("kvtier_cluster_copy_invalidation_failures_total",
          "Copy drops a member did not answer (recorded as tombstones).",
          rs.copy_invalidation_failures);
  if (staged_fetcher_ != nullptr) {
    cluster::StagedFetchStats f = staged_fetcher_->stats();
    counter("kvtier_cluster_staged_get_units_total",
            "Units fetched from an owner's staging region over the region transport and verified.",
            f.units);
    counter("kvtier_cluster_staged_get_bytes_total", "Value bytes of those units.", f.bytes);
    counter("kvtier_cluster_staged_get_reused_total",
            "Staged records that failed verification (slot reused before or during the read); "
            "fetched by plain GET.",
            f.reused);
    counter("kvtier_cluster_staged_get_fallback_units_total",
            "Units fetched by plain GET instead of the region transport (reused records, units "
            "not staged, transport errors, GET_STAGED refused).",
            f.fallback_units);
    counter("kvtier_cluster_staged_get_transport_errors_total",
            "Region transport connects, opens and read batches that failed.", f.transport_errors);
    counter("kvtier_cluster_staged_get_refused_total",
            "GET_STAGED calls an owner did not answer with records.", f.refused);
  }
  if (staging_ != nullptr) {
    cluster::StagingServerStats st = staging_->stats();
    counter("kvtier_cluster_staging_records_total",
            "Units this node staged in its staging ring for peers.", st.ring.records);
    counter("kvtier_cluster_staging_bytes_total", "Value bytes staged for peers.", st.ring.bytes);
    counter("kvtier_cluster_staging_ring_wraps_total",
            "Times the staging ring wrapped (older records overwritten).", st.ring.wraps);
    counter("kvtier_cluster_staging_too_large_total",
            "Units larger than cluster.peer_staging_ring_bytes (not staged).", st.ring.too_large);
    counter("kvtier_cluster_staging_refused_total",
            "GET_STAGED from nodes not in this node's membership view.", st.refused);
    counter("kvtier_cluster_staging_grants_issued_total",
            "Staging-region grants issued to peer nodes.", st.grants_issued);
    counter("kvtier_cluster_staging_grants_revoked_total",
            "Staging-region grants revoked because their node left the membership.",
            st.grants_revoked);
    counter("kvtier_cluster_staging_region_bytes_served_total",
            "Bytes peers read from the staging region over TCP (RDMA READs bypass the server).",
            st.region.bytes_served);
    counter("kvtier_cluster_staging_region_denied_total",
            "Staging-region opens and reads refused for a missing, expired or revoked grant.",
            st.region.permission_denied);
  }
  RefetchStats rf = refetch_->stats();
  counter("kvtier_cluster_checksum_refetches_total",
          "Units quarantined here for a checksum failure and rewritten from another owner.",
          rf.refetched);
  counter("kvtier_cluster_checksum_refetch_failures_total",
          "Quarantined units no other owner could supply, or whose rewrite failed.", rf.failed);
  counter("kvtier_cluster_checksum_refetch_dropped_total",
          "Quarantined units not refetched: more than 1024 waiting.", rf.dropped);
  counter("kvtier_cluster_checksum_refetch_superseded_total",
          "Refetched units not put back: a newer PUT had written the unit here meanwhile.",
          rf.superseded);
  RepairStats rp = repair_->stats();
  gauge("kvtier_cluster_under_replicated_units",
        "Units this node must copy (it is their designated sender) that an owner still lacks, "
        "as found by the repair scan in progress or the last one.",
        rp.under_replicated);
  gauge("kvtier_cluster_moves_in_progress",
        "Units held here that this node no longer owns and has not yet handed over.",
        rp.moves_in_progress);
  gauge("kvtier_cluster_repair_done_units",
        "Units copied or handed over by the repair scan in progress or the last one.",
        rp.done_in_scan);
  gauge("kvtier_cluster_repair_active", "1 while a repair scan runs.", rp.active ? 1 : 0);
  counter("kvtier_cluster_repair_units_total", "Unit copies to owners acknowledged by them.",
          rp.units_total);
  counter("kvtier_cluster_repair_bytes_total", "Bytes of unit copies acknowledged by owners.",
          rp.bytes_total);
  counter("kvtier_cluster_repair_dropped_units_total",
          "Units dropped here after every owner confirmed holding them.", rp.dropped_total);
  counter("kvtier_cluster_repair_scans_total", "Completed repair scans.", rp.scans_total);
  counter("kvtier_cluster_repair_copy_failures_total", "Unit copies an owner did not acknowledge.",
          rp.copy_failures_total);
  counter("kvtier_cluster_repair_lookup_failures_total",
          "Repair LOOKUPs of a page that an owner did not answer.", rp.lookup_failures_total);
  counter("kvtier_cluster_repair_expired_at_owner_total",
          "Copies of TTL units an owner did not store: by its clock the unit had ended (many: "
          "its clock runs ahead of this node's).",
          rp.expired_at_owner_total);
  counter("kvtier_cluster_peer_auth_failures_total",
          "Peer connections refused for a bad or missing cluster credential.", ps.auth_failures);
  counter("kvtier_cluster_peer_tls_failures_total",
          "Peer connections refused in the TLS handshake (no certificate, one of another CA, "
          "or plaintext), with cluster.peer_tls.",
          ps.tls_failures);
  counter("kvtier_cluster_peer_accept_waits_total",
          "Peer-front accepts that failed and paused accepting (no descriptor or memory left).",
          ps.accept_waits);
  return os.str();
}

}  // namespace kvtier::daemon
