"""scripts/benchmark.py as a user runs it: one JSON row per configuration, figures that agree with each other."""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import gguf
import pytest
import torch

from bench_server import requests_of, run_clients
from benchmark import Config, Entry, chart_bars, gguf_variant, slower_configurations, table, time_rounds
from conftest import ROOT
from quantize import quantize_checkpoint


def run_benchmark(*args, env=None):
    command = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_benchmark_rows(tiny_checkpoint, tmp_path):
    chart = tmp_path / "chart.png"
    result = run_benchmark(
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--configs",
        "eager:float32,eager:int8:fused",
        "--draft",
        str(tiny_checkpoint),
        "--rounds",
        "2",
        "--prompt_length",
        "8",
        "--new_tokens",
        "6",
        "--json",
        "--chart",
        str(chart),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    png = (
        chart.read_bytes()
    )  # a PNG image (signature, then the IHDR chunk's width and height) of 10 x 5.5 in at 110 dpi
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1100, 605)
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temporary file left
    report = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {row["config"]: row for row in report["rows"]}
    assert list(rows) == [
        "ours eager float32 (library)",
        "ours eager float32 (library) + draft (k=4)",
        "ours eager int8 (fused)",
        "ours eager int8 (fused) + draft (k=4)",
    ]
    assert "| ours eager int8 (fused) |" in result.stdout  # the markdown table
    assert report["cpu"].endswith(f"ATen {torch.backends.cpu.get_cpu_capability()}")
    for row in rows.values():
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["compile_s"] is None
    # float32 reads every tensor in the checkpoint file but the (untied) embedding table, of which a step reads a
    # row: the bytes per token, and the bandwidth and MBU per token decoded, against that independent count.
    state = torch.load(tiny_checkpoint / "model.pth", weights_only=True)
    assert "output.weight" in state
    read = sum(t.numel() * t.element_size() for name, t in state.items() if name != "tok_embeddings.weight")
    row = rows["ours eager float32 (library)"]
    assert row["weights_mb_per_token"] == pytest.approx(read / 1e6)
    assert row["achieved_gb_s"] * 1e9 / row["decode_tokens_per_s"] == pytest.approx(read, rel=1e-3)
    assert row["mbu"] * report["copy_bandwidth_gb_s"] * 1e9 / row["decode_tokens_per_s"] == pytest.approx(
        read, rel=1e-3
    )
    # int8 weights: about a quarter of the float32 bytes (plus float32 scales, norms and the embedding row)
    int8, float32 = rows["ours eager int8 (fused)"], rows["ours eager float32 (library)"]
    assert int8["weights_mb_per_token"] < 0.45 * float32["weights_mb_per_token"]


