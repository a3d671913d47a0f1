"""Acceptance and tokens per target forward of drafters on the benchmark's requests at a fixed k,
with no timing: the figures of `python -m measure.bench --fixed-k K`'s k = K rows (the same
requests, warm-up, decode settings and summary: measure/bench.py's `run_rows` and `summarize`),
without the other rows or the cost model. Greedy drafting and verification do not depend on
speed, so a drafter being trained can be scored in seconds, on a busy machine too.

    python -m measure.acceptance --drafter assets/demo/mtp_drafter,DIR [--fixed-k 4] [--requests 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.loop import DecodeSettings
from measure.bench import Row, demo_requests, photo_requests, run_rows, short, smol_requests, summarize


def main(argv=None) -> int:
    from engine.build import add_model_flags, build_engine, spec_from_args

    parser = argparse.ArgumentParser(prog="python -m measure.acceptance", description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--fixed-k", type=int, default=4, metavar="K", help="tokens drafted a round (default 4)")
    parser.add_argument("--requests", type=int, default=12, help="number of the benchmark's requests (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the answer's most tokens (default 128)")
    parser.add_argument("--requests-from", choices=["demo", "smol", "photos"],
                        help="as measure.bench's (default: demo for the demo preset, smol for smol, else photos)")
    parser.add_argument("--json", metavar="FILE", help="write the rows (measure.bench's summary of each) as JSON")
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    engine = build_engine(spec)
    source = args.requests_from or {"demo": "demo", "smol": "smol"}.get(spec.preset, "photos")
    requests = {"demo": demo_requests, "smol": smol_requests, "photos": photo_requests}[source](args.requests)
    rows = [Row("this", "plain", None)] + [Row("this", "speculative", key, f"{short(drafter.name)}, k={args.fixed_k}",
                                               args.fixed_k) for key, drafter in engine.drafters.items()]
    run_rows(engine, rows, requests, DecodeSettings(max_new_tokens=args.max_new_tokens))
    table = [summarize(row, rows[0], {}) for row in rows[1:]]
    if args.json:
        with open(args.json, "w") as file:
            json.dump(table, file, indent=1)
    print(f"| drafter (k = {args.fixed_k}) | acceptance | tokens per target forward | identical to plain "
          "| accepted by position |\n|---|---|---|---|---|")
    for r in table:
        if r["acceptance"] is None:
            print(f"| {r['drafter']} | - | - | - | {r['error'] or 'nothing drafted'} |")
            continue
        positions = " / ".join(f"{p:.2f}" for p in r["accepted_by_position"] or [])
        print(f"| {r['drafter']} | {r['acceptance']:.3f} | {r['tokens_per_forward']:.3f} "
              f"| {r['identical_to_plain']}/{r['requests']} | {positions} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
