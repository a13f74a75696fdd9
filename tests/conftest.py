import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
import kernels  # noqa: E402
from convert_hf_checkpoint import convert_hf_checkpoint  # noqa: E402
from decode import inductor_cache_dir  # noqa: E402

# Every test that compiles does so in the CPU capability's own inductor cache, as decode.compile_steps does: a test
# calling torch.compile itself would otherwise share the folder of test.sh's AVX-512 and AVX2 passes, and be served
# the other ISA's code (docs/upstream-inductor-cache-isa.md).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())

SMOLLM2_DIR = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = ROOT / "checkpoints" / ".downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model's test prompts: 1 to 40+ tokens, prose, code, lists, numbers.
SMOLLM2_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there",
    "List three colours:",
    "1, 2, 3, 4,",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
# TEST_DEVICE=cuda runs the tests that take the `device` fixture (the numerics that make sense on a GPU) there, and
# skips the rest, which are CPU-only by nature or need what a GPU machine lacks (scripts/gpu_check.sh).
DEVICE_NAME = os.environ.get("TEST_DEVICE") or "cpu"
DEVICE = torch.device(DEVICE_NAME if re.fullmatch(r"cpu|cuda(:\d+)?", DEVICE_NAME) else "cpu")
# Their tests are all CPU-only, and they import packages a GPU machine may lack: the server's (openai, llguidance)
# and gguf.
CPU_ONLY_MODULES = ["test_server.py", "test_bad_inputs.py", "test_chat_reply.py", "test_grammar.py"]
collect_ignore = CPU_ONLY_MODULES if DEVICE.type != "cpu" else []
TINY_VOCAB = 320
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Naïve café déjà vu, Ærøskøbing, "
    "日本語のテキスト, 中文, Ελληνικά, русский текст, emoji 🙂🚀👩‍💻 and numbers 1234567890.\n"
    "def main():\n    return {'key': [1, 2, 3]}\n"
)


DYNAMO_RECOMPILE_LIMIT = torch._dynamo.config.recompile_limit


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo():
    """Dynamo keeps each function's compiled graphs for the whole process, up to recompile_limit, past which a
    fullgraph step fails: each test module starts without the graphs of the modules before it (they come back
    from the inductor cache in seconds when needed again), and with Dynamo's own limit, which a server Engine raises
    for the process: a module passes alone as it does in the suite."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = DYNAMO_RECOMPILE_LIMIT


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: compares numerically different paths; scripts/test.sh runs these twice on AVX-512 CPUs"
    )
    if str(DEVICE) != DEVICE_NAME:
        raise pytest.UsageError(f"TEST_DEVICE={DEVICE_NAME}: use cpu, cuda or cuda:N")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"TEST_DEVICE={DEVICE}, but torch sees no CUDA device")


def pytest_collection_modifyitems(config, items):
    if DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU only (TEST_DEVICE={DEVICE} runs the tests that take the device fixture)")
    for item in items:
        if "device" not in item.fixturenames:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def native_ops():
    """torch.ops.gpt_fast, kernels_cpu.cpp's operators, built on first use; without a C++ compiler the test is
    skipped, but under CI=true it fails: CI must not go green without the kernels."""
    if not kernels.native_kernels():
        assert os.environ.get("CI") != "true", "kernels_cpu.cpp did not build"
        pytest.skip("kernels_cpu.cpp did not build here (no C++ compiler?)")
    return torch.ops.gpt_fast


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where a test that takes this fixture runs its models: TEST_DEVICE (default cpu)."""
    return DEVICE


@torch.no_grad()
def assert_same_greedy(model, prompt: list[int], got: list[int], expected: list[int], margin: float):
    """Greedy continuations of prompt by two numerically different paths (batched and alone, compiled and
    eager, sharded and not, ours and transformers') must be equal, except that they may part at a near-tie:
    where model's float32 logits of the two tokens differ by less than margin, a bound on the logit
    difference between the paths that the caller states. A genuine fault moves logits far more than any
    such margin and so parts the outputs elsewhere too. What follows a parting is not compared."""
    part = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if part is None:
        assert len(got) == len(expected), (got, expected)
        return
    ids, device = prompt + expected[:part], model.tok_embeddings.weight.device
    model.setup_caches(1, len(ids))
    logits = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device))[0, -1]
    gap = (logits[got[part]] - logits[expected[part]]).abs().item()
    assert gap < margin, (
        f"outputs part at token {part} where the logits differ by {gap:.2e} (>= {margin}): {got} vs {expected}"
    )


