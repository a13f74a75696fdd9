"""Speculative decoding on three workloads, each decoded plainly and speculated, in one run: drafts by prompt lookup
(from the context itself), and with --draft from a draft model; with --peer_gguf, transformers' prompt lookup beside.

    python scripts/speculative_demo.py --compile \\
        --target checkpoints/Qwen2.5-Coder-1.5B-Instruct/model_int8.pth \\
        --draft checkpoints/Qwen2.5-Coder-0.5B-Instruct/model_int8.pth \\
        --peer_gguf checkpoints/.downloads/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf

The workloads are chat turns, decoded greedily:
- code edit: scripts/workloads/inventory.py (160 lines), "rename a method, return the whole file";
- extraction: the same file, "which method does X? show its code, quoted from the file";
- free chat: an open question.

Each workload runs once per configuration to compile and warm up; speculation measures its round costs there (the
seconds of a round at each depth, at this prompt's length) and keeps them. Then --rounds rounds, each configuration
in turn. Each row: decode tokens/s (the tokens after the first over the time after it; the median of the rounds),
the ratio to plain decoding of the same round, the acceptance (drafts kept / drafted), the mean accepted length
(drafts kept per round that drafted), the rounds the controller ran at each depth, and whether the tokens are plain
decoding's. The peer, transformers' generate(prompt_lookup_num_tokens=K), loads the GGUF the checkpoint came from in
float32 (its CPU path has no int8; the row says so) and runs one round, its decode time being its whole time less
that of generating one token.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import DEFAULT_CHECKPOINT, DEFAULT_DEVICE, DTYPES, HelpFormatter, device_flag, user_errors  # noqa: E402
from decode import compile_steps, ensure_caches  # noqa: E402
from generate import generate, load_models  # noqa: E402

EDITED_FILE = Path(__file__).resolve().parent / "workloads" / "inventory.py"
WORKLOADS = {
    "code edit": "Rename the method compute_total to order_total everywhere in this file, and return the whole file."
    "\n\n```python\n{file}```",
    "extraction": "```python\n{file}```\n\nWhich method of this file takes an order's units out of stock? Show its "
    "code, quoted from the file.",
    "free chat": "What are some good habits for staying focused when working from home?",
}


def decode_rate(result) -> float:
    tokens = len(result.tokens[0])
    return (tokens - 1) / result.decode_time_s if tokens > 1 else float("nan")


def run_workload(name: str, prompt: list[int], target, draft, steps, args) -> list[dict]:
    """The workload's rows: plain, prompt lookup and (with a draft) the draft model, over args.rounds rounds."""
    configurations = {"plain": {}, "prompt lookup": {"ngram": True}}
    if draft is not None:
        configurations["draft model"] = {"draft_model": draft}
    common = dict(eos_ids=args.eos_ids, steps=steps, speculate_k=args.speculate_k)
    costs, warm_up = {}, {}
    for config, kwargs in configurations.items():  # compiles, and measures the round costs at this prompt
        start = time.perf_counter()
        result = generate(target, prompt, args.max_new_tokens, **common, **kwargs)
        warm_up[config] = time.perf_counter() - start
        costs[config] = result.speculation and result.speculation["round_costs_s"]
    rates, last = {config: [] for config in configurations}, {}
    for _ in range(args.rounds):
        for config, kwargs in configurations.items():
            last[config] = generate(target, prompt, args.max_new_tokens, **common, **kwargs, round_costs=costs[config])
            rates[config].append(decode_rate(last[config]))
    rows = []
    for config in configurations:
        ratios = [r / p for r, p in zip(rates[config], rates["plain"])]
        figures = last[config].speculation or {}
        rows.append(
            {
                "workload": name,
                "configuration": config,
                "prompt_tokens": len(prompt),
                "new_tokens": len(last[config].tokens[0]),
                "tokens_per_s": statistics.median(rates[config]),
                "vs_plain": statistics.median(ratios),
                "acceptance": figures.get("acceptance_rate"),
                "mean_accepted_length": figures.get("mean_accepted_length"),
                "depths": figures.get("depth_histogram"),
                "round_costs_ms": {d: round(s * 1e3, 1) for d, s in (costs[config] or {}).items()},
                "warm_up_s": warm_up[config],
                "same_tokens": last[config].tokens == last["plain"].tokens,
            }
        )
    return rows


