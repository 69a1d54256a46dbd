#include "cache_daemon/tls_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>

namespace kvtier::daemon {
namespace {

// After an SSL_read/SSL_write that returned r <= 0: sets *tcp_in or *tcp_out for the wait
// OpenSSL asks for; returns false when the connection is over (close_notify, TCP close, or
// a failure).
bool WaitFor(SSL* ssl, int r, bool* tcp_in, bool* tcp_out) {
  const int err = SSL_get_error(ssl, r);
  if (err == SSL_ERROR_WANT_READ) {
    *tcp_in = true;
  } else if (err == SSL_ERROR_WANT_WRITE) {
    *tcp_out = true;
  } else {
    return false;
  }
  return true;
}

// OpenSSL's most recent error as text (and clears the queue).
std::string SslError() {
  unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return std::strerror(errno);
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

bool SetNonBlocking(int fd, bool on) {
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) return false;
  return ::fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK)) == 0;
}

// A socket BIO whose writes never raise SIGPIPE (send with MSG_NOSIGNAL where OpenSSL's own
// socket BIO calls write(2)): every read and write of the handshake, the relay and a
// TlsConnection (a read may send too: an alert, a key update's answer) goes through it, so no
// call needs the signal mask blocked around it (4 system calls per call, 8 % of a cluster
// node's samples when reading peer replies over TLS). Its data is the descriptor; it does not
// close it.
int NoSigpipeWrite(BIO* b, const char* data, size_t n, size_t* written) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  ssize_t k;
  do {
    k = ::send(fd, data, n, MSG_NOSIGNAL);
  } while (k < 0 && errno == EINTR);
  if (k >= 0) {
    *written = static_cast<size_t>(k);
    return 1;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(b);
  return 0;
}

int NoSigpipeRead(BIO* b, char* out, size_t n, size_t* got) {
  BIO_clear_retry_flags(b);
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  ssize_t k;
  do {
    k = ::recv(fd, out, n, 0);
  } while (k < 0 && errno == EINTR);
  if (k > 0) {
    *got = static_cast<size_t>(k);
    return 1;
  }
  if (k == 0) {
    BIO_set_flags(b, BIO_FLAGS_IN_EOF);  // the end of the stream, as OpenSSL's socket BIO says
  } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
    BIO_set_retry_read(b);
  }
  return 0;
}

long NoSigpipeCtrl(BIO* b, int cmd, long /*num*/, void* ptr) {
  switch (cmd) {
    case BIO_C_GET_FD: {
      const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
      if (ptr != nullptr) *static_cast<int*>(ptr) = fd;
      return fd;
    }
    case BIO_CTRL_EOF:
      return BIO_test_flags(b, BIO_FLAGS_IN_EOF) != 0 ? 1 : 0;
    case BIO_CTRL_FLUSH:
      return 1;
    default:
      return 0;
  }
}

int NoSigpipeCreate(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}

// A new BIO of that kind over fd; null when OpenSSL could not make one.
BIO* NoSigpipeSocketBio(int fd) {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR,
                                 "kvtier socket (MSG_NOSIGNAL)");
    if (m == nullptr || BIO_meth_set_write_ex(m, NoSigpipeWrite) != 1 ||
        BIO_meth_set_read_ex(m, NoSigpipeRead) != 1 || BIO_meth_set_ctrl(m, NoSigpipeCtrl) != 1 ||
        BIO_meth_set_create(m, NoSigpipeCreate) != 1) {
      return static_cast<BIO_METHOD*>(nullptr);
    }
    return m;
  }();
  if (method == nullptr) return nullptr;
  BIO* b = BIO_new(method);
  if (b != nullptr) BIO_set_data(b, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  return b;
}

// The connection's BIO: ours over tcp_fd (not closing it).
bool SetSocket(SSL* ssl, int tcp_fd) {
  BIO* b = NoSigpipeSocketBio(tcp_fd);
  if (b == nullptr) return false;
  SSL_set_bio(ssl, b, b);  // takes the one reference
  return true;
}

}  // namespace

