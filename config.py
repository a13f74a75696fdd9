"""A checkpoint's config.json: the ModelArgs that make model.Transformer one family or another, checked strictly
(a config is user input: a wrong type or value fails here, naming the field, not later with an obscure error).
"""

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import get_args

LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # model.ACTIVATIONS maps each to its function


@dataclass
class ModelArgs:
    dim: int
    n_layer: int
    n_head: int
    intermediate_size: int
    vocab_size: int
    n_kv_heads: int | None = None  # None: same as n_head (no GQA)
    head_dim: int | None = None  # None: dim // n_head
    block_size: int = 2048  # maximum number of positions
    rope_base: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "longrope" | "yarn", "factor", ...}
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama's attention_bias also sets the next one)
    attention_out_bias: bool = False  # bias on the attention output projection
    norm_type: str = "rmsnorm"  # or "gemma_rmsnorm" (scales by 1 + weight), "layernorm" (GPT-2: with bias)
    hidden_act: str = "silu"  # or "gelu_tanh" (Gemma, GPT-2)
    gated_mlp: bool = True  # w2(act(w1 x) * w3 x); False: w2(act(w1 x)) (GPT-2)
    mlp_bias: bool = False
    position_embedding: str = "rope"  # or "learned" (GPT-2: a table of block_size positions, no rotary)
    scale_embeddings: bool = False  # multiply embeddings by sqrt(dim) (Gemma)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3, Gemma 3)
    post_norms: bool = False  # normalise attention and MLP outputs before the residual sum too (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power; None: head_dim's
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits
    sliding_window: int | None = None  # sliding layers see this many positions, their own included
    layer_types: list | None = None  # "full_attention" or "sliding_attention" per layer; None: all sliding
    #   if sliding_window is set, else all full
    rope_local_base: float | None = None  # rotary base of sliding layers, unscaled (Gemma 3); None: as full ones
    n_experts: int = 0  # mixture of experts per layer (Mixtral); 0: one dense MLP
    n_experts_per_token: int = 2

    def __post_init__(self):
        # Types first: a config is user input, and a wrong type would fail later with an obscure error.
        check_types(self)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.head_dim is None:
            if self.n_head > 0 and self.dim % self.n_head:
                raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}; give head_dim")
            self.head_dim = self.dim // max(self.n_head, 1)
        check_values(self)
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[self.sliding_window is not None]] * self.n_layer
        check_layers(self)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = json.loads(path.read_bytes())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"config {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config {path}: expected a JSON object of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config {path}: unknown fields {unknown}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ValueError(f"config {path}: missing fields {missing}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"config {path}: {e}") from None

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, indent=2)


def check_types(args: ModelArgs):
    for f in fields(args):
        value, allowed = getattr(args, f.name), get_args(f.type) or (f.type,)
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # JSON writes 10000.0 as 10000
            setattr(args, f.name, value)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r}")


SIZES = ("dim", "n_layer", "n_head", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size", "block_size")
SCALES = (
    "rope_base",
    "norm_eps",
    "query_pre_attn_scalar",
    "attn_logit_softcap",
    "final_logit_softcap",
    "rope_local_base",
)
CHOICES = {
    "norm_type": ("rmsnorm", "gemma_rmsnorm", "layernorm"),
    "hidden_act": HIDDEN_ACTS,
    "position_embedding": ("rope", "learned"),
}


def check_values(args: ModelArgs):
    for name in SIZES:
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {getattr(args, name)!r}")
    for name in SCALES:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    for name, allowed in CHOICES.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(args, name)!r}")
    if args.sliding_window is not None and args.sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive integer, got {args.sliding_window!r}")
    if args.n_experts < 0:
        raise ValueError(f"n_experts must be >= 0, got {args.n_experts}")
    if args.n_experts and not 0 < args.n_experts_per_token <= args.n_experts:
        raise ValueError(f"n_experts_per_token must be in 1..{args.n_experts}, got {args.n_experts_per_token}")
    if args.n_head % args.n_kv_heads:
        raise ValueError(f"n_head {args.n_head} is not divisible by n_kv_heads {args.n_kv_heads}")
    if args.head_dim % 2:
        raise ValueError(f"head_dim {args.head_dim} must be even for rotary embeddings")
    if args.rope_scaling is not None:
        check_rope_scaling(args.rope_scaling, args.head_dim)


def check_layers(args: ModelArgs):
    if len(args.layer_types) != args.n_layer or not set(args.layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {args.n_layer} of {', '.join(LAYER_TYPES)}, got {args.layer_types!r}")
    if "sliding_attention" in args.layer_types and args.sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")


# The numbers each kind of rope_scaling takes (longrope also takes short_factor and long_factor lists).
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "longrope": ("original_max_position_embeddings", "attention_factor"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# YaRN's numbers with defaults (the paper's, as transformers takes them), and truncate (true: whole pairs).
YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow")


def positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_rope_scaling(scaling: dict, head_dim: int):
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"unsupported rope_scaling {scaling!r} (supported: {', '.join(ROPE_SCALING_KEYS)})")
    for key in ROPE_SCALING_KEYS[kind]:
        if not positive_number(scaling.get(key)):
            raise ValueError(f"rope_scaling {key} must be a positive number, got {scaling.get(key)!r}")
    for key in YARN_OPTIONAL_KEYS if kind == "yarn" else ():
        if key in scaling and not positive_number(scaling[key]):
            raise ValueError(f"rope_scaling {key} must be a positive number, got {scaling[key]!r}")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"rope_scaling truncate must be true or false, got {scaling['truncate']!r}")
    yarn_keys = {"rope_type", "truncate", *ROPE_SCALING_KEYS["yarn"], *YARN_OPTIONAL_KEYS}
    if kind == "yarn" and set(scaling) - yarn_keys:
        raise ValueError(f"rope_scaling has unknown keys {sorted(set(scaling) - yarn_keys)} for yarn")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling high_freq_factor must exceed low_freq_factor")
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2 or not all(map(positive_number, factors)):
            raise ValueError(f"rope_scaling {key} must be a list of {head_dim // 2} positive numbers")
