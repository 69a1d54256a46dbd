#include "cache_daemon/resp_name_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "common/checksum.h"
#include "common/endian.h"

namespace kvtier::daemon {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'R', 'N', 'A', 'M', 'E'};
constexpr size_t kFixedBytes = 48;         // op .. key; then the name, then the checksum
constexpr uint32_t kCheckpointBytes = 12;  // a checkpoint's "name": u32 segment, u64 offset

Status Errno(const std::string& what, const std::string& path) {
  return Status::IOError(what + " " + path + ": " + std::strerror(errno));
}

Status WriteAll(int fd, const void* data, size_t size, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("write", path);
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Reads exactly size bytes at offset; false at end of file or on an error.
bool ReadAll(int fd, void* data, size_t size, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

void EncodeHeader(uint8_t* h) {
  std::memcpy(h, kMagic, sizeof(kMagic));
  le::Put32(h + 8, RespNameLog::kVersion);
  le::Put32(h + 12, 0);
}

Status SyncDirOf(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory", dir);
  int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? Status::Ok() : Errno("fsync directory", dir);
}

}  // namespace

void RespNameLog::Encode(const Record& r, std::string* out) {
  const bool checkpoint = r.op == Op::kCheckpoint;
  const size_t n = checkpoint ? kCheckpointBytes : r.name.size();
  out->resize(kFixedBytes + n + 8);
  auto* p = reinterpret_cast<uint8_t*>(out->data());
  std::memset(p, 0, kFixedBytes);
  p[0] = static_cast<uint8_t>(r.op);
  le::Put32(p + 4, static_cast<uint32_t>(n));
  if (checkpoint) {
    le::Put32(p + kFixedBytes, r.position.segment);
    le::Put64(p + kFixedBytes + 4, r.position.offset);
  } else {
    le::Put64(p + 8, r.tenant);
    std::memcpy(p + 16, r.key.data(), r.key.size());
    // A removal's name is empty and its data() may be null: memcpy from null is undefined even
    // for 0 bytes (UBSan, preset asan, stopped kvtierd in KvtierdCrashTest on every RESP DEL).
    if (!r.name.empty()) std::memcpy(p + kFixedBytes, r.name.data(), r.name.size());
  }
  le::Put64(p + kFixedBytes + n, Xxh3_64(p, kFixedBytes + n));
}

StatusOr<std::unique_ptr<RespNameLog>> RespNameLog::Open(
    const std::string& path, uint64_t name_bytes_max,
    const std::function<void(const Record&)>& replay) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", path);
  std::unique_ptr<RespNameLog> log(new RespNameLog(path, fd));
  uint8_t header[kHeaderBytes];
  off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < 0) return Errno("seek", path);
  if (size == 0) {
    EncodeHeader(header);
    KVTIER_RETURN_IF_ERROR(WriteAll(fd, header, sizeof(header), 0, path));
    if (::fdatasync(fd) != 0) return Errno("fdatasync", path);
    KVTIER_RETURN_IF_ERROR(SyncDirOf(path));
    log->file_bytes_ = kHeaderBytes;
    return log;
  }
  const bool read = ReadAll(fd, header, sizeof(header), 0);
  const uint32_t version = read ? le::Get32(header + 8) : 0;
  if (!read || std::memcmp(header, kMagic, sizeof(kMagic)) != 0 ||
      (version != 1 && version != kVersion)) {
    return Status::Corruption(path + ": not a RESP name log of version 1 or " +
                              std::to_string(kVersion));
  }
  if (le::Get32(header + 12) != 0) {
    return Status::Corruption(path + ": RESP name log header's reserved bytes are not zero");
  }
  log->version_ = version;
  // The last op a record of this version may carry (version 1 has no checkpoints).
  const uint8_t op_max = static_cast<uint8_t>(version == 1 ? Op::kRemoveTenant : Op::kCheckpoint);
  uint64_t offset = kHeaderBytes;
  std::vector<uint8_t> rec;
  for (;;) {
    uint8_t fixed[kFixedBytes];
    if (!ReadAll(fd, fixed, sizeof(fixed), offset)) break;
    uint32_t name_bytes = le::Get32(fixed + 4);
    if (name_bytes > name_bytes_max || fixed[0] < 1 || fixed[0] > op_max) break;
    const bool checkpoint = fixed[0] == static_cast<uint8_t>(Op::kCheckpoint);
    if (checkpoint && name_bytes != kCheckpointBytes) break;
    rec.resize(kFixedBytes + name_bytes + 8);
    std::memcpy(rec.data(), fixed, sizeof(fixed));
    if (!ReadAll(fd, rec.data() + kFixedBytes, name_bytes + 8, offset + kFixedBytes)) break;
    if (le::Get64(rec.data() + kFixedBytes + name_bytes) !=
        Xxh3_64(rec.data(), kFixedBytes + name_bytes)) {
      break;
    }
    Record r{static_cast<Op>(fixed[0]),
             le::Get64(fixed + 8),
             {},
             std::string_view(reinterpret_cast<const char*>(rec.data()) + kFixedBytes, name_bytes)};
    std::memcpy(r.key.data(), fixed + 16, r.key.size());
    if (checkpoint) {
      r.name = {};
      r.position = {le::Get32(rec.data() + kFixedBytes), le::Get64(rec.data() + kFixedBytes + 4)};
    }
    replay(r);
    offset += rec.size();
  }
  log->dropped_bytes_ = static_cast<uint64_t>(size) - offset;
  if (log->dropped_bytes_ > 0 && ::ftruncate(fd, static_cast<off_t>(offset)) != 0) {
    return Errno("truncate", path);
  }
  log->file_bytes_ = offset;
  return log;
}

