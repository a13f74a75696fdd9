"""Generate text with a checkpoint of ours.

    python generate.py --prompt "The capital of France is" --max_new_tokens 64
    python generate.py --prompt "Once upon a time" --prompt "def fib(n):" --temperature 0 --json
    python generate.py --checkpoint_path checkpoints/NAME/model.pth --compile --temperature 0.8 --top_p 0.95
    python generate.py --interactive            # a conversation kept in the KV cache

The decode step runs as one static-shape function (optionally torch.compile'd). Sampling runs on the
device inside that step, with its settings passed as tensors, so new values never recompile it. The
host looks at the tokens only to stream them or, every few steps, to check whether every row is done.
"""

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

import tp
from checkpoint import (
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    DTYPES,
    HelpFormatter,
    device_flag,
    prompt_lines,
    resolve_checkpoint,
    user_errors,
    utf8_text,
)
from kernels import Kernels, set_kernels
from model import Transformer, ensure_caches
from quantize import load_checkpoint_model, prepare_quantized
from results import Generation, Speculation, TextPieces, check_stop, collect, find_stop, summarize, synchronize
from sampling import (
    SETTINGS,
    SamplerState,
    SamplingParams,
    accept_drafts,
    check_logprobs,
    check_seed,
    record_token,
    refill_noise,
    sample,
    sampler_state,
    step_probs,
)
from tokenizer import Tokenizer, load_tokenizer

CHECK_INTERVAL = 8  # decode steps between host checks for finished rows (EOS, stop strings)
CHAT_CACHE_LENGTH = 2048  # KV cache positions of an interactive conversation (capped by block_size)


# ---------------------------------------------------------------- the model steps


def prefill(
    model,
    x: Tensor,
    input_pos: Tensor,
    left_pad: Tensor,
    s: SamplerState,
    greedy: bool,
    n_logprobs: int | None,
    first_row: int = 0,
    kv_length: int | None = None,
):
    # x: [B, S] prompts in cache slots input_pos [S] of cache rows first_row..
    # -> first new token [B, 1] (and its log-probs)
    logits = model(x, input_pos, left_pad, last_only=True, first_row=first_row, kv_length=kv_length)
    return sample(logits[:, -1], s, greedy, n_logprobs)


def kv_length(window: Tensor | None) -> int | None:
    """The model's kv_length that a step's window tensor stands for (None: the whole cache)."""
    return None if window is None else window.shape[0]


def decode_one_token(
    model,
    x: Tensor,
    input_pos: Tensor,
    left_pad: Tensor,
    s: SamplerState,
    greedy: bool,
    n_logprobs: int | None,
    window: Tensor | None = None,
):
    # x: [B, 1] in slots input_pos ([1], or [B, 1] per row) -> next token [B, 1] (and its log-probs). window: a
    # tensor whose length is the model's kv_length (None: the whole cache); marked dynamic (torch._dynamo.
    # mark_dynamic), one compiled graph serves every length, which a plain int argument would not.
    return sample(model(x, input_pos, left_pad, kv_length=kv_length(window))[:, -1], s, greedy, n_logprobs)


def draft_step(draft, x: Tensor, input_pos: Tensor, s: SamplerState, greedy: bool, window: Tensor | None = None):
    # x: [B, S] in slots input_pos ([S], or [B, S] per row) -> a token drafted after the last [B, 1] and the
    # distribution p it was drawn from [B, V]. window: as decode_one_token's.
    probs = step_probs(draft(x, input_pos, last_only=True, kv_length=kv_length(window))[:, -1], s, greedy)
    return torch.argmax(probs / s.noise, dim=-1, keepdim=True), probs


def verify_step(
    model, x: Tensor, input_pos: Tensor, s: SamplerState, greedy: bool, window: Tensor | None = None
) -> Tensor:
    # x: [B, k + 1], each row's current token and k drafted ones -> the target's distributions q after each
    # [B, k + 1, V]. Settings of [B, 1] (a server's rows) become [B, 1, 1], to go with them.
    per_position = s._replace(**{k: getattr(s, k)[..., None] for k in SETTINGS if getattr(s, k).dim()})
    return step_probs(model(x, input_pos, kv_length=kv_length(window)), per_position, greedy)


