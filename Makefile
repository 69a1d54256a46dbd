# The two commands of the README contract:
#   make demo   install deps, configure, build, run the main scenario on the embedded default
#   make test   install deps, configure, build, run the default (fast) test suite
# Other targets: build, test-slow (stress/crash/long fuzz, label `slow`), bench, format, clean,
#   test-reference (the engine against the live PyTorch reference; installs python3-torch),
#   test-sanitize (below; not part of `make test`), test-container (podman images of kvtierd and
#   the server),
#   gpu-pack (the GPU check's binaries, for a machine with a GPU: deploy/gpu/check.sh).
# PRESET selects a CMakePresets.json preset (release, debug, nohw, asan, ubsan, tsan); preset
# asan is AddressSanitizer and UndefinedBehaviorSanitizer in one build, ubsan is UBSan alone.

PRESET ?= release
JOBS ?= $(shell nproc)
BUILD_DIR := build/$(PRESET)

# Sanitizer runs (README "Sanitizers"; not part of `make test`): `make test-sanitize` builds the
# presets asan (ASan+UBSan) and tsan and runs the unit, stress and crash suites on each
# (tests/sanitizers/run.sh says what each suite holds); `make test-sanitize-<preset>` runs one.
SANITIZERS ?= asan tsan

.PHONY: all deps configure build test test-slow test-reference test-sanitize test-container
.PHONY: demo bench format clean test-sanitize-asan test-sanitize-ubsan test-sanitize-tsan gpu-pack

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

# Fresh golden vectors of the random init and the trained checkpoint from reference/ (PyTorch,
# /usr/bin/python3) into a temporary directory, then the engine's golden test against them.
test-reference: build
	@./deploy/install-deps.sh --with-torch
	@sh tests/engine/reference_live.sh /usr/bin/python3 $(BUILD_DIR)/tests/engine/kvtier_engine_golden_test

test-sanitize: $(addprefix test-sanitize-,$(SANITIZERS))

test-sanitize-asan test-sanitize-ubsan test-sanitize-tsan: test-sanitize-%: deps
	@JOBS=$(JOBS) tests/sanitizers/run.sh $*

# The container images (kvtierd, the server) built with podman and started side by side (needs
# root, podman, runc, debootstrap; about 9 minutes the first time, most of it debootstrap). Not
# part of `make test`.
test-container: deps
	@$(MAKE) --no-print-directory build PRESET=nohw
	@tests/deploy/container_test.sh

# The CUDA tests and GPU benchmarks packed into build/gpu-pack for a GPU machine that lacks this
# project's build dependencies; there, `deploy/gpu/check.sh` runs them (README "GPU check").
gpu-pack: build
	@deploy/gpu/pack.sh $(BUILD_DIR)

demo: build
	@$(BUILD_DIR)/cli/kvtier demo

bench: build
	@$(BUILD_DIR)/bench/kvtier_bench_kernels

format:
	@git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	@rm -rf build

# The trained miniature (docs/ENGINE.md, "Trained miniature"): corpus from Debian packages,
# stage 1 (build/train: 950 pre + 150 replay-aware post steps of 8 x 256 bytes; about an hour
# on one core), then stage 2 (build/train2: continues from stage 1's output, pinned by its
# sha256, at a lower peak learning rate on other batches (seed 1): 104 pre + 24 replay-aware
# post steps of 8 x 256 bytes; build/train2/pretrained.safetensors is the model before its
# post-training), then stage 3 (build/train3: continues from stage 2's output, pinned by its
# sha256, re-warmed to a higher peak learning rate on other batches (seed 2): 120 pre + 20
# replay-aware post steps of 16 x 256 bytes; about 45 minutes on one shared core), then stage 4
# (build/train4: continues from stage 3's output, pinned by its sha256, re-warmed to the same
# peak on other batches (seed 3): 540 pre + 60 replay-aware post steps of 16 x 256 bytes; about
# an hour on one core of a busy machine, half that on an idle one). Bits per byte of every
# stage beside xz -9 and zstd -19.
STAGE1_SHA256 := a154b0d51eb50248d06a5216cf216ce764c659a1b52ddc84ac566af8c133bd58
STAGE2_SHA256 := 4eb4d2fd7f56f9df02b87740458208ea9e51da7459464b49489af388db6c3ef4
STAGE3_SHA256 := 660fa8be83641a9c6ba2b293909165701985c100b76cd79008d56a4cd1ce1e8d
.PHONY: train
train:
	@./deploy/install-deps.sh --with-train
	@/usr/bin/python3 train/build_corpus.py --out build/corpus --compare train/corpus-manifest.json
	@nice -n 5 /usr/bin/python3 train/train.py --config deploy/models/kvmini-trained.json \
	  --corpus build/corpus --out build/train --pre-steps 950 --post-steps 150 --batch 8 \
	  --seq 256 --lr 3e-3 --lr-min 3e-4 --warmup 20 --seed 0 --threads 1 --val-every 50 \
	  --val-windows 16
	@nice -n 5 /usr/bin/python3 train/train.py --config deploy/models/kvmini-trained.json \
	  --corpus build/corpus --out build/train2 --init build/train/final.safetensors \
	  --init-sha256 $(STAGE1_SHA256) --pre-steps 104 --post-steps 24 --batch 8 --seq 256 \
	  --lr 6e-4 --lr-min 6e-5 --warmup 5 --seed 1 --threads 1 --val-every 32 --val-windows 16 \
	  --ckpt-every 4
	@nice -n 5 /usr/bin/python3 train/train.py --config deploy/models/kvmini-trained.json \
	  --corpus build/corpus --out build/train3 --init build/train2/final.safetensors \
	  --init-sha256 $(STAGE2_SHA256) --pre-steps 120 --post-steps 20 --batch 16 --seq 256 \
	  --lr 1.2e-3 --lr-min 5e-5 --warmup 8 --seed 2 --threads 1 --val-every 50 --val-windows 16 \
	  --ckpt-every 10
	@nice -n 5 /usr/bin/python3 train/train.py --config deploy/models/kvmini-trained.json \
	  --corpus build/corpus --out build/train4 --init build/train3/final.safetensors \
	  --init-sha256 $(STAGE3_SHA256) --pre-steps 540 --post-steps 60 --batch 16 --seq 256 \
	  --lr 1.2e-3 --lr-min 5e-5 --warmup 8 --seed 3 --threads 1 --val-every 100 --val-windows 16 \
	  --ckpt-every 20
	@/usr/bin/python3 train/bpb.py --config deploy/models/kvmini-trained.json \
	  --model build/train/final.safetensors --model build/train2/pretrained.safetensors \
	  --model build/train2/final.safetensors --model build/train3/pretrained.safetensors \
	  --model build/train3/final.safetensors --model build/train4/pretrained.safetensors \
	  --model build/train4/final.safetensors --text build/corpus/val.txt --windows 1024

