"""The OpenAI API of the server: a request's body checked into a Job (ApiError, naming the field, when it
cannot be), and the answer objects built from the engine's events (completions, chat completions, and their
streamed chunks).
"""

import json
import logging
import math
from dataclasses import dataclass

from chat import encode_conversation
from engine import MAX_TOP_LOGPROBS, Choice, Engine, Event
from grammar import choice_grammar, grammar_error, json_grammar, regex_grammar, text_grammar
from results import TokenLogprobs
from sampling import SamplingParams, check_seed
from tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant")
# Every field of OpenAI's chat and completions requests, and the extensions, by what the server does with it
# (docs/serving.md has the table; tests/test_server.py walks it against the openai package's request types).
HONOURED = set(
    "model messages prompt max_tokens max_completion_tokens temperature top_p n stop seed presence_penalty "
    "frequency_penalty logprobs top_logprobs echo stream stream_options top_k min_p repetition_penalty "
    "response_format guided_json guided_regex guided_choice guided_grammar".split()
)
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's names
# Fields this server cannot honour, with the values that ask for nothing: any other value is refused with a 400.
UNSUPPORTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
# Fields accepted with no effect: the OpenAI platform's bookkeeping and settings of its own models.
NO_EFFECT = set(
    "user store metadata safety_identifier service_tier prompt_cache_key prompt_cache_retention prompt_cache_options "
    "verbosity reasoning_effort moderation parallel_tool_calls".split()
)
log = logging.getLogger("server")


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


def message_text(content, name: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined by newlines,
    as vLLM joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(f"{name} must be a string or a non-empty list of text parts", name)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if isinstance(kind, str) else "not a text part"
            raise ApiError(f"{name}[{j}] is {what}: this server reads text only", f"{name}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as the chat template takes them: {"role", "content": str}."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        # A developer message is what newer OpenAI clients send in place of a system one.
        role = "system" if m["role"] == "developer" else m["role"]
        checked.append({"role": role, "content": message_text(m.get("content"), f"messages[{i}].content")})
    return checked


def chat_prompt(body: dict, tokenizer: Tokenizer, add_generation_prompt: bool = True) -> list[int]:
    messages = chat_messages(body)
    try:
        return encode_conversation(tokenizer, messages, add_generation_prompt)
    except ValueError as e:  # the template refused the conversation, or the text is not valid UTF-8
        raise ApiError(str(e), "messages") from None


def encode_text(tokenizer: Tokenizer, text: str, name: str, bos: bool = True) -> list[int]:
    try:
        return tokenizer.encode(text, bos)
    except ValueError as e:  # lone surrogates, which JSON can carry
        raise ApiError(str(e), name) from None


def completion_prompts(body: dict, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists: one prompt each."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)  # noqa: E731
    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_ids(p) for p in prompt):
        raise ApiError("prompt must be a string, a list of strings, or token ids", "prompt")
    rows = [encode_text(tokenizer, p, "prompt") if isinstance(p, str) else p for p in prompt]
    if any(not 0 <= t < vocab_size for row in rows for t in row):
        raise ApiError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if any(not row for row in rows):
        raise ApiError("a prompt is empty and the tokenizer adds no BOS token to start from", "prompt")
    return rows


def output_grammar(body: dict, engine: Engine) -> str | None:
    """The llguidance grammar the request's output must follow, from response_format (json_object, or json_schema) or
    vLLM's guided_json (a schema), guided_regex, guided_choice (strings) and guided_grammar (Lark or GBNF)."""
    asked = [name for name in CONSTRAINTS if body.get(name) not in (None, {"type": "text"})]
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(f"give one of {', '.join(asked)}, not several", asked[1])
    name, value = asked[0], body[asked[0]]
    if engine.vocabulary is None:
        raise ApiError(f"{name} needs the checkpoint's tokenizer.json, which this model lacks", name)
    try:
        grammar = constraint_grammar(name, value)
    except ValueError as e:  # a grammar llguidance cannot read
        raise ApiError(f"{name}: {e}", name) from None
    if error := grammar_error(grammar, engine.vocabulary):
        raise ApiError(f"{name} is not supported as given: {error.strip()}", name)
    return grammar


def constraint_grammar(name: str, value) -> str:
    """One constraint field's value -> its grammar (ApiError when the value has the wrong shape)."""
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return json_grammar({"type": "object"})
        schema = value.get("json_schema") if kind == "json_schema" else None
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise ApiError(
                'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                '"json_schema": {"name": ..., "schema": {...}}}',
                name,
            )
        return json_grammar(schema["schema"])
    if name == "guided_json" and isinstance(value, (dict, str)):
        return json_grammar(value)
    if name == "guided_regex" and isinstance(value, str):
        return regex_grammar(value)
    if name == "guided_choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return choice_grammar(value)
    if name == "guided_grammar" and isinstance(value, str):
        return text_grammar(value)
    wanted = {"guided_json": "a JSON schema", "guided_choice": "a non-empty list of strings"}
    raise ApiError(f"{name} must be {wanted.get(name, 'a string')}", name)


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
    echo: bool  # completions: the answer starts with the prompt (with log-probs asked, the prompt's log-probs too)
    grammar: str | None  # what the output must follow (grammar.py), or None

    @property
    def score_prompt(self) -> bool:
        return self.echo and self.top_logprobs is not None


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
    for name in sorted(body.keys() - HONOURED - UNSUPPORTED.keys() - NO_EFFECT):
        log.info("request field %s is unknown to this server: ignored", json.dumps(name))
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
    echo = not chat and flag(body, "echo", False)
    # max_tokens 0 with echo: the prompt (and its log-probs) alone, as vLLM answers it, e.g. to lm-eval
    longest = max(map(len, prompts))
    max_tokens = reply_length(body, "messages" if chat else "prompt", longest, engine.context, int(not echo))
    include_usage = options.get("include_usage") is True
    params, stop, grammar = sampling_settings(body), stop_strings(body), output_grammar(body, engine)
    return Job(chat, prompts, n, max_tokens, params, stop, top, stream, include_usage, echo, grammar)


def reply_length(body: dict, prompt_field: str, longest: int, context: int, least: int) -> int:
    """max_completion_tokens (or max_tokens; default: all the room left) for a longest prompt in the context."""
    if longest >= context:
        raise ApiError(f"the prompt ({longest} tokens) does not fit the context ({context} tokens)", prompt_field)
    room = context - longest
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, name, room, low=least)
    if max_tokens > room:
        raise ApiError(
            f"{name} {max_tokens} plus the prompt ({longest} tokens) exceeds the context ({context} tokens)", name
        )
    return max_tokens


