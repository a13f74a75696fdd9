"""Tensor parallelism under torchrun (gloo on CPU): the sharded model computes what one process computes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tp
import tp_worker
from config import ModelArgs
from conftest import ROOT, SMOLLM2_DIR, assert_same_greedy, make_hf_llama
from generate import load_model
from quantize import quantize_checkpoint
from tokenizer import load_tokenizer

# OMP_NUM_THREADS: torchrun's own default, said here to keep it quiet. PYTHONFAULTHANDLER: a rank that aborts
# prints every thread's Python stack (see tp.end_rank).
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
# Sharded and whole float32 logits differ by rounding (partial sums added in another order): ~1e-6 for the tiny
# model, ~1e-5 for SmolLM2 (the real models); a wrong split (a head, a bias, a slice of the vocabulary) moves them
# by more than 1e-1.
TINY_MARGIN, REAL_MARGIN = 1e-4, 1e-3


def torchrun_command(nproc: int, script, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def torchrun(nproc: int, script, *args, stdin=None):
    command = torchrun_command(nproc, script, *args)
    return subprocess.run(command, env=ENV, input=stdin, capture_output=True, text=True, timeout=300)


def assert_same_greedy_texts(checkpoint, prompts: list[str], got, expected, margin):
    """assert_same_greedy for the rows of a command-line run (prompts as text)."""
    model, tokenizer = load_model(checkpoint), load_tokenizer(checkpoint)
    for text, row_got, row_expected in zip(prompts, got, expected, strict=True):
        assert_same_greedy(model, tokenizer.encode(text), row_got, row_expected, margin)


def generate_tokens(nproc: int, *args) -> list[list[int]]:
    args = ("--temperature", "0", "--json", *args)
    if nproc == 1:
        result = subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True, text=True)
    else:
        result = torchrun(nproc, ROOT / "generate.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens"]


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory, tiny_tokenizer_json):
    """A tiny model with every feature the splits must handle: GQA, q/k/v/o biases, tied embeddings, and
    sizes that allow int4 groups of 32 and kernels_cpu.cpp's int4 blocks of 64 on 2 ranks (each rank's share of a
    row-parallel layer's inputs: 64); with its int8 and int4 versions."""
    from convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir = tmp_path_factory.mktemp("hf_tp")
    make_hf_llama(
        hf_dir,
        tiny_tokenizer_json,
        hidden_size=128,
        num_key_value_heads=2,
        intermediate_size=128,
        attention_bias=True,
        tie_word_embeddings=True,
        seed=3,
    )
    out = tmp_path_factory.mktemp("tp") / "tiny"
    convert_hf_checkpoint(hf_dir, out)
    quantize_checkpoint(out / "model.pth", "int8")
    quantize_checkpoint(out / "model.pth", "int4", groupsize=32)
    return out


