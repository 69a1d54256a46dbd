"""MiniV41: the miniature DeepSeek-V4.1-Flash forward in PyTorch (CPU), written from
../shared/reference/deepseek-v4.1-model.md (sections in brackets below). Also the training model.

Contract (see README.md):
  model = MiniV41(cfg)                        random init (torch.manual_seed decides it), or
  model = MiniV41.engine_init(cfg, seed)      the engine's own InitWeights(cfg, seed), bit for bit
  logits = model(ids, restore_at=None)        ids LongTensor[B, T] at positions 0..T-1;
                                              logits [B, T, vocab], teacher-forced.
  restore_at (LongTensor[B]) = s simulates a restore point (bounded replay [4]): a query at
  i >= s sees SWA keys only in [max(s, i-W+1), i], in every layer. Global KV (compressor,
  indexer keys) is computed as usual; with exact_replay=True (default) the compressor inputs of
  positions < s+W come from an unrestricted pass, i.e. the replayed tokens reuse the global KV
  of the original session exactly as the engine's ReplayTail does (it imports, never rewrites).
  model.ced(ids, prompt_len)                  CED prefill of ids[:, :prompt_len] then decode of
                                              the rest [1]: the decoder's SWA starts at
                                              prompt_len - min(W, prompt_len).
  model.replay(ids, hit)                      restore after `hit` tokens, bounded replay from
                                              hit - min(W, hit), then decode of the rest.
Every engine mode is a mask over one teacher-forced pass: each position's computation is causal
(decode one token at a time computes the same function as the full forward).

Quantisation (QAT, straight-through gradients): SWA keys FP8 e4m3 + ue8m0/32 [4], global KV
main entries FP4 e2m1 + e4m3/16 and index keys/queries FP4 + ue8m0/32 [5], Engram rows FP8 [6];
codes are bit-identical to kernels/. Top-k selections (indexer, candidate blocks, experts) are
hard selections with ties broken by the lowest index; the indexer gets no gradient.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from . import quant
from .config import FULL, REINDEX, SWA, Config
from .engram_hash import EngramHash


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, cos, sin, rd, inverse=False):
    """Rotates adjacent pairs of the last rd channels (complex pairs, [2]); cos/sin broadcast
    against x[..., :rd/2]."""
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([head, rot], -1)


def rope_frequencies(rd, theta, cfg):
    """RoPE frequencies (float64) with DeepSeek's YaRN ramp when cfg.yarn."""
    f = np.array([1.0 / theta ** (2.0 * i / rd) for i in range(rd // 2)])
    rs = cfg.rope_scaling or {}
    orig = rs.get("original_max_position_embeddings", 0)
    if cfg.yarn and orig > 0:
        def corr_dim(rot):
            return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(corr_dim(rs.get("beta_fast", 32.0))), 0.0)
        high = min(math.ceil(corr_dim(rs.get("beta_slow", 1.0))), rd - 1.0)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2) - low) / (high - low), 0.0, 1.0)
        smooth = 1 - ramp
        f = f / rs.get("factor", 1.0) * (1 - smooth) + f * smooth
    return f