def peer_row(name: str, prompt: list[int], peer, args) -> dict:
    """transformers' prompt lookup on the same prompt, one round: its decode time is its whole time less that of
    generating the first token alone."""

    def timed(n: int) -> tuple[float, list[int]]:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            out = peer.generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                prompt_lookup_num_tokens=args.speculate_k,
                eos_token_id=list(args.eos_ids),
                pad_token_id=args.eos_ids[0],
            )
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    first, _ = timed(1)
    total, tokens = timed(args.max_new_tokens)
    return {
        "workload": name,
        "configuration": f"transformers prompt lookup (k={args.speculate_k}, float32)",
        "prompt_tokens": len(prompt),
        "new_tokens": len(tokens),
        "tokens_per_s": (len(tokens) - 1) / (total - first),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | configuration | tok/s | vs plain | acceptance | mean accepted | rounds at depths | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        optional = [
            f"{r['vs_plain']:.2f}x" if "vs_plain" in r else "",
            f"{r['acceptance']:.0%}" if r.get("acceptance") is not None else "",
            f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") is not None else "",
            " / ".join(f"{d}: {n}" for d, n in enumerate(r["depths"]) if n) if r.get("depths") else "",
            {True: "yes", False: "no", None: ""}[r.get("same_tokens")],
        ]
        lines.append(
            f"| {r['workload']} | {r['configuration']} | {r['tokens_per_s']:.1f} | " + " | ".join(optional) + " |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    arg = parser.add_argument
    arg("--target", type=Path, default=DEFAULT_CHECKPOINT, help="the checkpoint decoded (any model*.pth)")
    arg("--draft", type=Path, default=None, help="a draft checkpoint with the target's tokenizer (default: none)")
    arg(
        "--workloads",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help="comma-separated, of: " + ", ".join(WORKLOADS),
    )
    arg("--max_new_tokens", type=int, default=256, help="tokens to generate at most, per prompt")
    arg("--speculate_k", type=int, default=4, help="tokens drafted per round at most (the controller picks how many)")
    arg("--rounds", type=int, default=3, help="timed rounds of every configuration (their median)")
    arg("--compile", action="store_true", help="torch.compile the decode, draft and verify steps")
    arg("--dtype", choices=DTYPES, default=None, help="floating-point dtype (default: float32 on CPU)")
    arg("--device", type=device_flag, default=DEFAULT_DEVICE)
    arg("--peer_gguf", type=Path, default=None, help="the GGUF the target came from: transformers' prompt lookup")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "speculate_k", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))}: use {', '.join(WORKLOADS)}")
    if args.peer_gguf is not None and not args.peer_gguf.is_file():
        parser.error(f"--peer_gguf {args.peer_gguf}: no such file")
    return args


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        device = args.device
        target, tokenizer, draft = load_models(
            args.target, device, args.dtype, args.compile, draft_checkpoint_path=args.draft, rows=args.speculate_k + 1
        )
        if tokenizer.chat_template is None:
            raise ValueError(f"{args.target} has no chat template: the workloads are chat turns")
        args.eos_ids = tokenizer.eos_ids
        text = EDITED_FILE.read_text()
        prompts = {
            name: tokenizer.encode_chat([{"role": "user", "content": WORKLOADS[name].format(file=text)}])
            for name in args.workloads
        }
        for m in (target, draft) if draft is not None else (target,):  # one cache for every run: nothing recompiles
            ensure_caches(m, 1, max(map(len, prompts.values())), args.max_new_tokens + args.speculate_k + 1)
        steps = compile_steps(device, args.compile)
        print(
            f"target {args.target}, draft {args.draft}, k <= {args.speculate_k}, "
            f"{'compiled' if args.compile else 'eager'}, {target.tok_embeddings.weight.dtype}, {args.rounds} rounds",
            file=sys.stderr,
        )
        rows = []
        for name, prompt in prompts.items():
            rows += run_workload(name, prompt, target, draft, steps, args)
            print(table([r for r in rows if r["workload"] == name]), file=sys.stderr)
        if args.peer_gguf is not None:
            from transformers import AutoModelForCausalLM

            peer = AutoModelForCausalLM.from_pretrained(
                args.peer_gguf.parent, gguf_file=args.peer_gguf.name, dtype=torch.float32
            ).eval()
            rows += [peer_row(name, prompt, peer, args) for name, prompt in prompts.items()]
        print(table(rows))
        for r in rows:
            if r.get("round_costs_ms"):
                print(
                    f"{r['workload']}, {r['configuration']}: round costs {r['round_costs_ms']} ms, "
                    f"warm-up (compiles, measures) {r['warm_up_s']:.1f} s"
                )


if __name__ == "__main__":
    main()
