#!/usr/bin/python3
"""Trains the miniature (reference/model.py) on the byte corpus of train/build_corpus.py.

Contract:
  train.py --config CFG --corpus DIR --out DIR [--pre-steps N --post-steps M ...] [--resume]
Two phases over one deterministic schedule of steps 0 .. N+M-1:
  pre-training   steps [0, N): next-byte loss on windows of the train text;
  post-training  steps [N, N+M): replay-aware (reference section 4): in each batch the samples
                 of odd index get a restore point s (restore_at; even, uniform in [2, T-2W]),
                 where queries i >= s see SWA keys only in [max(s, i-W+1), i] in every layer and
                 global KV is that of the uninterrupted session; the even samples stay normal,
                 so the loss is a mix and normal quality is kept.
One learning-rate schedule (linear warm-up, cosine to lr_min) spans both phases. AdamW; the
MoE routing bias (noaux_tc) is not a gradient parameter: after each step it moves by
bias_rate * sign(mean load - load) per expert, the report's rule.

Stages: --init FILE --init-sha256 HEX starts from a previous stage's engine safetensors (the
sha256 pins the input; the optimizer starts fresh with its own warm-up) instead of the seeded
random init, so stage 2 (longer windows) continues stage 1 (Makefile `train`).

Outputs in --out: ckpt.pt (resumable: weights, optimizer, bias, step; written every
--ckpt-every steps and at the end), pretrained.safetensors (the engine's format, at the end of
pre-training, for before/after fidelity), final.safetensors (+ .sha256; after the last step, or
after --stop-after), train.log (one line per
step: loss, tokens/s; validation bpb every --val-every steps on a fixed validation sample).

Determinism: the torch seed fixes the initial weights; batch k takes its windows from
numpy default_rng((seed, k)), so a resumed run sees the same data as an uninterrupted one.
Windows are [bos] + T-1 bytes of the text at a random offset; ids are byte + 3
(engine/tokenizer.h). bits per byte = mean next-byte cross entropy / ln 2.
"""
import argparse
import ctypes
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from reference.config import Config  # noqa: E402
from reference import safetensors_io  # noqa: E402
from reference.model import MiniV41, save  # noqa: E402

BOS, BYTE_BASE = 0, 3


def tune_malloc():
    """Keeps freed tensor memory in glibc's heap: on this machine every fresh mmap of a large
    tensor costs page faults that dominate small-model steps (measured 10-20x on zeros())."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
        libc.mallopt(-2, 256 << 20)  # M_TOP_PAD
    except OSError:
        pass


def load_bytes(path):
    """The text file as a uint8 array."""
    return np.fromfile(path, dtype=np.uint8)


def windows(text, offsets, T):
    """LongTensor[B, T+1]: bos followed by the T bytes at each offset, as token ids."""
    out = np.empty((len(offsets), T + 1), dtype=np.int64)
    out[:, 0] = BOS
    for r, o in enumerate(offsets):
        out[r, 1:] = text[o:o + T].astype(np.int64) + BYTE_BASE
    return torch.from_numpy(out)


def batch_offsets(seed, step, n_bytes, B, T):
    rng = np.random.default_rng((seed, step))
    return rng.integers(0, n_bytes - T, size=B)


def val_offsets(n_bytes, T, count):
    """Evenly spaced, non-overlapping windows over the validation text (fixed sample)."""
    count = min(count, n_bytes // T)
    stride = n_bytes // count
    return [i * stride for i in range(count)]


def restore_points(seed, step, B, T, W):
    """restore_at for a post-training batch: odd samples restored at an even s, others 0."""
    rng = np.random.default_rng((seed, step, 1))
    s = 2 * rng.integers(1, (T - 2 * W) // 2 + 1, size=B)
    s[0::2] = 0
    return torch.from_numpy(s.astype(np.int64))


class Trainee(MiniV41):
    """MiniV41 whose MoE passes count routed tokens per expert (the reference's expert_load)
    while training, for the routing-bias rule."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.expert_load = {}

    def train(self, mode=True):
        """Counts loads only in training mode (validation passes leave the bias alone)."""
        super().train(mode)
        self.expert_load = {} if mode else None
        return self

    def update_routing_bias(self, rate):
        """noaux_tc: bias += rate * sign(mean load - load); clears the counts."""
        with torch.no_grad():
            for l, counts in self.expert_load.items():
                load = counts.float()
                self.p(l, "ffn.gate.bias").add_(rate * torch.sign(load.mean() - load))
        self.expert_load = {}


def lr_at(step, total, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, total - args.warmup)
    return args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * min(1.0, t)))


