"""Generate text with a Llama-family checkpoint.

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
import itertools
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import tp
from checkpoint import DEFAULT_CHECKPOINT, DTYPES, parse_device, resolve_checkpoint, user_errors
from model import Kernels, Transformer, set_kernels
from quantize import load_checkpoint_model, prepare_quantized
from tokenizer import Tokenizer, load_tokenizer, read_text

CHECK_INTERVAL = 8  # decode steps between host checks for finished rows (EOS, stop strings)
CHAT_CACHE_LENGTH = 2048  # KV cache positions of an interactive conversation (capped by block_size)


# ---------------------------------------------------------------- sampling (on the device)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # 1: off; divides positive logits of tokens seen (prompt and output)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of each token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence of a generated token
    seed: int | None = None  # a torch.Generator of this seed; None: torch's global generator
    logprobs: int | None = None  # report the chosen token's log-probability and this many top alternatives

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_seed(seed: int | None):
    if seed is not None and not 0 <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")


def check_logprobs(params: SamplingParams, vocab_size: int):
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs {params.logprobs} exceeds the vocabulary size ({vocab_size})")


KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampler_state(params: SamplingParams, rows: list[list[int]], vocab_size: int, device) -> dict:
    """The tensors the sampling step reads: the settings, and per row the tokens seen so far."""
    state = {k: torch.tensor(getattr(params, k), dtype=torch.float32, device=device) for k in KNOBS}
    batch = len(rows)
    state["seen"] = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)  # prompt and output
    for b, row in enumerate(rows):
        state["seen"][b, torch.tensor(row, dtype=torch.long, device=device)] = True
    state["counts"] = torch.zeros(batch, vocab_size, device=device)  # occurrences in the output
    state["noise"] = torch.ones(batch, vocab_size, device=device)  # Exp(1) draws, refilled per step
    return state


def record_token(state: dict, token: Tensor):
    # token: [B, 1], the token each row just produced
    state["seen"].scatter_(1, token, True)
    state["counts"].scatter_add_(1, token, torch.ones_like(token, dtype=state["counts"].dtype))


def apply_penalties(logits: Tensor, s: dict) -> Tensor:
    # Repetition penalty as in transformers (CTRL paper), presence/frequency as in OpenAI's API.
    penalized = torch.where(logits > 0, logits / s["repetition_penalty"], logits * s["repetition_penalty"])
    logits = torch.where(s["seen"], penalized, logits)
    return logits - s["frequency_penalty"] * s["counts"] - s["presence_penalty"] * (s["counts"] > 0)


def logits_to_probs(logits: Tensor, temperature, top_k, top_p, min_p) -> Tensor:
    """[B, V] logits -> probabilities after temperature, top-k, top-p and min-p (transformers' order).

    The settings are tensors (0-d or [B, 1]); one sort of the vocabulary serves all three filters."""
    logits = logits / temperature
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    remove = rank >= torch.where(top_k > 0, top_k, vocab)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # top-p: keep a token while the tokens ranked above it hold less than top_p of the mass.
    remove = remove | (((sorted_probs.cumsum(-1) - sorted_probs) >= top_p) & (top_p < 1))
    remove = remove | (sorted_probs < min_p * sorted_probs[..., :1])
    logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(logits: Tensor, s: dict, greedy: bool, n_logprobs: int | None):
    """[B, V] logits -> next token [B, 1], and (chosen log-prob [B, 1], top values [B, n], top ids [B, n]) or None."""
    processed = apply_penalties(logits, s)
    if greedy:
        token = torch.argmax(processed, dim=-1, keepdim=True)
    else:
        probs = logits_to_probs(processed, s["temperature"], s["top_k"], s["top_p"], s["min_p"])
        # argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p, without torch.multinomial's host sync.
        token = torch.argmax(probs / s["noise"], dim=-1, keepdim=True)
    if n_logprobs is None:
        return token, None
    logprobs = torch.log_softmax(logits, dim=-1)  # the model's own distribution, before any processing
    top = torch.topk(logprobs, n_logprobs, dim=-1)
    return token, (logprobs.gather(-1, token), top.values, top.indices)


# ---------------------------------------------------------------- the model steps


def prefill(model, x: Tensor, input_pos: Tensor, left_pad: Tensor, s: dict, greedy: bool, n_logprobs: int | None):
    # x: [B, S] prompts in cache slots input_pos [S] -> first new token [B, 1] (and its log-probs)
    return sample(model(x, input_pos, left_pad, last_only=True)[:, -1], s, greedy, n_logprobs)


def decode_one_token(model, x: Tensor, input_pos: Tensor, left_pad: Tensor, s: dict, greedy: bool, n_logprobs: int | None):
    # x: [B, 1] in slot input_pos [1] -> next token [B, 1] (and its log-probs)
    return sample(model(x, input_pos, left_pad)[:, -1], s, greedy, n_logprobs)


def ensure_caches(model: Transformer, batch_size: int, prompt_len: int, max_new_tokens: int, keep: bool = False):
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


def token_steps(model, rows, max_new_tokens, params: SamplingParams, *, start_pos=0, pad_id=0, prefill_fn=prefill, decode_fn=decode_one_token):
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
    s = sampler_state(params, rows, model.config.vocab_size, device)
    generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
    refill_noise(s, params, generator)
    input_pos = torch.arange(start_pos, start_pos + width, device=device)
    token, logprobs = prefill_fn(model, x, input_pos, left_pad, s, greedy=params.greedy, n_logprobs=params.logprobs)
    yield token, logprobs
    input_pos = torch.tensor([start_pos + width], device=device)
    yield from decode_n_tokens(model, token, input_pos, left_pad, s, max_new_tokens - 1, params, generator, decode_fn)


def refill_noise(s: dict, params: SamplingParams, generator: torch.Generator | None):
    # Drawn outside the (compiled) step, so that a per-request torch.Generator can be used.
    if not params.greedy:
        s["noise"].exponential_(generator=generator)


def decode_n_tokens(model, cur_token, input_pos, left_pad, s, num_new_tokens, params, generator=None, decode_fn=decode_one_token):
    """Yields (token [B, 1], log-probs or None) for num_new_tokens decode steps after cur_token [B, 1]."""
    for _ in range(num_new_tokens):
        record_token(s, cur_token)
        refill_noise(s, params, generator)
        token, logprobs = decode_fn(model, cur_token, input_pos, left_pad, s, greedy=params.greedy, n_logprobs=params.logprobs)
        # Copies: CUDA graphs reuse their output buffers on the next call.
        cur_token = token.clone()
        logprobs = None if logprobs is None else tuple(t.clone() for t in logprobs)
        input_pos += 1
        yield cur_token, logprobs


# ---------------------------------------------------------------- generation


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row: up to EOS (excluded) or through the token completing a stop string
    texts: list[str] | None  # per row, ending before any stop string (None without a tokenizer)
    finish_reasons: list[str]  # per row: "eos", "stop" or "length"
    logprobs: list[list[dict]] | None  # per row, per token: {"token", "logprob", "top": [[id, logprob], ...]}
    prompt_tokens: list[int]  # positions prefilled per row (padding excluded)
    decode_steps: int  # decode steps run (a row that finished early still took part in them)
    time_to_first_token_s: float
    decode_time_s: float
    raw_tokens: list[list[int]] = field(repr=False, default_factory=list)  # every token produced per row
    speculation: dict | None = None  # speculative decoding's figures (Speculation.summary)


def check_prompts(prompts) -> list[list[int]]:
    """One prompt (a list of ids or a 1-D tensor) or a list of them -> a list of id lists."""
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist()
    if len(prompts) == 0:
        raise ValueError("the prompt list is empty")
    rows = [prompts] if isinstance(prompts[0], int) else [list(p.tolist() if isinstance(p, Tensor) else p) for p in prompts]
    if any(len(row) == 0 for row in rows):
        raise ValueError("a prompt is empty and the tokenizer adds no BOS token to start from")
    return rows


def check_stop(stop, tokenizer) -> list[str]:
    stop = list(stop)
    if any(s == "" for s in stop):
        raise ValueError("a stop string is empty")
    if stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer (tokenizer=...)")
    return stop


def find_stop(text: str, stop: list[str]) -> int:
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def finish_row(raw: list[int], eos_ids, stop: list[str], tokenizer: Tokenizer | None):
    """A row's produced tokens -> (tokens, text, finish reason), cut at the first EOS or stop string."""
    eos = set(eos_ids)
    end = next((i for i, t in enumerate(raw) if t in eos), None)
    tokens, reason = (raw, "length") if end is None else (raw[:end], "eos")
    if tokenizer is None:
        return tokens, None, reason
    text = tokenizer.decode(tokens)
    cut = find_stop(text, stop)
    if cut < 0:
        return tokens, text, reason
    # Keep the tokens through the one that completes the stop string; the text ends before it.
    n = next(n for n in range(1, len(tokens) + 1) if find_stop(tokenizer.decode(tokens[:n]), stop) >= 0)
    return tokens[:n], text[:cut], "stop"


def collect(raw_rows, logprob_steps, prompt_rows, eos_ids, stop, tokenizer, ttft, decode_time) -> Generation:
    rows = [finish_row(raw, eos_ids, stop, tokenizer) for raw in raw_rows]
    logprobs = None
    if logprob_steps and logprob_steps[0] is not None:
        chosen = torch.cat([lp[0] for lp in logprob_steps], dim=1).tolist()  # [B, steps]
        top_values = torch.stack([lp[1] for lp in logprob_steps], dim=1).tolist()  # [B, steps, n]
        top_ids = torch.stack([lp[2] for lp in logprob_steps], dim=1).tolist()
        logprobs = [
            [
                {"token": t, "logprob": chosen[b][i], "top": [list(p) for p in zip(top_ids[b][i], top_values[b][i])]}
                for i, t in enumerate(tokens)
            ]
            for b, (tokens, _, _) in enumerate(rows)
        ]
    return Generation(
        tokens=[r[0] for r in rows],
        texts=None if tokenizer is None else [r[1] for r in rows],
        finish_reasons=[r[2] for r in rows],
        logprobs=logprobs,
        prompt_tokens=[len(p) for p in prompt_rows],
        decode_steps=len(raw_rows[0]) - 1,
        time_to_first_token_s=ttft,
        decode_time_s=decode_time,
        raw_tokens=raw_rows,
    )


# ---------------------------------------------------------------- speculative decoding


def step_probs(logits: Tensor, s: dict, greedy: bool) -> Tensor:
    """[..., V] logits -> the distribution a token is drawn from (one-hot at the argmax when greedy)."""
    if greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return logits_to_probs(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])


