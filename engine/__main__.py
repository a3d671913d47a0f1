"""Command line: answer one prompt about zero or more images, plainly or speculatively.

    python -m engine [--backend URL] [--preset NAME] [--model ID_OR_DIR] [--drafter ID_OR_DIR|ngram|mtp|auto|none]
                     [--image PATH]... [load flags: --dtype D --device D ...] [settings: --mode plain|speculative
                     --max-new-tokens N --temperature T --top-p P --top-k K --seed S --draft-tokens K --adaptive
                     --draft-tree NODES --tree-branching B --system-prompt TEXT] [--json] PROMPT

The settings are the app's API parameters, with dashes (engine/settings.py, docs/settings.md).
User errors (missing or unreadable image, unknown model, incompatible drafter) exit with
status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.image_jail import ImageJail
from engine.images import ImageError
from engine.loop import Done
from engine.settings import add_cli_args, from_args


def _open_images(paths: list[str]) -> list:
    """The images, decoded in a jailed child as the app's uploads are (engine/image_jail.py)."""
    jail = ImageJail()
    try:
        return [jail.load(path) for path in paths]
    finally:
        jail.close()


def parse_args(argv=None) -> argparse.Namespace:
    from engine.build import add_model_flags

    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="the question: the user turn to answer")
    add_model_flags(parser)
    parser.add_argument("--image", action="append", default=[], help="an image file; repeat for several")
    add_cli_args(parser.add_argument_group("settings (the app's API parameters, docs/settings.md)"))
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
        settings = from_args(args)  # RequestError names the setting out of range
        images = _open_images(args.image)
        if args.backend:
            backend = remote(args.backend)  # the server decides its own speculative decoding
        else:
            spec = spec_from_args(args)
            # The command line answers with one drafter: the first named (or the preset's first), or
            # with --drafter auto the one that `auto` picks among them all.
            spec = replace(spec, drafters=(spec.drafters if spec.auto else spec.drafters[:1])
                           if settings.mode == "speculative" else ())
            backend = BuiltIn(build_engine(spec))
        content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": args.prompt}]
        system = [{"role": "system", "content": [{"type": "text", "text": settings.system_prompt}]}] \
            if settings.system_prompt.strip() else []
        events = backend.stream(Request(system + [{"role": "user", "content": content}],
                                        drafter=backend.capabilities.default_drafter,
                                        sampling=settings.sampling(), decode=settings.decode()))
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