def bits_per_byte(model, ids, batch, restore_at=None):
    """Mean next-byte cross entropy in bits over ids [N, T+1] (no gradient)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch):
            x = ids[i:i + batch]
            ra = None if restore_at is None else restore_at[i:i + batch]
            logits = model(x[:, :-1], restore_at=ra)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="sum")
            total += ce.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count / math.log(2)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def init_from(model, path, want_sha256):
    """Loads a previous stage's engine safetensors into model; ValueError when the file's
    sha256 is not want_sha256 (a stage's input is pinned) or a tensor is missing or misshapen."""
    digest = sha256_file(path)
    if digest != want_sha256:
        raise ValueError("%s has sha256 %s, expected %s" % (path, digest, want_sha256 or "none"))
    tensors, _ = safetensors_io.read(path)
    model.load_engine_tensors(tensors)


def write_engine(model, path, dtype, meta):
    save(model, path, dtype=dtype, metadata={k: str(v) for k, v in meta.items()})
    digest = sha256_file(path)
    with open(path + ".sha256", "w") as f:
        f.write("%s  %s\n" % (digest, os.path.basename(path)))
    return digest


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--corpus", required=True, help="directory with train.txt and val.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pre-steps", type=int, default=400)
    ap.add_argument("--post-steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-min", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--val-windows", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--dtype", default="F32", choices=["F32", "F16", "BF16"])
    ap.add_argument("--init", default="",
                    help="start from this engine safetensors (a previous stage's output) "
                         "instead of the seeded random init")
    ap.add_argument("--init-sha256", default="",
                    help="required with --init: the file's sha256 (a stage's input is pinned)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="end after this step (the schedule still spans every step)")
    args = ap.parse_args()

    tune_malloc()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    with open(args.config) as f:
        cfg = Config(json.load(f))
    train_text = load_bytes(os.path.join(args.corpus, "train.txt"))
    val_text = load_bytes(os.path.join(args.corpus, "val.txt"))
    T, B, W = args.seq, args.batch, cfg.sliding_window
    val_ids = windows(val_text, val_offsets(len(val_text), T, args.val_windows), T)
    val_restore = restore_points(args.seed, 1 << 30, val_ids.shape[0], T, W)

    torch.manual_seed(args.seed)
    model = Trainee(cfg)
    if args.init:
        try:
            init_from(model, args.init, args.init_sha256)
        except ValueError as e:
            sys.exit("train: %s" % e)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = args.pre_steps + args.post_steps
    step, seen = 0, 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, seen = ck["step"], ck["tokens"]
    log = open(os.path.join(args.out, "train.log"), "a")

    def say(line):
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    n_params = sum(p.numel() for p in model.parameters())
    say("train: config %s params %d steps %d+%d batch %dx%d threads %d start step %d" % (
        args.config, n_params, args.pre_steps, args.post_steps, B, T, args.threads, step))
    meta = {"trained_by": "train/train.py", "config": os.path.basename(args.config),
            "seed": args.seed}
    if args.init:
        meta["init_sha256"] = args.init_sha256

    def checkpoint():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "tokens": seen}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    def validate():
        bpb = bits_per_byte(model, val_ids, B)
        rbpb = bits_per_byte(model, val_ids, B, val_restore)
        say("val step %d tokens %d bpb %.4f restored_bpb %.4f" % (step, seen, bpb, rbpb))

    t_start = time.time()
    end = min(total, args.stop_after) if args.stop_after > 0 else total
    while step < end:
        if step == args.pre_steps:
            validate()
            digest = write_engine(model, os.path.join(args.out, "pretrained.safetensors"),
                                  args.dtype, dict(meta, phase="pre", step=step))
            say("train: pre-training done, pretrained.safetensors sha256 %s" % digest)
        t0 = time.time()
        ids = windows(train_text, batch_offsets(args.seed, step, len(train_text), B, T), T)
        post = step >= args.pre_steps
        ra = restore_points(args.seed, step, B, T, W) if post else None
        lr = lr_at(step, total, args)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(ids[:, :-1], restore_at=ra)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        model.update_routing_bias(args.bias_rate)
        step += 1
        seen += B * T
        dt = time.time() - t0
        say("step %d %s loss %.4f bpb %.4f lr %.2e gnorm %.2f %.1fs %.0f tok/s" % (
            step, "post" if post else "pre", loss.item(), loss.item() / math.log(2), lr,
            gnorm.item(), dt, B * T / dt))
        if step % args.val_every == 0 or step == end:
            validate()
        if step % args.ckpt_every == 0 or step == end:
            checkpoint()
    if args.post_steps == 0 or end <= args.pre_steps:
        write_engine(model, os.path.join(args.out, "pretrained.safetensors"), args.dtype,
                     dict(meta, phase="pre", step=step))
    digest = write_engine(model, os.path.join(args.out, "final.safetensors"), args.dtype,
                          dict(meta, phase="post", step=step))
    say("train: done, %d tokens in %.0f s; final.safetensors sha256 %s" % (
        seen, time.time() - t_start, digest))


if __name__ == "__main__":
    main()
