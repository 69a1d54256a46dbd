"""Writes golden logits of the reference for the engine's tests (tests/engine/golden/).

  /usr/bin/python3 -m reference.golden                       # the random-init checkpoint
  /usr/bin/python3 -m reference.golden --name trained \\
      --weights deploy/models/X.safetensors --config deploy/models/X.json   # a trained one

Each run (re)writes the cases of one checkpoint, <name>_*.bin, and its entry in manifest.json
(other checkpoints' entries are kept). A random-init checkpoint is named by (config, seed): the
engine's InitWeights(config, seed) rebuilds it, so no weights are committed; a file checkpoint
is named by its path and sha256.

Cases, for each prompt (two lengths, one odd and one even, both over 512 positions so that the
candidate pool restricts the Reindex layers; tokens from numpy default_rng(prompt seed)):
  full     Forward(prompt[:split], all logits) then Decode of each remaining token: rows 0..T-1
  ced      PrefillCed(prompt[:split]) then Decode of the rest: rows split-1..T-1
  replay   Forward(prompt[:split]); ReplayTail (bounded replay from split - min(W, split));
           then Decode of the rest: rows split-1..T-1
The .bin file holds float32 little-endian logits of the listed rows (row-major, vocab each);
the manifest holds the tokens, the rows, the argmax of every computed row and the top-1 margin
(logit gap to the runner-up) of every computed row, and the .bin's sha256.
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np
import torch

from .config import Config
from .model import MiniV41, load

PROMPTS = [(600, 11), (577, 12)]  # (length, token seed)
DECODE_TAIL = 3  # tokens decoded one at a time after the prompt split


def stored_rows(T, first):
    rows = {0, 1, 15, 16, 17, 255, 256, 300, 511, 512, 513, 540, T - 5, T - 4, T - 3, T - 2,
            T - 1}
    return sorted(r for r in rows if first <= r < T)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="deploy/models/mini-v4.1.json")
    ap.add_argument("--seed", type=int, default=7, help="engine init seed (without --weights)")
    ap.add_argument("--weights", help="a safetensors checkpoint instead of the random init")
    ap.add_argument("--name", default="init7")
    ap.add_argument("--out", default="tests/engine/golden")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = Config.from_json(a.config)
    if a.weights:
        model = load(a.weights, cfg)
        ckpt = {"config": a.config, "weights": a.weights, "weights_sha256": sha256_file(a.weights)}
    else:
        model = MiniV41.engine_init(cfg, a.seed)
        ckpt = {"config": a.config, "init_seed": a.seed}
    model.eval()
    os.makedirs(a.out, exist_ok=True)
    man_path = os.path.join(a.out, "manifest.json")
    manifest = {"format": 1, "checkpoints": {}, "cases": []}
    if os.path.exists(man_path):
        with open(man_path) as f:
            manifest = json.load(f)
    manifest["checkpoints"][a.name] = ckpt
    manifest["cases"] = [c for c in manifest["cases"] if c["checkpoint"] != a.name]
    for T, tseed in PROMPTS:
        tokens = np.random.default_rng(tseed).integers(0, cfg.vocab_size, T).astype(np.int64)
        ids = torch.from_numpy(tokens).view(1, T)
        split = T - DECODE_TAIL
        with torch.no_grad():
            outs = {"full": (model(ids), 0), "ced": (model.ced(ids, split), split - 1),
                    "replay": (model.replay(ids, split), split - 1)}
        for mode, (logits, first) in outs.items():
            lg = logits[0, first:]
            top2 = torch.topk(lg, 2, dim=-1).values
            rows = stored_rows(T, first)
            name = f"{a.name}_{mode}_{T}"
            bin_path = os.path.join(a.out, name + ".bin")
            logits[0, rows].contiguous().numpy().astype("<f4").tofile(bin_path)
            manifest["cases"].append({
                "name": name, "checkpoint": a.name, "mode": mode, "split": split,
                "tokens": tokens.tolist(), "rows": rows, "first_row": first,
                "argmax": lg.argmax(-1).tolist(),
                "margin": [round(float(x), 6) for x in (top2[:, 0] - top2[:, 1])],
                "logits_file": name + ".bin", "sha256": sha256_file(bin_path)})
            print(f"{name}: rows {first}..{T - 1}, {len(rows)} stored", file=sys.stderr)
    with open(man_path, "w") as f:
        json.dump(manifest, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
