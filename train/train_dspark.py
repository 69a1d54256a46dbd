#!/usr/bin/python3
"""Trains the DSpark draft module (reference/dspark.py) by distillation from the trained backbone.

Contract:
  train_dspark.py --config CFG --backbone W.safetensors --corpus DIR --out OUT.safetensors
                  [--steps N --batch B --seq T --anchors A --lr ... --seed S --threads 1]
                  [--self-text SELF.npy --self-frac F] [--init D.safetensors --init-sha256 HEX]
                  [--hard-weight H] [--anchor-min M]
The backbone is frozen. Each step takes B windows of the train text (the windows of
train/train.py: bos + T-1 bytes, batch k from numpy default_rng((seed, k))), runs the backbone
once (no gradient) for its logits and the target layers' attention-input streams, and picks A
anchor positions n per window (uniform in [1, T-K], the same rng). The draft block at n is
[ids[n], noise x (K-1)] over the context main_x[n-W, n); its position k is trained towards the
backbone's distribution at n + k (KL(teacher || draft), the Markov bias taking the real token
at n + k as its previous token), and its confidence head towards 1[draft argmax == backbone
argmax] (binary cross entropy on detached features, weight --conf-weight). --hard-weight H
adds H times the cross entropy towards the backbone's argmax at n + k (greedy verification
accepts exactly the argmax); --anchor-min M draws the anchors from [M, T-K] instead (M = 1 +
prompt bytes: the self text's continuations, where greedy speculation drafts).

Self-distillation (--self-text, written by train/gen_self_text.py): an int array [N, L >= T] of
token ids, each row bos + a prompt cut from the TRAIN text + the backbone's greedy continuation
(what greedy speculation verifies); --self-text given again appends that file's rows. With
--self-frac F the last round(F * B) windows of every batch are replaced by rows of it, row
indices from numpy default_rng((seed, step, 11)); the other windows, the anchors and the loss
are unchanged (F = 0: exactly the corpus-only run).

Validation (every --val-every steps and at the end): on --val-windows windows of val.txt, at
fixed anchors, the draft proposes K tokens greedily (sequential Markov bias), the backbone
verifies [ids[:n+1] + draft] in one pass, and the accepted length is the longest prefix equal
to the backbone's greedy tokens. Reported: mean accepted draft tokens per verification (tau),
tokens per verification (tau + 1, with the target's own next token), per-position acceptance
and the mean predicted survival (product of confidences) beside the measured one.

Stages: --init starts the draft from a previous stage's draft (its sha256 pinned by
--init-sha256) instead of the seeded random init; the optimizer state starts fresh.

Output: OUT (the engine's safetensors of the draft parameters, --dtype) + OUT.sha256, and
OUT.log (one line per step and per validation); OUT.last holds the draft at the latest
validation before the end (a checkpoint, not the result). --stop-after N ends after step N
with the learning-rate schedule of --steps; OUT is then written exactly as the checkpoint at
step N would be (the same bytes as that run's OUT.last at a validation step N).
Deterministic for a given seed and threads.
"""
import argparse
import hashlib
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import safetensors_io  # noqa: E402
from reference.config import Config  # noqa: E402
from reference.dspark import Capture, DSpark, dims, save  # noqa: E402
from train import batch_offsets, load_bytes, tune_malloc, val_offsets, windows  # noqa: E402

VAL_ANCHORS = [24, 48, 80, 112, 144, 176, 208, 240]


def load_backbone(cfg, path):
    bb = Capture(cfg)
    tensors, _ = safetensors_io.read(path)
    bb.load_engine_tensors(tensors)
    bb.eval()
    for p in bb.parameters():
        p.requires_grad_(False)
    return bb


def teacher(bb, ids):
    """(logits [B, T, V], streams [B, T, NT, D]) of the backbone over ids [B, T]."""
    with torch.no_grad():
        bb.streams = {}
        logits = bb(ids)
        streams = bb.stacked_streams()
        bb.streams = None
    return logits, streams


