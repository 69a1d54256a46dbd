// Which sanitizer a test is built with, for gcc and clang alike: gcc defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang 14 (Debian 12's, the fuzz preset's compiler)
// answers only __has_feature. Tests whose figures measure the allocator or the process's
// memory read these to skip or to widen an allowance, and say why where they do.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_TEST_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define KVTIER_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TEST_TSAN 1
#endif
#endif
