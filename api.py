"""The OpenAI API of the server: a request's body checked into a Job (ApiError, naming the field, when it
cannot be): prompts, sampling, log-probs, tools, structured output; and the tokenizer routes (answers.py builds
the answers).
"""

import json
import logging
import math
import re
from dataclasses import dataclass

from chat import encode_conversation
from chat_reply import THINK, ReplyFormat, reply_format, tool_call_grammar
from engine import MAX_TOP_LOGPROBS, Engine
from grammar import after_reasoning, choice_grammar, grammar_error, json_grammar, regex_grammar, text_grammar
from sampling import SamplingParams, check_seed
from tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# Every field of OpenAI's chat and completions requests, and the extensions, by what the server does with it
# (docs/serving.md has the table; tests/test_server.py walks it against the openai package's request types).
HONOURED = set(
    "model messages prompt max_tokens max_completion_tokens temperature top_p n stop seed presence_penalty "
    "frequency_penalty logprobs top_logprobs echo stream stream_options top_k min_p repetition_penalty "
    "response_format guided_json guided_regex guided_choice guided_grammar tools tool_choice parallel_tool_calls "
    "chat_template_kwargs ignore_eos prediction".split()
)
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # OpenAI's, vLLM's
# Fields this server cannot honour, with the values that ask for nothing: any other value is refused with a 400.
UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
# Fields accepted with no effect: the OpenAI platform's bookkeeping and settings of its own models.
NO_EFFECT = set(
    "user store metadata safety_identifier service_tier prompt_cache_key prompt_cache_retention prompt_cache_options "
    "verbosity reasoning_effort moderation".split()
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
    """The request's messages as transformers' chat templates take them: {"role", "content": str}, an assistant's
    tool calls with their arguments as objects, a tool's result with its tool_call_id."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    checked = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"{name}.role must be one of {', '.join(ROLES)}", f"{name}.role")
        # A developer message is what newer OpenAI clients send in place of a system one.
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        message = {
            "role": role,
            "content": "" if content is None and calls else message_text(content, f"{name}.content"),
        }
        if calls is not None:
            message["tool_calls"] = assistant_calls(calls, f"{name}.tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(f"{name}.tool_call_id must be the id of the call this answers", f"{name}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        checked.append(message)
    return checked


def assistant_calls(calls, name: str) -> list[dict]:
    """An assistant message's tool_calls, with each call's arguments (JSON text) as the object the templates print."""
    if not isinstance(calls, list):
        raise ApiError(f"{name} must be a list of tool calls", name)
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(function["arguments"])
            assert isinstance(function["name"], str) and isinstance(arguments, dict)
        except (TypeError, KeyError, ValueError, AssertionError):
            raise ApiError(
                f'{name}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments": JSON text of '
                "an object}}",
                f"{name}[{j}]",
            ) from None
        checked.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return checked


@dataclass
class ToolUse:
    """What a chat request lets the model do with its tools."""

    tools: list[dict]  # as given: [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: str  # "auto", "required", or the name of the function it must call
    parallel: bool


def tool_use(body: dict, fmt: ReplyFormat) -> ToolUse | None:
    """tools, tool_choice and parallel_tool_calls -> ToolUse, or None where no tool may be called."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ApiError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError('tools must be a list of {"type": "function", "function": {"name", "parameters"}}', "tools")
    names = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
            or not FUNCTION_NAME.fullmatch(function["name"])
            or not isinstance(function.get("parameters", {}), dict)
            or not isinstance(function.get("description", ""), str)
        ):
            raise ApiError(
                f'tools[{j}] must be {{"type": "function", "function": {{"name" (letters, digits, _ and -; at most '
                '64), "description", "parameters": a JSON schema}}',
                f"tools[{j}]",
            )
        names.append(function["name"])
    if len(set(names)) < len(names):
        raise ApiError("tools must have different names", "tools")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        named = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or named not in names:
            raise ApiError(
                'tool_choice must name one of the tools: {"type": "function", "function": {"name"}}', "tool_choice"
            )
        choice = named
    elif choice not in ("none", "auto", "required"):
        raise ApiError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}', "tool_choice")
    if choice == "none":
        return None
    if fmt.tools is None:
        raise ApiError("tools: this model's chat template does not support tools", "tools")
    return ToolUse(tools, choice, flag(body, "parallel_tool_calls", True))


def template_kwargs(body: dict, tokenizer: Tokenizer) -> dict:
    """chat_template_kwargs: more variables for the template (e.g. Qwen3's enable_thinking)."""
    kwargs = body.get("chat_template_kwargs") or {}
    reserved = {"messages", "tools", "add_generation_prompt"} | tokenizer.special_tokens.keys()
    if not isinstance(kwargs, dict) or reserved & kwargs.keys():
        raise ApiError(
            f"chat_template_kwargs must be an object without {', '.join(sorted(reserved))}", "chat_template_kwargs"
        )
    return kwargs


