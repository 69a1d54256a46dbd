"""Writes golden logits of the reference for the engine's tests (tests/engine/golden/).

  /usr/bin/python3 -m reference.golden                       # the random-init checkpoint
  /usr/bin/python3 -m reference.golden --name trained \\
      --weights deploy/models/X.safetensors --config deploy/models/X.json   # a trained one
  /usr/bin/python3 -m reference.golden --name init7fp4 --short-only \
      --config deploy/models/mini-v4.1-mxfp4.json        # MXFP4 experts: full and ced only
  /usr/bin/python3 -m reference.golden --name init9q --seed 9 --short-only \
      --config deploy/models/mini-v4.1-fp8-mxfp4.json    # and FP8 projections

Each run (re)writes the cases of one checkpoint, <name>_*.bin, and its entry in manifest.json
(other checkpoints' entries are kept). A random-init checkpoint is named by (config, seed): the
engine's InitWeights(config, seed) rebuilds it, so no weights are committed; a file checkpoint
is named by its path and sha256.

The model is chaotic at these lengths: an FP8 rounding that flips between two float32 sums
of a different order (one SWA key element of one token) grows into O(1) logit changes some 20
positions later (measured: the reference against itself with the embeddings perturbed by 1e-6
relative). So no case runs the engine over more than ~24 positions from its own caches; long
contexts come in as the reference's caches, the way a restore imports them:

  full     Forward(prompt[:21]) with every row, then Decode of 3 tokens: rows 0..23
  ced      PrefillCed(prompt[:split]) (split 20 and 21 > W) then Decode of 3: rows split-1..
  decode   long prompt (split = 597 or 574, over 512 so the candidate pool restricts): the
           engine's state is the reference's caches after prompt[:split] (FP4 global KV codes,
           the compressor's partial group, FP8 SWA rings); Decode of 3 tokens: rows split..
  replay   same long prompt, state = the imported global KV only; ReplayTail (bounded replay
           of the last W tokens) then Decode of 3: rows split-1..

The .bin file holds float32 little-endian logits of the listed rows; <prompt>_state.bin holds the
caches (layout in the manifest's "state" entries: byte ranges of each tensor). The manifest
holds the tokens, rows, the argmax and top-1 margin of every row, and each file's sha256.
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np
import torch

from . import quant
from .config import Config
from .model import MiniV41, load

LONG_PROMPTS = [(600, 11), (577, 12)]  # (length, token seed): split = length - DECODE_TAIL
SHORT_SPLITS = [21, 20]
DECODE_TAIL = 3  # tokens decoded one at a time after the split


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def write_state(cap, cfg, model_weight, split, path):
    """The reference's caches (captured by the pass whose logits are stored: another pass, of
    another length, sums in another order and drifts apart, see above) cut at `split` tokens,
    as the engine holds them; returns the manifest's "state" entry (byte ranges in the file)."""
    c = cfg
    W = c.sliding_window
    blobs, entry = [], {"split": split, "sources": [], "swa": []}

    def put(t):
        raw = t.contiguous().numpy().tobytes()
        off = sum(len(b) for b in blobs)
        blobs.append(raw)
        return [off, len(raw)]

    def codes(x, fmt):
        q, sc = quant.quantize(x[0], fmt)
        data = quant.pack_fp4(q) if fmt != quant.FP8_UE8M0X32 else q.to(torch.uint8)
        return put(data), put(sc.to(torch.uint8))
    for l in c.kv_source_layer_ids:
        m = c.compress_ratios[l]
        E = split // m
        main_data, main_scales = codes(cap[("main", l)][:, :E], quant.FP4_E4M3X16)
        index_data, index_scales = codes(cap[("index", l)][:, :E], quant.FP4_UE8M0X32)
        tail = cap[("xa", l)][:, E * m:split]  # the compressor's partial group
        kv = tail @ model_weight(l, "attn.compressor.wkv.weight").t()
        score = tail @ model_weight(l, "attn.compressor.wgate.weight").t() if m > 1 else tail[..., :0]
        entry["sources"].append({
            "layer": l, "entries": E,
            "main_data": main_data, "main_scales": main_scales,
            "index_data": index_data, "index_scales": index_scales,
            "partial_tokens": int(kv.shape[1]), "partial_kv": put(kv[0].float()),
            "partial_score": put(score[0].float())})
    first = max(0, split - W)
    for l in range(c.num_hidden_layers):
        data, scales = codes(cap[("swa", l)][:, first:split], quant.FP8_UE8M0X32)
        entry["swa"].append({"layer": l, "first_pos": first, "data": data, "scales": scales})
    with open(path, "wb") as f:
        for b in blobs:
            f.write(b)
    return entry