def draft_step(draft, x: Tensor, input_pos: Tensor, s: dict, greedy: bool):
    # x: [1, 1] -> drafted token [1, 1] and the distribution p it was drawn from [1, V]
    probs = step_probs(draft(x, input_pos)[:, -1], s, greedy)
    return torch.argmax(probs / s["noise"], dim=-1, keepdim=True), probs


def verify_step(model, x: Tensor, input_pos: Tensor, s: dict, greedy: bool) -> Tensor:
    # x: [1, k + 1], the current token and k drafted ones -> the target's distributions q after each [k + 1, V]
    return step_probs(model(x, input_pos)[0], s, greedy)


def residual_probs(q: Tensor, p: Tensor) -> Tensor:
    """Where a drafted token is rejected, the next one comes from normalize(max(0, q - p)) over the whole
    vocabulary; if that has no mass (p equals q up to rounding, so rejection had ~0 chance), from q."""
    residual = (q - p).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 1e-6, residual / mass.clamp(min=1e-6), q)


def accept_drafts(drafted: Tensor, p: Tensor, q: Tensor, uniforms: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """Leviathan et al.'s rule: drafted [k] tokens drawn from p [k, V], target distributions q [k + 1, V].

    Token i is kept with probability min(1, q_i(x_i) / p_i(x_i)) (uniforms [k]); at the first rejection
    the next token comes from the residual; if all are kept, a bonus token comes from q_k. Returns the
    number kept and the next token, as device tensors."""
    k = drafted.shape[0]
    rows = torch.arange(k, device=drafted.device)
    ratio = q[rows, drafted] / p[rows, drafted]  # p > 0 at the drafted tokens: they were drawn from it
    kept = torch.cumprod((uniforms < ratio).int(), dim=0).sum()
    # Past the last draft p is zero, so the "residual" there is q_k itself: the bonus token.
    p = torch.cat([p, torch.zeros_like(p[:1])])
    return kept, torch.argmax(residual_probs(q[kept], p[kept]) / noise, dim=-1)


@dataclass
class Speculation:
    k: int
    rounds: int = 0
    drafted: int = 0
    kept: int = 0
    histogram: list[int] = field(default_factory=list)  # rounds that kept 0, 1, ..., k drafted tokens

    def summary(self) -> dict:
        return {
            "speculate_k": self.k,
            "acceptance_rate": self.kept / max(self.drafted, 1),
            "accepted_length_histogram": self.histogram,
            "tokens_per_target_forward": (self.kept + self.rounds) / max(self.rounds, 1),
        }


def check_speculation(model, draft, params: SamplingParams, k: int):
    if k < 1:
        raise ValueError(f"speculate_k must be >= 1, got {k}")
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's ({model.config.vocab_size})")
    if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty or params.logprobs is not None:
        raise ValueError("speculative decoding supports temperature, top_k, top_p and min_p, not penalties or logprobs")


@torch.no_grad()
def speculative_generate(
    model, draft, prompt: list[int], max_new_tokens: int, params: SamplingParams, k: int, *,
    eos_ids=(), stop=(), tokenizer=None, prefill_fn=prefill, draft_fn=draft_step, verify_fn=verify_step,
) -> Generation:  # fmt: skip
    """Generates from the target with the draft proposing k tokens a round; the output distribution is
    exactly the target's (greedy: exactly its greedy tokens). One host sync per round."""
    check_speculation(model, draft, params, k)
    device = model.tok_embeddings.weight.device
    # Verification writes up to k positions past the last kept token.
    for m in (model, draft):
        ensure_caches(m, 1, len(prompt), max_new_tokens + k + 1)
    s_target, s_draft = (sampler_state(params, [prompt], model.config.vocab_size, device) for _ in range(2))
    generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
    no_pad = torch.zeros(1, dtype=torch.long, device=device)
    x, input_pos = torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)
    eos, stats = set(eos_ids), Speculation(k, histogram=[0] * (k + 1))

    synchronize(device)
    start = time.perf_counter()
    refill_noise(s_target, params, generator)
    first, _ = prefill_fn(model, x, input_pos, no_pad, s_target, greedy=params.greedy, n_logprobs=None)
    draft(x, input_pos, last_only=True)  # the draft's cache holds the prompt too
    out = [int(first)]
    ttft = time.perf_counter() - start
    pos, cur = len(prompt), first.view(1, 1)
    while len(out) < max_new_tokens and out[-1] not in eos and not (stop and find_stop(tokenizer.decode(out), stop) >= 0):
        drafted, probs, token = [], [], cur
        for i in range(k):
            refill_noise(s_draft, params, generator)
            token, p = draft_fn(draft, token, torch.tensor([pos + i], device=device), s_draft, params.greedy)
            token = token.clone()
            drafted.append(token)
            probs.append(p.clone())
        drafted = torch.cat(drafted, dim=1)  # [1, k]
        q = verify_fn(model, torch.cat([cur, drafted], dim=1), torch.arange(pos, pos + k + 1, device=device), s_target, params.greedy)
        uniforms = torch.rand(k, device=device, generator=generator)
        noise = torch.empty(q.shape[-1], device=device).exponential_(generator=generator)
        kept, next_token = accept_drafts(drafted[0], torch.cat(probs), q, uniforms, noise)
        host = torch.cat([kept.view(1), next_token.view(1), drafted[0]]).tolist()  # the round's one sync
        n = host[0]
        if n == k:  # the draft never fed its last token: do it, so its cache is complete
            draft_fn(draft, drafted[:, -1:], torch.tensor([pos + k], device=device), s_draft, params.greedy)
        emitted = host[2 : 2 + n] + [host[1]]
        stats.rounds, stats.drafted, stats.kept = stats.rounds + 1, stats.drafted + k, stats.kept + n
        stats.histogram[n] += 1
        out += emitted
        pos += len(emitted)
        cur = torch.tensor([[emitted[-1]]], device=device)
    raw = out[:max_new_tokens]
    result = collect([raw], [None], [prompt], eos_ids, list(stop), tokenizer, ttft, time.perf_counter() - start - ttft)
    result.speculation = stats.summary()
    return result


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts,
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    eos_ids=(),
    stop=(),
    tokenizer: Tokenizer | None = None,
    batch_size: int = 1,
    pad_id: int = 0,
    draft_model: Transformer | None = None,
    speculate_k: int = 4,
    prefill_fn=prefill,
    decode_fn=decode_one_token,
    draft_fn=draft_step,
    verify_fn=verify_step,
    **sampling_kwargs,
) -> Generation:
    """Continues each prompt (token ids; one prompt or a list, each repeated batch_size times) in one batch.

    Every row stops at its first EOS or stop string (matched on decoded text, which needs tokenizer)
    or after max_new_tokens. sampling_kwargs (temperature=..., top_p=...) build a SamplingParams.
    With a draft_model, decoding is speculative (batch 1), speculate_k drafted tokens a round."""
    params = sampling or SamplingParams(**sampling_kwargs)
    rows = check_prompts(prompts) * batch_size
    stop = check_stop(stop, tokenizer)
    if draft_model is not None:
        if len(rows) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time, got a batch of {len(rows)}")
        return speculative_generate(
            model, draft_model, rows[0], max_new_tokens, params, speculate_k, eos_ids=eos_ids, stop=stop,
            tokenizer=tokenizer, prefill_fn=prefill_fn, draft_fn=draft_fn, verify_fn=verify_fn,
        )  # fmt: skip
    device = model.tok_embeddings.weight.device
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    steps = token_steps(model, rows, max_new_tokens, params, pad_id=pad_id, prefill_fn=prefill_fn, decode_fn=decode_fn)

    synchronize(device)
    start = time.perf_counter()
    tokens, logprobs = [], []
    finished = torch.zeros(len(rows), dtype=torch.bool, device=device)
    for step, (token, lp) in enumerate(steps, start=1):
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


