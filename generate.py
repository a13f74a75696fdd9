"""Generate text with a Llama-family checkpoint.

    python generate.py --prompt "The capital of France is" --max_new_tokens 64
    python generate.py --checkpoint_path checkpoints/NAME/model.pth --compile --temperature 0.8 --top_p 0.95

The decode step runs as one static-shape function (optionally torch.compile'd); sampling stays on the
device, and the host looks at the tokens only to stream them or, every few steps, to check for EOS.
"""
import argparse
import contextlib
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from model import ModelArgs, Transformer
from tokenizer import Tokenizer, load_tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct" / "model.pth"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EOS_CHECK_INTERVAL = 8  # decode steps between host checks for "every row has produced EOS"
INTERACTIVE_CACHE_LENGTH = 2048


# ---------------------------------------------------------------- sampling (all on the device)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def logits_to_probs(logits: Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    # logits: [..., V] -> probabilities after temperature, then top-k, then top-p (the order transformers uses)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the tokens ranked above it hold less than top_p of the mass.
        remove = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return torch.softmax(logits, dim=-1)


def multinomial_sample_one(probs: Tensor) -> Tensor:
    # argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p, without torch.multinomial's host sync.
    noise = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / noise, dim=-1, keepdim=True)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    # logits: [B, S, V] -> next token [B, 1] from the last position
    last = logits[:, -1]
    if temperature == 0:
        return torch.argmax(last, dim=-1, keepdim=True)
    return multinomial_sample_one(logits_to_probs(last, temperature, top_k, top_p))


# ---------------------------------------------------------------- the model steps


def prefill(model: Transformer, x: Tensor, input_pos: Tensor, **sampling) -> Tensor:
    # x: [B, S] prompt at positions input_pos [S] -> first new token [B, 1]
    return sample(model(x, input_pos), **sampling)


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor, **sampling) -> Tensor:
    # x: [B, 1] at position input_pos [1] -> next token [B, 1]
    return sample(model(x, input_pos), **sampling)


def decode_n_tokens(
    model, cur_token, input_pos, num_new_tokens, *, decode_fn=decode_one_token, eos_ids=(), callback=None, **sampling
) -> list[Tensor]:
    """Decodes up to num_new_tokens tokens after cur_token [B, 1]; stops early once every row has hit EOS."""
    eos = torch.tensor(list(eos_ids), device=cur_token.device)
    finished = torch.zeros(cur_token.shape[0], dtype=torch.bool, device=cur_token.device)
    new_tokens = []
    for step in range(1, num_new_tokens + 1):
        next_token = decode_fn(model, cur_token, input_pos, **sampling)
        input_pos += 1
        # A copy: CUDA graphs reuse the output buffer on the next call.
        cur_token = next_token.clone()
        new_tokens.append(cur_token)
        if callback is not None:
            callback(cur_token)
        if len(eos):
            finished |= torch.isin(cur_token[:, 0], eos)
            if step % EOS_CHECK_INTERVAL == 0 and bool(finished.all()):
                break
    return new_tokens


