"""DSpark: the draft module of the miniature (../shared/reference/deepseek-v4.1-model.md §9).

Contract (the engine's engine/dspark.cc computes the same function):

  draft = DSpark(cfg, backbone)            parameters of the draft; shares (reads, never trains)
                                           the backbone's embed.weight and head.weight
  mx = draft.main_x(streams)               streams [..., n_targets, D]: the mean over the mHC
                                           copies of each target layer's attention input
                                           (Capture below); main_x = RMSNorm(proj(concat)) [..., D]
  h = draft.hidden(mx, ctx_pos, ctx_valid, tokens, tok_pos)
                                           [N, K, D]: the normalised draft states of N blocks
  base = draft.base_logits(h)              h @ head^T (the shared head)            [N, K, V]
  bias = draft.markov(prev)                head_r(embed_r(prev)), rank r           [N, V]
  conf = draft.confidence(h_k, prev)       sigmoid(Linear([h_k; embed_r(prev)]))   [N]
  tokens, logits, conf = draft.draft(...)  the sequential pass: position k gets the Markov
                                           bias of its previous token (the last real token for
                                           k = 0, then the drafted k-1) and is then chosen
                                           (greedy here; the engine may sample).

A block is the K = dspark_block_size tokens [last, noise x (K-1)] at positions n .. n+K-1,
where `last` is the newest token (not yet run by the target) and the context is the target's
positions [n - W, n) (W = sliding_window). Position k predicts the token at n + k + 1.
Each of the num_nextn_predict_layers draft blocks: pre-norm attention (H heads of head_dim
queries, one latent of head_dim as key and value, RoPE on its last qk_rope_head_dim channels
at the token positions; the keys are the context's main_x and all K draft positions, no causal
mask inside the block), then a pre-norm MoE (dspark_n_routed_experts SwiGLU experts, top-1 by
sqrt(softplus) score, the expert output weighted by that score, plus one shared expert; the
backbone's clamps). Draft token embeddings are the backbone's embedding plus a learned
per-position vector block_pos[k] (the K-1 noise tokens would otherwise be identical inputs).
Differences from the real model, all for size: one residual stream instead of mHC copies in
the draft blocks, no attention sink, no FP8 rounding of the draft's keys.

Parameter names (engine order) are in `specs(cfg)`; all float32.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .config import Config
from .model import MiniV41, rms_norm, rope, rope_frequencies


def dims(cfg):
    """(D, V, H, hd, rd, K, r, E, I, n_blocks, n_targets) of the draft module."""
    return (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim,
            cfg.qk_rope_head_dim, cfg.raw["dspark_block_size"], cfg.raw["dspark_markov_rank"],
            cfg.raw["dspark_n_routed_experts"], cfg.moe_intermediate_size,
            cfg.raw["num_nextn_predict_layers"], len(cfg.raw["dspark_target_layer_ids"]))


def specs(cfg):
    """[(name, shape, init)] of the draft's parameters, in the engine's order."""
    D, V, H, hd, rd, K, r, E, I, NB, NT = dims(cfg)
    v = [("dspark.proj.weight", (D, NT * D), "linear"), ("dspark.proj_norm.weight", (D,), "ones"),
         ("dspark.block_pos", (K, D), "small")]
    for b in range(NB):
        p = f"dspark.blocks.{b}."
        v += [(p + "attn_norm.weight", (D,), "ones"), (p + "wq.weight", (H * hd, D), "linear"),
              (p + "wkv.weight", (hd, D), "linear"), (p + "kv_norm.weight", (hd,), "ones"),
              (p + "wo.weight", (D, H * hd), "half"), (p + "ffn_norm.weight", (D,), "ones"),
              (p + "gate.weight", (E, D), "linear")]
        for e in range(E):
            v += [(p + f"experts.{e}.w1.weight", (I, D), "linear"),
                  (p + f"experts.{e}.w3.weight", (I, D), "linear"),
                  (p + f"experts.{e}.w2.weight", (D, I), "half")]
        v += [(p + "shared.w1.weight", (I, D), "linear"), (p + "shared.w3.weight", (I, D), "linear"),
              (p + "shared.w2.weight", (D, I), "half")]
    v += [("dspark.norm.weight", (D,), "ones"), ("dspark.markov_embed", (V, r), "small"),
          ("dspark.markov_head", (V, r), "zeros"), ("dspark.conf.weight", (1, D + r), "zeros"),
          ("dspark.conf.bias", (1,), "zeros")]
    return v


class Capture(MiniV41):
    """MiniV41 that records, when `streams` is a dict, the mean over the mHC copies of each
    dspark target layer's attention input: streams[l] = X.mean(copies) [B, T, D]."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.streams = None
        self.targets = list(self.cfg.raw["dspark_target_layer_ids"])

    def _hc(self, X, pre, l, sub):
        if sub == 0 and self.streams is not None and l in self.targets:
            self.streams[l] = X.mean(2)
        return super()._hc(X, pre, l, sub)

    def stacked_streams(self):
        """[B, T, n_targets, D] in dspark_target_layer_ids order."""
        return torch.stack([self.streams[l] for l in self.targets], 2)


