"""Run another measure module as a CPU without AVX-512 would (most laptops): the compiled stack
built with AVX-512 switched off (so its rows kernel is the AVX2 one), torch's own kernels held to
AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS). On a CPU with AVX-512 it
shows what one without it gets; docs/performance.md, "CPUs without AVX-512".

    python -m measure.as_avx2 measure.bench --drafter none --no-transformers
    python -m measure.as_avx2 measure.kernels --kinds in,compiled,compiled:portable --shapes smolvlm
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

# torch's kernels held to AVX2, and the compiled stack built without AVX-512 (engine/fast_native.py)
HELD_TO_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                "VLM_NATIVE_AVX2": "1"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if any(os.environ.get(name) != value for name, value in HELD_TO_AVX2.items()):
        # torch reads these when it loads: run again with them set
        return subprocess.call([sys.executable, "-m", "measure.as_avx2", *argv], env=os.environ | HELD_TO_AVX2)
    from engine import fast_native

    built = fast_native.layer()
    if built is None:
        print(f"error: {fast_native.unavailable()}", file=sys.stderr)
        return 1
    print(f"as a CPU without AVX-512: rows kernel {built.rows_kernel()}, torch's kernels held to AVX2", file=sys.stderr)
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
