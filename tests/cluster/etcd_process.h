// Test helper: a real single-member etcd (/usr/bin/etcd, Debian etcd-server) on free loopback
// ports in a temporary directory. It starts and stops by itself; every wait is bounded.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "cluster/http_client.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/process_util.h"

namespace kvtier::testing {

inline constexpr const char* kEtcdPath = "/usr/bin/etcd";

class EtcdProcess {
 public:
  explicit EtcdProcess(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
    client_port_ = FreePort();
    peer_port_ = FreePort();
  }
  ~EtcdProcess() { Kill(); }

  static bool Installed() { return ::access(kEtcdPath, X_OK) == 0; }

  // Starts etcd and waits (up to 20 s) until it answers a range request.
  bool Start() {
    std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    std::vector<std::string> args = {kEtcdPath,
                                     "--name=t",
                                     "--data-dir=" + (dir_ / "etcd-data").string(),
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=t=" + peer,
                                     "--log-level=warn"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    std::string log = (dir_ / "etcd.log").string();
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    int rc = Spawn(&pid_, argv.data(), &fa, own_process_group_);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      return false;
    }
    cluster::HttpLimits limits;
    limits.timeout_ms = 500;
    for (int i = 0; i < 200; ++i) {
      auto r = cluster::HttpPost({"127.0.0.1", client_port_}, "/v3/kv/range", R"({"key":"AA=="})",
                                 limits);
      if (r.ok() && r->status == 200) return true;
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Start() puts etcd in a process group of its own, as a test that pauses it needs (Spawn,
  // tests/process_util.h, says why).
  void set_own_process_group(bool on) { own_process_group_ = on; }

  // SIGSTOP (true; returns once every thread has stopped, StopProcess) or SIGCONT (false):
  // etcd takes connections but answers nothing meanwhile. Set set_own_process_group before
  // Start() when pausing it.
  void Pause(bool paused) {
    if (pid_ <= 0) return;
    if (paused) {
      StopProcess(pid_, 10000);
    } else {
      ::kill(pid_, SIGCONT);
    }
  }

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

 private:
  std::filesystem::path dir_;
  uint16_t client_port_ = 0, peer_port_ = 0;
  pid_t pid_ = -1;
  bool own_process_group_ = false;
};

// Polls pred every 20 ms until it holds or timeout_ms passes; returns its last value.
template <typename Pred>
bool WaitFor(Pred pred, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

}  // namespace kvtier::testing