def chat_prompt(
    body: dict, tokenizer: Tokenizer, add_generation_prompt: bool = True, tools: ToolUse | None = None
) -> list[int]:
    messages, kwargs = chat_messages(body), template_kwargs(body, tokenizer)
    if tools is not None:
        kwargs["tools"] = tools.tools
    try:
        return encode_conversation(tokenizer, messages, add_generation_prompt, **kwargs)
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


def output_grammar(
    body: dict, engine: Engine, tools: ToolUse | None, fmt: ReplyFormat, in_reasoning: bool
) -> str | None:
    """The llguidance grammar the request's output must follow, from response_format (json_object, or json_schema),
    vLLM's guided_json (a schema), guided_regex, guided_choice (strings) and guided_grammar (Lark or GBNF), or a
    tool_choice that demands a call; after the reasoning where the reply starts inside <think>."""
    asked = [name for name in CONSTRAINTS if body.get(name) not in (None, {"type": "text"})]
    if tools is not None and tools.choice != "auto":
        asked.append("tool_choice")
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(f"give one of {', '.join(asked)}, not several", asked[1])
    name, value = asked[0], body[asked[0]]
    if engine.vocabulary is None:
        raise ApiError(f"{name} needs the checkpoint's tokenizer.json, which this model lacks", name)
    try:
        if name == "tool_choice":
            functions = [t["function"] for t in tools.tools if tools.choice in ("required", t["function"]["name"])]
            grammar = tool_call_grammar(fmt.tools, functions, tools.parallel, engine.tokenizer.token_to_id)
        else:
            grammar = constraint_grammar(name, value)
    except ValueError as e:  # a grammar llguidance cannot read
        raise ApiError(f"{name}: {e}", name) from None
    grammar = after_reasoning(grammar) if in_reasoning else grammar
    if error := grammar_error(grammar, engine.vocabulary):
        name = "tools" if name == "tool_choice" else name  # a function's parameters schema
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
    reply_format: ReplyFormat  # chat: how the template's replies hold reasoning and tool calls
    tools: ToolUse | None  # chat: the tools the model may call
    in_reasoning: bool  # chat: the prompt opened <think>, so the reply starts inside it
    ignore_eos: bool = False  # EOS does not end a choice (vLLM's and llama.cpp's extension)
    prediction: list[int] | None = None  # OpenAI's predicted output, as tokens: what prompt lookup drafts from

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
            instead = "; use tools, which replace it" if name.startswith("function") else ""
            raise ApiError(f"{name} is not supported by this server{instead}", name)
    for name in sorted(body.keys() - HONOURED - UNSUPPORTED.keys() - NO_EFFECT):
        log.info("request field %s is unknown to this server: ignored", json.dumps(name))
    fmt = reply_format(engine.tokenizer.chat_template)
    tools = tool_use(body, fmt) if chat else None
    if chat:
        prompts = [chat_prompt(body, engine.tokenizer, tools=tools)]
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
    # 16 tokens hold at least 16 characters: enough to see whether the prompt ends with <think> (and a newline)
    in_reasoning = chat and fmt.reasoning and engine.tokenizer.decode(prompts[0][-16:]).rstrip().endswith(THINK)
    params, stop = sampling_settings(body), stop_strings(body)
    grammar = output_grammar(body, engine, tools, fmt, in_reasoning)
    return Job(
        chat,
        prompts,
        n,
        max_tokens,
        params,
        stop,
        top,
        stream,
        include_usage,
        echo,
        grammar,
        fmt,
        tools,
        in_reasoning,
        flag(body, "ignore_eos", False),
        prediction_tokens(body, engine.tokenizer),
    )


def prediction_tokens(body: dict, tokenizer: Tokenizer) -> list[int] | None:
    """OpenAI's prediction, {"type": "content", "content": text or text parts}: the output expected, as tokens. A
    server with prompt lookup (--ngram) drafts from it; the answer is the same with or without it."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or "content" not in prediction:
        raise ApiError('prediction must be {"type": "content", "content": ...}', "prediction")
    return encode_text(tokenizer, message_text(prediction["content"], "prediction.content"), "prediction", bos=False)


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
    """POST /tokenize, as vLLM takes it (prompt, or messages and tools through the chat template;
    add_special_tokens) and llama.cpp (content; add_special)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("messages") is not None:
        tools = tool_use(body, reply_format(tokenizer.chat_template))
        tokens = chat_prompt(body, tokenizer, flag(body, "add_generation_prompt", True), tools)
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
