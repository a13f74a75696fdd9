"""Prefill and decode speed of our configurations, side by side with llama.cpp and transformers, in one run.

    python scripts/benchmark.py                                    # SmolLM2: compiled float32/bfloat16/int8/int4
    python scripts/benchmark.py --peers llama.cpp,transformers     # and the peers, on the same GGUF file
    python scripts/benchmark.py --configs eager:float32,compiled:float32 --rounds 5 --json
    python scripts/benchmark.py --configs eager:int4,compiled:int4,compiled:CHECKPOINT_FILE.pth --check
    python scripts/benchmark.py --shape llama-2-7b --device cuda --configs compiled:bfloat16,compiled:int8,compiled:int4
    python scripts/benchmark.py --draft checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth --configs compiled:float32
    python scripts/benchmark.py --shape llama-2-7b --device cuda --configs compiled:bfloat16 --draft int4   # own copy

A run is a prompt of --prompt_length random tokens (prefill), then --new_tokens greedy decode steps
with no EOS. Every round runs each configuration once, each of ours right beside the llama.cpp copy it is compared
with (ours first in even rounds, the peer first in odd ones), so that the host's speed, which moves in steps of
seconds, weighs on both alike: the ratios to llama.cpp are medians over the rounds of each such pair's ratio. The
table shows medians over the rounds, after one warm-up run each (which, for compiled ones, compiles: "compile s";
"recompiles" counts the graphs Dynamo compiled after it, during the timed runs, which should be none). MBU = bytes
of weights a decode step reads x steps per second / the copy bandwidth measured at the start of the same run.
--compile_prefill compiles the compiled configurations' prefill too, as generate.py's flag does.
--start times what a user waits for: `generate.py --compile` (and --compile_prefill) in a new process, from its
start to its exit after 2 greedy tokens (an upper bound of the time to the first token), with an empty inductor
cache ("first start s") and then with the cache that run left ("start s").
int8 / int4 models are quantized in memory (round to nearest; int4 groups of --groupsize), or a configuration names
a checkpoint file (float, or quantized as the file says). --check fails a compiled configuration that decodes slower
than the same one eager or prefills more than 10% slower (without --compile_prefill the same eager prefill), and
an int8/int4 one that decodes slower than float32 run the same way.
llama.cpp runs through the optional `llama-cpp-python` package (pip install llama-cpp-python): the GGUF as it is,
and its F32 / F16 / Q8_0 / Q4_1 copies made by the package's own quantize function. Our rows compare with the copy of
their precision, or with the GGUF as it is for a checkpoint converted from it (convert_gguf.py --int4). The table
names the instruction sets llama.cpp was built with: a llama.cpp built for AVX2 only (docs/performance.md says how)
is the peer of our AVX2 path (ATEN_CPU_CAPABILITY=avx2).
"""

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from checkpoint import (  # noqa: E402
    DEFAULT_CHECKPOINT,
    DEFAULT_DEVICE,
    HelpFormatter,
    device_flag,
    load_checkpoint,
    resolve_checkpoint,
    user_errors,
)
from config import ModelArgs  # noqa: E402
from decode import compile_steps, ensure_caches  # noqa: E402
from generate import default_dtype, generate, load_model  # noqa: E402
from kernels import MATVECS, Kernels, in_huge_pages, set_kernels  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import quantize_checkpoint, quantize_model  # noqa: E402
from results import model_size_bytes, synchronize  # noqa: E402