def add_case(manifest, out, name, ckpt, mode, tokens, split, logits, first, rows, state=None):
    lg = logits[0, first:]
    top2 = torch.topk(lg, 2, dim=-1).values
    bin_path = os.path.join(out, name + ".bin")
    logits[0, rows].contiguous().numpy().astype("<f4").tofile(bin_path)
    case = {"name": name, "checkpoint": ckpt, "mode": mode, "split": split,
            "tokens": tokens.tolist(), "rows": rows, "first_row": first,
            "argmax": lg.argmax(-1).tolist(),
            "margin": [round(float(x), 6) for x in (top2[:, 0] - top2[:, 1])],
            "logits_file": name + ".bin", "sha256": sha256_file(bin_path)}
    if state is not None:
        case["state"] = state
    manifest["cases"].append(case)
    print(f"{name}: rows {first}..{logits.shape[1] - 1}, {len(rows)} stored", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="deploy/models/mini-v4.1.json")
    ap.add_argument("--seed", type=int, default=7, help="engine init seed (without --weights)")
    ap.add_argument("--weights", help="a safetensors checkpoint instead of the random init")
    ap.add_argument("--name", default="init7")
    ap.add_argument("--out", default="tests/engine/golden")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short-only", action="store_true",
                    help="only the full and ced cases (no long-context caches or states)")
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
    for T, tseed in LONG_PROMPTS:
        tokens = np.random.default_rng(tseed).integers(0, cfg.vocab_size, T).astype(np.int64)
        ids = torch.from_numpy(tokens).view(1, T)
        split = T - DECODE_TAIL
        if T == LONG_PROMPTS[0][0]:  # the short cases use the first prompt's head
            for n in SHORT_SPLITS:
                short = ids[:, :n + DECODE_TAIL]
                with torch.no_grad():
                    full, ced = model(short), model.ced(short, n)
                if n == SHORT_SPLITS[0]:
                    add_case(manifest, a.out, f"{a.name}_full_{n}", a.name, "full",
                             tokens[:n + DECODE_TAIL], n, full, 0, list(range(n + DECODE_TAIL)))
                add_case(manifest, a.out, f"{a.name}_ced_{n}", a.name, "ced",
                         tokens[:n + DECODE_TAIL], n, ced, n - 1,
                         list(range(n - 1, n + DECODE_TAIL)))
        if a.short_only:
            break
        state_file = f"{a.name}_state_{T}.bin"
        model.capture = {}
        with torch.no_grad():
            full = model(ids)
        cap, model.capture = model.capture, None
        with torch.no_grad():
            state = write_state(cap, cfg, model.p, split, os.path.join(a.out, state_file))
            replay = model.replay(ids, split)
        state["file"] = state_file
        state["sha256"] = sha256_file(os.path.join(a.out, state_file))
        add_case(manifest, a.out, f"{a.name}_decode_{T}", a.name, "decode", tokens, split, full,
                 split, list(range(split, T)), state)
        add_case(manifest, a.out, f"{a.name}_replay_{T}", a.name, "replay", tokens, split,
                 replay, split - 1, list(range(split - 1, T)), state)
    with open(man_path, "w") as f:
        json.dump(manifest, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
