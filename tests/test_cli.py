"""generate.py as a user runs it: JSON output, streaming, and one clear message for each bad input."""
import json
import shutil
import subprocess
import sys

import pytest
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
    result = run_cli("--checkpoint_path", str(tiny_checkpoint / "model.pth"), "--prompt", "The quick brown",
                     "--max_new_tokens", "20", "--temperature", "0", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(tiny_checkpoint)
    expected = gen.generate(gen.load_model(tiny_checkpoint), tokenizer.encode("The quick brown"), 20).tokens[0]
    assert report["outputs"] == [tokenizer.decode(expected)]
    assert result.stdout.startswith("The quick brown" + report["outputs"][0])  # streamed before the figures
    stats = report["stats"]
    assert stats["prompt_tokens"] == [len(tokenizer.encode("The quick brown"))]
    assert stats["new_tokens"] == [20] and stats["decode_tokens_per_s"] > 0 and stats["peak_memory_gb"] > 0
    assert stats["bandwidth_gb_s"] == pytest.approx(stats["model_size_gb"] * stats["decode_tokens_per_s"], rel=1e-6)


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


def test_bad_input_gives_one_clear_message(tiny_checkpoint):
    result = run_cli("--checkpoint_path", str(tiny_checkpoint / "absent.pth"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: checkpoint not found: {tiny_checkpoint / 'absent.pth'}"


@pytest.fixture
def broken_checkpoints(tmp_path, tiny_checkpoint):
    def variant(name, change):
        folder = tmp_path / name
        shutil.copytree(tiny_checkpoint, folder)
        change(folder)
        return str(folder)

    def inconsistent(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "n_kv_heads": 3}))

    def wrong_shape(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dim": 32}))

    return {
        "no config": variant("no_config", lambda f: (f / "config.json").unlink()),
        "no tokenizer": variant("no_tokenizer", lambda f: (f / "tokenizer.json").unlink()),
        "inconsistent": variant("inconsistent", inconsistent),
        "wrong shape": variant("wrong_shape", wrong_shape),
    }


@pytest.mark.parametrize(
    "case,args,message",
    [
        ("no config", [], "config file not found"),
        ("no tokenizer", [], "no tokenizer.json or tokenizer.model"),
        ("inconsistent", [], "n_head 4 is not divisible by n_kv_heads 3"),
        ("wrong shape", [], "does not match"),
        (None, ["--prompt", "word " * 300], "exceeds the model's block_size"),
        (None, ["--temperature", "-1"], "temperature must be >= 0"),
        (None, ["--top_p", "0"], "top_p must be in (0, 1]"),
        (None, ["--top_p", "1.01"], "top_p must be in (0, 1]"),
        (None, ["--top_k", "-3"], "top_k must be >= 0"),
        (None, ["--device", "tpu"], "device"),
        (None, ["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nonsense"], "device"),
        (None, ["--dtype", "int3"], "invalid choice: 'int3'"),
        (None, ["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
        (None, ["--stop", ""], "a stop string is empty"),
        (None, ["--min_p", "1.5"], "min_p must be in [0, 1]"),
        (None, ["--repetition_penalty", "0"], "repetition_penalty must be > 0"),
        (None, ["--prompt", ""], "a prompt is empty"),
        (None, ["--prompts_file", "/nonexistent/prompts.txt"], "not found"),
    ],
)
def test_bad_input(capsys, tiny_checkpoint, broken_checkpoints, case, args, message):
    checkpoint = broken_checkpoints[case] if case else str(tiny_checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        gen.main(["--checkpoint_path", checkpoint, "--max_new_tokens", "4", *args])
    code = exit_info.value.code
    # argparse exits 2 and prints to stderr; our own errors exit with the message (status 1).
    text = code if isinstance(code, str) else capsys.readouterr().err
    assert code not in (0, None) and message in text, text
