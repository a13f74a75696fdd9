"""generate.py as a user runs it: JSON output, batches from a file, streaming, a conversation on a pipe (bad input:
test_bad_inputs.py), the compiled code of the CPU capability in force; every script's --help."""

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import generate as gen
from conftest import ROOT, SMOLLM2_DIR, assert_same_greedy, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint
from test_families import FAMILIES
from tokenizer import load_tokenizer


def run_cli(*args, stdin=None, env=None):
    # Bytes, decoded here: text mode would turn a generated "\r" into "\n".
    command = [sys.executable, str(ROOT / "generate.py"), *args]
    result = subprocess.run(command, input=(stdin or "").encode(), capture_output=True, timeout=300, env=env)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


# Every script with a command line: its parse_args(argv)
CLI_MODULES = sorted(
    path.stem for path in [*ROOT.glob("*.py"), *ROOT.glob("scripts/*.py")] if "\ndef parse_args(" in path.read_text()
)


def test_every_command_line_is_listed():
    assert {"generate", "quantize", "eval", "server", "benchmark", "bench_server"} <= set(CLI_MODULES), CLI_MODULES


@pytest.mark.parametrize("name", CLI_MODULES)
def test_help_prints_every_flag(name, capsys):
    """--help prints the usage and each flag's help and exits 0. argparse formats help strings with %, so a literal
    percent sign that is not doubled ends --help in a traceback."""
    parse_args = importlib.import_module(name).parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage:") and "--help" in out


def test_json_output_equals_python_api(tiny_checkpoint):
    start = time.perf_counter()
    result = run_cli(
        "--checkpoint_path",
        str(tiny_checkpoint / "model.pth"),
        "--prompt",
        "The quick brown",
        "--max_new_tokens",
        "20",
        "--temperature",
        "0",
        "--json",
    )
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
    result = run_cli(
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--prompt",
        "first",
        "--prompts_file",
        str(tmp_path / "prompts.txt"),
        "--max_new_tokens",
        "12",
        "--temperature",
        "0",
        "--logprobs",
        "2",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(tiny_checkpoint)
    prompts = [tokenizer.encode(p) for p in ("first", "second one", "third, a longer prompt")]
    expected = gen.generate(
        gen.load_model(tiny_checkpoint), prompts, 12, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids
    )
    assert report["outputs"] == expected.texts
    assert report["stats"]["prompt_tokens"] == [len(p) for p in prompts]
    assert [[e["token"] for e in row] for row in report["logprobs"]] == expected.tokens


def test_one_shot_chat_with_prompt_lookup(tiny_checkpoint, tmp_path):
    """--chat answers --prompt as a user's message after --system's, in the checkpoint's chat template, and prints
    the answer alone; --ngram speculates by prompt lookup and gives plain decoding's greedy tokens."""
    folder = tmp_path / "chat"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    args = ("--checkpoint_path", str(folder), "--system", "Be brief.", "--prompt", "say it again and again")
    result = run_cli(*args, "--chat", "--ngram", "--max_new_tokens", "24", "--temperature", "0", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    model, tokenizer = gen.load_model(folder), load_tokenizer(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say it again and again"}]
    prompt = tokenizer.encode_chat(messages)
    assert tokenizer.decode(prompt).endswith("<user>say it again and again\n<a>")
    expected = gen.generate(model, prompt, 24, eos_ids=tokenizer.eos_ids).tokens[0]
    assert_same_greedy(model, prompt, report["tokens"][0], expected, 1e-4)
    assert result.stdout.startswith("[0] " + report["outputs"][0])  # the answer, without the prompt
    speculation = report["stats"]["speculation"]
    assert speculation["draft"] == "prompt lookup" and sum(speculation["depth_histogram"]) > 0


def test_interactive_conversation_from_a_pipe(tiny_checkpoint):
    turns = ["first message", "", "second message", "/reset", "third message"]
    result = run_cli(
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--interactive",
        "--max_new_tokens",
        "6",
        "--temperature",
        "0",
        stdin="\n".join(turns) + "\n",
    )
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
    assert bad.returncode != 0 and bad.stderr.decode().strip().splitlines() == [
        "error: stdin is not valid UTF-8 (byte 3)"
    ]


AVX2_PATHS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX512_CPU = "avx512f" in Path("/proc/cpuinfo").read_text()


@pytest.mark.skipif(not AVX512_CPU, reason="needs an AVX-512 CPU (no avx512f in /proc/cpuinfo)")
def test_compiled_code_follows_the_cpu_capability(tiny_checkpoint, tmp_path):
    """A user who compiles on an AVX-512 CPU, then runs with ATEN_CPU_CAPABILITY=avx2 and the same
    TORCHINDUCTOR_CACHE_DIR, gets the greedy tokens of eager again: inductor's cache key leaves out the vector
    ISA, and code written for 16 floats a vector run as AVX2's 8 computes garbage (or reads out of bounds)."""
    inherited = {k: v for k, v in os.environ.items() if k not in AVX2_PATHS and k != "TORCHINDUCTOR_CACHE_DIR"}
    prompt = "The quick brown"
    args = ["--checkpoint_path", str(tiny_checkpoint), "--prompt", prompt, "--max_new_tokens", "40"]
    args += ["--temperature", "0", "--compile", "--json"]
    reports = {}
    for capability, paths in (("AVX512", {}), ("AVX2", AVX2_PATHS)):  # the second finds the first one's cache warm
        result = run_cli(*args, env=inherited | paths | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr
        reports[capability] = json.loads(result.stdout.strip().splitlines()[-1])
        assert reports[capability]["stats"]["inductor_cache_dir"] == str(tmp_path.resolve() / capability)
    model = gen.load_model(tiny_checkpoint)
    ids = load_tokenizer(tiny_checkpoint).encode(prompt)
    expected = gen.generate(model, ids, 40).tokens[0]
    for report in reports.values():  # compiled and eager may part only at a near-tie, as in test_compile.py
        assert_same_greedy(model, ids, report["tokens"][0], expected, margin=1e-4)


def test_passkey_prompts_hide_the_key_where_asked_and_the_model_finds_it(capsys):
    """scripts/passkey.py: a prompt of at most the length asked for, short of it by less than two filler sentences,
    holding its key twice, the needle at the depth asked for (within a sentence); the default model answers a
    256-token case with its key."""
    from passkey import FILLER, NEEDLE, main, passkey_prompt

    tokenizer = load_tokenizer(SMOLLM2_DIR)
    sentence = len(tokenizer.encode(FILLER))
    for length in (300, 1000):
        for depth in (0.1, 0.9):
            prompt = passkey_prompt(tokenizer, length, depth, 12345)
            text = tokenizer.decode(prompt)
            assert length - 2 * sentence < len(prompt) <= length and text.count("12345") == 2
            needle, fillers = text.index(NEEDLE.format(key=12345)), text.count(FILLER)
            assert abs(text[:needle].count(FILLER) / fillers - depth) <= 1 / fillers
    main(["--lengths", "256", "--depths", "0.5"])
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 3 and rows[2].split("|")[5].strip() == "True", rows
