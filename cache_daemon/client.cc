#include "cache_daemon/client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "cache_daemon/tls_client.h"

namespace kvtier::daemon {
namespace {

using wire::Frame;
using wire::Opcode;
constexpr size_t kRecvChunkBytes = 256 * 1024;
constexpr uint64_t kShmAlignBytes = 64;

// Sends every byte (retrying partial sends and EINTR); *sent_out: bytes sent before an error.
Status SendAll(int fd, std::span<const uint8_t> bytes, size_t* sent_out = nullptr) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (sent_out != nullptr) *sent_out = off;
      return Status::IOError(std::string("send: ") + std::strerror(errno));
    }
    off += static_cast<size_t>(n);
  }
  if (sent_out != nullptr) *sent_out = off;
  return Status::Ok();
}

// First-fit allocator over the shared-memory region. Thread-safe.
class ShmAllocator {
 public:
  void Reset(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.clear();
    if (bytes > 0) free_[0] = bytes;
  }
  std::optional<uint64_t> Alloc(uint64_t bytes) {
    bytes = (bytes + kShmAlignBytes - 1) & ~(kShmAlignBytes - 1);
    if (bytes == 0) bytes = kShmAlignBytes;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      uint64_t off = it->first, size = it->second;
      free_.erase(it);
      if (size > bytes) free_[off + bytes] = size - bytes;
      return off;
    }
    return std::nullopt;
  }
  void Free(uint64_t off, uint64_t bytes) {
    bytes = (bytes + kShmAlignBytes - 1) & ~(kShmAlignBytes - 1);
    if (bytes == 0) bytes = kShmAlignBytes;
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = free_.emplace(off, bytes);
    (void)inserted;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

 private:
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, protected by mu_
};

// Where a GET's values are copied out of the shared-memory file (ValuesBuffer): anonymous
// memory, 2 MiB aligned and advised MADV_HUGEPAGE, cached per thread and reused by the
// thread's next GET. The first user access to each 4 KiB page of a fresh mapping costs a page
// fault, and in a virtual machine with shadow page tables about 5-10 us of CPU even after
// MADV_POPULATE_READ; reading a 256-unit resume (1.4 MB) in place from a new connection's
// region cost ~1.7 ms that way, its copy out with one pread ~0.1 ms (docs/performance/resume.md,
// "Resume fetch: one write per GET, values copied out (helper shmget)"). Buffers larger than
// kValuesCachedBytesMax are not kept.
constexpr uint64_t kValuesCachedBytesMax = 32ull << 20;
constexpr uint64_t kValuesGrainBytes = 2ull << 20;

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
struct ValuesBuffer {
  std::unique_ptr<uint8_t, FreeDeleter> data;
  uint64_t bytes = 0;
};
thread_local ValuesBuffer t_values;

