"""One decoder-only transformer with a static, pre-allocated KV cache, for every family we support.

The families differ only in ModelArgs fields (config.py; docs/models.md has the table): Llama, Mistral (sliding
window), Qwen2/3, Gemma 1/2/3, GPT-2, Phi-3 and Mixtral (mixture of experts) are all this one model.

The rotary embedding works on interleaved pairs (x0, x1), (x2, x3), ... as in Meta's original
Llama code and in GGUF files; Hugging Face checkpoints store q/k rows in a "half-split" order,
which scripts/convert_hf_checkpoint.py permutes into this one.
"""

import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from config import HIDDEN_ACTS, ModelArgs
from kernels import Kernels, Linear, fuses, linear, native_attention, pair_linear, runs_native_attention

ACTIVATIONS = dict(zip(HIDDEN_ACTS, (F.silu, functools.partial(F.gelu, approximate="tanh"))))


class KVCache(nn.Module):
    """Keys and values in slots, one a position (a sliding layer's rolling cache: those its ring holds,
    Transformer.setup_caches), stored per KV head (before GQA expansion) in stored (default: dtype, the model's):
    int8 stores codes and a float32 scale per position and head (max |x| / 127), quantized as they are written;
    another float dtype stores the values rounded to it. Either is read back in dtype."""

    def __init__(self, max_batch_size, slots, n_kv_heads, head_dim, dtype, stored: torch.dtype | None = None):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, slots, head_dim)
        self.dtype = dtype
        stored = stored or dtype
        quantized = stored == torch.int8
        self.register_buffer("k_cache", torch.zeros(shape, dtype=stored), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=stored), persistent=False)
        scales = (*shape[:3], 1)
        self.register_buffer("k_scale", torch.zeros(scales) if quantized else None, persistent=False)
        self.register_buffer("v_scale", torch.zeros(scales) if quantized else None, persistent=False)

    def update(self, slots: Tensor, k: Tensor, v: Tensor, cache_rows: Tensor | None = None):
        # k, v: [B, H_kv, S, D] written at slots, [S] for every row or [B, S] per row (a server's slots, each at
        # its own length), into cache rows 0..B-1 or the cache rows listed in cache_rows [B]
        for cache, scale, x in ((self.k_cache, self.k_scale, k), (self.v_cache, self.v_scale, v)):
            if scale is None:
                write_positions(cache, slots, x.to(cache.dtype), cache_rows)
            else:
                amax = x.float().abs().amax(-1, keepdim=True)
                codes = (x.float() * (127 / amax.clamp(min=torch.finfo(torch.float32).tiny))).round()
                write_positions(cache, slots, codes.to(torch.int8), cache_rows)
                write_positions(scale, slots, amax / 127, cache_rows)

    def read(self, rows: slice | Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The keys and values of some cache rows (a slice of them, or a tensor listing them) in slots 0..length-1,
        [rows, H_kv, length, D] in the model's dtype: views of the cache, or for listed rows (or a cache stored in
        another dtype) copies of those slots."""
        k, v = self.k_cache[rows, :, :length], self.v_cache[rows, :, :length]
        if self.k_scale is None:
            return k.to(self.dtype), v.to(self.dtype)
        k_scale, v_scale = self.k_scale[rows, :, :length], self.v_scale[rows, :, :length]
        return (k * k_scale).to(self.dtype), (v * v_scale).to(self.dtype)

    def buffers_by_position(self) -> list[Tensor]:
        return [b for b in (self.k_cache, self.v_cache, self.k_scale, self.v_scale) if b is not None]

    def copy_slots(self, source: int, row: int, slots: slice | Tensor):
        for cache in self.buffers_by_position():
            cache[row, :, slots] = cache[source, :, slots]

    def swap_rows(self, a: int, b: int, slots: slice):
        for cache in self.buffers_by_position():
            cache[[a, b], :, slots] = cache[[b, a], :, slots]


def write_positions(cache: Tensor, slots: Tensor, x: Tensor, cache_rows: Tensor | None):
    """x [B, H_kv, S, *] into cache [rows, H_kv, slots, *] at slots (see KVCache.update)."""
    if cache_rows is None and slots.dim() == 1:
        cache[: x.shape[0], :, slots] = x
    else:
        rows = torch.arange(x.shape[0], device=x.device) if cache_rows is None else cache_rows
        cache[rows[:, None], :, slots] = x.transpose(1, 2)  # [B, S] beside [B, 1]


class Transformer(nn.Module):
    kernels = Kernels()  # for the tied output projection, which has no module of its own

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        learned = config.position_embedding == "learned"
        self.pos_embeddings = nn.Embedding(config.block_size, config.dim) if learned else None
        self.layers = nn.ModuleList(TransformerBlock(config, kind) for kind in config.layer_types)
        self.norm = make_norm(config, config.dim)
        # With tied embeddings the output projection reuses tok_embeddings.weight and has no weight of its own.
        self.output = None if config.tie_word_embeddings else Linear(config.dim, config.vocab_size, bias=False)
        # the tied output's weight in oneDNN's layout, where the kernels keep one (set_kernels)
        self.register_buffer("packed_output", None, persistent=False)
        self.max_batch_size = -1
        self.max_seq_length = -1
        # Rolling caches (setup_caches): whether the sliding layers' are (else full-length), the ring's slots, the
        # reserved positions after it, the most positions a call takes, and the position each sliding layer's slot
        # holds [rows, 1, slots] (-1: none yet), where a layer slides.
        self.rolling, self.ring_size, self.reserved, self.chunk = False, -1, 0, -1
        self.register_buffer("ring_positions", None, persistent=False)
        # how the KV caches store keys and values (KVCache's stored): torch.int8 (quantized) or a float dtype; None:
        # in the model's dtype
        self.kv_cache_dtype: torch.dtype | None = None

    def kv_bytes_per_position(self, dtype: torch.dtype | None = None, kind: str | None = None) -> int:
        """The KV cache's bytes for one position of one row, over every layer (or those of one kind, full_attention
        or sliding_attention) of this rank under tensor parallelism: kv_cache_dtype's values where it is set (int8:
        codes and a float32 scale per head), else dtype's (default: the model's)."""
        heads = sum(layer.attention.n_kv_heads for layer in self.layers if kind in (None, layer.attention.kind))
        stored = self.kv_cache_dtype or dtype or self.tok_embeddings.weight.dtype
        per_head = self.config.head_dim + 4 if stored == torch.int8 else self.config.head_dim * stored.itemsize
        return 2 * heads * per_head

    def kv_cache_bytes(
        self, max_batch_size: int, max_seq_length: int, chunk: int | None = None, reserved: int = 0, dtype=None
    ) -> int:
        """The bytes of the KV caches setup_caches makes with these arguments: full layers' of max_seq_length
        positions, sliding layers' rolling ones (ring_length and reserved)."""
        ring = self.ring_length(max_seq_length, chunk, reserved) + reserved
        full, sliding = (self.kv_bytes_per_position(dtype, kind) for kind in ("full_attention", "sliding_attention"))
        return max_batch_size * (full * max_seq_length + sliding * ring)

    def ring_length(self, max_seq_length: int, chunk: int | None, reserved: int) -> int:
        """The slots of a sliding layer's rolling cache before its reserved ones: sliding_window + chunk - 1, or
        max_seq_length - reserved where that is no more (the ring then holds every position: a full-length cache)."""
        window = self.config.sliding_window or max_seq_length
        return min(window + min(chunk or max_seq_length, max_seq_length) - 1, max_seq_length - reserved)

    def kv_cache_figures(self) -> dict:
        """The KV caches' dtype (int8: quantized), bytes per position of a row, and bytes as set up (all rows)."""
        dtype = self.kv_cache_dtype or self.tok_embeddings.weight.dtype
        caches = [layer.attention.kv_cache for layer in self.layers if layer.attention.kv_cache is not None]
        return {
            "kv_cache_dtype": str(dtype).removeprefix("torch."),
            "kv_cache_bytes_per_token": self.kv_bytes_per_position(),
            "kv_cache_bytes": sum(b.nbytes for cache in caches for b in cache.buffers_by_position()),
        }

    def setup_caches(
        self,
        max_batch_size: int,
        max_seq_length: int,
        dtype: torch.dtype | None = None,
        chunk: int | None = None,
        reserved: int = 0,
    ):
        # dtype: the keys' and values' as attention reads them (default: the model's); the caches store them in
        # kv_cache_dtype where it is set.
        # chunk: the most positions a call takes (forward runs a longer one in pieces of chunk), which is also the most
        # by which a call may write past the first position of the next (a rejected draft's): a sliding layer then
        # keeps a rolling cache of sliding_window + chunk - 1 slots, a ring where position p takes slot p mod its
        # size (ring_slots), where that is fewer than max_seq_length (None: full-length caches). reserved: the last
        # positions, which take slots of their own after the ring (a server's idle rows write there; nobody reads them).
        if max_seq_length > self.config.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's block_size {self.config.block_size}")
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = self.tok_embeddings.weight.device
        c = self.config
        ring = self.ring_length(max_seq_length, chunk, reserved)
        size = self.kv_cache_bytes(max_batch_size, max_seq_length, chunk, reserved, dtype)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if device.type == "cpu" else None
        if memory is not None and size > memory:  # the allocation would not fail cleanly: the OOM killer ends us
            raise ValueError(
                f"a KV cache of {max_batch_size} rows x {max_seq_length} positions needs "
                f"{size / 1e9:.1f} GB, more than this machine's {memory / 1e9:.1f} GB"
            )
        try:
            for layer in self.layers:
                attn = layer.attention
                length = ring + reserved if attn.kind == "sliding_attention" else max_seq_length
                with torch.device(device):
                    attn.kv_cache = KVCache(
                        max_batch_size, length, attn.n_kv_heads, c.head_dim, dtype, self.kv_cache_dtype
                    )
        except torch.OutOfMemoryError:
            self.max_batch_size = self.max_seq_length = -1  # the layers' caches are mixed now: set up anew next time
            raise ValueError(
                f"a KV cache of {max_batch_size} rows x {max_seq_length} positions ({size / 1e9:.1f} GB) "
                f"does not fit in the free memory of {device}"
            ) from None
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.rolling, self.ring_size, self.reserved = ring + reserved < max_seq_length, ring, reserved
        self.chunk = min(chunk, max_seq_length) if self.rolling else max_seq_length
        held = torch.full((max_batch_size, 1, ring + reserved), -1, device=device) if c.sliding_window else None
        self.register_buffer("ring_positions", held, persistent=False)
        if c.position_embedding == "rope":
            freqs = precompute_freqs_cis(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
            self.register_buffer("freqs_cis", freqs.to(device), persistent=False)
            if c.rope_local_base is not None:
                local = precompute_freqs_cis(max_seq_length, c.head_dim, c.rope_local_base, None)
                self.register_buffer("local_freqs_cis", local.to(device), persistent=False)

    def forward(
        self,
        idx: Tensor,
        input_pos: Tensor,
        left_pad: Tensor | None = None,
        last_only: bool = False,
        cache_rows: Tensor | None = None,
        kv_length: int | tuple[int, ...] | None = None,
        fused_rows: int = 1,
    ) -> Tensor:
        # idx: [B, S] token ids in cache slots input_pos, [S] for every row or [B, S] per row; returns logits
        # [B, S, vocab] in float32. left_pad [B]: row b's first left_pad[b] slots hold padding; its real tokens
        # start at position 0. cache_rows [B]: the cache row each row uses (None: rows 0..B-1); a server prefills
        # requests into their own slots while the others keep theirs.
        # last_only: logits [B, 1, vocab] of the last position alone, which is all a prefill samples from
        # (the output projection over every prompt position is a large share of a short prefill).
        # kv_length: attend to the first kv_length cache slots only (None: all), which must hold every position
        # the queries see: a server's rows reach far less than its cache's length, and reading the rest of the
        # cache each step can cost more than reading the weights. A tuple: one length per group of consecutive
        # rows (the batch split in equal groups), each group attending to its own: a server's long prompts, in
        # rows of their own, no longer make every row read as far as they do.
        # fused_rows: the most rows a linear layer computes as a fused product on a CPU (kernels.linear), which only
        # a compiled step makes one pass over the weights: compile_steps passes more than 1 to its compiled steps.
        assert self.max_seq_length > 0, "call setup_caches() first"
        bsz, seqlen = idx.shape
        if seqlen > self.chunk:  # a rolling cache takes at most chunk new positions a call
            rest, n = (left_pad, last_only, cache_rows, kv_length, fused_rows), self.chunk
            pieces = [self(idx[:, a : a + n], input_pos[..., a : a + n], *rest) for a in range(0, seqlen, n)]
            return pieces[-1] if last_only else torch.cat(pieces, dim=1)
        if cache_rows is None and bsz > self.max_batch_size:
            raise ValueError(f"batch of {bsz} rows is larger than the cache, set up for {self.max_batch_size}")
        lengths = kv_length if isinstance(kv_length, tuple) else (kv_length,)
        if bsz % len(lengths):
            raise ValueError(f"a batch of {bsz} rows does not split into {len(lengths)} equal groups")
        for length in lengths:  # tells the compiler too, so that slicing the cache to it keeps it symbolic
            if length is not None:
                torch._check(length <= self.max_seq_length)
        positions, inputs = self.attention_inputs(input_pos, left_pad, bsz, lengths, cache_rows)
        x = self.embed(idx, positions)
        for layer in self.layers:
            freqs_cis, slots, masks = inputs[layer.attention.kind]
            x = layer(x, slots, freqs_cis, cache_rows, fused_rows, *masks)
        x = self.norm(x[:, -1:] if last_only else x)
        if self.output is None:
            rows = fused_rows if self.kernels.float_matvec == "fused" else 0
            weight, packed = self.tok_embeddings.weight, self.packed_output
            logits = linear(x, weight, fused_rows=rows, kernels=self.kernels, packed=packed)
        else:
            logits = self.output(x, fused_rows)
        return softcap(logits.float(), self.config.final_logit_softcap)

    def copy_positions(self, source: int, row: int, start: int, end: int):
        """Cache row row's keys and values at positions start..end-1 become row source's: a prefix of tokens both
        rows hold (a server's slots sharing a prompt's beginning). A rolling cache copies the positions of those
        its ring can hold, the last ring_size; whether source held them is for holds to say."""
        positions = torch.arange(max(start, end - self.ring_size), end, device=self.tok_embeddings.weight.device)
        ring = self.ring_slots(positions)
        for layer in self.layers:
            sliding = layer.attention.kind == "sliding_attention"
            layer.attention.kv_cache.copy_slots(source, row, ring if sliding else slice(start, end))
        if self.ring_positions is not None:
            self.ring_positions[row, :, ring] = self.ring_positions[source, :, ring]

    def swap_rows(self, a: int, b: int, end: int):
        """Cache rows a and b exchange their keys and values at positions 0..end-1 (a server's slots moving); a
        rolling cache, its ring's slots of those."""
        ring = slice(0, min(end, self.ring_size))
        for layer in self.layers:
            sliding = layer.attention.kind == "sliding_attention"
            layer.attention.kv_cache.swap_rows(a, b, ring if sliding else slice(0, end))
        if self.ring_positions is not None:
            self.ring_positions[[a, b], :, ring] = self.ring_positions[[b, a], :, ring]

    def holds(self, row: int, start: int, end: int, query: int | None = None) -> bool:
        """Whether cache row row still holds what its positions start..end-1 give a query at position query
        (default end): on a sliding layer, those of its last sliding_window positions. A rolling cache keeps the
        last ring_size positions written (a rejected draft's too), so a row going back to an earlier position (the
        next turn of a conversation, re-rendered) may find them gone; a full-length cache keeps all."""
        if self.ring_positions is None:
            return True
        query = end if query is None else query
        first = max(start, query - self.config.sliding_window + 1)
        positions = torch.arange(min(first, end), end, device=self.ring_positions.device)
        return bool((self.ring_positions[row, 0, self.ring_slots(positions)] == positions).all())

    def ring_slots(self, positions: Tensor) -> Tensor:
        """The slots of positions in a sliding layer's cache: p mod ring_size, and the reserved last positions in
        the slots after the ring (a full-length cache: p)."""
        first_reserved = self.max_seq_length - self.reserved
        return torch.where(
            positions < first_reserved, positions % self.ring_size, positions - first_reserved + self.ring_size
        )

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        """The first layer's input: token embeddings (plus learned position embeddings), [B, S, dim]."""
        x = self.tok_embeddings(idx)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(positions)
        if self.config.scale_embeddings:  # by sqrt(dim) rounded to the model's dtype, as Gemma's reference does
            x = x * torch.tensor(self.config.dim**0.5, dtype=x.dtype)
        return x

    def attention_inputs(
        self,
        input_pos: Tensor,
        left_pad: Tensor | None,
        bsz: int,
        kv_lengths: tuple[int | None, ...] = (None,),
        cache_rows: Tensor | None = None,
    ) -> tuple[Tensor, dict]:
        """Each row's positions [B, S] (0 at its first real token), and for each kind of layer its rotary
        angles [B, S, head_dim / 2, 2] (None without rotary embeddings), the cache slots input_pos is written to,
        and attention masks: one per group of consecutive rows (the batch split in len(kv_lengths) equal groups),
        [B / groups, 1, S, slots read]. Records the positions the sliding layers' slots now hold."""
        if left_pad is None:
            left_pad = torch.zeros(bsz, dtype=torch.long, device=input_pos.device)
        positions = (input_pos - left_pad[:, None]).clamp(min=0)  # [B, S]
        group = bsz // len(kv_lengths)
        rows = [slice(g * group, (g + 1) * group) for g in range(len(kv_lengths))]
        inputs = {}
        for kind in set(self.config.layer_types):
            if kind == "sliding_attention":
                slots = self.ring_slots(input_pos)
                write_positions(self.ring_positions, slots, input_pos.expand(bsz, -1)[:, None], cache_rows)
                held = self.ring_positions[:bsz] if cache_rows is None else self.ring_positions[cache_rows]
                masks = tuple(self.sliding_mask(held, input_pos, left_pad, r, n) for r, n in zip(rows, kv_lengths))
            else:
                slots = input_pos
                masks = tuple(self.attention_mask(input_pos, left_pad, r, n) for r, n in zip(rows, kv_lengths))
            freqs = None
            if self.config.position_embedding == "rope":
                local = kind == "sliding_attention" and self.config.rope_local_base is not None
                freqs = (self.local_freqs_cis if local else self.freqs_cis)[positions]
            inputs[kind] = (freqs, slots, masks)
        return positions, inputs

    def attention_mask(self, input_pos: Tensor, left_pad: Tensor, rows: slice, kv_length: int | None):
        """Which cache slots (the first kv_length) the queries of some rows see on a full layer, [rows, 1, S,
        kv_length]."""
        slots = torch.arange(self.max_seq_length if kv_length is None else kv_length, device=input_pos.device)
        at = input_pos if input_pos.dim() == 1 else input_pos[rows]  # [S] or [rows, S]
        # A query in slot p sees slots pad..p of its row; later slots hold stale or zero entries. A padding query
        # sees only itself, so that no softmax row is empty (its output is never used).
        seen = at[..., None] >= slots  # [S, kv_length] or [rows, S, kv_length]
        not_padding = slots >= left_pad[rows, None]  # [rows, kv_length]
        mask = (seen & not_padding[:, None, :]) | (at[..., None] == slots)
        return mask[:, None]

    def sliding_mask(self, held: Tensor, input_pos: Tensor, left_pad: Tensor, rows: slice, kv_length: int | None):
        """Which slots of a sliding layer's cache the queries of some rows see, [rows, 1, S, slots read], by the
        positions the slots hold (held [B, 1, slots], ring_positions' of the batch's rows): the last
        sliding_window positions up to the query's own, none of them padding. A rolling cache is read whole, a
        full-length one as far as kv_length."""
        length = held.shape[-1] if self.rolling or kv_length is None else kv_length
        h = held[rows, :, :length]  # [rows, 1, length]
        at = (input_pos if input_pos.dim() == 1 else input_pos[rows])[..., None]  # [S, 1] or [rows, S, 1]
        seen = (h <= at) & (at - h < self.config.sliding_window) & (h >= left_pad[rows, None, None])
        return (seen | (h == at))[:, None]  # a padding query sees only itself, as on a full layer


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, kind: str):
        super().__init__()
        self.attention = Attention(config, kind)
        self.feed_forward = MoEFeedForward(config) if config.n_experts else FeedForward(config)
        self.attention_norm = make_norm(config, config.dim)
        self.ffn_norm = make_norm(config, config.dim)
        post_norm = functools.partial(make_norm, config, config.dim) if config.post_norms else nn.Identity
        self.post_attention_norm, self.post_ffn_norm = post_norm(), post_norm()

    # Under torch.compile one layer's code is traced and compiled once and reused for every layer with the same
    # inputs' shapes and attributes (regional compilation; eagerly a no-op): a compile costs about one layer's,
    # not n_layer of them, for the same decode speed. The masks (one per group of rows) come as separate arguments:
    # Dynamo checks whether a tuple argument lets it reuse the layer's code far more slowly.
    @torch.compiler.nested_compile_region
    def forward(
        self, x: Tensor, slots: Tensor, freqs_cis: Tensor | None, cache_rows, fused_rows, *masks: Tensor
    ) -> Tensor:
        h = self.attention(self.attention_norm(x), slots, freqs_cis, masks, cache_rows, fused_rows)
        h = x + self.post_attention_norm(h)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h), fused_rows))


