#include "bench/daemon/proc_stats.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace kvtier::bench {

uint64_t CpuNs(pid_t pid) {
  uint64_t total = 0;
  std::error_code ec;
  const std::filesystem::path dir = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::ifstream f(e.path() / "schedstat");
    uint64_t ns = 0;
    if (f >> ns) total += ns;
  }
  return total;
}

pid_t PidWithArg(const std::string& needle) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::ifstream f(e.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find("kvtierd") != std::string::npos && cmdline.find(needle) != std::string::npos)
      return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace kvtier::bench
