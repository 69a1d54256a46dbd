// Test helpers about processes: starting one (in a process group of its own when asked), a
// resource limit to start the real binaries under, the CPU time and memory a process has used,
// and a server in this process starved of file descriptors.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/open_files.h"

extern char** environ;

namespace kvtier::testing {

// posix_spawn of argv (argv[0] the program's path, null-terminated) with the file actions fa.
// own_process_group puts the child in a process group of its own, which a test that stops it
// with SIGSTOP needs: when the shell that started the suite exits (a suite run in the
// background), the kernel hangs up a process group left without a parent outside it that
// holds a stopped process (SIGHUP, then SIGCONT), which would continue the child mid-test. The
// price: a terminal's Ctrl-C no longer reaches it. Returns posix_spawn's result.
inline int Spawn(pid_t* pid, char* const argv[], const posix_spawn_file_actions_t* fa,
                 bool own_process_group) {
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (own_process_group) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  const int rc = posix_spawn(pid, argv[0], fa, &attr, argv, environ);
  posix_spawnattr_destroy(&attr);
  return rc;
}

// Resource limits to start a program under, soft and hard alike (so it cannot raise them),
// through prlimit(1), which sets them and execs the program: the spawned pid is the program's.
struct StartLimits {
  uint64_t open_files_max = 0;           // RLIMIT_NOFILE; 0: unchanged
  uint64_t address_space_bytes_max = 0;  // RLIMIT_AS; 0: unchanged

  // Prefixes `args` (a command line) with the prlimit call, when a limit is set.
  void Apply(std::vector<std::string>* args) const {
    std::vector<std::string> prefix = {"/usr/bin/prlimit"};
    auto both = [](uint64_t v) { return std::to_string(v) + ":" + std::to_string(v); };
    if (open_files_max > 0) prefix.push_back("--nofile=" + both(open_files_max));
    if (address_space_bytes_max > 0) prefix.push_back("--as=" + both(address_space_bytes_max));
    if (prefix.size() > 1) args->insert(args->begin(), prefix.begin(), prefix.end());
  }
};

// A field of /proc/PID/status given in kB ("VmRSS:", "VmHWM:": field includes its colon), in
// bytes; 0 when unknown.
inline uint64_t ProcessStatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoull(line.substr(field.size())) * 1024;
  }
  return 0;
}

// Virtual memory size of process `pid` (VmSize of /proc/PID/status) in bytes; 0 when unknown.
inline uint64_t VmSizeBytes(pid_t pid) { return ProcessStatusBytes(pid, "VmSize:"); }

// The fields of /proc/PID/stat after the command name: fields[0] is field 3 (the state) of
// proc(5), fields[i] field i + 3. Empty when unknown.
inline std::vector<std::string> ProcessStatFields(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 > stat.size()) return {};
  std::istringstream in_fields(stat.substr(paren + 2));
  std::vector<std::string> fields;
  for (std::string f; in_fields >> f;) fields.push_back(f);
  return fields;
}

// CPU time (user + system) process `pid` has used, in seconds; -1 when unknown.
inline double ProcessCpuSeconds(pid_t pid) {
  const std::vector<std::string> f = ProcessStatFields(pid);
  if (f.size() < 13) return -1;
  const uint64_t utime = std::stoull(f[11]), stime = std::stoull(f[12]);  // fields 14 and 15
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Minor page faults process `pid` has taken so far (all its threads); -1 when unknown.
inline int64_t ProcessMinorFaults(pid_t pid) {
  const std::vector<std::string> f = ProcessStatFields(pid);
  return f.size() < 8 ? -1 : std::stoll(f[7]);  // minflt: field 10
}

// SIGSTOPs process `pid` and waits (up to timeout_ms) until every one of its threads is
// stopped. kill() returns before that: the kernel wakes one thread to begin the group stop, and
// until it has run the others go on (on a busy machine long enough to answer a request), so a
// test that needs the process silent must wait. True once every thread is stopped.
inline bool StopProcess(pid_t pid, int timeout_ms) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  for (int waited_ms = 0; waited_ms <= timeout_ms; ++waited_ms) {
    bool all = true;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream in(e.path() / "stat");
      const std::string stat((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      const size_t paren = stat.rfind(')');  // field 3, the state, follows the command name
      if (paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'T') {
        all = false;
        break;
      }
    }
    if (!ec && all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// CPU time (user + system) this process has used, in seconds; opens no file (so it works
// while the process has no descriptor left).
inline double SelfCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  return seconds(u.ru_utime) + seconds(u.ru_stime);
}

// CPU seconds process `pid` (ProcessCpuSeconds) or this process (SelfCpuSeconds) uses while
// the calling thread sleeps for `period`.
inline double ProcessCpuSecondsOver(pid_t pid, std::chrono::milliseconds period) {
  const double before = ProcessCpuSeconds(pid);
  std::this_thread::sleep_for(period);
  return ProcessCpuSeconds(pid) - before;
}
inline double SelfCpuSecondsOver(std::chrono::milliseconds period) {
  const double before = SelfCpuSeconds();
  std::this_thread::sleep_for(period);
  return SelfCpuSeconds() - before;
}

// Reads `read()` every 20 ms until it returns `want` or `timeout_ms` passed; returns the last
// value read.
template <typename Read>
auto PollUntilEqual(Read read, decltype(read()) want, int timeout_ms) {
  auto value = read();
  for (int waited_ms = 0; value != want && waited_ms < timeout_ms; waited_ms += 20) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    value = read();
  }
  return value;
}

// Clients of a server in this process, connected while the process has room for only
// `accepts_room` more descriptors, so that the rest wait in the server's listen backlog with
// every accept failing (EMFILE). The sockets are made before the soft open-file limit is
// lowered: connecting needs no new descriptor, accepting does. The limit is put back by
// RestoreLimit() or the destructor; the destructor closes the clients. Nothing in this process
// may open a file meanwhile (so the CPU time is measured with SelfCpuSeconds()).
class DescriptorStarvedClients {
 public:
  DescriptorStarvedClients(uint16_t port, int clients, int accepts_room) {
    for (int i = 0; i < clients; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        Fail("socket");
        return;
      }
      fds_.push_back(fd);
    }
    if (::getrlimit(RLIMIT_NOFILE, &saved_) != 0) {
      Fail("getrlimit");
      return;
    }
    rlimit low = saved_;
    low.rlim_cur = OpenFilesNow() + static_cast<uint64_t>(accepts_room);
    if (::setrlimit(RLIMIT_NOFILE, &low) != 0) {
      Fail("setrlimit");
      return;
    }
    lowered_ = true;
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    at.sin_port = htons(port);
    for (int fd : fds_) {
      if (::connect(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0) {
        Fail("connect");
        return;
      }
    }
  }
  ~DescriptorStarvedClients() {
    RestoreLimit();
    for (int fd : fds_) ::close(fd);
  }
  DescriptorStarvedClients(const DescriptorStarvedClients&) = delete;
  DescriptorStarvedClients& operator=(const DescriptorStarvedClients&) = delete;

  void RestoreLimit() {
    if (lowered_) ::setrlimit(RLIMIT_NOFILE, &saved_);
    lowered_ = false;
  }
  // "" when every client connected; else the call that failed and why.
  const std::string& error() const { return error_; }

 private:
  void Fail(const char* what) {
    error_ = std::string(what) + ": " + std::strerror(errno);
    RestoreLimit();
  }
  std::vector<int> fds_;
  rlimit saved_{};
  bool lowered_ = false;
  std::string error_;
};

}  // namespace kvtier::testing