@pytest.fixture(scope="session")
def tiny_tokenizer_json(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json with fewer than TINY_VOCAB tokens, trained on the spot."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - 8,
        special_tokens=["<|endoftext|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([SAMPLE_TEXT] * 20, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def make_hf_llama(
    folder: Path,
    tokenizer_json: Path,
    model_cls=None,
    config_cls=None,
    save_kwargs=None,
    seed=0,
    norm_noise=0.0,
    **overrides,
):
    """A tiny random transformers model saved with save_pretrained, plus a tokenizer. Returns the model.
    norm_noise: spread of random noise added to the norms' weights (and biases), which start as constants that
    hide a misplaced or misordered norm weight."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = (model_cls or LlamaForCausalLM)((config_cls or LlamaConfig)(**kwargs)).eval()
    # Default init (std 0.02) gives near-uniform logits and degenerate greedy text; wider weights don't.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                if norm_noise:  # drawn only when asked for: other models keep their random weights
                    p.add_(torch.randn_like(p) * norm_noise)
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, **(save_kwargs or {}))
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer_json) -> Path:
    """A converted tiny GQA model: checkpoint folder with model.pth, config.json and tokenizer."""
    hf_dir = tmp_path_factory.mktemp("hf_tiny")
    make_hf_llama(hf_dir, tiny_tokenizer_json, num_key_value_heads=2)
    out = tmp_path_factory.mktemp("ours") / "tiny"
    convert_hf_checkpoint(hf_dir, out)
    return out


def write_gguf(path, state_dict, config, tensor_type, arch="llama", skip_keys=()):
    """Writes our (already interleaved-rotary) weights as a GGUF file (no tokenizer), 2-D weights in tensor_type;
    metadata keys in skip_keys are left out."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    integers = {
        "block_count": config.n_layer,
        "context_length": config.block_size,
        "embedding_length": config.dim,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.n_head,
        "attention.head_count_kv": config.n_kv_heads,
        "rope.dimension_count": config.head_dim,
    }
    floats = {"rope.freq_base": config.rope_base, "attention.layer_norm_rms_epsilon": config.norm_eps}
    for key, value in {**integers, **floats}.items():
        if f"{arch}.{key}" not in skip_keys:
            (w.add_uint32 if key in integers else w.add_float32)(f"{arch}.{key}", value)
    names = {
        "tok_embeddings.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "output.weight": "output.weight",
    }
    layer_names = {
        "attention_norm.weight": "attn_norm.weight",
        "attention.wo.weight": "attn_output.weight",
        "feed_forward.w1.weight": "ffn_gate.weight",
        "feed_forward.w3.weight": "ffn_up.weight",
        "feed_forward.w2.weight": "ffn_down.weight",
        "ffn_norm.weight": "ffn_norm.weight",
    }
    q, kv = config.n_head * config.head_dim, config.n_kv_heads * config.head_dim
    for name, t in state_dict.items():
        parts = name.split(".")
        if name in names:
            items = [(names[name], t)]
        elif parts[3] == "wqkv":
            qw, kw, vw = t.split([q, kv, kv])
            items = [(f"blk.{parts[1]}.attn_{p}.weight", x) for p, x in zip("qkv", (qw, kw, vw))]
        else:
            items = [(f"blk.{parts[1]}.{layer_names['.'.join(parts[2:])]}", t)]
        for gname, x in items:
            x = x.float().numpy()
            if x.ndim == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
                w.add_tensor(gname, quantize(x, tensor_type), raw_dtype=tensor_type)
            else:
                w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
