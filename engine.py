"""The server's engine: one thread (server.py's main thread; Engine.thread in-process) that owns the model and a
static KV cache of max_batch_size rows ("slots").

A request's choices wait in a bounded queue for free slots; each is prefilled into its slot between two decode
steps, then decodes with every other busy slot in one batch, and frees its slot when it ends or its client goes
away. A slot keeps its tokens' keys and values after its request, so the next turn of a conversation prefills
only what is new. With a draft model, each step is a round of speculative decoding for all busy slots (decode.
draft_and_verify; the acceptance rule of sampling.accept_drafts): while a busy slot's request is one the rule does
not cover (penalties, log-probs, a grammar), the batch decodes one token per step instead. A choice with a grammar
(grammar.py) has a matcher: after each of its tokens, the matcher's allowed tokens become its row's mask for the next
step, which every row reads (all tokens allowed in a free row), so constrained and free rows share a step's graph.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from llguidance import LLMatcher, LLTokenizer

from chat import cached_prefix
from decode import draft_and_verify, prefill, prefill_and_score
from grammar import allowed_tokens
from results import Speculation, TextPieces, TokenLogprobs, step_logprobs
from sampling import SamplerState, SamplingParams, accept_drafts, record_token, row_sampler_state, set_row
from tokenizer import Tokenizer

# A decode step attends to the cache slots up to its furthest row's position, rounded up to this many: a CUDA
# graph is recorded per length met, so the rounding bounds their number (one compiled graph serves them all).
WINDOW_STEP = 128
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs at most (OpenAI's limit); a decode step computes this many for all rows
log = logging.getLogger("server")


@dataclass
class Choice:
    """One sequence to generate: a request's prompt for one of its n choices. The engine thread fills it."""

    index: int
    ids: list[int]
    max_tokens: int  # 0: score the prompt only (score_prompt)
    params: SamplingParams
    stop: list[str]
    top_logprobs: int | None  # None: no log-probs
    send: Callable[["Event"], None]  # from the engine thread to the request's handler
    score_prompt: bool = False  # the prompt's tokens' log-probs too (a completion's echo), from a full prefill
    matcher: LLMatcher | None = None  # the grammar its output follows, if any
    generator: torch.Generator | None = None
    pieces: TextPieces | None = None
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens whose keys and values the slot held already (not prefilled again)
    cancelled: bool = False


@dataclass
class Event:
    """What the engine sends a choice's request: the text its new token completes (maybe none yet: part of a
    character, or the start of a possible stop string) with the token's log-probs, the end ("stop" or "length"),
    or a fault of ours (error)."""

    index: int  # the choice's
    text: str = ""
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first event of a choice that scores its prompt


