// Test-only PKI for the cluster's mutual TLS: made with the OpenSSL API in a temporary
// directory at test time (nothing committed).
#pragma once

#include <filesystem>
#include <string>

#include "tests/cache_daemon/tls_test_util.h"

namespace kvtier::testing {

// ca.pem and node.pem + node.key (signed by it, serverAuth + clientAuth, names 127.0.0.1,
// ::1 and localhost): what every node of the test cluster uses. other-ca.pem and
// other-node.pem + other-node.key: the same kind of certificate under an unrelated CA (a
// peer from another cluster, which must be refused).
struct PeerPki {
  std::string ca_file, cert_file, key_file;
  std::string other_ca_file, other_cert_file, other_key_file;
};

inline bool MakePeerPki(const std::filesystem::path& dir, PeerPki* out) {
  using namespace tls_detail;
  std::filesystem::create_directories(dir);
  EVP_PKEY* keys[4] = {NewKey(), NewKey(), NewKey(), NewKey()};
  for (EVP_PKEY* k : keys) {
    if (k == nullptr) return false;
  }
  X509* ca = NewCert(keys[0], "kvtier test cluster CA", nullptr, nullptr, true, 1);
  X509* node = NewCert(keys[1], "localhost", ca, keys[0], false, 2, "serverAuth,clientAuth");
  X509* other_ca = NewCert(keys[2], "another cluster's CA", nullptr, nullptr, true, 3);
  X509* other = NewCert(keys[3], "localhost", other_ca, keys[2], false, 4, "serverAuth,clientAuth");
  *out = PeerPki{.ca_file = (dir / "ca.pem").string(),
                 .cert_file = (dir / "node.pem").string(),
                 .key_file = (dir / "node.key").string(),
                 .other_ca_file = (dir / "other-ca.pem").string(),
                 .other_cert_file = (dir / "other-node.pem").string(),
                 .other_key_file = (dir / "other-node.key").string()};
  bool ok = WriteCert(out->ca_file, ca) && WriteCert(out->cert_file, node) &&
            WriteKey(out->key_file, keys[1]) && WriteCert(out->other_ca_file, other_ca) &&
            WriteCert(out->other_cert_file, other) && WriteKey(out->other_key_file, keys[3]);
  for (X509* c : {ca, node, other_ca, other}) X509_free(c);
  for (EVP_PKEY* k : keys) EVP_PKEY_free(k);
  return ok;
}

}  // namespace kvtier::testing