@pytest.mark.numerics
@pytest.mark.parametrize(
    "name, compiled, native",
    [
        ("model.pth", False, False),
        ("model_int8.pth", True, False),
        ("model_int4.g32.pth", False, False),
        ("model_int8.pth", True, True),  # kernels_cpu.cpp, compiled
        ("model_int4.g32.pth", False, True),
    ],
)
def test_sharded_model_equals_one_process(request, tp_checkpoint, tmp_path, name, compiled, native):
    if native:
        request.getfixturevalue("native_ops")  # built, or skipped (failed under CI=true)
    kernels = tp_worker.native() if native else tp_worker.EXACT
    expected = tp_worker.logits_and_tokens(tp_checkpoint / name, compiled=compiled, kernels=kernels)
    out = tmp_path / "result.pt"
    flags = ["compile"] * compiled + ["native"] * native
    result = torchrun(2, ROOT / "tests" / "tp_worker.py", str(tp_checkpoint / name), str(out), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert got["logits"].shape == expected["logits"].shape == (2, 9, 320)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # padding queries: their outputs are never used
    per_position = (got["logits"] - expected["logits"])[valid].abs().amax(-1)
    if native:
        # kernels_cpu.cpp quantizes each block of a layer's input to int8 codes: the all-reduce's other order of
        # sums (~1e-6) can move a value across a code's rounding boundary, and a flipped code moves that block's
        # product by a code step (~1e-2 on these logits). Such flips are rare; a wrong split moves every position.
        assert (per_position < 1e-4).float().mean() >= 0.75 and per_position.max() < 0.05, per_position
    else:
        assert per_position.max() < 1e-4
    # Two different prompts in one batch: every row is all-reduced, not only the first.
    assert expected["tokens"][0] != expected["tokens"][1]
    model = load_model(tp_checkpoint / name, kernels=tp_worker.EXACT)
    for prompt, row_got, row_expected in zip(tp_worker.PROMPTS, got["tokens"], expected["tokens"], strict=True):
        assert_same_greedy(model, prompt, row_got, row_expected, TINY_MARGIN)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "family, name", [("qwen3", "model.pth"), ("mixtral", "model.pth"), ("mixtral", "model_int8.pth")]
)
def test_sharded_family_equals_one_process(tmp_path, tiny_tokenizer_json, family, name):
    """A GQA family with per-head q/k norms, and a mixture of experts (each expert split over the ranks)."""
    from convert_hf_checkpoint import convert_hf_checkpoint
    from test_families import FAMILIES

    model_cls, config_cls, overrides = FAMILIES[family]
    make_hf_llama(tmp_path / "hf", tiny_tokenizer_json, model_cls, config_cls, norm_noise=0.1, **overrides)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    if name != "model.pth":
        quantize_checkpoint(tmp_path / "ours" / "model.pth", "int8")
    expected = tp_worker.logits_and_tokens(tmp_path / "ours" / name)
    result = torchrun(2, ROOT / "tests" / "tp_worker.py", str(tmp_path / "ours" / name), str(tmp_path / "result.pt"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(tmp_path / "result.pt", weights_only=True)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # padding queries: their outputs are never used
    assert (got["logits"] - expected["logits"])[valid].abs().max() < TINY_MARGIN
    model = load_model(tmp_path / "ours" / name, kernels=tp_worker.EXACT)
    for prompt, row_got, row_expected in zip(tp_worker.PROMPTS, got["tokens"], expected["tokens"], strict=True):
        assert_same_greedy(model, prompt, row_got, row_expected, TINY_MARGIN)


# An int8 KV cache rounds each key and value to a code: the sharded run's other order of sums (~1e-6) can move one
# across a code's boundary, a step of 1/127 of its head's largest value in one of the entries a query averages,
# so a parting is allowed where logits are within 1e-2; a rank's heads quantized with another rank's scales, or
# codes read as float, move them by O(1).
@pytest.mark.numerics
@pytest.mark.parametrize("cache_flags, margin", [((), TINY_MARGIN), (("--kv_cache_dtype", "int8"), 1e-2)])
def test_cli_batch_under_tp(tp_checkpoint, cache_flags, margin):
    """A batch of two prompts on two ranks, with the model's KV cache or an int8 one (each rank quantizing its
    own KV heads): the greedy text of one process with the same cache."""
    args = (
        "--checkpoint_path",
        str(tp_checkpoint),
        "--prompt",
        "The quick brown",
        "--prompt",
        "def main():",
        "--max_new_tokens",
        "24",
        *cache_flags,
    )
    expected = generate_tokens(1, *args)
    assert_same_greedy_texts(
        tp_checkpoint, ["The quick brown", "def main():"], generate_tokens(2, *args), expected, margin
    )


def test_seeded_sampling_and_speculative_decoding_under_tp(tp_checkpoint):
    sampled = ("--checkpoint_path", str(tp_checkpoint), "--max_new_tokens", "24", "--seed", "7")
    expected = generate_tokens(1, *sampled, "--temperature", "1.0")
    # The ranks draw with rank 0's seed. (Rounding of the sharded logits, ~1e-6, could change a draw only where
    # the two best ratios p / E are that close: about 5e-7 a draw, see test_compile.)
    assert generate_tokens(2, *sampled, "--temperature", "1.0") == expected  # the last --temperature wins
    # Target and draft both sharded; greedy speculation gives the target's own greedy tokens.
    args = ("--checkpoint_path", str(tp_checkpoint), "--max_new_tokens", "24", "--prompt", "Hello")
    plain = generate_tokens(1, *args)
    speculative = generate_tokens(2, *args, "--draft_checkpoint_path", str(tp_checkpoint / "model_int4.g32.pth"))
    assert_same_greedy_texts(tp_checkpoint, ["Hello"], speculative, plain, TINY_MARGIN)


def test_interactive_under_tp(tp_checkpoint):
    args = ["--checkpoint_path", str(tp_checkpoint), "--interactive", "--temperature", "0", "--max_new_tokens", "12"]
    single = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args], input="Hello\nThe quick\n", capture_output=True, text=True
    )
    sharded = torchrun(2, ROOT / "generate.py", *args, stdin="Hello\nThe quick\n")
    assert single.returncode == sharded.returncode == 0, sharded.stderr[-3000:]
    # The same greedy replies, compared as text: rounding (~1e-6) could part them only where two logits are that
    # close, a chance under 1e-5 over these 24 steps of the tiny model.
    assert sharded.stdout == single.stdout and single.stdout.count("\n") == 2  # one reply a line sent


