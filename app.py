"""Chat with a vision-language model about several images at once; speculative decoding makes
it answer faster, and a live panel shows by how much.

    python app.py                                        # the bundled demo model (assets/demo)
    python app.py --model DIR_OR_HUB_ID --drafter DIR_OR_HUB_ID|ngram [--no-browser] [--share]

Every flag has an environment variable for Hugging Face Spaces (`python app.py --help`,
app_ui/setup.py). On ZeroGPU, the `spaces` package's GPU decorator wraps each callback that
generates; without the package the decorator is a no-op. Nothing is loaded at import time.
"""

from __future__ import annotations

import os
import sys

try:
    import spaces  # Hugging Face ZeroGPU: imported before anything initializes CUDA
except ImportError:
    spaces = None


def gpu_decorator():
    return spaces.GPU(duration=120) if spaces is not None else (lambda fn: fn)


def main(argv: list[str] | None = None, block: bool = True):
    from app_ui.setup import SetupError, load_engine, read_config, warm_up

    # 1. Settings from flags, else environment variables, else defaults.
    config = read_config(argv)
    # 2. Load the target and its drafters; a missing or unusable model is one line, not a traceback.
    try:
        engine = load_engine(config)
    except SetupError as error:
        sys.exit(f"error: {error}")
    # 3. Keep one-time costs out of the first visitor's statistics (ZeroGPU has no GPU outside requests).
    if not (spaces is not None and os.environ.get("SPACES_ZERO_GPU")):
        warm_up(engine)
    # 4. Build the UI and serve it; generations queue (one at a time, see app_ui/layout.py).
    from app_ui.layout import CSS, EXAMPLES_DIR, build_demo
    from engine.images import MAX_FILE_BYTES

    demo = build_demo(engine, gpu=gpu_decorator())
    demo.queue(default_concurrency_limit=1)
    try:
        demo.launch(server_name=config.host, server_port=config.port, share=config.share,
                    inbrowser=config.open_browser, prevent_thread_lock=not block, allowed_paths=[EXAMPLES_DIR],
                    max_file_size=MAX_FILE_BYTES, css=CSS)  # serves uploads and the examples, nothing else
    except OSError as error:  # e.g. the port is taken
        sys.exit(f"error: {error}")
    return demo


if __name__ == "__main__":
    main()