class IncrementalDecoder:
    """Turns one row's tokens into text pieces; a character split across tokens comes out once complete.

    Decodes a short window (from the token before the last emitted piece) so that tokenizers that
    drop a leading space at the start of a decode, and multi-byte characters, come out right."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(before) :]


@torch.no_grad()
def stream(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt,
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    stop=(),
    start_pos: int = 0,
    prefill_fn=prefill,
    decode_fn=decode_one_token,
    **sampling_kwargs,
):
    """Yields the continuation of one prompt (text, or token ids) as text pieces while it is generated.

    The pieces join to exactly the final text: held back are an incomplete character and any tail that
    could begin a stop string. The generator's return value (StopIteration.value) is the Generation."""
    params = sampling or SamplingParams(**sampling_kwargs)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    (ids,) = check_prompts([ids])
    stop = check_stop(stop, tokenizer)
    hold = max((len(s) for s in stop), default=1) - 1
    device = model.tok_embeddings.weight.device
    steps = token_steps(model, [ids], max_new_tokens, params, start_pos=start_pos, prefill_fn=prefill_fn, decode_fn=decode_fn)
    decoder, pending, raw, logprobs = IncrementalDecoder(tokenizer), "", [], []
    start = time.perf_counter()
    for token, lp in steps:
        raw.append(int(token[0, 0]))  # waits for the device
        if len(raw) == 1:
            ttft = time.perf_counter() - start
        logprobs.append(lp)
        if raw[-1] in tokenizer.eos_ids:
            break
        pending += decoder.push(raw[-1])
        cut = find_stop(pending, stop)
        if cut >= 0:
            pending = pending[:cut]
            break
        if len(pending) > hold:
            yield pending[: len(pending) - hold]
            pending = pending[len(pending) - hold :]
    else:
        pending += decoder.flush()
    if pending:
        yield pending
    synchronize(device)
    decode_time = time.perf_counter() - start - ttft
    return collect([raw], logprobs, [ids], tokenizer.eos_ids, stop, tokenizer, ttft, decode_time)