def test_world_size_that_does_not_divide_the_model(tp_checkpoint):
    result = torchrun(3, ROOT / "generate.py", "--checkpoint_path", str(tp_checkpoint))  # 4 heads, 2 KV heads
    assert result.returncode != 0
    assert result.stderr.count("error: cannot split this model over 3 ranks") == 1  # rank 0 speaks, alone
    assert "n_head = 4 is not a multiple of 3" in result.stderr and "Traceback" not in result.stderr.split("error:")[0]


@pytest.mark.parametrize(
    "overrides, quantization, message",
    [
        (dict(n_head=6, n_kv_heads=6), None, "n_head = 6 is not a multiple of 4"),
        (dict(intermediate_size=102), None, "intermediate_size = 102 is not a multiple of 4"),
        (dict(intermediate_size=384), {"mode": "int4", "groupsize": 64}, "w2 would get 96 inputs a rank"),
        (dict(n_head=8, n_kv_heads=4, head_dim=8), {"mode": "int4", "groupsize": 32}, "wo would get 16 inputs"),
    ],
)
def test_check_divisible_refuses_uneven_splits(overrides, quantization, message):
    base = dict(dim=128, n_layer=1, n_head=8, n_kv_heads=8, head_dim=16, intermediate_size=256, vocab_size=320)
    tp.check_divisible(ModelArgs(**base), 4, {"mode": "int4", "groupsize": 32})  # the base splits evenly
    with pytest.raises(ValueError, match=message):
        tp.check_divisible(ModelArgs(**{**base, **overrides}), 4, quantization)


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """The worker processes torchrun started, by their RANK."""
    pids = {}
    for child in open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read().split():
        environ = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        pids[int(next(e for e in environ if e.startswith(b"RANK="))[5:])] = int(child)
    return pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_rank_ends_the_job(tp_checkpoint, sig):
    # SIGKILL: torchrun sees the death; SIGSTOP: only the process-group timeout can end the wait.
    command = torchrun_command(
        2,
        ROOT / "generate.py",
        "--checkpoint_path",
        str(tp_checkpoint),
        "--num_samples",
        "100000",
        "--max_new_tokens",
        "100",
        "--tp_timeout_s",
        "5",
    )
    job = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = {}
    try:
        job.stdout.readline()  # rank 0 is generating
        pids = rank_pids(job.pid)
        start = time.monotonic()
        os.kill(pids[1], sig)
        _, stderr = job.communicate(timeout=60)
        assert job.returncode != 0 and time.monotonic() - start < 60
        if sig == signal.SIGSTOP:
            assert "error: rank 0 stopped:" in stderr and "Timed out" in stderr
    finally:
        for pid in (job.pid, *pids.values()):  # nothing is left behind, stopped or not, if the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.numerics
@pytest.mark.skipif(not (SMOLLM2_DIR / "model.pth").is_file(), reason="run scripts/prepare.sh first")
def test_smollm2_on_three_ranks():
    # 9 heads and 3 KV heads: 3 q heads and 1 KV head a rank; the 49152-token vocabulary splits in 3.
    args = ("--checkpoint_path", str(SMOLLM2_DIR), "--prompt", "The capital of France is", "--max_new_tokens", "24")
    expected = generate_tokens(1, *args)
    assert_same_greedy_texts(
        SMOLLM2_DIR, ["The capital of France is"], generate_tokens(3, *args), expected, REAL_MARGIN
    )


QWEN_05B = ROOT / "checkpoints" / "Qwen2.5-Coder-0.5B-Instruct"


@pytest.mark.numerics
@pytest.mark.skipif(not (QWEN_05B / "model.pth").is_file(), reason="run scripts/prepare.sh --model qwen2.5-coder-0.5b")
def test_qwen2_5_coder_on_two_ranks():
    # 14 heads and 2 KV heads: 7 q heads and 1 KV head a rank, q/k/v biases split with them; a batch of two prompts.
    prompts = ["def quicksort(arr):", "The capital of France is"]
    args = (
        "--checkpoint_path",
        str(QWEN_05B),
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--max_new_tokens",
        "24",
    )
    expected = generate_tokens(1, *args)
    assert_same_greedy_texts(QWEN_05B, prompts, generate_tokens(2, *args), expected, REAL_MARGIN)