def test_own_quantized_copy_as_draft_and_no_recompiles(tiny_checkpoint):
    """--draft int8: the target's own int8 copy drafts (what the GPU check runs on random weights); compiled rows
    compile nothing after their warm-up."""
    args = ["--configs", "compiled:float32", "--draft", "int8", "--rounds", "2", "--prompt_length", "8"]
    result = run_benchmark("--checkpoint_path", str(tiny_checkpoint), *args, "--new_tokens", "12", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["config"], r["recompiles"]) for r in rows] == [
        ("ours compiled float32 (fused)", 0),
        ("ours compiled float32 (fused) + draft (k=4)", 0),
    ]
    assert all(r["compile_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)


def test_compiled_prefill_compiles_once(tiny_checkpoint):
    """--compile_prefill: a compiled configuration's prefill is compiled too (TorchDynamo's log says it traces
    decode.prefill), in its warm-up, and the timed runs compile nothing more; an eager one stays eager."""
    args = ["--configs", "compiled:float32,eager:float32", "--compile_prefill", "--rounds", "2", "--prompt_length", "8"]
    env = dict(os.environ, TORCH_LOGS="dynamo")
    result = run_benchmark("--checkpoint_path", str(tiny_checkpoint), *args, "--new_tokens", "4", "--json", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("torchdynamo start tracing prefill") == 1
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["config"], r["recompiles"]) for r in rows] == [
        ("ours compiled float32 (fused), prefill compiled", 0),
        ("ours eager float32 (library)", 0),
    ]


def test_check_flags_compiled_slower_than_eager_and_quantized_slower_than_float32():
    def entry(name, config, *speeds, prefill=100):
        runs = [{"decode_tokens_per_s": s, "prefill_tokens_per_s": prefill} for s in speeds]
        return Entry(name, None, config.precision, config, compiled=config.compiled, runs=runs)

    f32, int8, int4 = (Config(True, p, "auto") for p in ("float32", "int8", "int4"))
    float32 = entry("f32 compiled", f32, 30, 28, 29)  # median 29
    fast, slow = entry("int8 compiled", int8, 40, 41, 20), entry("int4 compiled", int4, 28, 35, 27, prefill=85)
    eager_int8 = entry("int8 eager", Config(False, "int8", "auto"), 45, 45, 45)  # no eager float32 to compare with
    eager_int4 = entry("int4 eager", Config(False, "int4", "auto"), 20, 20, 20)  # prefills 100: int4's 85 is slower
    library = entry("int8 compiled library", Config(True, "int8", "library"), 50, 50, 50)  # no eager library
    peer = Entry("llama.cpp Q8_0", None, runs=[{"decode_tokens_per_s": 1, "prefill_tokens_per_s": 1}] * 3)
    problems = slower_configurations([float32, fast, slow, eager_int8, eager_int4, library, peer])
    assert sorted(problems) == [
        "int4 compiled decodes 28.0 tok/s, f32 compiled 29.0",
        "int4 compiled prefills 85 tok/s, int4 eager 100",
        "int8 compiled decodes 40.0 tok/s, int8 eager 45.0",
    ]
    assert slower_configurations([float32, fast, library]) == []
    # a prefill within 10% of the eager one's (the same code: the run's noise) passes
    assert (
        slower_configurations([entry("int8", int8, 50, prefill=91), entry("eager", Config(False, "int8", "auto"), 45)])
        == []
    )


def test_rounds_run_each_configuration_beside_its_peer_and_compare_the_pairs():
    """Each of ours runs right beside its llama.cpp copy, first in even rounds and second in odd ones (A B B A); the
    ratio to llama.cpp is the median of the pairs' ratios, in which the host's speed of the moment cancels."""
    order = []

    def runner(name, speeds):
        speeds = iter(speeds)

        def run():
            order.append(name)
            speed = next(speeds)
            return {"decode_tokens_per_s": speed, "prefill_tokens_per_s": 2 * speed, "time_to_first_token_s": 1.0}

        return run

    # the host slow, then fast, then middling: ours 1.5x its peer in two pairs of three, 0.5x in the last
    ours = Entry("ours", runner("ours", [15, 120, 50]), "float32", Config(True, "float32", "auto"), "llama.cpp F32")
    peer, alone = Entry("llama.cpp F32", runner("peer", [10, 80, 100])), Entry("hf", runner("alone", [1, 2, 3]))
    entries = [ours, peer, alone]
    time_rounds(argparse.Namespace(rounds=3), entries)
    assert order == ["ours", "peer", "alone", "peer", "ours", "alone", "ours", "peer", "alone"]
    _, rows = table(entries, 1.0, torch.device("cpu"))
    assert rows[0]["vs_llama_cpp_decode"] == rows[0]["vs_llama_cpp_prefill"] == 1.5
    assert rows[0]["decode_tokens_per_s"] / rows[1]["decode_tokens_per_s"] == 50 / 80  # the medians' ratio


def test_check_needs_a_pair_to_compare():
    result = run_benchmark("--configs", "compiled:int8,eager:float32", "--check")
    assert result.returncode == 2 and "--check compares" in result.stderr


def test_a_checkpoint_file_as_a_configuration(tiny_checkpoint):
    """compiled:FILE.pth runs the file as it is: its precision from its quantization, named in the row."""
    int4 = quantize_checkpoint(tiny_checkpoint / "model.pth", "int4", 32)
    short = ["--rounds", "1", "--json", "--prompt_length", "4", "--new_tokens", "4"]
    result = run_benchmark("--checkpoint_path", str(tiny_checkpoint), "--configs", f"eager:{int4}", *short)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert row["config"].startswith(f"ours eager int4 {int4.name} (") and row["decode_tokens_per_s"] > 0
    missing = run_benchmark("--configs", "eager:/nonexistent/model.pth")
    assert missing.returncode == 2 and "checkpoint file /nonexistent/model.pth not found" in missing.stderr


def test_chart_sets_each_precision_beside_its_comparable_peers():
    def entry(name, precision=None, compiled=False):
        return Entry(name, None, precision, compiled=compiled)

    f32, int4 = entry("ours compiled float32", "float32", True), entry("ours eager int4", "int4")
    draft = entry("ours compiled float32 + draft (k=4)", "float32", True)
    q41, q80, hf = entry("llama.cpp Q4_1"), entry("llama.cpp Q8_0"), entry("transformers eager float32")
    groups = chart_bars([f32, draft, int4, q41, q80, hf])
    assert groups == {
        "float32": [("ours compiled", f32), ("transformers eager", hf)],
        "int4": [("ours eager", int4), ("llama.cpp", q41)],
    }


def test_chart_needs_an_existing_folder(tmp_path):
    result = run_benchmark("--chart", str(tmp_path / "missing" / "chart.png"))
    assert result.returncode == 2 and "--chart: folder" in result.stderr and "not found" in result.stderr


def test_start_times_generate_in_new_processes(tiny_checkpoint):
    """--start runs generate.py --compile twice per compiled config (empty inductor cache, then filled), int8 from
    a checkpoint quantized in a temporary folder: the user's folder gains no file."""
    before = sorted(p.name for p in tiny_checkpoint.iterdir())
    result = run_benchmark(
        "--checkpoint_path",
        str(tiny_checkpoint),
        "--configs",
        "compiled:int8",
        "--start",
        "--rounds",
        "1",
        "--prompt_length",
        "4",
        "--new_tokens",
        "4",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert row["first_start_s"] > 0 and row["start_s"] > 0 and row["compile_s"] > 0
    assert f"| {row['first_start_s']:.1f} | {row['start_s']:.1f} |" in result.stdout
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == before
    assert "--start runs generate.py on a checkpoint" in run_benchmark("--shape", "smollm2-135m", "--start").stderr


def test_gguf_variant_by_llama_quantize(tmp_path):
    """A llama-quantize binary makes the copy: called as llama.cpp documents it (--allow-requantize, source, output,
    type, threads), its output moved into place whole, then reused; a failure raises its last line and leaves no
    file behind; a source already of the type is its own copy."""
    source = tmp_path / "model.Q4_1.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    calls = tmp_path / "calls"
    quantize = tmp_path / "llama-quantize"
    quantize.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$4" = Q8_0 ] || {{ echo "bad type $4" >&2; exit 1; }}\necho made > "$3"\n'
    )
    quantize.chmod(0o755)

    copy = gguf_variant(source, "Q8_0", 2, quantize)
    assert copy == tmp_path / "model.Q4_1.bench-Q8_0.gguf" and copy.read_text() == "made\n"
    assert calls.read_text().split() == ["--allow-requantize", str(source), str(copy.with_suffix(".tmp")), "Q8_0", "2"]
    assert gguf_variant(source, "Q8_0", 2, quantize) == copy and len(calls.read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="could not make a F32 copy .*: bad type F32"):
        gguf_variant(source, "F32", 2, quantize)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls", "llama-quantize", copy.name, source.name]
    assert gguf_variant(source, "Q4_1", 2, quantize) == source and len(calls.read_text().splitlines()) == 2


def test_mixed_load_sends_the_document_once_the_other_streams_run():
    """bench_server's mixed load: the clients whose requests carry the document send them only after every other
    client's first reply has begun to stream, so that the document enters beside running streams on any server."""
    seen = []  # (what, whose request, when), in the order the stub server saw them

    class Stub(BaseHTTPRequestHandler):
        def do_POST(self):
            message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][0]["content"]
            whose = "document" if message.startswith("DOC") else message
            seen.append(("request", whose, time.perf_counter()))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                time.sleep(0.05)
                if i == 0:
                    seen.append(("text", whose, time.perf_counter()))
                chunk = {"choices": [{"delta": {"content": f"t{i}"}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"completion_tokens": 3}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = SimpleNamespace(requests=2, max_tokens=3, ignore_eos=True)
        _, answers = run_clients(f"http://127.0.0.1:{server.server_port}", "mixed", 4, args, "DOC")
    finally:
        server.shutdown()
        server.server_close()
    assert len(answers) == 8 and all(a.tokens == 3 for a in answers)
    firsts = [messages[0] for messages in requests_of("mixed", 4, 2, "DOC")[1:]]  # the chat clients' first requests
    first_texts = [when for what, whose, when in seen if what == "text" and whose in firsts]
    documents = [when for what, whose, when in seen if what == "request" and whose == "document"]
    assert len(first_texts) == 3 and len(documents) == 2 and min(documents) > max(first_texts)
