import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

SMOLLM2_DIR = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = ROOT / "checkpoints" / ".downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_VOCAB = 320
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Naïve café déjà vu, Ærøskøbing, "
    "日本語のテキスト, 中文, Ελληνικά, русский текст, emoji 🙂🚀👩‍💻 and numbers 1234567890.\n"
    "def main():\n    return {'key': [1, 2, 3]}\n"
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


def make_hf_llama(folder: Path, tokenizer_json: Path, model_cls=None, config_cls=None, save_kwargs=None, seed=0, **overrides):
    """A tiny random transformers model saved with save_pretrained, plus a tokenizer. Returns the model."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, vocab_size=TINY_VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = (model_cls or LlamaForCausalLM)((config_cls or LlamaConfig)(**kwargs)).eval()
    # Default init (std 0.02) gives near-uniform logits and degenerate greedy text; wider weights don't.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, **(save_kwargs or {}))
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer_json) -> Path:
    """A converted tiny GQA model: checkpoint folder with model.pth, config.json and tokenizer."""
    from convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir = tmp_path_factory.mktemp("hf_tiny")
    make_hf_llama(hf_dir, tiny_tokenizer_json, num_key_value_heads=2)
    out = tmp_path_factory.mktemp("ours") / "tiny"
    convert_hf_checkpoint(hf_dir, out)
    return out
