// A device backend's profile (DeviceBackend::SetProfiling, TakeProfile): how many times each
// operation ran, what it moved or computed, and its device time, so that a pass's cost can be
// split by kernel and copy on a GPU without an external profiler.
//
// Thread safety: none (a backend is used by one thread at a time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::engine::device {

// One operation's totals: a kernel by its kName, or "copy to device", "copy to host",
// "device copy".
struct OpStat {
  std::string name;
  int64_t calls = 0;
  int64_t bytes = 0;    // copies: bytes moved; kernels: 0
  int64_t threads = 0;  // kernels: outputs computed, over all calls; copies: 0
  double seconds = 0;   // device time (on a GPU: between events around each call on the stream)
};

// Totals by name, in the order names first came (what both backends keep while profiling).
class ProfileTable {
 public:
  void Add(const char* name, int64_t bytes, int64_t threads, double seconds);
  // The totals since the last Take; the table starts anew.
  std::vector<OpStat> Take();

 private:
  std::vector<OpStat> stats_;
};

inline constexpr const char* kCopyToDevice = "copy to device";
inline constexpr const char* kCopyToHost = "copy to host";
inline constexpr const char* kDeviceCopy = "device copy";

}  // namespace kvtier::engine::device
