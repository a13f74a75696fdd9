"""The model steps of a generation and the loops over them.

A step is one static-shape function: prefill, decode_one_token, draft_step, verify_step (Steps holds them, eager or
compiled by compile_steps). Sampling runs on the device inside the step, with its settings passed as tensors, so
new values never recompile it. token_steps yields a batch's tokens, Stream one prompt's text as it comes, and
draft_and_verify is the model work of a speculative round (generate.speculative_generate and the server's engine).
"""

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from kernels import FUSED_ROWS
from model import Transformer
from results import Generation, TextPieces, check_stop, collect, synchronize
from sampling import (
    SETTINGS,
    SamplerState,
    SamplingParams,
    apply_penalties,
    check_logprobs,
    record_token,
    refill_noise,
    sample,
    sampler_state,
    step_probs,
    token_logprobs,
)
from tokenizer import Tokenizer

# A decode-shaped step attends to the cache slots up to its furthest position, rounded up to a multiple of these
# (attention_window): on CUDA, where a graph is recorded per length met, to bound their number; elsewhere, where one
# compiled graph serves every length, to whole vectors of 16 floats: the slots past the furthest position are read
# for nothing.
WINDOW_STEPS = {"cuda": 128}
VECTOR_STEP = 16
# A server's decode step on a CPU attends in groups of this many consecutive rows, each group to its own window (one
# compiled graph serves every combination of lengths): rows holding long prompts then make only their group read as
# far as they do. On CUDA, where a graph is recorded per combination, all rows take one window.
WINDOW_GROUP_ROWS = {"cpu": 4}
Window = Tensor | tuple[Tensor, ...]  # a step's window (attention_window), or one per group of rows


# A prompt longer than this enters the cache in pieces of this many positions (fill_cache), its last piece through
# the prefill step: the attention's mask [S, positions] and the activations [S, ...] of a call then stay those of a
# PREFILL_CHUNK-token prompt, whatever the prompt's length.
PREFILL_CHUNK = 512


def prompt_head(width: int) -> int:
    """How many of a prompt's width positions fill_cache writes before the prefill step takes the rest (at most
    PREFILL_CHUNK of them): 0 for a prompt of up to PREFILL_CHUNK tokens."""
    return (width - 1) // PREFILL_CHUNK * PREFILL_CHUNK


@torch.no_grad()
def fill_cache(model, x: Tensor, start: int, left_pad: Tensor | None = None):
    """Writes the keys and values of x [B, S] at positions start..start + S - 1 into the cache, PREFILL_CHUNK
    positions a call, each attending to the positions filled before it (left_pad: as in model.forward)."""
    for a in range(0, x.shape[1], PREFILL_CHUNK):
        b = min(a + PREFILL_CHUNK, x.shape[1])
        positions = torch.arange(start + a, start + b, device=x.device)
        model(x[:, a:b], positions, left_pad, last_only=True, kv_length=start + b, fused_rows=0)


def prefill(
    model,
    x: Tensor,
    input_pos: Tensor,
    left_pad: Tensor,
    s: SamplerState,
    greedy: bool,
    n_logprobs: int | None,
    cache_rows: Tensor | None = None,
    kv_length: int | None = None,
    last: Tensor | None = None,
):
    # x: [B, S] prompts in cache slots input_pos ([S], or [B, S] per row) of cache rows cache_rows ([B]; None: 0..B-1)
    # -> first new token [B, 1] (and its log-probs), from each row's last position, or from position last[b] of
    # row b where rows are right-padded. No product fuses (fused_rows 0), eager or compiled: the prompt's are of
    # many rows, and the output projection of the last one, fused eagerly, would materialise a vocabulary-sized
    # float32 temporary.
    logits = model(x, input_pos, left_pad, last is None, cache_rows=cache_rows, kv_length=kv_length, fused_rows=0)
    at_end = logits[:, -1] if last is None else logits[torch.arange(x.shape[0], device=x.device), last]
    return sample(at_end, s, greedy, n_logprobs)


def fill_piece(model, x: Tensor, input_pos: Tensor, cache_rows: Tensor, window: Window) -> Tensor:
    # x: [B, S] prompt tokens in cache slots input_pos [B, S] of cache rows cache_rows [B], attending to the window's
    # slots (as decode_one_token's: marked dynamic, one compiled graph serves every length) -> the last position's
    # logits [B, 1, vocab], which nobody reads: a piece that does not end its prompt only writes keys and values. A
    # server's engine runs it compiled at one width, a long prompt's piece a turn beside its streams. (A compiled
    # function whose output depends on nothing drops the layers and their cache writes.)
    return model(x, input_pos, last_only=True, cache_rows=cache_rows, kv_length=kv_length(window), fused_rows=0)


