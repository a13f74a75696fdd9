"""Bad input to every script, as a careless or hostile user gives it.

Each case must end with a non-zero exit, no traceback, exactly one error line that names the offending
file or flag, and no file left behind. Most cases call the script's main() in this process (the same
code path as the command line, minus the interpreter's start-up); those that need a real process (bytes
in argv, Ctrl-C, a file size limit) run one.
"""

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys

import gguf
import pytest
import torch

import eval as evaluate
import generate
import quantize
import server
from benchmark import main as benchmark_main
from conftest import ROOT, make_hf_llama, write_gguf
from convert_gguf import main as convert_gguf_main
from convert_hf_checkpoint import main as convert_hf_main
from tokenizer import load_tokenizer

# Every case starts from these arguments; a case's own come after them, and argparse keeps the last value.
BASE_ARGS = {
    "generate": ["--checkpoint_path", "{tmp}/ckpt", "--max_new_tokens", "4", "--temperature", "0"],
    "quantize": ["--checkpoint_path", "{tmp}/ckpt/model.pth", "--mode", "int8"],
    "eval": ["--checkpoint_path", "{tmp}/ckpt", "--window", "64"],
    "benchmark": [
        "--checkpoint_path",
        "{tmp}/ckpt",
        "--configs",
        "eager:float32",
        "--rounds",
        "1",
        "--prompt_length",
        "4",
        "--new_tokens",
        "2",
    ],
    "convert_hf": ["--checkpoint_dir", "{tmp}/hf", "--out_dir", "{tmp}/out"],
    "convert_gguf": ["--gguf", "{tmp}/m.gguf", "--out_dir", "{tmp}/out"],
    "server": ["--checkpoint_path", "{tmp}/ckpt", "--port", "8199"],
}
MAINS = {
    "generate": generate.main,
    "quantize": quantize.main,
    "eval": evaluate.main,
    "benchmark": benchmark_main,
    "convert_hf": convert_hf_main,
    "convert_gguf": convert_gguf_main,
    "server": server.main,
}


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def write(name: str, content):
    """A setup that writes content (bytes, text, or an object as JSON) to tmp/name."""

    def setup(tmp):
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))

    return setup


def save(name: str, obj):
    return lambda tmp: torch.save(obj, tmp / name)


def edit_json(name: str, **changes):
    def setup(tmp):
        data = json.loads((tmp / name).read_text())
        data.update(changes)
        (tmp / name).write_text(json.dumps(data))

    return setup


def remove_key(name: str, key: str):
    def setup(tmp):
        data = json.loads((tmp / name).read_text())
        del data[key]
        (tmp / name).write_text(json.dumps(data))

    return setup


def truncate(name: str, keep: int):
    def setup(tmp):
        data = (tmp / name).read_bytes()
        (tmp / name).write_bytes(data[:keep])

    return setup


def quantized_with(fmt):
    """A quantized checkpoint whose recorded format is fmt."""

    def setup(tmp):
        tensors = torch.load(tmp / "ckpt" / "model.pth", weights_only=True)
        torch.save({"quantization": fmt, "state_dict": tensors}, tmp / "ckpt" / "model.pth")

    return setup


def gguf_without(tensors=False, metadata_key=None, arch="llama"):
    """The tiny model as a GGUF file with its tensors (all of them) or one metadata key left out."""

    def setup(tmp):
        model = generate.load_model(tmp / "ckpt")
        write_gguf(
            tmp / "m.gguf",
            {} if tensors else model.state_dict(),
            model.config,
            gguf.GGMLQuantizationType.F32,
            arch=arch,
            skip_keys={metadata_key},
        )

    return setup


def index_with_missing_shard(tmp):
    (tmp / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "absent.safetensors"}})
    )


