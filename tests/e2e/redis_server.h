// Starts a real redis-server (Debian's package, deploy/install-deps.sh) on a loopback port for
// tests and benchmarks that compare kvtierd's RESP front with Redis. No persistence (no RDB
// snapshots, no AOF): what it holds lives only as long as the process.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "tests/cache_daemon/net_util.h"

namespace kvtier::testing {

// True when `redis-server` is on PATH.
inline bool RedisServerInstalled() {
  return ::system("command -v redis-server >/dev/null 2>&1") == 0;
}

// Starts redis-server on 127.0.0.1:port with its working directory `dir` (which must exist),
// no persistence, protected mode on, and `extra` arguments appended (e.g. {"--requirepass",
// "t"}); its stdout goes to /dev/null. Waits up to 5 s for the port to accept a connection.
// Returns the process id (the caller stops it: StopRedisServer), or -1 when it could not be
// spawned or never accepted.
inline pid_t StartRedisServer(uint16_t port, const std::string& dir,
                              const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"redis-server",
                                   "--port",
                                   std::to_string(port),
                                   "--bind",
                                   "127.0.0.1",
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--dir",
                                   dir,
                                   "--protected-mode",
                                   "yes"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  if (posix_spawnp(&pid, "redis-server", &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  for (int i = 0; i < 200 && pid > 0; ++i) {
    int fd = ConnectTcp(port);
    if (fd >= 0) {
      ::close(fd);
      return pid;
    }
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return -1;  // exited (a bad argument?)
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (pid > 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  return -1;
}

// Stops a redis-server StartRedisServer started (SIGTERM, then waits); nothing for pid <= 0.
inline void StopRedisServer(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
}

}  // namespace kvtier::testing