def speculable(c: Choice) -> bool:
    """Whether speculative decoding's acceptance rule covers a choice's sampling (not penalties, log-probs or a
    grammar, whose masks the draft and the verification do not apply)."""
    return c.top_logprobs is None and not c.params.penalized and c.matcher is None


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
        vocabulary: LLTokenizer | None = None,
    ):
        self.model, self.tokenizer, self.steps, self.draft = model, tokenizer, steps, draft
        self.vocabulary = vocabulary  # the tokens as grammar.py's matchers read them (None: no structured output)
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
                self.decode_step(n, state, positions, greedy, None, self.window(0))
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
        """Queues a request's choices, all or none: queue.Full when the queue has no room for them all."""
        if self.waiting.maxsize - self.waiting.qsize() < len(choices):
            raise queue.Full
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
        # Scoring the prompt takes every position's logits, so it prefills the whole prompt.
        start = choice.reused = 0 if choice.score_prompt else cached_prefix(self.cached[row], choice.ids)
        self.slots[row], self.cached[row] = choice, choice.ids[:start]
        choice.pieces = TextPieces(self.tokenizer, choice.stop)
        if choice.params.seed is not None:
            choice.generator = choice.params.generator(self.device)
        vocab_size = self.model.config.vocab_size
        allowed = None if choice.matcher is None else allowed_tokens(choice.matcher, vocab_size)
        set_row(self.state, row, choice.params, choice.ids, allowed)
        self.refill_noise([row])
        x = torch.tensor([choice.ids[start:]], device=self.device)
        positions = torch.arange(start, len(choice.ids), device=self.device)
        args = (self.model, x, positions, self.no_pad[:1], self.state_rows(slice(row, row + 1)), choice.params.greedy)
        if choice.score_prompt:
            token, logprobs, scored = prefill_and_score(
                *args, choice.top_logprobs, choice.top_logprobs, first_row=row, kv_length=len(choice.ids)
            )
            prompt = [TokenLogprobs(choice.ids[0], None, None)] + step_logprobs(
                tuple(t[0] for t in scored), choice.ids[1:]
            )
        else:
            token, logprobs = prefill(*args, choice.top_logprobs, first_row=row, kv_length=len(choice.ids))
            prompt = None
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
        if choice.max_tokens == 0:
            choice.send(Event(choice.index, finish_reason="length", prompt_logprobs=prompt))
            return self.finish(row)
        self.tokens[row] = token[0]
        self.last[row] = int(token)
        logprobs = None if logprobs is None else step_logprobs(logprobs, [self.last[row]])[0]
        self.emit(row, self.last[row], logprobs, prompt)

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
        token, logprobs = self.decode_step(n, state, positions, greedy, n_logprobs, window)
        if self.draft is not None:  # keeps up: a speculative round expects it to lack one position at most
            self.draft(*self.draft_inputs(n, positions), self.no_pad[:n], last_only=True, kv_length=window.shape[0])
        self.tokens[:n] = token  # a copy: CUDA graphs reuse token's buffer on the next call
        host = token[:, 0].tolist()  # the step's one sync
        logprobs = None if logprobs is None else step_logprobs(logprobs, host)
        for i in busy:
            self.cached[i].append(self.last[i])
            self.last[i] = host[i]
            self.emit(i, host[i], None if logprobs is None else logprobs[i])

    def decode_step(self, n: int, state: SamplerState, positions: torch.Tensor, greedy: bool, n_logprobs, window):
        """The decode step for rows 0..n-1 (state: theirs), each at its position [n, 1]."""
        x, no_pad = self.tokens[:n], self.no_pad[:n]
        return self.steps.decode(self.model, x, positions, no_pad, state, greedy, n_logprobs, window)

    def draft_inputs(self, n: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..n-1's previous and current tokens [n, 2] and their positions: what the draft reads next, as
        its cache may lack the previous one (the model's verification kept all the drafted tokens)."""
        previous = torch.tensor(
            [[self.cached[i][-1] if self.slots[i] is not None else 0] for i in range(n)], device=self.device
        )
        return torch.cat([previous, self.tokens[:n]], dim=1), torch.cat([positions - 1, positions], dim=1)

    def draft_and_verify(self, n: int, busy: list[int], state, positions: torch.Tensor, greedy: bool, window):
        """decode.draft_and_verify for rows 0..n-1, whose draft reads each row's previous and current tokens;
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

    def emit(self, row: int, token: int, logprobs: TokenLogprobs | None, prompt: list[TokenLogprobs] | None = None):
        """Hands row's new token to its request (logprobs: of MAX_TOP_LOGPROBS alternatives, or None; prompt: the
        scored prompt's, with the first token); ends the choice when done."""
        c = self.slots[row]
        if c.cancelled:
            return self.finish(row)
        c.tokens.append(token)
        event = Event(c.index, c.pieces.push(token), prompt_logprobs=prompt)
        if logprobs is not None and c.top_logprobs is not None and c.pieces.finished != "eos":
            event.logprobs = replace(logprobs, top=logprobs.top[: c.top_logprobs])
        complete = False  # the grammar takes nothing more
        if c.matcher is not None and not c.pieces.finished:
            if not c.matcher.consume_token(token):
                return self.finish(row, error=f"grammar: {c.matcher.get_error()}")
            complete = c.matcher.is_stopped()
            self.state.allowed[row] = allowed_tokens(c.matcher, self.model.config.vocab_size)
        if complete or (not c.pieces.finished and len(c.tokens) >= c.max_tokens):
            event.text += c.pieces.end()
            event.finish_reason = "stop" if complete else "length"
        if c.pieces.finished:
            event.finish_reason = "stop"
        c.send(event)
        if event.finish_reason:
            self.finish(row)

    def finish(self, row: int, error: str | None = None):
        c = self.slots[row]
        self.slots[row] = None
        self.state.allowed[row] = True  # the idle row samples freely (a stale mask could allow nothing)
        if error is not None:
            c.send(Event(c.index, error=error))
