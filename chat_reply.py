"""A chat reply's parts, split out of the model's text as its chat template taught it: reasoning (<think>...</think>),
content and tool calls; and the grammar that makes a tool call well-formed (tool_choice "required", or a named
function).

Tool-call formats, told by the template's own markers:
- hermes (Qwen2.5, Qwen3, Hermes): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, once or more;
  or, as Qwen2.5-Coder often writes it, the reply is that JSON object alone, maybe in a ```json fence.
- llama3 (Llama 3.1 and later): the reply is {"name": ..., "parameters": {...}}, maybe after <|python_tag|>, calls
  separated by ";".
- mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...].
Reasoning: where the template writes <think> (Qwen3, DeepSeek-R1), the reply's <think>...</think> is reasoning; a
prompt that ends with <think> (the template opened it) starts the reply inside it.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from grammar import JSON_LAYOUT

THINK, END_THINK = "<think>", "</think>"
CALL_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)
FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*(?:```\s*)?", re.DOTALL)


@dataclass(frozen=True)
class ReplyFormat:
    tools: str | None  # the template's tool-call format ("hermes", "llama3", "mistral"), None: it takes no tools
    reasoning: bool  # the template writes <think>


def reply_format(template: str | None) -> ReplyFormat:
    template = template or ""
    tools = next((name for name, marker in CALL_MARKERS.items() if marker in template), None)
    if tools is None and "tools" in template and "<|start_header_id|>" in template:
        tools = "llama3"  # Llama 3.2's template offers tools without <|python_tag|>
    return ReplyFormat(tools, THINK in template)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ReplyParts:
    reasoning: str
    content: str
    calls: list[ToolCall]


def held_back(text: str, marker: str) -> int:
    """How much of text can be shown while more may follow: all but an ending that could begin marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


def split_reply(text: str, fmt: ReplyFormat, tools: bool, in_reasoning: bool, final: bool) -> ReplyParts:
    """The reply so far -> its parts. tools: the request offered tools (only then is a call looked for). Before the
    end (final False), text that may yet become a marker (a partial </think>, a tool call) is held back, so that each
    part only ever grows: a stream sends what is new."""
    reasoning = ""
    if fmt.reasoning and not final and THINK.startswith(text.lstrip()):  # maybe the start of <think>
        return ReplyParts("", "", [])
    if fmt.reasoning and (in_reasoning or text.lstrip().startswith(THINK)):
        body = text.lstrip().removeprefix(THINK).lstrip()
        end = body.find(END_THINK)
        if end < 0:  # still thinking
            return ReplyParts(body if final else body[: held_back(body, END_THINK)], "", [])
        reasoning, text = body[:end], body[end + len(END_THINK) :].lstrip()
    if not tools or fmt.tools is None:
        return ReplyParts(reasoning, text, [])
    start = call_start(fmt.tools, text, final)
    if start is None:
        marker = CALL_MARKERS[fmt.tools]
        return ReplyParts(reasoning, text if final else text[: held_back(text, marker)], [])
    if not final:
        return ReplyParts(reasoning, text[:start], [])
    calls = parse_calls(fmt.tools, text[start:])
    return ReplyParts(reasoning, text[:start], calls) if calls else ReplyParts(reasoning, text, [])


def call_start(tools: str, text: str, final: bool) -> int | None:
    """Where the tool calls begin in text, or None."""
    if tools != "llama3" and (start := text.find(CALL_MARKERS[tools])) >= 0:
        return start
    if tools == "mistral":
        return None
    # A Llama call, or a Hermes one without its tags, is the whole reply: a JSON object, maybe fenced or tagged.
    body, starts = text.lstrip(), ("{", "```", CALL_MARKERS["llama3"])
    if body.startswith(starts) or (not final and any(start.startswith(body) for start in starts)):
        return 0
    return None


def parse_calls(tools: str, text: str) -> list[ToolCall]:
    """The calls of a reply's tool-call part; [] when it is not well-formed (then it stays content)."""
    try:
        if tools == "hermes" and CALL_MARKERS["hermes"] in text:
            found = hermes_calls(text)
        elif tools == "mistral":
            found = json.loads(text.removeprefix(CALL_MARKERS["mistral"]))
        else:
            found = bare_calls(text)
    except json.JSONDecodeError:
        return []
    calls = []
    for call in found if isinstance(found, list) else []:
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def hermes_calls(text: str) -> list:
    """The JSON of each <tool_call>; a last one cut short (max_tokens) is left out."""
    found = []
    for body, end in HERMES_CALL.findall(text):
        try:
            found.append(json.loads(body))
        except json.JSONDecodeError:
            if end:
                raise
    return found


def bare_calls(text: str) -> list:
    """JSON objects separated by ";", the whole of text but for a <|python_tag|> or a ``` fence around them."""
    fenced = FENCE.fullmatch(text)
    rest = (fenced.group(1) if fenced else text).strip().removeprefix(CALL_MARKERS["llama3"])
    found, decoder = [], json.JSONDecoder()
    while rest := rest.strip().lstrip(";").strip():
        call, end = decoder.raw_decode(rest)
        found.append(call)
        rest = rest[end:]
    return found


def tool_call_grammar(tools: str, functions: list[dict], parallel: bool, token_to_id) -> str:
    """A Lark grammar (llguidance's, with %json schemas) of one call, or with parallel one or more, to any of
    functions (OpenAI's {"name", "parameters"}), in the template's format."""
    key = "parameters" if tools == "llama3" else "arguments"
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    if tools == "mistral":
        schema = {"type": "array", "items": schema, "minItems": 1} | ({} if parallel else {"maxItems": 1})
    call = json.dumps(schema | {"x-guidance": JSON_LAYOUT})
    if tools == "hermes":
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls}\ncall: "<tool_call>\\n" %json {call} "\\n</tool_call>"'
    if tools == "llama3":
        return f"start: %json {call}"
    token = token_to_id(CALL_MARKERS["mistral"])  # a special token in Mistral's tokenizers
    marker = json.dumps(CALL_MARKERS["mistral"]) if token is None else f"<[{token}]>"
    return f'start: {marker} " " %json {call}'
