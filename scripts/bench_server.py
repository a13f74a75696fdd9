"""server.py under concurrent clients, beside generate.py serving the same requests one after another.

    python scripts/bench_server.py                          # SmolLM2, compiled, 1 / 4 / 16 clients
    python scripts/bench_server.py --clients 1,8 --max_tokens 64 --requests 1 --no-compile
    python scripts/bench_server.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model_int8.pth --kernels fused

C clients each send --requests chat requests in turn (different questions, greedy, --max_tokens at most), all
starting together. Total tokens/s: completion tokens of all requests / wall time from the first request sent to
the last answer. Time to first token (TTFT): from sending a request to its first streamed text.
The baseline is the project's own generate.py path (Stream, compiled alike) in this process, serving the same
requests one at a time in arrival order: a request's TTFT includes its wait for the ones before it.
server.py --compile compiles its decode graphs before it serves (one per power-of-two batch, greedy and sampled);
the time it takes to start is printed. One request warms up each side before the timed rounds.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chat import encode_conversation  # noqa: E402
from checkpoint import DEFAULT_CHECKPOINT, HelpFormatter, resolve_checkpoint, user_errors  # noqa: E402
from decode import Stream, compile_steps  # noqa: E402
from generate import load_models  # noqa: E402
from kernels import MATVECS  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "What does a compiler do?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painter and one of their works.",
    "How do plants make food?",
    "Tell me a short joke.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a cat in one sentence.",
    "Summarize the story of Cinderella in two sentences.",
    "What are the three states of matter?",
]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(label: str, clients: int, wall: float, tokens: int, ttfts: list[float]) -> dict:
    return {
        "server": label,
        "clients": clients,
        "requests": len(ttfts),
        "completion_tokens": tokens,
        "wall_s": wall,
        "total_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
    }


def requests_of(clients: int, per_client: int) -> list[list[str]]:
    """Client c's questions, in the order it sends them."""
    return [[QUESTIONS[(c + r * clients) % len(QUESTIONS)] for r in range(per_client)] for c in range(clients)]


def start_server(args) -> tuple[subprocess.Popen, str, float]:
    """Starts server.py; returns it, its address and the seconds it took to answer /health."""
    url, start = f"http://127.0.0.1:{args.port}", time.perf_counter()
    command = [
        sys.executable,
        str(ROOT / "server.py"),
        "--checkpoint_path",
        str(args.checkpoint_path),
        "--port",
        str(args.port),
        "--max_batch_size",
        str(max(args.clients)),
        "--max_seq_length",
        str(args.max_seq_length),
        "--kernels",
        args.kernels,
    ] + ["--compile"] * args.compile
    process = subprocess.Popen(command, cwd=ROOT)  # its log (compiles, one line per request) goes to stderr
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, time.perf_counter() - start
        except httpx.TransportError:
            if process.poll() is not None:
                sys.exit("error: server.py exited before serving")
        time.sleep(0.2)


def one_request(url: str, question: str, max_tokens: int) -> tuple[float, int]:
    """Sends one streamed chat request; returns (time to first text, completion tokens)."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


def run_clients(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    results = []

    def client(questions):
        for question in questions:
            results.append(one_request(url, question, max_tokens))

    threads = [threading.Thread(target=client, args=(q,)) for q in requests_of(clients, per_client)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return summary("server.py", clients, wall, sum(n for _, n in results), [t for t, _ in results])


def run_sequential(model, tokenizer, steps, clients: int, per_client: int, max_tokens: int) -> dict:
    """The same requests served one at a time: client c's r-th request is sent when its previous one ends, and
    waits for every request queued before it (round r of all clients, in turn)."""
    questions = requests_of(clients, per_client)
    sent, clock, ttfts, tokens = [0.0] * clients, 0.0, [], 0
    for r in range(per_client):
        for c in range(clients):
            ids = encode_conversation(tokenizer, [{"role": "user", "content": questions[c][r]}])
            start = time.perf_counter()
            result = Stream(model, tokenizer, ids, max_tokens, steps=steps).run()
            took = time.perf_counter() - start
            ttfts.append(clock - sent[c] + result.time_to_first_token_s)
            clock += took
            sent[c] = clock
            tokens += len(result.raw_tokens[0])
    return summary("generate.py, one at a time", clients, clock, tokens, ttfts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument(
        "--clients",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16],
        help="comma-separated numbers of concurrent clients",
    )
    p.add_argument("--requests", type=int, default=2, help="requests per client, sent one after another")
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kernels", choices=MATVECS, default="auto", help="as generate.py's flag, for both sides")
    p.add_argument("--max_seq_length", type=int, default=2048, help="server.py's positions per slot")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if min(args.clients) < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--clients, --requests and --max_tokens must be positive")
    args.checkpoint_path = resolve_checkpoint(args.checkpoint_path)
    return args


def main(argv=None):
    with user_errors():
        args = parse_args(argv)
    rows = []
    process, url, started = start_server(args)
    try:
        one_request(url, QUESTIONS[0], 4)
        for clients in args.clients:
            rows.append(run_clients(url, clients, args.requests, args.max_tokens))
    finally:
        process.terminate()
        process.wait()
    cpu = torch.device("cpu")
    model, tokenizer, _ = load_models(args.checkpoint_path, cpu, compiled=args.compile, matvec=args.kernels)
    steps = compile_steps(cpu, args.compile)
    # One cache for all requests, as large as the longest needs, so that the compiled step never recompiles.
    longest = max(len(encode_conversation(tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS)
    model.setup_caches(1, longest + args.max_tokens)
    Stream(model, tokenizer, "warm-up", 4, steps=steps).run()
    for clients in args.clients:
        rows.append(run_sequential(model, tokenizer, steps, clients, args.requests, args.max_tokens))
    if args.json:
        print(json.dumps({"server_start_s": started, "rows": rows}, indent=1))
        return
    print(
        f"{args.checkpoint_path}, {'compiled' if args.compile else 'eager'}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, greedy, max_tokens {args.max_tokens}; "
        f"server.py --max_seq_length {args.max_seq_length} started in {started:.0f} s"
    )
    print("| server | clients | requests | tokens | wall s | total tok/s | TTFT p50 s | TTFT p95 s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['clients']} | {r['requests']} | {r['completion_tokens']} | {r['wall_s']:.1f} | "
            f"{r['total_tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