def prefill_and_score(model, x, input_pos, left_pad, s, greedy, n_logprobs, n_top, cache_rows=None, kv_length=None):
    # prefill, from every position's logits, also scoring the prompt: -> first new token [B, 1], its log-probs, and
    # (x[:, 1:]'s log-probs [B, S - 1, 1], the top n_top's values and ids [B, S - 1, n_top]) under the model.
    logits = model(x, input_pos, left_pad, cache_rows=cache_rows, kv_length=kv_length)
    return *sample(logits[:, -1], s, greedy, n_logprobs), token_logprobs(logits[:, :-1], x[:, 1:, None], n_top)


def attention_window(position: int, max_seq_length: int, device: torch.device, group: int = 0) -> Tensor:
    """The window a decode-shaped step takes whose rows write up to position in a cache of max_seq_length slots: a
    tensor whose length (the model's kv_length) covers position, rounded up (WINDOW_STEPS), marked dynamic so that
    one compiled graph serves every length. It stays shorter than the cache, since a slice as long as the cache is
    contiguous, which the compiled graph would specialise on: a step writes below the last slot. group: which group
    of rows it is for (attention_windows)."""
    if position >= max_seq_length - 1:
        raise ValueError(f"a decode step at position {position} needs a cache of more than {max_seq_length} slots")
    step = WINDOW_STEPS.get(device.type, VECTOR_STEP)
    return window_of(min((position // step + 1) * step, max_seq_length - 1), device, group)


def attention_windows(positions: list[int], max_seq_length: int, device: torch.device) -> tuple[Tensor, ...]:
    """The windows of a step whose groups of rows (window_groups) write up to positions, one for each. Each group's
    window is a tensor of its own, whatever its length: Dynamo takes one tensor passed twice as one input, whose
    length the compiled graph would then assume the groups share."""
    return tuple(attention_window(p, max_seq_length, device, g) for g, p in enumerate(positions))


def window_groups(rows: int, device: torch.device) -> int:
    """How many groups of consecutive rows (WINDOW_GROUP_ROWS each) a decode-shaped step of rows rows attends in."""
    size = WINDOW_GROUP_ROWS.get(device.type)
    return rows // size if size and rows % size == 0 else 1


@functools.lru_cache(maxsize=256)
def window_of(length: int, device: torch.device, group: int = 0) -> Tensor:
    """A window tensor of length slots, made once per length and group: marking a tensor dynamic is Python work
    that a step need not repeat (the tensor's contents are never read)."""
    window = torch.empty(length, dtype=torch.bool, device=device)
    torch._dynamo.mark_dynamic(window, 0)
    return window


def kv_length(window: Window | None) -> int | tuple[int, ...] | None:
    """The model's kv_length that a step's window tensor (or tensors, one per group of rows) stands for (None: the
    whole cache)."""
    if isinstance(window, tuple):
        return tuple(w.shape[0] for w in window)
    return None if window is None else window.shape[0]


def decode_one_token(model, x, input_pos, left_pad, s, greedy, n_logprobs, window: Window | None = None, fused_rows=1):
    # The arguments as prefill's. x: [B, 1] in slots input_pos ([1], or [B, 1] per row) -> next token [B, 1] (and
    # its log-probs). window: a tensor whose length is the model's kv_length (None: the whole cache), or one per
    # group of rows; marked dynamic (torch._dynamo.mark_dynamic), one compiled graph serves every length, which a
    # plain int argument would not.
    # fused_rows, here and in the other decode-shaped steps: the model's (compile_steps binds FUSED_ROWS).
    logits = model(x, input_pos, left_pad, kv_length=kv_length(window), fused_rows=fused_rows)
    return sample(logits[:, -1], s, greedy, n_logprobs)


def draft_step(
    draft, x: Tensor, input_pos: Tensor, s: SamplerState, greedy: bool, window: Window | None = None, fused_rows=1
):
    # x: [B, S] in slots input_pos ([S], or [B, S] per row) -> a token drafted after the last [B, 1] and the
    # distribution p it was drawn from [B, V]. window: as decode_one_token's.
    logits = draft(x, input_pos, last_only=True, kv_length=kv_length(window), fused_rows=fused_rows)
    probs = step_probs(logits[:, -1], s, greedy)
    return torch.argmax(probs / s.noise, dim=-1, keepdim=True), probs


def verify_step(
    model, x: Tensor, input_pos: Tensor, s: SamplerState, greedy: bool, window: Window | None = None, fused_rows=1
) -> Tensor:
    # x: [B, k + 1], each row's current token and k drafted ones -> the target's distributions q after each
    # [B, k + 1, V]. Settings of [B, 1] (a server's rows) become [B, 1, 1], and what is per token [B, V] becomes
    # [B, 1, V], to go with them. Penalties and a grammar's mask apply as in a decode step: exact at a row's first
    # position, which is what a row without drafts takes (a server's row that speculation does not cover).
    per_position = s._replace(**{k: getattr(s, k)[..., None] for k in SETTINGS if getattr(s, k).dim()})
    per_position = per_position._replace(**{k: getattr(s, k)[:, None] for k in ("seen", "counts", "allowed")})
    logits = model(x, input_pos, kv_length=kv_length(window), fused_rows=fused_rows)
    logits = apply_penalties(logits, per_position).masked_fill(~per_position.allowed, float("-inf"))
    return step_probs(logits, per_position, greedy)


class Steps(NamedTuple):
    """The step functions a generation calls: these eager ones, or compiled ones (compile_steps)."""

    prefill: Callable = prefill
    decode: Callable = decode_one_token
    draft: Callable = draft_step
    verify: Callable = verify_step
    fill: Callable = fill_piece


def inductor_cache_dir() -> Path:
    """inductor's cache folder for the CPU capability in force (ATEN_CPU_CAPABILITY, else the CPU's best):
    TORCHINDUCTOR_CACHE_DIR, else inductor's default, then /AVX512, /AVX2, ... inductor's cache key leaves out
    the vector ISA of the C++ it generates, so a folder shared by two capabilities serves one of them code written
    for the other, which computes garbage (docs/upstream-inductor-cache-isa.md). A folder already named after the
    capability is that capability's folder (a process started by one that keyed it)."""
    # Imported here, when compiling only: it loads much of inductor, which an eager run never needs.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).resolve()
    capability = torch.backends.cpu.get_cpu_capability()
    return base if base.name == capability else base / capability


def skip_unchanged_modules(compiled):
    """compiled, with guards that pass a module whose attributes (and its submodules') are unchanged since the
    last call without checking each of its weights: per call, Dynamo would otherwise check every tensor of the
    model before the step runs."""
    return torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True)(compiled)


def compile_steps(device: torch.device, decode: bool = True, prefill: bool = False) -> Steps:
    """Steps with the decode-shaped steps (decode, draft, verify, and a server's fill of prompt pieces at one width)
    and/or the prefill compiled; each compiles on first use, with inductor's cache in inductor_cache_dir(). CUDA
    graphs ("reduce-overhead") exist on CUDA only."""
    # inductor reads its folder from the environment when it compiles (and writes it there itself); the processes
    # we start inherit it.
    if decode or prefill:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    if device.type == "cuda":
        # A CUDA graph replays the whole step, with none of the checks below ("reduce-overhead"). Coordinate
        # descent tuning also makes inductor write a one-row product as a multiply-and-sum that it tunes, into
        # which an int8 weight's widening fuses (kernels.linear): without it the widened weights are written out.
        step = {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}
    else:  # Dynamo's guards check each input's shape and stride before a call already; the compiled code's
        # own re-check of each is a measurable share of a small model's decode step. A value read more than once
        # is written once rather than recomputed at each read: inductor would otherwise recompute a norm's output
        # inside the fused product of every row (kernels.linear), which turns a product of a few rows from
        # reading memory into computing.
        step = {"options": {"size_asserts": False, "realize_reads_threshold": 1}}
    eager, steps = Steps(), {}
    # Compiled steps fuse products of up to FUSED_ROWS rows (kernels.linear), a value bound to the compiled function
    # (each keeps its own code object, so its own graphs and recompile limit). Static shapes: a batch size or
    # speculation depth met later gets its own graph (a fused product unrolls its rows).
    if decode:
        for name in ("decode", "draft", "verify"):
            compiled = torch.compile(getattr(eager, name), fullgraph=True, dynamic=False, **step)
            steps[name] = functools.partial(skip_unchanged_modules(compiled), fused_rows=FUSED_ROWS)
        steps["fill"] = skip_unchanged_modules(torch.compile(eager.fill, fullgraph=True, dynamic=False, **step))
    if prefill:
        # Static at the first prompt length, dynamic from the second (dynamic=True from the first would make the
        # layers' float attributes symbolic, which a layer compiled once for all cannot guard on).
        steps["prefill"] = torch.compile(eager.prefill, fullgraph=True)
    return eager._replace(**steps)


@torch.no_grad()
def token_steps(model, rows, max_new_tokens, params: SamplingParams, steps: Steps, *, start_pos=0, pad_id=0):
    """Yields (token [B, 1], log-probs or None) per new token: the first from the prefill, then one per decode step.

    Rows of different lengths are left-padded; the mask hides the padding and each row's rotary positions
    start at its first real token. start_pos > 0 continues a sequence whose first start_pos positions
    are in the cache already (batch 1)."""
    device = model.tok_embeddings.weight.device
    check_logprobs(params, model.config.vocab_size)
    lengths = [len(row) for row in rows]
    width = max(lengths)
    if start_pos and len(rows) > 1:
        raise ValueError("continuing from cached positions (start_pos > 0) works for one row only")
    ensure_caches(model, len(rows), start_pos + width, max_new_tokens, keep=start_pos > 0)
    x = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        x[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
    left_pad = torch.tensor([width - n for n in lengths], device=device)
    s, generator = sampler_state(params, rows, model.config.vocab_size, device), params.generator(device)
    refill_noise(s, params, generator)
    head = prompt_head(width)
    fill_cache(model, x[:, :head], start_pos, left_pad)
    input_pos = torch.arange(start_pos + head, start_pos + width, device=device)
    # kv_length: the prompt attends to the positions filled so far, not to the whole cache
    token, logprobs = steps.prefill(
        model, x[:, head:], input_pos, left_pad, s, params.greedy, params.logprobs, kv_length=start_pos + width
    )
    yield token, logprobs
    input_pos = torch.tensor([start_pos + width], device=device)
    for step in range(max_new_tokens - 1):
        if params.penalized:  # what penalties read; nothing else does
            record_token(s, token)
        refill_noise(s, params, generator)
        window = attention_window(start_pos + width + step, model.max_seq_length, device)
        token, logprobs = steps.decode(model, token, input_pos, left_pad, s, params.greedy, params.logprobs, window)
        # Copies: CUDA graphs reuse their output buffers on the next call.
        token = token.clone()
        logprobs = None if logprobs is None else tuple(t.clone() for t in logprobs)
        input_pos += 1
        yield token, logprobs


def ensure_caches(
    model: Transformer, batch_size: int, prompt_len: int, max_new_tokens: int, keep: bool = False, overrun: int = 0
):
    """Checks the request fits the model; sets up KV caches unless big enough ones exist (or keep is set): rolling
    ones for sliding layers, taking PREFILL_CHUNK positions a call, and overrun positions past the next call's first
    (speculation's drafts, rejected)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = prompt_len + max_new_tokens
    if needed > model.config.block_size:
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"block_size ({model.config.block_size})"
        )
    # Reusing caches keeps the compiled decode step's shapes, so it does not recompile.
    if model.max_seq_length >= needed and model.max_batch_size >= batch_size and model.chunk >= overrun:
        return
    if keep:
        raise ValueError(
            f"{batch_size} rows of {needed} positions do not fit the KV cache "
            f"({model.max_batch_size} rows of {model.max_seq_length})"
        )
    model.setup_caches(batch_size, needed, chunk=max(PREFILL_CHUNK, overrun))


def check_speculation(model, draft, params: SamplingParams, k: int):
    """draft: the draft model, or None (prompt lookup)."""
    if k < 1:
        raise ValueError(f"speculate_k must be >= 1, got {k}")
    if draft is not None and draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's ({model.config.vocab_size})"
        )
    if params.penalized or params.logprobs is not None:
        raise ValueError("speculative decoding supports temperature, top_k, top_p and min_p, not penalties or logprobs")


@torch.no_grad()
def draft_and_verify(
    model,
    draft,
    steps: Steps,
    k: int,
    current: Tensor,
    draft_input: tuple[Tensor, Tensor],
    s_target: SamplerState,
    s_draft: SamplerState,
    greedy: bool,
    refill_noise: Callable[[], None],
    window: Window | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The model work of a speculative round, for rows at their current tokens [B, 1]: the draft reads draft_input
    (tokens [B, S] and their positions, the last S being the current tokens' positions [B, 1] or [1]) and drafts k
    tokens, one step each (refill_noise before each draw); the model then reads the current and drafted tokens in
    one pass. Returns the drafted tokens [B, k], the draft's distributions [B, k, V] and the model's [B, k + 1, V];
    sampling.accept_drafts decides what each row keeps."""
    (token, at), drafted, probs = draft_input, [], []
    for _ in range(k):
        refill_noise()
        token, p = steps.draft(draft, token, at, s_draft, greedy, window)
        token, p = token.clone(), p.clone()  # copies: CUDA graphs reuse their output buffers on the next call
        drafted.append(token)
        probs.append(p)
        at = at[..., -1:] + 1
    drafted = torch.cat(drafted, dim=1)
    verify_at = at - k + torch.arange(k + 1, device=at.device)  # the current tokens' positions, then the drafts'
    q = steps.verify(model, torch.cat([current, drafted], dim=1), verify_at, s_target, greedy, window)
    return drafted, torch.stack(probs, dim=1), q


@torch.no_grad()
def plain_steps(
    model,
    steps: Steps,
    token: Tensor,
    position: int,
    n: int,
    s: SamplerState,
    params: SamplingParams,
    generator: torch.Generator | None,
    max_seq_length: int,
) -> Tensor:
    """n decode steps of one sequence from its current token [1, 1] at position, each reading the one before's token
    where it lies, on the device: nothing waits for the device in between. Returns the tokens made [1, n]."""
    device = token.device
    # filled on the device: a tensor copied from the host would wait for the device
    at, no_pad, made = torch.full((1,), position, device=device), torch.zeros(1, dtype=torch.long, device=device), []
    for i in range(n):
        refill_noise(s, params, generator)
        window = attention_window(position + i, max_seq_length, device)
        token, _ = steps.decode(model, token, at, no_pad, s, params.greedy, None, window)
        token = token.clone()  # a copy: CUDA graphs reuse their output buffers on the next call
        made.append(token)
        at = at + 1
    return torch.cat(made, dim=1)


def check_prompts(prompts) -> list[list[int]]:
    """One prompt (a list of ids or a 1-D tensor) or a list of them -> a list of id lists."""
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist()
    if len(prompts) == 0:
        raise ValueError("the prompt list is empty")
    rows = (
        [prompts]
        if isinstance(prompts[0], int)
        else [list(p.tolist() if isinstance(p, Tensor) else p) for p in prompts]
    )
    if any(len(row) == 0 for row in rows):
        raise ValueError("a prompt is empty and the tokenizer adds no BOS token to start from")
    return rows


class Stream:
    """One prompt's continuation (prompt: text or token ids) as text pieces, produced while it is iterated.

    The pieces join to exactly the final text: held back are an incomplete character and any tail that
    could begin a stop string. Once the iteration ends, .result is the Generation; run() does both."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        prompt,
        max_new_tokens: int,
        *,
        sampling: SamplingParams = SamplingParams(),
        stop=(),
        start_pos: int = 0,
        steps: Steps = Steps(),
    ):
        (self.ids,) = check_prompts([tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)])
        self.model, self.tokenizer, self.stop = model, tokenizer, check_stop(stop, tokenizer)
        self.produced = token_steps(model, [self.ids], max_new_tokens, sampling, steps, start_pos=start_pos)
        self.result: Generation | None = None

    @torch.no_grad()
    def __iter__(self):
        pieces, raw, logprobs = TextPieces(self.tokenizer, self.stop), [], []
        start = time.perf_counter()
        for token, lp in self.produced:
            raw.append(int(token[0, 0]))  # waits for the device
            if len(raw) == 1:
                ttft = time.perf_counter() - start
            logprobs.append(lp)
            piece = pieces.push(raw[-1])
            if piece:
                yield piece
            if pieces.finished:
                break
        else:
            piece = pieces.end()
            if piece:
                yield piece
        synchronize(self.model.tok_embeddings.weight.device)
        decode_time = time.perf_counter() - start - ttft
        self.result = collect(
            [raw], logprobs, [self.ids], self.tokenizer.eos_ids, self.stop, self.tokenizer, ttft, decode_time
        )

    def run(self, on_piece: Callable[[str], None] | None = None) -> Generation:
        """Generates to the end, passing each piece to on_piece; returns the Generation."""
        for piece in self:
            if on_piece is not None:
                on_piece(piece)
        return self.result