RANDOM = bytes(range(256)) * 3
CASES = [
    # server.py: the KV cache's budget (the tiny model's keys and values take 512 bytes a position, 256 positions)
    ("server", None, ["--kv_cache_memory", "0"], "--kv_cache_memory"),
    ("server", None, ["--kv_cache_memory", "nan"], "--kv_cache_memory"),
    ("server", None, ["--kv_cache_memory", "0.000001"], "--kv_cache_memory"),  # 2 positions: no room for a reply
    ("server", None, ["--kv_cache_memory", "0.0000001"], "--kv_cache_memory"),  # not one position
    ("server", None, ["--kv_cache_memory", "1", "--max_batch_size", "100000", "--max_seq_length", "256"], "budget"),
    ("server", None, ["--kv_cache_memory", "10000", "--max_batch_size", "10000000"], "free"),
    ("server", None, ["--max_batch_size", "0"], "--max_batch_size"),
    ("server", None, ["--max_seq_length", "1"], "--max_seq_length"),
    ("server", None, ["--prefill_chunk_while_decoding", "0"], "--prefill_chunk_while_decoding"),
    ("server", None, ["--http_nice", "20"], "--http_nice"),
    ("server", None, ["--http_nice", "-1"], "--http_nice"),  # a raised priority needs privileges
    # generate.py: the checkpoint folder's files
    ("generate", write("ckpt/config.json", "null"), [], "config.json"),
    ("generate", edit_json("ckpt/config.json", rope_base="abc"), [], "rope_base"),
    ("generate", edit_json("ckpt/config.json", norm_eps=-1), [], "norm_eps"),
    (
        "generate",
        write(
            "ckpt/config.json",
            '{"dim": 64, "n_layer": 2, "n_head": 4, "intermediate_size": 96, "vocab_size": 320, "norm_eps": NaN}',
        ),
        [],
        "norm_eps",
    ),
    ("generate", edit_json("ckpt/config.json", dim=64.5), [], "dim"),
    ("generate", edit_json("ckpt/config.json", n_layer=True), [], "n_layer"),
    ("generate", edit_json("ckpt/config.json", rope_scaling={"rope_type": "llama3", "factor": 8}), [], "rope_scaling"),
    ("generate", write("ckpt/config.json", b"\xff\xfe{}"), [], "config.json"),
    ("generate", save("ckpt/model.pth", torch.zeros(3)), [], "model.pth"),
    ("generate", write("ckpt/model.pth", RANDOM), [], "model.pth"),
    ("generate", write("ckpt/model.pth", b""), [], "model.pth"),
    ("generate", save("ckpt/model.pth", {"tok_embeddings.weight": 1}), [], "model.pth"),
    ("generate", write("ckpt/model.pth", pickle.dumps({"tok_embeddings.weight": Exploit()})), [], "model.pth"),
    (
        "generate",
        save("ckpt/model.pth", {"tok_embeddings.weight": Exploit()}),
        [],
        "posix.system",
    ),  # torch.save's format
    ("generate", quantized_with("int8"), [], "model.pth"),
    ("generate", quantized_with({"version": 1, "mode": "int2"}), [], "model.pth"),
    ("generate", write("ckpt/tokenizer.json", RANDOM), [], "tokenizer.json"),
    ("generate", write("ckpt/tokenizer_config.json", "{not json"), [], "tokenizer_config.json"),
    ("generate", write("ckpt/generation_config.json", {"eos_token_id": "</s>"}), [], "generation_config.json"),
    (
        "generate",
        write("ckpt/chat_template.jinja", "{% for m in messages %}{{ m.content }"),
        ["--interactive"],
        "chat_template.jinja",
    ),
    ("generate", lambda tmp: (tmp / "ckpt" / "config.json").unlink(), [], "config.json"),
    ("generate", lambda tmp: (tmp / "ckpt" / "tokenizer.json").unlink(), [], "tokenizer.json or tokenizer.model"),
    ("generate", edit_json("ckpt/config.json", n_kv_heads=3), [], "n_kv_heads"),
    ("generate", edit_json("ckpt/config.json", dim=32), [], "does not match"),
    ("generate", None, ["--checkpoint_path", "{tmp}/m.gguf"], "m.gguf"),
    ("generate", None, ["--checkpoint_path", "{tmp}"], "model.pth"),
    ("generate", None, ["--draft_checkpoint_path", "{tmp}/absent"], "absent"),
    # generate.py: flags
    ("generate", None, ["--temperature", "nan"], "temperature"),
    ("generate", None, ["--temperature", "-1"], "temperature"),
    ("generate", None, ["--top_p", "0"], "top_p"),
    ("generate", None, ["--top_p", "1.01"], "top_p"),
    ("generate", None, ["--top_k", "-3"], "top_k"),
    ("generate", None, ["--min_p", "1.5"], "min_p"),
    ("generate", None, ["--repetition_penalty", "0"], "repetition_penalty"),
    ("generate", None, ["--repetition_penalty", "nan"], "repetition_penalty"),
    ("generate", None, ["--presence_penalty", "inf"], "presence_penalty"),
    ("generate", None, ["--top_p", "nan"], "top_p"),
    ("generate", None, ["--logprobs", "100000"], "logprobs"),
    ("generate", None, ["--logprobs", "-1"], "logprobs"),
    ("generate", None, ["--seed", str(2**70)], "seed"),
    ("generate", None, ["--seed", "-1"], "seed"),
    ("generate", None, ["--device", "tpu"], "--device"),
    ("generate", None, ["--device", "cuda:7"], "--device"),
    ("generate", None, ["--dtype", "int3"], "--dtype"),
    ("generate", None, ["--profile", "{tmp}/no/such/folder/trace.json"], "--profile"),
    ("generate", None, ["--interactive", "--max_new_tokens", "9000"], "max_new_tokens"),
    ("generate", None, ["--max_new_tokens", "0"], "--max_new_tokens"),
    ("generate", None, ["--batch_size", str(10**9)], "KV cache"),
    ("generate", None, ["--prompt", "word " * 300], "block_size"),
    ("generate", None, ["--prompt", ""], "prompt"),
    ("generate", None, ["--prompt", "caf\udce9"], "--prompt"),  # a Latin-1 byte in argv, as Python decodes it
    ("generate", None, ["--stop", "\udcff"], "--stop"),
    ("generate", None, ["--stop", ""], "stop"),
    ("generate", None, ["--tp_timeout_s", "nan"], "--tp_timeout_s"),
    ("generate", write("prompts.txt", b"caf\xe9\n"), ["--prompts_file", "{tmp}/prompts.txt"], "prompts.txt"),
    ("generate", None, ["--prompts_file", "{tmp}/ckpt"], "--prompts_file"),
    ("generate", None, ["--prompts_file", "{tmp}/absent.txt"], "absent.txt"),
    ("generate", None, ["--num_samples", "0"], "--num_samples"),
    ("generate", None, ["--chat"], "chat template"),
    ("generate", None, ["--chat", "--interactive"], "--interactive"),
    ("generate", None, ["--ngram", "--draft_checkpoint_path", "{tmp}/ckpt"], "--ngram"),
    ("generate", None, ["--ngram", "--batch_size", "2"], "one prompt"),
    # quantize.py
    ("quantize", None, ["--checkpoint_path", "{tmp}/absent.pth"], "absent.pth"),
    ("quantize", save("ckpt/model.pth", torch.zeros(3)), [], "model.pth"),
    (
        "quantize",
        lambda tmp: quantize.quantize_checkpoint(tmp / "ckpt" / "model.pth", "int8"),
        ["--checkpoint_path", "{tmp}/ckpt/model_int8.pth", "--mode", "int4"],
        "already quantized",
    ),
    ("quantize", write("ckpt/config.json", "null"), [], "config.json"),
    ("quantize", None, ["--mode", "int3"], "--mode"),
    ("quantize", None, ["--mode", "int4", "--groupsize", "48"], "groupsize"),
    ("quantize", None, ["--mode", "int4", "--groupsize", "64"], "groupsize"),
    ("quantize", None, ["--mode", "int4-gptq", "--calibration_file", "{tmp}/absent.txt"], "absent.txt"),
    (
        "quantize",
        write("calib.txt", b"\x80abc"),
        ["--mode", "int4-gptq", "--calibration_file", "{tmp}/calib.txt"],
        "calib.txt",
    ),
    (
        "quantize",
        write("calib.txt", "too short"),
        ["--mode", "int4-gptq", "--calibration_file", "{tmp}/calib.txt"],
        "calibration",
    ),
    ("quantize", None, ["--mode", "int4-gptq", "--calibration_samples", "0"], "--calibration_samples"),
    # eval.py
    ("eval", None, ["--device", "tpu"], "--device"),
    ("eval", None, ["--device", "cuda"], "--device"),
    ("eval", None, ["--text_file", "{tmp}/absent.txt"], "absent.txt"),
    ("eval", write("t.txt", b"\xff" * 10), ["--text_file", "{tmp}/t.txt"], "t.txt"),
    ("eval", write("t.txt", ""), ["--text_file", "{tmp}/t.txt"], "t.txt"),
    ("eval", None, ["--checkpoint_path", "{tmp}/absent"], "absent"),
    ("eval", None, ["--stride", "0"], "--stride"),
    ("eval", None, ["--window", "64", "--stride", "64"], "--stride"),
    # scripts/convert_hf_checkpoint.py
    ("convert_hf", None, ["--checkpoint_dir", "{tmp}/absent"], "absent"),
    ("convert_hf", remove_key("hf/config.json", "hidden_size"), [], "hidden_size"),
    ("convert_hf", write("hf/config.json", "{"), [], "config.json"),
    ("convert_hf", write("hf/config.json", "null"), [], "config.json"),
    ("convert_hf", edit_json("hf/config.json", model_type="bert"), [], "model_type"),
    ("convert_hf", edit_json("hf/config.json", num_attention_heads=0), [], "config.json"),
    ("convert_hf", edit_json("hf/config.json", rope_parameters={"rope_type": "yarn", "factor": -4.0}), [], "factor"),
    ("convert_hf", edit_json("hf/config.json", rope_parameters={"rope_type": "yarn", "mscale": 0.7}), [], "mscale"),
    ("convert_hf", edit_json("hf/config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0}), [], "dynamic"),
    ("convert_hf", edit_json("hf/config.json", hidden_act="relu"), [], "relu"),
    ("convert_hf", truncate("hf/model.safetensors", 1000), [], "model.safetensors"),
    ("convert_hf", write("hf/model.safetensors", RANDOM), [], "model.safetensors"),
    ("convert_hf", index_with_missing_shard, [], "absent.safetensors"),
    ("convert_hf", write("hf/tokenizer.json", RANDOM), ["--out_dir", "{tmp}/ckpt"], "tokenizer"),
    # scripts/convert_gguf.py
    ("convert_gguf", None, ["--gguf", "{tmp}/absent.gguf"], "absent.gguf"),
    ("convert_gguf", write("m.gguf", RANDOM), [], "m.gguf"),
    ("convert_gguf", gguf_without(tensors=True), [], "token_embd"),
    ("convert_gguf", gguf_without(metadata_key="llama.block_count"), [], "llama.block_count"),
    ("convert_gguf", gguf_without(arch="gpt2"), [], "gpt2"),
    ("convert_gguf", truncate("m.gguf", 3000), [], "m.gguf"),
    # scripts/benchmark.py
    ("benchmark", None, ["--device", "tpu"], "--device"),
    ("benchmark", None, ["--configs", "fast:float32"], "fast:float32"),
    ("benchmark", None, ["--peers", "vllm"], "vllm"),
    ("benchmark", None, ["--peers", "llama.cpp"], "--gguf"),
    ("benchmark", None, ["--gguf", "{tmp}/absent.gguf"], "absent.gguf"),
    ("benchmark", None, ["--rounds", "0"], "--rounds"),
    ("benchmark", None, ["--configs", "eager:int8", "--check"], "--check"),
    ("benchmark", None, ["--configs", "eager:int8:fast"], "eager:int8:fast"),
    ("generate", None, ["--kernels", "fast"], "--kernels"),
    ("benchmark", None, ["--checkpoint_path", "{tmp}/absent"], "absent"),
    ("benchmark", write("ckpt/config.json", "null"), [], "config.json"),
    ("benchmark", write("a_file", "x"), ["--profile", "{tmp}/a_file"], "a_file"),
]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_tokenizer_json):
    folder = tmp_path_factory.mktemp("bad_hf") / "hf"
    make_hf_llama(folder, tiny_tokenizer_json, num_key_value_heads=2)
    return folder


@pytest.fixture
def workspace(tmp_path, tiny_checkpoint, hf_folder):
    """tmp/ckpt: a checkpoint folder; tmp/hf: a Hugging Face folder; tmp/m.gguf: the same model as GGUF."""
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    shutil.copytree(hf_folder, tmp_path / "hf")
    model = generate.load_model(tiny_checkpoint)
    write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, gguf.GGMLQuantizationType.F32)
    return tmp_path


