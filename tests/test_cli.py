"""generate.py as a user runs it: JSON output, batches from a file, streaming, a conversation on a pipe (bad input: test_bad_inputs.py)."""
import json
import subprocess
import sys
import time

import torch
from conftest import ROOT

import generate as gen
from tokenizer import load_tokenizer


def run_cli(*args, stdin=None):
    # Bytes, decoded here: text mode would turn a generated "\r" into "\n".
    result = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args], input=(stdin or "").encode(), capture_output=True, timeout=300
    )
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def test_json_output_equals_python_api(tiny_checkpoint):
    start = time.perf_counter()
    result = run_cli("--checkpoint_path", str(tiny_checkpoint / "model.pth"), "--prompt", "The quick brown",
                     "--max_new_tokens", "20", "--temperature", "0", "--json")  # fmt: skip
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(tiny_checkpoint)
    expected = gen.generate(gen.load_model(tiny_checkpoint), tokenizer.encode("The quick brown"), 20).tokens[0]
    assert report["outputs"] == [tokenizer.decode(expected)]
    assert result.stdout.startswith("The quick brown" + report["outputs"][0])  # streamed before the figures
    stats = report["stats"]
    assert stats["prompt_tokens"] == [len(tokenizer.encode("The quick brown"))]
    assert stats["new_tokens"] == [20] and stats["decode_tokens_per_s"] > 0 and stats["peak_memory_gb"] > 0
    # Against independent figures: the bytes a decode step reads are the checkpoint file's tensors but the (untied)
    # embedding table, of which it reads one row; the 19 decode steps took less than the whole run's wall time.
    state = torch.load(tiny_checkpoint / "model.pth", weights_only=True)
    read = sum(t.numel() * t.element_size() for name, t in state.items() if name != "tok_embeddings.weight")
    assert "output.weight" in state and round(stats["model_size_gb"] * 1e9) == read
    assert round(stats["bandwidth_gb_s"] * 1e9 / stats["decode_tokens_per_s"]) == read
    assert stats["decode_tokens_per_s"] > 19 / wall


def test_several_prompts_are_one_batch(tiny_checkpoint, tmp_path):
    (tmp_path / "prompts.txt").write_text("second one\n\nthird, a longer prompt\n")
    result = run_cli("--checkpoint_path", str(tiny_checkpoint), "--prompt", "first", "--prompts_file",
                     str(tmp_path / "prompts.txt"), "--max_new_tokens", "12", "--temperature", "0",
                     "--logprobs", "2", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(tiny_checkpoint)
    prompts = [tokenizer.encode(p) for p in ("first", "second one", "third, a longer prompt")]
    expected = gen.generate(gen.load_model(tiny_checkpoint), prompts, 12, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids)
    assert report["outputs"] == expected.texts
    assert report["stats"]["prompt_tokens"] == [len(p) for p in prompts]
    assert [[e["token"] for e in row] for row in report["logprobs"]] == expected.tokens


def test_interactive_conversation_from_a_pipe(tiny_checkpoint):
    turns = ["first message", "", "second message", "/reset", "third message"]
    result = run_cli("--checkpoint_path", str(tiny_checkpoint), "--interactive", "--max_new_tokens", "6",
                     "--temperature", "0", stdin="\n".join(turns) + "\n")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # Without a chat template the conversation is the messages joined by newlines; /reset forgets it.
    model, tokenizer = gen.load_model(tiny_checkpoint), load_tokenizer(tiny_checkpoint)

    def reply(text):
        return gen.generate(model, tokenizer.encode(text), 6, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids).texts[0]

    first = reply("first message")
    second = reply("first message\n" + first + "\nsecond message")
    assert result.stdout == first + "\n" + second + "\n" + reply("third message") + "\n"


def test_gpt2_continues_piped_text_and_converses(tmp_path, tiny_tokenizer_json):
    """As the seed's GPT-2 command-line tool: a prompt piped to stdin is continued (no chat template: plain text),
    and --interactive reads prompts until EOF."""
    from conftest import make_hf_llama
    from convert_hf_checkpoint import convert_hf_checkpoint
    from test_families import FAMILIES

    model_cls, config_cls, overrides = FAMILIES["gpt2"]
    make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, model_cls, config_cls, **overrides)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "gpt2")
    model, tokenizer = gen.load_model(tmp_path / "gpt2"), load_tokenizer(tmp_path / "gpt2")
    assert model.config.position_embedding == "learned" and tokenizer.chat_template is None

    def continuation(text, n):
        return gen.generate(model, tokenizer.encode(text), n, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids).texts[0]

    args = ("--checkpoint_path", str(tmp_path / "gpt2"), "--max_new_tokens", "10", "--temperature", "0")
    piped = run_cli(*args, stdin="The quick brown fox\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "The quick brown fox" + continuation("The quick brown fox", 10) + "\n"
    talk = run_cli(*args, "--interactive", stdin="The quick\ndef main():\n")
    assert talk.returncode == 0, talk.stderr
    first = continuation("The quick", 10)
    assert talk.stdout == first + "\n" + continuation("The quick\n" + first + "\ndef main():", 10) + "\n"
    bad = subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], input=b"caf\xe9\n", capture_output=True)
    assert bad.returncode != 0 and bad.stderr.decode().strip().splitlines() == ["error: stdin is not valid UTF-8 (byte 3)"]
