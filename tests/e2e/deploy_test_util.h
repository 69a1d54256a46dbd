// Helpers of the tests that read the operator files in deploy/ (deploy_files_test.cc,
// k8s_manifests_test.cc).
#pragma once

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

namespace kvtier::testing {

inline const std::filesystem::path kDeployDir = std::filesystem::path(KVTIER_SOURCE_DIR) / "deploy";

// The whole file; empty when it cannot be read.
inline std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every match of `re` in `text` (its capture `group`).
inline std::set<std::string> Matches(const std::string& text, const std::regex& re, int group = 0) {
  std::set<std::string> out;
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it)
    out.insert((*it)[group].str());
  return out;
}

}  // namespace kvtier::testing
