"""Choosing the next token on the device: penalties, temperature, top-k/top-p/min-p, and the acceptance
rule of speculative decoding.

The settings travel as tensors (SamplerState), so new values never recompile a compiled step. Random
draws are made outside the step (refill_noise), so that a per-request torch.Generator can be used;
drawing argmax(p_i / E_i) with E_i ~ Exp(1) samples from p without torch.multinomial's host sync.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
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

    @property
    def penalized(self) -> bool:
        """Whether a token's odds depend on the tokens before it: speculative decoding's rule does not cover that."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def generator(self, device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


def check_seed(seed: int | None):
    if seed is not None and not 0 <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")


def check_logprobs(params: SamplingParams, vocab_size: int):
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs {params.logprobs} exceeds the vocabulary size ({vocab_size})")


class SamplerState(NamedTuple):
    """What the sampling step reads: the settings as 0-d float32 tensors, and per row [B, V] the tokens seen
    (prompt and output), the occurrences of each token in the output, this step's Exp(1) draws, and the tokens
    allowed (all, unless a grammar constrains the row: grammar.py)."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    repetition_penalty: Tensor
    presence_penalty: Tensor
    frequency_penalty: Tensor
    seen: Tensor
    counts: Tensor
    noise: Tensor
    allowed: Tensor


SETTINGS = tuple(k for k in SamplerState._fields if k not in ("seen", "counts", "noise", "allowed"))


def sampler_state(params: SamplingParams, rows: list[list[int]], vocab_size: int, device) -> SamplerState:
    knobs = {k: torch.tensor(float(getattr(params, k)), dtype=torch.float32, device=device) for k in SETTINGS}
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        seen[b, torch.tensor(row, dtype=torch.long, device=device)] = True
    counts = torch.zeros(len(rows), vocab_size, device=device)
    allowed = torch.ones_like(seen)
    return SamplerState(**knobs, seen=seen, counts=counts, noise=torch.ones_like(counts), allowed=allowed)


def row_sampler_state(batch_size: int, vocab_size: int, device) -> SamplerState:
    """A state whose settings are per row [B, 1], for rows that are independent requests (set_row fills one)."""
    knobs = {k: torch.zeros(batch_size, 1, device=device) for k in SETTINGS}
    counts = torch.zeros(batch_size, vocab_size, device=device)
    allowed = torch.ones_like(counts, dtype=torch.bool)
    return SamplerState(**knobs, seen=counts.bool(), counts=counts, noise=torch.ones_like(counts), allowed=allowed)


def set_row(state: SamplerState, row: int, params: SamplingParams, seen: list[int], allowed: Tensor | None = None):
    """Row row of a row_sampler_state starts a request: its settings, the tokens seen (its prompt), no output yet,
    and the tokens its grammar allows first (None: all)."""
    for k in SETTINGS:
        getattr(state, k)[row] = float(getattr(params, k))
    state.seen[row] = False
    state.seen[row, torch.tensor(seen, dtype=torch.long, device=state.seen.device)] = True
    state.counts[row] = 0
    state.allowed[row] = True if allowed is None else allowed


def record_token(state: SamplerState, token: Tensor):
    # token: [B, 1], the token each row just produced
    state.seen.scatter_(1, token, True)
    state.counts.scatter_add_(1, token, torch.ones_like(token, dtype=state.counts.dtype))


def refill_noise(state: SamplerState, params: SamplingParams, generator: torch.Generator | None):
    if not params.greedy:
        draw_exponential_(state.noise, generator)


def draw_exponential_(noise: Tensor, generator: torch.Generator | None) -> Tensor:
    """Fills noise with Exp(1) draws, as -log(U) for U uniform in [0, 1): on a CPU, torch draws uniforms and takes
    their logs far faster than Tensor.exponential_ draws. U = 0 makes an infinite draw, whose token then loses
    (p / inf), never a zero one (p / 0)."""
    return noise.uniform_(generator=generator).log_().neg_()


def apply_penalties(logits: Tensor, s: SamplerState) -> Tensor:
    # Repetition penalty as in transformers (CTRL paper), presence/frequency as in OpenAI's API.
    penalized = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
    logits = torch.where(s.seen, penalized, logits)
    return logits - s.frequency_penalty * s.counts - s.presence_penalty * (s.counts > 0)


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


def sample(logits: Tensor, s: SamplerState, greedy: bool, n_logprobs: int | None):
    """[B, V] logits -> next token [B, 1], and (chosen log-prob [B, 1], top values [B, n], top ids [B, n]) or None."""
    processed = apply_penalties(logits, s).masked_fill(~s.allowed, float("-inf"))
    token = torch.argmax(processed, dim=-1, keepdim=True)
    if not greedy:  # rows at temperature 0 among sampled ones (a server's batch of requests) keep the argmax
        hot = s.temperature > 0
        probs = logits_to_probs(processed, torch.where(hot, s.temperature, 1.0), s.top_k, s.top_p, s.min_p)
        token = torch.where(hot, torch.argmax(probs / s.noise, dim=-1, keepdim=True), token)
    return token, None if n_logprobs is None else token_logprobs(logits, token, n_logprobs)


def token_logprobs(logits: Tensor, tokens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """[..., V] logits and [..., 1] tokens -> (the tokens' log-probs [..., 1], the top n's values and ids [..., n])
    under the model's own distribution, before any sampling setting."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, n, dim=-1)
    return logprobs.gather(-1, tokens), top.values, top.indices


