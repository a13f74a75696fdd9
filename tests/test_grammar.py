"""grammar.py's grammars, as llguidance applies them to a tokenizer's tokens: a constraint that follows a reasoning
part holds only after the first </think>."""

import json

from grammar import after_reasoning, grammar_error, grammar_vocabulary, json_grammar, new_matcher
from tokenizer import load_tokenizer


def accepts(matcher, tokens: list[int]) -> bool:
    return all(matcher.consume_token(t) for t in tokens)


def test_a_constraint_after_reasoning_applies_from_the_first_think_end(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    vocabulary = grammar_vocabulary(tiny_checkpoint / "tokenizer.json", 320, tokenizer.eos_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = after_reasoning(json_grammar(schema))
    assert grammar_error(grammar, vocabulary) == ""
    encode = lambda text: tokenizer.encode(text, bos=False)  # noqa: E731
    # JSON inside the reasoning is reasoning; the answer after the first </think> and a blank line is the JSON.
    matcher = new_matcher(grammar, vocabulary)
    assert accepts(matcher, encode('Maybe {"a": 1} or </th, no.</think>\n\n{"a": 5}'))
    assert matcher.is_accepting() and matcher.is_stopped()
    for wrong in ["Done.</think>\n\nnot JSON", 'Done.</think>\n\n{"a": 1}</think>', '{"a": 5}']:
        matcher = new_matcher(grammar, vocabulary)
        assert not (accepts(matcher, encode(wrong)) and matcher.is_accepting()), wrong
    assert json.loads(grammar)["grammars"][1]["json_schema"]["required"] == ["a"]
