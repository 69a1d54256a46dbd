#include "cluster/peer_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "common/logging.h"

namespace kvtier::cluster {
namespace {

using daemon::wire::Frame;
using daemon::wire::Reader;
using daemon::wire::Writer;
using Clock = std::chrono::steady_clock;

bool SendAll(PeerSocket& sock, std::span<const uint8_t> data, uint64_t timeout_ms) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!data.empty()) {
    short wait = 0;
    ssize_t k = sock.Write(data.data(), data.size(), &wait);
    if (k > 0) {
      data = data.subspan(static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno != EAGAIN && errno != EINTR) return false;
    if (k < 0 && errno == EINTR) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{sock.fd(), wait, 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
  }
  return true;
}

// A timeout as a duration that can be added to Clock::now() (a larger one waits a year).
std::chrono::milliseconds Clamped(uint64_t ms) {
  constexpr uint64_t kYearMs = 365ull * 24 * 3600 * 1000;
  return std::chrono::milliseconds(std::min(ms, kYearMs));
}

void Respond(PeerSocket& sock, uint8_t opcode, uint64_t request_id, Writer* w, uint64_t timeout_ms,
             bool* ok) {
  std::vector<uint8_t>& body = w->buffer();
  auto header = daemon::wire::EncodeHeader(opcode | daemon::wire::kResponseBit, 0, request_id,
                                           static_cast<uint32_t>(body.size()));
  *ok = SendAll(sock, header, timeout_ms) && SendAll(sock, body, timeout_ms);
}

}  // namespace

StatusOr<std::unique_ptr<PeerServer>> PeerServer::Start(PeerServerOptions options,
                                                        PeerHandler* handler) {
  if (options.credential.size() < kCredentialBytesMin) {
    return Status::InvalidArgument("cluster credential shorter than 32 bytes");
  }
  if (options.tls.has_value()) {
    KVTIER_RETURN_IF_ERROR(daemon::CheckTlsFiles(*options.tls, "cluster.peer_tls"));
  }
  if (static_cast<bool>(options.take_reply_buffer) != static_cast<bool>(options.give_reply_buffer))
    return Status::InvalidArgument("peer server: take_reply_buffer needs give_reply_buffer");
  std::unique_ptr<PeerServer> s(new PeerServer(std::move(options), handler));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string where = s->options_.listen_host + ":" + std::to_string(s->options_.listen_port);
  const char* host =
      s->options_.listen_host == "localhost" ? "127.0.0.1" : s->options_.listen_host.c_str();
  if (::getaddrinfo(host, std::to_string(s->options_.listen_port).c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return Status::InvalidArgument("peer listen address " + where + " is not numeric");
  }
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
    std::string err = std::strerror(errno);
    ::freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    return Status::IOError("peer front: cannot listen on " + where + ": " + err);
  }
  ::freeaddrinfo(res);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->listen_fd_ = fd;
  s->acceptor_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

PeerServer::PeerServer(PeerServerOptions options, PeerHandler* handler)
    : options_(std::move(options)), handler_(handler) {}

PeerServer::~PeerServer() { Stop(); }

void PeerServer::Stop() {
  if (stop_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  std::map<uint64_t, std::thread> workers;
  {
    std::lock_guard lock(mu_);
    workers.swap(workers_);
  }
  for (auto& [id, t] : workers) t.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

PeerServerStats PeerServer::stats() const {
  return {connections_.load(), refused_.load(),      auth_failures_.load(), requests_.load(),
          bad_frames_.load(),  tls_failures_.load(), accept_waits_.load(),  active_.load()};
}

void PeerServer::ReapFinished() {
  std::vector<std::thread> done;
  {
    std::lock_guard lock(mu_);
    for (uint64_t id : finished_) {
      auto it = workers_.find(id);
      if (it != workers_.end()) {
        done.push_back(std::move(it->second));
        workers_.erase(it);
      }
    }
    finished_.clear();
  }
  for (auto& t : done) t.join();
}

void PeerServer::AcceptLoop() {
  while (!stop_.load()) {
    ReapFinished();
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // No descriptor or memory left: wait instead of spinning (common/accept_backoff.h).
      const auto wait = accept_backoff_.Failed(errno);
      if (wait.count() > 0) {
        accept_waits_.fetch_add(1);
        std::this_thread::sleep_for(wait);
      }
      continue;
    }
    // A response goes out as header then body: without NODELAY the body waits for the
    // peer's delayed ACK of the header (tens of ms per request).
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (active_.load() >= options_.connections_max) {
      refused_.fetch_add(1);
      ::close(fd);
      continue;
    }
    active_.fetch_add(1);
    std::unique_lock lock(mu_);
    const uint64_t id = next_worker_++;
    try {
      workers_[id] = std::thread([this, fd, id] {
        ServeConnection(fd);
        active_.fetch_sub(1);
        std::lock_guard l(mu_);
        finished_.push_back(id);
      });
    } catch (const std::system_error& e) {
      // No thread for it (memory or the thread limit ran out): closed (the peer retries or
      // fails over), and accepts pause as after EMFILE; an exception here used to end kvtierd.
      workers_.erase(id);
      lock.unlock();
      active_.fetch_sub(1);
      ::close(fd);
      accept_waits_.fetch_add(1);
      std::this_thread::sleep_for(
          accept_backoff_.Pause(e.code().value(), "starting a connection thread"));
      continue;
    }
    lock.unlock();
    connections_.fetch_add(1);
    accept_backoff_.Succeeded();
  }
}

void PeerServer::ServeConnection(int fd) {
  if (!options_.tls.has_value()) {
    PeerSocket sock(fd);
    Serve(sock);
    return;
  }
  auto tls = daemon::TlsConnection::Accept(fd, *options_.tls);  // owns fd from here
  if (!tls.ok()) {
    tls_failures_.fetch_add(1);
    KVTIER_LOG(kDebug) << "peer front: " << tls.status().message();
    return;
  }
  PeerSocket sock(std::move(*tls));
  Serve(sock);
}

void PeerServer::Serve(PeerSocket& sock) {
  daemon::wire::FrameParser parser(kPeerPreauthFrameBytesMax);
  bool authenticated = false;
  PeerNonce client_nonce{}, server_nonce{};
  bool hello_done = false;
  std::string peer_node;  // from HELLO
  const auto frame_timeout = Clamped(options_.frame_timeout_ms);
  const auto idle_timeout = Clamped(options_.idle_timeout_ms);
  // HELLO and AUTH must both be done by then: an unauthenticated peer holds a connection slot
  // for frame_timeout_ms at most, however it spaces its bytes.
  const auto handshake_deadline = Clock::now() + frame_timeout;
  auto last_activity = Clock::now();
  // When the first bytes of the frame being read arrived (in_frame: some have). The frame must
  // be whole by frame_started + frame_timeout_ms, checked whether or not more bytes arrive: a
  // peer trickling a byte at a time used to keep a started frame open indefinitely.
  bool in_frame = false;
  Clock::time_point frame_started;
  std::vector<uint8_t> buf(64 << 10);
  short read_wait = POLLIN;   // what the socket must be for the next read (TLS may want POLLOUT)
  bool read_blocked = false;  // the last read had nothing to return without waiting
  while (!stop_.load()) {
    Frame frame;
    auto next = parser.Next(&frame);
    if (!next.ok()) {
      bad_frames_.fetch_add(1);
      return;
    }
    if (!*next) {
      const auto now = Clock::now();
      if (parser.mid_frame() && !in_frame) frame_started = now;
      in_frame = parser.mid_frame();
      auto deadline = in_frame ? frame_started + frame_timeout : last_activity + idle_timeout;
      if (!authenticated) deadline = std::min(deadline, handshake_deadline);
      if (now >= deadline) return;
      // Wake at the deadline at the latest (and every 200 ms for stop_). TLS records already
      // read ahead are read without waiting, unless the last read found only part of one.
      if (!sock.Buffered() || read_blocked) {
        const auto wait = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
        pollfd p{sock.fd(), read_wait, 0};
        int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(wait.count(), 200)));
        if (n <= 0) continue;
      }
      ssize_t k = sock.Read(buf.data(), buf.size(), &read_wait);
      read_blocked = k < 0 && errno == EAGAIN;
      if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;  // part of a TLS record
      if (k <= 0) return;
      read_wait = POLLIN;
      parser.Append(std::span<const uint8_t>(buf.data(), static_cast<size_t>(k)));
      continue;
    }
    // A whole frame: bytes already buffered beyond it start the next one, timed from now.
    in_frame = false;
    last_activity = Clock::now();
    const uint8_t op = frame.header.opcode;
    Writer w;
    bool sent = false;
    if (!authenticated) {
      Reader r(frame.body);
      if (op == static_cast<uint8_t>(PeerOp::kHello) && !hello_done) {
        std::span<const uint8_t> nonce;
        std::string node_id;
        if (!r.Bytes(client_nonce.size(), &nonce) || !GetText(&r, &node_id)) {
          bad_frames_.fetch_add(1);
          return;
        }
        std::copy(nonce.begin(), nonce.end(), client_nonce.begin());
        peer_node = node_id;
        RAND_bytes(server_nonce.data(), static_cast<int>(server_nonce.size()));
        PeerProof proof =
            PeerAuthProof(options_.credential, kServerProofLabel, client_nonce, server_nonce);
        daemon::wire::EncodeStatus(Status::Ok(), &w);
        w.Bytes(std::span<const uint8_t>(server_nonce));
        w.Bytes(std::span<const uint8_t>(proof));
        hello_done = true;
        Respond(sock, op, frame.header.request_id, &w, options_.frame_timeout_ms, &sent);
        if (!sent) return;
        continue;
      }
      if (op == static_cast<uint8_t>(PeerOp::kAuth) && hello_done) {
        std::span<const uint8_t> got;
        PeerProof proof{};
        bool ok = r.Bytes(proof.size(), &got);
        if (ok) std::copy(got.begin(), got.end(), proof.begin());
        ok = ok && ProofsEqual(proof, PeerAuthProof(options_.credential, kClientProofLabel,
                                                    server_nonce, client_nonce));
        if (!ok) {
          auth_failures_.fetch_add(1);
          daemon::wire::EncodeStatus(Status::PermissionDenied("bad cluster credential"), &w);
          Respond(sock, op, frame.header.request_id, &w, options_.frame_timeout_ms, &sent);
          return;
        }
        authenticated = true;
        parser.set_max_frame_bytes(options_.frame_bytes_max);
        daemon::wire::EncodeStatus(Status::Ok(), &w);
        Respond(sock, op, frame.header.request_id, &w, options_.frame_timeout_ms, &sent);
        if (!sent) return;
        continue;
      }
      auth_failures_.fetch_add(1);
      daemon::wire::EncodeStatus(Status::PermissionDenied("peer: authenticate first"), &w);
      Respond(sock, op, frame.header.request_id, &w, options_.frame_timeout_ms, &sent);
      return;
    }
    requests_.fetch_add(1);
    // A GET's reply holds its units: built in a kept buffer when the daemon keeps them.
    const bool kept = op == static_cast<uint8_t>(PeerOp::kGet) && options_.take_reply_buffer;
    if (kept) w = Writer(options_.take_reply_buffer());
    Execute(frame, peer_node, &w);
    Respond(sock, op, frame.header.request_id, &w, options_.frame_timeout_ms, &sent);
    if (kept) options_.give_reply_buffer(w.Take());
    if (!sent) return;
  }
}

void PeerServer::Execute(const Frame& frame, const std::string& peer_node, Writer* w) {
  Reader r(frame.body);
  std::vector<PeerKey> keys;
  auto bad = [&](std::string_view what) {
    bad_frames_.fetch_add(1);
    daemon::wire::EncodeStatus(Status::InvalidArgument(what), w);
  };
  switch (static_cast<PeerOp>(frame.header.opcode)) {
    case PeerOp::kLookup: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer LOOKUP");
      std::vector<uint8_t> tiers = handler_->Lookup(keys);
      daemon::wire::EncodeStatus(Status::Ok(), w);
      w->U32(static_cast<uint32_t>(tiers.size()));
      w->Bytes(std::span<const uint8_t>(tiers));
      return;
    }
    case PeerOp::kGet: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer GET");
      const bool with_ttl = (frame.header.flags & kPeerFlagTtl) != 0;
      daemon::wire::EncodeStatus(Status::Ok(), w);
      w->U32(static_cast<uint32_t>(keys.size()));
      // The whole body (status, count and entries, all in w, then the TTL trailer when asked
      // for) within the frame limit. It used to keep a further 4096 bytes spare, which wrapped
      // around for a limit of 4096..4111 (the configuration allows 4096): every value was then
      // sent, in a response over the limit that the caller refused.
      const uint64_t reserved =
          daemon::wire::kHeaderBytes + (with_ttl ? PeerTtlTrailerBytes(keys.size()) : 0);
      const uint64_t budget =
          options_.frame_bytes_max > reserved ? options_.frame_bytes_max - reserved : 0;
      std::vector<uint8_t> value;
      std::vector<uint64_t> ttls(keys.size(), 0);
      bool any_value = false;
      for (size_t i = 0; i < keys.size(); ++i) {
        const PeerKey& k = keys[i];
        Status s = handler_->GetWithTtl(k, &value, &ttls[i]);
        if (s.ok() && w->buffer().size() + 5 + value.size() > budget) {
          // Retry: ask again in a later response; Rejected: it would never fit in one.
          s = any_value ? Status::Retry("response full")
                        : Status::Rejected("value larger than the peer response limit");
        }
        any_value = any_value || s.ok();
        if (!s.ok()) ttls[i] = 0;
        w->U8(static_cast<uint8_t>(s.code()));
        w->U32(s.ok() ? static_cast<uint32_t>(value.size()) : 0);
        if (s.ok()) w->Bytes(std::span<const uint8_t>(value));
      }
      if (with_ttl) EncodeTtlTrailer(ttls, w);
      return;
    }
    case PeerOp::kPut: {
      auto put = DecodePeerPut(frame.body, frame.header.flags);
      if (!put.ok()) return bad(put.status().message());
      if (put->expires_at_unix_ms != 0) {
        // Counted from now, the copy ends no later than its unit by this node's clock.
        put->ttl_ms = PeerPutTtlMs(*put, UnixClock().NowMs());
        if (put->ttl_ms == 0) {  // its unit has expired: nothing to store or restore
          daemon::wire::EncodeStatus(Status::Ok(), w);
          w->U8(static_cast<uint8_t>(PeerPutOutcome::kExpired));
          return;
        }
      }
      bool held = false;
      Status s = handler_->Put(*put, &held);
      daemon::wire::EncodeStatus(s, w);
      if (s.ok() && put->repair) {
        w->U8(static_cast<uint8_t>(held ? PeerPutOutcome::kHeld : PeerPutOutcome::kStored));
      }
      return;
    }
    case PeerOp::kDelete: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer DELETE");
      auto deleted = handler_->Delete(keys);
      daemon::wire::EncodeStatus(deleted.status(), w);
      if (deleted.ok()) {
        w->U32(static_cast<uint32_t>(deleted->size()));
        w->Bytes(std::span<const uint8_t>(*deleted));
      }
      return;
    }
    case PeerOp::kDeleteTenant: {
      std::string tenant;
      if (!GetText(&r, &tenant) || r.remaining() != 0) {
        return bad("malformed peer DELETE_TENANT");
      }
      daemon::wire::EncodeStatus(handler_->DeleteTenant(tenant), w);
      return;
    }
    case PeerOp::kGetStaged: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer GET_STAGED");
      auto staged = handler_->GetStaged(peer_node, keys);
      daemon::wire::EncodeStatus(staged.status(), w);
      if (staged.ok()) EncodeStagedReply(*staged, w, (frame.header.flags & kPeerFlagTtl) != 0);
      return;
    }
    case PeerOp::kDropCopies: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer DROP_COPIES");
      daemon::wire::EncodeStatus(handler_->DropCopies(keys), w);
      return;
    }
    case PeerOp::kDropOlder: {
      if (!GetKeys(&r, &keys) || r.remaining() != 0) return bad("malformed peer DROP_OLDER");
      daemon::wire::EncodeStatus(handler_->DropOlder(keys), w);
      return;
    }
    case PeerOp::kClock: {
      if (r.remaining() != 0) return bad("malformed peer CLOCK");
      daemon::wire::EncodeStatus(Status::Ok(), w);
      w->U64(UnixClock().NowUs());
      return;
    }
    default:
      return bad("unknown peer opcode");
  }
}

}  // namespace kvtier::cluster