def token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    ids = body.get(name)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(f"{name} must be a list of token ids", name)
    if any(not 0 <= t < vocab_size for t in ids):
        raise ApiError(f"{name} must be token ids in [0, {vocab_size})", name)
    return ids


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", name)
    return value


def tokenize(body, tokenizer: Tokenizer, max_model_len: int) -> dict:
    """POST /tokenize, as vLLM takes it (prompt, or messages through the chat template; add_special_tokens) and
    llama.cpp (content; add_special)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("messages") is not None:
        tokens = chat_prompt(body, tokenizer, flag(body, "add_generation_prompt", True))
    else:
        name = "prompt" if "prompt" in body else "content"
        text = body.get(name)
        if not isinstance(text, str):
            raise ApiError("give the text to tokenize as prompt (or content), or messages", name)
        bos = flag(body, "add_special_tokens", True) if name == "prompt" else flag(body, "add_special", False)
        tokens = encode_text(tokenizer, text, name, bos)
    answer = {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}
    if flag(body, "return_token_strs", False):
        answer["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return answer


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict:
    """GET /tokenizer_info, as vLLM answers it: the special tokens and chat template (lm-eval's remote tokenizer
    reads them)."""
    specials = {k: tokenizer.special_tokens.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return specials | {"chat_template": tokenizer.chat_template, "model_max_length": max_model_len}


def detokenize(body, tokenizer: Tokenizer, vocab_size: int) -> dict:
    """POST /detokenize: tokens -> their text, as vLLM's prompt and llama.cpp's content."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    text = tokenizer.decode(token_ids(body, "tokens", vocab_size))
    return {"prompt": text, "content": text}


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
        "top_logprobs": [None if e.top is None else {tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
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


def echo_choice(tokenizer: Tokenizer, c: Choice, prompt: list[TokenLogprobs] | None) -> dict:
    """A streamed completion's chunk with echo, before a choice's first token: the prompt (and its log-probs)."""
    lp = None if prompt is None else completion_logprobs(tokenizer, prompt)
    return {"index": c.index, "text": tokenizer.decode(c.ids), "logprobs": lp, "finish_reason": None}


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