class DSpark(torch.nn.Module):
    def __init__(self, cfg, backbone):
        super().__init__()
        if not isinstance(cfg, Config):
            cfg = Config(cfg)
        self.cfg = cfg
        self.embed = backbone.params["embed__weight"].detach()
        self.head = backbone.params["head__weight"].detach()
        self.params = torch.nn.ParameterDict()
        D, V, H, hd, rd, K, r, E, I, NB, NT = dims(cfg)
        for name, shape, init in specs(cfg):
            if ".experts." in name:
                parts = name.split(".")
                if parts[4] != "0":
                    continue
                del parts[4]
                key = "__".join(parts)
                shape = (E,) + tuple(shape)
            else:
                key = name.replace(".", "__")
            t = torch.empty(shape)
            if init == "linear":
                t.uniform_(-math.sqrt(3.0 / shape[-1]), math.sqrt(3.0 / shape[-1]))
            elif init == "half":
                t.uniform_(-0.5 * math.sqrt(3.0 / shape[-1]), 0.5 * math.sqrt(3.0 / shape[-1]))
            elif init == "small":
                t.uniform_(-0.1, 0.1)
            elif init == "ones":
                t.fill_(1.0)
            else:
                t.zero_()
            self.params[key] = torch.nn.Parameter(t)
        self.freqs = torch.from_numpy(rope_frequencies(rd, cfg.rope_theta, cfg))

    def w(self, name):
        return self.params[name.replace(".", "__")]

    # -- engine tensors ----------------------------------------------------------------------
    def engine_tensors(self):
        out = {}
        for name, shape, init in specs(self.cfg):
            if ".experts." in name:
                parts = name.split(".")
                e = int(parts[4])
                del parts[4]
                out[name] = self.params["__".join(parts)][e].detach().contiguous()
            else:
                out[name] = self.w(name).detach().contiguous()
        return out

    def load_engine_tensors(self, tensors):
        with torch.no_grad():
            for name, shape, init in specs(self.cfg):
                if name not in tensors:
                    raise ValueError(f"dspark weights: missing {name}")
                t = tensors[name].float()
                if list(t.shape) != list(shape):
                    raise ValueError(f"dspark weights: {name} has shape {list(t.shape)}")
                if ".experts." in name:
                    parts = name.split(".")
                    e = int(parts[4])
                    del parts[4]
                    self.params["__".join(parts)][e].copy_(t)
                else:
                    self.w(name).copy_(t)

    # -- the function ----------------------------------------------------------------------------
    def main_x(self, streams):
        c = self.cfg
        x = streams.reshape(*streams.shape[:-2], -1) @ self.w("dspark.proj.weight").t()
        return rms_norm(x, self.w("dspark.proj_norm.weight"), c.rms_norm_eps)

    def _rope(self, x, pos):
        """RoPE of x [..., hd] at integer positions pos (x.shape[:-1] or broadcastable)."""
        ang = pos.double().unsqueeze(-1) * self.freqs
        return rope(x, torch.cos(ang).float(), torch.sin(ang).float(), self.cfg.qk_rope_head_dim)

    def _moe(self, b, x):
        c = self.cfg
        lim = c.swiglu_limit
        p = f"dspark.blocks.{b}."

        def swiglu(xe, w1, w3, w2, weight=None):
            h = F.silu((xe @ w1.transpose(-1, -2)).clamp(max=lim)) * \
                (xe @ w3.transpose(-1, -2)).clamp(-lim, lim)
            if weight is not None:
                h = h * weight
            return h @ w2.transpose(-1, -2)
        s = torch.sqrt(F.softplus(x @ self.w(p + "gate.weight").t(), threshold=20.0))
        top = torch.sort(s.detach(), dim=-1, descending=True, stable=True).indices[..., :1]
        weight = s.gather(-1, top)
        out = swiglu(x, self.w(p + "shared.w1.weight"), self.w(p + "shared.w3.weight"),
                     self.w(p + "shared.w2.weight"))
        w1, w3, w2 = (self.params["__".join(["dspark", "blocks", str(b), "experts", n, "weight"])]
                      for n in ("w1", "w3", "w2"))
        flat, fw = x.reshape(-1, x.shape[-1]), weight.reshape(-1, 1)
        idx = top.reshape(-1)
        routed = torch.zeros_like(flat)
        for e in range(w1.shape[0]):
            rows = (idx == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                routed = routed.index_add(0, rows, swiglu(flat[rows], w1[e], w3[e], w2[e], fw[rows]))
        return out + routed.view_as(x)

    def hidden(self, mx, ctx_pos, ctx_valid, tokens, tok_pos):
        """Normalised draft states [N, K, D] for N blocks: mx [N, C, D] main_x of the context,
        ctx_pos [N, C] positions, ctx_valid [N, C] which context slots exist, tokens/tok_pos
        [N, K] the block's tokens and positions."""
        c = self.cfg
        D, V, H, hd, rd, K, r, E, I, NB, NT = dims(c)
        N = tokens.shape[0]
        eps = c.rms_norm_eps
        h = self.embed[tokens] + self.w("dspark.block_pos")
        kpos = torch.cat([ctx_pos, tok_pos], 1)
        kvalid = torch.cat([ctx_valid, torch.ones_like(tok_pos, dtype=torch.bool)], 1)
        for b in range(NB):
            p = f"dspark.blocks.{b}."
            xn = rms_norm(h, self.w(p + "attn_norm.weight"), eps)
            cn = rms_norm(mx, self.w(p + "attn_norm.weight"), eps)
            q = self._rope((xn @ self.w(p + "wq.weight").t()).view(N, K, H, hd),
                           tok_pos.unsqueeze(-1))
            lat = rms_norm(torch.cat([cn, xn], 1) @ self.w(p + "wkv.weight").t(),
                           self.w(p + "kv_norm.weight"), eps)  # [N, C+K, hd]: values
            keys = self._rope(lat, kpos)
            s = torch.einsum("nkhd,ncd->nkhc", q, keys) / math.sqrt(hd)
            s = s.masked_fill(~kvalid.view(N, 1, 1, -1), -math.inf)
            o = torch.einsum("nkhc,ncd->nkhd", torch.softmax(s, -1), lat).reshape(N, K, H * hd)
            h = h + o @ self.w(p + "wo.weight").t()
            h = h + self._moe(b, rms_norm(h, self.w(p + "ffn_norm.weight"), eps))
        return rms_norm(h, self.w("dspark.norm.weight"), eps)

    def base_logits(self, h):
        return h @ self.head.t()

    def markov(self, prev):
        return self.w("dspark.markov_embed")[prev] @ self.w("dspark.markov_head").t()

    def confidence(self, hk, prev):
        f = torch.cat([hk, self.w("dspark.markov_embed")[prev]], -1)
        return torch.sigmoid(f @ self.w("dspark.conf.weight").t() + self.w("dspark.conf.bias"))[..., 0]

    def block_inputs(self, mx_seq, n, last):
        """One block after n context positions of mx_seq [T, D] (T >= n): the inputs of
        hidden() for N = 1, with `last` the token at position n."""
        c = self.cfg
        W, K = c.sliding_window, c.raw["dspark_block_size"]
        pos = torch.arange(n - W, n)
        valid = pos >= 0
        mx = torch.where(valid.unsqueeze(-1), mx_seq[pos.clamp_min(0)], torch.zeros(1))
        tokens = torch.tensor([last] + [c.dspark_noise_token_id] * (K - 1))
        return mx[None], pos[None], valid[None], tokens[None], torch.arange(n, n + K)[None]

    def draft(self, mx, ctx_pos, ctx_valid, tokens, tok_pos):
        """Greedy sequential drafting: (tokens [N, K], logits [N, K, V] incl. the Markov bias,
        confidences [N, K])."""
        h = self.hidden(mx, ctx_pos, ctx_valid, tokens, tok_pos)
        base = self.base_logits(h)
        prev = tokens[:, 0]
        out, logits, conf = [], [], []
        for k in range(tokens.shape[1]):
            lg = base[:, k] + self.markov(prev)
            conf.append(self.confidence(h[:, k], prev))
            prev = torch.argmax(lg, -1)
            out.append(prev)
            logits.append(lg)
        return torch.stack(out, 1), torch.stack(logits, 1), torch.stack(conf, 1)


def load(path, cfg, backbone):
    from . import safetensors_io
    tensors, _ = safetensors_io.read(path)
    d = DSpark(cfg, backbone)
    d.load_engine_tensors(tensors)
    return d


def save(draft, path, dtype="F32", metadata=None):
    from . import safetensors_io
    tensors = draft.engine_tensors()
    meta = {"format": "kvtier-dspark"}
    meta.update(metadata or {})
    safetensors_io.write(path, tensors, {n: dtype for n in tensors}, meta)
