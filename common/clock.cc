#include "common/clock.h"

namespace kvtier {

const Clock& DefaultSteadyClock() {
  static const SteadyClock* clock = new SteadyClock();
  return *clock;
}

const Clock& DefaultSystemClock() {
  static const SystemClock* clock = new SystemClock();
  return *clock;
}

}  // namespace kvtier