def gather_blocks(cfg, mx, ids, anchors):
    """Inputs of DSpark.hidden for anchors [B, A]: (mx [N, W, D], ctx_pos, ctx_valid, tokens,
    tok_pos) with N = B * A."""
    B, T, D = mx.shape
    W, K = cfg.sliding_window, cfg.raw["dspark_block_size"]
    A = anchors.shape[1]
    ctx_pos = anchors.unsqueeze(-1) - W + torch.arange(W)  # [B, A, W]
    valid = ctx_pos >= 0
    gi = ctx_pos.clamp_min(0).reshape(B, A * W, 1).expand(B, A * W, D)
    ctx = torch.gather(mx, 1, gi).view(B, A, W, D) * valid.unsqueeze(-1)
    tok_pos = anchors.unsqueeze(-1) + torch.arange(K)  # [B, A, K]
    tokens = torch.full((B, A, K), cfg.dspark_noise_token_id, dtype=torch.long)
    tokens[..., 0] = torch.gather(ids, 1, anchors)
    return (ctx.reshape(B * A, W, D), ctx_pos.reshape(B * A, W), valid.reshape(B * A, W),
            tokens.reshape(B * A, K), tok_pos.reshape(B * A, K))


def validate(cfg, bb, draft, val_ids):
    """Greedy draft-then-verify on the validation windows at VAL_ANCHORS: a dict of figures."""
    K = cfg.raw["dspark_block_size"]
    draft.eval()
    acc_lens, pos_ok, pos_n, pred_surv = [], np.zeros(K), np.zeros(K), []
    with torch.no_grad():
        _, streams = teacher(bb, val_ids)
        mx = draft.main_x(streams)
        B = val_ids.shape[0]
        for n in VAL_ANCHORS:
            if n + 1 > val_ids.shape[1]:
                continue
            a = torch.full((B, 1), n, dtype=torch.long)
            toks, _, conf = draft.draft(*gather_blocks(cfg, mx, val_ids, a))
            seq = torch.cat([val_ids[:, :n + 1], toks], 1)
            bb.streams = None
            g = torch.argmax(bb(seq)[:, n:n + K], -1)
            match = (toks == g).long()
            alive = torch.cumprod(match, 1)
            acc_lens.append(alive.sum(1))
            prev_alive = torch.cat([torch.ones(B, 1, dtype=torch.long), alive[:, :-1]], 1)
            pos_ok += (alive * prev_alive).sum(0).numpy()
            pos_n += prev_alive.sum(0).numpy()
            pred_surv.append(torch.cumprod(conf, 1).sum(1))
    draft.train()
    acc = torch.cat(acc_lens).float()
    return {"tau": acc.mean().item(), "tokens_per_verify": acc.mean().item() + 1,
            "cond_accept": (pos_ok / np.maximum(pos_n, 1)).round(3).tolist(),
            "pred_tau": torch.cat(pred_surv).mean().item(), "verifications": int(acc.numel())}


SELF_TEXT_ROWS_MAX = 1 << 18  # rows over all --self-text files (gen_self_text writes <= 2^16 each)


def load_self_text(paths, seq, vocab):
    """The rows of the --self-text files in order, cut to seq columns: int64 tensor [N, seq];
    ValueError when a file is not an integer array [N >= 1, L >= seq], holds an id outside
    [0, vocab), or the files hold more than SELF_TEXT_ROWS_MAX rows together (each file's shape
    and type are read from its header before its rows are)."""
    parts, rows = [], 0
    for path in paths:
        a = np.load(path, mmap_mode="r")
        if a.ndim != 2 or a.shape[1] < seq or a.shape[0] < 1:
            raise ValueError("--self-text %s must be [N, L >= %d], got %s" % (path, seq, a.shape))
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError("--self-text %s must hold integer token ids, got %s" % (path, a.dtype))
        rows += a.shape[0]
        if rows > SELF_TEXT_ROWS_MAX:
            raise ValueError("--self-text files hold more than %d rows" % SELF_TEXT_ROWS_MAX)
        a = np.array(a[:, :seq])
        if a.min() < 0 or a.max() >= vocab:
            raise ValueError("--self-text %s has token ids outside the vocabulary" % path)
        parts.append(a.astype(np.int64))
    return torch.from_numpy(np.concatenate(parts, 0))


def mix_self(ids, self_ids, seed, step, n_self):
    """Replaces the last n_self rows of ids [B, T] in place by rows of self_ids [N, T], chosen by
    numpy default_rng((seed, step, 11)); n_self = 0 leaves ids unchanged."""
    if n_self > 0:
        rows = np.random.default_rng((seed, step, 11)).integers(0, self_ids.shape[0], size=n_self)
        ids[ids.shape[0] - n_self:] = self_ids[torch.from_numpy(rows)]
    return ids