def drain(pieces, on_piece=None) -> Generation:
    """Runs a stream() generator to its end, passing each piece to on_piece; returns its Generation."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            return done.value
        if on_piece is not None:
            on_piece(piece)


class Chat:
    """A conversation kept in the KV cache: each turn prefills only the tokens not cached yet.

    With a chat template, turns are rendered by it; without one, the conversation is its messages
    joined by newlines. When a turn would not fit the cache, the oldest turns are dropped (the system
    message stays) and dropped_turns counts them."""

    def __init__(self, model, tokenizer, *, system=None, max_new_tokens=256, cache_length=CHAT_CACHE_LENGTH, **stream_kwargs):
        self.model, self.tokenizer, self.max_new_tokens, self.stream_kwargs = model, tokenizer, max_new_tokens, stream_kwargs
        cache_length = min(cache_length, model.config.block_size)
        if max_new_tokens >= cache_length:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a message in the conversation's "
                             f"{cache_length}-position cache")  # fmt: skip
        model.setup_caches(1, cache_length)
        self.system = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self):
        self.messages, self.cached, self.dropped_turns, self.last_prefill = [], [], 0, 0

    def render(self, messages) -> list[int]:
        if self.tokenizer.chat_template:
            return self.tokenizer.encode_chat(self.system + messages)
        return self.tokenizer.encode("\n".join(m["content"] for m in self.system + messages))

    def send(self, text: str):
        """Yields the reply's text pieces; returns its Generation (see drain). A message that cannot fit
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
        common = 0
        while common < min(len(ids) - 1, len(self.cached)) and ids[common] == self.cached[common]:
            common += 1
        self.last_prefill = len(ids) - common
        pieces = stream(self.model, self.tokenizer, ids[common:], self.max_new_tokens, start_pos=common, **self.stream_kwargs)
        result = yield from pieces
        # Every produced token but the last was fed back, so its keys and values are in the cache.
        self.cached = ids + result.raw_tokens[0][:-1]
        self.messages.append({"role": "assistant", "content": result.texts[0]})
        return result


