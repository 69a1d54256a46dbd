"""The model configuration: the keys of engine/config.cc (HF `text_config`), same defaults.

Config.from_json(path) reads a config.json whose keys sit at the top level or inside
"text_config". Derived fields (layer_modes, kv_source_of_layer, first_decoder_layer) follow
reference section 2: a layer is Full when it is a KV source and an index source, Reindex when
only an index source, Reuse when neither (it reuses the last top-k), SwaOnly at ratio 0.
Only the invariants the reference relies on are checked here; engine/config.cc checks the rest.
"""
import json

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"

_DEFAULTS = {
    "num_key_value_heads": 1, "o_groups": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 0, "rope_scaling": {},
    "candidate_source_layer_id": -1, "candidate_topk_blocks": 0, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "swiglu_limit": 10.0, "engram_layer_ids": [],
    "engram_max_ngram_size": 0, "engram_n_heads": 0, "engram_head_dim": 0,
    "engram_vocab_size": [], "engram_pad_token_id": 2, "engram_seed": 0,
    "engram_compressed_vocab_size": 0, "dspark_noise_token_id": -1, "expert_format": "f32",
    "weight_format": "f32",
}
_REQUIRED = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "sliding_window", "compress_ratios",
    "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
]


class Config:
    def __init__(self, d):
        j = d["text_config"] if isinstance(d.get("text_config"), dict) else d
        self.raw = dict(j)
        for k in _REQUIRED:
            if k not in j:
                raise ValueError(f"config: missing {k}")
            setattr(self, k, j[k])
        for k, v in _DEFAULTS.items():
            setattr(self, k, j.get(k, v))
        if self.expert_format not in ("f32", "mxfp4"):
            raise ValueError('config: expert_format must be "f32" or "mxfp4"')
        if self.expert_format == "mxfp4" and (self.hidden_size % 32 or
                                              self.moe_intermediate_size % 32):
            raise ValueError("config: expert_format mxfp4 needs hidden_size and "
                             "moe_intermediate_size multiples of 32")
        if self.weight_format not in ("f32", "fp8"):
            raise ValueError('config: weight_format must be "f32" or "fp8"')
        if self.weight_format == "fp8" and any(
                v % 32 for v in (self.hidden_size, self.q_lora_rank,
                                 self.o_groups * self.o_lora_rank,
                                 self.moe_intermediate_size * self.n_shared_experts,
                                 self.engram_head_dim)):
            raise ValueError("config: weight_format fp8 needs hidden_size, q_lora_rank, "
                             "o_groups x o_lora_rank, moe_intermediate_size x n_shared_experts "
                             "and engram_head_dim multiples of 32")
        L = self.num_hidden_layers
        if len(self.compress_ratios) < L:
            raise ValueError("config: compress_ratios shorter than num_hidden_layers")
        self.compress_ratios = list(self.compress_ratios[:L])
        if not isinstance(self.engram_vocab_size, list):
            self.engram_vocab_size = [self.engram_vocab_size]
        if self.engram_layer_ids and len(self.engram_vocab_size) == 1:
            self.engram_vocab_size = self.engram_vocab_size * (self.engram_max_ngram_size - 1)
        if self.engram_compressed_vocab_size == 0:
            self.engram_compressed_vocab_size = self.vocab_size
        rs = self.rope_scaling or {}
        self.yarn = (rs.get("rope_type") or rs.get("type") or "") == "yarn" and (
            self.max_position_embeddings == 0
            or self.max_position_embeddings > rs.get("original_max_position_embeddings", 0))
        self.layer_modes, self.kv_source_of_layer = [], []
        source = -1
        for l in range(L):
            kv, idx = l in self.kv_source_layer_ids, l in self.index_source_layer_ids
            if self.compress_ratios[l] == 0:
                mode = SWA
            elif kv and idx:
                mode, source = FULL, l
            elif kv:
                raise ValueError(f"config: kv source {l} must also be an index source")
            else:
                mode = REINDEX if idx else REUSE
            if mode != SWA and source < 0:
                raise ValueError(f"config: layer {l} has no kv source before it")
            self.layer_modes.append(mode)
            self.kv_source_of_layer.append(source if mode != SWA else -1)
        self.first_decoder_layer = L // 2

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            return cls(json.load(f))

    def to_dict(self):
        return dict(self.raw)