def draw_anchors(seed, step, batch, count, seq, block, anchor_min=1):
    """Anchor positions [batch, count] of a training step, uniform in [anchor_min, seq - block]
    from numpy default_rng((seed, step, 7)) (anchor_min = 1: every position with a previous
    token, the draws of the runs before --anchor-min)."""
    rng = np.random.default_rng((seed, step, 7))
    return torch.from_numpy(rng.integers(anchor_min, seq - block + 1, size=(batch, count)))


def distill_loss(logits, t_logits, hard_weight=0.0):
    """(loss, kl) of draft logits [N, K, V] against the backbone's t_logits [N, K, V]: the mean
    KL(teacher || draft), plus hard_weight times the mean cross entropy of the draft towards
    the teacher's argmax (what greedy verification accepts). hard_weight = 0: the KL alone,
    the loss of the runs before --hard-weight, bit for bit."""
    tp = torch.softmax(t_logits, -1)
    lsm = torch.log_softmax(logits, -1)
    kl = (tp * (torch.log_softmax(t_logits, -1) - lsm)).sum(-1).mean()
    if hard_weight == 0.0:
        return kl, kl
    target = torch.argmax(t_logits, -1, keepdim=True)
    ce = -torch.gather(lsm, -1, target).mean()
    return kl + hard_weight * ce, kl


