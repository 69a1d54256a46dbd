#!/usr/bin/python3
"""Bits per byte of a trained miniature beside `xz -9` and `zstd -19` on the same text.

Contract:
  bpb.py --config CFG --model M.safetensors [--model M2 ...] --text val.txt [--windows N --seq T]
         [--json]
Every --model is scored on the same sample, in the order given (stages side by side).
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
    ap.add_argument("--model", required=True, action="append")
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
    ids = windows(text, offsets, args.seq)
    models = []
    for path in args.model:
        t0 = time.time()
        bpb = bits_per_byte(load(path, cfg), ids, args.batch)
        models.append({"model": path, "model_bpb": bpb, "model_seconds": time.time() - t0})
    whole = text.tobytes()
    result = {
        "text": args.text, "sample_bytes": len(sample), "windows": len(offsets),
        "seq": args.seq, "models": models,
        "xz9_bpb": compressed_bpb(sample, ["xz", "-9", "-c"]),
        "zstd19_bpb": compressed_bpb(sample, ["zstd", "-19", "-c", "-q"]),
        "whole_text_bytes": len(whole),
        "whole_xz9_bpb": compressed_bpb(whole, ["xz", "-9", "-c"]),
        "whole_zstd19_bpb": compressed_bpb(whole, ["zstd", "-19", "-c", "-q"]),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("sample: %d windows x %d bytes = %d bytes of %s" % (
        len(offsets), args.seq, len(sample), args.text))
    for key, label in (("xz9_bpb", "xz -9"), ("zstd19_bpb", "zstd -19")):
        print("  %-40s %.4f bits/byte" % (label, result[key]))
    for m in models:
        print("  model %-34s %.4f bits/byte (%.1f%% fewer than xz -9, %.1f%% fewer than "
              "zstd -19; %.0f s)" % (m["model"], m["model_bpb"],
                                     100.0 * (1 - m["model_bpb"] / result["xz9_bpb"]),
                                     100.0 * (1 - m["model_bpb"] / result["zstd19_bpb"]),
                                     m["model_seconds"]))
    print("whole text (%d bytes): xz -9 %.4f, zstd -19 %.4f bits/byte" % (
        len(whole), result["whole_xz9_bpb"], result["whole_zstd19_bpb"]))
    if any(math.isnan(m["model_bpb"]) for m in models):
        sys.exit(1)


if __name__ == "__main__":
    main()
