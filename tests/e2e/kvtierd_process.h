// Starts the real kvtierd binary on temporary sockets/ports for end-to-end tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cache_daemon/net_util.h"
#include "tests/process_util.h"

namespace kvtier::testing {

// Runs a command through /bin/sh; returns its exit status and captures stdout+stderr.
inline int RunShell(const std::string& cmd, std::string* output = nullptr) {
  std::string full = cmd + " 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  if (output) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class KvtierdProcess {
 public:
  explicit KvtierdProcess(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
    socket_ = (dir_ / "d.sock").string();
    resp_port_ = FreePort();
    http_port_ = FreePort();
  }
  ~KvtierdProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // The limits Start() runs the daemon under (none by default).
  StartLimits& limits() { return limits_; }

  // Start() puts the daemon in a process group of its own, as a test that stops it with
  // SIGSTOP needs (Spawn says why; a cluster failover test's stopped node was continued
  // mid-test). The destructor still kills it.
  void set_own_process_group(bool on) { own_process_group_ = on; }

  // Writes the config file used by Start().
  void WriteConfig(const std::string& toml) { std::ofstream(dir_ / "kvtierd.toml") << toml; }

  // Starts and waits until the Unix socket accepts connections (false on timeout/exit).
  bool Start(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {KVTIERD_PATH,
                                     "--config",
                                     (dir_ / "kvtierd.toml").string(),
                                     "--data-dir",
                                     (dir_ / "data").string(),
                                     "--socket",
                                     socket_,
                                     "--resp-port",
                                     std::to_string(resp_port_),
                                     "--http-port",
                                     std::to_string(http_port_)};
    args.insert(args.end(), extra.begin(), extra.end());
    limits_.Apply(&args);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    std::string log = (dir_ / "kvtierd.log").string();
    posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    int rc = Spawn(&pid_, argv.data(), &fa, own_process_group_);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return false;
    for (int i = 0; i < 300; ++i) {
      int fd = ConnectUnix(socket_);
      if (fd >= 0) {
        ::close(fd);
        return true;
      }
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // Sends sig and waits for exit; returns the exit code (-1 killed by a signal / timeout).
  int Stop(int sig = SIGTERM, int timeout_ms = 30000) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    return WaitExit(timeout_ms);
  }
  int WaitExit(int timeout_ms) {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    return -1;
  }
  // Sends sig to the daemon; nothing once it has exited (kill(-1) would signal every process).
  // Sends `sig`; SIGSTOP returns once every thread has stopped (StopProcess says why).
  void Signal(int sig) {
    if (pid_ <= 0) return;
    if (sig == SIGSTOP) {
      StopProcess(pid_, 10000);
    } else {
      ::kill(pid_, sig);
    }
  }

  std::string Log() const {
    std::ifstream in(dir_ / "kvtierd.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  pid_t pid() const { return pid_; }
  // True while the process has not exited (reaps it when it has).
  bool Alive() {
    if (pid_ <= 0) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      exit_status_ = st;
      pid_ = -1;
      return false;
    }
    return true;
  }
  // The raw wait status of a process Alive() found dead (WIFSIGNALED etc.).
  int exit_status() const { return exit_status_; }
  // glibc malloc heaps of threads' arenas (each arena beyond the main one has at least one):
  // mappings of /proc/PID/maps that start on a 64 MiB boundary (glibc's HEAP_MAX_SIZE on
  // 64-bit) and span exactly 64 MiB as a read-write part and the reserved rest. An anonymous
  // read-write mapping of exactly 64 MiB on such a boundary counts too: a test that counts
  // heaps gives its memory tiers other sizes.
  int MallocThreadHeaps() const {
    constexpr uint64_t kHeapBytes = 64ull << 20;
    std::ifstream in("/proc/" + std::to_string(pid_) + "/maps");
    std::string line;
    int heaps = 0;
    uint64_t open_heap = 0, open_end = 0;  // a heap's read-write part, waiting for its rest
    while (std::getline(in, line)) {
      uint64_t start = 0, end = 0;
      char perms[5] = {};
      if (std::sscanf(line.c_str(), "%lx-%lx %4s", &start, &end, perms) != 3) continue;
      const bool anonymous =
          line.find('/') == std::string::npos && line.find('[') == std::string::npos;
      if (open_heap != 0 && start == open_end && std::string(perms) == "---p" &&
          end == open_heap + kHeapBytes) {
        ++heaps;
      } else if (anonymous && std::string(perms) == "rw-p" && start % kHeapBytes == 0 &&
                 end == start + kHeapBytes) {
        ++heaps;  // a heap grown to its whole reservation
      }
      open_heap = 0;
      if (anonymous && std::string(perms) == "rw-p" && start % kHeapBytes == 0 &&
          end < start + kHeapBytes) {
        open_heap = start;
        open_end = end;
      }
    }
    return heaps;
  }
  // Resident memory of the process (VmRSS of /proc/PID/status) in bytes; 0 when unknown.
  uint64_t RssBytes() const { return ProcessStatusBytes(pid_, "VmRSS:"); }
  // The most resident memory the process has had since it started (VmHWM), in bytes; 0 when
  // unknown. Catches a peak that a sample of RssBytes() taken at the wrong moment misses.
  uint64_t PeakRssBytes() const { return ProcessStatusBytes(pid_, "VmHWM:"); }

  const std::string& socket() const { return socket_; }
  uint16_t resp_port() const { return resp_port_; }
  uint16_t http_port() const { return http_port_; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::string socket_;
  uint16_t resp_port_ = 0, http_port_ = 0;
  pid_t pid_ = -1;
  int exit_status_ = 0;
  StartLimits limits_;
  bool own_process_group_ = false;
};

}  // namespace kvtier::testing