class TlsTunnel::Impl {
 public:
  ~Impl() {
    if (thread_.joinable()) {
      stop_.store(true);
      char c = 1;
      (void)!::write(wake_w_, &c, 1);
      thread_.join();
    }
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
    for (int fd : {tcp_fd_, relay_fd_, client_fd_, wake_r_, wake_w_}) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Client side: the context, the name to verify, then the handshake.
  Status Connect(const TlsClientOptions& o) {
    KVTIER_RETURN_IF_ERROR(NewContext(/*server=*/false, o.cert_file, o.key_file, o.ca_file));
    ssl_ = SSL_new(ctx_);
    if (ssl_ == nullptr || !SetSocket(ssl_, tcp_fd_)) {
      return Status::Internal("TLS: SSL_new: " + SslError());
    }
    const std::string& name = o.server_name;
    in6_addr ip{};
    bool is_ip =
        inet_pton(AF_INET, name.c_str(), &ip) == 1 || inet_pton(AF_INET6, name.c_str(), &ip) == 1;
    if (!is_ip && !name.empty()) SSL_set_tlsext_host_name(ssl_, name.c_str());
    if (o.verify_hostname) {
      if (name.empty()) return Status::InvalidArgument("TLS: no server name to verify");
      int ok = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), name.c_str())
                     : SSL_set1_host(ssl_, name.c_str());
      if (ok != 1) return Status::InvalidArgument("TLS: bad server name '" + name + "'");
    }
    return Handshake(/*server=*/false, o.handshake_timeout_ms);
  }

  // Server side: a client certificate is required and must chain to ca_file.
  Status Accept(const TlsAcceptOptions& o) {
    if (o.ca_file.empty()) return Status::InvalidArgument("TLS: a CA file is required");
    KVTIER_RETURN_IF_ERROR(NewContext(/*server=*/true, o.cert_file, o.key_file, o.ca_file));
    ssl_ = SSL_new(ctx_);
    if (ssl_ == nullptr || !SetSocket(ssl_, tcp_fd_)) {
      return Status::Internal("TLS: SSL_new: " + SslError());
    }
    return Handshake(/*server=*/true, o.handshake_timeout_ms);
  }

  // ctx_: TLS 1.2 at least; the peer's certificate is verified against ca_file ("" -> the
  // default store; a server requires one); with cert_file, ours is presented.
  Status NewContext(bool server, const std::string& cert_file, const std::string& key_file,
                    const std::string& ca_file) {
    ctx_ = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (ctx_ == nullptr) return Status::Internal("TLS: SSL_CTX_new: " + SslError());
    SSL_CTX_set_min_proto_version(ctx_, TLS1_2_VERSION);
    // No session tickets after a TLS 1.3 handshake: a context serves one connection, so none
    // could be resumed, and an idle TlsConnection must not find records waiting that are not
    // a reply (its pool checks an idle connection for unread bytes).
    if (server) SSL_CTX_set_num_tickets(ctx_, 0);
    SSL_CTX_set_verify(ctx_,
                       server ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER,
                       nullptr);
    // An encrypted key would make OpenSSL prompt on the terminal: answer with no passphrase.
    SSL_CTX_set_default_passwd_cb(ctx_, [](char*, int, int, void*) { return 0; });
    if (!ca_file.empty()) {
      if (SSL_CTX_load_verify_locations(ctx_, ca_file.c_str(), nullptr) != 1) {
        return Status::InvalidArgument("TLS: cannot load CA file " + ca_file + ": " + SslError());
      }
    } else if (SSL_CTX_set_default_verify_paths(ctx_) != 1) {
      return Status::Internal("TLS: cannot load the default trust store: " + SslError());
    }
    if (cert_file.empty() != key_file.empty()) {
      return Status::InvalidArgument("TLS: a certificate needs its key and a key its certificate");
    }
    if (!cert_file.empty()) {
      if (SSL_CTX_use_certificate_chain_file(ctx_, cert_file.c_str()) != 1) {
        return Status::InvalidArgument("TLS: " + cert_file +
                                       ": not a PEM certificate chain: " + SslError());
      }
      if (SSL_CTX_use_PrivateKey_file(ctx_, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
        return Status::InvalidArgument("TLS: " + key_file +
                                       ": not an unencrypted PEM private key: " + SslError());
      }
      if (SSL_CTX_check_private_key(ctx_) != 1) {
        return Status::InvalidArgument("TLS: " + key_file + " does not match the certificate in " +
                                       cert_file);
      }
    } else if (server) {
      return Status::InvalidArgument("TLS: a server needs a certificate and key");
    }
    return Status::Ok();
  }

  Status Handshake(bool server, uint64_t timeout_ms) {
    SSL_set_mode(ssl_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_set_read_ahead(ssl_, 1);  // fewer, larger recv calls
    if (!SetNonBlocking(tcp_fd_, true)) return Status::IOError("TLS: fcntl O_NONBLOCK");
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      ERR_clear_error();
      int r = server ? SSL_accept(ssl_) : SSL_connect(ssl_);
      if (r == 1) break;
      int err = SSL_get_error(ssl_, r);
      short events = err == SSL_ERROR_WANT_READ    ? POLLIN
                     : err == SSL_ERROR_WANT_WRITE ? POLLOUT
                                                   : 0;
      if (events == 0) {
        long verify = SSL_get_verify_result(ssl_);
        if (verify != X509_V_OK) {
          return Status::PermissionDenied(
              std::string(server ? "TLS: the client's certificate did not verify: "
                                 : "TLS: the daemon's certificate did not verify: ") +
              X509_verify_cert_error_string(verify));
        }
        if (server && ERR_GET_REASON(ERR_peek_error()) == SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE) {
          ERR_clear_error();
          return Status::PermissionDenied("TLS: the client sent no certificate");
        }
        return Status::IOError(std::string(server ? "TLS handshake failed (does the client "
                                                    "speak TLS?): "
                                                  : "TLS handshake failed (does the port speak "
                                                    "TLS?): ") +
                               SslError());
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return Status::IOError("TLS handshake timed out");
      pollfd p{tcp_fd_, events, 0};
      int pr = ::poll(&p, 1, static_cast<int>(left.count()));
      if (pr < 0 && errno != EINTR) return Status::IOError("TLS: poll: " + SslError());
    }
    return Status::Ok();
  }

  Status StartRelay() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      return Status::IOError(std::string("TLS: socketpair: ") + std::strerror(errno));
    }
    client_fd_ = sv[0];
    relay_fd_ = sv[1];
    int wake[2];
    if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      return Status::IOError(std::string("TLS: pipe: ") + std::strerror(errno));
    }
    wake_r_ = wake[0];
    wake_w_ = wake[1];
    if (!SetNonBlocking(relay_fd_, true)) return Status::IOError("TLS: fcntl O_NONBLOCK");
    try {
      thread_ = std::thread([this] { Run(); });
    } catch (const std::system_error& e) {  // memory or the thread limit ran out
      return Status::Unavailable(std::string("TLS: cannot start the relay thread: ") + e.what());
    }
    return Status::Ok();
  }

  // The relay loop: the only code touching ssl_ after the handshake.
  void Run() {
    std::unique_ptr<uint8_t[]> up(new uint8_t[kChunkBytes]);    // client -> daemon
    std::unique_ptr<uint8_t[]> down(new uint8_t[kChunkBytes]);  // daemon -> client
    size_t up_len = 0, up_off = 0, down_len = 0, down_off = 0;
    bool plain_eof = false, tls_eof = false;
    while (!stop_.load()) {
      bool progress = false, tcp_in = false, tcp_out = false, plain_out = false;
      if (up_len == 0 && !plain_eof) {
        ssize_t n = ::recv(relay_fd_, up.get(), kChunkBytes, 0);
        if (n > 0) {
          up_len = static_cast<size_t>(n);
          up_off = 0;
          progress = true;
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          plain_eof = true;  // the client closed (or shut down) its end
        }
      }
      if (up_off < up_len) {
        ERR_clear_error();
        int r = SSL_write(ssl_, up.get() + up_off, static_cast<int>(up_len - up_off));
        if (r > 0) {
          up_off += static_cast<size_t>(r);
          if (up_off == up_len) up_off = up_len = 0;
          progress = true;
        } else if (!WaitFor(ssl_, r, &tcp_in, &tcp_out)) {
          tls_eof = true;  // the connection failed: nothing more can be sent
          up_off = up_len = 0;
        }
      }
      // One SSL_read returns at most one record (16 KiB): fill the buffer with as many as
      // are already here, so that the client's end gets one send per chunk.
      while (down_len < kChunkBytes && down_off == 0 && !tls_eof) {
        ERR_clear_error();
        int r = SSL_read(ssl_, down.get() + down_len, static_cast<int>(kChunkBytes - down_len));
        if (r > 0) {
          down_len += static_cast<size_t>(r);
          progress = true;
        } else {
          if (!WaitFor(ssl_, r, &tcp_in, &tcp_out)) tls_eof = true;  // close_notify, TCP close
          break;
        }
      }
      if (down_off < down_len) {
        ssize_t n = ::send(relay_fd_, down.get() + down_off, down_len - down_off, MSG_NOSIGNAL);
        if (n > 0) {
          down_off += static_cast<size_t>(n);
          if (down_off == down_len) down_off = down_len = 0;
          progress = true;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
          plain_out = true;
        } else {
          plain_eof = true;  // the client is gone
          down_off = down_len = 0;
        }
      }
      if (tls_eof && down_off == down_len) {
        ::shutdown(relay_fd_, SHUT_RDWR);  // the client reads end-of-stream
        break;
      }
      if (plain_eof && up_off == up_len) {
        ERR_clear_error();
        SSL_shutdown(ssl_);  // best effort close_notify; the TCP close follows
        break;
      }
      if (progress) continue;
      short tcp_events = static_cast<short>((tcp_in ? POLLIN : 0) | (tcp_out ? POLLOUT : 0));
      short plain_events =
          static_cast<short>((up_len == 0 && !plain_eof ? POLLIN : 0) | (plain_out ? POLLOUT : 0));
      // A descriptor with nothing to wait for is left out (a negative fd), so that a hang-up
      // on it cannot wake this loop again and again.
      pollfd fds[3] = {
          {tcp_events != 0 ? tcp_fd_ : -1, tcp_events, 0},
          {plain_events != 0 ? relay_fd_ : -1, plain_events, 0},
          {wake_r_, POLLIN, 0},
      };
      if (::poll(fds, 3, -1) < 0 && errno != EINTR) break;
    }
    ERR_clear_error();
  }

  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  int tcp_fd_ = -1, relay_fd_ = -1, client_fd_ = -1, wake_r_ = -1, wake_w_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TlsTunnel::TlsTunnel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TlsTunnel::~TlsTunnel() = default;

