"""Chat with a vision-language model about several images at once; speculative decoding makes
it answer faster, and a live panel shows by how much.

    python app.py                                        # the demo model: SmolLM2-135M-Instruct + a vision tower
    python app.py --preset demo                          # the 3.6 M demo model (assets/demo): fast, a toy
    python app.py --model DIR_OR_HUB_ID --drafter DIR_OR_HUB_ID|ngram [--no-browser] [--share]
    python app.py --backend http://127.0.0.1:8080       # a vLLM / SGLang / llama-server answers instead
    python app.py --ab-backend http://127.0.0.1:8080    # A/B: the built-in engine vs that server
    python app.py --desktop                              # in a window of its own (requirements-desktop.txt)

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


def main(argv: list[str] | None = None, block: bool = True, limits=None):
    """Start the app; `limits` (app_ui.visitors.Limits): the bounds on what visitors may hold
    (default: Limits from VLM_* variables, docs/security.md). Each step that may take a while is
    printed, and the app's address says "Starting…" until it is ready (app_ui/starting.py)."""
    from app_ui.starting import Startup

    startup = Startup()
    try:
        return _start(argv, block, limits, startup)
    finally:
        startup.close()  # also when a step fails: the address is free again


def _start(argv: list[str] | None, block: bool, limits, startup):
    from app_ui.served import Served
    from app_ui.setup import SetupError, open_backends, read_config, warm_up

    # 1. Settings from flags, else environment variables, else defaults; a bad one is one line.
    #    Then the address answers "Starting…".
    try:
        with startup.step("Reading the settings", announce=False):
            config = read_config(argv)
            if config.desktop:  # a missing package is one line now, not after the model has loaded
                from app_ui import desktop

                desktop.check()
        startup.serve(config.host, config.port, open_browser=config.open_browser)
        with startup.step(_opening(config), announce=bool(config.backend or config.ab_backend)):
            backend, ab_backend = open_backends(config)
    except SetupError as error:
        sys.exit(f"error: {error}")
    except OSError as error:  # the port is taken
        sys.exit(f"error: {error}")
    # 2. Load the target and its drafters (unless a server answers); a missing or unusable model is
    #    one line, not a traceback. A server that is down is told to each request, in one line.
    engine = None if backend else _load(config, startup)
    jail = _image_jail()  # visitors' images are decoded in its children only (engine/image_jail.py)
    served = Served.remote(backend, config.max_images, jail) if backend else Served.built_in(engine, jail)
    # 3. Keep one-time costs out of the first visitor's statistics (ZeroGPU has no GPU outside requests).
    if engine is not None and not (spaces is not None and os.environ.get("SPACES_ZERO_GPU")):
        try:
            with startup.step("Warming up (a short answer per drafter)"):
                warm_up(engine)
        except Exception as error:
            sys.exit(f"error: the model loaded but cannot answer: {_one_line(error)}")
    # 4. The bounds on visitors (docs/security.md); a bad VLM_* value is one line. 5. Uploads an
    #    earlier process left are deleted; this one's are listed for the next (_bounds).
    from gradio.utils import get_upload_folder

    from app_ui.components import CSS, EXAMPLES_DIR
    from app_ui.layout import build_demo
    from app_ui.visitors import Visitors
    from engine.images import MAX_FILE_BYTES

    limits, journals = _bounds(config, limits, get_upload_folder())
    # 6. Build the UI and serve it behind the visitors' guard; generations queue (one at a time,
    #    see app_ui/callbacks.py); idle conversations and unsent uploads are swept while it runs.
    with startup.step("Building the page", announce=False):
        visitors = Visitors(limits, public=[EXAMPLES_DIR])
        demo = build_demo(served, gpu=gpu_decorator(), visitors=visitors, ab_backend=ab_backend)
        demo.queue(default_concurrency_limit=1)
    guard = _guard(demo, visitors, get_upload_folder(), served)
    startup.close()  # the starting page gives the port to the app (the browser, if any, is open on it)
    try:
        demo.launch(server_name=config.host, server_port=startup.port, share=config.share,
                    inbrowser=False, prevent_thread_lock=True, allowed_paths=[EXAMPLES_DIR],
                    max_file_size=MAX_FILE_BYTES, css=CSS,  # serves uploads and the examples, nothing else
                    app_kwargs={"middleware": [guard], "lifespan": visitors.lifespan}, enable_monitoring=False,
                    state_session_capacity=visitors.limits.sessions, quiet=True,
                    footer_links=["api", "gradio", "settings"])  # not "runs": Gradio's run history is not the chat
    except OSError as error:  # e.g. the port is taken
        sys.exit(f"error: {error}")
    visitors.journal = os.path.join(journals, f"{os.getpid()}-{demo.server_port}.txt")
    # Our own start-up lines: Gradio's would suggest `share=True`, a code change, for what --share does.
    print(f"Running on {demo.local_url}" + (f" and {demo.share_url}" if demo.share_url else
                                          " (a public link: --share, or VLM_SHARE=1)")
          + f"; ready {startup.ready():.1f} s after the start", flush=True)
    if config.desktop:  # the window holds the main thread; closing it stops the app
        from app_ui import desktop

        desktop.open_window(demo.local_url)
        demo.close()
    elif block:
        demo.block_thread()
    return demo