class Steps(NamedTuple):
    """The step functions a generation calls: these eager ones, or compiled ones (compile_steps)."""

    prefill: Callable = prefill
    decode: Callable = decode_one_token
    draft: Callable = draft_step
    verify: Callable = verify_step


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


def compile_steps(device: torch.device, decode: bool = True, prefill: bool = False) -> Steps:
    """Steps with the decode-shaped steps (decode, draft, verify) and/or the prefill compiled; each compiles on
    first use, with inductor's cache in inductor_cache_dir(). CUDA graphs ("reduce-overhead") exist on CUDA only."""
    # inductor reads its folder from the environment when it compiles (and writes it there itself); the processes
    # we start inherit it.
    if decode or prefill:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    if device.type == "cuda":  # a CUDA graph replays the whole step, with none of the checks below
        step = {"mode": "reduce-overhead"}
    else:  # Dynamo's guards check each input's shape and stride before a call already; the compiled code's
        # own re-check of each is a measurable share of a small model's decode step.
        step = {"options": {"size_asserts": False}}
    eager, steps = Steps(), {}
    # Static shapes: a batch size or speculation depth met later gets its own graph (kernels.fuses unrolls rows).
    if decode:
        steps = {
            name: torch.compile(getattr(eager, name), fullgraph=True, dynamic=False, **step)
            for name in ("decode", "draft", "verify")
        }
    if prefill:
        steps["prefill"] = torch.compile(eager.prefill, fullgraph=True, dynamic=True)
    return eager._replace(**steps)


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
    input_pos = torch.arange(start_pos, start_pos + width, device=device)
    token, logprobs = steps.prefill(model, x, input_pos, left_pad, s, greedy=params.greedy, n_logprobs=params.logprobs)
    yield token, logprobs
    input_pos = torch.tensor([start_pos + width], device=device)
    for _ in range(max_new_tokens - 1):
        record_token(s, token)
        refill_noise(s, params, generator)
        token, logprobs = steps.decode(
            model, token, input_pos, left_pad, s, greedy=params.greedy, n_logprobs=params.logprobs
        )
        # Copies: CUDA graphs reuse their output buffers on the next call.
        token = token.clone()
        logprobs = None if logprobs is None else tuple(t.clone() for t in logprobs)
        input_pos += 1
        yield token, logprobs


# ---------------------------------------------------------------- speculative decoding


def check_speculation(model, draft, params: SamplingParams, k: int):
    if k < 1:
        raise ValueError(f"speculate_k must be >= 1, got {k}")
    if draft.config.vocab_size != model.config.vocab_size:
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
    window: Tensor | None = None,
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
        drafted.append(token.clone())  # copies: CUDA graphs reuse their output buffers on the next call
        probs.append(p.clone())
        at = at[..., -1:] + 1
    drafted = torch.cat(drafted, dim=1)
    verify_at = at - k + torch.arange(k + 1, device=at.device)  # the current tokens' positions, then the drafts'
    q = steps.verify(model, torch.cat([current, drafted], dim=1), verify_at, s_target, greedy, window)
    return drafted, torch.stack(probs, dim=1), q