# The DSpark draft of the trained miniature (docs/ENGINE.md, "DSpark"): stage 1 (build/dspark)
# distils the shipped backbone's own distributions on corpus text (about 20 minutes on one
# core; its output is the draft shipped until 2026-12-03, sha256 pinned below); then the
# backbone's greedy continuations of 2048 train-text prompts are generated with the engine
# (build/dspark/self-text.npy, a few minutes); stage 2 (build/dspark2) continues stage 1's draft
# with every batch taken from those continuations (what greedy speculation verifies; about 5
# minutes; its output was shipped until session 16, pinned below); 6144 more continuations
# (other prompts, seed 1: build/dspark/self-text-s1.npy, about 10 minutes) and stage 3
# (build/dspark3) continues stage 2 on all 8192 for 960 steps (about 15 minutes) with anchors
# only in the continuations and a cross entropy towards the backbone's argmax beside the KL; its
# output is the shipped draft (sha256 8e6a5948...). Copy
# build/dspark3/kvmini-trained-dspark.safetensors + .sha256 to deploy/models to ship it; the
# logs end with the validation acceptance.
DSPARK1_SHA256 := ef857df9bcd08b52a1173c9bf2ae517a9f26f491c95c158ef652b511bc3e36bc
DSPARK2_SHA256 := 4085ff4e70fdff70496deebb32140627374ef3bf806613ac502c74359be603d2
.PHONY: train-dspark
train-dspark: build
	@./deploy/install-deps.sh --with-train
	@/usr/bin/python3 train/build_corpus.py --out build/corpus --compare train/corpus-manifest.json
	@mkdir -p build/dspark build/dspark2 build/dspark3
	@nice -n 5 /usr/bin/python3 train/train_dspark.py --config deploy/models/kvmini-trained.json \
	  --backbone deploy/models/kvmini-trained.safetensors --corpus build/corpus \
	  --out build/dspark/kvmini-trained-dspark.safetensors --steps 300 --batch 8 --seq 256 \
	  --anchors 64 --lr 3e-3 --lr-min 3e-4 --warmup 20 --seed 0 --threads 1 --val-every 100 \
	  --val-windows 16
	@nice -n 5 /usr/bin/python3 train/gen_self_text.py --engine $(BUILD_DIR)/engine/kvtier-engine \
	  --config deploy/models/kvmini-trained.json --model deploy/models/kvmini-trained.safetensors \
	  --corpus build/corpus --out build/dspark/self-text.npy --rows 2048 --prompt-bytes 96 \
	  --seq 256 --seed 0 --jobs 2
	@nice -n 5 /usr/bin/python3 train/train_dspark.py --config deploy/models/kvmini-trained.json \
	  --backbone deploy/models/kvmini-trained.safetensors --corpus build/corpus \
	  --out build/dspark2/kvmini-trained-dspark.safetensors \
	  --init build/dspark/kvmini-trained-dspark.safetensors --init-sha256 $(DSPARK1_SHA256) \
	  --self-text build/dspark/self-text.npy --self-frac 1.0 --steps 240 --batch 8 --seq 256 \
	  --anchors 64 --lr 1.5e-3 --lr-min 1e-4 --warmup 10 --seed 1 --threads 1 --val-every 60 \
	  --val-windows 16
	@nice -n 5 /usr/bin/python3 train/gen_self_text.py --engine $(BUILD_DIR)/engine/kvtier-engine \
	  --config deploy/models/kvmini-trained.json --model deploy/models/kvmini-trained.safetensors \
	  --corpus build/corpus --out build/dspark/self-text-s1.npy --rows 6144 --prompt-bytes 96 \
	  --seq 256 --seed 1 --jobs 2
	@nice -n 5 /usr/bin/python3 train/train_dspark.py --config deploy/models/kvmini-trained.json \
	  --backbone deploy/models/kvmini-trained.safetensors --corpus build/corpus \
	  --out build/dspark3/kvmini-trained-dspark.safetensors \
	  --init build/dspark2/kvmini-trained-dspark.safetensors --init-sha256 $(DSPARK2_SHA256) \
	  --self-text build/dspark/self-text.npy --self-text build/dspark/self-text-s1.npy \
	  --self-frac 1.0 --anchor-min 97 --hard-weight 1.0 --steps 960 --batch 8 --seq 256 \
	  --anchors 64 --lr 1e-3 --lr-min 5e-5 --warmup 10 --seed 3 --threads 1 --val-every 240 \
	  --val-windows 16