def _guard(demo, visitors, uploads: str, served):
    """The visitors' guard in front of the app (app_ui/guard.py), refusing to start where it could not
    read Gradio's queue (every field it reads must be there: a check that cannot look refuses); an
    answer's uploads are decoded before it joins the line (app_ui/prepare_lane.py)."""
    from starlette.middleware import Middleware

    from app_ui import queue_rules
    from app_ui.callbacks import GENERATE
    from app_ui.guard import Guard
    from app_ui.uploads import decode_uploads

    def decode(paths, client, cancelled):
        return decode_uploads(served, visitors, paths, client, cancelled, visitors.limits.time_budget_s)

    try:
        queue_rules.check_readable(demo)
    except queue_rules.QueueUnreadable as error:
        sys.exit(f"error: {error}; install the Gradio of requirements.txt")
    group = GENERATE["concurrency_id"]  # the events that answer: bounded per session and address (queue_rules)
    visitors.answering = lambda: queue_rules.sessions(demo, group)
    # The Guard reads the client's address itself (X-Forwarded-For only behind VLM_PROXY_HOPS proxies);
    # uvicorn, which Gradio starts, would otherwise replace a local client's address by the header's.
    os.environ["FORWARDED_ALLOW_IPS"] = ""  # uvicorn's Config reads it when launch builds one: trust no proxy
    return Middleware(Guard, visitors=visitors, uploads=uploads, answer_group=group, decode=decode)


def _load(config, startup):
    """The engine of `config` (the compiled decode path first); a missing or unusable model exits with one line."""
    from app_ui.setup import SetupError, assemble_target, load_engine
    from models.presets import SMOL_DEMO

    # (named as the header names it: the page is public, the folders it was loaded from are not; the
    # smol demo's folder is a cache path with a hash)
    model = ("SmolLM2-135M-Instruct + the demo's vision tower" if config.model == SMOL_DEMO
             else "/".join(str(config.model).rstrip("/").rsplit("/", 2)[-2:]))
    try:
        if config.model == SMOL_DEMO:  # the default: assembled on its first start (models/demo/smol.py), then cached
            with startup.step("Finding the smol demo model (SmolLM2-135M-Instruct + the demo's vision tower; "
                              "assembled on the first start, then cached)"):
                config = assemble_target(config)
        with startup.step("Loading the compiled decode path (engine/fast_layer.cpp)", announce=False):
            _compiled_path(config)
        with startup.step(f"Loading {model} and its drafters"):
            return load_engine(config)
    except SetupError as error:
        sys.exit(f"error: {error}")
    except Exception as error:  # e.g. a truncated weights file, which safetensors reports in its own way
        sys.exit(f"error: cannot load {config.model} or its drafters: {_one_line(error)}")


def _bounds(config, limits, upload_folder: str):
    """(the visitors' limits, the journal folder): every variable through engine/settings.py
    `from_environ` (a bad one exits with one line); the uploads an earlier process left deleted,
    in a folder beside the upload folder (Gradio serves nothing there)."""
    from app_ui.journals import journal_folder, sweep_journals
    from app_ui.visitors import Limits
    from engine.settings import Ceilings

    try:  # RequestError is a ValueError
        limits = limits or Limits.from_environ(proxy_hops=1 if config.behind_proxy else 0)
        Ceilings.from_environ()
    except ValueError as error:
        sys.exit(f"error: {error}")
    journals = journal_folder(upload_folder)
    sweep_journals(journals)
    os.makedirs(journals, exist_ok=True)
    return limits, journals


def _image_jail():
    """The pool of decoding children, sized and limited by VLM_DECODE_* (a bad value exits with one
    line), started now: each imports Pillow while the model warms up."""
    from engine.image_jail import Decoding, ImageJail
    from engine.settings import from_environ

    try:
        jail = ImageJail(from_environ(Decoding))
    except ValueError as error:
        sys.exit(f"error: {error}")
    jail.warm()
    return jail


def _opening(config) -> str:
    """The step that opens --backend / --ab-backend: llama.cpp converts a checkpoint once, then starts."""
    flags = [f"{flag} {value}" for flag, value in (("--backend", config.backend), ("--ab-backend", config.ab_backend))
             if value]
    converting = any(value.split(":")[0] == "llamacpp" for value in (config.backend, config.ab_backend) if value)
    return f"Opening {' and '.join(flags) or 'no backend'}" + (
        " (llama.cpp: a checkpoint is converted to GGUF once, then served)" if converting else "")


def _compiled_path(config) -> None:
    """Build or load the compiled decode path now, on a CPU, so that its time is a step of its own
    (the model's load would ask for it; engine/fast_native.py prints when it compiles)."""
    from engine import fast_native
    from models.loading import LoadError, resolve_device

    try:
        on_cpu = resolve_device(config.spec.options.device) == "cpu"
    except LoadError:  # the model's load says so, in its words
        return
    if on_cpu:
        fast_native.layer()


def _one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


if __name__ == "__main__":
    main()
