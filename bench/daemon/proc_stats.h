// What the daemon benchmarks read about the processes they measure: a process's CPU time from
// /proc, the running kvtierd started with a given argument, and the median of their rounds.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::bench {

// Nanoseconds the process has run on a CPU, all its threads (/proc/<pid>/task/*/schedstat;
// 0 when unreadable).
uint64_t CpuNs(pid_t pid);

// The kvtierd process whose command line contains `needle` (a benchmark's daemon: its unique
// socket path), or -1.
pid_t PidWithArg(const std::string& needle);

// The median of v (the mean of the middle two for an even count; 0 for none).
double Median(std::vector<double> v);

}  // namespace kvtier::bench