// A buffer of at least `bytes`: the thread's cached one when it is large enough (taken out of
// the cache while in use, so a GET issued from inside a visitor gets its own), else a new
// one. Empty when memory is short.
ValuesBuffer TakeValuesBuffer(uint64_t bytes) {
  if (t_values.bytes >= bytes) return std::exchange(t_values, ValuesBuffer{});
  ValuesBuffer b;
  b.bytes =
      (std::max(bytes, t_values.bytes * 2) + kValuesGrainBytes - 1) & ~(kValuesGrainBytes - 1);
  b.data.reset(static_cast<uint8_t*>(std::aligned_alloc(kValuesGrainBytes, b.bytes)));
  if (b.data == nullptr) return {};
  (void)::madvise(b.data.get(), b.bytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  return b;
}
void ReturnValuesBuffer(ValuesBuffer b) {
  if (b.data != nullptr && b.bytes <= kValuesCachedBytesMax && b.bytes > t_values.bytes) {
    t_values = std::move(b);
  }
}

// A shared-memory allocation released on destruction.
struct ShmLease {
  ShmAllocator* alloc = nullptr;
  uint64_t offset = 0, bytes = 0;
  ShmLease() = default;
  ShmLease(ShmAllocator* a, uint64_t o, uint64_t b) : alloc(a), offset(o), bytes(b) {}
  ShmLease(ShmLease&& o) noexcept : alloc(o.alloc), offset(o.offset), bytes(o.bytes) {
    o.alloc = nullptr;
  }
  ShmLease(const ShmLease&) = delete;
  ~ShmLease() {
    if (alloc != nullptr) alloc->Free(offset, bytes);
  }
};

// A request waiting for its reply, with the shared-memory ranges the daemon may still read or
// write for it. A caller that stops waiting (timeout) drops its own references; the ranges
// stay allocated here until the reply arrives or the connection fails, so they are never
// handed to another request while the daemon could still use them.
struct Pending {
  std::promise<StatusOr<Frame>> reply;
  std::vector<std::shared_ptr<ShmLease>> leases;
};

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(const ClientOptions& o) : options_(o), parser_(o.max_frame_bytes) {}

  ~ClientImpl() override {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
    if (fd_ >= 0) ::close(fd_);
    if (shm_ != nullptr) ::munmap(shm_, shm_bytes_);
    if (shm_fd_ >= 0) ::close(shm_fd_);
  }

  Status Open() {
    if (options_.tcp_port != 0) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      std::string port = std::to_string(options_.tcp_port);
      if (::getaddrinfo(options_.tcp_host.c_str(), port.c_str(), &hints, &res) != 0) {
        return Status::IOError("cannot resolve " + options_.tcp_host);
      }
      for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
        } else {
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
      if (fd_ < 0) {
        return Status::IOError("cannot connect to " + options_.tcp_host + ":" + port);
      }
      int one = 1;
      ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      if (options_.tls) {
        // From here on fd_ is the plaintext end of the tunnel; the tunnel owns the TCP socket.
        TlsClientOptions to;
        to.ca_file = options_.tls_ca_file;
        to.server_name =
            options_.tls_server_name.empty() ? options_.tcp_host : options_.tls_server_name;
        to.verify_hostname = options_.tls_verify_hostname;
        to.handshake_timeout_ms = options_.timeout_ms;
        int tcp_fd = std::exchange(fd_, -1);
        KVTIER_ASSIGN_OR_RETURN(tls_, TlsTunnel::Open(tcp_fd, to));
        fd_ = tls_->TakeClientFd();
      }
    } else {
      if (options_.socket_path.empty() || options_.socket_path.size() >= 108) {
        return Status::InvalidArgument("socket path empty or too long");
      }
      fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, options_.socket_path.data(), options_.socket_path.size());
      if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        return Status::IOError("cannot connect to " + options_.socket_path + ": " +
                               std::strerror(errno));
      }
      is_unix_ = true;
    }
    // HELLO (with the token) and, over a Unix socket, SHM_ATTACH, before the reader starts.
    wire::HelloRequest hello;
    hello.token = options_.token;
    hello.unit_tokens = options_.unit_tokens;
    KVTIER_ASSIGN_OR_RETURN(Frame hf, SyncCall(Opcode::kHello, wire::EncodeHello(hello), nullptr));
    wire::Reader hr(hf.body);
    Status hs;
    KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&hr, &hs));
    KVTIER_RETURN_IF_ERROR(hs);
    KVTIER_ASSIGN_OR_RETURN(hello_, wire::DecodeHelloResponse(&hr));
    // The daemon names the tenant a connection runs as; none means auth is on and no token
    // was given.
    unauthenticated_ = hello_.tenant_name.empty();
    if (is_unix_ && options_.shm_bytes > 0 && !unauthenticated_) {
      int memfd = -1;
      KVTIER_ASSIGN_OR_RETURN(
          Frame sf,
          SyncCall(Opcode::kShmAttach, wire::EncodeShmAttach(options_.shm_bytes), &memfd));
      wire::Reader sr(sf.body);
      Status ss;
      KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&sr, &ss));
      uint64_t granted = 0;
      if (ss.ok() && sr.U64(&granted) && memfd >= 0 && granted > 0) {
        void* p = ::mmap(nullptr, granted, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
        if (p != MAP_FAILED) {
          shm_ = static_cast<uint8_t*>(p);
          shm_bytes_ = granted;
          alloc_.Reset(granted);
          shm_fd_ = std::exchange(memfd, -1);  // kept: GET values are read out of it (pread)
        }
      }
      if (memfd >= 0) ::close(memfd);
    }
    reader_ = std::thread([this] { ReadLoop(); });
    return Status::Ok();
  }

  const wire::HelloResponse& hello() const override { return hello_; }
  bool shm_attached() const override { return shm_ != nullptr; }

  uint64_t NewTurn() override { return next_turn_.fetch_add(1, std::memory_order_relaxed); }

  std::future<StatusOr<LookupResult>> LookupAsync(std::span<const wire::Key> chain,
                                                  uint64_t turn) override {
    std::vector<wire::Key> keys(chain.begin(), chain.end());
    return std::async(std::launch::deferred,
                      [this, keys = std::move(keys), turn]() { return DoLookup(keys, turn); });
  }

  std::future<StatusOr<std::vector<Status>>> PutAsync(std::span<const PutUnit> units,
                                                      const PutOptions& o) override {
    // Values are sent now (they are not retained); only the wait is deferred.
    std::vector<std::pair<std::future<StatusOr<Frame>>, size_t>> calls;
    std::vector<std::shared_ptr<ShmLease>> leases;
    Status early;
    size_t i = 0;
    while (i < units.size() && early.ok()) {
      size_t end = i;
      uint64_t bytes = 0;
      uint64_t frame_budget = hello_.max_frame_bytes > 4096 ? hello_.max_frame_bytes - 4096 : 0;
      while (end < units.size() && end - i < BatchLimit() &&
             (end == i || bytes + units[end].value.size() + 80 <= frame_budget)) {
        bytes += units[end].value.size() + 80;
        ++end;
      }
      StatusOr<std::future<StatusOr<Frame>>> f = SendPut(units.subspan(i, end - i), o, &leases);
      if (!f.ok()) {
        early = f.status();
        break;
      }
      calls.emplace_back(std::move(f).value(), end - i);
      i = end;
    }
    return std::async(
        std::launch::deferred,
        [this, calls = std::move(calls), leases = std::move(leases),
         early]() mutable -> StatusOr<std::vector<Status>> {
          std::vector<Status> out;
          Status first = early;
          for (auto& [fut, n] : calls) {
            StatusOr<Frame> f = Wait(fut);
            if (!f.ok()) {
              if (first.ok()) first = f.status();
              continue;
            }
            wire::Reader r(f->body);
            Status st;
            Status outer = wire::DecodeStatus(&r, &st);
            if (!outer.ok() || !st.ok()) {
              if (first.ok()) first = outer.ok() ? st : outer;
              continue;
            }
            StatusOr<std::vector<StatusCode>> codes = wire::DecodeCodes(&r);
            if (!codes.ok() || codes->size() != n) {
              if (first.ok()) first = Status::Corruption("put response count mismatch");
              continue;
            }
            for (StatusCode c : *codes) {
              out.push_back(c == StatusCode::kOk ? Status::Ok() : Status(c, "unit not stored"));
            }
          }
          if (!first.ok()) return first;
          return out;
        });
  }

  Status Get(std::span<const wire::Key> keys, uint64_t turn,
             const std::function<void(size_t, const GetItem&)>& visit) override {
    for (size_t base = 0; base < keys.size(); base += BatchLimit()) {
      size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
      KVTIER_RETURN_IF_ERROR(GetChunk(keys.subspan(base, n), base, turn, visit));
    }
    return Status::Ok();
  }

  Status Prefetch(std::span<const wire::Key> keys) override {
    return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
      return Simple(Opcode::kPrefetch, wire::EncodeKeys(b), nullptr);
    });
  }
  Status Pin(std::span<const wire::Key> keys, uint64_t lease_ms) override {
    return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
      return Simple(Opcode::kPin, wire::EncodePin(lease_ms, b), nullptr);
    });
  }
  Status Unpin(std::span<const wire::Key> keys) override {
    return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
      return Simple(Opcode::kUnpin, wire::EncodeKeys(b), nullptr);
    });
  }
  StatusOr<uint32_t> Delete(std::span<const wire::Key> keys) override {
    uint32_t total = 0;
    for (size_t base = 0; base < keys.size() || base == 0; base += BatchLimit()) {
      size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
      wire::DeleteRequest req;
      req.keys.assign(keys.begin() + base, keys.begin() + base + n);
      uint32_t deleted = 0;
      KVTIER_RETURN_IF_ERROR(Simple(Opcode::kDelete, wire::EncodeDelete(req), [&](wire::Reader* r) {
        return r->U32(&deleted) ? Status::Ok() : Status::Corruption("bad delete response");
      }));
      total += deleted;
      if (keys.empty()) break;
    }
    return total;
  }
  Status DeleteAll() override {
    wire::DeleteRequest req;
    req.scope = 1;
    return Simple(Opcode::kDelete, wire::EncodeDelete(req), nullptr);
  }
  StatusOr<std::string> StatsJson() override { return TextCall(Opcode::kStats, {}); }
  StatusOr<std::string> PolicyGet() override { return TextCall(Opcode::kPolicyGet, {}); }
  StatusOr<std::string> PolicySet(const std::string& json) override {
    wire::Writer w;
    wire::EncodeText(json, &w);
    return TextCall(Opcode::kPolicySet, w.Take());
  }
  Status Drain(bool shutdown) override {
    std::vector<uint8_t> body{static_cast<uint8_t>(shutdown ? 1 : 0)};
    return Simple(Opcode::kDrain, body, nullptr);
  }
  StatusOr<wire::EngramGrantResponse> EngramGrant(std::span<const std::string> regions,
                                                  uint64_t ttl_ms) override {
    if (regions.size() > wire::kEngramRegionsMax) {
      return Status::InvalidArgument("at most " + std::to_string(wire::kEngramRegionsMax) +
                                     " regions in one engram grant");
    }
    wire::EngramGrantRequest req;
    req.ttl_ms = ttl_ms;
    for (const std::string& r : regions) {
      if (r.empty() || r.size() > wire::kEngramNameBytesMax) {
        return Status::InvalidArgument("engram region names are 1..256 bytes");
      }
      req.regions.push_back(r);
    }
    wire::EngramGrantResponse resp;
    KVTIER_RETURN_IF_ERROR(
        Simple(Opcode::kEngramGrant, wire::EncodeEngramGrant(req), [&](wire::Reader* r) -> Status {
          KVTIER_ASSIGN_OR_RETURN(resp, wire::DecodeEngramGrantResponse(r));
          return Status::Ok();
        }));
    return resp;
  }
  Status EngramReport(const wire::EngramReport& report) override {
    if (wire::EngramTransportIndex(report.transport) < 0) {
      return Status::InvalidArgument("engram report transport must be \"tcp\" or \"verbs\"");
    }
    return Simple(Opcode::kEngramReport, wire::EncodeEngramReport(report), nullptr);
  }
  Status TEST_SendRaw(std::span<const uint8_t> bytes) override {
    std::lock_guard<std::mutex> lock(write_mu_);
    return SendAll(fd_, bytes);
  }

 private:
  // The frame flags and body of a LOOKUP/GET/PUT of `turn` (wire::kFlagTurn): the turn id in
  // front of the body when there is one and the daemon takes turns; unchanged otherwise.
  uint16_t WithTurn(uint64_t turn, uint16_t flags, std::vector<uint8_t>* body) const {
    if (turn == 0 || (hello_.features & wire::kFeatureTurns) == 0) return flags;
    uint8_t id[wire::kTurnBytes];
    for (size_t i = 0; i < wire::kTurnBytes; ++i) id[i] = static_cast<uint8_t>(turn >> (8 * i));
    body->insert(body->begin(), id, id + wire::kTurnBytes);
    return static_cast<uint16_t>(flags | wire::kFlagTurn);
  }

  // Keys per request: the daemon's advertised max_batch_keys (HELLO), never above the wire
  // format's kMaxBatchKeys; every batch call is split at it.
  size_t BatchLimit() const {
    uint32_t m = hello_.max_batch_keys;
    return m == 0 || m > wire::kMaxBatchKeys ? wire::kMaxBatchKeys : m;
  }
  // Runs call(b) for consecutive slices of at most BatchLimit() keys (once for no keys).
  Status ForEachBatch(std::span<const wire::Key> keys,
                      const std::function<Status(std::span<const wire::Key>)>& call) {
    if (keys.empty()) return call(keys);
    for (size_t base = 0; base < keys.size(); base += BatchLimit()) {
      KVTIER_RETURN_IF_ERROR(call(keys.subspan(base, std::min(BatchLimit(), keys.size() - base))));
    }
    return Status::Ok();
  }

  // Blocking request/response used before the reader thread exists. Collects a passed fd.
  StatusOr<Frame> SyncCall(Opcode op, const std::vector<uint8_t>& body, int* fd_out) {
    uint64_t id = next_id_++;
    KVTIER_RETURN_IF_ERROR(SendAll(fd_, wire::BuildFrame(static_cast<uint8_t>(op), 0, id, body)));
    std::vector<uint8_t> buf(kRecvChunkBytes);
    for (;;) {
      Frame f;
      KVTIER_ASSIGN_OR_RETURN(bool got, parser_.Next(&f));
      if (got) {
        if (f.header.request_id != id ||
            f.header.opcode != (static_cast<uint8_t>(op) | wire::kResponseBit)) {
          return Status::Corruption("unexpected response during handshake");
        }
        return f;
      }
      msghdr msg{};
      iovec iov{buf.data(), buf.size()};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ssize_t n = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError("connection closed during handshake");
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
          if (fd_out != nullptr && *fd_out < 0)
            *fd_out = fd;
          else
            ::close(fd);
        }
      }
      parser_.Append(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
    }
  }

  void ReadLoop() {
    std::vector<uint8_t> buf(kRecvChunkBytes);
    Status failure;
    for (;;) {
      Frame f;
      StatusOr<bool> got = parser_.Next(&f);
      if (!got.ok()) {
        failure = Status::IOError("malformed frame from daemon: " + got.status().message());
        break;
      }
      if (*got) {
        std::promise<StatusOr<Frame>> p;
        bool found = false;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = pending_.find(f.header.request_id);
          if (it != pending_.end()) {
            p = std::move(it->second.reply);
            pending_.erase(it);  // releases its shared-memory ranges
            found = true;
          }
        }
        if (found) p.set_value(std::move(f));
        continue;
      }
      ssize_t n = ::recv(fd_, buf.data(), buf.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        failure = Status::IOError("connection to kvtierd closed");
        break;
      }
      parser_.Append(std::span<const uint8_t>(buf.data(), static_cast<size_t>(n)));
    }
    std::map<uint64_t, Pending> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = failure;
      pending.swap(pending_);
    }
    for (auto& [id, p] : pending) p.reply.set_value(failure);
  }

  // leases: the shared-memory ranges the request names; kept until its reply (see Pending).
  std::future<StatusOr<Frame>> Call(Opcode op, uint16_t flags, std::span<const uint8_t> body,
                                    std::vector<std::shared_ptr<ShmLease>> leases = {}) {
    uint64_t id = next_id_++;
    std::promise<StatusOr<Frame>> p;
    std::future<StatusOr<Frame>> fut = p.get_future();
    if (unauthenticated_) {
      // The daemon answers anything but HELLO/AUTH on an unauthenticated connection once and
      // closes it; refuse here and keep the connection (docs/format/wire.md).
      p.set_value(Status::PermissionDenied("authentication required (HELLO/AUTH)"));
      return fut;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.ok()) {
        p.set_value(broken_);
        return fut;
      }
      pending_.emplace(id, Pending{std::move(p), std::move(leases)});
    }
    // A frame the daemon would refuse from its header (over max_frame_bytes) would make it
    // close the connection: refuse it here and keep the connection.
    const uint64_t frame_bytes = uint64_t{wire::kHeaderBytes} + body.size();
    const uint64_t limit = std::min<uint64_t>(
        hello_.max_frame_bytes != 0 ? hello_.max_frame_bytes : options_.max_frame_bytes,
        uint64_t{UINT32_MAX});
    if (frame_bytes > limit) {
      Abandon(id,
              Status::InvalidArgument("request frame of " + std::to_string(frame_bytes) +
                                      " bytes exceeds max_frame_bytes " + std::to_string(limit)));
      return fut;
    }
    auto h =
        wire::EncodeHeader(static_cast<uint8_t>(op), flags, id, static_cast<uint32_t>(body.size()));
    Status st;
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      size_t sent = 0, body_sent = 0;
      st = SendAll(fd_, h, &sent);
      if (st.ok()) st = SendAll(fd_, body, &body_sent);
      // A partly sent frame loses framing for every later request: fail the connection (the
      // reader then fails everything pending) rather than send the next header mid-body.
      if (!st.ok() && sent + body_sent > 0) ::shutdown(fd_, SHUT_RDWR);
    }
    if (!st.ok()) Abandon(id, st);
    return fut;
  }

  void Abandon(uint64_t id, const Status& st) {
    std::promise<StatusOr<Frame>> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;
      p = std::move(it->second.reply);
      pending_.erase(it);  // never sent: its ranges are free again
    }
    p.set_value(st);
  }

  StatusOr<Frame> Wait(std::future<StatusOr<Frame>>& fut) {
    if (fut.wait_for(std::chrono::milliseconds(options_.timeout_ms)) != std::future_status::ready) {
      return Status::IOError("timed out waiting for kvtierd");
    }
    return fut.get();
  }

  // Sends one call and checks the response status; parse(r) reads the payload.
  Status Simple(Opcode op, std::span<const uint8_t> body,
                const std::function<Status(wire::Reader*)>& parse, uint16_t flags = 0) {
    auto fut = Call(op, flags, body);
    KVTIER_ASSIGN_OR_RETURN(Frame f, Wait(fut));
    wire::Reader r(f.body);
    Status st;
    KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r, &st));
    KVTIER_RETURN_IF_ERROR(st);
    return parse ? parse(&r) : Status::Ok();
  }

  StatusOr<std::string> TextCall(Opcode op, std::span<const uint8_t> body) {
    std::string text;
    KVTIER_RETURN_IF_ERROR(Simple(op, body, [&](wire::Reader* r) -> Status {
      KVTIER_ASSIGN_OR_RETURN(text, wire::DecodeText(r, options_.max_frame_bytes));
      return Status::Ok();
    }));
    return text;
  }

  StatusOr<LookupResult> DoLookup(const std::vector<wire::Key>& keys, uint64_t turn) {
    LookupResult out;
    for (size_t base = 0; base < keys.size() || base == 0; base += BatchLimit()) {
      size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
      wire::LookupReply reply;
      std::vector<uint8_t> body =
          wire::EncodeKeys(std::span<const wire::Key>(keys).subspan(base, n));
      const uint16_t flags = WithTurn(turn, 0, &body);
      KVTIER_RETURN_IF_ERROR(Simple(
          Opcode::kLookup, body,
          [&](wire::Reader* r) -> Status {
            KVTIER_ASSIGN_OR_RETURN(reply, wire::DecodeLookupReply(r));
            return Status::Ok();
          },
          flags));
      out.hit_count += reply.hit_count;
      out.tiers.insert(out.tiers.end(), reply.tiers.begin(), reply.tiers.end());
      out.first_miss = reply.first_miss;
      if (reply.hit_count < n || keys.empty()) break;
    }
    return out;
  }

  StatusOr<std::future<StatusOr<Frame>>> SendPut(std::span<const PutUnit> units,
                                                 const PutOptions& o,
                                                 std::vector<std::shared_ptr<ShmLease>>* leases) {
    wire::PutRequest req;
    req.kind = o.kind;
    req.highest_tier = o.highest_tier;
    req.allow_ssd = o.allow_ssd ? 1 : 0;
    req.recompute_tokens = o.recompute_tokens;
    req.ttl_ms = o.ttl_ms;
    req.units.resize(units.size());
    uint64_t total = 0;
    for (size_t i = 0; i < units.size(); ++i) {
      req.units[i].key = units[i].key;
      req.units[i].parent = units[i].parent;
      req.units[i].value = units[i].value;
      req.units[i].value_bytes = static_cast<uint32_t>(units[i].value.size());
      if (!InShm(units[i].value)) total += units[i].value.size();
    }
    bool shm = false;
    std::shared_ptr<ShmLease> lease;
    if (shm_ != nullptr) {
      std::optional<uint64_t> off = total > 0 ? alloc_.Alloc(total) : std::optional<uint64_t>(0);
      if (off) {
        shm = true;
        if (total > 0) {
          lease = std::make_shared<ShmLease>(&alloc_, *off, total);
          leases->push_back(lease);
        }
        uint64_t cursor = *off;
        for (size_t i = 0; i < units.size(); ++i) {
          std::span<const uint8_t> v = units[i].value;
          if (InShm(v)) {
            req.units[i].value_offset = static_cast<uint64_t>(v.data() - shm_);  // zero copy
          } else {
            std::memcpy(shm_ + cursor, v.data(), v.size());
            req.units[i].value_offset = cursor;
            cursor += v.size();
          }
        }
      }
    }
    std::vector<uint8_t> body = wire::EncodePut(req, shm);
    const uint16_t flags = WithTurn(o.turn, shm ? wire::kFlagShm : 0, &body);
    std::vector<std::shared_ptr<ShmLease>> held;
    if (lease) held.push_back(std::move(lease));
    return Call(Opcode::kPut, flags, body, std::move(held));
  }

  bool InShm(std::span<const uint8_t> v) const {
    return shm_ != nullptr && v.data() >= shm_ && v.data() + v.size() <= shm_ + shm_bytes_;
  }

  // Copies the part of the lease that a reply's values occupy, [lease.offset, end of the last
  // value), out of the shared-memory file into *out with one pread (ValuesBuffer says why not
  // read in place). False (nothing copied: the caller views the values in the mapping) when
  // no value lies in the lease, the range is larger than kValuesCachedBytesMax, or the read
  // fails. Each value is still checked against the lease before it is viewed.
  bool CopyOutValues(const std::vector<wire::GetEntry>& entries, const ShmLease& lease,
                     ValuesBuffer* out) {
    uint64_t end = lease.offset;
    for (const wire::GetEntry& e : entries) {
      if (e.code != StatusCode::kOk || e.value_offset < lease.offset) continue;
      const uint64_t rel = e.value_offset - lease.offset;
      if (rel > lease.bytes || e.value_bytes > lease.bytes - rel) continue;
      end = std::max(end, e.value_offset + e.value_bytes);
    }
    const uint64_t bytes = end - lease.offset;
    if (bytes == 0 || bytes > kValuesCachedBytesMax || shm_fd_ < 0) return false;
    *out = TakeValuesBuffer(bytes);
    if (out->data == nullptr) return false;
    uint64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(shm_fd_, out->data.get() + done, bytes - done,
                                static_cast<off_t>(lease.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ReturnValuesBuffer(std::exchange(*out, ValuesBuffer{}));
        return false;
      }
      done += static_cast<uint64_t>(n);
    }
    return true;
  }

  Status GetChunk(std::span<const wire::Key> keys, size_t base, uint64_t turn,
                  const std::function<void(size_t, const GetItem&)>& visit) {
    std::shared_ptr<ShmLease> lease;
    if (shm_ != nullptr) {
      for (uint64_t cap = shm_bytes_ / 2; cap >= (64u << 10) && !lease; cap /= 2) {
        if (auto off = alloc_.Alloc(cap)) lease = std::make_shared<ShmLease>(&alloc_, *off, cap);
      }
    }
    wire::GetRequest req;
    req.keys.assign(keys.begin(), keys.end());
    bool shm = lease != nullptr;
    if (shm) {
      req.dst_offset = lease->offset;
      req.dst_capacity = lease->bytes;
    }
    std::vector<std::shared_ptr<ShmLease>> held;
    if (lease) held.push_back(lease);
    std::vector<uint8_t> body = wire::EncodeGet(req, shm);
    const uint16_t flags = WithTurn(turn, shm ? wire::kFlagShm : 0, &body);
    auto fut = Call(Opcode::kGet, flags, body, std::move(held));
    KVTIER_ASSIGN_OR_RETURN(Frame f, Wait(fut));
    wire::Reader r(f.body);
    Status st;
    KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r, &st));
    KVTIER_RETURN_IF_ERROR(st);
    KVTIER_ASSIGN_OR_RETURN(std::vector<wire::GetEntry> entries, wire::DecodeGetResponse(&r, shm));
    if (entries.size() != keys.size()) return Status::Corruption("get response count mismatch");
    // Over shared memory the values are viewed in `copied` (or, when it could not be made,
    // in the mapping); the thread keeps it for its next GET.
    ValuesBuffer copied;
    const bool copy_out = shm && CopyOutValues(entries, *lease, &copied);
    struct GiveBack {
      ValuesBuffer* b;
      ~GiveBack() { ReturnValuesBuffer(std::exchange(*b, ValuesBuffer{})); }
    } give_back{&copied};
    std::vector<wire::Key> retry;
    std::vector<size_t> retry_index;
    for (size_t i = 0; i < entries.size(); ++i) {
      const wire::GetEntry& e = entries[i];
      if (e.code == StatusCode::kRetry) {  // no room in the destination / frame: ask again
        retry.push_back(keys[i]);
        retry_index.push_back(base + i);
        continue;
      }
      GetItem item;
      item.status = e.code == StatusCode::kOk ? Status::Ok() : Status(e.code, "miss");
      item.tier = e.tier;
      if (e.code == StatusCode::kOk) {
        if (shm) {
          if (e.value_offset < lease->offset ||
              e.value_offset + e.value_bytes > lease->offset + lease->bytes) {
            return Status::Corruption("get value outside the destination area");
          }
          const uint8_t* v = copy_out ? copied.data.get() + (e.value_offset - lease->offset)
                                      : shm_ + e.value_offset;
          item.value = std::span<const uint8_t>(v, e.value_bytes);
        } else {
          item.value = e.value;
        }
      }
      visit(base + i, item);
    }
    lease.reset();
    // One key at a time, inline: each fits in a frame by itself.
    for (size_t j = 0; j < retry.size(); ++j) {
      wire::GetRequest one;
      one.keys = {retry[j]};
      std::vector<uint8_t> one_body = wire::EncodeGet(one, false);
      const uint16_t one_flags = WithTurn(turn, 0, &one_body);
      auto rf = Call(Opcode::kGet, one_flags, one_body);
      KVTIER_ASSIGN_OR_RETURN(Frame f1, Wait(rf));
      wire::Reader r1(f1.body);
      Status s1;
      KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r1, &s1));
      KVTIER_RETURN_IF_ERROR(s1);
      KVTIER_ASSIGN_OR_RETURN(std::vector<wire::GetEntry> e1, wire::DecodeGetResponse(&r1, false));
      if (e1.size() != 1) return Status::Corruption("get response count mismatch");
      GetItem item;
      item.status = e1[0].code == StatusCode::kOk ? Status::Ok() : Status(e1[0].code, "miss");
      item.tier = e1[0].tier;
      item.value = e1[0].value;
      visit(retry_index[j], item);
    }
    return Status::Ok();
  }

  ClientOptions options_;
  // TLS over TCP: owns the TCP socket and the relay thread; fd_ is its plaintext end.
  // Destroyed after the destructor's body has closed fd_ (which ends the relay).
  std::unique_ptr<TlsTunnel> tls_;
  int fd_ = -1;
  bool is_unix_ = false;
  wire::HelloResponse hello_;
  wire::FrameParser parser_;  // handshake, then the reader thread only
  std::thread reader_;
  std::mutex write_mu_;
  std::mutex mu_;
  std::map<uint64_t, Pending> pending_;  // protected by mu_
  // Auth is on and HELLO carried no token: only HELLO/AUTH would be accepted (set in Open).
  bool unauthenticated_ = false;
  Status broken_;  // protected by mu_
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> next_turn_{1};  // NewTurn's ids
  uint8_t* shm_ = nullptr;
  uint64_t shm_bytes_ = 0;
  int shm_fd_ = -1;  // the region's memfd (with shm_): GET values are read out of it
  ShmAllocator alloc_;
};

}  // namespace

std::string DefaultDataDir() {
  if (const char* x = std::getenv("XDG_STATE_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/kvtier";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return std::string(h) + "/.local/state/kvtier";
  }
  return "./kvtier-data";
}

std::string DefaultSocketPath() { return DefaultDataDir() + "/kvtierd.sock"; }

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto c = std::make_unique<ClientImpl>(options);
  KVTIER_RETURN_IF_ERROR(c->Open());
  return std::unique_ptr<Client>(std::move(c));
}

Status Client::GetCopy(std::span<const wire::Key> keys, std::vector<std::vector<uint8_t>>* values,
                       std::vector<bool>* found) {
  values->assign(keys.size(), {});
  found->assign(keys.size(), false);
  return Get(keys, [&](size_t i, const GetItem& item) {
    if (!item.status.ok()) return;
    (*found)[i] = true;
    (*values)[i].assign(item.value.begin(), item.value.end());
  });
}

}  // namespace kvtier::daemon
