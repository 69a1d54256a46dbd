// fio (the flexible I/O tester) as the peer of storage benchmarks: `kvtier bench storage`
// (cli/cmd_bench.cc) and the resume benchmark's fetch phase (bench/resume/resume_bench.cc) run
// their fio jobs through these two functions, so both measure the device the same way.
//
//   std::string err;
//   double bps = RunFio("--name=r --rw=randread --bs=8192 --size=8M --iodepth=256" +
//                           FioDirectArgs(dir), "read", &err);
//   if (bps < 0) ...  // err says why
//
// Thread safety: reentrant (each call runs its own fio process).
#pragma once

#include <string>

namespace kvtier::cli {

// The job options every comparison with the SSD tier shares, with a leading space:
//   " --directory=DIR --ioengine=io_uring --direct=1 --numjobs=1 --group_reporting"
// (io_uring and O_DIRECT, as the SSD tier reads and writes; one job). DIR is quoted for the
// shell; fio itself treats ':' in a directory as a list separator, so DIR must not contain one.
std::string FioDirectArgs(const std::string& dir);

// Runs `fio --output-format=json ARGS` through /bin/sh (ARGS: fio options built by the
// caller; every user-given part must be quoted, as FioDirectArgs does) and returns the
// bytes/s of the first job's `side` ("read" or "write"). A negative value with *error set
// when fio cannot start, exits non-zero, or prints no JSON with that field.
double RunFio(const std::string& args, const char* side, std::string* error);

}  // namespace kvtier::cli
