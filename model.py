"""A Llama-family transformer with a static, pre-allocated KV cache.

The rotary embedding works on interleaved pairs (x0, x1), (x2, x3), ... as in Meta's original
Llama code and in GGUF files; Hugging Face checkpoints store q/k rows in a "half-split" order,
which scripts/convert_hf_checkpoint.py permutes into this one.
"""
import json
import math
import os
from dataclasses import MISSING, dataclass, fields
from typing import get_args
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


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
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama's attention_bias also sets the next one)
    attention_out_bias: bool = False  # bias on the attention output projection

    def __post_init__(self):
        # Types first: a config is user input, and a wrong type would fail later with an obscure error.
        for f in fields(self):
            value, allowed = getattr(self, f.name), get_args(f.type) or (f.type,)
            if float in allowed and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)  # JSON writes 10000.0 as 10000
                setattr(self, f.name, value)
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{f.name} must be {names}, got {value!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_head
        if self.head_dim is None:
            if self.n_head > 0 and self.dim % self.n_head:
                raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}; give head_dim")
            self.head_dim = self.dim // max(self.n_head, 1)
        for name in ("dim", "n_layer", "n_head", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("rope_base", "norm_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive finite number, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)

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


LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: dict):
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope_scaling {scaling!r} (only 'llama3' is supported)")
    for key in LLAMA3_SCALING_KEYS:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling high_freq_factor must exceed low_freq_factor")


@dataclass(frozen=True)
class Kernels:
    """How a CPU runs the linear layers: a speed choice made once at load time (see choose), recorded in the
    run's figures. Numerics follow from it: "fused" computes one-row products in float32; ATen's int8/int4
    kernels compute with kernel_activations (on x86 they are vectorised for bfloat16 only: float32 is exact
    but about 10x slower)."""

    float_matvec: str = "library"  # one-row products with float weights: "library" (BLAS) or "fused"
    quant_matvec: str = "library"  # one-row products with int8/int4 weights: "library" (ATen's kernels) or "fused"
    gemm_dtype: torch.dtype = torch.float32  # many-row int8 products widen the weights to this dtype
    kernel_activations: torch.dtype = torch.bfloat16  # what ATen's int8/int4 kernels are fed

    @classmethod
    def choose(cls, device: torch.device, compiled: bool, matvec: str = "auto") -> "Kernels":
        """The fastest measured choice for this CPU (scripts/benchmark.py --kernels shows the measurements).

        "fused" is a multiply-and-sum that torch.compile turns into one pass over the weights in their own
        dtype; run eagerly it would materialise the product, so it is for compiled steps. It wins for float
        weights on every CPU measured, and for int8/int4 ones where AVX-512 converts bytes to floats fast
        enough; on AVX2 ATen's int8/int4 kernels are faster. Widening int8 weights to bfloat16 for a matrix
        product pays off only with native bfloat16 (AVX512-BF16, AMX): 4x slower than float32 without it."""
        if matvec not in ("auto", "fused", "library"):
            raise ValueError(f"unknown --kernels {matvec!r}: use auto, fused or library")
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        native_bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
        gemm_dtype = torch.bfloat16 if native_bf16 else torch.float32
        if matvec != "auto":
            return cls(matvec, matvec, gemm_dtype)
        fused = "fused" if compiled and device.type == "cpu" else "library"
        return cls(fused, fused if avx512 else "library", gemm_dtype)

    def describe(self) -> dict:
        dtypes = {"gemm_dtype": self.gemm_dtype, "kernel_activations": self.kernel_activations}
        return {"cpu": torch.backends.cpu.get_cpu_capability(), "float_matvec": self.float_matvec,
                "quant_matvec": self.quant_matvec, **{k: str(v).removeprefix("torch.") for k, v in dtypes.items()}}


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: all of them but the embedding table, of which it reads one
    row, unless the output projection reuses it (tied embeddings)."""
    skip = {"tok_embeddings.weight"} if model.output is not None else set()
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if name not in skip)


def set_kernels(model: nn.Module, kernels: Kernels):
    """Gives every module that computes a linear layer (and the model, for a tied output) this choice."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def ensure_caches(model: "Transformer", batch_size: int, prompt_len: int, max_new_tokens: int, keep: bool = False):
    """Checks the request fits the model; sets up KV caches unless big enough ones exist (or keep is set)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = prompt_len + max_new_tokens
    if needed > model.config.block_size:
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"block_size ({model.config.block_size})"
        )
    # Reusing caches keeps the compiled decode step's shapes, so it does not recompile.
    if model.max_seq_length >= needed and model.max_batch_size >= batch_size:
        return
    if keep:
        raise ValueError(
            f"{batch_size} rows of {needed} positions do not fit the KV cache "
            f"({model.max_batch_size} rows of {model.max_seq_length})"
        )
    model.setup_caches(batch_size, needed)


class KVCache(nn.Module):
    """Keys and values of every position, stored per KV head (before GQA expansion)."""

    def __init__(self, max_batch_size, max_seq_length, n_kv_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k, v: [B, H_kv, S, D] written at positions input_pos [S]; returns the whole cache
        batch = k.shape[0]
        self.k_cache[:batch, :, input_pos] = k
        self.v_cache[:batch, :, input_pos] = v
        return self.k_cache[:batch], self.v_cache[:batch]


class Transformer(nn.Module):
    kernels = Kernels()  # for the tied output projection, which has no module of its own

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # With tied embeddings the output projection reuses tok_embeddings.weight and has no weight of its own.
        self.output = None if config.tie_word_embeddings else Linear(config.dim, config.vocab_size, bias=False)
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype: torch.dtype | None = None):
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's block_size {self.config.block_size}")
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = self.tok_embeddings.weight.device
        c = self.config
        heads = sum(layer.attention.n_kv_heads for layer in self.layers)  # fewer per rank under tensor parallelism
        size = 2 * heads * max_batch_size * max_seq_length * c.head_dim * dtype.itemsize
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if device.type == "cpu" else None
        if memory is not None and size > memory:  # the allocation would not fail cleanly: the OOM killer ends us
            raise ValueError(f"a KV cache of {max_batch_size} rows x {max_seq_length} positions needs "
                             f"{size / 1e9:.1f} GB, more than this machine's {memory / 1e9:.1f} GB")  # fmt: skip
        try:
            for layer in self.layers:
                attn = layer.attention
                with torch.device(device):
                    attn.kv_cache = KVCache(max_batch_size, max_seq_length, attn.n_kv_heads, c.head_dim, dtype)
        except torch.OutOfMemoryError:
            self.max_batch_size = self.max_seq_length = -1  # the layers' caches are mixed now: set up anew next time
            raise ValueError(f"a KV cache of {max_batch_size} rows x {max_seq_length} positions ({size / 1e9:.1f} GB) "
                             f"does not fit in the free memory of {device}") from None  # fmt: skip
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        freqs = precompute_freqs_cis(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("freqs_cis", freqs.to(device), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, left_pad: Tensor | None = None, last_only: bool = False) -> Tensor:
        # idx: [B, S] token ids in cache slots input_pos [S]; returns logits [B, S, vocab] in float32.
        # left_pad [B]: row b's first left_pad[b] slots hold padding; its real tokens start at rotary position 0.
        # last_only: logits [B, 1, vocab] of the last position alone, which is all a prefill samples from
        # (the output projection over every prompt position was 14% of a 128-token float32 prefill here).
        assert self.max_seq_length > 0, "call setup_caches() first"
        bsz = idx.shape[0]
        if bsz > self.max_batch_size:
            raise ValueError(f"batch of {bsz} rows is larger than the cache, set up for {self.max_batch_size}")
        freqs_cis, mask = self.attention_inputs(input_pos, left_pad, bsz)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x[:, -1:] if last_only else x)
        if self.output is None:
            logits = linear(x, self.tok_embeddings.weight, fused=self.kernels.float_matvec == "fused")
        else:
            logits = self.output(x)
        return logits.float()

    def attention_inputs(self, input_pos: Tensor, left_pad: Tensor | None, bsz: int) -> tuple[Tensor, Tensor]:
        """Rotary angles [B, S, head_dim / 2, 2] and attention mask [B, 1, S, max_seq] for these positions."""
        if left_pad is None:
            left_pad = torch.zeros(bsz, dtype=torch.long, device=input_pos.device)
        slots = torch.arange(self.max_seq_length, device=input_pos.device)
        # A query in slot p sees slots pad..p of its row; later slots hold stale or zero entries.
        # A padding query sees only itself, so that no softmax row is empty (its output is never used).
        causal = input_pos[:, None] >= slots  # [S, max_seq]
        not_padding = slots >= left_pad[:, None]  # [B, max_seq]
        mask = (causal & not_padding[:, None, :]) | (input_pos[:, None] == slots)  # [B, S, max_seq]
        positions = (input_pos - left_pad[:, None]).clamp(min=0)  # [B, S]
        return self.freqs_cis[positions], mask[:, None]


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), input_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = config.n_head, config.n_kv_heads, config.head_dim
        qkv_size = (config.n_head + 2 * config.n_kv_heads) * config.head_dim
        # q, k and v projections fused into one matrix: one matmul per layer instead of three.
        self.wqkv = Linear(config.dim, qkv_size, bias=config.attention_bias)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=config.attention_out_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, H_kv, max_seq, D]
        if seqlen == 1:  # a decode step: plain ops, which inductor fuses (SDPA's CPU kernel costs ~0.1 ms a call)
            y = one_query_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv_heads)
        y = y.transpose(1, 2).reshape(bsz, seqlen, q_size)
        return self.wo(y)


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d)) v for one query position. q [B, H, 1, D], k and v [B, H_kv, T, D],
    mask [B, 1, 1, T]; the query heads that share a KV head (head i uses KV head i // group) become rows."""
    bsz, n_head, _, head_dim = q.shape
    rows = q.reshape(bsz, k.shape[1], n_head // k.shape[1], head_dim)
    scores = (rows.float() @ k.float().transpose(-1, -2)) / math.sqrt(head_dim)  # [B, H_kv, group, T]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ v.float()).to(q.dtype).reshape(bsz, n_head, 1, head_dim)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scales: Tensor | None = None,
           fused: bool = False) -> Tensor:  # fmt: skip
    """x @ weight.T, times per-output scales (int8 weights), plus bias, in x's dtype. fused (for one row on a
    CPU): as a float32 multiply-and-sum, which torch.compile fuses into one pass over the weights."""
    if fused and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        y = (x.reshape(1, -1).float() * weight.float()).sum(-1)
        y = (y if scales is None else y * scales).to(x.dtype).reshape(*x.shape[:-1], -1)
    elif scales is None:
        y = F.linear(x, weight)
    else:  # int8 weights, widened for the product (on CUDA, torch.compile fuses that into it)
        y = F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    kernels = Kernels()

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, fused=self.kernels.float_matvec == "fused")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 as the reference does, whatever the weights' dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_context / high, inv_freq, scaled)


def precompute_freqs_cis(seq_len: int, head_dim: int, base: float, scaling: dict | None) -> Tensor:
    # Returns [seq_len, head_dim // 2, 2] holding (cos, sin) of each position's angle for each pair.
    inv_freq = rope_inv_freq(head_dim, base, scaling).float()
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x: [B, S, H, D], freqs_cis: [B, S, D/2, 2]; rotates each pair (x[2i], x[2i+1]) by its position's angle.
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, S, H, D/2, 2]
    fc = freqs_cis.unsqueeze(2)  # [B, S, 1, D/2, 2]
    out = torch.stack(
        [xp[..., 0] * fc[..., 0] - xp[..., 1] * fc[..., 1], xp[..., 1] * fc[..., 0] + xp[..., 0] * fc[..., 1]], dim=-1
    )
    return out.flatten(3).type_as(x)
