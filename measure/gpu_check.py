"""The check to run whenever a GPU is lent: one command, offline, under 10 minutes on one GPU.

    python -m measure.gpu_check [--json FILE]      # on CUDA: the full check
    python -m measure.gpu_check --short            # anywhere (CI runs it on the CPU): tiny shapes

Steps, each reported as it ends:
1. exactness, in process (measure/exactness.py `check`, the comparisons of
   tests/test_engine_exact.py: speculative greedy == plain greedy for every family x drafter
   kind, chains and trees) with the tiny models on the device, in float32 (must pass) and in
   bfloat16 (reported: a verify pass over k+1 tokens may round a near-tie of random weights
   differently from a one-token pass);
2. real scale: measure/realscale.py at the Qwen2.5-VL-7B shape (random weights, bfloat16,
   built on first use) with timings that synchronise the device before each clock reading.
`--short` runs step 1 for one family (qwen2_5_vl, 1 and 2 images, chains) in float32 on the CPU,
and step 2 on the shrunken SmolVLM shape in float32 (replay at acceptance 1.0 and 0.2), in well
under a minute. The exit status is non-zero when a float32 exactness comparison fails. The
tests' other oracle (plain greedy == the uncached forward, tests/oracles.py) stays in the tests:
`VLM_TEST_DEVICE=cuda python -m pytest tests/test_engine_exact.py` runs all of it on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def exactness(device: str, dtype: str, families=None, cases=None, trees: bool = True) -> dict:
    """In this process: speculative greedy == plain greedy on the tiny models (measure/exactness.py
    `check`: every family x drafter kind, chains and trees) on `device` in `dtype`. `families` and
    `cases` narrow it (default: all)."""
    import tempfile
    from pathlib import Path

    from measure.exactness import CASES, TinyZoo, check
    from models import tiny
    from models.loading import LoadOptions

    started = time.perf_counter()
    zoo = TinyZoo(Path(tempfile.mkdtemp()), LoadOptions(dtype=dtype, device=device))
    families = families or tiny.FAMILIES
    compared, failures = check(zoo, families, cases or CASES, trees)
    which = families[0] if len(families) == 1 else f"{len(families)} families"
    return {"device": device, "dtype": dtype, "passed": not failures, "failures": failures,
            "summary": f"{compared - len(failures)} passed, {len(failures)} failed ({which}, in process)",
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    import torch

    from measure import realscale

    cuda = torch.cuda.is_available() and not args.short
    if not cuda and not args.short:
        print("no CUDA device: running the short mode (--short)", file=sys.stderr)
    device = "cuda" if cuda else "cpu"
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "short": not cuda, "exactness": []}
    # 1. Exactness: every family in float32 and bfloat16 on CUDA; one family in float32 on the CPU.
    short = {"families": ("qwen2_5_vl",), "cases": [(1, False), (2, False)], "trees": False}
    for result in ([exactness(device, "float32"), exactness(device, "bfloat16")] if cuda else
                   [exactness("cpu", "float32", **short)]):
        report["exactness"].append(result)
        print(f"exactness {result['device']} {result['dtype']}: {result['summary']} ({result['seconds']} s)",
              flush=True)
        for line in result["failures"][:20]:
            print(f"  {line}")
    # 2. Real scale: the 7B shape on CUDA; the shrunken SmolVLM shape on the CPU.
    started = time.perf_counter()
    preset, quick = ("qwen2.5-vl-7b", False) if cuda else ("smolvlm-256m", True)
    if cuda:
        report["realscale"] = realscale.measure(preset, quick, "bfloat16", device, 64, 448)
    else:  # float32: a CPU's bfloat16 kernels are slow at tiny shapes
        report["realscale"] = realscale.measure(preset, quick, "float32", device, 8, 224, acceptances=(1.0, 0.2))
    realscale.print_table([report["realscale"]])
    print(f"real scale {preset}{' (quick)' if quick else ''} on {device}: {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1, default=str)
    float32_ok = all(r["passed"] for r in report["exactness"] if r["dtype"] == "float32")
    print("gpu check: float32 exactness " + ("passed" if float32_ok else "FAILED"))
    return 0 if float32_ok else 1


if __name__ == "__main__":
    sys.exit(main())