class Attention(nn.Module):
    kernels = Kernels()  # fused attention products, as the linear layers' (set_kernels)

    def __init__(self, config: ModelArgs, kind: str):
        super().__init__()
        self.kind = kind  # "full_attention" or "sliding_attention": which mask and rotary angles it takes
        self.n_head, self.n_kv_heads, self.head_dim = config.n_head, config.n_kv_heads, config.head_dim
        qkv_size = (config.n_head + 2 * config.n_kv_heads) * config.head_dim
        # q, k and v projections fused into one matrix: one matmul per layer instead of three.
        self.wqkv = Linear(config.dim, qkv_size, bias=config.attention_bias)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=config.attention_out_bias)
        qk_norm = functools.partial(make_norm, config, config.head_dim) if config.qk_norm else nn.Identity
        self.q_norm, self.k_norm = qk_norm(), qk_norm()
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.logit_softcap = config.attn_logit_softcap
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: Tensor,
        slots: Tensor,
        freqs_cis: Tensor | None,
        masks: tuple[Tensor, ...],
        cache_rows=None,
        fused_rows=1,
    ) -> Tensor:
        # slots: the cache slots of x's positions, [S] or [B, S] (Transformer.ring_slots on a sliding layer); masks:
        # one per group of consecutive rows (Transformer.attention_inputs), each as long as the slots its rows read
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x, fused_rows).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(bsz, seqlen, self.n_head, self.head_dim))
        k = self.k_norm(k.view(bsz, seqlen, self.n_kv_heads, self.head_dim))
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if freqs_cis is not None:
            q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
        self.kv_cache.update(slots, k, v, cache_rows)
        group, ys = bsz // len(masks), []
        for g, mask in enumerate(masks):
            rows = slice(g * group, (g + 1) * group)
            k_rows, v_rows = self.kv_cache.read(rows if cache_rows is None else cache_rows[rows], mask.shape[-1])
            ys.append(self.attend(q[rows], k_rows, v_rows, mask, fused_rows))
        y = torch.cat(ys)
        y = y.transpose(1, 2).reshape(bsz, seqlen, q_size)
        return self.wo(y, fused_rows)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, fused_rows: int) -> Tensor:
        # q [B, H, S, D], k and v [B, H_kv, T, D] (the slots the mask covers), mask [B, 1, S, T] -> [B, H, S, D].
        # A CPU's decode step of several rows takes kernels_cpu.cpp's attention, which reads the cache once for the
        # query heads that share it (kernels.runs_native_attention). Other decode steps take plain ops, which
        # inductor fuses (SDPA's CPU kernel has a fixed cost per call that exceeds one query's work); so does
        # soft-capping, which SDPA cannot do. A few queries a row, where the linear layers' products fuse (a
        # verification of drafts), take batched products: SDPA's CPU kernel costs about twice as much for them, and
        # fused multiply-and-sums more still.
        if runs_native_attention(q, k, v, self.logit_softcap, self.kernels):
            return native_attention(q, k, v, mask, self.scale)
        if fuses(q[0, 0], fused_rows) or self.logit_softcap is not None:
            fused = self.kernels.float_matvec == "fused" and q.shape[2] == 1 and fuses(q[0, 0], fused_rows)
            return grouped_attention(q, k, v, mask, self.scale, self.logit_softcap, fused)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_head != self.n_kv_heads
        )


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, logit_softcap: float | None, fused: bool = False
) -> Tensor:
    """softmax(q k^T * scale) v in float32. q [B, H, S, D], k and v [B, H_kv, T, D], mask [B, 1, S, T]; the
    query heads that share a KV head (head i uses KV head i // group) become rows of one product. fused: the
    products as multiply-and-sums, which torch.compile fuses with the softmax (run eagerly they would materialise
    [B, H_kv, group * S, T, D])."""
    bsz, n_head, seqlen, head_dim = q.shape
    n_kv = k.shape[1]
    rows, k, v = q.reshape(bsz, n_kv, n_head // n_kv * seqlen, head_dim).float(), k.float(), v.float()
    scores = (rows[:, :, :, None] * k[:, :, None]).sum(-1) if fused else rows @ k.transpose(-1, -2)
    scores = softcap(scores * scale, logit_softcap)  # [B, H_kv, group * S, T]
    scores = scores.view(bsz, n_kv, -1, seqlen, k.shape[2]).masked_fill(~mask[:, :, None], float("-inf"))
    # softmax, with its division after the product with v: one division per output, not one per cached position
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp().view(bsz, n_kv, -1, k.shape[2])
    y = (weights[..., None] * v[:, :, None]).sum(-2) if fused else weights @ v
    y = y / weights.sum(dim=-1, keepdim=True)
    return y.to(q.dtype).reshape(bsz, n_head, seqlen, head_dim)


def softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)  # gate (GPT-2: up)
        self.w3 = Linear(config.dim, config.intermediate_size, bias=config.mlp_bias) if config.gated_mlp else None  # up
        self.w2 = Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)  # down
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, fused_rows: int = 1) -> Tensor:
        if self.w3 is None:
            return self.w2(self.act(self.w1(x, fused_rows)), fused_rows)
        gate, up = pair_linear(self.w1, self.w3, x, fused_rows)  # one pass over both where kernels join them
        return self.w2(self.act(gate) * up, fused_rows)


