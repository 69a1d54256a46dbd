# The two commands of the README contract:
#   make demo   install deps, configure, build, run the main scenario on the embedded default
#   make test   install deps, configure, build, run the default (fast) test suite
# Other targets: build, test-slow (stress/crash/long fuzz, label `slow`), bench, format, clean,
#   test-reference (the engine against the live PyTorch reference; installs python3-torch).
# PRESET selects a CMakePresets.json preset (release, debug, nohw, asan, ubsan, tsan).

PRESET ?= release
JOBS ?= $(shell nproc)
BUILD_DIR := build/$(PRESET)

.PHONY: all deps configure build test test-slow test-reference demo bench format clean

all: build

deps:
	@./deploy/install-deps.sh

configure: deps
	@cmake --preset $(PRESET) >/dev/null

build: configure
	@cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	@ctest --preset $(PRESET)

test-slow: build
	@ctest --test-dir $(BUILD_DIR) -L slow --output-on-failure

# Fresh golden vectors from reference/ (PyTorch, /usr/bin/python3) into a temporary directory,
# then the engine's golden test against them.
test-reference: build
	@./deploy/install-deps.sh --with-torch
	@sh tests/engine/reference_live.sh /usr/bin/python3 $(BUILD_DIR)/tests/engine/kvtier_engine_golden_test

demo: build
	@$(BUILD_DIR)/cli/kvtier demo

bench: build
	@$(BUILD_DIR)/bench/kvtier_bench_kernels

format:
	@git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	@rm -rf build
