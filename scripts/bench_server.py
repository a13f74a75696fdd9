"""server.py under concurrent clients, side by side with llama.cpp's llama-server on the same GGUF.

    python scripts/bench_server.py --llama_server PATH/llama-server        # SmolLM2 float32 beside F32
    python scripts/bench_server.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model_int8.pth \\
        --llama_server PATH/llama-server                                   # int8 beside Q8_0
    python scripts/bench_server.py --clients 1,8 --max_tokens 64 --requests 1 --no-compile   # ours alone
    python scripts/bench_server.py --checkpoint_path checkpoints/Qwen2.5-Coder-1.5B-Instruct/model_int8.pth \
        --workloads edit --clients 4 --requests 1 --max_tokens 256 --no-ignore_eos --ngram   # prompt lookup

Workloads (--workloads): "chat": C clients each send --requests streamed chat requests in turn, on a connection of their
own (different questions, greedy, --max_tokens tokens: ignore_eos, as both servers take it, so that both do the same
work even where their greedy texts part), all starting together; "mixed": the same, but the requests of every fourth
client (the first, the fifth, ...) begin with a document of --document_tokens tokens, a long prompt entering while the
other streams run: those clients start once every other client's first reply streams. Each row: total tokens/s
(completion tokens of all requests / wall time from the first request sent to the last answer, both summed over the
rounds), time to first token (TTFT: from sending a request to its first streamed text) p50 and p95, the largest gap
between two pieces of text of one stream, and the streams' decode rate (tokens after the first / time from the first to
the last). "edit": every request is speculative_demo.py's code edit (a 160-line file, "rename a method, return the whole
file"), what prompt lookup speeds up: with --ngram, server.py --ngram runs every row too, its ratio against server.py's.

llama-server (build it as README says) serves the GGUF the checkpoint came from (--gguf) at the checkpoint's
precision (float32: F32, int8: Q8_0, int4: Q4_1, a checkpoint of GGUF blocks: the GGUF's own type; llama.cpp makes
the copy: the llama-quantize built beside llama-server, else llama-cpp-python), with as many slots, the same context
per slot and the same threads, continuous batching. server.py runs
with --max_batch_size the most clients. Both servers are up together, each idle while the other is measured. Each
row runs its load --rounds times on each server, the order of the servers reversed every other round (server.py,
llama-server, llama-server, server.py, ...), so that the host's drift over a row weighs on both alike; a row's
figures are over all its rounds (each round of each mixed row has a document of its own, which neither server has
seen before). One request warms up each server first; each server's start time is printed
(server.py --compile compiles its decode graphs before it serves). The single-stream check: eight of the questions
one at a time, each through generate.py's compiled decode (Stream, in this process), through server.py (up and idle)
twice, and through generate.py again, just before the rows: their decode rates over the eight.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmark import DEFAULT_GGUF, LLAMA_CPP_TYPES, cpu_has_amx, gguf_file_type, gguf_variant  # noqa: E402
from chat import encode_conversation  # noqa: E402
from checkpoint import (  # noqa: E402
    DEFAULT_CHECKPOINT,
    KV_CACHE_DTYPES,
    HelpFormatter,
    load_checkpoint,
    resolve_checkpoint,
    user_errors,
)
from decode import Stream, compile_steps  # noqa: E402
from generate import load_models  # noqa: E402
from kernels import MATVECS  # noqa: E402
from speculative_demo import EDITED_FILE, WORKLOADS  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

# --kv_cache_dtype as llama-server's cache types (-ctk, -ctv); its default is f16
LLAMA_CACHE_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
SINGLE_STREAM = 8  # questions the single-stream check asks: the host's speed moves from one to the next
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
DOCUMENT_SOURCES = ["README.md", "docs/usage.md", "docs/serving.md", "docs/performance.md"]  # the mixed load's text


@dataclass
class Answer:
    """One streamed request as its client saw it."""

    ttft: float  # from sending to the first text
    tokens: int  # completion tokens (usage)
    span: float  # from the first text to the last
    largest_gap: float  # between two pieces of text


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(server: str, workload: str, clients: int, wall: float, answers: list[Answer]) -> dict:
    tokens = sum(a.tokens for a in answers)
    span = sum(a.span for a in answers)
    return {
        "server": server,
        "workload": workload,
        "clients": clients,
        "requests": len(answers),
        "completion_tokens": tokens,
        "wall_s": wall,
        "total_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile([a.ttft for a in answers], 50),
        "ttft_p95_s": percentile([a.ttft for a in answers], 95),
        "largest_gap_s": max(a.largest_gap for a in answers),
        "decode_tokens_per_s": sum(a.tokens - 1 for a in answers) / span if span else float("nan"),
    }


def carries_document(workload: str, c: int) -> bool:
    """Whether client c's requests begin with the mixed load's document."""
    return workload == "mixed" and c % 4 == 0


def requests_of(workload: str, clients: int, per_client: int, document: str) -> list[list[str]]:
    """Client c's messages, in the order it sends them."""
    if workload == "edit":
        return [[WORKLOADS["code edit"].format(file=EDITED_FILE.read_text())] * per_client for _ in range(clients)]
    return [
        [
            (document + "\n\n" if carries_document(workload, c) else "") + QUESTIONS[(c + r * clients) % len(QUESTIONS)]
            for r in range(per_client)
        ]
        for c in range(clients)
    ]


