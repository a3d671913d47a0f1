"""Shared fixtures: tiny random-weight models built once per test session, saved to folders
and loaded back through the same `from_pretrained` code as hub models."""

from __future__ import annotations

import os

import pytest
import torch

from measure.exactness import TinyZoo
from models.loading import LoadOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# How the tiny models load: float32 on the CPU, unless these variables ask for another device or
# dtype (the exactness tests on a GPU: VLM_TEST_DEVICE=cuda python -m pytest tests/test_engine_exact.py).
MODEL_OPTIONS = LoadOptions(dtype=os.environ.get("VLM_TEST_DTYPE", "float32"),
                            device=os.environ.get("VLM_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def zoo(model_root):
    return TinyZoo(model_root, MODEL_OPTIONS)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread of a busy 2-core machine; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llamacpp():
    """A llama-server in a child process (engine/backends/llamacpp.py) on the bundled demo model,
    converted to GGUF in float32 (cached in .gguf/), its text drafter as llama.cpp's draft model."""
    from engine.backends.llamacpp import LlamaCpp
    from tests.helpers import DEMO_TARGET, DEMO_TEXT_DRAFTER

    return LlamaCpp.from_checkpoint(DEMO_TARGET, draft=DEMO_TEXT_DRAFTER, threads=1)


@pytest.fixture(scope="session")
def browser():
    """Chromium (Debian's, tests/helpers.py CHROMIUM) driven by Playwright, one for the session."""
    from playwright.sync_api import sync_playwright

    from tests.helpers import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def engine(zoo):
    """The reference engine (tests/helpers.py `reference_engine`: the app's weights and drafters,
    loaded apart from the app), once per test module; a module may define its own `engine`."""
    from tests.helpers import reference_engine

    return reference_engine(zoo)