int TlsTunnel::TakeClientFd() {
  int fd = impl_->client_fd_;
  impl_->client_fd_ = -1;
  return fd;
}

StatusOr<std::unique_ptr<TlsTunnel>> TlsTunnel::Open(int tcp_fd, const TlsClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->tcp_fd_ = tcp_fd;  // closed by ~Impl on every path
  KVTIER_RETURN_IF_ERROR(impl->Connect(options));
  KVTIER_RETURN_IF_ERROR(impl->StartRelay());
  return std::unique_ptr<TlsTunnel>(new TlsTunnel(std::move(impl)));
}

TlsConnection::TlsConnection(std::unique_ptr<TlsTunnel::Impl> impl) : impl_(std::move(impl)) {}

TlsConnection::~TlsConnection() {
  ERR_clear_error();
  SSL_shutdown(impl_->ssl_);  // best effort, non-blocking: close_notify if it fits
  ERR_clear_error();
}

StatusOr<std::unique_ptr<TlsConnection>> TlsConnection::Connect(int tcp_fd,
                                                                const TlsClientOptions& options) {
  auto impl = std::make_unique<TlsTunnel::Impl>();
  impl->tcp_fd_ = tcp_fd;  // closed by ~Impl on every path
  KVTIER_RETURN_IF_ERROR(impl->Connect(options));
  return std::unique_ptr<TlsConnection>(new TlsConnection(std::move(impl)));
}

