"""Structured output through llguidance: the server's constrained requests (a JSON schema, any JSON object, a regex,
a choice of strings, a Lark or GBNF grammar) as llguidance grammars, and per choice a matcher whose allowed tokens
mask the row's logits in the sampler (SamplerState.allowed). docs/serving.md has the per-token cost measured.
"""

import json
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, grammar_from

# JSON as json.dumps writes it: one space after ":" and ",", and no other whitespace, which a weak model could
# otherwise repeat until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Free text up to the first </think> (the text ending with it, less those that go on past another), a blank line,
# then the grammar named answer: Qwen3's layout of a reply whose template opened <think>.
REASONING_FIRST = 'start: REASONING "\\n\\n" @answer\nREASONING: /(?s:.*)<\\/think>/ & ~/(?s:.*)<\\/think>(?s:.+)/'


def grammar_vocabulary(tokenizer_file: Path, vocab_size: int, eos_ids: list[int]) -> LLTokenizer:
    """The model's tokens as llguidance reads them, from the checkpoint's tokenizer.json; ids from the tokenizer's
    size up to the model's vocab_size (padding) are never allowed."""
    return LLTokenizer(tokenizer_file.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos_ids or None)


def json_grammar(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)


def regex_grammar(regex: str) -> str:
    return LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str]) -> str:
    return grammar_from("choice", choices)


def text_grammar(text: str) -> str:
    """A Lark grammar, or a GBNF one (llama.cpp's), which llguidance converts."""
    return grammar_from("grammar", text)


def after_reasoning(grammar: str) -> str:
    """grammar, for a reply that starts inside <think>: it applies once the reasoning has ended."""
    answer = json.loads(grammar)["grammars"] if grammar.startswith("{") else [{"lark_grammar": grammar}]
    answer[0]["name"] = "answer"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": REASONING_FIRST}] + answer})


def grammar_error(grammar: str, vocabulary: LLTokenizer) -> str:
    """What llguidance finds wrong with a grammar ("" when nothing): it names an unsupported schema keyword."""
    return LLMatcher.validate_grammar(grammar, vocabulary)


def new_matcher(grammar: str, vocabulary: LLTokenizer) -> LLMatcher:
    return LLMatcher(vocabulary, grammar, log_level=0)


def allowed_tokens(matcher: LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the matcher allows next, [vocab_size] bool (llguidance's bitmask, one bit a token)."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool))
