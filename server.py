"""An OpenAI-compatible server, with continuous batching and a chat page.

    python server.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --compile
    open http://127.0.0.1:8000/ (the chat page), or point any OpenAI client at http://127.0.0.1:8000/v1

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream or not), GET /health, GET /.
One engine thread owns the model and a static KV cache of --max_batch_size rows ("slots"). A request waits in
a bounded queue for a free slot, is prefilled into it between two decode steps, and decodes with every other
busy slot in one batch; it frees its slot when it ends or its client goes away. A slot keeps its tokens' keys
and values after its request, so the next turn of a conversation prefills only what is new.
With --draft_checkpoint_path, each step is a round of speculative decoding for all busy slots: the draft
proposes --speculate_k tokens per slot, the model verifies them in one pass, and each slot keeps what the
acceptance rule keeps (the model's own distribution; at temperature 0, its own greedy tokens). A batch with a
request the rule does not cover (penalties, log-probs) decodes one token per step meanwhile.
"""

import argparse
import asyncio
import hmac
import json
import logging
import math
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from checkpoint import (
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    DTYPES,
    HelpFormatter,
    device_flag,
    resolve_checkpoint,
    user_errors,
)
from generate import (
    cached_prefix,
    check_speculation,
    compile_steps,
    draft_and_verify,
    encode_conversation,
    load_models,
    prefill,
)
from results import Speculation, TextPieces
from sampling import SamplerState, SamplingParams, accept_drafts, check_seed, record_token, row_sampler_state, set_row
from tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 16
# A decode step attends to the cache slots up to its furthest row's position, rounded up to this many: a CUDA
# graph is recorded per length met, so the rounding bounds their number (one compiled graph serves them all).
WINDOW_STEP = 128
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs at most (OpenAI's limit); a decode step computes this many for all rows
ROLES = ("system", "developer", "user", "assistant")
# Fields this server cannot honour, with the values that ask for nothing: anything else is refused, not ignored.
UNSUPPORTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
}
CHAT_PAGE = Path(__file__).resolve().parent / "chat.html"
log = logging.getLogger("server")


class ApiError(Exception):
    """An error the client caused, answered with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# ---------------------------------------------------------------- the engine


@dataclass
class Choice:
    """One sequence to generate: a request's prompt for one of its n choices. The engine thread fills it."""

    index: int
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    top_logprobs: int | None  # None: no log-probs
    send: object  # send(event dict) from the engine thread to the request's handler
    generator: torch.Generator | None = None
    pieces: TextPieces | None = None
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens whose keys and values the slot held already (not prefilled again)
    cancelled: bool = False


def speculable(c: Choice) -> bool:
    """Whether speculative decoding's acceptance rule covers a choice's sampling (not penalties or log-probs)."""
    return c.top_logprobs is None and not c.params.penalized


