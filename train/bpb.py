#!/usr/bin/python3
"""Bits per byte of a trained miniature beside `xz -9` and `zstd -19` on the same text.

Contract:
  bpb.py --config CFG --model M.safetensors --text val.txt [--windows N --seq T] [--json]
The sample is N evenly spaced, non-overlapping windows of T bytes of the text (the validation
sample of train/train.py); N = 0 tiles the whole text (every full window of T bytes). The model scores every byte of every window, the first one after
bos only, so each byte has at most T-1 bytes of context; the compressors get the same windows
concatenated into one file (so they may use all of the sample as context) and are charged their
whole output, container headers included. Also prints the compressors on the whole text.
Exits 2 when xz or zstd is missing.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from train import bits_per_byte, load_bytes, tune_malloc, val_offsets, windows  # noqa: E402
from reference.config import Config  # noqa: E402
from reference.model import load  # noqa: E402


def compressed_bpb(data, argv):
    """8 * len(compressor output) / len(data)."""
    out = subprocess.run(argv, input=data, capture_output=True, check=True).stdout
    return 8.0 * len(out) / len(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for tool in ("xz", "zstd"):
        if shutil.which(tool) is None:
            print("bpb: %s not found (deploy/install-deps.sh installs it)" % tool,
                  file=sys.stderr)
            sys.exit(2)
    tune_malloc()
    torch.set_num_threads(args.threads)
    text = load_bytes(args.text)
    if args.windows > 0:
        offsets = val_offsets(len(text), args.seq, args.windows)
    else:
        offsets = list(range(0, len(text) - args.seq + 1, args.seq))
    sample = b"".join(text[o:o + args.seq].tobytes() for o in offsets)
    with open(args.config) as f:
        cfg = Config(json.load(f))
    model = load(args.model, cfg)
    t0 = time.time()
    model_bpb = bits_per_byte(model, windows(text, offsets, args.seq), args.batch)
    seconds = time.time() - t0
    whole = text.tobytes()
    result = {
        "text": args.text, "sample_bytes": len(sample), "windows": len(offsets),
        "seq": args.seq, "model": os.path.basename(args.model), "model_bpb": model_bpb,
        "xz9_bpb": compressed_bpb(sample, ["xz", "-9", "-c"]),
        "zstd19_bpb": compressed_bpb(sample, ["zstd", "-19", "-c", "-q"]),
        "whole_text_bytes": len(whole),
        "whole_xz9_bpb": compressed_bpb(whole, ["xz", "-9", "-c"]),
        "whole_zstd19_bpb": compressed_bpb(whole, ["zstd", "-19", "-c", "-q"]),
        "model_seconds": seconds,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("sample: %d windows x %d bytes = %d bytes of %s" % (
        len(offsets), args.seq, len(sample), args.text))
    print("  model %-24s %.4f bits/byte (%.0f s)" % (result["model"], model_bpb, seconds))
    for key, label in (("xz9_bpb", "xz -9"), ("zstd19_bpb", "zstd -19")):
        v = result[key]
        print("  %-30s %.4f bits/byte  (model %.1f%% fewer bits)" % (
            label, v, 100.0 * (1 - model_bpb / v)))
    print("whole text (%d bytes): xz -9 %.4f, zstd -19 %.4f bits/byte" % (
        len(whole), result["whole_xz9_bpb"], result["whole_zstd19_bpb"]))
    if math.isnan(model_bpb):
        sys.exit(1)


if __name__ == "__main__":
    main()