RespNameLog::~RespNameLog() {
  if (fd_ >= 0) {
    (void)WritePending();  // best effort: the records buffered last
    (void)::fdatasync(fd_);
    ::close(fd_);
  }
}

Status RespNameLog::Buffer(const Record& r) {
  if (r.op == Op::kCheckpoint && version_ < 2) {
    return Status::InvalidArgument(path_ + ": a version 1 name log holds no checkpoints");
  }
  Encode(r, &scratch_);
  pending_ += scratch_;
  ++pending_records_;
  return Status::Ok();
}

Status RespNameLog::WritePending() {
  if (pending_.empty()) return Status::Ok();
  Status st = WriteAll(fd_, pending_.data(), pending_.size(), file_bytes_, path_);
  if (!st.ok()) {
    // Undo a partial write, so that a later append does not follow half a record.
    if (::ftruncate(fd_, static_cast<off_t>(file_bytes_)) != 0) {
      return Errno("truncate after a failed write", path_);
    }
    return st;
  }
  file_bytes_ += pending_.size();
  pending_.clear();
  if (pending_.capacity() > kPendingKeepBytes) std::string().swap(pending_);
  pending_records_ = 0;
  return Status::Ok();
}

Status RespNameLog::Append(const Record& r) {
  const size_t before = pending_.size();
  const uint64_t before_records = pending_records_;
  KVTIER_RETURN_IF_ERROR(Buffer(r));
  Status st = WritePending();
  if (!st.ok()) {
    // r was not appended; what was buffered before it stays buffered.
    pending_.resize(before);
    pending_records_ = before_records;
  }
  return st;
}

Status RespNameLog::Sync() {
  return ::fdatasync(fd_) == 0 ? Status::Ok() : Errno("fdatasync", path_);
}

Status RespNameLog::Rewrite(
    const std::function<void(const std::function<void(const Record&)>&)>& each) {
  std::string tmp = path_ + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", tmp);
  // Written in pieces of about kRewriteChunkBytes, so the copy in memory stays small.
  constexpr size_t kRewriteChunkBytes = 1 << 20;
  std::string buf(kHeaderBytes, '\0');
  EncodeHeader(reinterpret_cast<uint8_t*>(buf.data()));
  uint64_t written = 0;
  Status st;
  std::string rec;
  each([&](const Record& r) {
    Encode(r, &rec);
    buf += rec;
    if (buf.size() >= kRewriteChunkBytes && st.ok()) {
      st = WriteAll(fd, buf.data(), buf.size(), written, tmp);
      written += buf.size();
      buf.clear();
    }
  });
  if (st.ok()) st = WriteAll(fd, buf.data(), buf.size(), written, tmp);
  written += buf.size();
  if (st.ok() && ::fdatasync(fd) != 0) st = Errno("fdatasync", tmp);
  if (st.ok() && ::rename(tmp.c_str(), path_.c_str()) != 0) st = Errno("rename", tmp);
  if (!st.ok()) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return st;
  }
  // The renamed file is the log now (opened for writing, which is all appends need).
  ::close(fd_);
  fd_ = fd;
  file_bytes_ = written;
  version_ = kVersion;
  // The rewrite replaces what was buffered too (the caller emits its current state).
  pending_.clear();
  pending_records_ = 0;
  return SyncDirOf(path_);
}

}  // namespace kvtier::daemon
