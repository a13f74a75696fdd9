"""The server's engine: one thread (server.py's main thread; Engine.thread in-process) that owns the model and a
static KV cache of max_batch_size rows ("slots").

A request's choices wait in a bounded queue and take free slots in arrival order (slot_for picks which). A step's
rows attend in groups, each to a window of its own (decode.window_groups): after admitting, rows swap slots so that
long prompts share a group (regroup). Each turn of the loop prefills up to prefill_chunk prompt tokens of the slots
still entering, short prompts whole first and then the oldest in a piece (short pieces of several slots in one
call), then runs one decode step for every slot that has its prompt in: a long prompt enters in chunks while the
running streams go on, in turns of prefill_chunk_while_decoding tokens (what the streams wait for). A choice frees
its slot when it ends or its client goes away (a prefill stops at its next chunk). A slot keeps its tokens' keys and
values after its request, and before a chunk a slot copies the longest prefix of its prompt that any slot holds,
busy or not: the next turn of a conversation, a shared system prompt, the n choices of a request prefill only what
is new (a slot waits while an older one prefills a longer prefix of its prompt than it could copy). With
speculation, each step is a round for all decoding slots, of one depth (drafted tokens per row; 0: a plain decode
step) that speculate.choose_depth picks from the rows' acceptance and the round costs measured at warm-up: with a
draft model (decode.draft_and_verify; while a slot's request is one the acceptance rule does not cover, penalties,
log-probs or a grammar, the batch decodes one token per step instead), or by prompt lookup (--ngram: each row's
drafts come from its prompt, its prediction and its output, speculate.NgramIndex; a row the rule does not cover, or
with a shorter proposal, is padded and keeps no padding, and a step with a row wanting log-probs is a plain one). A
choice with a grammar (grammar.py) has a matcher: after each of its tokens, the matcher's allowed tokens become its
row's mask for the next step, which every row reads (all tokens allowed in a free row), so constrained and free rows
share a step's graph.
"""

import functools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from llguidance import LLMatcher, LLTokenizer