def files_under(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")}


def run_main(main, argv, capsys) -> tuple[int, str]:
    """Calls a script's main(argv) as the interpreter would: returns its exit status and what it printed to stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code = exit_info.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # sys.exit("error: ...") prints the message and exits with 1
        return 1, err + code + "\n"
    return code, err


@pytest.mark.parametrize("script, setup, args, names", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(workspace, capsys, script, setup, args, names):
    if setup is not None:
        setup(workspace)
    before = files_under(workspace)
    argv = [a.format(tmp=workspace) for a in BASE_ARGS[script] + args]
    code, err = run_main(MAINS[script], argv, capsys)
    assert code not in (0, None), err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and names.format(tmp=workspace) in errors[0], err
    assert files_under(workspace) == before, "a failed run left files behind"
    assert not (workspace / "pwned").exists() and not os.path.exists("pwned")


def test_the_catalogue_covers_every_script():
    counts = {script: sum(c[0] == script for c in CASES) for script in MAINS}
    assert len(CASES) >= 40 and min(counts.values()) >= 5, counts


# ---------------------------------------------------------------- cases that need a real process


def run_script(script, *args, stdin=b"", limit_file_size=None, timeout=300):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    command = [sys.executable, str(ROOT / script), *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, timeout=timeout, preexec_fn=limit if limit_file_size else None
    )


def one_error_line(stderr: bytes) -> str:
    text = stderr.decode(errors="replace")
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1, text
    return errors[0]


def test_invalid_utf8_in_argv(tiny_checkpoint):
    result = run_script("generate.py", "--checkpoint_path", str(tiny_checkpoint), "--prompt", b"caf\xe9")
    assert result.returncode == 2 and "--prompt" in one_error_line(result.stderr)


@pytest.mark.parametrize(
    "script, args, output",
    [
        ("quantize.py", ["--checkpoint_path", "{tmp}/ckpt/model.pth", "--mode", "int8"], "model_int8.pth"),
        ("scripts/convert_hf_checkpoint.py", ["--checkpoint_dir", "{tmp}/hf", "--out_dir", "{tmp}/out"], "model.pth"),
        ("scripts/convert_gguf.py", ["--gguf", "{tmp}/m.gguf", "--out_dir", "{tmp}/out"], "model.pth"),
    ],
)
def test_a_full_disk_leaves_no_partial_file(workspace, script, args, output):
    # A file size limit makes writes fail as a full disk does (EFBIG instead of ENOSPC): a model file is
    # larger than 64 KiB, every other file smaller.
    before = files_under(workspace)
    result = run_script(script, *[a.format(tmp=workspace) for a in args], limit_file_size=64 * 1024)
    assert result.returncode == 1 and output in one_error_line(result.stderr)
    assert files_under(workspace) == before


def test_interactive_reports_a_bad_line_and_goes_on(tiny_checkpoint):
    lines = b"\xff\xfe bad bytes\n" + b"hello\n" + b"x " * 400 + b"\n" + b"again\n"
    result = run_script(
        "generate.py",
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--interactive",
        "--max_new_tokens",
        "6",
        "--temperature",
        "0",
        stdin=lines,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in stderr
    assert "input line 1 is not valid UTF-8" in stderr and "does not fit" in stderr  # the long line: refused
    model, tokenizer = generate.load_model(tiny_checkpoint), load_tokenizer(tiny_checkpoint)

    def reply(text):
        return generate.generate(
            model, tokenizer.encode(text), 6, tokenizer=tokenizer, eos_ids=tokenizer.eos_ids
        ).texts[0]

    first = reply("hello")
    assert result.stdout.decode() == first + "\n" + reply("hello\n" + first + "\nagain") + "\n"


def test_ctrl_c_exits_130_quietly(tiny_checkpoint):
    command = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--interactive",
        "--max_new_tokens",
        "4",
        "--temperature",
        "0",
    ]
    # A suite started in the background (`bash scripts/test.sh &`) inherits SIGINT ignored, and so would the
    # command: Python installs its Ctrl-C handler only where SIGINT is not ignored.
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    job = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    try:
        job.stdin.write(b"hello\n")
        job.stdin.flush()
        job.stdout.readline()  # the reply: the process now waits for the next line
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 130
    assert "Traceback" not in stderr.decode() and "KeyboardInterrupt" not in stderr.decode()
