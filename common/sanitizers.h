// Which sanitizer this translation unit is built with, for gcc and clang alike: gcc defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang 14 (Debian 12's, the fuzz preset's compiler)
// answers only __has_feature. KVTIER_ASAN / KVTIER_TSAN / KVTIER_MSAN are defined (to 1) for
// the sanitizer in use; tests read them through tests/sanitizers.h.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define KVTIER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TSAN 1
#endif
#endif

#if defined(__has_feature)
#if __has_feature(memory_sanitizer)
#define KVTIER_MSAN 1
#endif
#endif

namespace kvtier {

// True when malloc is a sanitizer's own allocator (ASan, TSan, MSan replace glibc's): it takes
// no mallopt settings, and the process's resident memory and heaps measure it, not the program.
#if defined(KVTIER_ASAN) || defined(KVTIER_TSAN) || defined(KVTIER_MSAN)
inline constexpr bool kSanitizerAllocator = true;
#else
inline constexpr bool kSanitizerAllocator = false;
#endif

}  // namespace kvtier
