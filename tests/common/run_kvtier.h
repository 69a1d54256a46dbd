// Runs a built binary of the project (`kvtier` by default) with a command line and returns its
// exit code and its combined stdout and stderr (for the tests that drive the CLI end to end).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace kvtier::testing {

struct KvtierResult {
  int exit_code = -1;  // -1: not started, or ended by a signal
  std::string out;
};

// `binary` is relative to the build directory, e.g. "cache_daemon/kvtierd".
inline KvtierResult RunBuilt(const std::string& binary, const std::string& args) {
  const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/" + binary + " " + args + " 2>&1";
  KvtierResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline KvtierResult RunKvtier(const std::string& args) { return RunBuilt("cli/kvtier", args); }

}  // namespace kvtier::testing
