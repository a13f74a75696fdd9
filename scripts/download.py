"""Download a Hugging Face model repository (weights, config, tokenizer) for convert_hf_checkpoint.py.

    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B \\
        --local_dir checkpoints/.downloads/meta-llama/Llama-3.2-1B

Gated repositories need a token: --hf_token or the HF_TOKEN environment variable.
"""

import argparse
import sys
from pathlib import Path

# Weights in safetensors where the repo has them; the .bin pattern is used only when it has none.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def download(repo_id: str, local_dir: Path, token: str | None = None) -> Path:
    from huggingface_hub import list_repo_files, snapshot_download

    files = list_repo_files(repo_id, token=token)
    patterns = (
        ALLOW_PATTERNS if any(f.endswith(".safetensors") for f in files) else ALLOW_PATTERNS + ["pytorch_model*.bin"]
    )
    # consolidated.* are Meta-format duplicates of the same weights.
    return Path(
        snapshot_download(
            repo_id,
            local_dir=local_dir,
            token=token,
            allow_patterns=patterns,
            ignore_patterns=["consolidated*", "original/*"],
        )
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", required=True, help="e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--local_dir", type=Path, required=True, help="where to put the files")
    parser.add_argument("--hf_token", default=None, help="token for gated repos (default: HF_TOKEN)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        path = download(args.repo_id, args.local_dir, args.hf_token)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # network, authentication and unknown-repo errors all end here
        sys.exit(f"error: could not download {args.repo_id}: {type(e).__name__}: {e}")
    print(f"downloaded {args.repo_id} to {path}")


if __name__ == "__main__":
    main()
