// The fixture of the tests that run one real kvtierd: its folder, the process, and the
// daemon's log printed when a test failed.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cache_daemon/client.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::testing {

// SetUp makes dir_ = <temp>/<prefix>_<pid>_<test name> (emptied first) and d_, a kvtierd in it
// that is not started yet; TearDown prints the daemon's log if the test failed, stops the
// daemon and removes the folder. A fixture that overrides SetUp calls this one first.
class KvtierdTest : public ::testing::Test {
 protected:
  explicit KvtierdTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           (prefix_ + "_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    d_ = std::make_unique<KvtierdProcess>(dir_);
  }
  void TearDown() override {
    if (HasFailure() && d_ != nullptr) {
      std::fprintf(stderr, "---- kvtierd log ----\n%s\n", d_->Log().c_str());
    }
    d_.reset();
    std::filesystem::remove_all(dir_);
  }

  // A client of d_'s unix socket that says HELLO with `token` ("": none); nullptr, with a
  // test failure, when it cannot connect.
  std::unique_ptr<daemon::Client> ConnectUnix(const std::string& token) const {
    daemon::ClientOptions o;
    o.socket_path = d_->socket();
    o.token = token;
    auto c = daemon::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  std::filesystem::path dir_;
  std::unique_ptr<KvtierdProcess> d_;

 private:
  std::string prefix_;
};

}  // namespace kvtier::testing
