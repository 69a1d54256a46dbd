// The client's connection (client_impl.h): connect over a Unix socket, TCP or TLS, the
// HELLO and SHM_ATTACH handshake, the reader thread that completes calls, the framing of every
// call (Call, Wait); and Client::Connect, Client::GetCopy and the default paths of client.h.
#include "cache_daemon/client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "cache_daemon/client_impl.h"
#include "cache_daemon/tls_client.h"

namespace kvtier::daemon {
namespace client_internal {

Status SendAll(int fd, std::span<const uint8_t> bytes, size_t* sent_out) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (sent_out != nullptr) *sent_out = off;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  // SO_SNDTIMEO ran out
        return Status::IOError("send: timed out (kvtierd is not reading)");
      }
      return Status::IOError(std::string("send: ") + std::strerror(errno));
    }
    off += static_cast<size_t>(n);
  }
  if (sent_out != nullptr) *sent_out = off;
  return Status::Ok();
}

// Bounds fd's blocking sends (SO_SNDTIMEO, which also bounds a blocking connect) or receives
// (SO_RCVTIMEO) by `ms`; 0 lifts the bound.
static void SetSocketTimeout(int fd, int option, uint64_t ms) {
  ms = std::min<uint64_t>(ms, uint64_t{86400} * 1000);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>(ms % 1000 * 1000);
  ::setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

// The region SHM_ATTACH passed must be what the daemon says (docs/format/wire.md, "Shared
// memory"): a file of at least `granted` bytes, sealed against shrinking. Mapped at `granted`
// over a shorter file, the client's first access past the file's end (a PUT's memcpy) dies of
// SIGBUS. Corruption when it is not.
static Status CheckShmRegion(int fd, uint64_t granted) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return Status::IOError(std::string("fstat of the shared-memory region: ") +
                           std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode) || st.st_size < 0 || static_cast<uint64_t>(st.st_size) < granted) {
    return Status::Corruption("shared-memory region of " + std::to_string(st.st_size) +
                              " bytes, granted " + std::to_string(granted));
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return Status::Corruption("shared-memory region not sealed against shrinking");
  }
  return Status::Ok();
}

ClientImpl::~ClientImpl() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) ::close(fd_);
  if (shm_ != nullptr) ::munmap(shm_, shm_bytes_);
  if (shm_fd_ >= 0) ::close(shm_fd_);
}

Status ClientImpl::Open() {
  if (options_.tcp_port != 0) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    std::string port = std::to_string(options_.tcp_port);
    if (::getaddrinfo(options_.tcp_host.c_str(), port.c_str(), &hints, &res) != 0) {
      return Status::IOError("cannot resolve " + options_.tcp_host);
    }
    std::string why = "no address";
    for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      SetSocketTimeout(fd, SO_SNDTIMEO, options_.timeout_ms);  // bounds connect, then sends
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
      } else {
        why = errno == EINPROGRESS
                  ? "timed out after " + std::to_string(options_.timeout_ms) + " ms"
                  : std::strerror(errno);
        ::close(fd);
      }
    }
    ::freeaddrinfo(res);
    if (fd_ < 0) {
      return Status::IOError("cannot connect to " + options_.tcp_host + ":" + port + ": " + why);
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
      SetSocketTimeout(fd_, SO_SNDTIMEO, options_.timeout_ms);
    }
    SetSocketTimeout(fd_, SO_RCVTIMEO, options_.timeout_ms);  // the handshake's replies
  } else {
    if (options_.socket_path.empty() || options_.socket_path.size() >= 108) {
      return Status::InvalidArgument("socket path empty or too long");
    }
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return Status::IOError(std::string("socket: ") + std::strerror(errno));
    // Bounds a connect that waits for room in a full backlog, then every send; and the
    // handshake's replies (a stopped daemon's backlog still accepts).
    SetSocketTimeout(fd_, SO_SNDTIMEO, options_.timeout_ms);
    SetSocketTimeout(fd_, SO_RCVTIMEO, options_.timeout_ms);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, options_.socket_path.data(), options_.socket_path.size());
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Status::IOError("cannot connect to " + options_.socket_path + ": " +
                             (errno == EAGAIN
                                  ? "timed out after " + std::to_string(options_.timeout_ms) + " ms"
                                  : std::string(std::strerror(errno))));
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
        Frame sf, SyncCall(Opcode::kShmAttach, wire::EncodeShmAttach(options_.shm_bytes), &memfd));
    wire::Reader sr(sf.body);
    Status ss;
    KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&sr, &ss));
    // Without a usable region the connection carries values over the socket (shm_status()
    // says why).
    uint64_t granted = 0;
    if (!ss.ok()) {
      shm_status_ = ss;
    } else if (!sr.U64(&granted) || memfd < 0 || granted == 0) {
      shm_status_ = Status::Corruption("SHM_ATTACH reply without a region");
    } else {
      shm_status_ = CheckShmRegion(memfd, granted);
    }
    if (shm_status_.ok()) {
      void* p = ::mmap(nullptr, granted, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
      if (p != MAP_FAILED) {
        shm_ = static_cast<uint8_t*>(p);
        shm_bytes_ = granted;
        alloc_.Reset(granted);
        shm_fd_ = std::exchange(memfd, -1);  // kept: GET values are read out of it (pread)
      } else {
        shm_status_ = Status::IOError(std::string("mmap of the shared-memory region: ") +
                                      std::strerror(errno));
      }
    }
    if (memfd >= 0) ::close(memfd);
  }
  // The reader waits for replies without a bound (an idle connection is fine); each call's
  // wait is bounded instead (Wait).
  SetSocketTimeout(fd_, SO_RCVTIMEO, 0);
  try {
    reader_ = std::thread([this] { ReadLoop(); });
  } catch (const std::system_error& e) {  // memory or the thread limit ran out
    return Status::Unavailable(std::string("cannot start the client's reader thread: ") + e.what());
  }
  return Status::Ok();
}