# ---------------------------------------------------------------- loading


def load_model(checkpoint_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               shard=None, kernels: Kernels = Kernels()):  # fmt: skip
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


def model_size_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads: all of them but the embedding table, of which it reads one
    row, unless the output projection reuses it (tied embeddings)."""
    skip = {"tok_embeddings.weight"} if model.output is not None else set()
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if name not in skip)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # peak resident set, KiB on Linux


def compile_steps(device: torch.device) -> dict:
    """The compiled steps, named as generate() takes them. CUDA graphs ("reduce-overhead") exist on CUDA only."""
    if device.type == "cuda":  # a CUDA graph replays the whole step, with none of the checks below
        step = {"mode": "reduce-overhead"}
    else:  # Dynamo's guards check each input's shape and stride before a call already; the compiled code's
        # own re-check of each cost ~0.9 ms of a 13 ms int8 decode step here (measured with torch.profiler).
        step = {"options": {"size_asserts": False}}
    return {
        "prefill_fn": torch.compile(prefill, fullgraph=True, dynamic=True),
        "decode_fn": torch.compile(decode_one_token, fullgraph=True, **step),
        "draft_fn": torch.compile(draft_step, fullgraph=True, **step),
        "verify_fn": torch.compile(verify_step, fullgraph=True, **step),
    }


# ---------------------------------------------------------------- command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", type=utf8_text, help="text to continue; several --prompt make one batch")
    p.add_argument("--prompts_file", type=Path, help="one prompt a line, all in one batch")
    p.add_argument("--interactive", action="store_true", help="a conversation on stdin (chat template if any)")
    p.add_argument("--system", default=None, type=utf8_text, help="system message for --interactive")
    p.add_argument("--num_samples", type=int, default=1, help="number of runs")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate at most, per row")
    p.add_argument("--batch_size", type=int, default=1, help="rows generated from each prompt")
    p.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (may be given several times)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--min_p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0: off)")
    p.add_argument("--repetition_penalty", type=float, default=1.0, help="> 1 discourages repeats (1: off)")
    p.add_argument("--presence_penalty", type=float, default=0.0, help="OpenAI presence penalty (0: off)")
    p.add_argument("--frequency_penalty", type=float, default=0.0, help="OpenAI frequency penalty (0: off)")
    p.add_argument("--logprobs", type=int, default=None, help="report log-probs of chosen tokens and N alternatives")
    p.add_argument("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None, help="draft model: speculative decoding")
    p.add_argument("--speculate_k", type=int, default=4, help="tokens the draft proposes per round")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile_prefill", action="store_true", help="torch.compile the prefill too (dynamic shapes)")
    p.add_argument("--kernels", choices=("auto", "fused", "library"), default="auto",
                   help="CPU one-row products: auto (the fastest measured for this CPU and --compile), fused "
                        "(float32 multiply-and-sum, for compiled steps) or library (BLAS, ATen's int8/int4 kernels)")  # fmt: skip
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace (.json) of the last run")
    p.add_argument("--json", action="store_true", help="print one JSON object of outputs and figures as last line")
    p.add_argument("--tp_timeout_s", type=float, default=tp.DEFAULT_TIMEOUT_S,
                   help="under torchrun: seconds a rank waits for the others before it gives up")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "batch_size", "speculate_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not (math.isfinite(args.tp_timeout_s) and args.tp_timeout_s > 0):
        p.error("--tp_timeout_s must be a finite number > 0")
    if args.profile is not None and not args.profile.parent.is_dir():
        p.error(f"--profile {args.profile}: there is no folder {args.profile.parent}")
    try:
        args.sampling = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs,
        )  # fmt: skip
        check_seed(args.seed)
        args.device = parse_device(args.device)
    except ValueError as e:
        p.error(str(e))
    if "" in args.stop:
        p.error("a stop string is empty")
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            p.error(f"--prompts_file {args.prompts_file}: not a file")
        try:
            lines = read_text(args.prompts_file).splitlines()
        except ValueError as e:
            p.error(f"--prompts_file {e}")
        args.prompt = (args.prompt or []) + [line for line in lines if line.strip()]
        if not args.prompt:
            p.error(f"--prompts_file {args.prompts_file} holds no prompt")
    args.prompt = args.prompt or ["Hello, my name is"]
    return args


def utf8_text(text: str) -> str:
    """argparse type of text flags: bytes that are not UTF-8 reach sys.argv as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return text


