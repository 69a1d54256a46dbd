// TempDir: a fresh directory under $TMPDIR (std::filesystem::temp_directory_path()), removed
// with everything in it when the object is destroyed. Used by tests, benchmarks and the demo.
//
//   TempDir dir("kvtier-demo-");
//   if (!dir.ok()) return dir.status();
//   Use(dir.File("data"));
//
// Thread safety: a TempDir is a value owned by one thread; distinct objects are independent.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier {

class TempDir {
 public:
  // Creates <temp>/<prefix>XXXXXX (mkdtemp). On failure ok() is false, path() is empty and
  // status() says why.
  explicit TempDir(std::string_view prefix = "kvtier-") {
    std::error_code ec;
    std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    if (ec) {
      status_ = Status::IOError("no temp directory: " + ec.message());
      return;
    }
    std::string tmpl = (base / (std::string(prefix) + "XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      status_ = Status::IOError("mkdtemp " + tmpl + ": " + std::strerror(errno));
      return;
    }
    path_ = std::move(tmpl);
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const Status& status() const { return status_; }
  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string File(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
  Status status_;
};

}  // namespace kvtier
