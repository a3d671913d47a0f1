"""The check to run whenever a GPU is lent: one command, offline, under 10 minutes on one GPU.

    python -m measure.gpu_check [--json FILE]      # on CUDA: the full check
    python -m measure.gpu_check --short            # anywhere (CI runs it on the CPU): tiny shapes

Steps, each reported as it ends:
1. exactness: the engine's exactness tests (tests/test_engine_exact.py: speculative greedy ==
   plain greedy for every family x drafter kind, plain greedy == the uncached forward) with the
   tiny models on the device, in float32 (must pass) and in bfloat16 (reported: a verify pass over
   k+1 tokens may round a near-tie of random weights differently from a one-token pass);
2. real scale: measure/realscale.py at the Qwen2.5-VL-7B shape (random weights, bfloat16,
   built on first use) with timings that synchronise the device before each clock reading.
`--short` runs step 1 for one family (qwen2_5_vl) in float32 on the CPU, in process, and step 2 on the shrunken SmolVLM
shape in float32 (replay at acceptance 1.0 and 0.2), in well under a minute. The exit status is non-zero when a float32 exactness test fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exactness(device: str, dtype: str) -> dict:
    """pytest on the exactness tests with the tiny models on `device` in `dtype`."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_exact.py"]
    env = dict(os.environ, VLM_TEST_DEVICE=device, VLM_TEST_DTYPE=dtype)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"device": device, "dtype": dtype, "passed": done.returncode == 0, "summary": summary,
            "seconds": round(time.perf_counter() - started, 1),
            "failures": [line for line in done.stdout.splitlines() if line.startswith("FAILED")]}


def exactness_short(family: str = "qwen2_5_vl") -> dict:
    """In this process, on the CPU in float32: one family's plain and speculative greedy answers
    (text LM, VLM and n-gram drafters; 1 and 2 images) must be identical (CI runs the whole
    exactness suite on the CPU anyway: this checks the check)."""
    import tempfile
    from pathlib import Path

    from measure.exactness import DRAFTERS, TinyZoo, conversation, run

    started = time.perf_counter()
    zoo, failures, cases = TinyZoo(Path(tempfile.mkdtemp())), [], 0
    for num_images in (1, 2):
        plain = run(zoo, family, None, conversation(num_images)).token_ids
        for drafter in DRAFTERS:
            cases += 1
            if run(zoo, family, drafter, conversation(num_images)).token_ids != plain:
                failures.append(f"FAILED {family} {drafter} with {num_images} images")
    return {"device": "cpu", "dtype": "float32", "passed": not failures, "failures": failures,
            "summary": f"{cases - len(failures)} passed, {len(failures)} failed ({family}, in process)",
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
    for result in ([exactness(device, "float32"), exactness(device, "bfloat16")] if cuda else [exactness_short()]):
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