PREFILL_NOISE = 0.9  # --check: how far below the eager prefill a compiled one's may measure (see slower_configurations)
DEFAULT_GGUF = ROOT / "checkpoints" / ".downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = {  # random-weight models of well-known shapes: GPU runs need no download
    "smollm2-135m": dict(
        dim=576, n_layer=30, n_head=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True
    ),
    "llama-2-7b": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, vocab_size=32000),
    "llama-3-8b": dict(
        dim=4096, n_layer=32, n_head=32, n_kv_heads=8, intermediate_size=14336, vocab_size=128256, rope_base=500000.0
    ),
}
PRECISIONS = ("float32", "bfloat16", "int8", "int4")
LLAMA_CPP_TYPES = {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0", "int4": "Q4_1"}  # comparable formats
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's enum llama_ftype


@dataclass
class Entry:
    """One row of the table: a configuration, how to run it once, and what its runs measured."""

    name: str
    run: object  # () -> dict(prefill_tokens_per_s, time_to_first_token_s, decode_tokens_per_s)
    precision: str | None = None  # ours: the comparable precision; peers: None
    config: "Config | None" = None  # ours: what ran
    peer: str | None = None  # ours: the name of the llama.cpp entry it is compared with
    weight_bytes: int = 0  # bytes a decode step reads
    memory_mb: float = float("nan")  # RSS growth (CPU) or peak allocated (CUDA) while loading and warming up
    compile_s: float | None = None
    recompiles: int = 0  # graphs compiled during the timed runs
    compiled: bool = False
    start_s: tuple[float, float] | None = None  # --start: (first-ever, cached) seconds to generate.py's first tokens
    runs: list[dict] = field(default_factory=list)
    paired: list[tuple[dict, dict]] = field(default_factory=list)  # ours: (our run, the peer's run right beside it)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)


@dataclass(frozen=True)
class Config:
    compiled: bool
    precision: str
    matvec: str  # auto, fused, library or native: see kernels.Kernels
    checkpoint: Path | None = None  # a checkpoint file to run as it is, of this precision
    from_gguf: bool = False  # the checkpoint's weights are the GGUF's own blocks (convert_gguf.py --int4)


def parse_configs(text: str) -> list[Config]:
    """argparse type of --configs."""
    configs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        mode, what, matvec = parts + ["auto"] if len(parts) == 2 else parts if len(parts) == 3 else ("",) * 3
        if (
            mode not in ("eager", "compiled")
            or not (what in PRECISIONS or what.endswith(".pth"))
            or matvec not in MATVECS
        ):
            raise argparse.ArgumentTypeError(
                f"bad config {item!r}: use eager|compiled:{'|'.join(PRECISIONS)}|FILE.pth[:{'|'.join(MATVECS)}]"
            )
        if what in PRECISIONS:
            configs.append(Config(mode == "compiled", what, matvec))
            continue
        if not Path(what).is_file():
            raise argparse.ArgumentTypeError(f"config {item!r}: checkpoint file {what} not found")
        try:
            quantization = load_checkpoint(Path(what))[1]
        except (OSError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"config {item!r}: {e}") from None
        precision = quantization["mode"] if quantization else "float32"
        from_gguf = quantization is not None and quantization.get("method") == "gguf"
        configs.append(Config(mode == "compiled", precision, matvec, Path(what), from_gguf))
    return configs


def copy_bandwidth_gb_s(device: torch.device, megabytes: int = 512) -> float:
    """Read + write bytes per second of a large tensor copy: the yardstick of MBU."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / min(times[1:]) / 1e9


def memory_now_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1e3


def measure_memory(device: torch.device, build):
    """build() and the memory it took: CPU resident-set growth, or CUDA peak allocation during it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 1e6
    else:
        before = memory_now_mb(device)
    result = build()
    return result, memory_now_mb(device) - before


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> Transformer:
    config = ModelArgs(**SHAPES[shape])
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    for name, p in model.named_parameters():
        with torch.no_grad():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02, generator=generator)
    return model.eval()


def base_model(args, dtype: torch.dtype, kernels: Kernels) -> Transformer:
    """The float model the configurations start from: --shape's random weights (the same for every call), or the
    checkpoint."""
    if args.shape:
        model = random_model(args.shape, args.device, dtype)
        set_kernels(model, kernels)
        if kernels.huge_pages:
            in_huge_pages(model)
        return model
    return load_model(args.checkpoint_path, args.device, dtype, kernels=kernels)


