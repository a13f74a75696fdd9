"""The OpenAI API of the server: a request's body checked into a Job (ApiError, naming the field, when it
cannot be), and the answer objects built from the engine's events (completions, chat completions, and their
streamed chunks).
"""

import json
import math
from dataclasses import dataclass

from chat import encode_conversation
from engine import MAX_TOP_LOGPROBS, Choice, Engine, Event
from results import TokenLogprobs
from sampling import SamplingParams, check_seed
from tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
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


class ApiError(Exception):
    """An error the client caused, answered with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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


def parse_job(body, chat: bool, model_name: str, engine: Engine) -> Job:
    """A request's body -> its Job, checked against this server's model and engine; ApiError names a bad field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(f"the model {json.dumps(model)} does not exist; this server has {model_name}", "model")
    for name, harmless in UNSUPPORTED.items():
        if body.get(name) not in harmless:
            raise ApiError(f"{name} is not supported by this server", name)
    if chat:
        prompts = [chat_prompt(body, engine.tokenizer)]
        if body.get("logprobs") not in (None, True, False):
            raise ApiError("logprobs must be true or false", "logprobs")
        top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if body.get("logprobs") else None
    else:
        prompts = completion_prompts(body, engine.tokenizer, engine.model.config.vocab_size)
        top = integer(body, "logprobs", None, 0, 5)
    n = integer(body, "n", 1, 1, len(engine.slots))
    if len(prompts) * n > len(engine.slots):
        raise ApiError(f"{len(prompts)} prompts x n = {n} choices exceed the {len(engine.slots)} slots", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    max_tokens = reply_length(body, "messages" if chat else "prompt", max(map(len, prompts)), engine.context)
    include_usage, echo = options.get("include_usage") is True, body.get("echo", False) is True and not chat
    return Job(
        chat, prompts, n, max_tokens, sampling_settings(body), stop_strings(body), top, stream, include_usage, echo
    )


def reply_length(body: dict, prompt_field: str, longest: int, context: int) -> int:
    """max_completion_tokens (or max_tokens; default: all the room left) for a longest prompt in the context."""
    if longest >= context:
        raise ApiError(f"the prompt ({longest} tokens) does not fit the context ({context} tokens)", prompt_field)
    room = context - longest
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name, room, low=1)
    if max_tokens > room:
        raise ApiError(
            f"{name} {max_tokens} plus the prompt ({longest} tokens) exceeds the context ({context} tokens)", name
        )
    return max_tokens


# ---------------------------------------------------------------- answers


def logprobs_object(job: Job, tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    """A choice's (or a chunk's) log-probs as the chat API gives them, or the completions API."""
    return chat_logprobs(tokenizer, entries) if job.chat else completion_logprobs(tokenizer, entries)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    def item(token, logprob):
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(*t) for t in e.top]} for e in entries]}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    tokens = [tokenizer.decode([e.token]) for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
        "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))],
    }


def object_name(job: Job, chunk: bool) -> str:
    if job.chat:
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def chunk_choice(job: Job, tokenizer: Tokenizer, event: Event) -> dict:
    """A streamed event as a chunk's choice."""
    lp = None if event.logprobs is None else logprobs_object(job, tokenizer, [event.logprobs])
    text = {"delta": {"content": event.text}} if job.chat else {"text": event.text}
    return {"index": event.index, **text, "logprobs": lp, "finish_reason": event.finish_reason}


def answer_choice(job: Job, tokenizer: Tokenizer, c: Choice, text: str, entries: list[TokenLogprobs], reason: str):
    """A choice of a non-streamed answer: its whole text (after the prompt's, with echo) and log-probs."""
    lp = None if job.top_logprobs is None else logprobs_object(job, tokenizer, entries)
    if job.chat:
        content = {"message": {"role": "assistant", "content": text}}
    else:
        content = {"text": (tokenizer.decode(c.ids) if job.echo else "") + text}
    return {"index": c.index, **content, "logprobs": lp, "finish_reason": reason}


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
