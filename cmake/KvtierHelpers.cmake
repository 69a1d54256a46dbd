# The helper pair every module uses: kvtier_library() and kvtier_test().
include(GoogleTest)

# Flags shared by every kvtier target (not by third-party code).
add_library(kvtier_build_flags INTERFACE)
target_compile_options(kvtier_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-missing-field-initializers>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVTIER_WERROR}>>:-Werror>
  $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${KVTIER_WERROR}>>:-Werror=all-warnings>)
target_compile_definitions(kvtier_build_flags INTERFACE
  $<$<BOOL:${KVTIER_CUDA_ENABLED}>:KVTIER_WITH_CUDA=1>
  $<$<BOOL:${KVTIER_RDMA_ENABLED}>:KVTIER_WITH_RDMA=1>)
target_include_directories(kvtier_build_flags INTERFACE ${PROJECT_SOURCE_DIR})

# KVTIER_SANITIZE is what -fsanitize= takes: address, undefined, thread, or a comma list such as
# address,undefined,float-cast-overflow (preset asan; GCC leaves float-cast-overflow out of
# undefined, clang's fuzz preset has it). Every finding is fatal (-fno-sanitize-recover=all), so
# a test that triggers one fails instead of logging and passing.
if(KVTIER_SANITIZE)
  set(_san_flags -fsanitize=${KVTIER_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  set(_san_compile_flags ${_san_flags})
  if(KVTIER_SANITIZE MATCHES "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12 warns (-Wtsan) that std::atomic_thread_fence is not instrumented; Boost.Asio uses
    # it, so every Asio-based module (rdma, cache_daemon) failed to build under -Werror.
    list(APPEND _san_compile_flags -Wno-tsan)
  endif()
  target_compile_options(kvtier_build_flags INTERFACE
                         $<$<COMPILE_LANGUAGE:CXX>:${_san_compile_flags}>)
  target_link_options(kvtier_build_flags INTERFACE ${_san_flags})
  # Runtime defaults (stop at the first finding, TSan suppressions), compiled into executables
  # only: the generator expression is evaluated on the target that links kvtier_build_flags.
  set(KVTIER_TSAN_SUPPRESSIONS ${PROJECT_SOURCE_DIR}/tests/sanitizers/tsan.supp)
  configure_file(${PROJECT_SOURCE_DIR}/tests/sanitizers/sanitizer_defaults.cc.in
                 ${PROJECT_BINARY_DIR}/sanitizer_defaults.cc @ONLY)
  target_sources(kvtier_build_flags INTERFACE
    $<$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>:${PROJECT_BINARY_DIR}/sanitizer_defaults.cc>)
endif()

# UBSan builds (preset ubsan, asan, fuzz) say so to the tests (tests/sanitizers.h): GCC defines
# no macro for it.
if(KVTIER_SANITIZE MATCHES "undefined" OR CMAKE_CXX_FLAGS MATCHES "undefined")
  target_compile_definitions(kvtier_build_flags INTERFACE KVTIER_SANITIZE_UNDEFINED=1)
endif()

# kvtier_library(NAME SOURCES a.cc b.cc [CUDA_SOURCES k.cu] [DEPS t1 t2] [PRIVATE_DEPS t3])
# Declares library NAME (static). CUDA_SOURCES are compiled only when CUDA is enabled.
function(kvtier_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(_srcs ${ARG_SOURCES})
  if(KVTIER_CUDA_ENABLED AND ARG_CUDA_SOURCES)
    list(APPEND _srcs ${ARG_CUDA_SOURCES})
  endif()
  add_library(${name} STATIC ${_srcs})
  target_link_libraries(${name} PUBLIC kvtier_build_flags ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  if(KVTIER_CUDA_ENABLED AND ARG_CUDA_SOURCES)
    set_target_properties(${name} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
    target_link_libraries(${name} PUBLIC CUDA::cudart)
  endif()
endfunction()

# kvtier_unit_tests builds every test binary labelled unit and nothing else (no CLI, no e2e
# tests), for tests/sanitizers/run.sh, where a full build of a sanitizer preset costs most.
add_custom_target(kvtier_unit_tests)

# kvtier_test(NAME SOURCES a_test.cc [DEPS ...] [LABELS unit vectors ...] [TIMEOUT s]
#             [TEST_PREFIX p])
# Declares a GoogleTest binary and registers each test case with ctest (named p + Suite.Case
# when TEST_PREFIX is given, so that `ctest -R <module>` selects a module's tests).
# Labels: unit (default), vectors (reads ../shared/vectors), e2e (starts processes),
# slow (stress / crash / long fuzz; excluded from `make test`, run by `make test-slow`).
function(kvtier_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT;TEST_PREFIX" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  if("unit" IN_LIST ARG_LABELS)
    add_dependencies(kvtier_unit_tests ${name})
  endif()
  target_link_libraries(${name} PRIVATE kvtier_build_flags ${ARG_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  target_compile_definitions(${name} PRIVATE
    KVTIER_DEFAULT_SHARED_DIR="${KVTIER_DEFAULT_SHARED_DIR}"
    KVTIER_BINARY_DIR="${PROJECT_BINARY_DIR}")
  set(_prefix_args)
  if(ARG_TEST_PREFIX)
    set(_prefix_args TEST_PREFIX ${ARG_TEST_PREFIX})
  endif()
  gtest_discover_tests(${name} ${_prefix_args}
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()

# kvtier_fuzzer(NAME SOURCES f.cc DEPS ...): a libFuzzer target, built only with
# KVTIER_BUILD_FUZZ=ON and clang (preset `fuzz`).
function(kvtier_fuzzer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  if(NOT KVTIER_BUILD_FUZZ)
    return()
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVTIER_BUILD_FUZZ needs clang (use the `fuzz` preset)")
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(${name} PRIVATE kvtier_build_flags ${ARG_DEPS})
endfunction()