# ---------------------------------------------------------------- speculative decoding's rule


def step_probs(logits: Tensor, s: SamplerState, greedy: bool) -> Tensor:
    """[..., V] logits -> the distribution a token is drawn from (one-hot at the argmax when greedy, and for
    rows at temperature 0 among sampled ones). Settings of [B, 1] go with logits of [B, V]."""
    one_hot = F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if greedy:
        return one_hot
    hot = s.temperature > 0
    probs = logits_to_probs(logits, torch.where(hot, s.temperature, 1.0), s.top_k, s.top_p, s.min_p)
    return torch.where(hot, probs, one_hot)


def residual_probs(q: Tensor, p: Tensor) -> Tensor:
    """Where a drafted token is rejected, the next one comes from normalize(max(0, q - p)) over the whole
    vocabulary; if that has no mass (p equals q up to rounding, so rejection had ~0 chance), from q."""
    residual = (q - p).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 1e-6, residual / mass.clamp(min=1e-6), q)


def accept_drafts(
    drafted: Tensor, p: Tensor, q: Tensor, uniforms: Tensor, noise: Tensor, lengths: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Leviathan et al.'s rule, for each of B rows: drafted [B, k] tokens drawn from p [B, k, V], the target's
    distributions q [B, k + 1, V].

    Token i is kept with probability min(1, q_i(x_i) / p_i(x_i)) (uniforms [B, k]); at the first rejection
    the next token comes from the residual (noise [B, V]: Exp(1) draws); if all are kept, a bonus token
    comes from q_k. lengths [B]: a row's drafts, where fewer than k (the rest pad the rows to one shape): the
    padding is never kept, and past a row's last draft its next token comes from q there, as after all k.
    Returns the number kept [B] and the next token [B], as device tensors."""
    k = drafted.shape[1]
    chosen = drafted[..., None]
    ratio = (q[:, :k].gather(-1, chosen) / p.gather(-1, chosen))[..., 0]  # p > 0 at the drafted tokens: drawn from it
    keep = uniforms < ratio
    if lengths is not None:
        drafts = torch.arange(k, device=drafted.device) < lengths[:, None]  # [B, k]
        keep, p = keep & drafts, p * drafts[..., None]
    kept = torch.cumprod(keep.int(), dim=-1).sum(-1)
    # Past the last draft p is zero, so the "residual" there is q itself: the bonus token.
    p = torch.cat([p, torch.zeros_like(p[:, :1])], dim=1)
    rows = torch.arange(drafted.shape[0], device=drafted.device)
    return kept, torch.argmax(residual_probs(q[rows, kept], p[rows, kept]) / noise, dim=-1)