def our_entry(args, config: Config, prompt: list[int], with_draft: bool = False) -> Entry:
    compiled, precision = config.compiled, config.precision
    quantized, half = precision in ("int8", "int4"), precision == "bfloat16"
    kernels = Kernels.choose(args.device, compiled, config.matvec, quantized, half=half)
    # int8 / int4: the float parts (and the activations) in generate.py's dtype for the device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(precision, default_dtype(args.device))

    def build():
        if config.checkpoint is not None:
            return load_model(config.checkpoint, args.device, dtype, kernels=kernels)
        base = base_model(args, dtype, kernels)
        return (
            base if precision in ("float32", "bfloat16") else quantize_model(base, precision, args.groupsize, kernels)
        )

    model, memory = measure_memory(args.device, build)
    draft = None
    if with_draft and args.draft in ("int8", "int4"):  # the target's own quantized copy
        draft = quantize_model(
            base_model(args, default_dtype(args.device), kernels), args.draft, args.groupsize, kernels
        )
    elif with_draft:
        draft = load_model(args.draft, args.device, default_dtype(args.device), kernels=kernels)
    # Compiled: the decode steps, and with --compile_prefill the prefill (one shape here: the prompt's).
    steps = compile_steps(args.device, decode=compiled, prefill=compiled and args.compile_prefill)
    extra = dict(draft_model=draft, speculate_k=args.speculate_k) if draft is not None else {}
    ahead = args.speculate_k + 1 if draft is not None else 0
    for m in (model, draft) if draft is not None else (model,):
        ensure_caches(m, 1, len(prompt), args.new_tokens + ahead)

    def run() -> dict:
        result = generate(model, prompt, args.new_tokens, steps=steps, **extra)
        return {
            "time_to_first_token_s": result.time_to_first_token_s,
            "prefill_tokens_per_s": len(prompt) / result.time_to_first_token_s,
            "decode_tokens_per_s": (len(result.tokens[0]) - 1) / result.decode_time_s,
        }

    matvec = kernels.float_matvec if precision in ("float32", "bfloat16") else kernels.quant_matvec
    native = {"int8": kernels.int8_native, "int4": kernels.int4_native}.get(precision)
    if native is not None:
        matvec = f"native {native}"
    if half and kernels.half_native:
        matvec = "native"
    path = f" ({matvec})" if args.device.type == "cpu" else ""
    file = f" {config.checkpoint.name}" if config.checkpoint else ""
    name = f"ours {'compiled' if compiled else 'eager'} {precision}{file}{path}" + (
        f" + draft (k={args.speculate_k})" if draft else ""
    )
    name += ", prefill compiled" if compiled and args.compile_prefill else ""
    peer = None
    if "llama.cpp" in args.peers:
        peer = f"llama.cpp {gguf_file_type(peers_gguf(args)) if config.from_gguf else LLAMA_CPP_TYPES[precision]}"
    entry = Entry(name, run, precision, config, peer, model_size_bytes(model), memory, compiled=compiled)
    start = time.perf_counter()
    entry.run()  # warm-up: compiles, if compiled
    entry.compile_s = time.perf_counter() - start if compiled else None
    return entry


def measure_start(args, config: Config, folder: Path) -> tuple[float, float]:
    """Seconds from process start to exit of `generate.py --compile` making 2 greedy tokens: with an empty
    inductor cache, then with the one it filled. int8 / int4 checkpoints are quantized into folder first."""
    checkpoint = config.checkpoint or resolve_checkpoint(args.checkpoint_path)
    if config.checkpoint is None and config.precision in ("int8", "int4"):
        # quantize.py's inputs: the model, and the config and tokenizer files beside it
        for f in [checkpoint, *(f for f in checkpoint.parent.iterdir() if f.is_file() and f.suffix != ".pth")]:
            (folder / f.name).symlink_to(f.resolve())
        checkpoint = quantize_checkpoint(folder / checkpoint.name, config.precision, args.groupsize)
    dtype = "bfloat16" if config.precision == "bfloat16" else "float32"
    command = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--checkpoint_path",
        str(checkpoint),
        "--compile",
        *(["--compile_prefill"] if args.compile_prefill else []),
        "--prompt",
        "Hello",
        "--max_new_tokens",
        "2",
        "--temperature",
        "0",
        "--dtype",
        dtype,
        "--kernels",
        config.matvec,
        "--device",
        str(args.device),
    ]
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(args.threads))
        times = []
        for _ in range(2):
            start = time.perf_counter()
            done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            times.append(time.perf_counter() - start)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return times[0], times[1]