Status ClientImpl::TEST_SendRaw(std::span<const uint8_t> bytes) {
  std::lock_guard<std::mutex> lock(write_mu_);
  return SendAll(fd_, bytes);
}

StatusOr<Frame> ClientImpl::SyncCall(Opcode op, const std::vector<uint8_t>& body, int* fd_out) {
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
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  // SO_RCVTIMEO ran out
      return Status::IOError("timed out after " + std::to_string(options_.timeout_ms) +
                             " ms waiting for kvtierd's handshake reply");
    }
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

void ClientImpl::ReadLoop() {
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
    if (broken_.ok()) broken_ = failure;  // a timed-out call may have said why first (Wait)
    failure = broken_;
    pending.swap(pending_);
  }
  for (auto& [id, p] : pending) p.reply.set_value(failure);
}

std::future<StatusOr<Frame>> ClientImpl::Call(Opcode op, uint16_t flags,
                                              std::span<const uint8_t> body,
                                              std::vector<std::shared_ptr<ShmLease>> leases) {
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
    Abandon(id, Status::InvalidArgument("request frame of " + std::to_string(frame_bytes) +
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
    if (!st.ok() && sent + body_sent > 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);  // the reader then fails every call with it
        if (broken_.ok()) broken_ = st;
      }
      ::shutdown(fd_, SHUT_RDWR);
    }
  }
  if (!st.ok()) Abandon(id, st);
  return fut;
}

void ClientImpl::Abandon(uint64_t id, const Status& st) {
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

StatusOr<Frame> ClientImpl::Wait(std::future<StatusOr<Frame>>& fut) {
  if (fut.wait_for(std::chrono::milliseconds(options_.timeout_ms)) != std::future_status::ready) {
    if (!options_.close_on_timeout) {
      return Status::IOError("timed out after " + std::to_string(options_.timeout_ms) +
                             " ms waiting for kvtierd");
    }
    // A daemon that has not answered in time is stalled or gone: the connection fails, so
    // that every other call waiting on it, and every later one, fails at once instead of
    // waiting out its own timeout (connection_status says why).
    const Status timed_out =
        Status::IOError("timed out after " + std::to_string(options_.timeout_ms) +
                        " ms waiting for kvtierd; connection closed");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok()) broken_ = timed_out;
    }
    ::shutdown(fd_, SHUT_RDWR);
    return timed_out;
  }
  return fut.get();
}

Status ClientImpl::connection_status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

}  // namespace client_internal

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
  auto c = std::make_unique<client_internal::ClientImpl>(options);
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