from chat import cached_prefix
from decode import (
    VECTOR_STEP,
    attention_window,
    attention_windows,
    draft_and_verify,
    fill_piece,
    kv_length,
    prefill,
    prefill_and_score,
    window_groups,
)
from grammar import allowed_tokens
from results import Speculation, TextPieces, TokenLogprobs, step_logprobs, synchronize
from sampling import (
    SamplerState,
    SamplingParams,
    accept_drafts,
    draw_exponential_,
    record_token,
    row_sampler_state,
    set_row,
)
from speculate import (
    Acceptance,
    NgramIndex,
    Probes,
    check_round_costs,
    choose_depth,
    depth_choices,
    draft_depth,
    lookup_drafts,
    measure_round_costs,
)
from tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs at most (OpenAI's limit); a decode step computes this many for all rows
STEP_LOG = 4096  # the latest steps Engine.steps_taken keeps
PREFILL_PADDING = 32  # padded positions a prefill call may compute for nothing: fewer than a pass over the weights
IDLE_WINDOW = 256  # the attention window of warm_up's steps, which measure_round_costs times: a short chat's length
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
    ignore_eos: bool = False  # EOS does not end it: it ends at max_tokens, a stop string or its grammar's end
    prediction: list[int] | None = None  # tokens the output is expected to hold (OpenAI's prediction): drafts
    generator: torch.Generator | None = None
    pieces: TextPieces | None = None
    lookup: NgramIndex | None = None  # its prompt (after any prediction) and output, for prompt lookup's drafts
    acceptance: Acceptance = field(default_factory=Acceptance)
    probes: Probes = field(default_factory=Probes)  # when a draft model kept off is tried all the same
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens whose keys and values a slot held already (not prefilled again)
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
    made: float = field(default_factory=time.perf_counter)  # when: the gaps between a choice's tokens, however sent


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
        prefill_chunk: int = 256,
        ngram: bool = False,
        round_costs: dict[int, dict[int, float]] | None = None,
        prefill_chunk_while_decoding: int | None = None,
    ):
        self.model, self.tokenizer, self.steps, self.draft = model, tokenizer, steps, draft
        self.vocabulary = vocabulary  # the tokens as grammar.py's matchers read them (None: no structured output)
        self.prefill_chunk = prefill_chunk  # prompt tokens a turn of the loop prefills (a prompt's more)
        # ... in a turn that also decodes: a running stream waits for them (None: as many)
        self.prefill_chunk_while_decoding = min(prefill_chunk_while_decoding or prefill_chunk, prefill_chunk)
        self.device = model.tok_embeddings.weight.device
        if draft is not None and ngram:
            raise ValueError("speculative decoding drafts with a draft model or by prompt lookup (ngram), not both")
        self.ngram = ngram
        self.k = speculate_k if draft is not None or ngram else 0  # the most tokens a step drafts for a row
        self.speculation = Speculation(self.k) if self.k else None  # per slot and round
        # Seconds of a step of each batch size at each depth (speculate.choose_depth): measure_round_costs
        self.round_costs = round_costs
        self.step_depths = [0] * (self.k + 1)  # steps at each depth 0..k
        self.horizon = max_seq_length - 1  # the last cache position
        # Idle rows feed this position during a step, and write from one before it (a speculative round's draft
        # catching up) to k after it (its verification): no request reaches any of these positions.
        self.idle_position = self.horizon - self.k
        self.context = self.idle_position - (draft is not None)
        if self.context < 2:
            raise ValueError(
                f"slots of {max_seq_length} positions (--max_seq_length, or what --kv_cache_memory holds) leave no "
                "room for a prompt and a reply" + (f" beside speculate_k {self.k}" if self.k else "")
            )
        if prefill_chunk < 1:
            raise ValueError(f"--prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_chunk_while_decoding is not None and prefill_chunk_while_decoding < 1:
            raise ValueError(f"--prefill_chunk_while_decoding must be >= 1, got {prefill_chunk_while_decoding}")
        self.models = (model, draft) if draft is not None else (model,)
        for m in self.models:  # sliding layers' rolling caches: the idle positions in slots of their own
            m.setup_caches(max_batch_size, max_seq_length, **self.cache_layout(prefill_chunk, self.k))
        self.slots: list[Choice | None] = [None] * max_batch_size
        self.cached: list[list[int]] = [[] for _ in range(max_batch_size)]  # tokens whose keys/values a row holds
        self.draft_cached = [0] * max_batch_size  # how many of them the draft's cache holds too
        self.prefilling: list[int] = []  # busy rows whose prompt is not all in the cache, in arrival order
        self.state = row_sampler_state(max_batch_size, model.config.vocab_size, self.device)
        self.tokens = torch.zeros(max_batch_size, 1, dtype=torch.long, device=self.device)
        self.last = [0] * max_batch_size  # self.tokens on the host: each row's token to feed next
        self.no_pad = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        # A decode step runs rows 0..n-1, n a power of two below the slots or all of them: few compiled shapes.
        self.batch_sizes = sorted({min(1 << i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)})
        self.waiting: queue.Queue = queue.Queue(max_queue)
        # What the loop did, latest last: ("prefill", row, tokens) and ("decode", rows); counts: steps and tokens
        # of each kind, and prompt tokens copied from another slot.
        self.steps_taken: deque = deque(maxlen=STEP_LOG)
        self.counts: Counter = Counter()
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)
        # A compiled step holds one graph per batch size, greedy or sampled, with log-probs or without (the
        # draft's: of one token or two; the verification's: one per depth): more than Dynamo's default limit of 8
        # graphs per function, past which a fullgraph step fails instead of compiling.
        graphs = 2 * len(self.batch_sizes) * max(2, len(self.depths()) - 1)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)

    @staticmethod
    def cache_layout(prefill_chunk: int, k: int) -> dict:
        """setup_caches' chunk and reserved for an engine: a call writes a prefill chunk (a longer one, a prompt
        scored whole or a draft catching up, runs in pieces), or up to k positions past where the row goes on
        (rejected drafts); idle rows write at the last k + 2 positions."""
        return {"chunk": max(prefill_chunk, k), "reserved": k + 2}

    @torch.no_grad()
    def warm_up(self):
        """Runs every step the server may take at every batch size, greedy and sampled: the decode step, and with
        speculation a round of each depth (depths), so that compiled steps compile them all before serving
        (seconds to minutes each) rather than while requests wait; log-probs compile when first asked for; and the
        fill of a long prompt's pieces beside streams. Then measures the rounds' costs, unless given. Idle rows
        write at positions no request reaches, and the fill into the last slot, before it serves: this changes no
        slot that holds a request."""
        for n in self.batch_sizes:
            for greedy in (True, False):
                start = time.perf_counter()
                for depth in self.depths():
                    self.idle_round(n, greedy, depth)
                log.info(
                    "%s of %d rows, %s: ready in %.1f s",
                    f"decode step and rounds of depths {self.depths()[1:]}" if self.k else "decode step",
                    n,
                    "greedy" if greedy else "sampled",
                    time.perf_counter() - start,
                )
        for width in self.fill_widths():  # a long prompt's pieces, into the last slot
            start = time.perf_counter()
            x = torch.zeros(1, width, dtype=torch.long, device=self.device)
            row = torch.tensor([len(self.slots) - 1], device=self.device)
            self.fill(x, torch.arange(width, device=self.device)[None], row, width)
            synchronize(self.device)
            log.info("prompt pieces of %d tokens: ready in %.1f s", width, time.perf_counter() - start)
        if self.k and self.round_costs is None:
            self.measure_round_costs()

    def depths(self) -> tuple[int, ...]:
        """The depths a step may take: drafted tokens per row (0: a plain decode step)."""
        return depth_choices(self.k) if self.k else (0,)

    def idle_round(self, n: int, greedy: bool, depth: int):
        """A step of rows 0..n-1, all idle, at depth (warm_up, measure_round_costs); waits for it. Each group of
        rows attends to a window of another length: a graph compiled for groups of equal windows would assume them
        equal (and compile again when they are not)."""
        state, positions, groups = self.state_rows(slice(0, n)), self.positions(n), window_groups(n, self.device)
        shortest = max(0, min(IDLE_WINDOW, self.horizon - 1 - VECTOR_STEP * groups))  # all within the cache
        windows = attention_windows([shortest + VECTOR_STEP * g for g in range(groups)], self.horizon + 1, self.device)
        if depth == 0:
            self.decode_step(n, state, positions, greedy, None, windows)
        elif self.draft is not None:
            self.draft_and_verify(n, [], state, positions, greedy, windows, depth)
        else:
            drafted = torch.zeros(n, depth, dtype=torch.long, device=self.device)
            self.verify(n, state, positions, greedy, windows, drafted)
        synchronize(self.device)  # the outputs stay on the device: reading the distributions back would be timed too

    def measure_round_costs(self):
        """The seconds of a step of each batch size at each depth (speculate.measure_round_costs), greedy."""
        self.round_costs = {
            n: measure_round_costs(functools.partial(self.idle_round, n, True), self.depths()) for n in self.batch_sizes
        }
        for n, costs in self.round_costs.items():
            log.info(
                "round costs of %d rows: %s", n, ", ".join(f"depth {d} {s * 1e3:.1f} ms" for d, s in costs.items())
            )

    def state_rows(self, rows: slice | torch.Tensor) -> SamplerState:
        return SamplerState(*(t[rows] for t in self.state))

    def decoding(self, row: int) -> bool:
        return self.slots[row] is not None and row not in self.prefilling

    def positions(self, n: int) -> torch.Tensor:
        """Rows 0..n-1's positions to feed next [n, 1]: a decoding row's next after the tokens it holds; an idle
        or prefilling row's the idle position."""
        return torch.tensor(
            [[len(self.cached[i]) if self.decoding(i) else self.idle_position] for i in range(n)], device=self.device
        )

    def batch_size(self, rows: list[int]) -> int:
        return next(n for n in self.batch_sizes if n > max(rows))

    def windows(self, n: int, ahead: int = 0) -> tuple[torch.Tensor, ...]:
        """The windows (decode.attention_windows) of a step of rows 0..n-1, each group's covering its decoding rows'
        next positions (len(cached)) and ahead more."""
        groups = window_groups(n, self.device)
        size = n // groups
        ends = [
            max((len(self.cached[i]) for i in range(g * size, (g + 1) * size) if self.decoding(i)), default=0) + ahead
            for g in range(groups)
        ]
        return attention_windows(ends, self.horizon + 1, self.device)

    def expected_end(self, c: Choice) -> int:
        """The most positions a choice's slot may come to hold (regroup)."""
        return min(len(c.ids) + c.max_tokens, self.horizon)

    def submit(self, choices: list[Choice]):
        """Queues a request's choices, all or none: queue.Full when the queue has no room for them all."""
        if self.waiting.maxsize - self.waiting.qsize() < len(choices):
            raise queue.Full
        for c in choices:  # only this event loop's thread puts, so the room checked above is still there
            self.waiting.put_nowait(c)

    def busy_slots(self) -> list[int]:
        return [i for i, c in enumerate(self.slots) if c is not None]

    def kv_cache_figures(self) -> dict:
        """The model's Transformer.kv_cache_figures with the draft's bytes added, the positions of all the slots, and
        those that requests hold now (a slot's prompt and reply so far)."""
        figures = [m.kv_cache_figures() for m in self.models]
        return {
            **figures[0],
            "kv_cache_bytes_per_token": sum(f["kv_cache_bytes_per_token"] for f in figures),
            "kv_cache_bytes": sum(f["kv_cache_bytes"] for f in figures),
            "kv_cache_positions": len(self.slots) * (self.horizon + 1),
            "kv_cache_used_positions": sum(len(self.cached[i]) for i in self.busy_slots()),
        }

    def loop(self):
        while True:
            self.step()

    @torch.no_grad()
    def step(self):
        """One turn of the loop: admit waiting choices (waiting for one while there is nothing to do), prefill a
        chunk of prompts, and decode a token (a speculative round) for every row that has its prompt in."""
        self.admit()
        if self.prefilling:
            self.prefill_chunk_of_prompts()
        rows = [i for i in range(len(self.slots)) if self.decoding(i)]
        if rows:
            try:
                if self.draft is not None and all(speculable(self.slots[i]) for i in rows):
                    self.speculate(rows)
                elif self.ngram and all(self.slots[i].top_logprobs is None for i in rows):
                    self.look_up(rows)
                else:
                    self.decode(rows)
            except Exception as e:  # a fault of ours: end the requests it hit, keep serving
                log.exception("decode step failed")
                for i in rows:
                    self.finish(i, error=str(e))

    def admit(self):
        """Takes waiting choices into free slots in arrival order (blocking while the engine has nothing to do):
        each into the slot slot_for picks, whose tokens the prompt does not share are set aside first; then
        regroups the rows."""
        admitted = False
        while None in self.slots:
            try:
                choice = self.waiting.get(block=not self.busy_slots())
            except queue.Empty:
                break
            if choice.cancelled:
                continue
            row = self.slot_for(choice)
            # Scoring the prompt takes every position's logits, so it prefills the whole prompt. A rolling cache
            # may have rolled past what the kept prefix's end attends to.
            kept = 0 if choice.score_prompt else cached_prefix(self.cached[row], choice.ids)
            kept = kept if self.model.holds(row, 0, kept) else 0
            self.set_aside(row, kept)
            self.slots[row], self.cached[row], choice.reused = choice, choice.ids[:kept], kept
            draft_kept = min(self.draft_cached[row], kept)
            self.draft_cached[row] = draft_kept if self.draft is None or self.draft.holds(row, 0, draft_kept) else 0
            self.prefilling.append(row)
            admitted = True
        if admitted:
            self.regroup()

    def slot_for(self, choice: Choice) -> int:
        """The free slot a choice takes: the one that keeps the decode steps' batch smallest (a step runs rows
        0..n-1, and an idle row below a busy one costs as much as a busy one); then the one holding the longest
        prefix of the prompt (what other slots hold is copied, but this needs no copy); then the one holding the
        fewest tokens (admit sets aside what it held)."""
        busy = self.busy_slots()

        def preference(i):
            return -self.batch_size(busy + [i]), cached_prefix(self.cached[i], choice.ids), -len(self.cached[i]), -i

        return max((i for i, c in enumerate(self.slots) if c is None), key=preference)

    def regroup(self):
        """Swaps rows of the decode steps' batch between its groups of rows (decode.window_groups), the swap that
        shortens the groups' windows most first, as far as the rows' choices may reach: long prompts that came
        at different times end up in one group, whose window the others no longer read."""
        n = self.batch_size(self.busy_slots())
        size = n // window_groups(n, self.device)
        ends = [0 if c is None else self.expected_end(c) for c in self.slots[:n]]

        def reach(ends):
            return sum(max(ends[g : g + size]) for g in range(0, n, size))

        def swapped(a, b):
            after = list(ends)
            after[a], after[b] = after[b], after[a]
            return after

        pairs = [(a, b) for a in range(n) for b in range(a // size * size + size, n)]  # rows of two groups
        while pairs:
            a, b = min(pairs, key=lambda pair: reach(swapped(*pair)))
            if reach(swapped(a, b)) >= reach(ends):
                return
            self.swap_rows(a, b)
            ends = swapped(a, b)

    def swap_rows(self, a: int, b: int):
        """Rows a and b exchange what they hold: their choices, the keys and values of their tokens (the draft's
        too), their sampling state and their next tokens."""
        self.model.swap_rows(a, b, max(len(self.cached[a]), len(self.cached[b])))
        if self.draft is not None:
            self.draft.swap_rows(a, b, max(self.draft_cached[a], self.draft_cached[b]))
        for per_row in (self.slots, self.cached, self.draft_cached, self.last):
            per_row[a], per_row[b] = per_row[b], per_row[a]
        for t in (*self.state, self.tokens):
            t[[a, b]] = t[[b, a]]
        self.prefilling = [b if r == a else a if r == b else r for r in self.prefilling]
        self.counts["swapped_rows"] += 2

    def set_aside(self, row: int, kept: int):
        """Before row is overwritten beyond its first kept tokens: copies what it holds into the free slot holding
        the fewest tokens (the highest of them), where that holds fewer, so that a document's next question or a
        conversation's next turn still finds it (copy_prefix) while new requests stay in the low rows."""
        held, free = len(self.cached[row]), [i for i, c in enumerate(self.slots) if c is None and i != row]
        if held <= kept or not free:
            return
        target = min(free, key=lambda i: (len(self.cached[i]), -i))
        if len(self.cached[target]) >= held:
            return
        self.model.copy_positions(row, target, 0, held)
        if self.draft is not None and self.draft_cached[row]:
            self.draft.copy_positions(row, target, 0, self.draft_cached[row])
        self.cached[target], self.draft_cached[target] = self.cached[row], self.draft_cached[row]
        self.counts["set_aside_tokens"] += held

    def prefill_chunk_of_prompts(self):
        """Prefills up to prefill_chunk prompt tokens of the prefilling rows, each row first copying what another
        slot holds of its prompt. Prompts whose rest fits go first, whole: their streams start this turn. Fitting
        means within prefill_chunk_while_decoding tokens if rows already decode in this turn, else within
        prefill_chunk. The others follow, oldest first, each in a piece of what is left, but in a turn with
        streams (already decoding or starting in it) the pieces that do not end a prompt stop once the turn holds
        prefill_chunk_while_decoding tokens: every stream waits for the whole turn. A prompt scored whole goes in
        one piece. Pieces of several rows go in one call (prefill_groups)."""
        streams = any(self.decoding(i) for i in range(len(self.slots)))
        fits = self.prefill_chunk_while_decoding if streams else self.prefill_chunk
        used, pieces = 0, []
        for row in list(self.prefilling):
            if self.slots[row].cancelled:
                self.finish(row)
            elif not self.slots[row].score_prompt:
                self.copy_prefix(row)
        for row in sorted(self.prefilling, key=lambda r: len(self.slots[r].ids) - len(self.cached[r]) > fits):
            c = self.slots[row]
            if used >= self.prefill_chunk:
                break
            if not c.score_prompt and self.older_row_prefills_more(row):
                continue
            start = len(self.cached[row])
            if c.score_prompt or len(c.ids) - start <= min(fits, self.prefill_chunk - used):
                end, streams = len(c.ids), True
            else:
                end = min(
                    len(c.ids), start + (self.prefill_chunk_while_decoding if streams else self.prefill_chunk) - used
                )
                if end <= start:
                    continue
            used += end - start
            if end == start + 1 == len(c.ids) and self.joins_decode(c):
                self.start_sampling(row, c)
                self.prefilling.remove(row)
                self.tokens[row], self.last[row] = c.ids[-1], c.ids[-1]
                self.counts["prefilled_tokens"] += 1
            else:
                pieces.append((row, end))
        for group in self.prefill_groups(pieces):
            try:
                self.prefill(group)
            except Exception as e:
                log.exception("prefill failed")
                for row, _ in group:
                    if self.slots[row] is not None:
                        self.finish(row, error=str(e))

    def prefill_groups(self, pieces: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Pieces (row, end) in the calls that prefill them: pieces of rows holding about as many tokens (within
        a prefill chunk of each other: they attend to about as many) together, as long as each row's piece,
        right-padded to the longest, stays within the cache and the padding is no more than a quarter of the
        pieces or PREFILL_PADDING positions (short pieces gain from sharing a pass over the weights, but padding
        costs what tokens cost); a prompt scored whole alone."""
        groups = []
        for row, end in sorted(pieces, key=lambda piece: (len(self.cached[piece[0]]), piece[1])):
            group = groups[-1] if groups else []
            joined = group + [(row, end)]
            starts = [len(self.cached[r]) for r, _ in joined]
            lengths = [e - start for (_, e), start in zip(joined, starts)]
            if (
                group
                and not any(self.slots[r].score_prompt for r, _ in joined)
                and max(starts) - min(starts) <= self.prefill_chunk
                and max(starts) + max(lengths) <= self.horizon + 1
                and len(joined) * max(lengths) - sum(lengths) <= max(sum(lengths) // 4, PREFILL_PADDING)
            ):
                group.append((row, end))
            else:
                groups.append([(row, end)])
        return groups

    def joins_decode(self, c: Choice) -> bool:
        """Whether a choice whose prompt lacks one token in the cache feeds it in the next decode step, which
        computes its first token as a prefill would: not with penalties (the step counts the token it feeds as
        output), nor with a draft (whose step reads the token before too), nor to score the prompt."""
        return self.draft is None and not c.params.penalized and not c.score_prompt and c.max_tokens > 0

    def copy_prefix(self, row: int):
        """Copies into row the keys and values of the longest prefix of its prompt that another slot holds beyond
        what row holds (the draft's too, as far as its cache holds them). With rolling caches, the prefix's end
        attends to its last sliding_window positions: those row lacks are copied too, and a source whose ring no
        longer holds them is not copied from."""
        c, held = self.slots[row], len(self.cached[row])
        others = [i for i in range(len(self.slots)) if i != row]
        source = max(others, key=lambda i: cached_prefix(self.cached[i], c.ids), default=row)
        length = cached_prefix(self.cached[source], c.ids)
        if length <= held:
            return
        start = held if self.model.holds(row, 0, held, length) else 0
        if not self.model.holds(source, start, length):
            return
        self.model.copy_positions(source, row, start, length)
        if self.draft is not None:
            start, end = self.draft_cached[row], min(length, self.draft_cached[source])
            if end > start and self.draft.holds(row, 0, start, end) and self.draft.holds(source, start, end):
                self.draft.copy_positions(source, row, start, end)
                self.draft_cached[row] = end
        self.cached[row] = c.ids[:length]
        c.reused += length - held
        self.counts["copied_prompt_tokens"] += length - held

    def older_row_prefills_more(self, row: int) -> bool:
        """Whether a row that came before row is prefilling a longer prefix of row's prompt than row holds: row
        then waits to copy it (the n choices of one request share one prefill)."""
        ids, held = self.slots[row].ids, len(self.cached[row])
        older = self.prefilling[: self.prefilling.index(row)]
        return any(cached_prefix(self.slots[i].ids, ids) > held for i in older)

    def prefill(self, group: list[tuple[int, int]]):
        """Prefills each row's prompt tokens from those it holds up to its end, for several rows in one call (each
        row's piece right-padded to the longest: the padding writes past what the row holds, where nothing is read
        before it is written again); a row whose prompt ends there gets its first token."""
        rows, ends = [r for r, _ in group], [e for _, e in group]
        choices, starts = [self.slots[r] for r in rows], [len(self.cached[r]) for r in rows]
        n, width, finals = len(rows), max(e - s for s, e in zip(starts, ends)), []
        x = torch.zeros(n, width, dtype=torch.long, device=self.device)
        for i, (c, start, end) in enumerate(zip(choices, starts, ends)):
            x[i, : end - start] = torch.tensor(c.ids[start:end])
            finals.append(end == len(c.ids))
            if finals[-1]:
                self.start_sampling(rows[i], c)
                self.refill_noise([rows[i]])
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
        final = [c for c, f in zip(choices, finals) if f]
        greedy = all(c.params.greedy for c in final)
        n_logprobs = max((c.top_logprobs for c in final if c.top_logprobs is not None), default=None)
        last = None if n == 1 else torch.tensor([e - s - 1 for s, e in zip(starts, ends)], device=self.device)
        cache_rows = torch.tensor(rows, device=self.device)
        args = (self.model, x, positions, self.no_pad[:n], self.state_rows(cache_rows), greedy)
        prompt, token = None, None
        if not final:  # pieces only: keys and values, nothing to sample
            self.fill(x, positions, cache_rows, max(ends))
        elif choices[0].score_prompt:  # alone, whole
            c = choices[0]
            token, logprobs, scored = prefill_and_score(
                *args, c.top_logprobs, c.top_logprobs, cache_rows=cache_rows, kv_length=ends[0]
            )
            prompt = [TokenLogprobs(c.ids[0], None, None)] + step_logprobs(tuple(t[0] for t in scored), c.ids[1:])
        else:
            kv_length = max(starts) + width
            token, logprobs = prefill(*args, n_logprobs, cache_rows=cache_rows, kv_length=kv_length, last=last)
        if token is not None:
            host = token[:, 0].tolist()
            logprobs = None if logprobs is None else step_logprobs(logprobs, host)
        for i, (row, c, start, end) in enumerate(zip(rows, choices, starts, ends)):
            if self.draft is not None:  # from the first position its cache lacks
                since = self.draft_cached[row]
                self.draft(
                    torch.tensor([c.ids[since:end]], device=self.device),
                    torch.arange(since, end, device=self.device),
                    self.no_pad[:1],
                    last_only=True,
                    cache_rows=cache_rows[i : i + 1],
                    kv_length=end,
                )
                self.draft_cached[row] = end
            self.cached[row] = c.ids[:end]
            self.steps_taken.append(("prefill", row, end - start))
            self.counts["prefilled_tokens"] += end - start
            if not finals[i]:
                continue
            self.prefilling.remove(row)
            if c.max_tokens == 0:
                c.send(Event(c.index, finish_reason="length", prompt_logprobs=prompt))
                self.finish(row)
                continue
            self.tokens[row], self.last[row] = host[i], host[i]
            self.emit(row, host[i], None if logprobs is None else logprobs[i], prompt)
        self.counts["prefill_chunks"] += 1

    def fill_widths(self) -> list[int]:
        """The widths of the pieces a long prompt enters by, a row at a time (prefill_chunk, and
        prefill_chunk_while_decoding beside streams), that a prompt in a slot can have."""
        return sorted(w for w in {self.prefill_chunk, self.prefill_chunk_while_decoding} if w < self.context)

    def fill(self, x: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor, end: int):
        """Pieces of prompts that end none of them, x [B, S] at positions [B, S] of cache rows cache_rows, attending
        to the slots before end (their last real position's, padding aside): through the steps' fill (compiled: a
        graph a width) where it is one row's piece of one of the fill_widths, what a long prompt enters by; else
        eagerly."""
        piece = x.shape[0] == 1 and x.shape[1] in self.fill_widths()
        window = attention_window(end - 1, self.horizon + 1, self.device)
        (self.steps.fill if piece else fill_piece)(self.model, x, positions, cache_rows, window)

    def start_sampling(self, row: int, choice: Choice):
        """The row's sampling state becomes choice's, for its first token (a decode step reads every row's state,
        so not before the prompt's last chunk)."""
        choice.pieces = TextPieces(self.tokenizer, choice.stop, choice.ignore_eos)
        if choice.params.seed is not None:
            choice.generator = choice.params.generator(self.device)
        vocab_size = self.model.config.vocab_size
        allowed = None if choice.matcher is None else allowed_tokens(choice.matcher, vocab_size)
        set_row(self.state, row, choice.params, choice.ids, allowed)
        if self.ngram and speculable(choice):  # what prompt lookup drafts from: the prediction before the prompt
            choice.lookup = NgramIndex((choice.prediction or []) + choice.ids)

    def refill_noise(self, rows: list[int]):
        for i in rows:
            c = self.slots[i]
            if not c.params.greedy:
                draw_exponential_(self.state.noise[i], c.generator)

    def decode(self, rows: list[int], proposals: dict[int, list[int]] | None = None):
        """One decode step for the decoding rows (the others of the batch feed the idle position); a row's
        proposal (prompt lookup's, not verified) is checked against its token, for its acceptance."""
        n = self.batch_size(rows)
        state, positions = self.state_rows(slice(0, n)), self.positions(n)
        if any(self.slots[i].params.penalized for i in rows):  # what penalties read; nothing else does
            record_token(state, self.tokens[:n])
        self.refill_noise(rows)
        greedy = all(self.slots[i].params.greedy for i in rows)
        n_logprobs = MAX_TOP_LOGPROBS if any(self.slots[i].top_logprobs is not None for i in rows) else None
        windows = self.windows(n)
        token, logprobs = self.decode_step(n, state, positions, greedy, n_logprobs, windows)
        if self.draft is not None:  # keeps up: a speculative round expects it to lack one position at most
            inputs = self.draft_inputs(n, positions)
            self.draft(*inputs, self.no_pad[:n], last_only=True, kv_length=kv_length(windows))
        self.tokens[:n] = token  # a copy: CUDA graphs reuse token's buffer on the next call
        host = token[:, 0].tolist()  # the step's one sync
        logprobs = None if logprobs is None else step_logprobs(logprobs, host)
        self.steps_taken.append(("decode", tuple(rows)))
        self.counts["decode_steps"] += 1
        self.step_depths[0] += 1
        for i in rows:
            if self.speculation is not None:
                self.speculation.record(0, 0)
            if proposals and proposals[i]:  # prompt lookup's proposal, not taken: still checked
                self.slots[i].acceptance.record(int(proposals[i][0] == host[i]), 1)
            elif self.draft is not None:  # no evidence: what was seen fades, and speculation is tried again in time
                self.slots[i].acceptance.record(0, 0)
                self.slots[i].probes.plain(1)
            self.cached[i].append(self.last[i])
            self.draft_cached[i] = len(self.cached[i])
            self.last[i] = host[i]
            self.emit(i, host[i], None if logprobs is None else logprobs[i])

    def decode_step(self, n: int, state: SamplerState, positions: torch.Tensor, greedy: bool, n_logprobs, window):
        """The decode step for rows 0..n-1 (state: theirs), each at its position [n, 1]."""
        x, no_pad = self.tokens[:n], self.no_pad[:n]
        return self.steps.decode(self.model, x, positions, no_pad, state, greedy, n_logprobs, window)

    def draft_inputs(self, n: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..n-1's previous and current tokens [n, 2] and their positions: what the draft reads next, as
        its cache may lack the previous one (the model's verification kept all the drafted tokens)."""
        previous = torch.tensor([[self.cached[i][-1] if self.decoding(i) else 0] for i in range(n)], device=self.device)
        return torch.cat([previous, self.tokens[:n]], dim=1), torch.cat([positions - 1, positions], dim=1)

    def draft_and_verify(
        self, n: int, rows: list[int], state, positions: torch.Tensor, greedy: bool, window, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """decode.draft_and_verify of depth drafts for rows 0..n-1, whose draft reads each row's previous and
        current tokens; the decoding rows' sampling noise is drawn anew before each draft step."""
        return draft_and_verify(
            self.model,
            self.draft,
            self.steps,
            depth,
            self.tokens[:n],
            self.draft_inputs(n, positions),
            state,
            state,
            greedy,
            lambda: self.refill_noise(rows),
            window,
        )

    def verify(self, n: int, state, positions: torch.Tensor, greedy: bool, window, drafted: torch.Tensor):
        """The model's distributions [n, d + 1, V] after rows 0..n-1's current tokens and drafts [n, d]."""
        x = torch.cat([self.tokens[:n], drafted], dim=1)
        at = positions + torch.arange(drafted.shape[1] + 1, device=self.device)
        return self.steps.verify(self.model, x, at, state, greedy, window)

    def speculation_figures(self) -> dict:
        """What speculation did (/health): the rows' rounds (results.Speculation), the steps taken at each depth,
        and the measured seconds of a step of each batch size at each depth."""
        return self.speculation.summary() | {
            "draft": "model" if self.draft is not None else "prompt lookup",
            "step_depths": list(self.step_depths),
            "round_costs_s": self.round_costs,
        }

    def costs(self, n: int) -> dict[int, float]:
        if self.round_costs is None:  # an engine that was not warmed up
            self.measure_round_costs()
        check_round_costs(self.round_costs[n])
        return self.round_costs[n]

    def speculate(self, rows: list[int]):
        """One round of speculative decoding with the draft for every decoding row, of the depth that yields
        the most tokens a second (speculate.choose_depth; 0: a decode step, which the draft reads too), or of
        speculate.probe_depth where a row's probe is due (speculate.draft_depth)."""
        n = self.batch_size(rows)
        depth = draft_depth(self.costs(n), [(self.slots[i].acceptance, self.slots[i].probes) for i in rows], self.k)
        if depth == 0:
            return self.decode(rows)
        state = self.state_rows(slice(0, n))
        greedy = all(self.slots[i].params.greedy for i in rows)
        windows = self.windows(n, ahead=depth)
        drafted, p, q = self.draft_and_verify(n, rows, state, self.positions(n), greedy, windows, depth)
        self.accept_round(rows, drafted, p, q, None)

    def look_up(self, rows: list[int]):
        """One round of speculative decoding with prompt lookup's drafts (Choice.lookup) for the rows that can
        take them (speculable), of the depth that yields the most tokens a second (speculate.choose_depth; 0: a
        decode step). The other rows, and those with shorter proposals, are padded: they keep no padding."""
        n = self.batch_size(rows)
        proposals = {i: self.slots[i].lookup.propose(self.k) if speculable(self.slots[i]) else [] for i in rows}
        depth = choose_depth(self.costs(n), [(self.slots[i].acceptance, len(proposals[i])) for i in rows])
        if depth == 0:
            return self.decode(rows, proposals)
        state = self.state_rows(slice(0, n))
        if any(self.slots[i].params.penalized for i in rows):  # what penalties read; nothing else does
            record_token(state, self.tokens[:n])
        greedy = all(self.slots[i].params.greedy for i in rows)
        vocab_size = self.model.config.vocab_size
        drafted, p, lengths = lookup_drafts([proposals.get(i, []) for i in range(n)], depth, vocab_size, self.device)
        q = self.verify(n, state, self.positions(n), greedy, self.windows(n, ahead=depth), drafted)
        self.accept_round(rows, drafted, p, q, lengths)

    def accept_round(self, rows: list[int], drafted, p, q, lengths: torch.Tensor | None):
        """The acceptance rule (sampling.accept_drafts) on a round's drafts [n, d], for the decoding rows; emits
        each row's kept drafts and next token."""
        n, depth = drafted.shape
        uniforms = torch.zeros(n, depth, device=self.device)  # a greedy row keeps a draft where q (one-hot) agrees
        for i in rows:
            if not self.slots[i].params.greedy:
                uniforms[i] = torch.rand(depth, generator=self.slots[i].generator, device=self.device)
        self.refill_noise(rows)
        state = self.state_rows(slice(0, n))
        kept, next_token = accept_drafts(drafted, p, q, uniforms, state.noise, lengths)
        host = torch.cat([kept[:, None], next_token[:, None], drafted], dim=1).tolist()  # the round's one sync
        drafts = [depth] * n if lengths is None else lengths.tolist()
        self.tokens[:n, 0] = next_token
        self.steps_taken.append(("decode", tuple(rows)))
        self.counts["decode_steps"] += 1
        self.step_depths[depth] += 1
        for i in rows:
            n_kept, new = host[i][0], host[i][2 : 2 + host[i][0]] + [host[i][1]]
            self.speculation.record(n_kept, drafts[i])
            if drafts[i]:
                self.slots[i].acceptance.record(n_kept, n_kept + (n_kept < drafts[i]))
            # The draft read the row's token and every draft but the last: all the row now holds, unless it kept
            # every draft.
            self.draft_cached[i] = len(self.cached[i]) + min(n_kept + 1, depth)
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
        if c.lookup is not None:
            c.lookup.extend([token])
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
        if row in self.prefilling:
            self.prefilling.remove(row)
        self.state.allowed[row] = True  # the idle row samples freely (a stale mask could allow nothing)
        if error is not None:
            c.send(Event(c.index, error=error))