def gguf_file_type(path: Path) -> str:
    """The GGUF's llama.cpp file type, as llama.cpp names it: F32, F16, Q8_0, Q4_1, Q4_K_M, ..."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return "as is"
    return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def gguf_variant(source: Path, kind: str, threads: int, quantize: Path | None = None) -> Path:
    """source requantized to llama.cpp type `kind` (cached beside it), made by llama.cpp itself: by its
    llama-quantize binary where given, else by llama-cpp-python; source itself when it is of that type."""
    if kind == gguf_file_type(source):
        return source
    out = source.with_name(f"{source.stem}.bench-{kind}.gguf")
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    if quantize is not None:
        command = [str(quantize), "--allow-requantize", str(source), str(tmp), kind, str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
            raise ValueError(f"{quantize} could not make a {kind} copy of {source}: {last[0]}")
    else:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = LLAMA_FTYPES[kind], True, threads
        if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise ValueError(f"llama.cpp could not make a {kind} copy of {source}")
    os.replace(tmp, out)
    return out


def cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_int8" in f.read()


def llama_cpp_entry(gguf: Path, kind: str, prompt: list[int], args) -> Entry:
    from llama_cpp import Llama

    def build():
        return Llama(
            model_path=str(gguf),
            n_ctx=len(prompt) + args.new_tokens + 8,
            n_batch=max(512, len(prompt)),
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )

    if cpu_has_amx():  # llama.cpp's AMX weight buffers crash on such CPUs (llama.cpp issue 20824): use plain ones
        import llama_cpp.llama_cpp as low

        default_params = low.llama_model_default_params

        def plain_buffers():
            params = default_params()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = plain_buffers

    llm, memory = measure_memory(torch.device("cpu"), build)

    def run() -> dict:
        llm.reset()  # the next eval starts at position 0 and drops the cached positions after it
        start = time.perf_counter()
        llm.eval(prompt)
        ttft = time.perf_counter() - start
        token = prompt[-1]
        start = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            llm.eval([token])  # llama-bench, too, decodes fixed tokens: the speed does not depend on them
        return {
            "time_to_first_token_s": ttft,
            "prefill_tokens_per_s": len(prompt) / ttft,
            "decode_tokens_per_s": (args.new_tokens - 1) / (time.perf_counter() - start),
        }

    entry = Entry(f"llama.cpp {kind}", run, weight_bytes=gguf.stat().st_size, memory_mb=memory)
    entry.run()
    return entry


def transformers_entry(gguf: Path, prompt: list[int], args) -> Entry:
    from transformers import AutoModelForCausalLM

    def build():
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    model, memory = measure_memory(torch.device("cpu"), build)
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def run() -> dict:
        ttft, total = timed(1), timed(args.new_tokens)
        return {
            "time_to_first_token_s": ttft,
            "prefill_tokens_per_s": len(prompt) / ttft,
            "decode_tokens_per_s": (args.new_tokens - 1) / (total - ttft),
        }

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    entry = Entry("transformers eager float32", run, weight_bytes=weights, memory_mb=memory)
    entry.run()
    return entry


def cell(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    """A table cell: the value formatted, or empty where there is none."""
    return "" if value is None else format(value, spec) + unit


def table(entries: list[Entry], bandwidth: float, device: torch.device) -> tuple[str, list[dict]]:
    peers = {e.name: e for e in entries if e.precision is None}
    rows = []
    for e in entries:
        decode = e.median("decode_tokens_per_s")
        row = {
            "config": e.name,
            "prefill_tokens_per_s": e.median("prefill_tokens_per_s"),
            "time_to_first_token_ms": 1e3 * e.median("time_to_first_token_s"),
            "decode_tokens_per_s": decode,
            "weights_mb_per_token": e.weight_bytes / 1e6,
            "achieved_gb_s": e.weight_bytes * decode / 1e9,
            "mbu": e.weight_bytes * decode / 1e9 / bandwidth,
            "memory_mb": e.memory_mb,
            "compile_s": e.compile_s,
            "recompiles": e.recompiles if e.precision is not None else None,
            "first_start_s": e.start_s[0] if e.start_s else None,
            "start_s": e.start_s[1] if e.start_s else None,
        }
        if e.precision is not None:
            if e.paired:
                for key, name in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
                    row[f"vs_llama_cpp_{name}"] = statistics.median(a[key] / b[key] for a, b in e.paired)
            if "transformers eager float32" in peers:
                row["vs_transformers_decode"] = decode / peers["transformers eager float32"].median(
                    "decode_tokens_per_s"
                )
        rows.append(row)
    memory = "peak MB" if device.type == "cuda" else "RSS +MB"
    lines = [
        f"| config | prefill tok/s | TTFT ms | decode tok/s | MB/token | GB/s | MBU | {memory} | compile s "
        "| recompiles | first start s | start s | decode vs llama.cpp | prefill vs llama.cpp "
        "| decode vs transformers |",
        "|---|" + "---|" * 14,
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['prefill_tokens_per_s']:.0f} | {r['time_to_first_token_ms']:.0f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['weights_mb_per_token']:.0f} | {r['achieved_gb_s']:.1f} "
            f"| {100 * r['mbu']:.0f}% | {r['memory_mb']:.0f} | {cell(r['compile_s'])} | {cell(r['recompiles'], 'd')} "
            f"| {cell(r['first_start_s'])} "
            f"| {cell(r['start_s'])} | {cell(r.get('vs_llama_cpp_decode'), '.2f', 'x')} "
            f"| {cell(r.get('vs_llama_cpp_prefill'), '.2f', 'x')} "
            f"| {cell(r.get('vs_transformers_decode'), '.2f', 'x')} |"
        )
    return "\n".join(lines), rows


def chart_bars(entries: list[Entry]) -> dict[str, list[tuple[str, Entry]]]:
    """The chart's bars, grouped by precision: (kind, entry) for ours (without draft) and the comparable peers."""
    peers = {e.name: e for e in entries if e.precision is None}
    groups = {}
    for precision in PRECISIONS:
        ours = [e for e in entries if e.precision == precision and "draft" not in e.name]
        if not ours:
            continue
        bars = [("ours compiled" if e.compiled else "ours eager", e) for e in ours]
        if (peer := peers.get(f"llama.cpp {LLAMA_CPP_TYPES[precision]}")) is not None:
            bars.append(("llama.cpp", peer))
        if precision == "float32" and "transformers eager float32" in peers:
            bars.append(("transformers eager", peers["transformers eager float32"]))
        groups[precision] = bars
    return groups


