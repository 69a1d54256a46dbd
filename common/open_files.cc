#include "common/open_files.h"

#include <dirent.h>
#include <sys/resource.h>

#include "common/logging.h"

namespace kvtier {

namespace {
uint64_t Limit(rlim_t v) { return v == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(v); }
}  // namespace

OpenFilesLimit RaiseOpenFilesLimit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return {};
  if (r.rlim_cur != r.rlim_max) {
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  return {Limit(r.rlim_cur), Limit(r.rlim_max)};
}

uint64_t OpenFilesNow() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  uint64_t n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n > 0 ? n - 1 : 0;  // not the directory's own descriptor
}

bool WarnIfOpenFilesShort(const OpenFilesLimit& limit, uint64_t connection_fds,
                          std::string_view metric, std::string_view remedy) {
  const uint64_t open_now = OpenFilesNow();
  if (limit.soft >= open_now + connection_fds) return false;
  KVTIER_LOG(kWarn) << "the open-file limit (" << limit.soft << ", hard " << limit.hard
                    << ") is below the " << open_now << " descriptors open now plus the "
                    << connection_fds << " that the connections the limits allow may hold: at "
                    << "the limit the fronts pause accepting (" << metric
                    << "); raise the limit (LimitNOFILE=, ulimit -n) or " << remedy;
  return true;
}

}  // namespace kvtier
