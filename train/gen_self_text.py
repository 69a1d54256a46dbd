#!/usr/bin/python3
"""Writes the backbone's greedy continuations of train-text prompts, for train_dspark --self-text.

Contract:
  gen_self_text.py --engine BIN --config CFG --model W.safetensors --corpus DIR --out OUT.npy
                   [--rows N --prompt-bytes P --seq T --seed S --jobs J]
Row r: P bytes of DIR/train.txt (never val.txt) at offset default_rng((S, 13)).integers(0,
len - P, N)[r], run through `BIN generate --bos --full --ids --threads 1 --max-new T - 1 - P`
(greedy: the tokens greedy speculation verifies, as kvtier_spec_bench prompts bos + bytes).
OUT: int16 [N, T] = bos, the prompt's byte ids, the continuation's ids. Deterministic for a given
seed (the engine's greedy output does not depend on threads or jobs).
"""
import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BOS, BYTE_BASE = 0, 3
ROWS_MAX, SEQ_MAX = 1 << 16, 4096


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--prompt-bytes", type=int, default=96)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    P, T, N = args.prompt_bytes, args.seq, args.rows
    if not (0 < N <= ROWS_MAX and 0 < P and P + 2 <= T <= SEQ_MAX and 0 < args.jobs <= 16):
        ap.error("--rows 1..%d, --prompt-bytes >= 1, --seq in [P+2, %d], --jobs 1..16" % (
            ROWS_MAX, SEQ_MAX))
    text = np.fromfile(os.path.join(args.corpus, "train.txt"), dtype=np.uint8)
    if len(text) <= P:
        sys.exit("gen_self_text: %s/train.txt has %d bytes, not more than --prompt-bytes %d" % (
            args.corpus, len(text), P))
    offsets = np.random.default_rng((args.seed, 13)).integers(0, len(text) - P, size=N)
    out = np.zeros((N, T), dtype=np.int16)

    def one(r, tmp):
        prompt = text[offsets[r]:offsets[r] + P]
        pf = os.path.join(tmp, "p%d.txt" % r)
        prompt.tofile(pf)
        res = subprocess.run(
            [args.engine, "generate", "--model", args.model, "--config", args.config,
             "--prompt-file", pf, "--max-new", str(T - 1 - P), "--ids", "--bos", "--full",
             "--threads", "1"], capture_output=True)
        os.unlink(pf)
        if res.returncode != 0:
            raise RuntimeError("row %d: %s generate exited %d: %s" % (
                r, args.engine, res.returncode, res.stderr.decode("latin-1").strip()[-500:]))
        ids = [int(v) for v in res.stdout.decode("latin-1").strip().split("\n")[-1].split()]
        if len(ids) != T - 1 - P or any(not 0 <= v <= np.iinfo(np.int16).max for v in ids):
            raise RuntimeError("row %d: %d ids (expected %d) or one outside [0, %d]" % (
                r, len(ids), T - 1 - P, np.iinfo(np.int16).max))
        out[r, 0] = BOS
        out[r, 1:P + 1] = prompt.astype(np.int16) + BYTE_BASE
        out[r, P + 1:] = ids

    # The prompt files live in a directory removed however the run ends.
    with tempfile.TemporaryDirectory(prefix="gen_self_text.") as tmp, \
            ThreadPoolExecutor(args.jobs) as ex:
        try:
            for i, _ in enumerate(ex.map(lambda r: one(r, tmp), range(N))):
                if (i + 1) % 256 == 0:
                    print("gen_self_text: %d / %d rows" % (i + 1, N), flush=True)
        except RuntimeError as e:
            ex.shutdown(cancel_futures=True)  # the rows not started are not run
            sys.exit("gen_self_text: %s" % e)
    np.save(args.out, out)
    print("gen_self_text: wrote %s %s" % (args.out, out.shape))


if __name__ == "__main__":
    sys.exit(main())
