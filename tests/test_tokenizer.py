"""Each tokenizer format against its reference library, built on the spot; the chat template against transformers."""

import base64

import pytest

from conftest import SAMPLE_TEXT, SMOLLM2_DIR
from tokenizer import LLAMA3_PATTERN, load_tokenizer

TEXTS = [SAMPLE_TEXT, "  leading spaces and\ttabs\n\nnew lines  ", "🙂", "x"]


def test_sentencepiece(tmp_path):
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text(SAMPLE_TEXT * 30)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=340,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=0.98,  # rare characters go through byte pieces
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,  # as Llama 2's tokenizer
    )
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    assert tok.bos_id == reference.bos_id() and tok.eos_ids == [reference.eos_id()]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [reference.bos_id()] + reference.encode(text)
        assert tok.decode(ids[1:]) == reference.decode(reference.encode(text))
        assert (
            tok.decode(ids[1:]) == text
        )  # identity normalization: whitespace, newlines and tabs come back as they were
    assert tok.encode("abc", bos=False) == reference.encode("abc")


def test_tiktoken(tmp_path):
    import tiktoken
    from tiktoken._educational import bpe_train

    ranks = bpe_train(SAMPLE_TEXT * 5, vocab_size=300, pat_str=LLAMA3_PATTERN, visualise=None)
    lines = [
        f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    reference = tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    tok = load_tokenizer(tmp_path)
    n = len(ranks)
    assert tok.bos_id == n  # <|begin_of_text|> follows the merges
    assert tok.eos_ids == [n + 1, n + 9]  # <|end_of_text|>, <|eot_id|>
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [n] + reference.encode(text)
        assert tok.decode(ids[1:]) == text
    assert tok.encode("<|start_header_id|>user<|end_header_id|>", bos=False) == [n + 6] + reference.encode("user") + [
        n + 7
    ]


@pytest.fixture(scope="module")
def smollm2_reference():
    from transformers import AutoTokenizer

    assert (SMOLLM2_DIR / "tokenizer.json").is_file(), "run: bash scripts/prepare.sh"
    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))


def test_hf_tokenizer_json(smollm2_reference):
    tok = load_tokenizer(SMOLLM2_DIR)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == smollm2_reference(text).input_ids
        assert tok.decode(ids) == smollm2_reference.decode(ids) == text
    assert tok.eos_ids == [smollm2_reference.eos_token_id]


def test_chat_template_matches_transformers(smollm2_reference):
    tok = load_tokenizer(SMOLLM2_DIR)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi 🙂"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Ça va ?"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = smollm2_reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert tok.apply_chat_template(messages, add_generation_prompt) == expected
        expected_ids = smollm2_reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected_ids = (
            expected_ids["input_ids"]
            if isinstance(expected_ids, dict) or hasattr(expected_ids, "keys")
            else expected_ids
        )
        assert tok.encode_chat(messages) == list(expected_ids)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="neither a SentencePiece model nor a tiktoken"):
        load_tokenizer(tmp_path)
