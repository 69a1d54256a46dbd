#!/bin/sh
# The engine against the live PyTorch reference: writes fresh golden vectors of the random-init
# checkpoint (f32; MXFP4 experts, and those with FP8 projections, for the short cases) and of the
# shipped trained
# checkpoint with reference/golden.py into a temporary directory, then runs the engine's golden test on them (KVTIER_GOLDEN_DIR). Usage: reference_live.sh PYTHON GOLDEN_TEST_BINARY
# Run from the repository root (make test-reference does).
set -eu
python="$1"
test_bin="$2"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-reference.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$python" -c 'import torch' || { echo "reference_live: $python has no torch (install-deps.sh --with-torch)" >&2; exit 1; }
"$python" -m reference.golden --out "$work"
"$python" -m reference.golden --out "$work" --name trained \
  --weights deploy/models/kvmini-trained.safetensors --config deploy/models/kvmini-trained.json
"$python" -m reference.golden --out "$work" --name init7fp4 --short-only \
  --config deploy/models/mini-v4.1-mxfp4.json
"$python" -m reference.golden --out "$work" --name init9q --seed 9 --short-only \
  --config deploy/models/mini-v4.1-fp8-mxfp4.json
KVTIER_GOLDEN_DIR="$work" "$test_bin"
