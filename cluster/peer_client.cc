#include "cluster/peer_client.h"

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

#include "cluster/http_client.h"
#include "cluster/peer_socket.h"

namespace kvtier::cluster {
namespace {

using daemon::wire::Reader;
using daemon::wire::Writer;
using Clock = std::chrono::steady_clock;

uint64_t NowMs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
          .count());
}
int LeftMs(uint64_t deadline_ms) {
  uint64_t now = NowMs();
  return now >= deadline_ms ? 0 : static_cast<int>(deadline_ms - now);
}

}  // namespace

struct PeerClient::Conn {
  PeerSocket sock;  // TCP, or TLS driven by the calling thread
  uint64_t next_id = 1;

  // How the last RoundTrip failed, for PeerClient::Call's one retry on a pooled connection.
  // unsent: the peer closed or reset the connection before the whole request was handed to
  // the kernel (so it never read a whole request); closed_before_reply: it closed or reset
  // it (EOF, ECONNRESET, EPIPE) before any byte of the reply arrived (it may or may not have
  // executed the request).
  bool unsent = false;
  bool closed_before_reply = false;

  // False when the peer has closed or reset this idle connection (EOF or an error pending) or
  // sent something unasked (out of step): it cannot carry a request.
  bool IdleAndOpen() const {
    if (sock.Buffered()) return false;
    pollfd p{sock.fd(), POLLIN | POLLRDHUP, 0};
    return ::poll(&p, 1, 0) == 0;
  }

  Status Send(std::span<const uint8_t> data, uint64_t deadline_ms) {
    while (!data.empty()) {
      short wait = 0;
      ssize_t k = sock.Write(data.data(), data.size(), &wait);
      if (k > 0) {
        data = data.subspan(static_cast<size_t>(k));
        continue;
      }
      if (k < 0 && errno != EAGAIN && errno != EINTR) {
        if (errno == EPIPE || errno == ECONNRESET) unsent = true;
        return Status::Unavailable(std::string("peer send: ") + std::strerror(errno));
      }
      if (k < 0 && errno == EINTR) continue;
      pollfd p{sock.fd(), wait, 0};
      if (::poll(&p, 1, LeftMs(deadline_ms)) == 0) return Status::Unavailable("peer send timeout");
    }
    return Status::Ok();
  }

  // reply_start: out is the start of the reply (nothing of it has arrived yet).
  Status Recv(uint8_t* out, size_t n, uint64_t deadline_ms, bool reply_start = false) {
    const uint8_t* const start = out;
    while (n > 0) {
      short wait = 0;
      ssize_t k = sock.Read(out, n, &wait);
      if (k > 0) {
        out += k;
        n -= static_cast<size_t>(k);
        continue;
      }
      if (k == 0 || errno == ECONNRESET) {
        closed_before_reply = reply_start && out == start;
        return Status::Unavailable(k == 0 ? std::string("peer closed the connection")
                                          : std::string("peer recv: ") + std::strerror(errno));
      }
      if (errno != EAGAIN && errno != EINTR) {
        return Status::Unavailable(std::string("peer recv: ") + std::strerror(errno));
      }
      if (errno == EINTR) continue;
      pollfd p{sock.fd(), wait, 0};
      if (::poll(&p, 1, LeftMs(deadline_ms)) == 0) return Status::Unavailable("peer timeout");
    }
    return Status::Ok();
  }