def speculative_generate(
    model,
    draft,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    k: int,
    *,
    eos_ids=(),
    stop=(),
    tokenizer=None,
    steps: Steps = Steps(),
) -> Generation:
    """Generates from the target with the draft proposing k tokens a round; the output distribution is
    exactly the target's (greedy: exactly its greedy tokens). One host sync per round."""
    check_speculation(model, draft, params, k)
    device = model.tok_embeddings.weight.device
    # Verification writes up to k positions past the last kept token.
    for m in (model, draft):
        ensure_caches(m, 1, len(prompt), max_new_tokens + k + 1)
    s_target, s_draft = (sampler_state(params, [prompt], model.config.vocab_size, device) for _ in range(2))
    generator = params.generator(device)
    no_pad = torch.zeros(1, dtype=torch.long, device=device)
    x, input_pos = torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)
    eos, stats = set(eos_ids), Speculation(k)

    synchronize(device)
    start = time.perf_counter()
    refill_noise(s_target, params, generator)
    first, _ = steps.prefill(model, x, input_pos, no_pad, s_target, greedy=params.greedy, n_logprobs=None)
    draft(x, input_pos, last_only=True)  # the draft's cache holds the prompt too
    out = [int(first)]
    ttft = time.perf_counter() - start
    pos, cur = len(prompt), first.view(1, 1)
    while (
        len(out) < max_new_tokens and out[-1] not in eos and not (stop and find_stop(tokenizer.decode(out), stop) >= 0)
    ):
        at = torch.tensor([pos], device=device)
        drafted, probs, q = draft_and_verify(
            model,
            draft,
            steps,
            k,
            cur,
            (cur, at),
            s_target,
            s_draft,
            params.greedy,
            lambda: refill_noise(s_draft, params, generator),
        )
        uniforms = torch.rand(1, k, device=device, generator=generator)
        noise = torch.empty(1, q.shape[-1], device=device).exponential_(generator=generator)
        kept, next_token = accept_drafts(drafted, probs, q, uniforms, noise)
        host = torch.cat([kept, next_token, drafted[0]]).tolist()  # the round's one sync
        n = host[0]
        if n == k:  # the draft never fed its last token: do it, so its cache is complete
            steps.draft(draft, drafted[:, -1:], torch.tensor([pos + k], device=device), s_draft, params.greedy)
        emitted = host[2 : 2 + n] + [host[1]]
        stats.record(n)
        out += emitted
        pos += len(emitted)
        cur = torch.tensor([[emitted[-1]]], device=device)
    raw = out[:max_new_tokens]
    result = collect([raw], [None], [prompt], eos_ids, list(stop), tokenizer, ttft, time.perf_counter() - start - ttft)
    result.speculation = stats.summary()
    return result


# ---------------------------------------------------------------- generate, stream, chat


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


@torch.no_grad()
def generate(
    model: Transformer,
    prompts,
    max_new_tokens: int,
    *,
    sampling: SamplingParams = SamplingParams(),
    eos_ids=(),
    stop=(),
    tokenizer: Tokenizer | None = None,
    batch_size: int = 1,
    pad_id: int = 0,
    draft_model: Transformer | None = None,
    speculate_k: int = 4,
    steps: Steps = Steps(),
) -> Generation:
    """Continues each prompt (token ids; one prompt or a list, each repeated batch_size times) in one batch.

    Every row stops at its first EOS or stop string (matched on decoded text, which needs tokenizer)
    or after max_new_tokens. With a draft_model, decoding is speculative (batch 1), speculate_k drafted
    tokens a round."""
    rows = check_prompts(prompts) * batch_size
    stop = check_stop(stop, tokenizer)
    if draft_model is not None:
        if len(rows) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time, got a batch of {len(rows)}")
        return speculative_generate(
            model,
            draft_model,
            rows[0],
            max_new_tokens,
            sampling,
            speculate_k,
            eos_ids=eos_ids,
            stop=stop,
            tokenizer=tokenizer,
            steps=steps,
        )
    device = model.tok_embeddings.weight.device
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    produced = token_steps(model, rows, max_new_tokens, sampling, steps, pad_id=pad_id)

    synchronize(device)
    start = time.perf_counter()
    tokens, logprobs = [], []
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
    for step, (token, lp) in enumerate(produced, start=1):
        if step == 1:
            synchronize(device)
            ttft = time.perf_counter() - start
        tokens.append(token)
        logprobs.append(lp)
        finished |= torch.isin(token[:, 0], eos)
        if step % CHECK_INTERVAL == 0:
            if stop:  # rows whose text so far holds a stop string are done too
                so_far = torch.cat(tokens, dim=1).tolist()
                done = [find_stop(tokenizer.decode(row), stop) >= 0 for row in so_far]
                finished |= torch.tensor(done, device=device)
            if bool(finished.all()):
                break
    raw = torch.cat(tokens, dim=1).tolist()
    decode_time = time.perf_counter() - start - ttft
    return collect(raw, logprobs, rows, eos_ids, stop, tokenizer, ttft, decode_time)


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