StatusOr<std::unique_ptr<TlsConnection>> TlsConnection::Accept(int tcp_fd,
                                                               const TlsAcceptOptions& options) {
  auto impl = std::make_unique<TlsTunnel::Impl>();
  impl->tcp_fd_ = tcp_fd;  // closed by ~Impl on every path
  KVTIER_RETURN_IF_ERROR(impl->Accept(options));
  return std::unique_ptr<TlsConnection>(new TlsConnection(std::move(impl)));
}

namespace {

// The result of an SSL_read or SSL_write that returned r, as TlsConnection's contract says.
ssize_t IoResult(SSL* ssl, int r, short* wait) {
  if (r > 0) return r;
  const int saved = errno;
  const int err = SSL_get_error(ssl, r);
  const bool eof = err == SSL_ERROR_SSL &&
                   ERR_GET_REASON(ERR_peek_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING;
  ERR_clear_error();
  if (eof) return 0;  // the TCP connection closed without close_notify
  switch (err) {
    case SSL_ERROR_WANT_READ:
      *wait = POLLIN;
      errno = EAGAIN;
      return -1;
    case SSL_ERROR_WANT_WRITE:
      *wait = POLLOUT;
      errno = EAGAIN;
      return -1;
    case SSL_ERROR_ZERO_RETURN:  // close_notify
      return 0;
    case SSL_ERROR_SYSCALL:  // the socket failed, or (errno 0) closed without close_notify
      if (saved == 0) return 0;
      errno = saved;
      return -1;
    default:
      errno = EPROTO;
      return -1;
  }
}

}  // namespace

ssize_t TlsConnection::Read(void* out, size_t n, short* wait) {
  ERR_clear_error();
  errno = 0;
  const int r = SSL_read(impl_->ssl_, out, static_cast<int>(std::min<size_t>(n, INT_MAX)));
  return IoResult(impl_->ssl_, r, wait);
}

ssize_t TlsConnection::Write(const void* data, size_t n, short* wait) {
  ERR_clear_error();
  errno = 0;
  const int r = SSL_write(impl_->ssl_, data, static_cast<int>(std::min<size_t>(n, INT_MAX)));
  const ssize_t k = IoResult(impl_->ssl_, r, wait);
  if (k == 0) errno = EPIPE;  // the stream has ended: nothing more can be written
  return k == 0 ? -1 : k;
}

bool TlsConnection::Buffered() const { return SSL_has_pending(impl_->ssl_) == 1; }

int TlsConnection::fd() const { return impl_->tcp_fd_; }

Status CheckTlsFiles(const TlsAcceptOptions& options, const std::string& what) {
  if (options.cert_file.empty() || options.key_file.empty() || options.ca_file.empty()) {
    return Status::InvalidArgument(what + ": a certificate, its key and a CA file are required");
  }
  TlsTunnel::Impl probe;  // a context only: no connection
  Status s =
      probe.NewContext(/*server=*/true, options.cert_file, options.key_file, options.ca_file);
  return s.ok() ? s : Status::InvalidArgument(what + ": " + s.message());
}

}  // namespace kvtier::daemon