def print_piece(piece: str):
    print(piece, end="", flush=True)


def chat_loop(model, tokenizer, args, step_fns, read_line):
    """A conversation on stdin: read_line() gives the next line as bytes (b"" at the end)."""
    chat = Chat(
        model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens, sampling=args.sampling,
        stop=args.stop, **step_fns,
    )  # fmt: skip
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
            drain(chat.send(text), print_piece)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        if chat.dropped_turns > dropped:
            print(f"[the conversation outgrew the cache: dropped its {chat.dropped_turns - dropped} oldest turn(s)]", file=sys.stderr)


def load_draft(args, tokenizer: Tokenizer, shard, kernels: Kernels):
    """The draft model for speculative decoding, checked to share the target's tokenizer."""
    draft = load_model(args.draft_checkpoint_path, args.device, args.dtype, shard, kernels)
    draft_tokenizer = load_tokenizer(resolve_checkpoint(args.draft_checkpoint_path).parent)
    probe = "Tokenizer check: ünïcödé, 12345, emoji 🙂."
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe) or draft_tokenizer.eos_ids != tokenizer.eos_ids:
        raise ValueError(f"the draft {args.draft_checkpoint_path} does not use the target's tokenizer")
    return draft


def run(args, shard=None):
    t0 = time.perf_counter()
    kernels = Kernels.choose(args.device, args.compile, args.kernels)
    model = load_model(args.checkpoint_path, args.device, args.dtype, shard, kernels)
    tokenizer = load_tokenizer(resolve_checkpoint(args.checkpoint_path).parent)
    draft = load_draft(args, tokenizer, shard, kernels) if args.draft_checkpoint_path else None
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    check_logprobs(args.sampling, model.config.vocab_size)
    if shard is not None:  # every rank must sample the same tokens: one seed for all, chosen by rank 0
        args.seed = tp.from_rank0(args.seed if args.seed is not None else int(torch.randint(2**62, ())))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    compiled = compile_steps(args.device)  # each compiles lazily, on first use
    step_fns = dict(
        prefill_fn=compiled["prefill_fn"] if args.compile_prefill else prefill,
        decode_fn=compiled["decode_fn"] if args.compile else decode_one_token,
    )
    if args.interactive:
        if draft is not None:
            raise ValueError("--interactive does not take a draft model")
        read_line = sys.stdin.buffer.readline  # under torchrun: rank 0 reads, and passes each line to the others
        if shard is not None:
            read_line = lambda: tp.from_rank0(sys.stdin.buffer.readline() if shard.rank == 0 else None)  # noqa: E731
        return chat_loop(model, tokenizer, args, step_fns, read_line)

    prompts = [tokenizer.encode(p) for p in args.prompt]
    check_prompts(prompts)
    single = len(prompts) == 1 and args.batch_size == 1
    options = dict(sampling=args.sampling, stop=args.stop, **step_fns)
    if draft is not None:
        if not single:
            raise ValueError("speculative decoding takes one prompt and --batch_size 1")
        speculative = dict(draft_model=draft, speculate_k=args.speculate_k)
        if args.compile:
            speculative.update(draft_fn=compiled["draft_fn"], verify_fn=compiled["verify_fn"])

    def run_once(max_new_tokens, on_piece=None, plain=False):
        if single and draft is None or plain:
            return drain(stream(model, tokenizer, prompts[0], max_new_tokens, **options), on_piece)
        extra = speculative if draft is not None else {}
        return generate(model, prompts, max_new_tokens, batch_size=args.batch_size, tokenizer=tokenizer,
                        eos_ids=tokenizer.eos_ids, **options, **extra)  # fmt: skip

    # Caches sized once for every run below (speculation writes k + 1 positions ahead), so nothing recompiles.
    ahead = args.speculate_k + 1 if draft is not None else 0
    for m in (model, draft) if draft is not None else (model,):
        ensure_caches(m, len(prompts) * args.batch_size, max(map(len, prompts)), args.max_new_tokens + ahead)
    compile_time = None
    if args.compile or args.compile_prefill:
        t0 = time.perf_counter()
        run_once(min(args.max_new_tokens, 2 * CHECK_INTERVAL))
        if draft is not None:  # the plain decode step too: speculation is compared with it
            run_once(min(args.max_new_tokens, 2 * CHECK_INTERVAL), plain=True)
        compile_time = time.perf_counter() - t0
        print(f"Compilation and warm-up: {compile_time:.1f} s", file=sys.stderr)

    results = []
    for i in range(args.num_samples):
        profile = args.profile is not None and i == args.num_samples - 1 and (shard is None or shard.rank == 0)
        streaming = single and draft is None
        if streaming:
            print_piece(args.prompt[0])
        with torch.profiler.profile() if profile else contextlib.nullcontext() as profiler:
            result = run_once(args.max_new_tokens, print_piece)
        if profile:
            profiler.export_chrome_trace(str(args.profile))
        if streaming:
            print(flush=True)
        else:
            for b, text in enumerate(result.texts):
                print(f"[{b}] {args.prompt[b % len(args.prompt)]}{text}\n", flush=True)
        results.append(result)

    stats = summarize(results, model, args.device, compile_time)
    if shard is not None:  # the figures are rank 0's, but for memory: a rank's use depends on its slice
        stats["tensor_parallel_ranks"] = shard.world_size
        stats["peak_memory_gb_per_rank"] = tp.gather_objects(stats.pop("peak_memory_gb"))
    if draft is not None:
        plain = summarize([run_once(args.max_new_tokens, plain=True)], model, args.device, None)
        stats["speculation"] = results[-1].speculation
        stats["plain_decode_tokens_per_s"] = plain["decode_tokens_per_s"]
        stats["speedup_over_plain_decoding"] = stats["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    for key, value in stats.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", file=sys.stderr)
    if args.json:
        report = {
            "outputs": [text for r in results for text in r.texts],
            "tokens": [row for r in results for row in r.tokens],
            "finish_reasons": [reason for r in results for reason in r.finish_reasons],
            "stats": stats,
        }
        if args.logprobs is not None:
            report["logprobs"] = [row for r in results for row in r.logprobs]
        print(json.dumps(report))