class Engine:
    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        max_batch_size: int,
        max_seq_length: int,
        steps,
        max_queue: int,
        draft=None,
        speculate_k: int = 4,
    ):
        self.model, self.tokenizer, self.steps, self.draft = model, tokenizer, steps, draft
        self.device = model.tok_embeddings.weight.device
        self.k = speculate_k if draft is not None else 0
        self.speculation = Speculation(self.k) if draft is not None else None  # per slot and round
        for m in (model, draft) if draft is not None else (model,):
            m.setup_caches(max_batch_size, max_seq_length)
        self.horizon = max_seq_length - 1  # the last cache position
        # Idle rows feed this position during a step, and write from one before it (a speculative round's draft
        # catching up) to k after it (its verification): no request reaches any of these positions.
        self.idle_position = self.horizon - self.k
        self.context = self.idle_position - (draft is not None)
        if self.context < 2:
            raise ValueError(
                f"--max_seq_length {max_seq_length} leaves no room for a prompt and a reply"
                + (f" beside speculate_k {self.k}" if draft is not None else "")
            )
        self.slots: list[Choice | None] = [None] * max_batch_size
        self.cached: list[list[int]] = [[] for _ in range(max_batch_size)]  # tokens whose keys/values a row holds
        self.state = row_sampler_state(max_batch_size, model.config.vocab_size, self.device)
        self.tokens = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self.last = [0] * max_batch_size  # self.tokens on the host: each row's token to feed next
        self.no_pad = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        # A decode step runs rows 0..n-1, n a power of two below the slots or all of them: few compiled shapes.
        self.batch_sizes = sorted({min(1 << i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
        self.waiting: queue.Queue = queue.Queue(max_queue)
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)
        # A compiled step holds one graph per batch size, greedy or sampled, with log-probs or without (the
        # draft's: of one token or two): more than Dynamo's default limit of 8 graphs per function, past which a
        # fullgraph step fails instead of compiling.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(self.batch_sizes))

    @torch.no_grad()
    def warm_up(self):
        """Runs the decode step (and the speculative round) at every batch size, greedy and sampled, so that
        compiled steps compile them all before serving (seconds to minutes each) rather than while requests
        wait; log-probs compile when first asked for. Idle rows write at positions no request reaches, so this
        changes no slot."""
        for n in self.batch_sizes:
            state, positions = self.state_rows(slice(0, n)), self.positions(n)
            for greedy in (True, False):
                start = time.perf_counter()
                self.steps.decode(
                    self.model,
                    self.tokens[:n],
                    positions,
                    self.no_pad[:n],
                    state,
                    greedy=greedy,
                    n_logprobs=None,
                    window=self.window(0),
                )
                if self.draft is not None:
                    self.draft_and_verify(n, [], state, positions, greedy, self.window(0))
                log.info(
                    "%s of %d rows, %s: ready in %.1f s",
                    "speculative round" if self.draft else "decode step",
                    n,
                    "greedy" if greedy else "sampled",
                    time.perf_counter() - start,
                )

    def state_rows(self, rows: slice) -> SamplerState:
        return SamplerState(*(t[rows] for t in self.state))

    def positions(self, n: int) -> torch.Tensor:
        """Rows 0..n-1's positions to feed next [n, 1]: a busy row's next after the tokens it holds; an idle
        row's the idle position."""
        return torch.tensor(
            [[len(self.cached[i]) if self.slots[i] is not None else self.idle_position] for i in range(n)],
            device=self.device,
        )

    def batch_size(self, busy: list[int]) -> int:
        return next(n for n in self.batch_sizes if n > max(busy))

    def window(self, position: int) -> torch.Tensor:
        """The steps' window for a step whose rows write up to position: a tensor of the slots' number (only
        its length is read), marked dynamic so that no length compiles a graph of its own. It stays shorter
        than the cache (requests write below the horizon), since a slice as long as the cache is contiguous,
        which the compiled graph would specialize on."""
        length = min((position // WINDOW_STEP + 1) * WINDOW_STEP, self.horizon)
        window = torch.empty(length, dtype=torch.bool, device=self.device)
        torch._dynamo.mark_dynamic(window, 0)
        return window

    def submit(self, choices: list[Choice]):
        if self.waiting.maxsize - self.waiting.qsize() < len(choices):
            raise ApiError(
                "the server is busy: its queue of waiting requests is full", status=429, kind="rate_limit_error"
            )
        for c in choices:  # only this event loop's thread puts, so the room checked above is still there
            self.waiting.put_nowait(c)

    def busy_slots(self) -> list[int]:
        return [i for i, c in enumerate(self.slots) if c is not None]

    @torch.no_grad()
    def loop(self):
        while True:
            self.admit()
            busy = self.busy_slots()
            if busy:
                try:
                    if self.draft is not None and all(speculable(self.slots[i]) for i in busy):
                        self.speculate(busy)
                    else:
                        self.decode(busy)
                except Exception as e:  # a fault of ours: end the requests it hit, keep serving
                    log.exception("decode step failed")
                    for i in busy:
                        self.finish(i, error=str(e))

    def admit(self):
        """Takes waiting choices into free slots (blocking while nothing is running), prefilling each."""
        while None in self.slots:
            try:
                choice = self.waiting.get(block=not self.busy_slots())
            except queue.Empty:
                return
            if choice.cancelled:
                continue
            free = [i for i, c in enumerate(self.slots) if c is None]
            row = max(free, key=lambda i: (cached_prefix(self.cached[i], choice.ids), -i))
            try:
                self.prefill(row, choice)
            except Exception as e:
                log.exception("prefill failed")
                self.slots[row] = choice
                self.finish(row, error=str(e))

    def prefill(self, row: int, choice: Choice):
        start = choice.reused = cached_prefix(self.cached[row], choice.ids)
        self.slots[row], self.cached[row] = choice, choice.ids[:start]
        choice.pieces = TextPieces(self.tokenizer, choice.stop)
        if choice.params.seed is not None:
            choice.generator = choice.params.generator(self.device)
        set_row(self.state, row, choice.params, choice.ids)
        self.refill_noise([row])
        x = torch.tensor([choice.ids[start:]], device=self.device)
        positions = torch.arange(start, len(choice.ids), device=self.device)
        row_state = self.state_rows(slice(row, row + 1))
        token, logprobs = prefill(
            self.model,
            x,
            positions,
            self.no_pad[:1],
            row_state,
            choice.params.greedy,
            choice.top_logprobs,
            first_row=row,
            kv_length=len(choice.ids),
        )
        if self.draft is not None:  # from one position earlier: the draft may lack the last one the slot held
            since = max(start - 1, 0)
            self.draft(
                torch.tensor([choice.ids[since:]], device=self.device),
                torch.arange(since, len(choice.ids), device=self.device),
                self.no_pad[:1],
                last_only=True,
                first_row=row,
                kv_length=len(choice.ids),
            )
        self.cached[row] = list(choice.ids)
        self.tokens[row] = token[0]
        self.last[row] = int(token)
        self.emit(row, self.last[row], None if logprobs is None else row_logprobs([t.tolist() for t in logprobs], 0))

    def refill_noise(self, rows: list[int]):
        for i in rows:
            c = self.slots[i]
            if not c.params.greedy:
                self.state.noise[i].exponential_(generator=c.generator)

    def decode(self, busy: list[int]):
        n = self.batch_size(busy)
        state, positions = self.state_rows(slice(0, n)), self.positions(n)
        record_token(state, self.tokens[:n])
        self.refill_noise(busy)
        greedy = all(self.slots[i].params.greedy for i in busy)
        n_logprobs = MAX_TOP_LOGPROBS if any(self.slots[i].top_logprobs is not None for i in busy) else None
        window = self.window(max(len(self.cached[i]) for i in busy))  # a row feeds position len(cached)
        token, logprobs = self.steps.decode(
            self.model,
            self.tokens[:n],
            positions,
            self.no_pad[:n],
            state,
            greedy=greedy,
            n_logprobs=n_logprobs,
            window=window,
        )
        if self.draft is not None:  # keeps up: a speculative round expects it to lack one position at most
            self.draft(*self.draft_inputs(n, positions), self.no_pad[:n], last_only=True, kv_length=window.shape[0])
        self.tokens[:n] = token  # a copy: CUDA graphs reuse token's buffer on the next call
        host = token[:, 0].tolist()  # the step's one sync
        logprobs = None if logprobs is None else [t.tolist() for t in logprobs]
        for i in busy:
            self.cached[i].append(self.last[i])
            self.last[i] = host[i]
            self.emit(i, host[i], None if logprobs is None else row_logprobs(logprobs, i))

    def draft_inputs(self, n: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..n-1's previous and current tokens [n, 2] and their positions: what the draft reads next, as
        its cache may lack the previous one (the model's verification kept all the drafted tokens)."""
        previous = torch.tensor(
            [[self.cached[i][-1] if self.slots[i] is not None else 0] for i in range(n)], device=self.device
        )
        return torch.cat([previous, self.tokens[:n]], dim=1), torch.cat([positions - 1, positions], dim=1)

    def draft_and_verify(self, n: int, busy: list[int], state, positions: torch.Tensor, greedy: bool, window):
        """generate.draft_and_verify for rows 0..n-1, whose draft reads each row's previous and current tokens;
        the busy rows' sampling noise is drawn anew before each draft step."""
        return draft_and_verify(
            self.model,
            self.draft,
            self.steps,
            self.k,
            self.tokens[:n],
            self.draft_inputs(n, positions),
            state,
            state,
            greedy,
            lambda: self.refill_noise(busy),
            window,
        )

    def speculate(self, busy: list[int]):
        """One round of speculative decoding for every busy slot."""
        n = self.batch_size(busy)
        state = self.state_rows(slice(0, n))
        greedy = all(self.slots[i].params.greedy for i in busy)
        window = self.window(max(len(self.cached[i]) for i in busy) + self.k)
        drafted, p, q = self.draft_and_verify(n, busy, state, self.positions(n), greedy, window)
        uniforms = torch.zeros(n, self.k, device=self.device)  # a greedy row keeps a draft where q (one-hot) agrees
        for i in busy:
            if not self.slots[i].params.greedy:
                uniforms[i] = torch.rand(self.k, generator=self.slots[i].generator, device=self.device)
        self.refill_noise(busy)
        kept, next_token = accept_drafts(drafted, p, q, uniforms, state.noise)
        host = torch.cat([kept[:, None], next_token[:, None], drafted], dim=1).tolist()  # the round's one sync
        self.tokens[:n, 0] = next_token
        for i in busy:
            n_kept, new = host[i][0], host[i][2 : 2 + host[i][0]] + [host[i][1]]
            self.speculation.record(n_kept)
            self.cached[i] += [self.last[i]] + new[:-1]
            self.last[i] = new[-1]
            for token in new:
                self.emit(i, token, None)
                if self.slots[i] is None:  # ended (length, stop, or its client went away)
                    break

    def emit(self, row: int, token: int, logprobs: tuple | None):
        """Hands row's new token to its request: the text it completes, its log-probs (chosen, top values, top
        ids); ends the choice when done."""
        c = self.slots[row]
        if c.cancelled:
            return self.finish(row)
        c.tokens.append(token)
        event = {"index": c.index, "text": c.pieces.push(token), "finish_reason": None, "logprobs": None}
        if logprobs is not None and c.top_logprobs is not None and c.pieces.finished != "eos":
            chosen, values, ids = logprobs
            top = list(zip(ids[: c.top_logprobs], values[: c.top_logprobs]))
            event["logprobs"] = {"token": token, "logprob": chosen, "top": top}
        if not c.pieces.finished and len(c.tokens) >= c.max_tokens:
            event["text"] += c.pieces.end()
            event["finish_reason"] = "length"
        if c.pieces.finished:
            event["finish_reason"] = "stop"
        c.send(event)
        if event["finish_reason"]:
            self.finish(row)

    def finish(self, row: int, error: str | None = None):
        c = self.slots[row]
        self.slots[row] = None
        if error is not None:
            c.send({"index": c.index, "error": error})


def row_logprobs(logprobs: list, row: int) -> tuple:
    """sample()'s log-probs as lists -> row's (chosen log-prob, top values, top ids)."""
    chosen, values, ids = logprobs
    return chosen[row][0], values[row], ids[row]


# ---------------------------------------------------------------- requests


def integer(body: dict, name: str, default, low: int | None = None, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer, got {json.dumps(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ApiError(f"{name} must be {bounds}, got {value}", name)
    return value


def number(body: dict, name: str, default: float, ok, wanted: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ApiError(f"{name} must be {wanted}, got {json.dumps(value)}", name)
    return float(value)


def sampling_settings(body: dict) -> SamplingParams:
    """The request's sampling fields, OpenAI's defaults (temperature 1) and extensions (top_k, min_p, ...)."""
    top_k = integer(body, "top_k", 0, low=-1)  # -1 is off, as vLLM takes it
    seed = integer(body, "seed", None)
    try:
        check_seed(seed)
    except ValueError as e:
        raise ApiError(str(e), "seed") from None
    return SamplingParams(
        temperature=number(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0"),
        top_p=number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=max(top_k, 0),
        min_p=number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        presence_penalty=number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        frequency_penalty=number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        repetition_penalty=number(body, "repetition_penalty", 1.0, lambda v: v > 0, "a number > 0"),
        seed=seed,
    )


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return stop


def chat_prompt(body: dict, tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise ApiError(f"messages[{i}].content must be a string", f"messages[{i}].content")
    # A developer message is what newer OpenAI clients send in place of a system one.
    return encode_conversation(
        tokenizer,
        [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages],
    )


def completion_prompts(body: dict, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists: one prompt each."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)  # noqa: E731
    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_ids(p) for p in prompt):
        raise ApiError("prompt must be a string, a list of strings, or token ids", "prompt")
    rows = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    if any(not 0 <= t < vocab_size for row in rows for t in row):
        raise ApiError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if any(not row for row in rows):
        raise ApiError("a prompt is empty and the tokenizer adds no BOS token to start from", "prompt")
    return rows


@dataclass
class Job:
    """A parsed request: its prompts, n choices of each, and what to answer with."""

    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    top_logprobs: int | None
    stream: bool
    include_usage: bool
    echo: bool


def parse_job(body, chat: bool, app_state) -> Job:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != app_state.model_name:
        raise ApiError(f"the model {json.dumps(model)} does not exist; this server has {app_state.model_name}", "model")
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise ApiError(f"{name} is not supported by this server", name)
    engine = app_state.engine
    if chat:
        prompts = [chat_prompt(body, engine.tokenizer)]
        if body.get("logprobs") not in (None, True, False):
            raise ApiError("logprobs must be true or false", "logprobs")
        top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if body.get("logprobs") else None
    else:
        prompts = completion_prompts(body, engine.tokenizer, engine.model.config.vocab_size)
        top = integer(body, "logprobs", None, 0, 5)
    longest = max(map(len, prompts))
    if longest >= engine.context:
        raise ApiError(
            f"the prompt ({longest} tokens) does not fit the context ({engine.context} tokens)",
            "messages" if chat else "prompt",
        )
    room = engine.context - longest
    field_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, field_name, room, low=1)
    if max_tokens > room:
        raise ApiError(
            f"{field_name} {max_tokens} plus the prompt ({longest} tokens) exceeds the context "
            f"({engine.context} tokens)",
            field_name,
        )
    n = integer(body, "n", 1, 1, len(engine.slots))
    if len(prompts) * n > len(engine.slots):
        raise ApiError(f"{len(prompts)} prompts x n = {n} choices exceed the {len(engine.slots)} slots", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    echo = body.get("echo", False) is True and not chat
    return Job(
        chat,
        prompts,
        n,
        max_tokens,
        sampling_settings(body),
        stop_strings(body),
        top,
        stream,
        options.get("include_usage") is True,
        echo,
    )


# ---------------------------------------------------------------- answers


def chat_logprobs(tokenizer: Tokenizer, entries: list[dict]) -> dict:
    def item(token, logprob):
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            item(e["token"], e["logprob"]) | {"top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries
        ]
    }


def completion_logprobs(tokenizer: Tokenizer, entries: list[dict], offset: int) -> dict:
    tokens = [tokenizer.decode([e["token"]]) for e in entries]
    offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    top = [{tokenizer.decode([t]): lp for t, lp in e["top"]} for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


async def run_job(job: Job, app_state, request_id: str):
    """Submits the job's choices; yields their events as they come (an error event raises)."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    send = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731

    # Choice i of a seeded request draws from seed + i: the n choices differ, and each repeats with its seed.
    def seeded(i):
        return job.params if job.params.seed is None else replace(job.params, seed=(job.params.seed + i) % 2**64)

    choices = [
        Choice(p * job.n + i, ids, job.max_tokens, seeded(i), job.stop, job.top_logprobs, send)
        for p, ids in enumerate(job.prompts)
        for i in range(job.n)
    ]
    app_state.engine.submit(choices)
    open_choices = len(choices)
    try:
        while open_choices:
            event = await events.get()
            if "error" in event:
                raise RuntimeError(event["error"])
            open_choices -= event["finish_reason"] is not None
            yield event, choices
    finally:  # the client went away (or the job ended): the engine frees whatever is still running
        for c in choices:
            c.cancelled = True


def usage(job: Job, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.tokens) for c in choices)
    reused = sum(c.reused for c in choices if c.index % job.n == 0)  # of each prompt's first choice, as prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


def log_request(request_id: str, job: Job, choices: list[Choice], start: float, first: float | None):
    end = time.perf_counter()
    u = usage(job, choices)
    ttft = (first or end) - start
    rate = u["completion_tokens"] / (end - first) if first and end > first else float("nan")
    log.info(
        "%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%.3fs tokens/s=%.1f",
        request_id,
        u["prompt_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
        u["completion_tokens"],
        ttft,
        rate,
    )


def make_app(app_state):
    app = FastAPI(title="gpt-fast-style server")

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if app_state.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {app_state.api_key}".encode()):
                e = ApiError(
                    "a valid API key is required: Authorization: Bearer KEY", None, 401, "authentication_error"
                )
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    async def read_body(request: Request):
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise ApiError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise ApiError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None

    async def complete(request: Request, chat: bool):
        job = parse_job(await read_body(request), chat, app_state)
        prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        request_id, created, start = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
        tokenizer = app_state.engine.tokenizer
        head = {"id": request_id, "created": created, "model": app_state.model_name}
        events = run_job(job, app_state, request_id)
        first, event, choices = None, None, None
        try:
            event, choices = await anext(events)  # errors of submission (a full queue) before any answer
            first = time.perf_counter()
        except BaseException:
            await events.aclose()
            raise

        def chunk(e: dict) -> dict:
            lp = None
            if e["logprobs"] is not None:
                lp = (
                    chat_logprobs(tokenizer, [e["logprobs"]])
                    if chat
                    else completion_logprobs(tokenizer, [e["logprobs"]], 0)
                )
            if chat:
                choice = {
                    "index": e["index"],
                    "delta": {"content": e["text"]},
                    "logprobs": lp,
                    "finish_reason": e["finish_reason"],
                }
            else:
                choice = {"index": e["index"], "text": e["text"], "logprobs": lp, "finish_reason": e["finish_reason"]}
            return head | {"object": kind + ("" if not chat else ".chunk"), "choices": [choice]}

        if job.stream:

            async def sse():
                try:
                    if chat:  # the role comes first, in a chunk of its own, as OpenAI sends it
                        for c in choices:
                            yield sse_line(
                                head
                                | {
                                    "object": "chat.completion.chunk",
                                    "choices": [
                                        {
                                            "index": c.index,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None,
                                            "finish_reason": None,
                                        }
                                    ],
                                }
                            )
                    elif job.echo:
                        for c in choices:
                            text = tokenizer.decode(c.ids)
                            yield sse_line(
                                chunk({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})
                            )
                    if shown(event):
                        yield sse_line(chunk(event))
                    async for e, _ in events:
                        if shown(e):
                            yield sse_line(chunk(e))
                    if job.include_usage:
                        yield sse_line(
                            head
                            | {"object": kind + (".chunk" if chat else ""), "choices": [], "usage": usage(job, choices)}
                        )
                    yield "data: [DONE]\n\n"
                finally:
                    await events.aclose()
                    log_request(request_id, job, choices, start, first)

            return StreamingResponse(sse(), media_type="text/event-stream")

        texts, reasons, entries = {}, {}, {}
        try:
            e = event
            while True:
                i = e["index"]
                texts[i] = texts.get(i, "") + e["text"]
                entries.setdefault(i, []).extend([e["logprobs"]] if e["logprobs"] else [])
                if e["finish_reason"]:
                    reasons[i] = e["finish_reason"]
                e = await anext(events, None)
                if e is None:
                    break
                e = e[0]
        finally:
            await events.aclose()
            log_request(request_id, job, choices, start, first)
        answer = []
        for c in sorted(choices, key=lambda c: c.index):
            i = c.index
            lp = None
            if job.top_logprobs is not None:
                lp = chat_logprobs(tokenizer, entries[i]) if chat else completion_logprobs(tokenizer, entries[i], 0)
            if chat:
                answer.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": texts[i]},
                        "logprobs": lp,
                        "finish_reason": reasons[i],
                    }
                )
            else:
                text = (tokenizer.decode(c.ids) if job.echo else "") + texts[i]
                answer.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reasons[i]})
        return head | {"object": kind, "choices": answer, "usage": usage(job, choices)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": app_state.model_name, "object": "model", "created": app_state.created, "owned_by": "local"}
            ],
        }

    @app.get("/health")
    async def health():
        engine = app_state.engine
        speculation = None if engine.speculation is None else engine.speculation.summary()
        return {
            "status": "ok",
            "busy_slots": len(engine.busy_slots()),
            "slots": len(engine.slots),
            "waiting": engine.waiting.qsize(),
            "speculation": speculation,
        }

    @app.get("/")
    async def page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    return app


def shown(event: dict) -> bool:
    """Whether a streamed event is worth a chunk: a token may complete no text yet (part of a character, or
    the start of a possible stop string)."""
    return bool(event["text"] or event["finish_reason"] or event["logprobs"])


def sse_line(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


# ---------------------------------------------------------------- command line


@dataclass
class AppState:
    engine: Engine
    model_name: str
    api_key: str | None
    created: int = field(default_factory=lambda: int(time.time()))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = p.add_argument
    arg("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    arg("--model_name", default=None, help="the model's name in the API; default: the checkpoint's folder name")
    arg("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    arg("--port", type=int, default=8000, help="port to listen on")
    arg("--max_batch_size", type=int, default=8, help="requests decoded together (slots of the KV cache)")
    arg("--max_seq_length", type=int, default=2048, help="positions per slot: prompt plus reply (capped by the model)")
    arg("--max_queue", type=int, default=64, help="requests waiting for a slot before new ones get 429")
    arg("--api_key", default=None, help="require Authorization: Bearer API_KEY on /v1 routes")
    arg(
        "--device",
        type=device_flag,
        default=DEFAULT_DEVICE,
        help="cpu, cuda, cuda:1, ...",
    )
    arg("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    arg("--compile", action="store_true", help="torch.compile the decode step (one graph per power-of-two batch)")
    arg("--kernels", choices=("auto", "fused", "library"), default="auto", help="CPU products, as generate.py's flag")
    arg("--draft_checkpoint_path", type=Path, default=None, help="a draft model (same tokenizer): speculative decoding")
    arg("--speculate_k", type=int, default=4, help="tokens the draft proposes per slot and round")
    args = p.parse_args(argv)
    for name in ("max_batch_size", "max_queue"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_seq_length < 2:
        p.error("--max_seq_length must be >= 2")
    return args


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    with user_errors():
        args = parse_args(argv)
        device = args.device
        path = resolve_checkpoint(args.checkpoint_path)
        model, tokenizer, draft = load_models(
            path, device, args.dtype, args.compile, args.kernels, args.draft_checkpoint_path
        )
        if draft is not None:
            check_speculation(model, draft, SamplingParams(), args.speculate_k)
        steps = compile_steps(device, args.compile)
        max_seq_length = min(
            args.max_seq_length, model.config.block_size, *([draft.config.block_size] if draft else [])
        )
        engine = Engine(
            model, tokenizer, args.max_batch_size, max_seq_length, steps, args.max_queue, draft, args.speculate_k
        )
        if args.compile:
            engine.warm_up()
        engine.thread.start()
        app = make_app(AppState(engine, args.model_name or path.parent.name, args.api_key))
        log.info(
            "serving %s on http://%s:%d (%d slots of %d positions%s)",
            path,
            args.host,
            args.port,
            args.max_batch_size,
            max_seq_length,
            f", draft {args.draft_checkpoint_path}" if draft else "",
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