  // One request/response; returns the body after the status prefix, or the status. The body
  // is read into `into` (overwritten; only what lies beyond its size is zeroed first, its
  // capacity reused), after the prefix: never moved.
  StatusOr<std::vector<uint8_t>> RoundTrip(PeerOp op, std::span<const uint8_t> body,
                                           uint64_t deadline_ms, uint64_t frame_bytes_max,
                                           uint16_t flags = 0, std::vector<uint8_t> into = {}) {
    uint64_t id = next_id++;
    unsent = closed_before_reply = false;
    auto header = daemon::wire::EncodeHeader(static_cast<uint8_t>(op), flags, id,
                                             static_cast<uint32_t>(body.size()));
    KVTIER_RETURN_IF_ERROR(Send(header, deadline_ms));
    KVTIER_RETURN_IF_ERROR(Send(body, deadline_ms));
    std::array<uint8_t, daemon::wire::kHeaderBytes> rh{};
    KVTIER_RETURN_IF_ERROR(Recv(rh.data(), rh.size(), deadline_ms, /*reply_start=*/true));
    auto decoded = daemon::wire::DecodeHeader(rh, frame_bytes_max);
    if (!decoded.ok()) return Status::Corruption("peer response: " + decoded.status().message());
    if (decoded->opcode != (static_cast<uint8_t>(op) | daemon::wire::kResponseBit) ||
        decoded->request_id != id) {
      return Status::Corruption("peer response does not match the request");
    }
    // The status prefix (u8 code, u16 message length, the message) first, then the rest.
    const size_t total = decoded->body_bytes();
    std::vector<uint8_t> prefix(std::min<size_t>(total, 3));
    KVTIER_RETURN_IF_ERROR(Recv(prefix.data(), prefix.size(), deadline_ms));
    if (prefix.size() == 3) {
      const size_t msg = std::min<size_t>(prefix[1] | (size_t{prefix[2]} << 8), total - 3);
      prefix.resize(3 + msg);
      KVTIER_RETURN_IF_ERROR(Recv(prefix.data() + 3, msg, deadline_ms));
    }
    into.resize(total - prefix.size());
    KVTIER_RETURN_IF_ERROR(Recv(into.data(), into.size(), deadline_ms));
    Reader r(prefix);
    Status st;
    KVTIER_RETURN_IF_ERROR(daemon::wire::DecodeStatus(&r, &st));
    if (!st.ok()) return st;
    return into;
  }
};

PeerClient::PeerClient(PeerClientOptions options) : options_(std::move(options)) {
  health_ = std::make_unique<PeerHealth>(
      PeerHealthOptions{.probe_interval_ms = options_.probe_interval_ms},
      [this](const std::string& endpoint) { return Probe(endpoint); });
}

PeerClient::~PeerClient() { health_.reset(); }  // its probers first