def summarize(runs: list[Generation], model: Transformer, device: torch.device, compile_time: float | None) -> dict:
    """Figures over all runs. A decode step advances every row by one token."""
    batch = len(runs[0].tokens)
    decode_steps = sum(r.decode_steps for r in runs)
    decode_time = sum(r.decode_time_s for r in runs)
    ttft = sum(r.time_to_first_token_s for r in runs) / len(runs)
    steps_per_s = decode_steps / decode_time if decode_time > 0 else float("nan")
    size = model_size_bytes(model)
    return {
        "prompt_tokens": runs[0].prompt_tokens,
        "new_tokens": [len(row) for r in runs for row in r.tokens],
        "time_to_first_token_s": ttft,
        "prefill_tokens_per_s": sum(runs[0].prompt_tokens) / ttft,
        "decode_tokens_per_s_per_row": steps_per_s,
        "decode_tokens_per_s": steps_per_s * batch,
        "bandwidth_gb_s": size * steps_per_s / 1e9,  # the weights are read once per decode step
        "model_size_gb": size / 1e9,
        "peak_memory_gb": peak_memory_gb(device),
        "compile_time_s": compile_time,
        "kernels": model.kernels.describe() if device.type == "cpu" else None,
    }


def main(argv=None):
    # Under torchrun every rank runs all of this; rank 0 alone prints (the others fail alike, quietly).
    quiet = int(os.environ.get("RANK", "0")) != 0
    shard = None
    with open(os.devnull, "w") as devnull, contextlib.ExitStack() as silence:
        if quiet:
            silence.enter_context(contextlib.redirect_stdout(devnull))
            silence.enter_context(contextlib.redirect_stderr(devnull))
        try:
            with user_errors(quiet):
                args = parse_args(argv)
                shard, args.device = tp.maybe_init_dist(args.device, args.tp_timeout_s)
                run(args, shard)
                if shard is not None:
                    tp.end_rank()
        except RuntimeError as e:  # under torchrun, mostly a collective failing: a rank died or hung
            if shard is None:
                raise
            sys.exit(f"error: rank {shard.rank} stopped: {e}")
        finally:
            tp.leave_dist()


if __name__ == "__main__":
    main()