def cached_prefix(cached: list[int], ids: list[int]) -> int:
    """How many tokens of ids a KV cache holding cached can keep: their common prefix, short of ids' last token,
    which is always fed again for the logits of the token after it."""
    n = 0
    while n < min(len(ids) - 1, len(cached)) and ids[n] == cached[n]:
        n += 1
    return n


def encode_conversation(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Messages ({"role", "content"}) -> the prompt of the reply: by the chat template, or without one, the
    messages' contents joined by newlines (a base model continues the conversation's text)."""
    if tokenizer.chat_template:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("\n".join(m["content"] for m in messages))


class Chat:
    """A conversation kept in the KV cache: each turn prefills only the tokens not cached yet.

    With a chat template, turns are rendered by it; without one, the conversation is its messages
    joined by newlines. When a turn would not fit the cache, the oldest turns are dropped (the system
    message stays) and dropped_turns counts them."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system=None,
        max_new_tokens=256,
        cache_length=CHAT_CACHE_LENGTH,
        sampling: SamplingParams = SamplingParams(),
        stop=(),
        steps: Steps = Steps(),
    ):
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.sampling, self.stop, self.steps = sampling, stop, steps
        cache_length = min(cache_length, model.config.block_size)
        if max_new_tokens >= cache_length:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} leaves no room for a message in the conversation's "
                f"{cache_length}-position cache"
            )
        model.setup_caches(1, cache_length)
        self.system = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self):
        self.messages, self.cached, self.dropped_turns, self.last_prefill = [], [], 0, 0

    def render(self, messages) -> list[int]:
        return encode_conversation(self.tokenizer, self.system + messages)

    def send(self, text: str, on_piece: Callable[[str], None] | None = None) -> Generation:
        """Generates the reply, passing its text pieces to on_piece as they come. A message that cannot fit
        is refused with a ValueError, and the conversation stays as it was."""
        messages, dropped = self.messages + [{"role": "user", "content": text}], 0
        ids = self.render(messages)
        while len(ids) + self.max_new_tokens > self.model.max_seq_length and len(messages) > 1:
            messages, dropped = messages[2:], dropped + 1  # the oldest user message and its reply
            ids = self.render(messages)
        if len(ids) + self.max_new_tokens > self.model.max_seq_length:
            raise ValueError(
                f"this message ({len(ids)} tokens) plus max_new_tokens ({self.max_new_tokens}) does not fit "
                f"the {self.model.max_seq_length}-position cache"
            )
        self.messages, self.dropped_turns = messages, self.dropped_turns + dropped
        common = cached_prefix(self.cached, ids)
        self.last_prefill = len(ids) - common
        result = Stream(
            self.model,
            self.tokenizer,
            ids[common:],
            self.max_new_tokens,
            sampling=self.sampling,
            stop=self.stop,
            start_pos=common,
            steps=self.steps,
        ).run(on_piece)
        # Every produced token but the last was fed back, so its keys and values are in the cache.
        self.cached = ids + result.raw_tokens[0][:-1]
        self.messages.append({"role": "assistant", "content": result.texts[0]})
        return result


# ---------------------------------------------------------------- loading and figures


def load_model(
    checkpoint_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    shard=None,
    kernels: Kernels = Kernels(),
):
    """Builds the model on the meta device and assigns the memory-mapped weights: no second copy.
    With a tensor-parallel shard (tp.Shard), keeps this rank's slice only, before moving it to the device.
    kernels: how a CPU runs the linear layers (Kernels.choose picks the fastest for a run)."""
    model, quantization = load_checkpoint_model(resolve_checkpoint(checkpoint_path))
    if shard is not None:
        tp.check_divisible(model.config, shard.world_size, quantization)
        tp.apply_tp(model, shard)
    model = model.to(device=device, dtype=dtype).eval()
    set_kernels(model, kernels)
    if quantization is not None:
        prepare_quantized(model)
    return model


