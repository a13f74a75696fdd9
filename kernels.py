"""How a linear layer runs: on a CPU, the kernel choice (Kernels), the fused multiply-and-sum and the library
paths; the int8 and int4 layers' forward on CPU and CUDA. model.py builds its layers from Linear, quantize.py
swaps in Int8Linear / Int4Linear and writes the formats they read.

The int4 weight arrives in a device-neutral packing (two 4-bit codes a byte, see quantize.pack_int4); prepare()
makes the layout of the device's int4 kernel (_weight_int4pack_mm on CUDA, _weight_int4pack_mm_for_cpu on CPU).
With Kernels.int8_native / int4_native, int8 and int4 products run kernels_cpu.cpp (integer dot products, built on
first use by native_kernels; the operators gpt_fast::int8_linear and gpt_fast::int4_linear, which torch.compile
traces through), all but those of many rows where the CPU has bfloat16 matrix products (runs_native).
"""

import ctypes
import functools
import hashlib
import math
import mmap
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# From this many rows, a CPU widens half-precision weights (and int8 ones off kernels_cpu.cpp) for a matrix product
GEMM_ROWS = 16
# From this many rows, a CPU with bfloat16 matrix products (AVX512-BF16 without AMX) widens int8/int4 weights to
# bfloat16 for one product instead of running kernels_cpu.cpp (Kernels.widen_rows; docs/performance.md); with AMX,
# whose products of the widened weights are faster, from AMX_WIDEN_ROWS.
WIDEN_ROWS = 80
AMX_WIDEN_ROWS = 48
# From this many rows, a float32 product reads its weight's copy in oneDNN's blocked layout where the kernels keep one
# (Kernels.packed_float, onednn_layout): given the plain weight, oneDNN reorders it into that layout at every call,
# which at these rows costs about as much as the product; fewer rows fuse (compiled steps) or read the plain weight.
PACKED_ROWS = 8
# decode steps' attention of this many rows or more (one group's, model.Attention.attend) runs kernels_cpu.cpp's
# decode_attention: its work is one item per row and KV head, too few for 2 threads to share evenly below
NATIVE_ATTENTION_ROWS = 4
NATIVE_SOURCE = Path(__file__).resolve().with_name("kernels_cpu.cpp")
NATIVE_ISAS = ("scalar", "avx2", "avx2-vnni", "avx512", "avx512-vnni")  # kernels_cpu.cpp's isa argument, by index
NATIVE_GROUP = 4  # output channels kernels_cpu.cpp interleaves (int8_native_layout, int4_native_layout)
# how far ahead kernels_cpu.cpp's loops ask for the weights' cache lines, where they do (Kernels.prefetch_bytes)
PREFETCH_BYTES = 4096
MATVECS = ("auto", "fused", "library", "native")  # the --kernels choices (Kernels.choose)
# -fopenmp: at::parallel_for is OpenMP in ATen's headers (without it, one thread), linked to the libgomp.so.1 torch
# has loaded; -ffp-contract=off: a row's float sums as written, the same instructions whatever the batch.
NATIVE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def cpuinfo_words() -> frozenset[str]:
    """The words of /proc/cpuinfo: the CPU's flags and vendor (empty where there is none)."""
    return frozenset(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else frozenset()


def native_isas() -> list[str]:
    """The paths of kernels_cpu.cpp this process may run, best last: those of the CPU's instructions that torch's CPU
    capability allows. ATEN_CPU_CAPABILITY=avx2 forces plain AVX2 (no AVX-512, no AVX-VNNI: a Zen 3's instructions),
    as it does for ATen's and inductor's code."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpuinfo_words()
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
    allowed = {
        "scalar": True,
        "avx2": capability in ("AVX2", "AVX512"),
        "avx2-vnni": capability in ("AVX2", "AVX512") and "avx_vnni" in flags and not forced,
        "avx512": capability == "AVX512",
        "avx512-vnni": capability == "AVX512" and "avx512_vnni" in flags,
    }
    return [isa for isa in NATIVE_ISAS if allowed[isa]]


def runs_avx2() -> bool:
    """Whether this process may run kernels_cpu.cpp's AVX2 code, which half_linear is (it has no scalar path)."""
    return "avx2" in native_isas()


def native_isa() -> str:
    """The best path of kernels_cpu.cpp this process may run."""
    return native_isas()[-1]


@functools.cache
def native_kernels() -> bool:
    """Builds kernels_cpu.cpp on first use and loads its operators (torch.ops.gpt_fast). The build is cached under
    TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) by the source, torch's version, the compiler and the
    CPU capability in force; torch's build lock serialises processes that build at once (tensor-parallel ranks).
    False, after one line on stderr saying why, when it cannot be built: the PyTorch paths run instead."""
    compiler = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(
            "\n".join([NATIVE_SOURCE.read_text(), *NATIVE_FLAGS, torch.__version__, version, native_isa()]).encode()
        ).hexdigest()[:16]
        base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
        folder = base / f"gpt_fast_kernels_{key}"
        folder.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension  # imported here: it loads setuptools, which only a build needs

        cpp_extension.load(
            name="gpt_fast_kernels",
            sources=[str(NATIVE_SOURCE)],
            build_directory=str(folder),
            extra_cflags=NATIVE_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (OSError, subprocess.CalledProcessError, RuntimeError, ImportError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(
            f"kernels: kernels_cpu.cpp did not build ({reason}); the PyTorch paths run instead",
            file=sys.stderr,
        )
        return False
    # x [M, K] by groups of channels [N / NATIVE_GROUP, K / 64, bytes] (int8/int4_native_layout) -> [M, N]
    torch.library.register_fake("gpt_fast::int8_linear")(
        lambda x, packed, scales, isa, prefetch: x.new_empty(x.shape[0], packed.shape[0] * NATIVE_GROUP)
    )
    torch.library.register_fake("gpt_fast::int4_linear")(
        lambda x, packed, isa, prefetch: x.new_empty(x.shape[0], packed.shape[0] * NATIVE_GROUP)
    )
    torch.library.register_fake("gpt_fast::half_linear")(
        lambda x, weight, prefetch: x.new_empty(x.shape[0], weight.shape[0])
    )
    torch.library.register_fake("gpt_fast::int4_weights")(
        lambda packed: packed.new_empty(packed.shape[0] * NATIVE_GROUP, packed.shape[1] * 64, dtype=torch.bfloat16)
    )
    torch.library.register_fake("gpt_fast::decode_attention")(lambda q, k, v, mask, scale: q.new_empty(q.shape))
    return True


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_BLOCK_BYTES = 32 << 20  # the largest mmap threshold glibc takes on 64-bit systems


@functools.cache
def keep_freed_memory():
    """Lets glibc's malloc serve blocks of up to KEPT_BLOCK_BYTES from memory the process freed, rather than map
    fresh pages for each and unmap them when freed. Its default threshold adapts to the largest block freed, yet a
    block of exactly that size is still mapped afresh: the weights a prefill widens to float32 (cpu_product), the
    same few sizes layer after layer, then pay a page fault per 4 KiB at every call, which costs more than the
    widening itself. Up to 2 * KEPT_BLOCK_BYTES of freed memory at the heap's top stays with the process. A setting
    of the process, made once (set_kernels), that changes no result; nothing where the C library has no mallopt."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)
        mallopt(M_TRIM_THRESHOLD, 2 * KEPT_BLOCK_BYTES)


THP_MODES = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the mode in force bracketed
HUGE_PAGE_BYTES = 2 << 20


def transparent_huge_pages() -> bool:
    """Whether memory advised for huge pages (madvise MADV_HUGEPAGE) may get them: Linux's transparent huge pages
    not set to "never"."""
    return hasattr(mmap, "MADV_HUGEPAGE") and THP_MODES.is_file() and "[never]" not in THP_MODES.read_text()


def in_huge_pages(model: nn.Module):
    """Moves the weights of a model on a CPU (its parameters and buffers, as the kernels' layouts made by then) into
    one anonymous mapping advised for 2 MiB pages, 64-byte aligned each. A decode step streams every weight once:
    with 4 KiB pages (a checkpoint's memory-mapped file, or malloc's) its reads miss the TLB every 4 KiB, most
    layers' matrices are smaller than one huge page, and glibc does not ask for huge pages. Each storage moved gets a
    storage of its own in the mapping (torch.compile's nested regions refuse weights that share one), and the tensors
    that shared it (a tied output projection, views) still share it; oneDNN's opaque layouts stay where they are.
    An embedding table that only looks up a row a token stays where it is (a checkpoint's stays mostly on disk).
    The storages left behind are freed, and glibc's heap gives their pages back (release_freed_memory)."""
    tied = getattr(model, "output", True) is None  # model.Transformer's output projection reads tok_embeddings
    owned = [  # (tensor, whether its module reads it whole)
        (t, not isinstance(module, nn.Embedding) or (tied and module is model.tok_embeddings))
        for module in model.modules()
        for t in [*module._parameters.values(), *module._buffers.values()]
        if t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
    ]
    tensors = [t for t, _ in owned]
    storages = {}  # data_ptr -> (offset in the mapping, storage)
    size = 0
    for t, read_whole in owned:
        storage = t.untyped_storage()
        if read_whole and storage.nbytes() > 0 and storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (size, storage)
            size += -(-storage.nbytes() // 64) * 64
    if size == 0:
        return
    # whole huge pages from a 2 MiB boundary within it; not MAP_SHARED, which follows shmem's own THP setting
    pages = -(-size // HUGE_PAGE_BYTES) + 1
    mapping = mmap.mmap(-1, pages * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    memory = memoryview(mapping)  # each tensor made from it keeps the mapping alive
    start = -torch.frombuffer(memory[:1], dtype=torch.uint8).data_ptr() % HUGE_PAGE_BYTES
    moved = {}  # data_ptr -> the storage's bytes in the mapping
    for ptr, (offset, storage) in storages.items():
        moved[ptr] = torch.frombuffer(memory[start + offset : start + offset + storage.nbytes()], dtype=torch.uint8)
        moved[ptr].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    homes = [moved.get(t.untyped_storage().data_ptr()) for t in tensors]  # before the first move: storages are shared
    with torch.no_grad():
        for t, home in zip(tensors, homes):
            if home is not None:
                t.data = home.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    storages.clear()  # the last references to the storages left behind, unless the caller holds some
    release_freed_memory()


def release_freed_memory():
    """Gives the pages of freed blocks inside glibc's heap back to the system (malloc_trim). free() returns only
    the heap's top beyond the trim threshold (keep_freed_memory), so the weights that a load converted (bfloat16
    from a float32 file, the kernels' layouts) and then moved into huge pages would stay in the process, as much
    memory as the moved weights again. Nothing where the C library has no malloc_trim."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def interleaved(t: Tensor) -> Tensor:
    """[N, K / 64, B] -> [N / NATIVE_GROUP, K / 64, NATIVE_GROUP * B]: a group's channels side by side per 64 inputs."""
    n, steps = t.shape[:2]
    return t.reshape(n // NATIVE_GROUP, NATIVE_GROUP, steps, -1).transpose(1, 2).reshape(n // NATIVE_GROUP, steps, -1)


def int8_native_layout(weight: Tensor) -> Tensor:
    """int8 weight [N, K] -> kernels_cpu.cpp's int8 layout [N / 4, K / 64, 256]: channels in groups of NATIVE_GROUP,
    and per group and 64 inputs each channel's 64 codes. N must be a multiple of NATIVE_GROUP and K of 64."""
    n, k = weight.shape
    return interleaved(weight.reshape(n, k // 64, 64)).contiguous()


def int4_native_layout(codes: Tensor, block_scales: Tensor) -> Tensor:
    """codes [N, K] in 0..15 and float16 (scale, offset) per block of 32 inputs [N, K / 32, 2] -> kernels_cpu.cpp's
    int4 layout [N / 4, K / 64, 160] uint8: channels in groups of NATIVE_GROUP, and per group and 64 inputs each
    channel's 32 bytes of codes (low nibbles inputs 0-31, high nibbles 32-63), then each channel's scales and
    offsets of the two blocks as float16. N must be a multiple of NATIVE_GROUP and K of 64."""
    n, k = codes.shape
    pairs = codes.view(n, k // 64, 2, 32)
    code_bytes = pairs[:, :, 0] | pairs[:, :, 1] << 4  # [N, K / 64, 32]
    scale_bytes = block_scales.half().contiguous().view(n, k // 64, 4).view(torch.uint8)  # [N, K / 64, 8]
    return torch.cat([interleaved(code_bytes), interleaved(scale_bytes)], -1).contiguous()


@dataclass(frozen=True)
class Kernels:
    """How a CPU runs the linear layers and decode attention: a speed choice made once at load time (see choose),
    recorded in the run's figures. Numerics follow from it: "fused" computes products of up to the caller's
    fused_rows rows (see linear) in float32; ATen's int8/int4 kernels compute with kernel_activations (on x86 they
    are vectorised for bfloat16 only, so float32 is exact but far slower)."""

    # few-row products with float weights, and a few queries' with the KV cache: "library" (BLAS) or "fused"
    float_matvec: str = "library"
    quant_matvec: str = "library"  # few-row products with int8/int4 weights: "library" (ATen's kernels) or "fused"
    # float32 products that do not fuse: "blas" (F.linear: MKL) or "onednn" (onednn_linear)
    float_gemm: str = "blas"
    # many-row products of int8 weights, and of half-precision ones in another dtype, compute in this dtype
    gemm_dtype: torch.dtype = torch.float32
    kernel_activations: torch.dtype = torch.bfloat16  # what ATen's int8/int4 kernels are fed
    # NATIVE_ISAS paths: int8 / int4 products by kernels_cpu.cpp (None: not; see runs_native)
    int8_native: str | None = None
    int4_native: str | None = None
    # int8/int4 products of this many rows or more widen the weights to gemm_dtype for one matrix product rather than
    # run kernels_cpu.cpp (None: never; see runs_native)
    widen_rows: int | None = None
    # float32 weights also kept in oneDNN's blocked layout (a second copy, made by set_kernels) for products of
    # PACKED_ROWS rows or more
    packed_float: bool = False
    # bfloat16/float16 weights' one-row products by kernels_cpu.cpp (see runs_half_native)
    half_native: bool = False
    # kernels_cpu.cpp's loops ask for the weights' cache lines this many bytes ahead of their reads (0: none)
    prefetch_bytes: int = PREFETCH_BYTES
    # the weights copied into memory backed by 2 MiB pages where the loader places them (in_huge_pages)
    huge_pages: bool = False
    # float32 decode steps' attention of this many rows or more by kernels_cpu.cpp (None: never; see
    # runs_native_attention)
    attention_rows: int | None = None

    @classmethod
    def choose(
        cls,
        device: torch.device,
        compiled: bool,
        matvec: str = "auto",
        quantized: bool = False,
        rows: int = 1,
        half: bool = False,
    ) -> "Kernels":
        """The fastest measured choice for this CPU (scripts/benchmark.py's configs ending in :fused, :library or
        :native measure the others).

        "fused" is a multiply-and-sum that torch.compile turns into one pass over the weights in their own
        dtype; run eagerly it would materialise the product, so it is for compiled steps. It wins for float
        weights on every CPU measured. Products with int8/int4 weights (quantized: the model has some) run
        kernels_cpu.cpp's integer dot products ("native", built on first use; see runs_native), eager and compiled:
        on AVX2 far faster than the other paths, on AVX-512 level with or faster than the fused one. Where the file
        cannot be built: "fused" where AVX-512 converts bytes to floats fast enough, ATen's int8/int4 kernels on
        AVX2. Widening int8/int4 weights to bfloat16 for a matrix product pays off only with native bfloat16
        (AVX512-BF16, AMX), and there from WIDEN_ROWS rows (AMX: AMX_WIDEN_ROWS): without it, matrix
        products emulate bfloat16 and lose to float32, so bfloat16 and float16 weights too are widened to float32
        there for products of many rows. float32 products that do not fuse run oneDNN on CPUs other than Intel's, and
        where the run's decode steps compute PACKED_ROWS rows or more (rows: a batch, or a speculative round's
        verification), the float32 weights are kept a second time in oneDNN's own layout for them (not with "fused"
        or "library": it costs their memory again). Where the model computes in bfloat16 or float16 (half), its
        one-row products run kernels_cpu.cpp's half_linear (half_native), which reads those weights faster than the
        other paths, except compiled on AMD CPUs with AVX-512, where the fused product is faster. Where the run's decode
        steps compute NATIVE_ATTENTION_ROWS rows or more, those of that many rows take kernels_cpu.cpp's
        decode_attention (AVX2 code) for their float32 attention, which reads the KV cache faster than the fused one
        (runs_native_attention); "fused" and "library" keep the PyTorch attention. docs/performance.md has the
        figures behind each choice."""
        if matvec not in MATVECS:
            raise ValueError(f"unknown --kernels {matvec!r}: use auto, fused, library or native")
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        native_bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
        # MKL, which F.linear runs for float32, is Intel's: on the AMD CPUs measured oneDNN's product is faster.
        onednn = "GenuineIntel" not in cpuinfo_words() and torch.backends.mkldnn.is_available()
        gemm_dtype = torch.bfloat16 if native_bf16 else torch.float32
        widen_rows = (AMX_WIDEN_ROWS if "amx_bf16" in cpuinfo_words() else WIDEN_ROWS) if native_bf16 else None
        # On an AMD CPU with AVX-512 (Zen 4, Zen 5), at either ATen level, software prefetches slow kernels_cpu.cpp's
        # streams of weights, and compiled, the fused product reads half-precision weights faster than half_linear
        amd_avx512 = {"AuthenticAMD", "avx512f"} <= cpuinfo_words()
        prefetch_bytes = 0 if amd_avx512 else PREFETCH_BYTES
        common = dict(
            float_gemm="onednn" if onednn else "blas",
            gemm_dtype=gemm_dtype,
            widen_rows=widen_rows,
            prefetch_bytes=prefetch_bytes,
            huge_pages=device.type == "cpu" and transparent_huge_pages(),
        )
        if matvec in ("fused", "library"):
            return cls(matvec, matvec, **common)
        common["packed_float"] = onednn and device.type == "cpu" and rows >= PACKED_ROWS
        native_attention = device.type == "cpu" and rows >= NATIVE_ATTENTION_ROWS and runs_avx2() and native_kernels()
        common["attention_rows"] = NATIVE_ATTENTION_ROWS if native_attention else None
        fused = "fused" if compiled and device.type == "cpu" else "library"
        quant = fused if avx512 else "library"
        if matvec == "native":
            if device.type != "cpu" or not native_kernels():
                raise ValueError("--kernels native: kernels_cpu.cpp runs on a CPU, built with a C++ compiler")
            isas = dict(int8_native=native_isa(), int4_native=native_isa(), half_native=half and runs_avx2())
            return cls(fused, "library", **isas, **common)
        fused_reads_half_faster = compiled and amd_avx512  # eager, half_linear is faster everywhere
        common["half_native"] = (
            half and device.type == "cpu" and not fused_reads_half_faster and runs_avx2() and native_kernels()
        )
        if quantized and device.type == "cpu" and native_kernels():
            return cls(fused, quant, int8_native=native_isa(), int4_native=native_isa(), **common)
        return cls(fused, quant, **common)

    def describe(self) -> dict:
        dtypes = {"gemm_dtype": self.gemm_dtype, "kernel_activations": self.kernel_activations}
        return {
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "float_matvec": self.float_matvec,
            "quant_matvec": self.quant_matvec,
            "float_gemm": self.float_gemm,
            "int8_native": self.int8_native,
            "int4_native": self.int4_native,
            "widen_rows": self.widen_rows,
            "packed_float": self.packed_float,
            "half_native": self.half_native,
            "prefetch_bytes": self.prefetch_bytes,
            "huge_pages": self.huge_pages,
            "attention_rows": self.attention_rows,
            **{k: str(v).removeprefix("torch.") for k, v in dtypes.items()},
        }


def set_kernels(model: nn.Module, kernels: Kernels):
    """Gives every module that computes a linear layer (and the model, for a tied output) this choice, with the
    weights' copies in oneDNN's layout where it keeps them (onednn_layout); and has the process keep freed memory for
    reuse (keep_freed_memory), as a CPU's products allocate the same sizes call after call."""
    keep_freed_memory()
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
        if isinstance(module, Linear):
            module.packed_weight = onednn_layout(module.weight, kernels)
    if getattr(model, "output", True) is None:  # a tied output projection (model.Transformer) reads the embeddings
        model.packed_output = onednn_layout(model.tok_embeddings.weight, kernels)


def onednn_layout(weight: Tensor, kernels: Kernels) -> Tensor | None:
    """A float32 weight [N, K] on a CPU as oneDNN's products of PACKED_ROWS rows read it (its blocked layout, a copy),
    where kernels.packed_float says so; else None."""
    if not kernels.packed_float or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


# The fused_rows that compiled steps pass (decode.compile_steps): a speculative verify of k <= 7, a small batch.
# torch.compile reads each weight once for all these rows, where a BLAS product of a few rows reads it once per row.
# Eager steps pass 1: run eagerly, each row of a fused product materialises a weight-sized temporary.
FUSED_ROWS = 8


def fuses(x: Tensor, fused_rows: int) -> bool:
    """Whether a fused product takes x: on a CPU, with at most fused_rows rows."""
    return x.device.type == "cpu" and x.numel() // x.shape[-1] <= fused_rows


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    scales: Tensor | None = None,
    fused_rows: int = 0,
    kernels: "Kernels | None" = None,
    packed: Tensor | None = None,
) -> Tensor:
    """x @ weight.T, times per-output scales (int8 weights), plus bias, in x's dtype. x of PACKED_ROWS rows or more,
    where packed holds the weight in oneDNN's layout (onednn_layout): by oneDNN from it. x of up to fused_rows rows
    on a CPU (0: none): as float32 multiply-and-sums, which torch.compile fuses into one pass over the weights.
    Other products on a CPU: by the library kernels choose (see cpu_product); None, or on CUDA: F.linear."""
    if packed is not None and x.numel() // x.shape[-1] >= PACKED_ROWS:
        y = onednn_linear(x.reshape(-1, x.shape[-1]), packed).reshape(*x.shape[:-1], -1)
    elif kernels is not None and runs_half_native(x, weight, scales, kernels):
        y = torch.ops.gpt_fast.half_linear(x.reshape(-1, x.shape[-1]).float(), weight, kernels.prefetch_bytes)
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
    elif fuses(x, fused_rows):
        w = weight.float()
        rows = x.reshape(-1, 1, x.shape[-1]).float()
        # A view that changes nothing, but inductor writes the input of as_strided to memory: the rows are computed
        # once, where their producer (a norm, a cast, SiLU times up) would otherwise be inlined into every output's sum
        rows = rows.as_strided(rows.shape, rows.stride())
        y = torch.stack([(row * w).sum(-1) for row in rows])
        y = (y if scales is None else y * scales).to(x.dtype).reshape(*x.shape[:-1], -1)
    elif kernels is not None and x.device.type == "cpu":
        y = cpu_product(x, weight, scales, kernels)
    elif scales is None:
        y = F.linear(x, weight)
    else:  # int8 weights, widened for the product (on CUDA, torch.compile fuses that into it)
        y = F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    return y if bias is None else y + bias


def runs_half_native(x: Tensor, weight: Tensor, scales: Tensor | None, kernels: "Kernels") -> bool:
    """Whether kernels_cpu.cpp's half_linear computes x @ weight.T: where the kernels say so (half_native), for one row
    of x (a decode step of one sequence, a prefill's last position) on a CPU and bfloat16/float16 weights [N, K] with K
    a multiple of 8. Its rows each read the weights again (from the cache), so a few rows stay with the fused
    product."""
    return (
        kernels.half_native
        and weight.dtype in (torch.bfloat16, torch.float16)
        and scales is None
        and x.device.type == "cpu"
        and x.numel() == x.shape[-1]
        and weight.shape[1] % 8 == 0
    )


def cpu_product(x: Tensor, weight: Tensor, scales: Tensor | None, kernels: "Kernels") -> Tensor:
    """x @ weight.T (times scales) on a CPU, in x's dtype. Computed in x's dtype where the CPU multiplies it natively
    (float32, or kernels.gemm_dtype) or for fewer than GEMM_ROWS rows (widening the weight would cost more than the
    product), else in float32; float32 by oneDNN where kernels.float_gemm says so. A weight of another dtype is
    widened for the call, in blocks of channels (widened_blocks)."""
    x2d = x.reshape(-1, x.shape[-1])
    native = x.dtype in (torch.float32, kernels.gemm_dtype)
    dtype = x.dtype if native or x2d.shape[0] < GEMM_ROWS else torch.float32
    x2d = x2d.to(dtype)
    if weight.dtype == dtype:
        y = float_product(x2d, weight, kernels)
    else:
        y = widened_product(x2d, weight, weight.shape[1] * dtype.itemsize, lambda w: w.to(dtype), kernels)
    y = y if scales is None else y * scales.to(dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def float_product(x: Tensor, weight: Tensor, kernels: "Kernels") -> Tensor:
    """x [M, K] @ weight [N, K].T of one dtype: float32 by oneDNN where kernels.float_gemm says so, else F.linear."""
    if weight.dtype == torch.float32 and kernels.float_gemm == "onednn":
        return onednn_linear(x, weight)
    return F.linear(x, weight)


def widened_blocks(units: int, unit_bytes: int) -> list[int]:
    """The blocks, in units (channels, or groups of them) of unit_bytes each once widened, in which a product widens
    its weight and multiplies: the fewest of about equal size within KEPT_BLOCK_BYTES. malloc serves a block that
    size from memory freed by the block before (keep_freed_memory); a larger copy is mapped afresh at every call and
    pays a page fault per 4 KiB, more than the widening itself."""
    most = max(1, KEPT_BLOCK_BYTES // unit_bytes)  # units a block may hold
    per_block = math.ceil(units / math.ceil(units / most))
    return [min(per_block, units - start) for start in range(0, units, per_block)]


def widened_product(x: Tensor, source: Tensor, unit_bytes: int, widen, kernels: "Kernels") -> Tensor:
    """x [M, K] @ widen(source).T -> [M, N]: source's units (dim 0: channels, or groups of them) widened to x's dtype
    (unit_bytes each) and multiplied a block at a time (widened_blocks), the outputs side by side."""
    blocks = source.split(widened_blocks(len(source), unit_bytes))
    ys = [float_product(x, widen(block), kernels) for block in blocks]
    return ys[0] if len(ys) == 1 else torch.cat(ys, -1)


def onednn_product(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in float32, by oneDNN (MKL is what F.linear runs); weight as it is or in
    oneDNN's layout (onednn_layout)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


# onednn_product as an operator of our own, gpt_fast::onednn_linear, so that compiled steps can call it: inductor
# lowers oneDNN's linear for constant weights only, which it prepacks itself. Defined with torch.library.Library, not
# torch.library.custom_op, whose Python wrapper costs several times more per call (docs/performance.md): a batched
# step or a prefill calls it once per linear layer.
ONEDNN_OPS = torch.library.Library("gpt_fast", "FRAGMENT")
ONEDNN_OPS.define("onednn_linear(Tensor x, Tensor weight) -> Tensor")
ONEDNN_OPS.impl("onednn_linear", onednn_product, "CompositeExplicitAutograd")


@torch.library.register_fake("gpt_fast::onednn_linear")
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def onednn_linear(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.gpt_fast.onednn_linear(x, weight)


class Linear(nn.Linear):
    kernels = Kernels()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)  # in oneDNN's layout, where kept (set_kernels)

    def forward(self, x: Tensor, fused_rows: int = 1) -> Tensor:
        # fused_rows: what the step allows (model.Transformer.forward); this layer fuses only by its kernels' choice
        fused_rows = fused_rows if self.kernels.float_matvec == "fused" else 0
        return linear(x, self.weight, self.bias, fused_rows=fused_rows, kernels=self.kernels, packed=self.packed_weight)


def unpack_int4(packed: Tensor) -> Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1)


class Int8Linear(nn.Module):
    """y = x @ (int8 weight * per-channel scale).T + bias; the weight stays int8 in memory."""

    kernels = Kernels()

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))
        # The scales as the CPU kernel takes them, made by prepare(): a buffer, not a cast in the compiled graph
        # (inductor's lowering of the kernel needs its scales realised).
        self.register_buffer("kernel_scales", None, persistent=False)
        # kernels_cpu.cpp's layout (int8_native_layout) and the scales as float32 it takes
        self.register_buffer("native_packed", None, persistent=False)
        self.register_buffer("native_scales", None, persistent=False)
        # both layouts of a pair of layers, this one's first (join_native)
        self.register_buffer("joined_packed", None, persistent=False)
        self.register_buffer("joined_scales", None, persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def prepare(self):
        self.joined_packed = None  # join_native's, of the layouts made before
        self.kernel_scales = self.scales.to(self.kernels.kernel_activations)
        # kernels_cpu.cpp's byte products need weights in [-127, 127] (ours are), its layout whole groups of channels
        # and of 64 inputs.
        native = self.kernels.int8_native is not None and not self.weight.is_cuda
        native = native and self.out_features % NATIVE_GROUP == 0 and self.in_features % 64 == 0
        native = native and native_kernels() and int(self.weight.min()) > -128  # built on first use
        self.native_packed = int8_native_layout(self.weight) if native else None
        self.native_scales = self.scales.float() if native else None

    def forward(self, x: Tensor, fused_rows: int = 1) -> Tensor:
        if runs_native(self, x):
            y = native_linear(self, x, self.native_packed, self.native_scales)
            return y if self.bias is None else y + self.bias
        fused_rows = fused_rows if self.kernels.quant_matvec == "fused" else 0
        if x.is_cuda or fuses(x, fused_rows):  # see linear
            return linear(x, self.weight, self.bias, self.scales, fused_rows)
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] >= GEMM_ROWS:
            # The kernel's time grows with the rows (a matrix-vector product per row); a matrix product with
            # the weight widened for the call is faster from GEMM_ROWS rows: prefill and large batches.
            y = cpu_product(x2d.to(self.kernels.gemm_dtype), self.weight, self.scales, self.kernels)
        else:
            y = torch.ops.aten._weight_int8pack_mm(
                x2d.to(self.kernels.kernel_activations), self.weight, self.kernel_scales
            )
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights; the kernel layout (`packed`) is made by prepare() on the device."""

    kernels = Kernels()

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(in_features // groupsize, out_features, 2))
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("groupsize_tensor", None, persistent=False)  # CPU only: see forward
        self.register_buffer("kernel_scales_and_zeros", None, persistent=False)  # in the kernels' activation dtype
        # CPU only, for fused one-row products (see forward): byte j holds inputs j and j + K/2, and the
        # group scales and offsets as [N, K / groupsize] float32, where weight = code * scale + offset.
        self.register_buffer("halves", None, persistent=False)
        self.register_buffer("group_scales", None, persistent=False)
        self.register_buffer("group_offsets", None, persistent=False)
        # kernels_cpu.cpp's layout (int4_native_layout; see runs_native)
        self.register_buffer("native_packed", None, persistent=False)
        self.register_buffer("joined_packed", None, persistent=False)  # as Int8Linear's (int4 scales are inline)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def prepare(self):
        """Converts the stored packing to the layout of this device's int4 kernel, and on a CPU to kernels_cpu.cpp's
        layout (kernels.int4_native), else to the halves layout when one-row products are fused (kernels.quant_matvec)
        and each half of the inputs holds whole groups."""
        self.joined_packed = None  # join_native's, of the layouts made before
        cuda = self.weight.is_cuda  # the CUDA kernel takes bfloat16 only
        self.kernel_scales_and_zeros = self.scales_and_zeros.to(
            torch.bfloat16 if cuda else self.kernels.kernel_activations
        )
        if cuda:
            # The CUDA layout tiles K by 16 x innerKTiles (8, 4 or 2): take the largest that divides it.
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(self.weight, inner_k_tiles)
        else:  # rows pack independently; chunks keep the int32 temporaries small (they fragment the heap)
            rows = range(0, self.out_features, 256)
            pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
            codes = unpack_int4(self.weight)
            self.packed = torch.cat([pack(codes[i : i + 256].int(), 2) for i in rows])
            self.groupsize_tensor = torch.tensor(self.groupsize)
            half = self.in_features // 2
            self.halves = self.group_scales = self.group_offsets = None  # from an earlier choice of kernels
            self.native_packed = self.native_layout(codes)
            if self.native_packed is None and self.kernels.quant_matvec == "fused" and half % self.groupsize == 0:
                self.halves = codes[:, :half] | codes[:, half:] << 4
                self.group_scales = self.scales_and_zeros[..., 0].T.float().contiguous()
                # (code - 8) * scale + zero, folded into one multiply-add per weight in forward
                zeros = self.scales_and_zeros[..., 1].T.float()
                self.group_offsets = (zeros - 8 * self.group_scales).contiguous()

    def native_layout(self, codes: Tensor) -> Tensor | None:
        """codes [N, K] -> kernels_cpu.cpp's layout, with a float16 scale and offset per block of 32 inputs; None when
        the kernel is not chosen or not built, K is not a multiple of 64, or a scale or offset does not fit float16.
        (N is a multiple of 16, which ATen's CPU packing needs, and so of NATIVE_GROUP.)"""
        if self.kernels.int4_native is None or self.in_features % 64 or not native_kernels():
            return None
        scales, zeros = self.scales_and_zeros.float().unbind(-1)  # [K / groupsize, N] each
        per_group = torch.stack([scales, zeros - 8 * scales], -1).transpose(0, 1)  # [N, groups, 2]
        per_block = per_group.repeat_interleave(self.groupsize // 32, dim=1).half()
        if not per_block.isfinite().all():
            return None
        return int4_native_layout(codes, per_block)

    def forward(self, x: Tensor, fused_rows: int = 1) -> Tensor:
        if runs_native(self, x):
            y = native_linear(self, x, self.native_packed)
            return y if self.bias is None else y + self.bias
        if self.native_packed is not None:  # many rows on a CPU with bfloat16 products (runs_native)
            y = widened_int4_product(self, x, self.native_packed)
            return y if self.bias is None else y + self.bias
        # fused_rows: the halves layout fuses one row only, which every step allows
        if self.halves is not None and x.numel() == self.in_features:
            # A float32 multiply-and-sum that torch.compile fuses into one pass over the 4-bit codes, like
            # linear; the halves layout lets it unpack a byte with two vectorised ops (interleaved
            # nibbles defeat vectorisation).
            n, half = self.halves.shape
            groups = half // self.groupsize
            xs = x.reshape(2, groups, self.groupsize).float()

            def part(codes: Tensor, i: int) -> Tensor:  # inputs i * K/2 .. (i + 1) * K/2
                g = slice(i * groups, (i + 1) * groups)
                w = codes.view(n, groups, self.groupsize).float() * self.group_scales[:, g, None]
                return (xs[i] * (w + self.group_offsets[:, g, None])).sum((-1, -2))

            y = (part(self.halves & 15, 0) + part(self.halves >> 4, 1)).to(x.dtype).reshape(*x.shape[:-1], n)
            return y if self.bias is None else y + self.bias
        x2d = x.reshape(-1, self.in_features)
        sz = self.kernel_scales_and_zeros
        if x.is_cuda:  # the CUDA kernel takes bfloat16 only
            y = torch.ops.aten._weight_int4pack_mm(x2d.to(torch.bfloat16), self.packed, self.groupsize, sz).to(x.dtype)
        else:  # the kernel behind aten._weight_int4pack_mm_for_cpu, taking the group size as a tensor: inductor
            # turns an int group size into a constant, which torch 2.13 leaves unset inside a layer compiled once
            # for all (model.TransformerBlock), so the compiled step would fail
            y = torch.ops.quantized.int4mm_packed_weight_cpu(x2d.to(sz.dtype), self.packed, self.groupsize_tensor, sz)
            y = y.to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def runs_native_attention(q: Tensor, k: Tensor, v: Tensor, logit_softcap: float | None, kernels: Kernels) -> bool:
    """Whether kernels_cpu.cpp's decode_attention computes the attention of q [B, H, S, D] over k and v
    [B, H_kv, T, D]: where the kernels say so (attention_rows), for one query a row (S = 1) in at least
    attention_rows rows, float32 keys and values read with D contiguous, D a multiple of 16 and no soft-capping
    (which it does not compute)."""
    return (
        kernels.attention_rows is not None
        and q.shape[2] == 1
        and q.shape[0] >= kernels.attention_rows
        and q.dtype == k.dtype == v.dtype == torch.float32
        and k.stride(-1) == v.stride(-1) == 1
        and q.shape[-1] % 16 == 0
        and logit_softcap is None
    )


def native_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) v by kernels_cpu.cpp (where runs_native_attention says so): q [B, H, 1, D], k and v
    [B, H_kv, T, D], mask [B, 1, 1, T] (or broadcast to it) -> [B, H, 1, D]."""
    mask = mask.expand(q.shape[0], 1, 1, k.shape[2])
    return torch.ops.gpt_fast.decode_attention(q, k, v, mask, scale)


def runs_native(layer: nn.Module, x: Tensor) -> bool:
    """Whether layer's product with x runs kernels_cpu.cpp: wherever the layer has its layout, at any number of rows,
    except Kernels.widen_rows rows or more on a CPU with bfloat16 matrix products, where one product with the weights
    widened to bfloat16 is faster (without them, widening to float32 is slower than the kernel)."""
    widen_rows = layer.kernels.widen_rows
    many = widen_rows is not None and x.numel() // x.shape[-1] >= widen_rows
    return layer.native_packed is not None and not many


def native_linear(layer: nn.Module, x: Tensor, packed: Tensor, scales: Tensor | None = None) -> Tensor:
    """x [..., K] by kernels_cpu.cpp's layout packed (an int8 layer's, with its float32 scales, or an int4 layer's)
    of layer, or of layers joined by join_native -> [..., N], in x's dtype, without bias."""
    x2d = x.reshape(-1, x.shape[-1]).float()
    if scales is None:
        isa = NATIVE_ISAS.index(layer.kernels.int4_native)
        y = torch.ops.gpt_fast.int4_linear(x2d, packed, isa, layer.kernels.prefetch_bytes)
    else:
        isa = NATIVE_ISAS.index(layer.kernels.int8_native)
        y = torch.ops.gpt_fast.int8_linear(x2d, packed, scales, isa, layer.kernels.prefetch_bytes)
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def widened_int4_product(layer: Int4Linear, x: Tensor, packed: Tensor) -> Tensor:
    """x [..., K] by kernels_cpu.cpp's int4 layout packed (of layer, or of layers joined by join_native) widened to
    bfloat16 for matrix products, a block of channels at a time (widened_blocks), as Int8Linear widens its weights for
    many rows -> [..., N], without bias."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    unit_bytes = NATIVE_GROUP * packed.shape[1] * 64 * torch.bfloat16.itemsize
    y = widened_product(rows, packed, unit_bytes, torch.ops.gpt_fast.int4_weights, layer.kernels)
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def join_native(first: nn.Module, second: nn.Module):
    """For two layers that read the same input (a gated MLP's gate and up projections), kernels_cpu.cpp's layouts of
    both as one (first.joined_packed, and first.joined_scales for int8), their outputs side by side; the layers'
    own layouts become views of it (no second copy). pair_linear then reads both in one call: one stream of
    weights and one round of the threads instead of two. joined_packed stays None where they do not both run the
    kernel alike."""
    native = [getattr(layer, "native_packed", None) for layer in (first, second)]
    joinable = type(first) is type(second) and all(p is not None for p in native)
    joinable = joinable and first.bias is None and second.bias is None
    first.joined_packed = None
    if not joinable:
        return
    first.joined_packed = torch.cat(native)
    first.native_packed, second.native_packed = first.joined_packed.split([len(native[0]), len(native[1])])
    if isinstance(first, Int8Linear):
        first.joined_scales = torch.cat([first.native_scales, second.native_scales])
        first.native_scales, second.native_scales = first.joined_scales.split([first.out_features, second.out_features])


def pair_linear(first: nn.Module, second: nn.Module, x: Tensor, fused_rows: int = 1) -> tuple[Tensor, Tensor]:
    """first(x), second(x): in one kernels_cpu.cpp call where join_native joined them and they run it (runs_native),
    and in one widened product where joined int4 layers widen their weights instead. Not each int4 layer widening its
    own half: the halves are views of one tensor, which a compiled layer (model.TransformerBlock) may not take as two
    inputs."""
    joined = getattr(first, "joined_packed", None)
    if joined is not None and runs_native(first, x):
        y = native_linear(first, x, joined, getattr(first, "joined_scales", None))
    elif joined is not None and isinstance(first, Int4Linear):
        y = widened_int4_product(first, x, joined)
    else:
        return first(x, fused_rows), second(x, fused_rows)
    return y.split([first.out_features, second.out_features], dim=-1)