def draw_chart(entries: list[Entry], bandwidth: float, title: str, path: Path):
    """A PNG of decode tok/s per precision, ours beside the peers, and the most that the copy bandwidth allows
    for our weights of that precision (bandwidth / bytes read per token)."""
    import matplotlib  # optional: only --chart needs it (parse_args checks it is there)

    matplotlib.use("Agg")
    from matplotlib import pyplot

    colors = {
        "ours compiled": "#1f77b4",
        "ours eager": "#9ecae1",
        "llama.cpp": "#ff7f0e",
        "transformers eager": "#999999",
    }
    figure, axes = pyplot.subplots(figsize=(10, 5.5))
    x, ticks, labels, seen = 0.0, [], [], set()
    for precision, bars in chart_bars(entries).items():
        left = x
        for kind, e in bars:
            speed = e.median("decode_tokens_per_s")
            axes.bar(x, speed, width=0.8, color=colors[kind], label=None if kind in seen else kind)
            axes.annotate(f"{speed:.1f}", (x, speed), ha="center", va="bottom", fontsize=8)
            seen.add(kind)
            x += 1
        limit = bandwidth * 1e9 / bars[0][1].weight_bytes
        axes.hlines(
            limit,
            left - 0.4,
            x - 0.6,
            colors="black",
            linestyles="dashed",
            label=None if "limit" in seen else "bandwidth limit of our weights",
        )
        seen.add("limit")
        peer = f" / {LLAMA_CPP_TYPES[precision]}" if any(kind == "llama.cpp" for kind, _ in bars) else ""
        ticks.append((left + x - 1) / 2)
        labels.append(precision + peer)
        x += 0.8
    axes.set_xticks(ticks, labels)
    axes.set_ylabel("decode tokens/s (batch 1)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8, loc="upper left")  # above the float32 bars, the lowest limit
    figure.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", dpi=110)
    pyplot.close(figure)
    os.replace(tmp, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth or its folder")
    p.add_argument("--shape", choices=SHAPES, default=None, help="a random-weight model of this shape instead")
    p.add_argument(
        "--configs",
        type=parse_configs,
        default="compiled:float32,compiled:bfloat16,compiled:int8,compiled:int4",
        help="comma-separated eager|compiled:float32|bfloat16|int8|int4[:auto|fused|library|native]; the last "
        "part picks the CPU one-row kernels (auto: the fastest for this CPU, see kernels.Kernels)",
    )
    p.add_argument("--groupsize", type=int, default=32, help="int4 group size")
    draft_help = "also each config with a draft (speculative): a checkpoint, or int8 / int4, the target's own copy"
    p.add_argument("--draft", type=draft_flag, default=None, help=draft_help)
    p.add_argument("--speculate_k", type=int, default=4, help="tokens the draft proposes per round")
    p.add_argument(
        "--peers", type=peer_list, default="", help="comma-separated: llama.cpp, transformers (default: none)"
    )
    p.add_argument("--gguf", type=Path, default=None, help="the peers' model file (default: the SmolLM2 GGUF)")
    p.add_argument("--prompt_length", type=int, default=128, help="random prompt tokens (the prefill)")
    p.add_argument("--new_tokens", type=int, default=128, help="greedy tokens generated (the decode)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each configuration (medians reported)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads, ours and the peers'")
    p.add_argument("--device", type=device_flag, default=DEFAULT_DEVICE, help="cpu, cuda or cuda:N")
    p.add_argument("--profile", type=Path, default=None, help="folder: a torch.profiler trace of one run per config")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    p.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="also draw decode tok/s per precision, ours vs the peers, as a PNG file (needs matplotlib)",
    )
    p.add_argument(
        "--compile_prefill",
        action="store_true",
        help="compiled configurations compile the prefill too (generate.py --compile_prefill)",
    )
    p.add_argument(
        "--start",
        action="store_true",
        help="also time generate.py --compile from process start to its first tokens, first-ever "
        "(empty inductor cache) and cached, for each compiled configuration",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 if a compiled configuration decodes slower than the same one eager or prefills "
        "more than 10%% slower, or an int8 or int4 one decodes slower than float32 run the same way (compiled or "
        "eager) in this run",
    )
    return p


def parse_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.check and not comparable_pairs(args.configs):
        p.error(
            "--check compares a compiled config with the same one eager, int8/int4 with float32 run the same way: "
            "give such a pair in --configs"
        )
    for name in ("prompt_length", "new_tokens", "rounds", "threads", "speculate_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.gguf is None and args.peers and (args.shape or Path(args.checkpoint_path) != DEFAULT_CHECKPOINT):
        p.error("--peers needs --gguf: the same model as a GGUF file")
    if (args.gguf is not None or args.peers) and not peers_gguf(args).is_file():
        p.error(f"GGUF file {peers_gguf(args)} not found (bash scripts/prepare.sh makes the default one)")
    if args.start and args.shape:
        p.error("--start runs generate.py on a checkpoint: not with --shape")
    if args.peers and args.device.type != "cpu":
        p.error("the peers run on the CPU: compare them with --device cpu")
    if args.chart is not None:
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--chart needs the matplotlib package (pip install matplotlib)")
        if not args.chart.parent.is_dir():
            p.error(f"--chart: folder {args.chart.parent} not found")
    return args


def peer_list(text: str) -> list[str]:
    """argparse type of --peers."""
    peers = [peer for peer in text.split(",") if peer]
    if unknown := set(peers) - {"llama.cpp", "transformers"}:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(sorted(unknown))}: use llama.cpp, transformers")
    return peers


def draft_flag(text: str) -> str | Path:
    """argparse type of --draft."""
    return text if text in ("int8", "int4") else Path(text)


def peers_gguf(args) -> Path:
    return args.gguf or DEFAULT_GGUF


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        benchmark(args)


def benchmark(args):
    if args.profile is not None:  # before the long runs, so that a bad folder fails at once
        args.profile.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    # Each configuration compiles the same step functions for another model: allow them all their graphs.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16 * len(args.configs))
    if args.shape:
        config = ModelArgs(**SHAPES[args.shape])
    else:
        config = ModelArgs.from_json(resolve_checkpoint(args.checkpoint_path).parent / "config.json")
    random_ids = torch.randint(config.vocab_size, (args.prompt_length,), generator=torch.Generator().manual_seed(0))
    prompt = random_ids.tolist()  # llama-bench, too, measures random tokens: the speed does not depend on them
    bandwidth = copy_bandwidth_gb_s(args.device)
    print(
        f"copy bandwidth: {bandwidth:.1f} GB/s (read + write); {args.threads} threads; {args.device}", file=sys.stderr
    )

    entries = prepare_entries(args, prompt)
    time_rounds(args, entries)
    if args.profile is not None:
        profile_entries(args, entries)
    text, rows = table(entries, bandwidth, args.device)
    cpu = cpu_description()
    llama = f"llama.cpp built with: {llama_cpp_features()}\n" if "llama.cpp" in args.peers else ""
    print(
        f"\n{args.shape or args.checkpoint_path}, batch 1, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
        f"{args.threads} threads, medians of {args.rounds} rounds; copy bandwidth {bandwidth:.1f} GB/s\n"
        f"CPU: {cpu}\n{llama}"
    )
    print(text)
    if args.chart is not None:
        name = args.shape or resolve_checkpoint(args.checkpoint_path).parent.name
        draw_chart(
            entries,
            bandwidth,
            f"{name}, batch 1, {args.threads} threads, copy bandwidth {bandwidth:.1f} GB/s\n{cpu}",
            args.chart,
        )
        print(f"chart: {args.chart}", file=sys.stderr)
    if args.json:
        print(json.dumps({"copy_bandwidth_gb_s": bandwidth, "cpu": cpu, "rows": rows}))
    if args.check:
        slower = slower_configurations(entries)
        for line in slower:
            print(f"check failed: {line}", file=sys.stderr)
        if slower:
            sys.exit(1)
        print(
            "check passed: no compiled configuration slower than eager (decode, prefill), no quantized one than "
            "float32 (decode)",
            file=sys.stderr,
        )


def prepare_entries(args, prompt: list[int]) -> list[Entry]:
    """Our configurations (each also with the draft, with --draft), then the peers', loaded and warmed up."""
    entries = []
    for config in args.configs:
        print(f"preparing ours {config} ...", file=sys.stderr)
        entries.append(our_entry(args, config, prompt))
        if args.start and config.compiled:
            with tempfile.TemporaryDirectory(prefix="start-") as folder:
                entries[-1].start_s = measure_start(args, config, Path(folder))
            print(
                f"start: {entries[-1].start_s[0]:.1f} s first, {entries[-1].start_s[1]:.1f} s cached", file=sys.stderr
            )
        if args.draft is not None:
            entries.append(our_entry(args, config, prompt, with_draft=True))
    if "llama.cpp" in args.peers:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            sys.exit("error: --peers llama.cpp needs the llama-cpp-python package (pip install llama-cpp-python)")
        kinds = [LLAMA_CPP_TYPES[c.precision] for c in args.configs] + [gguf_file_type(peers_gguf(args))]
        for kind in sorted(set(kinds), key=lambda k: list(LLAMA_FTYPES).index(k) if k in LLAMA_FTYPES else 9):
            print(f"preparing llama.cpp {kind} ...", file=sys.stderr)
            entries.append(llama_cpp_entry(gguf_variant(peers_gguf(args), kind, args.threads), kind, prompt, args))
    if "transformers" in args.peers:
        print("preparing transformers ...", file=sys.stderr)
        entries.append(transformers_entry(peers_gguf(args), prompt, args))

    return entries


def time_rounds(args, entries: list[Entry]):
    """--rounds timed runs of every entry. A round runs each of ours and, right beside it, the peer it is compared
    with (a peer compared with several runs beside each), ours first in even rounds and the peer first in odd ones
    (A B B A); then the entries no pair ran."""
    graphs = torch._dynamo.utils.counters["stats"]
    peers = {e.name: e for e in entries if e.precision is None}

    def timed(e: Entry) -> dict:
        before = graphs["unique_graphs"]
        e.runs.append(e.run())
        e.recompiles += graphs["unique_graphs"] - before
        return e.runs[-1]

    for r in range(args.rounds):
        paired = set()  # names of the entries this round ran in pairs
        for e in entries:
            peer = peers.get(e.peer)  # None for the peers themselves
            if peer is None:
                continue
            if r % 2 == 0:
                ours = timed(e)
                theirs = timed(peer)
            else:
                theirs = timed(peer)
                ours = timed(e)
            e.paired.append((ours, theirs))
            paired |= {e.name, peer.name}
        for e in entries:
            if e.name not in paired:
                timed(e)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{e.name} {e.runs[-1]['decode_tokens_per_s']:.1f}" for e in entries),
            file=sys.stderr,
        )