def stable_topk(scores, k):
    """Indices of the k largest along the last dim, ties to the lowest index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def signed_sqrt(g):
    return torch.sign(g) * torch.sqrt(g.abs().clamp_min(1e-12))


# ---- the engine's parameter list and deterministic init (engine/weights.cc) ----------------

def engine_specs(cfg, engram_rows):
    """[(name, dtype, shape, init, gain)] in the engine's WeightSpecs order."""
    v = []

    def add(name, shape, init, gain=1.0, dtype="F32"):
        v.append((name, dtype, list(shape), init, gain))
    D, V, H, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    hc = cfg.hc_mult
    M = (2 + hc) * hc
    add("embed.weight", (V, D), "uniform", 1.0)
    add("norm.weight", (D,), "ones")
    add("head.weight", (V, D), "linear")
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        for sub in ("attn", "ffn"):
            add(p + f"hc_{sub}_fn", (M, hc * D), "linear")
            add(p + f"hc_{sub}_scale", (3,), "hc_scale", 0.5)
            add(p + f"hc_{sub}_base", (M,), "hc_base", 1.0)
        add(p + "attn_norm.weight", (D,), "ones")
        add(p + "ffn_norm.weight", (D,), "ones")
        add(p + "attn.wq_a.weight", (cfg.q_lora_rank, D), "linear")
        add(p + "attn.q_norm.weight", (cfg.q_lora_rank,), "ones")
        add(p + "attn.wq_b.weight", (H * hd, cfg.q_lora_rank), "linear")
        add(p + "attn.wkv.weight", (hd, D), "linear")
        add(p + "attn.kv_norm.weight", (hd,), "ones")
        add(p + "attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, H // cfg.o_groups * hd),
            "linear")
        add(p + "attn.wo_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), "linear", 0.5)
        add(p + "attn.attn_sink", (H,), "uniform", 0.5)
        if l in cfg.kv_source_layer_ids:
            add(p + "attn.compressor.wkv.weight", (hd, D), "linear")
            if cfg.compress_ratios[l] > 1:
                add(p + "attn.compressor.wgate.weight", (hd, D), "linear")
            add(p + "attn.compressor.norm.weight", (hd,), "ones")
            add(p + "attn.indexer.wk.weight", (cfg.index_head_dim, hd), "linear")
            add(p + "attn.indexer.k_norm.weight", (cfg.index_head_dim,), "ones")
            add(p + "attn.indexer.k_norm.bias", (cfg.index_head_dim,), "zeros")
        if l in cfg.index_source_layer_ids:
            add(p + "attn.indexer.wq_b.weight",
                (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "linear")
            add(p + "attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "linear")
        add(p + "ffn.gate.weight", (cfg.n_routed_experts, D), "linear")
        add(p + "ffn.gate.bias", (cfg.n_routed_experts,), "uniform", 0.1)
        I = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            ep = p + f"ffn.experts.{e}."
            add(ep + "w1.weight", (I, D), "linear")
            add(ep + "w3.weight", (I, D), "linear")
            add(ep + "w2.weight", (D, I), "linear", 0.5)
        if cfg.n_shared_experts > 0:
            IS = I * cfg.n_shared_experts
            add(p + "ffn.shared_experts.w1.weight", (IS, D), "linear")
            add(p + "ffn.shared_experts.w3.weight", (IS, D), "linear")
            add(p + "ffn.shared_experts.w2.weight", (D, IS), "linear", 0.5)
        if l in cfg.engram_layer_ids:
            slot = cfg.engram_layer_ids.index(l)
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            ed = cfg.engram_head_dim
            add(p + "engram.table", (engram_rows[slot], ed), "engram_data", 1.0, "F8_E4M3")
            add(p + "engram.table_scale", (engram_rows[slot], ed // 32), "engram_scale", 1.0,
                "F8_E8M0")
            add(p + "engram.wkv.weight", ((hc + 1) * D, cols * ed), "linear")
            add(p + "engram.q_norm.weight", (hc, D), "ones")
            add(p + "engram.k_norm.weight", (hc, D), "ones")
    return v


_M64 = (1 << 64) - 1


def _fnv1a(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001B3) & _M64
    return h


def _uniform_sym(state, n):
    """n draws of the engine's UniformSym (SplitMix64 >> 40, scaled to [-1, 1)) in float32."""
    with np.errstate(over="ignore"):
        z = np.uint64(state) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 / 16777216.0)
    return u - np.float32(1.0)


def engine_init_tensors(cfg, seed, engram_rows):
    """{name: tensor} equal to the engine's InitWeights(cfg, seed) (float32 and FP8 codes)."""
    out = {}
    for name, dtype, shape, init, gain in engine_specs(cfg, engram_rows):
        n = int(np.prod(shape))
        state = (seed ^ _fnv1a(name)) & _M64
        g = np.float32(gain)
        if init == "engram_scale":
            continue
        if init == "engram_data":
            x = torch.from_numpy(_uniform_sym(state, n).reshape(shape))
            codes, scodes = quant.quantize(x, quant.FP8_UE8M0X32)
            out[name] = codes.to(torch.uint8)
            out[name.replace("table", "table_scale")] = scodes.to(torch.uint8)
            continue
        if init == "linear":
            a = g * np.sqrt(np.float32(3.0) / np.float32(shape[-1]), dtype=np.float32)
            f = np.float32(a) * _uniform_sym(state, n)
        elif init == "uniform":
            f = g * _uniform_sym(state, n)
        elif init == "ones":
            f = np.full(n, g, dtype=np.float32)
        elif init == "zeros":
            f = np.zeros(n, dtype=np.float32)
        elif init == "hc_scale":
            f = np.array([g, g, g * np.float32(0.5)], dtype=np.float32)
        elif init == "hc_base":
            f = np.zeros(n, dtype=np.float32)
            hc = cfg.hc_mult
            for i in range(hc):
                f[2 * hc + i * hc + i] = g
        else:
            raise ValueError(init)
        out[name] = torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32).reshape(shape))
    return out


# ---- the model --------------------------------------------------------------------------------

class MiniV41(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if not isinstance(cfg, Config):
            cfg = Config(cfg)
        self.cfg = cfg
        self.hash = EngramHash(cfg) if cfg.engram_layer_ids else None
        self.engram_rows = self.hash.rows if self.hash else []
        self.specs = engine_specs(cfg, self.engram_rows)
        self.use_candidate_pool = True  # False: Reindex top-k over every visible entry
        # When a dict: the next pass stores the caches it makes there (golden.py uses it):
        # ("swa", l) -> SWA keys before FP8 [B, T, hd]; ("main", l) / ("index", l) -> global KV
        # entries before FP4 [B, E, hd|id]; ("xa", l) -> a Full layer's compressor input.
        self.capture = None
        # When a dict: every MoE pass adds its routed-expert token counts there, {layer:
        # LongTensor[n_routed_experts]} (train/train.py's routing-bias rule reads them).
        self.expert_load = None
        E = cfg.n_routed_experts
        self.params = torch.nn.ParameterDict()
        for name, dtype, shape, init, gain in self.specs:
            key = self._key(name)
            if key is None:
                continue
            if ".ffn.experts.0." in name:
                shape = [E] + shape
            t = torch.empty(shape)
            if name.endswith("ffn.gate.bias"):
                self.register_buffer(key, t)  # noaux_tc bias: updated by a rule, not by gradient
            else:
                self.params[key] = torch.nn.Parameter(t)
        self._init_random()
        rd = cfg.qk_rope_head_dim
        self.freqs = {False: rope_frequencies(rd, cfg.rope_theta, cfg),
                      True: rope_frequencies(rd, cfg.compress_rope_theta, cfg)}
        self._rope_cache = {}

    # -- parameter names ---------------------------------------------------------------------
    @staticmethod
    def _key(name):
        """Module key of an engine tensor name (experts stacked under expert 0's key; the
        Engram scale lives inside the float table)."""
        if name.endswith("engram.table_scale"):
            return None
        if ".ffn.experts." in name:
            parts = name.split(".")
            if parts[4] != "0":
                return None
            del parts[4]
            name = ".".join(parts)
        return name.replace(".", "__")

    def _get(self, key):
        return self.params[key] if key in self.params else getattr(self, key)

    # The dense projections that weight_format "fp8" defines as their FP8 rounding (E4M3 with a
    # UE8M0 scale per 32 inputs of a row), as the engine rounds them at load.
    FP8_WEIGHTS = frozenset([
        "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
        "ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight",
        "ffn.shared_experts.w2.weight", "engram.wkv.weight"])

    def p(self, l, suffix):
        w = self._get(f"layers__{l}__" + suffix.replace(".", "__"))
        if self.cfg.weight_format == "fp8" and suffix in self.FP8_WEIGHTS:
            w = quant.fake_quant(w, quant.FP8_UE8M0X32)  # straight through in training
        return w

    def _init_random(self):
        """Initial values for training (engine-like scales): uniform linear layers, ones for
        norms, near-identity mHC; driven by torch's global RNG (seed it first)."""
        with torch.no_grad():
            for name, dtype, shape, init, gain in self.specs:
                key = self._key(name)
                if key is None:
                    continue
                t = self._get(key)
                if init == "linear":
                    a = gain * math.sqrt(3.0 / shape[-1])
                    t.uniform_(-a, a)
                elif init in ("uniform", "engram_data"):
                    t.uniform_(-gain, gain)
                elif init == "ones":
                    t.fill_(gain)
                elif init == "zeros":
                    t.zero_()
                elif init == "hc_scale":
                    t.copy_(torch.tensor([gain, gain, gain * 0.5]))
                elif init == "hc_base":
                    t.zero_()
                    hc = self.cfg.hc_mult
                    for i in range(hc):
                        t[2 * hc + i * hc + i] = gain
            for slot, l in enumerate(self.cfg.engram_layer_ids):
                t = self.p(l, "engram.table")
                t.copy_(quant.round_trip(t, quant.FP8_UE8M0X32))

    def load_engine_tensors(self, tensors):
        """Loads {engine name: tensor} (float tensors any float dtype; Engram table as FP8 codes
        plus scale codes). Missing tensors or wrong shapes raise ValueError."""
        with torch.no_grad():
            for name, dtype, shape, init, gain in self.specs:
                if name not in tensors:
                    raise ValueError(f"weights: missing {name}")
                t = tensors[name]
                if list(t.shape) != shape:
                    raise ValueError(f"weights: {name} has shape {list(t.shape)}, want {shape}")
                key = self._key(name)
                if name.endswith("engram.table"):
                    scale = tensors[name + "_scale"]
                    t = quant.dequantize(t.long(), scale.long(), quant.FP8_UE8M0X32)
                elif key is None and ".ffn.experts." in name:
                    parts = name.split(".")
                    e = int(parts[4])
                    del parts[4]
                    self._get(".".join(parts).replace(".", "__"))[e].copy_(t.float())
                    continue
                elif key is None:
                    continue
                dst = self._get(key)
                if ".ffn.experts.0." in name:
                    dst[0].copy_(t.float())
                else:
                    dst.copy_(t.float())

    def engine_tensors(self):
        """{engine name: tensor}: float32 tensors and the Engram tables as FP8 codes + scales."""
        out = {}
        for name, dtype, shape, init, gain in self.specs:
            if name.endswith("engram.table_scale"):
                continue
            if ".ffn.experts." in name:
                parts = name.split(".")
                e = int(parts[4])
                del parts[4]
                out[name] = self._get(".".join(parts).replace(".", "__"))[e].detach()
            elif name.endswith("engram.table"):
                codes, scodes = quant.quantize(self._get(self._key(name)), quant.FP8_UE8M0X32)
                out[name] = codes.to(torch.uint8)
                out[name + "_scale"] = scodes.to(torch.uint8)
            else:
                out[name] = self._get(self._key(name)).detach()
        return out

    @classmethod
    def engine_init(cls, cfg, seed):
        """The engine's random init for (cfg, seed), bit for bit (engine/weights.cc)."""
        m = cls(cfg)
        m.load_engine_tensors(engine_init_tensors(m.cfg, seed, m.engram_rows))
        return m

    # -- helpers -------------------------------------------------------------------------------
    def _rope_tables(self, compressed, positions):
        """cos/sin float32 [len(positions), rd/2] for integer positions (angles in float64,
        as the engine computes them)."""
        key = (compressed, int(positions[0]) if len(positions) else 0, len(positions),
               int(positions[1] - positions[0]) if len(positions) > 1 else 1)
        if key not in self._rope_cache:
            ang = positions.double()[:, None] * torch.from_numpy(self.freqs[compressed])[None]
            self._rope_cache[key] = (torch.cos(ang).float(), torch.sin(ang).float())
            if len(self._rope_cache) > 64:
                self._rope_cache.pop(next(iter(self._rope_cache)))
        return self._rope_cache[key]

    def _hc(self, X, pre, l, sub):
        """mHC [7]: the sublayer input from the previous pre-mix, and this sublayer's own
        (next pre, post, comb)."""
        c = self.cfg
        B, T, hc, D = X.shape
        norm = self.p(l, "attn_norm.weight" if sub == 0 else "ffn_norm.weight")
        xn = rms_norm(torch.einsum("bti,btid->btd", pre, X), norm, c.rms_norm_eps)
        fn = self.p(l, f"hc_{'attn' if sub == 0 else 'ffn'}_fn")
        scale = self.p(l, f"hc_{'attn' if sub == 0 else 'ffn'}_scale")
        base = self.p(l, f"hc_{'attn' if sub == 0 else 'ffn'}_base")
        Xf = X.reshape(B, T, hc * D)
        mixes = (Xf @ fn.t()) * torch.rsqrt(Xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        eps = c.hc_eps
        pre_n = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
        post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = torch.softmax((mixes[..., 2 * hc:] * scale[2] + base[2 * hc:])
                             .view(B, T, hc, hc), -1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return xn, pre_n, post, comb

    @staticmethod
    def _hc_post(X, f, post, comb):
        """out_j = post_j * f + sum_i comb[i][j] * res_i  [7]."""
        return post.unsqueeze(-1) * f.unsqueeze(2) + torch.einsum("btij,btid->btjd", comb, X)

    def _engram(self, l, X, ids_np):
        """Engram [6]: gated n-gram memory added to each hc copy before the block."""
        c = self.cfg
        B, T, hc, D = X.shape
        slot = c.engram_layer_ids.index(l)
        rows = torch.from_numpy(self.hash.row_ids(slot, ids_np))
        emb = quant.fake_quant(self.p(l, "engram.table")[rows], quant.FP8_UE8M0X32)
        kv = emb.reshape(B, T, -1) @ self.p(l, "engram.wkv.weight").t()
        key = kv[..., :hc * D].view(B, T, hc, D)
        value = kv[..., hc * D:]
        eps = c.rms_norm_eps
        rh = torch.rsqrt(X.pow(2).mean(-1) + eps)
        rk = torch.rsqrt(key.pow(2).mean(-1) + eps)
        qw, kw = self.p(l, "engram.q_norm.weight"), self.p(l, "engram.k_norm.weight")
        g = (X * qw * kw * key).sum(-1) * rh * rk / math.sqrt(D)
        gate = torch.sigmoid(signed_sqrt(g))
        return X + gate.unsqueeze(-1) * value.unsqueeze(2)

    def _compress(self, l, xa, override, collect):
        """Compressor [2] + indexer keys [3] of a Full layer: entries j over tokens
        [j*m, (j+1)*m), FP4 global KV."""
        c = self.cfg
        B, T, D = xa.shape
        if collect is not None:
            collect[l] = xa.detach()
        if override is not None:
            comp, hit = override
            keep = torch.arange(T)[None, :, None] < hit.view(B, 1, 1)
            xa = torch.where(keep, comp[l], xa)
        m, hd, rd = c.compress_ratios[l], c.head_dim, c.qk_rope_head_dim
        E = T // m
        xg = xa[:, :E * m]
        kv = xg @ self.p(l, "attn.compressor.wkv.weight").t()
        if m > 1:
            score = xg @ self.p(l, "attn.compressor.wgate.weight").t()
            w = torch.softmax(score.view(B, E, m, hd), dim=2)  # per channel, over the group
            lat = (w * kv.view(B, E, m, hd)).sum(2)
        else:
            lat = kv
        lat = rms_norm(lat, self.p(l, "attn.compressor.norm.weight"), c.rms_norm_eps)
        cos, sin = self._rope_tables(True, torch.arange(E) * m)
        with torch.no_grad():
            ik = F.layer_norm(lat.detach() @ self.p(l, "attn.indexer.wk.weight").t(),
                              (c.index_head_dim,), self.p(l, "attn.indexer.k_norm.weight"),
                              self.p(l, "attn.indexer.k_norm.bias"), c.rms_norm_eps)
            ik = rope(ik, cos, sin, rd)
        main = rope(lat, cos, sin, rd)
        if self.capture is not None:
            self.capture[("main", l)] = main.detach()
            self.capture[("index", l)] = ik
            self.capture[("xa", l)] = xa.detach()
        ik = quant.round_trip(ik, quant.FP4_UE8M0X32)
        main = quant.fake_quant(main, quant.FP4_E4M3X16)
        return {"main": main, "ik": ik, "m": m, "E": E}

    def _select(self, l, qr, xa, rt):
        """Indexer top-k [3]: score = sum_h ReLU(q_h . k_j) * w_h over visible entries; at the
        candidate source also the block pool; Reindex layers restricted to that pool."""
        c = self.cfg
        B, T, _ = qr.shape
        src = rt["src"]
        m, E = src["m"], src["E"]
        IH, idim, rd = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        k = min(c.index_topk, E)
        if E == 0:
            return torch.zeros(B, T, 0, dtype=torch.long), torch.zeros(B, T, 0, dtype=torch.bool)
        with torch.no_grad():
            cos, sin = self._rope_tables(c.compress_ratios[l] > 0, torch.arange(T))
            iq = (qr @ self.p(l, "attn.indexer.wq_b.weight").t()).view(B, T, IH, idim)
            iq = quant.round_trip(rope(iq, cos[:, None], sin[:, None], rd), quant.FP4_UE8M0X32)
            wscale = np.float32(1.0) / np.sqrt(np.float32(idim)) / np.sqrt(np.float32(IH))
            w = (xa @ self.p(l, "attn.indexer.weights_proj.weight").t()) * float(wscale)
            dots = torch.einsum("bthd,bed->bthe", iq, src["ik"]).clamp_min(0)
            score = dots[:, :, 0] * w[..., 0:1]
            for h in range(1, IH):
                score = score + dots[:, :, h] * w[..., h:h + 1]
            nv = torch.clamp((torch.arange(T) + 1) // m, max=E)  # visible entries per query
            visible = (torch.arange(E)[None, :] < nv[:, None]).expand(B, T, E)
            bs = c.candidate_block_size
            if l == c.candidate_source_layer_id:
                nb = (E + bs - 1) // bs
                sc = F.pad(score.masked_fill(~visible, -math.inf), (0, nb * bs - E),
                           value=-math.inf)
                bscore = sc.view(B, T, nb, bs).amax(-1)
                nblk = (nv + bs - 1) // bs
                bvalid = (torch.arange(nb)[None, :] < nblk[:, None]).expand(B, T, nb)
                newest = (nblk - 1).clamp_min(0).view(1, T, 1).expand(B, T, 1)
                pinned = torch.zeros(B, T, nb, dtype=torch.bool).scatter(
                    -1, newest, (nblk > 0).view(1, T, 1).expand(B, T, 1))
                bscore = bscore.masked_fill(pinned, math.inf).masked_fill(~bvalid, -math.inf)
                top = stable_topk(bscore, min(c.candidate_topk_blocks, nb))
                rt["cand"] = torch.zeros(B, T, nb, dtype=torch.bool).scatter(
                    -1, top, bvalid.gather(-1, top))
            eligible = visible
            if (c.layer_modes[l] == REINDEX and self.use_candidate_pool and "cand" in rt):
                pool = rt["cand"].repeat_interleave(bs, dim=-1)[..., :E]
                eligible = eligible & pool
            idx = stable_topk(score.masked_fill(~eligible, -math.inf), k)
            ok = eligible.gather(-1, idx)
            return idx.masked_fill(~ok, 0), ok

    def _attention(self, l, xa, swa_valid, rt, override, collect):
        """Attention [2]: own Q and SWA keys; sparse attention over the SWA window plus the
        selected compressed entries, a per-head sink logit, one latent as K and V."""
        c = self.cfg
        B, T, D = xa.shape
        H, hd, rd, W = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.sliding_window
        mode = c.layer_modes[l]
        cos, sin = self._rope_tables(c.compress_ratios[l] > 0, torch.arange(T))
        eps = c.rms_norm_eps
        qr = rms_norm(xa @ self.p(l, "attn.wq_a.weight").t(), self.p(l, "attn.q_norm.weight"), eps)
        q = (qr @ self.p(l, "attn.wq_b.weight").t()).view(B, T, H, hd)
        q = rope(q, cos[:, None], sin[:, None], rd)
        kv = rms_norm(xa @ self.p(l, "attn.wkv.weight").t(), self.p(l, "attn.kv_norm.weight"), eps)
        kv = rope(kv, cos, sin, rd)
        if self.capture is not None:
            self.capture[("swa", l)] = kv.detach()
        kv = quant.fake_quant(kv, quant.FP8_UE8M0X32)
        scale = 1.0 / math.sqrt(hd)
        kwin = F.pad(kv, (0, 0, W - 1, 0)).unfold(1, W, 1)  # [B, T, hd, W]: keys i-W+1 .. i
        s_win = torch.einsum("bthd,btdw->bthw", q, kwin) * scale
        s_win = s_win.masked_fill(~swa_valid.unsqueeze(2), -math.inf)
        sink = self.p(l, "attn.attn_sink").view(1, 1, H, 1).expand(B, T, H, 1)
        parts = [sink, s_win]
        ksel = None
        if mode != SWA:
            if mode == FULL:
                rt["src"] = self._compress(l, xa, override, collect)
                if l != c.candidate_source_layer_id:
                    rt.pop("cand", None)
            if mode in (FULL, REINDEX):
                rt["topk"] = self._select(l, qr, xa, rt)
            idx, ok = rt["topk"]
            if idx.shape[-1] > 0:
                main = rt["src"]["main"]
                ksel = main[torch.arange(B).view(B, 1, 1), idx]  # [B, T, k, hd]
                s_sel = torch.einsum("bthd,btkd->bthk", q, ksel) * scale
                parts.append(s_sel.masked_fill(~ok.unsqueeze(2), -math.inf))
        p = torch.softmax(torch.cat(parts, -1), -1)
        o = torch.einsum("bthw,btdw->bthd", p[..., 1:1 + W], kwin)
        if ksel is not None:
            o = o + torch.einsum("bthk,btkd->bthd", p[..., 1 + W:], ksel)
        o = rope(o, cos[:, None], sin[:, None], rd, inverse=True)
        G, ol = c.o_groups, c.o_lora_rank
        wo_a = self.p(l, "attn.wo_a.weight").view(G, ol, -1)
        oa = torch.einsum("btgi,goi->btgo", o.reshape(B, T, G, -1), wo_a).reshape(B, T, G * ol)
        return oa @ self.p(l, "attn.wo_b.weight").t()

    def _moe(self, l, xn):
        """MoE [8]: sqrt(softplus) scores, top-k of score + bias, weights normalised and scaled,
        SwiGLU experts with clamps, plus the shared expert."""
        c = self.cfg
        B, T, D = xn.shape
        x = xn.reshape(B * T, D)
        lim = c.swiglu_limit
        s = torch.sqrt(F.softplus(x @ self.p(l, "ffn.gate.weight").t(), threshold=20.0))
        top = stable_topk(s.detach() + self.p(l, "ffn.gate.bias"), c.num_experts_per_tok)
        if self.expert_load is not None:
            counts = torch.bincount(top.reshape(-1), minlength=c.n_routed_experts)
            self.expert_load[l] = self.expert_load.get(l, 0) + counts
        sw = s.gather(1, top)
        if c.norm_topk_prob:
            sw = sw / sw.sum(1, keepdim=True)
        sw = sw * c.routed_scaling_factor

        def swiglu(xe, w1, w3, w2, weight=None):
            h = F.silu((xe @ w1.t()).clamp(max=lim)) * (xe @ w3.t()).clamp(-lim, lim)
            if weight is not None:
                h = h * weight  # router weight before w2
            return h @ w2.t()
        if c.n_shared_experts > 0:
            out = swiglu(x, self.p(l, "ffn.shared_experts.w1.weight"),
                         self.p(l, "ffn.shared_experts.w3.weight"),
                         self.p(l, "ffn.shared_experts.w2.weight"))
        else:
            out = torch.zeros_like(x)
        w1, w3, w2 = (self.p(l, f"ffn.experts.{n}.weight") for n in ("w1", "w3", "w2"))
        if c.expert_format == "mxfp4":
            # Routed experts in MXFP4 (reference section 8): each row's blocks of 32 inputs
            # rounded to E2M1 x UE8M0 (straight-through in training), as the engine does at load.
            w1, w3, w2 = (quant.fake_quant(w, quant.FP4_UE8M0X32) for w in (w1, w3, w2))
        for e in range(c.n_routed_experts):
            tok, slot = (top == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = swiglu(x[tok], w1[e], w3[e], w2[e], sw[tok, slot].unsqueeze(-1))
            out = out.index_add(0, tok, y)
        return out.view(B, T, D)

    # -- passes --------------------------------------------------------------------------------
    def _run(self, ids, swa_start=None, swa_from_layer=0, override=None, collect=None,
             want_logits=True):
        c = self.cfg
        B, T = ids.shape
        hc, W = c.hc_mult, c.sliding_window
        X = self.params["embed__weight"][ids].unsqueeze(2).expand(B, T, hc, c.hidden_size)
        pre = torch.zeros(B, T, hc)
        pre[..., 0] = 1.0  # the first sublayer's one-hot pre-mix on copy 0
        pos = torch.arange(T)
        keypos = pos[:, None] - (W - 1) + torch.arange(W)[None, :]  # [T, W]
        valid = (keypos >= 0).unsqueeze(0).expand(B, T, W)
        if swa_start is not None:
            s = swa_start.view(B, 1, 1)
            restricted = valid & ~((pos.view(1, T, 1) >= s) & (keypos.unsqueeze(0) < s))
        ids_np = ids.cpu().numpy()
        rt = {}
        for l in range(c.num_hidden_layers):
            if l in c.engram_layer_ids:
                X = self._engram(l, X, ids_np)
            v = restricted if swa_start is not None and l >= swa_from_layer else valid
            xn, pre_n, post, comb = self._hc(X, pre, l, 0)
            X = self._hc_post(X, self._attention(l, xn, v, rt, override, collect), post, comb)
            xn, pre, post, comb = self._hc(X, pre_n, l, 1)
            X = self._hc_post(X, self._moe(l, xn), post, comb)
        if not want_logits:
            return None
        y = rms_norm(torch.einsum("bti,btid->btd", pre, X), self.params["norm__weight"],
                     c.rms_norm_eps)
        return y @ self.params["head__weight"].t()

    def forward(self, ids, restore_at=None, exact_replay=True):
        if restore_at is None:
            return self._run(ids)
        restore_at = torch.as_tensor(restore_at, dtype=torch.long).view(-1)
        override = None
        if exact_replay:
            comp = {}
            with torch.no_grad():
                self._run(ids, collect=comp, want_logits=False)
            override = (comp, restore_at + self.cfg.sliding_window)
        return self._run(ids, swa_start=restore_at, override=override)

    def ced(self, ids, prompt_len):
        """CED prefill of ids[:, :prompt_len], then decode of the rest: logits [B, T, V]; rows
        before prompt_len - min(W, prompt_len) are the encoder-only prefix (not computed by the
        engine's decoder; returned as a full forward computes them)."""
        start = prompt_len - min(self.cfg.sliding_window, prompt_len)
        B = ids.shape[0]
        return self._run(ids, swa_start=torch.full((B,), start, dtype=torch.long),
                         swa_from_layer=self.cfg.first_decoder_layer)

    def replay(self, ids, hit):
        """Restore after `hit` tokens (global KV imported), bounded replay of the last
        min(W, hit), then decode of the rest: logits [B, T, V] (rows >= hit - 1 are what the
        engine computes)."""
        start = hit - min(self.cfg.sliding_window, hit)
        return self.forward(ids, restore_at=torch.full((ids.shape[0],), start, dtype=torch.long))


def load(path, cfg):
    """MiniV41 with the weights of an engine safetensors file (any float dtype)."""
    from . import safetensors_io
    tensors, _ = safetensors_io.read(path)
    m = MiniV41(cfg)
    m.load_engine_tensors(tensors)
    return m


def save(model, path, dtype="F32", metadata=None):
    """Writes the engine's safetensors: float tensors as dtype (F32, F16 or BF16), Engram tables
    as FP8 e4m3 codes + ue8m0 scales."""
    from . import safetensors_io
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"save: dtype {dtype}")
    tensors = model.engine_tensors()
    dtypes = {n: ("F8_E4M3" if n.endswith("engram.table") else "F8_E8M0"
                  if n.endswith("engram.table_scale") else dtype) for n in tensors}
    meta = {"format": "kvtier-engine"}
    meta.update(metadata or {})
    safetensors_io.write(path, tensors, dtypes, meta)
