"""What a speculative round proposes, and how deep it goes.

Prompt lookup (NgramIndex) drafts from the context itself, with no second model: the tokens that followed the latest
earlier occurrence of the sequence's last n tokens (n from NGRAM_MAX down to NGRAM_MIN), in the prompt or in what
was generated since. It pays where an answer repeats its context: a code edit returning the file, a quoted passage.
A proposal is one token sequence, a one-hot draft distribution, so the acceptance rule (sampling.accept_drafts) stays
exact for sampling.

choose_depth picks each round's depth, the drafted tokens the target verifies (0: a plain decode step), among those
whose cost was measured on this machine (measure_round_costs): the depth d that maximises expected tokens per
second, (1 - a^(d + 1)) / (1 - a) tokens for a round of cost c(d), a being the per-token acceptance seen lately
(Acceptance); for a batch, the sum over its rows. Where verifying costs more than the acceptance repays, it picks 0:
speculation turns itself off, and back on when the acceptance rises again. A draft model's plain rounds observe
nothing, so a draft the controller keeps off is tried now and then all the same (Probes).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NGRAM_MAX = 4  # the longest suffix looked up: a longer match is likelier to continue the same way
NGRAM_MIN = 2  # one token matches too often to say much: its proposals are mostly wrong
DEPTHS = (0, 2, 4, 6)  # the depths a controller chooses from, up to speculate_k: few, each a compiled verify shape
ACCEPTANCE_MEMORY = 0.9  # an observation's weight at the next: the acceptance follows what the text does now
PROBE_GAP = 64  # plain rounds before a draft model's second probe; each later one waits twice as long (Probes)
RETRY_GAP = 8  # plain rounds before a draft the controller followed, then turned off, is probed again (Probes)
COST_REPEATS = 5  # timed passes over the depths (each depth's least time), after one that compiles and warms up


class NgramIndex:
    """A sequence's tokens, and for each of its n-grams (NGRAM_MIN <= n <= NGRAM_MAX) the position after its latest
    occurrence that has a token after it: what propose() continues from."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]):
        for token in tokens:
            # the n-grams ending at the current end now have a token after them: this one
            end = len(self.tokens)
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                self.after[tuple(self.tokens[end - n :])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix found (none: []). Where they
        run into the suffix itself, the sequence goes on with that period: after "a b a b", "a b a b ..."."""
        end = len(self.tokens)
        for n in range(min(NGRAM_MAX, end), NGRAM_MIN - 1, -1):
            start = self.after.get(tuple(self.tokens[end - n :]))
            if start is not None:
                proposal = []
                for i in range(start, start + k):
                    proposal.append(self.tokens[i] if i < end else proposal[i - end])
                return proposal
        return []


def lookup_drafts(proposals: list[list[int]], depth: int, vocab_size: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """Rows' proposals as a round's drafts of depth tokens [B, depth] (a row's proposal cut to depth, or padded
    with token 0), their one-hot draft distributions [B, depth, V] and how many of each row's are drafts [B]
    (sampling.accept_drafts' lengths)."""
    lengths = [min(len(p), depth) for p in proposals]
    drafted = torch.tensor([p[:n] + [0] * (depth - n) for p, n in zip(proposals, lengths)], device=device)
    one_hot = torch.zeros(*drafted.shape, vocab_size, device=device).scatter_(-1, drafted[..., None], 1.0)
    return drafted, one_hot, torch.tensor(lengths, device=device)


def depth_choices(k: int) -> tuple[int, ...]:
    """The depths a controller of speculate_k k chooses from: DEPTHS up to k, and k."""
    return tuple(sorted({d for d in DEPTHS if d <= k} | {k}))


def expected_tokens(acceptance: float, depth: int) -> float:
    """Tokens a round of depth drafts yields when each draft is kept with probability acceptance (until the first
    rejection), the target's own token included."""
    return sum(acceptance**i for i in range(depth + 1))


@dataclass
class Acceptance:
    """How often a sequence's drafts are kept, lately: each observation weighs ACCEPTANCE_MEMORY less at the next.
    Prompt lookup observes where it has a proposal, verified or not; a draft model observes every round, a plain
    one being an observation of nothing, through which what was seen fades."""

    kept: float = 0.0
    tried: float = 0.0

    def rate(self) -> float:
        # Laplace's rule: 1/2 with no evidence, to which the estimate returns as its evidence fades, so that a
        # sequence whose speculation was turned off is tried again.
        return (self.kept + 1) / (self.tried + 2)

    def record(self, kept: int, tried: int):
        """A round's evidence: tried drafts checked against the target's tokens, the first kept of them (a plain
        round checks none, or a proposal's first token against the token it made)."""
        self.kept = ACCEPTANCE_MEMORY * self.kept + kept
        self.tried = ACCEPTANCE_MEMORY * self.tried + tried


def check_round_costs(costs: dict[int, float]):
    if 0 not in costs or any(c <= 0 for c in costs.values()):
        raise ValueError(f"round costs need depth 0 and positive seconds, got {costs}")


def choose_depth(costs: dict[int, float], rows: list[tuple[Acceptance, int]]) -> int:
    """The depth of a round of several rows, one depth for all (costs: seconds of such a round at each depth):
    the one that yields the most tokens per second, each row (its acceptance, the drafts it has) yielding
    expected_tokens of the drafts it has up to the depth; a row with none yields its one token."""
    rates = [(acceptance.rate(), available) for acceptance, available in rows]

    def tokens_per_second(depth):
        return sum(expected_tokens(a, min(depth, available)) for a, available in rates) / costs[depth]

    return max(costs, key=lambda d: (tokens_per_second(d), -d))


def plain_rounds(costs: dict[int, float], acceptance: Acceptance, available: int, limit: int) -> int:
    """How many plain rounds in a row, at least one and at most limit, choose_depth picks for a sequence whose plain
    rounds observe nothing (a draft model's: each fades its acceptance), the first already picked. They need no
    look at the tokens in between, so they run queued on the device (decode.plain_steps)."""
    fading, rounds = Acceptance(acceptance.kept, acceptance.tried), 1
    fading.record(0, 0)
    while rounds < limit and choose_depth(costs, [(fading, available)]) == 0:
        fading.record(0, 0)
        rounds += 1
    return rounds


def probe_depth(costs: dict[int, float], available: int) -> int:
    """The depth that would yield the most tokens per second were every draft kept (0: none would pay)."""
    return max(costs, key=lambda d: ((min(d, available) + 1) / costs[d], -d))


@dataclass
class Probes:
    """When a draft model that the controller keeps off is tried all the same. Its plain rounds observe nothing,
    and without evidence its acceptance is 1/2 (Acceptance.rate): a draft that would pay only at a higher one would
    never be seen to. A probe is a round at probe_depth: the first at the first round, the next after PROBE_GAP
    plain rounds, and each after twice as many as the one before, while the controller keeps the draft off. A
    draft that loses costs a probe each time the text doubles; one that wins is followed from its first probe. A
    draft the controller followed and then turned off (a few rejections weigh much against little evidence) is
    probed again after RETRY_GAP plain rounds, then as from its first probe."""

    wait: int = 0  # plain rounds before the next probe
    gap: int = PROBE_GAP  # the wait after the next probe

    def due(self) -> bool:
        return self.wait <= 0

    def plain(self, rounds: int):
        self.wait -= rounds

    def probed(self):
        self.wait, self.gap = self.gap, 2 * self.gap

    def followed(self):
        """The controller chose to speculate: should it turn the draft off, the next probe is RETRY_GAP away."""
        self.wait, self.gap = RETRY_GAP, PROBE_GAP


def draft_depth(costs: dict[int, float], rows: list[tuple[Acceptance, Probes]], available: int) -> int:
    """The depth of a round with a draft model for several rows (each its acceptance and its probes; each row has
    available drafts): choose_depth's, recorded as followed in every row, where that speculates; else probe_depth
    where some row's probe is due, recorded as probed in those rows; else 0."""
    depth = choose_depth(costs, [(acceptance, available) for acceptance, _ in rows])
    if depth:
        for _, probes in rows:
            probes.followed()
        return depth
    due = [probes for _, probes in rows if probes.due()]
    for probes in due:
        probes.probed()
    return probe_depth(costs, available) if due else 0


def measure_round_costs(run_round: Callable[[int], None], depths: tuple[int, ...]) -> dict[int, float]:
    """Seconds of a round at each depth: run_round(depth) runs one and waits for it. Each depth's first call
    compiles and warms up; then COST_REPEATS passes over all depths in turn, each depth's least time kept (what
    else runs on the machine only adds time, and a pass takes every depth at about the same moment). A deeper
    round does more work: one measured cheaper than a shallower one is noise, and costs as much as that."""
    for depth in depths:
        run_round(depth)
    times = {depth: [] for depth in depths}
    for _ in range(COST_REPEATS):
        for depth in depths:
            start = time.perf_counter()
            run_round(depth)
            times[depth].append(time.perf_counter() - start)
    costs = {}
    for depth in sorted(depths):
        costs[depth] = max([min(times[depth]), *costs.values()])
    return costs