# ---------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = p.add_argument
    arg(
        "--prompt",
        action="append",
        type=utf8_text,
        help="text to continue; several --prompt make one batch; none: the text piped to stdin, "
        'else "Hello, my name is"',
    )
    arg(
        "--prompts_file", type=prompt_lines, help="a text file, one prompt a line, all in one batch (with any --prompt)"
    )
    arg("--interactive", action="store_true", help="a conversation on stdin (chat template if any)")
    arg("--system", default=None, type=utf8_text, help="system message for --interactive")
    arg("--num_samples", type=int, default=1, help="number of runs")
    arg("--max_new_tokens", type=int, default=200, help="tokens to generate at most, per row")
    arg("--batch_size", type=int, default=1, help="rows generated from each prompt")
    arg("--stop", action="append", default=[], type=utf8_text, help="stop string (may be given several times)")
    arg("--temperature", type=float, default=0.8, help="0 means greedy (the Python API's default)")
    arg("--top_k", type=int, default=200, help="keep the k most likely tokens, 0: all")
    arg("--top_p", type=float, default=1.0, help="nucleus sampling threshold, 1: off")
    arg("--min_p", type=float, default=0.0, help="drop tokens below min_p x the top probability, 0: off")
    arg("--repetition_penalty", type=float, default=1.0, help="> 1 discourages repeats, 1: off")
    arg("--presence_penalty", type=float, default=0.0, help="OpenAI presence penalty, 0: off")
    arg("--frequency_penalty", type=float, default=0.0, help="OpenAI frequency penalty, 0: off")
    arg("--logprobs", type=int, default=None, help="report log-probs of chosen tokens and N alternatives")
    arg("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    arg("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    arg("--draft_checkpoint_path", type=Path, default=None, help="draft model: speculative decoding")
    arg("--speculate_k", type=int, default=4, help="tokens the draft proposes per round")
    arg(
        "--device",
        type=device_flag,
        default=DEFAULT_DEVICE,
        help="cpu, cuda, cuda:1, ...",
    )
    arg("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    arg("--compile", action="store_true", help="torch.compile the decode step")
    arg("--compile_prefill", action="store_true", help="torch.compile the prefill too (dynamic shapes)")
    arg(
        "--kernels",
        choices=("auto", "fused", "library"),
        default="auto",
        help="CPU one-row products: auto (the fastest measured for this CPU and --compile), fused (float32 "
        "multiply-and-sum, for compiled steps) or library (BLAS, ATen's int8/int4 kernels)",
    )
    arg("--profile", type=Path, default=None, help="write a torch.profiler trace (.json) of the last run")
    arg("--json", action="store_true", help="print one JSON object of outputs and figures as last line")
    arg(
        "--tp_timeout_s",
        type=float,
        default=tp.DEFAULT_TIMEOUT_S,
        help="under torchrun: seconds a rank waits for the others before it gives up",
    )
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "batch_size", "speculate_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not (math.isfinite(args.tp_timeout_s) and args.tp_timeout_s > 0):
        p.error("--tp_timeout_s must be a finite number > 0")
    if args.profile is not None and not args.profile.parent.is_dir():
        p.error(f"--profile {args.profile}: there is no folder {args.profile.parent}")
    try:
        sampling_params(args)
        check_seed(args.seed)
    except ValueError as e:
        p.error(str(e))
    if "" in args.stop:
        p.error("a stop string is empty")
    return args


def sampling_params(args) -> SamplingParams:
    """The sampling flags, named as SamplingParams' fields (--seed seeds torch's generator for all the runs)."""
    return SamplingParams(**{f.name: getattr(args, f.name) for f in fields(SamplingParams) if f.name != "seed"})


print_piece = functools.partial(print, end="", flush=True)


def chat_loop(chat: Chat, read_line: Callable[[], bytes]):
    """A conversation on stdin: read_line() gives the next line as bytes (b"" at the end)."""
    terminal = sys.stdin.isatty()
    if terminal:
        print("Conversation kept in the KV cache. /reset starts over; Ctrl-D ends.", file=sys.stderr)
    for number in itertools.count(1):
        if terminal:
            print("> ", end="", flush=True)
        line = read_line()
        if not line:
            break
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as e:  # one bad line does not end the conversation
            print(f"error: input line {number} is not valid UTF-8 (byte {e.start}); ignored", file=sys.stderr)
            continue
        if text == "/reset":
            chat.reset()
            continue
        if not text:
            continue
        dropped = chat.dropped_turns
        try:
            chat.send(text, print_piece)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        if chat.dropped_turns > dropped:
            print(
                f"[the conversation outgrew the cache: dropped its {chat.dropped_turns - dropped} oldest turn(s)]",
                file=sys.stderr,
            )


def load_models(
    checkpoint_path: str | Path,
    device: torch.device,
    dtype_name: str | None = None,
    compiled: bool = False,
    matvec: str = "auto",
    draft_checkpoint_path: str | Path | None = None,
    shard=None,
) -> tuple[Transformer, Tokenizer, Transformer | None]:
    """What every script runs: the model, its tokenizer, and the draft model (None without one), checked to share
    the tokenizer. dtype_name: a key of checkpoint.DTYPES, None for bfloat16 on CUDA and float32 on a CPU (most CPUs
    have no native bfloat16 matrix products); the CPU kernels are Kernels.choose(device, compiled, matvec)."""
    kernels = Kernels.choose(device, compiled, matvec)
    dtype = DTYPES[dtype_name] if dtype_name else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = load_model(checkpoint_path, device, dtype, shard, kernels)
    tokenizer = load_tokenizer(resolve_checkpoint(checkpoint_path).parent)
    draft = None
    if draft_checkpoint_path is not None:
        draft = load_model(draft_checkpoint_path, device, dtype, shard, kernels)
        check_draft_tokenizer(tokenizer, draft_checkpoint_path)
    return model, tokenizer, draft


def check_draft_tokenizer(tokenizer: Tokenizer, draft_checkpoint_path: Path):
    draft_tokenizer = load_tokenizer(resolve_checkpoint(draft_checkpoint_path).parent)
    probe = "Tokenizer check: ünïcödé, 12345, emoji 🙂."
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe) or draft_tokenizer.eos_ids != tokenizer.eos_ids:
        raise ValueError(f"the draft {draft_checkpoint_path} does not use the target's tokenizer")


def run(args, device: torch.device, shard=None):
    piped = None if args.interactive or args.prompt or args.prompts_file else piped_text(shard)  # before loading
    start = time.perf_counter()
    model, tokenizer, draft = load_models(
        args.checkpoint_path, device, args.dtype, args.compile, args.kernels, args.draft_checkpoint_path, shard
    )
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    sampling = sampling_params(args)
    check_logprobs(sampling, model.config.vocab_size)
    seed = tp.shared_seed(args.seed, shard)
    if seed is not None:
        torch.manual_seed(seed)
    steps = compile_steps(device, args.compile, args.compile_prefill)  # each compiles lazily, on first use
    if args.interactive:
        if draft is not None:
            raise ValueError("--interactive does not take a draft model")
        chat = Chat(
            model,
            tokenizer,
            system=args.system,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            stop=args.stop,
            steps=steps,
        )
        return chat_loop(chat, tp.line_reader(shard))

    texts = (args.prompt or []) + (args.prompts_file or []) or [piped or "Hello, my name is"]
    prompts = check_prompts([tokenizer.encode(text) for text in texts])
    single = len(prompts) == 1 and args.batch_size == 1
    if draft is not None and not single:
        raise ValueError("speculative decoding takes one prompt and --batch_size 1")

    def run_once(max_new_tokens, on_piece=None, plain=False):
        if single and (draft is None or plain):
            return Stream(
                model, tokenizer, prompts[0], max_new_tokens, sampling=sampling, stop=args.stop, steps=steps
            ).run(on_piece)
        return generate(
            model,
            prompts,
            max_new_tokens,
            sampling=sampling,
            stop=args.stop,
            batch_size=args.batch_size,
            tokenizer=tokenizer,
            eos_ids=tokenizer.eos_ids,
            draft_model=draft,
            speculate_k=args.speculate_k,
            steps=steps,
        )

    # Caches sized once for every run below (speculation writes k + 1 positions ahead), so nothing recompiles.
    ahead = args.speculate_k + 1 if draft is not None else 0
    for m in (model, draft) if draft is not None else (model,):
        ensure_caches(m, len(prompts) * args.batch_size, max(map(len, prompts)), args.max_new_tokens + ahead)
    compile_time = (
        warm_up(run_once, args.max_new_tokens, draft is not None) if args.compile or args.compile_prefill else None
    )

    results = []
    for i in range(args.num_samples):
        profile = args.profile is not None and i == args.num_samples - 1 and (shard is None or shard.rank == 0)
        if single and draft is None:
            print_piece(texts[0])
        with torch.profiler.profile() if profile else contextlib.nullcontext() as profiler:
            results.append(run_once(args.max_new_tokens, print_piece))
        if profile:
            profiler.export_chrome_trace(str(args.profile))
        if single and draft is None:
            print(flush=True)
        else:
            for b, text in enumerate(results[-1].texts):
                print(f"[{b}] {texts[b % len(texts)]}{text}\n", flush=True)
    stats = summarize(results, model, device, compile_time)
    if compile_time is not None:
        stats["inductor_cache_dir"] = str(inductor_cache_dir())
    if draft is not None:
        plain = summarize([run_once(args.max_new_tokens, plain=True)], model, device, None)
        stats["speculation"] = results[-1].speculation
        stats["plain_decode_tokens_per_s"] = plain["decode_tokens_per_s"]
        stats["speedup_over_plain_decoding"] = stats["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    report(results, stats, shard, args.json, args.logprobs is not None)


def piped_text(shard) -> str | None:
    """What was piped to stdin (echo "text" | generate.py ...), without its last newline: None from a terminal
    or an empty pipe. Under torchrun rank 0 reads it and passes it to the others."""
    data = None
    if sys.stdin is not None and not sys.stdin.isatty() and (shard is None or shard.rank == 0):
        try:
            data = sys.stdin.buffer.read()
        except OSError:  # a closed or unreadable stdin (pytest's, when main() runs in a test) has no text
            data = None
    data = tp.from_rank0(data) if shard is not None else data
    try:
        return data.decode("utf-8").removesuffix("\n") if data else None
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not valid UTF-8 (byte {e.start})") from None


def warm_up(run_once, max_new_tokens: int, speculative: bool) -> float:
    """Runs the compiled steps once (they compile), and the plain decode step too when speculation is compared
    with it; returns the seconds it took."""
    start = time.perf_counter()
    run_once(min(max_new_tokens, 2 * CHECK_INTERVAL))
    if speculative:
        run_once(min(max_new_tokens, 2 * CHECK_INTERVAL), plain=True)
    elapsed = time.perf_counter() - start
    print(f"Compilation and warm-up: {elapsed:.1f} s", file=sys.stderr)
    return elapsed


def report(results: list[Generation], stats: dict, shard, as_json: bool, with_logprobs: bool):
    """The figures on stderr, and with as_json one JSON object of outputs and figures as stdout's last line."""
    if shard is not None:  # the figures are rank 0's, but for memory: a rank's use depends on its slice
        stats["tensor_parallel_ranks"] = shard.world_size
        stats["peak_memory_gb_per_rank"] = tp.gather_objects(stats.pop("peak_memory_gb"))
    for key, value in stats.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", file=sys.stderr)
    if as_json:
        output = {
            "outputs": [text for r in results for text in r.texts],
            "tokens": [row for r in results for row in r.tokens],
            "finish_reasons": [reason for r in results for reason in r.finish_reasons],
            "stats": stats,
        }
        if with_logprobs:
            output["logprobs"] = [row for r in results for row in r.logprobs]
        print(json.dumps(output))


def main(argv=None):
    with tp.rank0_prints(), user_errors(tp.quiet_rank()):
        args = parse_args(argv)
        shard, device = tp.maybe_init_dist(args.device, args.tp_timeout_s)
        with tp.rank_failures(shard):
            run(args, device, shard)
            if shard is not None:
                tp.end_rank()


if __name__ == "__main__":
    main()
