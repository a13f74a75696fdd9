"""What a generation returns, and the figures of a run: each row's tokens and text cut at its first EOS or
stop string (stop strings are matched on decoded text), finish reasons, log-probabilities, timings.
"""

import resource
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model import Transformer
from tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row: up to EOS (excluded) or through the token completing a stop string
    texts: list[str] | None  # per row, ending before any stop string (None without a tokenizer)
    finish_reasons: list[str]  # per row: "eos", "stop" or "length"
    logprobs: list[list["TokenLogprobs"]] | None  # per row, per token
    prompt_tokens: list[int]  # positions prefilled per row (padding excluded)
    decode_steps: int  # decode steps run (a row that finished early still took part in them)
    time_to_first_token_s: float
    decode_time_s: float
    raw_tokens: list[list[int]] = field(repr=False, default_factory=list)  # every token produced per row
    speculation: dict | None = None  # speculative decoding's figures (Speculation.summary)


@dataclass
class TokenLogprobs:
    """A chosen token's log-probability under the model (before any sampling setting), and the most likely
    tokens' (id, log-prob), best first: what generate returns and both of the server's APIs render. A prompt's
    first token has neither (None): nothing comes before it."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def step_logprobs(logprobs: tuple[Tensor, Tensor, Tensor], tokens: list[int]) -> list[TokenLogprobs]:
    """sample()'s log-probs of one step (chosen [B, 1], top values [B, n], top ids [B, n]) and its tokens -> one
    TokenLogprobs per row."""
    chosen, values, ids = (t.tolist() for t in logprobs)
    return [TokenLogprobs(token, chosen[b][0], list(zip(ids[b], values[b]))) for b, token in enumerate(tokens)]


@dataclass
class Speculation:
    """What speculative rounds did: each drafted some tokens (its depth, at most k; 0: a plain decode step) and
    kept some of them."""

    k: int
    rounds: int = 0
    drafted: int = 0
    kept: int = 0
    histogram: list[int] = field(init=False)  # rounds that drafted and kept 0, 1, ..., k of their drafts
    depths: list[int] = field(init=False)  # rounds of each depth 0, 1, ..., k

    def __post_init__(self):
        self.histogram, self.depths = [0] * (self.k + 1), [0] * (self.k + 1)

    def record(self, kept: int, depth: int):
        """One round: depth drafted, kept of them accepted."""
        self.rounds, self.drafted, self.kept = self.rounds + 1, self.drafted + depth, self.kept + kept
        self.depths[depth] += 1
        if depth:
            self.histogram[kept] += 1

    def summary(self) -> dict:
        speculative = self.rounds - self.depths[0]
        return {
            "speculate_k": self.k,
            "acceptance_rate": self.kept / max(self.drafted, 1),
            "accepted_length_histogram": self.histogram,
            "mean_accepted_length": self.kept / max(speculative, 1),
            "depth_histogram": self.depths,
            "tokens_per_target_forward": (self.kept + self.rounds) / max(self.rounds, 1),
        }


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


class TextPieces:
    """One row's text while its tokens come: push() returns the next piece to show. The pieces join to exactly
    the final text: held back are an incomplete character and any tail that could begin a stop string.
    finished becomes "eos" or "stop" when a token ends the text (ignore_eos: a stop string only); end() gives the
    rest when tokens run out."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], ignore_eos: bool = False):
        self.decoder, self.stop = IncrementalDecoder(tokenizer), stop
        self.eos = set() if ignore_eos else set(tokenizer.eos_ids)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending, self.finished = "", None

    def push(self, token: int) -> str:
        if token in self.eos:
            self.finished = "eos"
            return self.end()
        self.pending += self.decoder.push(token)
        return self.release(final=False)

    def end(self) -> str:
        """The rest of the text, an incomplete character included (as the tokenizer decodes it)."""
        self.pending += self.decoder.flush()
        return self.release(final=True)

    def release(self, final: bool) -> str:
        cut = find_stop(self.pending, self.stop)
        if cut >= 0:
            self.pending, self.finished = self.pending[:cut], "stop"
            return self.take(cut)
        return self.take(len(self.pending) if final else max(len(self.pending) - self.hold, 0))

    def take(self, n: int) -> str:
        piece, self.pending = self.pending[:n], self.pending[n:]
        return piece


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
        steps = [step_logprobs(lp, [raw[i] for raw in raw_rows]) for i, lp in enumerate(logprob_steps)]
        logprobs = [[steps[i][b] for i in range(len(tokens))] for b, (tokens, _, _) in enumerate(rows)]
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


def model_size_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads: all of them but the embedding tables, of which it reads one
    row, unless the output projection reuses the token table (tied embeddings)."""
    skip = {"pos_embeddings.weight"} | ({"tok_embeddings.weight"} if model.output is not None else set())
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if name not in skip)


def synchronize(device: torch.device):
    """Waits for the device's queued work: what timings of CUDA work need."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # peak resident set, KiB on Linux


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
        **model.kv_cache_figures(),
    }
