#include "cache_daemon/server_secret.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include "cache_daemon/tenants.h"

namespace kvtier::daemon {
namespace {

// The fingerprint file is 64 hex characters and a newline; anything longer is not ours.
constexpr size_t kFingerprintFileBytesMax = 128;

std::string Errno() { return std::strerror(errno); }

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("cannot open directory " + dir + ": " + Errno());
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Status::IOError("fsync " + dir + ": " + Errno());
  return Status::Ok();
}

// nullopt when the file does not exist.
StatusOr<std::optional<Digest>> ReadFingerprint(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<Digest>();
    return Status::IOError("cannot open " + path + ": " + Errno());
  }
  char buf[kFingerprintFileBytesMax + 1];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n < 0) return Status::IOError("cannot read " + path + ": " + Errno());
  std::string_view text(buf, static_cast<size_t>(n));
  if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  StatusOr<Digest> d = DigestFromHex(text);
  if (static_cast<size_t>(n) > kFingerprintFileBytesMax || !d.ok()) {
    return Status::Corruption(path +
                              " is not a kvtier secret fingerprint (64 hex characters); it "
                              "records which server secret this data directory belongs to");
  }
  return std::optional<Digest>(*d);
}

Status WriteFingerprint(const std::string& dir, const std::string& path, const Digest& fp) {
  std::string tmp = path + ".tmp";
  std::string text = ToHex(fp) + "\n";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError("cannot create " + tmp + ": " + Errno());
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
            ::fsync(fd) == 0;
  ok = (::close(fd) == 0) && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = Errno();
    ::unlink(tmp.c_str());
    return Status::IOError("cannot write " + path + ": " + why);
  }
  return FsyncDir(dir);
}

bool HoldsData(const std::string& store_dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(store_dir, ec);
  return !ec && it != std::filesystem::directory_iterator();
}

}  // namespace

Digest SecretFingerprint(std::span<const uint8_t> secret) {
  Digest mac = TenantSalt(secret, "kvtier-secret-fingerprint");  // HMAC-SHA256(secret, msg)
  return Sha256(mac);
}

StatusOr<std::vector<uint8_t>> OpenServerSecret(const ServerSecretPaths& paths) {
  const std::string fp_path = paths.data_dir + "/" + kSecretFingerprintFile;
  KVTIER_ASSIGN_OR_RETURN(std::optional<Digest> recorded, ReadFingerprint(fp_path));
  struct stat st {};
  if (::stat(paths.secret_file.c_str(), &st) != 0) {
    if (errno != ENOENT) {
      return Status::IOError("cannot stat server secret " + paths.secret_file + ": " + Errno());
    }
    if (recorded.has_value() || HoldsData(paths.store_dir)) {
      return Status::NotFound(
          "server secret " + paths.secret_file + " is missing, but " + paths.data_dir +
          " already holds data stored under a secret (" +
          (recorded.has_value() ? fp_path + " exists" : paths.store_dir + " is not empty") +
          "): a new secret would orphan every stored unit. Restore the secret file ([auth] "
          "server_secret_file), or move the data directory away to start empty");
    }
  }
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> secret, LoadOrCreateServerSecret(paths.secret_file));
  Digest fp = SecretFingerprint(secret);
  if (!recorded.has_value()) {
    KVTIER_RETURN_IF_ERROR(WriteFingerprint(paths.data_dir, fp_path, fp));
    return secret;
  }
  if (CRYPTO_memcmp(recorded->data(), fp.data(), fp.size()) != 0) {
    return Status::PermissionDenied(
        "server secret " + paths.secret_file +
        " is not the secret this data directory was "
        "written with (its fingerprint differs from " +
        fp_path +
        "): every stored unit is bound to the original secret. Restore the original secret "
        "file, or move the data directory away to start empty");
  }
  return secret;
}

}  // namespace kvtier::daemon
