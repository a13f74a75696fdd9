"""Files a user hands us, and the files we write for them.

Reading never runs code from a file (torch.load with weights_only=True, memory-mapped). Writing goes
to a temporary file renamed at the end, so a failed run leaves nothing half-written. A fault in a
user's file or flag is a ValueError or OSError whose message names it; user_errors() turns those into
one line and a non-zero exit in every script, while any other exception (a bug of ours) keeps its
traceback.
"""

import argparse
import contextlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

import torch

from tokenizer import read_text

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct" / "model.pth"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv_cache_dtype's choices (every script that runs a model): how model.KVCache stores keys and values
KV_CACHE_DTYPES = {"int8": torch.int8, **DTYPES}
KV_CACHE_HELP = (
    "int8: codes and a float32 scale per position and head; float32, bfloat16, float16: the values rounded to it "
    "(default: the model's dtype)"
)
DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # --device's default in every script


@contextlib.contextmanager
def user_errors(quiet: bool = False):
    """The one error path of a script's main: a fault in the user's input ends the run with one line
    'error: ...' and status 1 (no line when quiet), Ctrl-C with status 130 and no output."""
    try:
        yield
    except KeyboardInterrupt:
        sys.exit(130)  # the shell's status for a process ended by SIGINT
    except BrokenPipeError:  # the reader of our output went away (| head): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except (ValueError, OSError) as e:
        sys.exit(1 if quiet else f"error: {describe(e)}")


def describe(e: Exception) -> str:
    # An OSError from the system ("[Errno 2] No such file or directory: 'x'") reads better as "x: No such file ...".
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def parse_device(name: str) -> torch.device:
    """--device of every script: cpu, cuda or cuda:N, refused unless this machine has it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {name!r}: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but this PyTorch build or machine has no CUDA GPU")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of every script: its docstring as written, and each flag's default where it has one."""

    def _get_help_string(self, action):
        default = action.default
        if (
            not action.help
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default in ("", [])
        ):
            return action.help
        return f"{action.help} (default: %(default)s)"


def device_flag(name: str) -> torch.device:
    """argparse type of --device (its message shown as argparse shows a bad flag)."""
    try:
        return parse_device(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def utf8_text(text: str) -> str:
    """argparse type of text flags: bytes that are not UTF-8 reach sys.argv as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return text


def prompt_lines(path: str) -> list[str]:
    """argparse type of --prompts_file: its non-blank lines."""
    try:
        lines = [line for line in read_text(Path(path)).splitlines() if line.strip()]
    except (ValueError, OSError) as e:
        raise argparse.ArgumentTypeError(describe(e)) from None
    if not lines:
        raise argparse.ArgumentTypeError(f"{path} holds no prompt")
    return lines


def resolve_checkpoint(checkpoint_path: str | Path) -> Path:
    """A checkpoint file, or the model.pth of a checkpoint folder."""
    path = Path(checkpoint_path)
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        hint = " (run: bash scripts/prepare.sh)" if path == DEFAULT_CHECKPOINT else ""
        raise FileNotFoundError(f"checkpoint not found: {path}{hint}")
    if path.suffix in (".gguf", ".safetensors"):  # a model file of another format: it needs converting first
        script = (
            "convert_gguf.py --gguf FILE"
            if path.suffix == ".gguf"
            else "convert_hf_checkpoint.py --checkpoint_dir FOLDER"
        )
        raise ValueError(
            f"{path}: not a checkpoint of ours; convert it first: python scripts/{script} --out_dir checkpoints/NAME"
        )
    return path


def load_tensor_file(path: str | Path) -> dict:
    """torch.load that never runs code from the file, memory-mapped; the file must hold a dict."""
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:  # the pickle asks for functions or classes beyond tensors: never run them
        what = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), "objects other than tensors")
        raise ValueError(f"refusing to load {path}: not a plain tensor file ({what})") from None
    except Exception:  # RuntimeError: not a zip file that torch.save wrote (mmap needs one), or a damaged one
        raise ValueError(
            f"refusing to load {path}: not a plain tensor file (not written by torch.save, or damaged)"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a {type(data).__name__}, not a dict of named tensors")
    return data


def load_checkpoint(path: Path) -> tuple[dict, dict | None]:
    """A model.pth -> (its tensors by name, its quantization format or None for a floating-point one)."""
    data = load_tensor_file(path)
    quantization = data.pop("quantization", None)
    if quantization is not None:  # {"quantization": format, "state_dict": tensors}, written by quantize.py
        if not isinstance(quantization, dict) or not isinstance(data.get("state_dict"), dict) or len(data) != 1:
            raise ValueError(f"{path}: a damaged quantized checkpoint (expected 'quantization' and 'state_dict')")
        data = data["state_dict"]
    return check_tensors(data, path), quantization


def check_tensors(data: dict, path: Path) -> dict:
    bad = [name for name, t in data.items() if not isinstance(name, str) or not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"{path}: entry {bad[0]!r} is not a tensor; not a checkpoint")
    return data


def save_atomic(obj, path: Path):
    """torch.save into a temporary file beside path, renamed to path once complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    set_ordinary_mode(tmp, 0o666)
    try:
        save_tensors(obj, tmp, shown_as=path)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def set_ordinary_mode(path, mode: int):
    """mkstemp and mkdtemp make private files and folders; a checkpoint is an ordinary one (mode less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def save_tensors(obj, path, shown_as=None):
    """torch.save, whose write failures (a full disk, a size limit) are RuntimeErrors: made an OSError naming
    the file."""
    try:
        torch.save(obj, path)
    except RuntimeError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"{shown_as or path}: writing failed (disk full or a file size limit?): {first_line}") from None
