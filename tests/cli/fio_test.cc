// cli/fio.h: the fio runner shared by `kvtier bench storage` and bench/resume.
#include "cli/fio.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace kvtier::cli {
namespace {

// What /bin/sh makes of `s` as one command-line word list, one word per line.
std::string ShellWords(const std::string& s) {
  FILE* p = ::popen(("printf '%s\\n'" + s).c_str(), "r");
  if (p == nullptr) return "";
  std::string out;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

bool FioInstalled() { return ::system("fio --version >/dev/null 2>&1") == 0; }

TEST(FioDirectArgs, TheDirectoryReachesFioAsOneWordWhateverItHolds) {
  for (const std::string& dir :
       {std::string("/tmp/plain"), std::string("/tmp/it's here"), std::string("/tmp/$(touch x)"),
        std::string("/tmp/a;b `c` \"d\" \\e"), std::string("/tmp/''")}) {
    EXPECT_EQ(ShellWords(FioDirectArgs(dir)),
              "--directory=" + dir +
                  "\n--ioengine=io_uring\n--direct=1\n--numjobs=1\n--group_reporting\n")
        << dir;
  }
}

TEST(RunFio, AFailingJobIsANegativeResultWithTheReason) {
  std::string err;
  EXPECT_LT(RunFio("--name=x --rw=no-such-pattern --size=4k", "read", &err), 0);
  EXPECT_NE(err, "");
}

TEST(RunFio, ASmallRandomReadJobReportsItsBandwidth) {
  if (!FioInstalled()) GTEST_SKIP() << "fio is not installed (deploy/install-deps.sh)";
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvtier fio's test " + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string err;
  const double bps = RunFio(
      "--name=r --rw=randread --bs=4096 --size=65536 --iodepth=4" + FioDirectArgs(dir.string()),
      "read", &err);
  EXPECT_GT(bps, 0) << err;
  EXPECT_LT(RunFio("--name=r --rw=randread --bs=4096 --size=65536" + FioDirectArgs(dir.string()),
                   "no-such-side", &err),
            0);
  EXPECT_NE(err.find("cannot parse"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::cli