def documents_of(tokenizer, length: int, count: int) -> list[str]:
    """count documents for the mixed load: the project's docs, cut in pieces of length tokens."""
    text = "\n\n".join((ROOT / name).read_text() for name in DOCUMENT_SOURCES)
    ids = tokenizer.encode(text)
    if len(ids) < length * count:
        sys.exit(
            f"error: the docs hold {len(ids)} tokens, fewer than the {count} documents of {length} that the rows need"
        )
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


def wait_for(process: subprocess.Popen, url: str, name: str) -> float:
    """Seconds until url/health answers 200 (llama-server answers 503 while it loads)."""
    start = time.perf_counter()
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            sys.exit(f"error: {name} exited before serving")
        time.sleep(0.2)


def ours_command(args, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "server.py"),
        "--checkpoint_path",
        str(args.checkpoint_path),
        "--port",
        str(port),
        "--max_batch_size",
        str(max(args.clients)),
        "--max_seq_length",
        str(args.max_seq_length),
        "--kernels",
        args.kernels,
        *(["--kv_cache_dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []),
        *(["--prefill_chunk", str(args.prefill_chunk)] if args.prefill_chunk is not None else []),
        *(
            ["--prefill_chunk_while_decoding", str(args.prefill_chunk_while_decoding)]
            if args.prefill_chunk_while_decoding is not None
            else []
        ),
        *(["--stream_interval", str(args.stream_interval)] if args.stream_interval != 1 else []),
        *(["--http_nice", str(args.http_nice)] if args.http_nice is not None else []),
        *flags,
    ] + ["--compile"] * args.compile


def peer_gguf(args) -> tuple[Path, str]:
    """The GGUF llama-server serves, at the checkpoint's precision, and its llama.cpp type."""
    quantization = load_checkpoint(args.checkpoint_path)[1]
    if quantization is not None and quantization.get("method") == "gguf":
        return args.gguf, gguf_file_type(args.gguf)
    kind = LLAMA_CPP_TYPES[quantization["mode"] if quantization else "float32"]
    quantize = args.llama_server.with_name("llama-quantize")  # built beside llama-server (README)
    quantize = quantize if os.access(quantize, os.X_OK) else None
    try:
        return gguf_variant(args.gguf, kind, torch.get_num_threads(), quantize), kind
    except ImportError:
        raise ValueError(
            f"a {kind} copy of {args.gguf} is made by llama.cpp: build llama-quantize beside {args.llama_server} "
            "(README) or pip install llama-cpp-python"
        ) from None


def llama_server_command(args, port: int, gguf: Path) -> list[str]:
    slots = max(args.clients)
    return [
        str(args.llama_server),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * args.max_seq_length),
        "-t",
        str(torch.get_num_threads()),
        "-cb",
        "--no-webui",
        "--log-disable",
        *(["-ctk", cache, "-ctv", cache] if (cache := LLAMA_CACHE_TYPES.get(args.kv_cache_dtype)) else []),
        # as benchmark.py's llama.cpp: its AMX weight buffers crash on such CPUs (llama.cpp issue 20824; llama-server
        # dies of an illegal instruction serving Q8_0), so plain ones
        *(["--no-repack"] if cpu_has_amx() else []),
    ]