def init_draft(draft, path, want_sha256):
    """Loads a previous stage's draft into draft; ValueError when the file's sha256 is not
    want_sha256 (a stage's input is pinned) or a tensor is missing or misshapen."""
    digest = sha256_file(path)
    if digest != want_sha256:
        raise ValueError("%s has sha256 %s, expected %s" % (path, digest, want_sha256 or "none"))
    tensors, _ = safetensors_io.read(path)
    draft.load_engine_tensors(tensors)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-min", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--conf-weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-windows", type=int, default=16)
    ap.add_argument("--dtype", default="F32", choices=["F32", "F16"])
    ap.add_argument("--self-text", default=None, action="append",
                    help="int array [N, L>=seq] of bos + train prompt + greedy continuation; "
                    "repeated: the files' rows in order, as one array")
    ap.add_argument("--self-frac", type=float, default=0.0,
                    help="fraction of each batch's windows taken from --self-text")
    ap.add_argument("--init", default=None,
                    help="start from this draft safetensors (a previous stage's output)")
    ap.add_argument("--init-sha256", default="",
                    help="required with --init: the file's sha256 (a stage's input is pinned)")
    ap.add_argument("--anchor-min", type=int, default=1,
                    help="first anchor position (e.g. 1 + prompt bytes: anchors in the "
                    "self text's continuations only)")
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of the cross entropy towards the backbone's argmax, beside the KL")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="end after this step (the schedule still spans --steps)")
    args = ap.parse_args()
    if not 0 <= args.stop_after <= args.steps:
        ap.error("--stop-after in [0, --steps]")
    if not 0.0 <= args.hard_weight <= 100.0:
        ap.error("--hard-weight in [0, 100]")
    if not 0.0 <= args.self_frac <= 1.0 or (args.self_frac > 0) != (args.self_text is not None):
        ap.error("--self-frac in [0, 1], > 0 exactly when --self-text is given")

    tune_malloc()
    torch.set_num_threads(args.threads)
    cfg = Config.from_json(args.config)
    K = cfg.raw["dspark_block_size"]
    if not 1 <= args.anchor_min <= args.seq - K:
        ap.error("--anchor-min in [1, --seq - dspark_block_size]")
    train_text = load_bytes(os.path.join(args.corpus, "train.txt"))
    val_text = load_bytes(os.path.join(args.corpus, "val.txt"))
    T, B = args.seq, args.batch
    val_ids = windows(val_text, val_offsets(len(val_text), T, args.val_windows), T)[:, :T]
    n_self = int(round(args.self_frac * B))
    self_ids = None
    if args.self_text is not None:
        try:
            self_ids = load_self_text(args.self_text, T, cfg.vocab_size)
        except ValueError as e:
            sys.exit("train_dspark: %s" % e)
    bb = load_backbone(cfg, args.backbone)
    torch.manual_seed(args.seed)
    draft = DSpark(cfg, bb)
    if args.init is not None:
        try:
            init_draft(draft, args.init, args.init_sha256)
        except ValueError as e:
            sys.exit("train_dspark: %s" % e)
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                            betas=(0.9, 0.95))
    log = open(args.out + ".log", "w")

    def say(line):
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    n_params = sum(p.numel() for p in draft.parameters())
    say("train_dspark: %s params %d steps %d batch %dx%d anchors %d dims %s" % (
        args.backbone, n_params, args.steps, B, T, args.anchors, dims(cfg)))
    if self_ids is not None:
        say("self-text %s: %d rows, %d of %d windows per batch" % (
            " + ".join(args.self_text), self_ids.shape[0], n_self, B))
    t_start = time.time()
    if args.init is not None:  # the starting point, on the same validation
        v = validate(cfg, bb, draft, val_ids)
        say("val step 0 tau %.3f tokens_per_verify %.3f cond_accept %s pred_tau %.3f n %d" % (
            v["tau"], v["tokens_per_verify"], v["cond_accept"], v["pred_tau"], v["verifications"]))
    last = args.stop_after or args.steps
    for step in range(last):
        t0 = time.time()
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            t = (step - args.warmup) / max(1, args.steps - args.warmup)
            lr = args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * t))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows(train_text, batch_offsets(args.seed, step, len(train_text), B, T), T)[:, :T]
        mix_self(ids, self_ids, args.seed, step, n_self)
        t_logits, streams = teacher(bb, ids)
        anchors = draw_anchors(args.seed, step, B, args.anchors, T, K, args.anchor_min)
        mx = draft.main_x(streams)
        blk = gather_blocks(cfg, mx, ids, anchors)
        h = draft.hidden(*blk)
        tpos = blk[4].view(B, -1)  # positions n + k
        prev = torch.gather(ids, 1, tpos).view(-1, K)
        logits = draft.base_logits(h) + draft.markov(prev)
        V = logits.shape[-1]
        tl = torch.gather(t_logits, 1, tpos.unsqueeze(-1).expand(B, tpos.shape[1], V)).view(-1, K, V)
        loss, kl = distill_loss(logits, tl, args.hard_weight)
        hit = (torch.argmax(logits.detach(), -1) == torch.argmax(tl, -1)).float()
        conf = draft.confidence(h.detach(), prev)
        bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit)
        loss = loss + args.conf_weight * bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        say("step %d kl %.4f bce %.4f top1 %s lr %.2e gnorm %.2f %.2fs" % (
            step + 1, kl.item(), bce.item(), " ".join("%.2f" % v for v in hit.mean(0).tolist()), lr, gn.item(),
            time.time() - t0))
        if (step + 1) % args.val_every == 0 or step + 1 == last:
            v = validate(cfg, bb, draft, val_ids)
            say("val step %d tau %.3f tokens_per_verify %.3f cond_accept %s pred_tau %.3f n %d" % (
                step + 1, v["tau"], v["tokens_per_verify"], v["cond_accept"], v["pred_tau"],
                v["verifications"]))
            if step + 1 < args.steps:  # a usable checkpoint if the run is stopped early
                save(draft, args.out + ".last", dtype=args.dtype,
                     metadata={"trained_by": "train/train_dspark.py", "step": str(step + 1)})
    if last < args.steps:  # stopped early: OUT is byte for byte the checkpoint at that step
        meta = {"trained_by": "train/train_dspark.py", "step": str(last)}
    else:
        meta = {"trained_by": "train/train_dspark.py", "backbone": os.path.basename(args.backbone),
                "seed": str(args.seed), "steps": str(args.steps), "self_frac": str(args.self_frac),
                "init_sha256": args.init_sha256}
        if args.hard_weight or args.anchor_min != 1:  # the earlier stages' metadata unchanged
            meta.update({"hard_weight": str(args.hard_weight), "anchor_min": str(args.anchor_min)})
    save(draft, args.out, dtype=args.dtype, metadata=meta)
    digest = sha256_file(args.out)
    with open(args.out + ".sha256", "w") as f:
        f.write("%s  %s\n" % (digest, os.path.basename(args.out)))
    say("train_dspark: done in %.0f s; %s sha256 %s" % (time.time() - t_start, args.out, digest))


if __name__ == "__main__":
    main()
