"""Command line: answer one prompt about zero or more images, plainly or speculatively.

    python -m engine [--backend URL] [--preset NAME] [--model ID_OR_DIR] [--drafter ID_OR_DIR|ngram|mtp|none] [--mode plain|speculative]
                     [--image PATH]... [--max-new-tokens N] [--dtype D] [--drafter-dtype D] [--device D]
                     [--quantization 4bit|8bit] [--trust-remote-code] [--temperature T] [--top-p P]
                     [--top-k K] [--seed S] [--draft-tokens K] [--adaptive] [--draft-tree NODES]
                     [--tree-branching B] [--json] PROMPT

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
    from engine.build import add_model_flags

    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    add_model_flags(parser)
    parser.add_argument("--mode", choices=["plain", "speculative"], default="speculative")
    parser.add_argument("--image", action="append", default=[], help="an image file; repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="draft exactly K tokens a round (default: k chosen each round from measured cost)")
    parser.add_argument("--adaptive", action="store_true",
                        help="the +2/-1 rule from --draft-tokens (or 4): +2 after a full acceptance, -1 after a "
                             "rejection")
    parser.add_argument("--draft-tree", type=int, default=DecodeSettings.tree_nodes, metavar="NODES",
                        help="draft trees of up to NODES nodes, --draft-tokens deep, verified in one pass "
                             "(0: chains, the default)")
    parser.add_argument("--tree-branching", type=int, default=DecodeSettings.tree_branching,
                        help="a draft tree node's most children (default 2)")
    parser.add_argument("--backend", metavar="URL",
                        help="answer with a remote OpenAI-compatible server (llama-server, vLLM, SGLang) instead "
                             "of loading a model; its API key, if any, from VLM_BACKEND_API_KEY (docs/backends.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dataclasses import replace

    from transformers.utils import logging as hf_logging

    from engine.backend import BuiltIn, Request
    from engine.build import build_engine, spec_from_args
    from engine.engine import RequestError
    from models.loading import LoadError

    hf_logging.disable_progress_bar()  # stderr carries only our own one-line messages
    hf_logging.set_verbosity_error()
    try:
        images = [load_image(path) for path in args.image]
        if args.backend:
            backend = remote(args.backend)  # the server decides its own speculative decoding
        else:
            spec = spec_from_args(args)
            # The command line answers with one drafter: the first named (or the preset's first), or
            # with --drafter auto the one that `auto` picks among them all.
            spec = replace(spec, drafters=(spec.drafters if spec.auto else spec.drafters[:1])
                           if args.mode == "speculative" else ())
            backend = BuiltIn(build_engine(spec))
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": args.prompt}]
        events = backend.stream(Request(
            [{"role": "user", "content": content}],
            drafter=backend.capabilities.default_drafter,
            sampling=SamplingSettings(args.temperature, args.top_p, args.top_k, args.seed),
            decode=DecodeSettings(args.max_new_tokens, args.draft_tokens, args.adaptive,
                                  tree_nodes=args.draft_tree, tree_branching=args.tree_branching),
        ))
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


def remote(url: str):
    from engine.backends.openai import OpenAIServer
    from engine.engine import RequestError

    try:
        return OpenAIServer(url)
    except ValueError as error:  # not an http(s) URL
        raise RequestError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
