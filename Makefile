# The two commands of the README contract:
#   make demo   install deps, configure, build, run the main scenario on the embedded default
#   make test   install deps, configure, build, run the default (fast) test suite
# Other targets: build, test-slow (stress/crash/long fuzz, label `slow`), test-container
# (podman image of kvtierd), bench, format, clean.
# PRESET selects a CMakePresets.json preset (release, debug, nohw, asan, ubsan, tsan).

PRESET ?= release
JOBS ?= $(shell nproc)
BUILD_DIR := build/$(PRESET)

.PHONY: all deps configure build test test-slow test-container demo bench format clean

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

# The container image built with podman and started (needs root, podman, runc, debootstrap;
# about 9 minutes the first time, most of it debootstrap). Not part of `make test`.
test-container: deps
	@$(MAKE) --no-print-directory build PRESET=nohw
	@tests/deploy/container_test.sh

demo: build
	@$(BUILD_DIR)/cli/kvtier demo

bench: build
	@$(BUILD_DIR)/bench/kvtier_bench_kernels

format:
	@git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	@rm -rf build
