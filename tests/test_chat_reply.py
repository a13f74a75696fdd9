"""chat_reply.py: tool calls and reasoning split out of replies in each family's documented format, the same whole
or streamed a character at a time."""

import json

import pytest

from chat_reply import ReplyFormat, reply_format, split_reply

HERMES = ReplyFormat("hermes", False)
LLAMA3 = ReplyFormat("llama3", False)
MISTRAL = ReplyFormat("mistral", False)
QWEN3 = ReplyFormat("hermes", True)

# (format, reply as the model writes it, reasoning, content, [(name, arguments)])
CASES = [
    # Qwen2.5 / Hermes: tags around {"name", "arguments"}, one call after another (Qwen's function-calling docs)
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "",
        "Let me check.\n",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    (HERMES, "No tool needed: 4.", "", "No tool needed: 4.", []),
    # Qwen2.5-Coder-1.5B-Instruct's own reply to a weather question, greedy (the call without its tags)
    (
        HERMES,
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n'
        '    "unit": "celsius"\n  }\n}\n```',
        "",
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (HERMES, "```python\nprint(1)\n```", "", "```python\nprint(1)\n```", []),
    (HERMES, "<tool_call>\n{not json}\n</tool_call>", "", "<tool_call>\n{not json}\n</tool_call>", []),
    # cut short by max_tokens: the whole calls stay, the last one is left out
    (
        HERMES,
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "f", "argu',
        "",
        "",
        [("f", {"x": 1})],
    ),
    # Llama 3.1: the JSON object is the whole reply, "parameters" (Meta's prompt-format docs), maybe <|python_tag|>
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", "", [("get_weather", {"city": "Oslo"})]),
    (
        LLAMA3,
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        "",
        "",
        [("a", {}), ("b", {"x": 1})],
    ),
    (LLAMA3, "The answer is {1, 2}.", "", "The answer is {1, 2}.", []),
    (LLAMA3, '{"answer": 42}', "", '{"answer": 42}', []),
    # Mistral: [TOOL_CALLS] then a JSON list (mistral-common's v3 format)
    (
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]',
        "",
        "",
        [("get_weather", {"city": "Rome", "unit": "celsius"})],
    ),
    # Qwen3: <think>...</think> then the answer, or a call
    (QWEN3, "<think>\nThe user wants Paris.\n</think>\n\nParis.", "The user wants Paris.\n", "Paris.", []),
    (
        QWEN3,
        '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "A tool.\n",
        "",
        [("f", {})],
    ),
]


@pytest.mark.parametrize("fmt, reply, reasoning, content, calls", CASES)
def test_replies_split_whole_and_streamed(fmt, reply, reasoning, content, calls):
    parts = split_reply(reply, fmt, tools=True, in_reasoning=False, final=True)
    assert (parts.reasoning, parts.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in parts.calls] == calls
    # Streamed: each part only grows, and what was shown before the end is what the whole reply shows.
    shown = ("", "")
    for end in range(1, len(reply)):
        partial = split_reply(reply[:end], fmt, tools=True, in_reasoning=False, final=False)
        assert partial.calls == []
        assert partial.reasoning.startswith(shown[0]) and partial.content.startswith(shown[1]), reply[:end]
        shown = partial.reasoning, partial.content
    assert parts.reasoning.startswith(shown[0]) and parts.content.startswith(shown[1])


def test_without_tools_a_call_is_content_and_an_opened_think_is_reasoning():
    reply = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert split_reply(reply, HERMES, tools=False, in_reasoning=False, final=True).content == reply
    parts = split_reply("still thinking", QWEN3, tools=False, in_reasoning=True, final=True)
    assert (parts.reasoning, parts.content) == ("still thinking", "")


def test_formats_are_read_from_the_templates_markers():
    assert reply_format("... <tool_call> ... <think> ...") == ReplyFormat("hermes", True)
    assert reply_format("{{ '[TOOL_CALLS]' }}") == ReplyFormat("mistral", False)
    assert reply_format("<|start_header_id|>{% if tools %}") == ReplyFormat("llama3", False)
    assert reply_format("{{ messages }}") == ReplyFormat(None, False)
    assert reply_format(None) == ReplyFormat(None, False)