def ensure_caches(model: Transformer, batch_size: int, prompt_len: int, max_new_tokens: int):
    """Checks the request fits the model and sets up KV caches unless ones of the right size exist."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty and the tokenizer adds no BOS token to start from")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = prompt_len + max_new_tokens
    if needed > model.config.block_size:
        raise ValueError(
            f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"block_size ({model.config.block_size})"
        )
    # Reusing caches keeps the compiled decode step's shapes, so it does not recompile.
    if model.max_seq_length < needed or model.max_batch_size != batch_size:
        model.setup_caches(batch_size, needed)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row, up to and excluding the first EOS
    prompt_tokens: int
    decode_steps: int  # decode steps run (a row that finished early still took part in them)
    time_to_first_token_s: float
    decode_time_s: float


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_tokens: Tensor | list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_ids=(),
    callback=None,
    batch_size: int = 1,
    prefill_fn=prefill,
    decode_fn=decode_one_token,
) -> Generation:
    """Continues prompt_tokens [S] (repeated batch_size times) by up to max_new_tokens tokens."""
    check_sampling(temperature, top_k, top_p)
    device = model.tok_embeddings.weight.device
    prompt = torch.as_tensor(prompt_tokens, dtype=torch.long, device=device).view(-1)
    prompt_len = prompt.numel()
    ensure_caches(model, batch_size, prompt_len, max_new_tokens)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    synchronize(device)
    start = time.perf_counter()
    x = prompt.repeat(batch_size, 1)
    first = prefill_fn(model, x, torch.arange(prompt_len, device=device), **sampling).clone()
    if callback is not None:
        callback(first)
    synchronize(device)
    time_to_first_token = time.perf_counter() - start

    input_pos = torch.tensor([prompt_len], device=device)
    rest = decode_n_tokens(
        model, first, input_pos, max_new_tokens - 1, decode_fn=decode_fn, eos_ids=eos_ids, callback=callback, **sampling
    )
    rows = torch.cat([first, *rest], dim=1).tolist()
    decode_time = time.perf_counter() - start - time_to_first_token
    eos = set(eos_ids)
    trimmed = [row[: next((i for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
    return Generation(trimmed, prompt_len, len(rest), time_to_first_token, decode_time)


# ---------------------------------------------------------------- loading


def load_tensor_file(path: Path) -> dict:
    """torch.load that never runs code from the file, memory-mapped."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # UnpicklingError for a pickle with code in it, RuntimeError for a damaged file
        raise ValueError(f"refusing to load {path}: not a plain tensor file ({type(e).__name__}: {e})") from None


def resolve_checkpoint(checkpoint_path: str | Path) -> Path:
    path = Path(checkpoint_path)
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        hint = " (run: bash scripts/prepare.sh)" if path == DEFAULT_CHECKPOINT else ""
        raise FileNotFoundError(f"checkpoint not found: {path}{hint}")
    return path


