// Test-only TLS helpers: a throwaway CA and server certificate made with the OpenSSL API in a
// temporary directory (never committed), and a blocking TLS client for raw RESP / HTTP.
#pragma once

#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "tests/cache_daemon/net_util.h"

namespace kvtier::testing {

// PEM files of a test PKI in dir: ca.pem (trust anchor), server.pem + server.key (signed by
// the CA, names 127.0.0.1, ::1 and localhost), other-ca.pem (an unrelated CA: verification
// against it must fail).
struct TestPki {
  std::string ca_file, cert_file, key_file, other_ca_file;
};

namespace tls_detail {

inline EVP_PKEY* NewKey() { return EVP_EC_gen("P-256"); }

inline void AddExt(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext != nullptr) {
    X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
  }
}

// A certificate for key, signed by issuer_key (issuer == nullptr: self-signed); a leaf gets
// the extended key usages eku.
inline X509* NewCert(EVP_PKEY* key, const char* cn, X509* issuer, EVP_PKEY* issuer_key, bool ca,
                     long serial, const char* eku = "serverAuth") {
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), serial);
  X509_gmtime_adj(X509_getm_notBefore(cert), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert), 86400);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn),
                             -1, -1, 0);
  X509_set_issuer_name(cert, issuer != nullptr ? X509_get_subject_name(issuer) : name);
  X509* iss = issuer != nullptr ? issuer : cert;
  if (ca) {
    AddExt(cert, iss, NID_basic_constraints, "critical,CA:TRUE");
    AddExt(cert, iss, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    AddExt(cert, iss, NID_basic_constraints, "critical,CA:FALSE");
    AddExt(cert, iss, NID_key_usage, "critical,digitalSignature");
    AddExt(cert, iss, NID_ext_key_usage, eku);
    AddExt(cert, iss, NID_subject_alt_name, "IP:127.0.0.1,IP:::1,DNS:localhost");
  }
  X509_sign(cert, issuer_key != nullptr ? issuer_key : key, EVP_sha256());
  return cert;
}

inline bool WriteCert(const std::string& path, X509* cert) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  bool ok = PEM_write_X509(f, cert) == 1;
  return std::fclose(f) == 0 && ok;
}

inline bool WriteKey(const std::string& path, EVP_PKEY* key) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  bool ok = PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr) == 1;
  return std::fclose(f) == 0 && ok;
}

}  // namespace tls_detail

// Makes the test PKI in dir (created). Returns false on any OpenSSL failure.
inline bool MakeTestPki(const std::filesystem::path& dir, TestPki* out) {
  using namespace tls_detail;
  std::filesystem::create_directories(dir);
  EVP_PKEY* ca_key = NewKey();
  EVP_PKEY* srv_key = NewKey();
  EVP_PKEY* other_key = NewKey();
  if (ca_key == nullptr || srv_key == nullptr || other_key == nullptr) return false;
  X509* ca = NewCert(ca_key, "kvtier test CA", nullptr, nullptr, true, 1);
  X509* srv = NewCert(srv_key, "localhost", ca, ca_key, false, 2);
  X509* other = NewCert(other_key, "kvtier unrelated CA", nullptr, nullptr, true, 3);
  out->ca_file = (dir / "ca.pem").string();
  out->cert_file = (dir / "server.pem").string();
  out->key_file = (dir / "server.key").string();
  out->other_ca_file = (dir / "other-ca.pem").string();
  bool ok = WriteCert(out->ca_file, ca) && WriteCert(out->cert_file, srv) &&
            WriteKey(out->key_file, srv_key) && WriteCert(out->other_ca_file, other);
  X509_free(ca);
  X509_free(srv);
  X509_free(other);
  EVP_PKEY_free(ca_key);
  EVP_PKEY_free(srv_key);
  EVP_PKEY_free(other_key);
  return ok;
}

// A blocking TLS connection to 127.0.0.1:port that verifies the server against ca_file and
// the name 127.0.0.1. Every read waits at most timeout_ms. rcvbuf_bytes > 0: the TCP
// receive buffer is that small; from_ip: the source address (both as ConnectTcp).
class TlsTestConn {
 public:
  static std::unique_ptr<TlsTestConn> Connect(uint16_t port, const std::string& ca_file,
                                              std::string* error, int timeout_ms = 5000,
                                              int rcvbuf_bytes = 0, const char* from_ip = nullptr) {
    auto c = std::unique_ptr<TlsTestConn>(new TlsTestConn());
    c->fd_ = ConnectTcp(port, rcvbuf_bytes, from_ip);
    if (c->fd_ < 0) {
      *error = "connect failed";
      return nullptr;
    }
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(c->fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    c->ctx_ = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(c->ctx_, SSL_VERIFY_PEER, nullptr);
    if (SSL_CTX_load_verify_locations(c->ctx_, ca_file.c_str(), nullptr) != 1) {
      *error = "cannot load " + ca_file;
      return nullptr;
    }
    c->ssl_ = SSL_new(c->ctx_);
    SSL_set_fd(c->ssl_, c->fd_);
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(c->ssl_), "127.0.0.1");
    if (SSL_connect(c->ssl_) != 1) {
      char buf[256];
      ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
      *error = std::string("handshake: ") + buf;
      return nullptr;
    }
    return c;
  }
  ~TlsTestConn() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
    if (fd_ >= 0) ::close(fd_);
  }
  bool Send(const std::string& bytes) {
    return SSL_write(ssl_, bytes.data(), static_cast<int>(bytes.size())) ==
           static_cast<int>(bytes.size());
  }
  // Reads until `want` bytes, end of stream or a read timeout.
  std::string Recv(size_t want) {
    std::string out;
    char buf[16384];
    while (out.size() < want) {
      int n = SSL_read(ssl_, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  // True when the server ends the connection (close_notify, EOF or reset) within timeout_ms;
  // what arrives meanwhile is read and dropped.
  bool ClosedWithin(int timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    char buf[16384];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (SSL_pending(ssl_) == 0) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 0))) <= 0) {
          if (left <= 0) return false;
          continue;
        }
      }
      int n = SSL_read(ssl_, buf, sizeof(buf));
      if (n > 0) continue;
      int e = SSL_get_error(ssl_, n);
      if (e == SSL_ERROR_WANT_READ) continue;
      if (e == SSL_ERROR_SYSCALL && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      return true;
    }
  }
  // Reads until the text contains `until` (or end of stream / timeout).
  std::string RecvUntil(const std::string& until) {
    std::string out;
    char buf[16384];
    while (out.find(until) == std::string::npos) {
      int n = SSL_read(ssl_, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  TlsTestConn() = default;
  int fd_ = -1;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
};

// One HTTP/1.1 request over TLS with Connection: close; the whole response text ("" when
// the connection failed).
inline std::string HttpsRequest(uint16_t port, const std::string& ca_file,
                                const std::string& method, const std::string& path,
                                const std::string& headers = "", const std::string& body = "") {
  std::string error;
  auto c = TlsTestConn::Connect(port, ca_file, &error);
  if (c == nullptr) return "";
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" +
                    headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  if (!c->Send(req)) return "";
  return c->Recv(1 << 24);
}

}  // namespace kvtier::testing
