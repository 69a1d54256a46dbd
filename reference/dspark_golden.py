"""Writes the DSpark golden vectors for the engine's test (tests/engine/golden/dspark*).

  /usr/bin/python3 -m reference.dspark_golden [--config C.json --weights W.safetensors
                                               --draft D.safetensors --out DIR]

One case: a short prompt (bos + 19 bytes; short, so the engine runs it from its own caches
without the long-context chaos that golden.py describes) through the backbone with the target
layers' streams captured; then one greedy draft pass after it with `last` = the next byte.
dspark_trained.bin (float32 little-endian) holds, in order: the streams [n, n_targets, D]
(the engine's AttnInputCapture stream_mean of every prompt position), the draft logits [K, V]
(base + Markov bias) and the confidences [K]. dspark.json: tokens, last, shapes, the drafted
tokens and each position's top-1 margin, the files' sha256.
"""
import argparse
import hashlib
import json
import os

import torch

from . import safetensors_io
from .config import Config
from .dspark import Capture, DSpark

PROMPT = b"int main(void) {\n  r"
NEXT = ord("e")
BOS, BYTE_BASE = 0, 3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="deploy/models/kvmini-trained.json")
    ap.add_argument("--weights", default="deploy/models/kvmini-trained.safetensors")
    ap.add_argument("--draft", default="deploy/models/kvmini-trained-dspark.safetensors")
    ap.add_argument("--out", default="tests/engine/golden")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = Config.from_json(args.config)
    bb = Capture(cfg)
    bb.load_engine_tensors(safetensors_io.read(args.weights)[0])
    draft = DSpark(cfg, bb)
    draft.load_engine_tensors(safetensors_io.read(args.draft)[0])
    ids = [BOS] + [b + BYTE_BASE for b in PROMPT[:19]]
    n = len(ids)
    last = NEXT + BYTE_BASE
    with torch.no_grad():
        bb.streams = {}
        bb(torch.tensor([ids]))
        streams = bb.stacked_streams()[0]  # [n, NT, D]
        mx = draft.main_x(streams)
        toks, logits, conf = draft.draft(*draft.block_inputs(mx, n, last))
    top2 = torch.topk(logits[0], 2, -1).values
    blob = b"".join(t.contiguous().float().numpy().tobytes()
                    for t in (streams, logits[0], conf[0]))
    path = os.path.join(args.out, "dspark_trained.bin")
    with open(path, "wb") as f:
        f.write(blob)
    man = {"tokens": ids, "last": last, "n_targets": streams.shape[1],
           "dim": streams.shape[2], "block_size": logits.shape[1], "vocab": logits.shape[2],
           "draft_tokens": toks[0].tolist(),
           "margins": (top2[:, 0] - top2[:, 1]).tolist(),
           "bin": "dspark_trained.bin", "sha256": hashlib.sha256(blob).hexdigest(),
           "weights_sha256": hashlib.sha256(open(args.weights, "rb").read()).hexdigest(),
           "draft_sha256": hashlib.sha256(open(args.draft, "rb").read()).hexdigest()}
    with open(os.path.join(args.out, "dspark.json"), "w") as f:
        json.dump(man, f, indent=1)
        f.write("\n")
    print("dspark_golden: wrote", path, "draft", man["draft_tokens"])


if __name__ == "__main__":
    main()
