# The two commands of the README contract:
#   make demo   install deps, configure, build, run the main scenario on the embedded default
#   make test   install deps, configure, build, run the default (fast) test suite
# Other targets: build, test-slow (stress/crash/long fuzz, label `slow`), bench, format, clean,
# test-sanitize (below; not part of `make test`).
# PRESET selects a CMakePresets.json preset (release, debug, nohw, asan, ubsan, tsan); preset
# asan is AddressSanitizer and UndefinedBehaviorSanitizer in one build, ubsan is UBSan alone.

PRESET ?= release
JOBS ?= $(shell nproc)
BUILD_DIR := build/$(PRESET)

# Sanitizer runs (README "Sanitizers"; not part of `make test`): `make test-sanitize` builds the
# presets asan (ASan+UBSan) and tsan and runs the unit, stress and crash suites on each
# (tests/sanitizers/run.sh says what each suite holds); `make test-sanitize-<preset>` runs one.
SANITIZERS ?= asan tsan

.PHONY: all deps configure build test test-slow test-sanitize demo bench format clean
.PHONY: test-sanitize-asan test-sanitize-ubsan test-sanitize-tsan

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

test-sanitize: $(addprefix test-sanitize-,$(SANITIZERS))

test-sanitize-asan test-sanitize-ubsan test-sanitize-tsan: test-sanitize-%: deps
	@JOBS=$(JOBS) tests/sanitizers/run.sh $*

demo: build
	@$(BUILD_DIR)/cli/kvtier demo

bench: build
	@$(BUILD_DIR)/bench/kvtier_bench_kernels

format:
	@git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	@rm -rf build
