"""The fast path's decode / verify pass compiled from C++ (engine/fast_layer.cpp), built on first use.

A decode pass of a small model spends most of its time outside its matrix products, about
60 operator calls a layer, each costing Python and dispatch (docs/performance.md, "Fewer
operations a layer"). engine/fast_layer.cpp runs every layer of a pass in one call (`stack`):
`fast_decode.decoder_layer`'s arithmetic as loops between the products, the products of every
decode and verify pass (up to engine/tree.py's MAX_VERIFY_ROWS rows, the most the settings allow)
in its own kernel (each row summed alone, so a verify pass is bitwise its decode passes; AVX-512
intrinsics, or on other CPUs the same sums in code the compiler vectorizes, bitwise equal),
longer ones (a drafter head's prompt pass, compared with no other pass) in ATen's; the final
norm and output layer in one more call (`logits`). torch's extension loader compiles it with the
machine's C++ compiler and ninja the first time (222 s on 2 cores at load average 8, said on
stderr; then cached under ~/.cache/torch_extensions, built again when the source, its flags,
torch or the CPU changes).
Where it cannot be built (no compiler, a read-only home) or with `VLM_NATIVE_LAYER=0` (then
nothing is built), the Python layer runs on its own weight layout and `unavailable()` says why.
int8 weights (`--quantization int8`) run compiled too (the rows kernel reads their int8 values
and scales), and with int8 activations (`w8a8`) engine/fast_int8.h's integer products (AVX512-VNNI
where the CPU has it; `int8_fallback_reason()` says why not, and a portable loop gives the same bits);
llama.cpp's Q4_0 weights (`q4_0`) engine/fast_q4.h's, on the same int8 rows and the same choice of kernel.
Weights kept in a GGUF file's blocks (engine/packed.py) are multiplied as float32 values by the rows
kernel, or with `--weight-arithmetic integer` by int8 rows per block of 32 (engine/fast_blocks.h,
its kernel named per weight: portable, AVX2, AVX512-VNNI).
"""

from __future__ import annotations

import functools
import hashlib
import glob
import logging
import os
import re
import sys
from pathlib import Path

from engine.schema import switches
from engine.tree import MAX_VERIFY_ROWS

SOURCE = Path(__file__).with_name("fast_layer.cpp")
HEADERS = [Path(__file__).with_name(name) for name in ("fast_int8.h", "fast_q4.h", "fast_blocks.h")]  # included by SOURCE:
# int8 activations' products (w8a8, q4_0; integer rows on GGUF blocks)
NAME = "vlm_fast_layer"  # and torch's version, the CPU's features and the source: another build is never loaded
# -march=native: the vector width of this CPU (AVX-512 where it has it); -fopenmp: at::parallel_for
# on torch's OpenMP threads and `omp simd` sums; no FMA contraction, so that the rotary loop rounds
# as ATen's kernels do (engine/fast_layer.cpp).
# ROWS_KERNEL_MAX: the rows kernel covers every verify pass (engine/tree.py).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", f"-DROWS_KERNEL_MAX={MAX_VERIFY_ROWS}"]

log = logging.getLogger(__name__)


def layer():
    """The compiled module (its `stack`, `Layer`, `Weight`, ...), or None where it is unavailable."""
    return _build()[0]


def unavailable() -> str | None:
    """Why the compiled stack is not used (None when it is)."""
    return _build()[1]


@functools.cache
def _build():
    switch = switches()
    if not switch.native_layer:
        return None, "turned off (VLM_NATIVE_LAYER=0)"
    flags = FLAGS + (["-mno-avx512f"] if switch.native_avx2 else [])  # measure/as_avx2.py
    try:
        import torch
        from torch.utils.cpp_extension import load

        name = f"{NAME}_{re.sub(r'[^A-Za-z0-9]', '_', torch.__version__)}_{_machine()}_{_source(flags)}"
        if not _built(name):
            print("Compiling the fast decode path (engine/fast_layer.cpp) for this machine, once: minutes ...",
                  file=sys.stderr, flush=True)
        return load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    verbose=False), None
    except Exception as error:  # no compiler, no ninja, an unwritable cache: the Python layer runs
        lines = str(error).splitlines() or [""]
        first_error = next((line for line in lines if "error" in line.lower() and line is not lines[0]), lines[0])
        reason = f"the compiled decode path could not be built ({type(error).__name__}: {first_error.strip()[:300]})"
        log.warning("%s; the Python layer runs", reason)
        return None, reason


def _machine() -> str:
    """A short hash of the CPU's model and feature flags (a build with -march=native runs only there)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        import platform

        lines = [platform.machine(), platform.processor()]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:8]


def _source(flags: list[str] = FLAGS) -> str:
    """A short hash of the source, its folder and the flags: a changed file is a new name, so the
    message above is printed for its build too (torch's loader would rebuild under the old name,
    silently), and so is another clone: torch's build file names the source's path, so two clones
    sharing one name rebuilt it at every start that alternated between them."""
    text = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS]) + str(SOURCE.resolve()).encode()
    return hashlib.sha1(text + " ".join(flags).encode()).hexdigest()[:8]


def _built(name: str) -> bool:
    """Whether a build of `name` is cached (only for the message; torch's loader decides)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return bool(glob.glob(os.path.join(_get_build_directory(name, False), "*.so")))
    except Exception:  # a private helper of torch's: if it moves, say nothing
        return True
