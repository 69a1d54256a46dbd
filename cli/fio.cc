#include "cli/fio.h"

#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>

namespace kvtier::cli {

std::string FioDirectArgs(const std::string& dir) {
  std::string quoted = "'";  // single quotes: only ' itself needs escaping
  for (char c : dir) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  return " --directory=" + quoted + " --ioengine=io_uring --direct=1 --numjobs=1 --group_reporting";
}

double RunFio(const std::string& args, const char* side, std::string* error) {
  std::string cmd = "fio --output-format=json " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *error = "cannot start fio";
    return -1;
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int rc = ::pclose(p);
  size_t start = out.find('{');
  if (rc != 0 || start == std::string::npos) {
    *error = "fio failed: " + out.substr(0, 300);
    return -1;
  }
  try {
    auto j = nlohmann::json::parse(out.substr(start));
    return j.at("jobs").at(0).at(side).at("bw_bytes").get<double>();
  } catch (const std::exception& e) {
    *error = std::string("cannot parse fio output: ") + e.what();
    return -1;
  }
}

}  // namespace kvtier::cli
