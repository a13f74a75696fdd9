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
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args], input=stdin, capture_output=True, text=True, timeout=300
    )


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


def test_interactive_reads_a_pipe(tiny_checkpoint):
    result = run_cli("--checkpoint_path", str(tiny_checkpoint), "--interactive", "--max_new_tokens", "5",
                     "--temperature", "0", stdin="first prompt\n\nsecond prompt\n")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 1


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
