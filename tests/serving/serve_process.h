// Starts the real `kvtier-engine serve` for end-to-end tests, and a minimal HTTP client that
// understands chunked responses and server-sent events.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cache_daemon/net_util.h"
#include "tests/process_util.h"

namespace kvtier::testing {

class ServeProcess {
 public:
  explicit ServeProcess(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
  }
  ~ServeProcess() { Kill(); }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  // The limits Start() runs the server under (none by default).
  StartLimits& limits() { return limits_; }

  // Starts the server with `extra` flags and waits for its port file (false on exit/timeout).
  bool Start(const std::vector<std::string>& extra) {
    const std::string port_file = (dir_ / "serve.port").string();
    std::filesystem::remove(port_file);
    std::vector<std::string> args = {KVTIER_ENGINE_PATH, "serve",  "--port", "0",
                                     "--port-file",      port_file};
    args.insert(args.end(), extra.begin(), extra.end());
    limits_.Apply(&args);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string log = (dir_ / "serve.log").string();
    posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    int rc = Spawn(&pid_, argv.data(), &fa, /*own_process_group=*/false);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return false;
    for (int i = 0; i < 600; ++i) {
      std::ifstream in(port_file);
      if (in >> port_ && port_ != 0) return true;
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  bool Alive() {
    int st = 0;
    return pid_ > 0 && ::waitpid(pid_, &st, WNOHANG) == 0;
  }
  // SIGTERM and wait; the exit code (-1 on a signal or timeout).
  int Stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 3000; ++i) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Kill();
    return -1;
  }
  std::string Log() const {
    std::ifstream in(dir_ / "serve.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }
  // The most resident memory the server has had since it started (VmHWM of /proc/PID/status),
  // in bytes; 0 when unknown.
  uint64_t PeakRssBytes() const { return ProcessStatusBytes(pid_, "VmHWM:"); }

 private:
  std::filesystem::path dir_;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
  StartLimits limits_;
};

struct HttpReply {
  int status = 0;
  std::string headers;
  std::string body;  // de-chunked
  nlohmann::json Json() const { return nlohmann::json::parse(body, nullptr, false); }
  // The JSON payloads of "data: ..." events (a stream), "[DONE]" as the string "[DONE]".
  std::vector<nlohmann::json> Events() const {
    std::vector<nlohmann::json> out;
    std::istringstream in(body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("data: ", 0) != 0) continue;
      const std::string d = line.substr(6);
      out.push_back(d == "[DONE]" ? nlohmann::json("[DONE]")
                                  : nlohmann::json::parse(d, nullptr, false));
    }
    return out;
  }
};

// Splits a raw HTTP/1.1 response (Connection: close) into status, headers and body.
inline HttpReply ParseReply(const std::string& raw) {
  HttpReply r;
  const size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::atoi(raw.c_str() + 9);
  r.headers = raw.substr(0, end);
  std::string body = raw.substr(end + 4);
  if (r.headers.find("Transfer-Encoding: chunked") == std::string::npos) {
    r.body = body;
    return r;
  }
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t eol = body.find("\r\n", pos);
    if (eol == std::string::npos) break;
    const size_t n = std::stoul(body.substr(pos, eol - pos), nullptr, 16);
    if (n == 0) break;
    r.body += body.substr(eol + 2, n);
    pos = eol + 2 + n + 2;
  }
  return r;
}

inline HttpReply Http(uint16_t port, const std::string& method, const std::string& path,
                      const std::string& body = "", const std::string& key = "",
                      const std::string& extra_headers = "") {
  std::string headers = extra_headers;
  if (!key.empty()) headers += "Authorization: Bearer " + key + "\r\n";
  if (!body.empty()) headers += "Content-Type: application/json\r\n";
  return ParseReply(HttpRequest(port, method, path, body, headers));
}

// A greedy (temperature 0) chat completion request of the default model.
inline nlohmann::json GreedyChat(const nlohmann::json& messages, int max_tokens) {
  return {{"model", "kvmini-trained"},
          {"messages", messages},
          {"max_tokens", max_tokens},
          {"temperature", 0}};
}

// The value of one series (`name` or `name{labels}`, exactly as printed) in Prometheus text
// such as /metrics; -1 when absent.
inline double Metric(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

}  // namespace kvtier::testing