class MoEFeedForward(nn.Module):
    """Mixture of experts (Mixtral): each token's output is the sum of its n_experts_per_token best-scored
    experts' outputs, weighted by the router's softmax renormalised over them.

    Every expert runs on every token, weighted zero where it was not chosen: one graph for any routing (no
    data-dependent shapes, so torch.compile has no graph break), and quantization and tensor parallelism
    treat each expert as an ordinary FeedForward. The price: n_experts / n_experts_per_token times the
    MLP work and weight reads of the experts actually chosen."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.top_k = config.n_experts_per_token
        # A plain parameter, not a Linear: quantization leaves the small, routing-critical router in float.
        self.router = nn.Parameter(torch.empty(config.n_experts, config.dim))
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(config.n_experts))

    def forward(self, x: Tensor, fused_rows: int = 1) -> Tensor:
        scores = F.linear(x, self.router).float().softmax(dim=-1)
        top, chosen = scores.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(scores).scatter(-1, chosen, top / top.sum(-1, keepdim=True)).to(x.dtype)
        return sum(weights[..., e, None] * expert(x, fused_rows) for e, expert in enumerate(self.experts))


def make_norm(config: ModelArgs, dim: int) -> nn.Module:
    if config.norm_type == "layernorm":
        return nn.LayerNorm(dim, config.norm_eps)
    return RMSNorm(dim, config.norm_eps, unit_offset=config.norm_type == "gemma_rmsnorm")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 as the references do, whatever the weights' dtype; Gemma's scales by 1 + weight
        # in float32 too, Llama's by weight in the input's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None, seq_len: int) -> Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "longrope":
        # Phi-3: a divisor per frequency, the long set when the sequence reaches past the original context.
        # Hugging Face picks the set on each call by the sequence so far; a static cache picks it once, by
        # the length it is set up for, so that keys already cached never mix the two sets.
        long = seq_len > scaling["original_max_position_embeddings"]
        return inv_freq / torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, base, scaling)
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_context / high, inv_freq, scaled)


def yarn_inv_freq(inv_freq: Tensor, head_dim: int, base: float, scaling: dict) -> Tensor:
    # YaRN: pairs that turn more than beta_fast times within the original context keep their frequency, pairs
    # that turn fewer than beta_slow times are divided by `factor`, and those between blend linearly by pair index.
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times in old_context
        return head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling.get("beta_fast", 32)), pair_turning(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    # cos and sin are multiplied by it, so attention logits by its square (longrope, YaRN). YaRN's default is the
    # paper's 0.1 ln(factor) + 1.
    if scaling is None:
        return 1.0
    if scaling["rope_type"] == "yarn" and "attention_factor" not in scaling:
        return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0
    return scaling.get("attention_factor", 1.0)


def precompute_freqs_cis(seq_len: int, head_dim: int, base: float, scaling: dict | None) -> Tensor:
    # Returns [seq_len, head_dim // 2, 2] holding (cos, sin) of each position's angle for each pair, times the
    # scaling's attention factor.
    inv_freq = rope_inv_freq(head_dim, base, scaling, seq_len).float()
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1) * rope_attention_factor(scaling)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x: [B, S, H, D], freqs_cis: [B, S, D/2, 2]; rotates each pair (x[2i], x[2i+1]) by its position's angle.
    xp = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, S, H, D/2, 2]
    fc = freqs_cis.unsqueeze(2)  # [B, S, 1, D/2, 2]
    out = torch.stack(
        [xp[..., 0] * fc[..., 0] - xp[..., 1] * fc[..., 1], xp[..., 1] * fc[..., 0] + xp[..., 0] * fc[..., 1]], dim=-1
    )
    return out.flatten(3).type_as(x)