def profile_entries(args, entries: list[Entry]):
    """One more run of each of ours under torch.profiler: its trace in --profile's folder, and a summary."""
    for e in entries:
        if e.precision is None:
            continue
        with torch.profiler.profile() as prof:
            e.run()
        path = args.profile / (e.name.replace(" ", "_").replace("(", "").replace(")", "") + ".json")
        prof.export_chrome_trace(str(path))
        print(f"\n{e.name}: trace in {path}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def comparable_pairs(configs: list[Config]) -> list[tuple[Config, Config]]:
    """What --check compares, (config, the one it must decode at least as fast as): a compiled configuration and the
    same one eager; an int8/int4 one and float32 run the same way (compiled or eager)."""
    pairs = []
    for c in configs:
        for other in configs:
            eager = c.compiled and other == Config(False, c.precision, c.matvec, c.checkpoint, c.from_gguf)
            floats = c.precision in ("int8", "int4") and other.precision == "float32" and other.compiled == c.compiled
            if eager or floats:
                pairs.append((c, other))
    return pairs


def slower_configurations(entries: list[Entry]) -> list[str]:
    """Our configurations that decode slower than one they are compared with (comparable_pairs; for int8/int4, the
    fastest float32 one), and compiled ones that prefill below PREFILL_NOISE of the same one eager."""
    ours = {e.config: e for e in entries if e.config is not None and "draft" not in e.name}
    slowest_allowed = {}
    for config, other in comparable_pairs(list(ours)):
        if other.precision != config.precision:  # the fastest float32 run the same way
            best = slowest_allowed.get((config, "float32"))
            if best is None or ours[other].median("decode_tokens_per_s") > best.median("decode_tokens_per_s"):
                slowest_allowed[(config, "float32")] = ours[other]
        else:
            slowest_allowed[(config, "eager")] = ours[other]
    problems = []
    for (config, against), other in slowest_allowed.items():
        e = ours[config]
        if e.median("decode_tokens_per_s") < other.median("decode_tokens_per_s"):
            problems.append(
                f"{e.name} decodes {e.median('decode_tokens_per_s'):.1f} tok/s, "
                f"{other.name} {other.median('decode_tokens_per_s'):.1f}"
            )
        # A compiled configuration runs the eager one's prefill (the same code, so only a fault such as a product
        # fused eagerly, and not the run's noise, may take it below PREFILL_NOISE of the eager one's), or with
        # --compile_prefill a compiled one, which must not be slower either.
        prefill, eager_prefill = e.median("prefill_tokens_per_s"), other.median("prefill_tokens_per_s")
        if against == "eager" and prefill < PREFILL_NOISE * eager_prefill:
            problems.append(f"{e.name} prefills {prefill:.0f} tok/s, {other.name} {eager_prefill:.0f}")
    return problems


def llama_cpp_features() -> str:
    """The CPU features llama.cpp was built to use (llama_print_system_info's that are on), and where it loads from."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    on = [part.split("=")[0].strip() for part in info.replace(":", "|").split("|") if part.strip().endswith("= 1")]
    return f"{' '.join(on)} ({Path(llama_cpp.__file__).parent})"


def cpu_description() -> str:
    """The CPU's model name, the vector instruction sets that choose kernels, and ATen's dispatch level."""
    model, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = [
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
        if f in flags
    ]
    return f"{model}; {' '.join(isa) or 'no AVX2'}; ATen {torch.backends.cpu.get_cpu_capability()}"


if __name__ == "__main__":
    main()