def one_request(
    http: httpx.Client,
    url: str,
    message: str,
    max_tokens: int,
    ignore_eos: bool = False,
    streaming: threading.Event | None = None,
) -> Answer:
    """One streamed chat request on the client's connection, which stays open between its requests as an OpenAI SDK
    client's pool does (a connection per request would add its setup, on the same cores, to every TTFT). As that
    client does, a request the server closed the connection on before answering is sent again (llama-server closes
    kept-alive connections at times); its TTFT counts from the first try. streaming is set at its first text."""
    body = {
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    start, pieces, tokens = time.perf_counter(), [], 0
    for tries_left in (2, 1, 0):
        try:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        pieces.append(time.perf_counter())
                        if streaming is not None:
                            streaming.set()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            break
        except httpx.RemoteProtocolError:
            if pieces or not tries_left:
                raise
    gaps = [b - a for a, b in zip(pieces, pieces[1:])]
    return Answer(pieces[0] - start, tokens, pieces[-1] - pieces[0], max(gaps, default=0.0))


def run_clients(url: str, workload: str, clients: int, args, document: str) -> tuple[float, list[Answer]]:
    """The load on one server: its wall time and its answers. A client whose requests carry the document starts once
    every other client's first reply streams, so that the document enters while streams run on either server (sent
    all at once, which request a server read first decided whether any stream was running when the document came)."""
    answers, streaming = [], [threading.Event() for _ in range(clients)]

    def client(c: int, messages: list[str]):
        if carries_document(workload, c):
            for other, event in enumerate(streaming):
                if not carries_document(workload, other):
                    event.wait()
        with httpx.Client(timeout=600) as http:
            try:
                for message in messages:
                    answers.append(one_request(http, url, message, args.max_tokens, args.ignore_eos, streaming[c]))
            finally:  # a client that failed holds no one back
                streaming[c].set()

    messages = requests_of(workload, clients, args.requests, document)
    threads = [threading.Thread(target=client, args=(c, m)) for c, m in enumerate(messages)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, answers


def run_row(urls: dict[str, str], workload: str, clients: int, args, documents: list[str]) -> list[dict]:
    """A row's summary for each server: the load --rounds times on each, the order of the servers reversed every
    other round, the rates over all rounds together."""
    walls, answers = dict.fromkeys(urls, 0.0), {name: [] for name in urls}
    for r, document in enumerate(documents):
        for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
            wall, got = run_clients(urls[name], workload, clients, args, document)
            walls[name] += wall
            answers[name] += got
    return [summary(name, workload, clients, walls[name], answers[name]) for name in urls]


def start_server(command: list[str], port: int, name: str, processes: list[subprocess.Popen]) -> tuple[str, float]:
    """Starts a server (added to processes, for the caller to stop) and warms it up with one request: its url and
    the seconds until it served."""
    processes.append(subprocess.Popen(command, cwd=ROOT))  # its log goes to stderr
    url = f"http://127.0.0.1:{port}"
    started = wait_for(processes[-1], url, name)
    with httpx.Client(timeout=600) as http:
        one_request(http, url, QUESTIONS[0], 4)
    return url, started


def single_stream(args, url: str) -> dict:
    """generate.py's compiled (or eager) decode and server.py's one stream, tokens/s over the same chat questions:
    each question through both back to back, in the order generate.py, server, server, generate.py (the server
    idle meanwhile), so that a drift of the host's speed over the pair weighs on both alike."""
    cpu = torch.device("cpu")
    model, tokenizer, _ = load_models(
        args.checkpoint_path, cpu, compiled=args.compile, matvec=args.kernels, kv_cache_dtype=args.kv_cache_dtype
    )
    steps = compile_steps(cpu, args.compile)
    prompts = [encode_conversation(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:SINGLE_STREAM]]
    # One cache for all requests, as large as the longest needs, so that the compiled step never recompiles.
    model.setup_caches(1, max(map(len, prompts)) + args.max_tokens)
    Stream(model, tokenizer, "warm-up", 4, steps=steps).run()
    tokens = seconds = 0.0
    served = []

    def generated(ids):
        nonlocal tokens, seconds
        result = Stream(model, tokenizer, ids, args.max_tokens, steps=steps).run()
        tokens += len(result.raw_tokens[0]) - 1
        seconds += result.decode_time_s

    with httpx.Client(timeout=600) as http:
        for question, ids in zip(QUESTIONS, prompts):
            generated(ids)
            served += [one_request(http, url, question, args.max_tokens, args.ignore_eos) for _ in range(2)]
            generated(ids)
    server_rate = sum(a.tokens - 1 for a in served) / sum(a.span for a in served)
    return {"generate_decode_tokens_per_s": tokens / seconds, "server_decode_tokens_per_s": server_rate}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--llama_server", type=Path, default=None, help="llama.cpp's llama-server binary: the peer")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF of the checkpoint's model, for the peer")
    p.add_argument(
        "--clients",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 16],
        help="comma-separated numbers of concurrent clients",
    )
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["chat", "mixed"], help="chat, mixed, edit")
    p.add_argument("--requests", type=int, default=2, help="requests per client, sent one after another")
    p.add_argument(
        "--rounds", type=int, default=2, help="times each row's load runs on each server, in the order A B B A ..."
    )
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument(
        "--ignore_eos", action=argparse.BooleanOptionalAction, default=True, help="every reply max_tokens long"
    )
    p.add_argument("--document_tokens", type=int, default=1500, help="the mixed load's document")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kernels", choices=MATVECS, default="auto", help="as generate.py's flag")
    p.add_argument("--max_seq_length", type=int, default=2048, help="positions per slot, both servers")
    p.add_argument(
        "--kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="server.py's (default: the model's dtype); llama-server's too for float32, bfloat16 and float16 "
        "(otherwise its default, float16)",
    )
    p.add_argument(
        "--prefill_chunk", type=int, default=None, help="server.py's: prompt tokens per step (default: its default)"
    )
    p.add_argument(
        "--prefill_chunk_while_decoding",
        type=int,
        default=None,
        help="server.py's: prompt tokens per step while others decode (default: its default)",
    )
    p.add_argument("--stream_interval", type=int, default=1, help="server.py's: a stream's tokens per chunk")
    p.add_argument("--http_nice", type=int, default=None, help="server.py's (default: its default)")
    p.add_argument("--port", type=int, default=8765, help="server.py's; llama-server's is the next")
    p.add_argument("--ngram", action="store_true", help="server.py --ngram too, each row beside server.py's")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if min(args.clients) < 1 or min(args.requests, args.max_tokens, args.rounds, args.stream_interval) < 1:
        p.error("--clients, --requests, --rounds, --max_tokens and --stream_interval must be positive")
    if args.http_nice is not None and not 0 <= args.http_nice <= 19:
        p.error(f"--http_nice must be in 0..19, got {args.http_nice}")
    for name in ("prefill_chunk", "prefill_chunk_while_decoding"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if not set(args.workloads) <= {"chat", "mixed", "edit"}:
        p.error(f"--workloads: of chat, mixed and edit, got {','.join(args.workloads)}")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama_server {args.llama_server} is not an executable file")
    if args.llama_server is not None and not args.gguf.is_file():
        p.error(f"GGUF file {args.gguf} not found (bash scripts/prepare.sh makes the default one)")
    args.checkpoint_path = resolve_checkpoint(args.checkpoint_path)
    return args


def main(argv=None):
    with user_errors():
        args = parse_args(argv)
        tokenizer = load_tokenizer(args.checkpoint_path.parent)
        peer = None if args.llama_server is None else peer_gguf(args)
    # a document for each round of each mixed row
    count = args.rounds * len(args.clients) if "mixed" in args.workloads else 0
    documents = iter(documents_of(tokenizer, args.document_tokens, count))
    servers = {"server.py": (ours_command(args, args.port), args.port)}
    if args.ngram:
        servers["server.py --ngram"] = (ours_command(args, args.port + 2, "--ngram"), args.port + 2)
    if peer is not None:
        gguf, kind = peer
        servers[f"llama-server {kind}"] = (llama_server_command(args, args.port + 1, gguf), args.port + 1)
    processes, urls, started = [], {}, {}
    try:
        for name, (command, port) in servers.items():
            urls[name], started[name] = start_server(command, port, name, processes)
        one_stream = single_stream(args, urls["server.py"])
        rows = [
            row
            for workload in args.workloads
            for clients in args.clients
            for row in run_row(
                urls,
                workload,
                clients,
                args,
                [next(documents) if workload == "mixed" else "" for _ in range(args.rounds)],
            )
        ]
    finally:
        for process in processes:
            process.terminate()
            process.wait()
    if args.json:
        print(json.dumps({"start_s": started, "single_stream": one_stream, "rows": rows}, indent=1))
        return
    print(
        f"{args.checkpoint_path}, {'compiled' if args.compile else 'eager'}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, greedy, max_tokens {args.max_tokens}"
        f"{' (ignore_eos)' if args.ignore_eos else ''}, "
        f"{max(args.clients)} slots of {args.max_seq_length}, KV cache {args.kv_cache_dtype or 'in the model dtype'} "
        f"(llama-server: {LLAMA_CACHE_TYPES.get(args.kv_cache_dtype, 'f16')})"
        f"{'' if args.prefill_chunk is None else f', prefill chunk {args.prefill_chunk}'}"
        f"{'' if (n := args.prefill_chunk_while_decoding) is None else f', prefill chunk while decoding {n}'}"
        f"{'' if args.stream_interval == 1 else f', server.py --stream_interval {args.stream_interval}'}"
        f"{'' if args.http_nice is None else f', server.py --http_nice {args.http_nice}'}, "
        f"{args.rounds} rounds a row; "
        "started in " + ", ".join(f"{name} {s:.0f} s" for name, s in started.items())
    )
    theirs = {(r["workload"], r["clients"]): r for r in rows if r["server"].startswith("llama-server")}
    plain = {(r["workload"], r["clients"]): r for r in rows if r["server"] == "server.py"}
    print(
        "| server | load | clients | tokens | total tok/s | vs peer | TTFT p50 s | TTFT p95 s | largest gap s |"
        " decode tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer = (plain if r["server"] == "server.py --ngram" else theirs).get((r["workload"], r["clients"]))
        ratio = f"{r['total_tokens_per_s'] / peer['total_tokens_per_s']:.2f}x" if peer and peer is not r else ""
        print(
            f"| {r['server']} | {r['workload']} | {r['clients']} | {r['completion_tokens']} | "
            f"{r['total_tokens_per_s']:.1f} | {ratio} | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | "
            f"{r['largest_gap_s']:.2f} | {r['decode_tokens_per_s']:.1f} |"
        )
    ours, theirs = one_stream["server_decode_tokens_per_s"], one_stream["generate_decode_tokens_per_s"]
    print(
        f"single stream ({SINGLE_STREAM} questions, each through generate.py, the idle server.py twice and "
        f"generate.py): server.py decodes {ours:.1f} tok/s, generate.py {theirs:.1f} tok/s: {ours / theirs:.2f}x"
    )


if __name__ == "__main__":
    main()
