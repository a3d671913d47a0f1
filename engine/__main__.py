"""Command line: answer one prompt about zero or more images, plainly or speculatively.

    python -m engine [--preset NAME] [--model ID_OR_DIR] [--drafter ID_OR_DIR|ngram|mtp|none] [--mode plain|speculative]
                     [--image PATH]... [--max-new-tokens N] [--dtype D] [--device D]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--draft-tokens K]
                     [--adaptive] [--json] PROMPT

User errors (missing or unreadable image, unknown model, incompatible drafter) exit with
status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.images import ImageError, load_image
from engine.loop import DecodeSettings, Done
from engine.sampling import SamplingSettings


def parse_args(argv=None) -> argparse.Namespace:
    from models.presets import PRESETS, resolve

    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named target/drafter pair (default: demo)")
    parser.add_argument("--model", help="hub id or local folder of the target VLM (default: the preset's)")
    parser.add_argument("--drafter", default=None,
                        help="hub id or folder of a drafter (text LM, VLM of the target's family, DFlash or Gemma 4 "
                             "assistant), 'ngram', 'mtp' (the target's own MTP layers), or 'none' "
                             "(default: the preset's first drafter)")
    parser.add_argument("--mode", choices=["plain", "speculative"], default="speculative")
    parser.add_argument("--image", action="append", default=[], help="an image file; repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help='"auto" (default): float32 on a CPU for drafters under 1B parameters, else --dtype')
    parser.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--quantization", choices=["4bit", "8bit"], default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--adaptive", action="store_true", help="adapt the draft length to acceptance")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    args = parser.parse_args(argv)
    args.model, drafters = resolve(args.preset, args.model, [args.drafter] if args.drafter else None)
    args.drafter = drafters[0]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    from engine.engine import Engine, RequestError
    from models.loading import LoadError, LoadOptions, load_drafter, load_target

    hf_logging.disable_progress_bar()  # stderr carries only our own one-line messages
    hf_logging.set_verbosity_error()
    try:
        images = [load_image(path) for path in args.image]
        options = LoadOptions(args.dtype, args.device, args.quantization, args.trust_remote_code,
                              drafter_dtype=args.drafter_dtype)
        target = load_target(args.model, options)
        drafter = load_drafter(None if args.mode == "plain" else args.drafter, target, options)
        engine = Engine(target, {args.drafter: drafter} if drafter else {})
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": args.prompt}]
        events = engine.stream(
            [{"role": "user", "content": content}],
            drafter=args.drafter if drafter else None,
            sampling=SamplingSettings(args.temperature, args.top_p, args.top_k, args.seed),
            decode=DecodeSettings(args.max_new_tokens, args.draft_tokens, args.adaptive),
        )
        for event in events:
            if isinstance(event, Done):
                done = event
            elif not args.json:
                print(event.text, end="", flush=True)
    except (ImageError, LoadError, RequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": done.token_ids, "stats": done.stats.as_dict()}))
    else:
        print(f"\n[{done.stats.summary()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