def load_model(checkpoint_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Builds the model on the meta device and assigns the memory-mapped weights: no second copy."""
    path = resolve_checkpoint(checkpoint_path)
    config = ModelArgs.from_json(path.parent / "config.json")
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = load_tensor_file(path)
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match {path.parent / 'config.json'}: {e}") from None
    return model.to(device=device, dtype=dtype).eval()


def model_size_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # peak resident set, KiB on Linux


def compile_steps(device: torch.device):
    """The compiled prefill and decode step. CUDA graphs ("reduce-overhead") exist on CUDA only."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    decode_fn = torch.compile(decode_one_token, mode=mode, fullgraph=True)
    prefill_fn = torch.compile(prefill, fullgraph=True, dynamic=True)
    return prefill_fn, decode_fn


# ---------------------------------------------------------------- command line


class TextStream:
    """Prints row 0's text as tokens arrive, holding back an incomplete multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, eos_ids):
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.ids, self.printed, self.stopped = [], "", False

    def __call__(self, token: Tensor):
        t = int(token[0, 0])
        self.stopped = self.stopped or t in self.eos_ids
        if self.stopped:
            return
        self.ids.append(t)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[len(self.printed) :], end="", flush=True)
            self.printed = text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="Hello, my name is", help="text to continue")
    p.add_argument("--interactive", action="store_true", help="read prompts from stdin, one a line")
    p.add_argument("--num_samples", type=int, default=1, help="number of runs")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate at most")
    p.add_argument("--batch_size", type=int, default=1, help="rows generated together from the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top_k", type=int, default=200, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed, for repeatable sampling")
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="model.pth, or its folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--compile_prefill", action="store_true", help="torch.compile the prefill too (dynamic shapes)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace (.json) of the last run")
    p.add_argument("--json", action="store_true", help="print one JSON object of outputs and figures as last line")
    args = p.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        p.error(str(e))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"unknown --device {args.device!r}: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but this PyTorch build or machine has no CUDA GPU")
    args.device = device
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    return args


def run(args):
    t0 = time.perf_counter()
    model = load_model(args.checkpoint_path, args.device, args.dtype)
    tokenizer = load_tokenizer(resolve_checkpoint(args.checkpoint_path).parent)
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    compiled_prefill, compiled_decode = compile_steps(args.device)  # compiles lazily, on first use
    prefill_fn = compiled_prefill if args.compile_prefill else prefill
    decode_fn = compiled_decode if args.compile else decode_one_token
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_ids=tokenizer.eos_ids)

    def run_once(prompt_ids, max_new_tokens, callback=None):
        return generate(
            model, prompt_ids, max_new_tokens, batch_size=args.batch_size, callback=callback,
            prefill_fn=prefill_fn, decode_fn=decode_fn, **sampling,
        )  # fmt: skip

    if args.interactive:
        model.setup_caches(args.batch_size, min(model.config.block_size, INTERACTIVE_CACHE_LENGTH))
        for line in sys.stdin:
            if not line.strip():
                continue
            text = line.rstrip("\n")
            ids = tokenizer.encode_chat([{"role": "user", "content": text}]) if tokenizer.chat_template else tokenizer.encode(text)
            max_new = min(args.max_new_tokens, model.max_seq_length - len(ids))
            if max_new < 1:
                print(f"error: prompt of {len(ids)} tokens does not fit the {model.max_seq_length}-token cache", file=sys.stderr)
                continue
            run_once(ids, max_new, TextStream(tokenizer, tokenizer.eos_ids))
            print(flush=True)
        return

    prompt_ids = tokenizer.encode(args.prompt)
    ensure_caches(model, args.batch_size, len(prompt_ids), args.max_new_tokens)  # the warm-up's too
    compile_time = None
    if args.compile or args.compile_prefill:
        t0 = time.perf_counter()
        run_once(prompt_ids, min(args.max_new_tokens, 2 * EOS_CHECK_INTERVAL))
        compile_time = time.perf_counter() - t0
        print(f"Compilation and warm-up: {compile_time:.1f} s", file=sys.stderr)

    outputs, runs = [], []
    for i in range(args.num_samples):
        stream = TextStream(tokenizer, tokenizer.eos_ids) if args.batch_size == 1 else None
        profile = args.profile is not None and i == args.num_samples - 1
        if stream:
            print(args.prompt, end="", flush=True)
        with torch.profiler.profile() if profile else contextlib.nullcontext() as profiler:
            result = run_once(prompt_ids, args.max_new_tokens, stream)
        if profile:
            profiler.export_chrome_trace(str(args.profile))
        texts = [tokenizer.decode(row) for row in result.tokens]
        if stream:
            print(texts[0][len(stream.printed) :], flush=True)
        else:
            for text in texts:
                print(args.prompt + text + "\n", flush=True)
        outputs += texts
        runs.append(result)

    stats = summarize(runs, model, args.device, compile_time)
    for key, value in stats.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", file=sys.stderr)
    if args.json:
        print(json.dumps({"outputs": outputs, "stats": stats}))


def summarize(runs: list[Generation], model: Transformer, device: torch.device, compile_time: float | None) -> dict:
    """Figures over all runs: decode speed counts every decode step of every row."""
    batch = len(runs[0].tokens)
    decode_steps = sum(r.decode_steps for r in runs)
    decode_time = sum(r.decode_time_s for r in runs)
    ttft = sum(r.time_to_first_token_s for r in runs) / len(runs)
    steps_per_s = decode_steps / decode_time if decode_time > 0 else float("nan")
    size = model_size_bytes(model)
    return {
        "prompt_tokens": runs[0].prompt_tokens,
        "new_tokens": [len(row) for r in runs for row in r.tokens],
        "time_to_first_token_s": ttft,
        "prefill_tokens_per_s": runs[0].prompt_tokens * batch / ttft,
        "decode_tokens_per_s": steps_per_s * batch,
        "bandwidth_gb_s": size * steps_per_s / 1e9,  # the weights are read once per decode step
        "model_size_gb": size / 1e9,
        "peak_memory_gb": peak_memory_gb(device),
        "compile_time_s": compile_time,
    }


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