StatusOr<std::unique_ptr<PeerClient::Conn>> PeerClient::Connect(const std::string& endpoint,
                                                                uint64_t deadline_ms) {
  auto ep = ParseHttpEndpoint(endpoint);
  if (!ep.ok()) return Status::InvalidArgument("peer endpoint: " + ep.status().message());
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(ep->host.c_str(), std::to_string(ep->port).c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return Status::Unavailable("peer " + endpoint + ": cannot resolve");
  }
  auto conn = std::make_unique<Conn>();
  conn->sock = PeerSocket(::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const int fd = conn->sock.fd();
  int rc = fd < 0 ? -1 : ::connect(fd, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    return Status::Unavailable("peer " + endpoint + ": " + std::strerror(errno));
  }
  pollfd p{fd, POLLOUT, 0};
  int err = 0;
  socklen_t len = sizeof(err);
  if (::poll(&p, 1, LeftMs(deadline_ms)) != 1 ||
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
    return Status::Unavailable("peer " + endpoint + ": connect failed");
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (options_.tls.has_value()) {
    daemon::TlsClientOptions to = *options_.tls;
    to.server_name = ep->host;
    to.handshake_timeout_ms = static_cast<uint64_t>(std::max(LeftMs(deadline_ms), 1));
    // The connection takes the socket (and on failure has closed it).
    auto tls = daemon::TlsConnection::Connect(conn->sock.Release(), to);
    if (!tls.ok()) {
      const Status& s = tls.status();
      return s.IsPermissionDenied() || s.IsInvalidArgument()
                 ? Status(s.code(), "peer " + endpoint + ": " + s.message())
                 : Status::Unavailable("peer " + endpoint + ": " + s.message());
    }
    conn->sock = PeerSocket(std::move(*tls));
  }

  PeerNonce client_nonce{};
  RAND_bytes(client_nonce.data(), static_cast<int>(client_nonce.size()));
  Writer text;
  PutText(options_.node_id, &text);
  std::vector<uint8_t> hello(client_nonce.size() + text.buffer().size());
  std::memcpy(hello.data(), client_nonce.data(), client_nonce.size());
  std::memcpy(hello.data() + client_nonce.size(), text.buffer().data(), text.buffer().size());
  KVTIER_ASSIGN_OR_RETURN(
      std::vector<uint8_t> reply,
      conn->RoundTrip(PeerOp::kHello, hello, deadline_ms, kPeerPreauthFrameBytesMax));
  Reader r(reply);
  std::span<const uint8_t> sn, sp;
  if (!r.Bytes(32, &sn) || !r.Bytes(32, &sp)) return Status::Corruption("peer HELLO reply");
  PeerNonce server_nonce{};
  PeerProof server_proof{};
  std::copy(sn.begin(), sn.end(), server_nonce.begin());
  std::copy(sp.begin(), sp.end(), server_proof.begin());
  if (!ProofsEqual(server_proof, PeerAuthProof(options_.credential, kServerProofLabel, client_nonce,
                                               server_nonce))) {
    return Status::PermissionDenied("peer " + endpoint + " does not hold the cluster credential");
  }
  PeerProof proof =
      PeerAuthProof(options_.credential, kClientProofLabel, server_nonce, client_nonce);
  KVTIER_RETURN_IF_ERROR(
      conn->RoundTrip(PeerOp::kAuth, proof, deadline_ms, kPeerPreauthFrameBytesMax).status());
  return conn;
}

namespace {

// Operations whose repetition changes nothing another call could have done meanwhile: reads,
// staging (a new record per call) and dropping GET copies. A PUT, DELETE or DELETE_TENANT
// repeated after the peer executed it could undo a write or delete that landed in between.
bool SafeToRepeat(PeerOp op) {
  return op == PeerOp::kLookup || op == PeerOp::kGet || op == PeerOp::kGetStaged ||
         op == PeerOp::kDropCopies;
}

}  // namespace

std::unique_ptr<PeerClient::Conn> PeerClient::TakeIdle(const std::string& endpoint) {
  std::vector<std::unique_ptr<Conn>> closed;  // closed outside mu_
  std::unique_ptr<Conn> conn;
  {
    std::lock_guard lock(mu_);
    auto& idle = idle_[endpoint];
    while (!idle.empty() && conn == nullptr) {
      std::unique_ptr<Conn> c = std::move(idle.back());
      idle.pop_back();
      if (c->IdleAndOpen()) {
        conn = std::move(c);
      } else {
        closed.push_back(std::move(c));
      }
    }
  }
  return conn;
}

StatusOr<std::vector<uint8_t>> PeerClient::Call(const std::string& endpoint, PeerOp op,
                                                std::span<const uint8_t> body, uint16_t flags,
                                                std::vector<uint8_t> into) {
  uint64_t suspect_for_ms = 0;
  if (!health_->Admit(endpoint, &suspect_for_ms)) {
    return Status::Unavailable("peer " + endpoint + " is not answering (a call timed out " +
                               std::to_string(suspect_for_ms) + " ms ago; probing)");
  }
  const uint64_t deadline = NowMs() + options_.timeout_ms;
  auto reply = CallOnce(endpoint, op, body, flags, deadline, std::move(into));
  // Failed at the deadline: no answer in time. Anything else is an answer (a refused
  // connection fails at once and needs no suspicion to be fast).
  if (!reply.ok() && reply.status().IsUnavailable() && NowMs() >= deadline) {
    health_->TimedOut(endpoint);
  } else {
    health_->Answered(endpoint);
  }
  return reply;
}

StatusOr<std::vector<uint8_t>> PeerClient::CallOnce(const std::string& endpoint, PeerOp op,
                                                    std::span<const uint8_t> body, uint16_t flags,
                                                    uint64_t deadline, std::vector<uint8_t> into) {
  std::unique_ptr<Conn> conn = TakeIdle(endpoint);
  const bool pooled = conn != nullptr;
  if (!pooled) {
    KVTIER_ASSIGN_OR_RETURN(conn, Connect(endpoint, deadline));
  }
  auto reply =
      conn->RoundTrip(op, body, deadline, options_.frame_bytes_max, flags, std::move(into));
  // A pooled connection the peer closed (its idle timeout) just as we sent: once more on a
  // new connection, when the peer cannot have executed the request (it never had all of it)
  // or executing it twice is harmless. Never after a byte of the reply, never on a new one.
  if (!reply.ok() && pooled && (conn->unsent || (conn->closed_before_reply && SafeToRepeat(op)))) {
    conn.reset();
    KVTIER_ASSIGN_OR_RETURN(conn, Connect(endpoint, deadline));
    reply = conn->RoundTrip(op, body, deadline, options_.frame_bytes_max, flags);
  }
  // A peer's own error status leaves the connection in step; transport failures do not.
  bool reusable = reply.ok() || (!reply.status().IsUnavailable() && !reply.status().IsCorruption());
  if (reusable) KeepIdle(endpoint, std::move(conn));
  return reply;
}

void PeerClient::KeepIdle(const std::string& endpoint, std::unique_ptr<Conn> conn) {
  std::lock_guard lock(mu_);
  auto& idle = idle_[endpoint];
  if (idle.size() < options_.idle_connections_per_peer_max) idle.push_back(std::move(conn));
}

bool PeerClient::Probe(const std::string& endpoint) {
  const uint64_t deadline = NowMs() + options_.timeout_ms;
  auto conn = Connect(endpoint, deadline);
  if (conn.ok()) {
    KeepIdle(endpoint, std::move(*conn));
    return true;
  }
  return !(conn.status().IsUnavailable() && NowMs() >= deadline);
}

namespace {

// Bytes handed to `give` when the last holder lets go (a kept reply buffer; may be null).
struct GivenBack {
  GivenBack(std::vector<uint8_t> b, std::function<void(std::vector<uint8_t>)> g)
      : bytes(std::move(b)), give(std::move(g)) {}
  GivenBack(const GivenBack&) = delete;
  GivenBack& operator=(const GivenBack&) = delete;
  ~GivenBack() {
    if (give) give(std::move(bytes));
  }
  std::vector<uint8_t> bytes;
  std::function<void(std::vector<uint8_t>)> give;
};

// A GET reply's entries and TTL trailer (peer_wire.h), for `keys` keys, each value a view of
// `body`, which the result holds.
StatusOr<PeerClient::GetResult> DecodeGetReply(PeerBytes body, size_t keys) {
  Reader r(*body);
  uint32_t n = 0;
  if (!r.U32(&n) || n != keys) return Status::Corruption("peer GET reply");
  PeerClient::GetResult out;
  out.statuses.resize(n);
  out.values.resize(n);
  out.ttl_left_ms.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t code = 0;
    uint32_t len = 0;
    std::span<const uint8_t> bytes;
    if (!r.U8(&code) || code > static_cast<uint8_t>(StatusCode::kInternal) || !r.U32(&len) ||
        !r.Bytes(len, &bytes)) {
      return Status::Corruption("peer GET reply entry");
    }
    out.statuses[i] = code == 0 ? Status::Ok() : Status(static_cast<StatusCode>(code), "peer");
    if (code == 0) out.values[i] = bytes;
  }
  bool present = false;
  std::vector<uint64_t> ttls;
  KVTIER_RETURN_IF_ERROR(DecodeTtlTrailer(&r, n, &present, &ttls));
  for (size_t i = 0; i < ttls.size(); ++i) {
    if (out.statuses[i].ok()) out.ttl_left_ms[i] = ttls[i];
  }
  out.held.push_back(std::move(body));
  return out;
}

}  // namespace

StatusOr<std::vector<uint8_t>> PeerClient::ByteReplyPerKey(const std::string& endpoint, PeerOp op,
                                                           std::span<const PeerKey> keys,
                                                           const char* what) {
  Writer w;
  PutKeys(keys, &w);
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> body, Call(endpoint, op, w.buffer()));
  Reader r(body);
  uint32_t n = 0;
  std::span<const uint8_t> bytes;
  if (!r.U32(&n) || n != keys.size() || !r.Bytes(n, &bytes)) return Status::Corruption(what);
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

StatusOr<std::vector<uint8_t>> PeerClient::Lookup(const std::string& endpoint,
                                                  std::span<const PeerKey> keys) {
  return ByteReplyPerKey(endpoint, PeerOp::kLookup, keys, "peer LOOKUP reply");
}

StatusOr<PeerClient::GetResult> PeerClient::Get(const std::string& endpoint,
                                                std::span<const PeerKey> keys) {
  Writer w;
  PutKeys(keys, &w);
  StatusOr<std::vector<uint8_t>> body =
      Call(endpoint, PeerOp::kGet, w.buffer(), kPeerFlagTtl,
           options_.take_reply_buffer ? options_.take_reply_buffer() : std::vector<uint8_t>{});
  if (!body.ok()) return body.status();
  // The values are views of the reply: its buffer goes back to the daemon's kept ones when
  // the last holder of the result lets go.
  auto reply = std::make_shared<GivenBack>(std::move(*body), options_.give_reply_buffer);
  PeerBytes held(reply, &reply->bytes);
  return DecodeGetReply(std::move(held), keys.size());
}

StatusOr<StagedReply> PeerClient::GetStaged(const std::string& endpoint,
                                            std::span<const PeerKey> keys) {
  Writer w;
  PutKeys(keys, &w);
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> body,
                          Call(endpoint, PeerOp::kGetStaged, w.buffer(), kPeerFlagTtl));
  return DecodeStagedReply(body, keys.size(), /*ttl_asked=*/true);
}

