"""eval.py's perplexity against transformers' loss on the same tokens."""
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_hf_llama
from convert_hf_checkpoint import convert_hf_checkpoint

from eval import perplexity
from generate import load_model

pytestmark = pytest.mark.numerics


def test_perplexity_matches_transformers(tmp_path, tiny_tokenizer_json):
    hf = make_hf_llama(tmp_path / "hf", tiny_tokenizer_json)
    convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours")
    model = load_model(tmp_path / "ours")
    tokens = torch.randint(0, 300, (200,)).tolist()
    with torch.no_grad():
        loss = hf(torch.tensor([tokens]), labels=torch.tensor([tokens])).loss.item()
    ppl, counted = perplexity(model, tokens, window=256, stride=256)
    assert counted == 199 and abs(ppl - math.exp(loss)) / math.exp(loss) < 1e-4
    # A sliding window scores every token once, each with at least window - stride tokens of context.
    ppl_sliding, counted = perplexity(model, tokens, window=64, stride=16)
    assert counted == 199 and abs(math.log(ppl_sliding) - loss) < 0.5

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    result = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--checkpoint_path", str(tmp_path / "ours"),
                             "--text_file", str(text), "--window", "128", "--json"], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] > 100 and report["perplexity"] > 1