Status PeerClient::Put(const std::string& endpoint, const PeerPut& put, PeerPutOutcome* outcome) {
  if (outcome != nullptr) *outcome = PeerPutOutcome::kStored;
  auto body = Call(endpoint, PeerOp::kPut, EncodePeerPut(put), PeerPutFlags(put));
  if (!body.ok() && body.status().IsInvalidArgument() && put.expires_at_unix_ms != 0) {
    PeerPut without = put;  // a node older than the expiry (peer_wire.h)
    without.expires_at_unix_ms = 0;
    body = Call(endpoint, PeerOp::kPut, EncodePeerPut(without), PeerPutFlags(without));
  }
  if (!body.ok()) return body.status();
  // The held byte follows a repair copy's OK; a node older than it sends none (it stored).
  if (outcome != nullptr && put.repair && !body->empty()) {
    if ((*body)[0] == static_cast<uint8_t>(PeerPutOutcome::kHeld)) *outcome = PeerPutOutcome::kHeld;
    if ((*body)[0] == static_cast<uint8_t>(PeerPutOutcome::kExpired)) {
      *outcome = PeerPutOutcome::kExpired;
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<uint8_t>> PeerClient::Delete(const std::string& endpoint,
                                                  std::span<const PeerKey> keys) {
  return ByteReplyPerKey(endpoint, PeerOp::kDelete, keys, "peer DELETE reply");
}

Status PeerClient::DropCopies(const std::string& endpoint, std::span<const PeerKey> keys) {
  Writer w;
  PutKeys(keys, &w);
  return Call(endpoint, PeerOp::kDropCopies, w.buffer()).status();
}

Status PeerClient::DropOlder(const std::string& endpoint, std::span<const PeerKey> keys) {
  Writer w;
  PutKeys(keys, &w);
  return Call(endpoint, PeerOp::kDropOlder, w.buffer()).status();
}

StatusOr<PeerClient::ClockSample> PeerClient::Clock(const std::string& endpoint) {
  const kvtier::Clock& unix_clock =
      options_.unix_clock != nullptr ? *options_.unix_clock : DefaultSystemClock();
  const kvtier::Clock& steady = DefaultSteadyClock();
  std::optional<ClockSample> best;
  for (int exchange = 0; exchange < 2; ++exchange) {
    const uint64_t unix0_us = unix_clock.NowUs(), steady0_us = steady.NowUs();
    auto reply = Call(endpoint, PeerOp::kClock, {});
    const uint64_t rtt_us = steady.NowUs() - steady0_us;
    if (!reply.ok()) return reply.status();
    KVTIER_ASSIGN_OR_RETURN(uint64_t peer_us, DecodeClockReply(*reply));
    const uint64_t ours_us = unix0_us + rtt_us / 2;
    // Two's complement difference: Unix microseconds stay far below 2^63.
    const auto offset_us = static_cast<int64_t>(peer_us - ours_us);
    if (!best || rtt_us < best->rtt_us) best = ClockSample{offset_us, rtt_us};
  }
  return *best;
}

Status PeerClient::DeleteTenant(const std::string& endpoint, std::string_view tenant) {
  Writer w;
  PutText(tenant, &w);
  return Call(endpoint, PeerOp::kDeleteTenant, w.buffer()).status();
}

}  // namespace kvtier::cluster
