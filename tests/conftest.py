"""Shared fixtures: tiny random-weight models built once per test session, saved to folders
and loaded back through the same `from_pretrained` code as hub models."""

from __future__ import annotations

import os

import pytest
import torch

from engine.drafters.registry import load_drafter
from engine.target import load_target
from models.loading import LoadOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# How the tiny models load: float32 on the CPU, unless the GPU check (measure/gpu_check.py) asks
# for another device or dtype through these variables.
MODEL_OPTIONS = LoadOptions(dtype=os.environ.get("VLM_TEST_DTYPE", "float32"),
                            device=os.environ.get("VLM_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


class TinyZoo:
    """Builds each tiny model on first use; targets and drafters are loaded once."""

    def __init__(self, root):
        self.root = root
        self.dirs, self.targets, self.drafters = {}, {}, {}

    def dir(self, family: str, role: str = "target"):
        from tests import tiny

        key = (family, role)
        if key not in self.dirs:
            out = self.root / f"{family}-{role}"
            if role == "target":
                tiny.build_target(family, out)
            elif role == "text_drafter":
                tiny.build_text_drafter(self.dir(family), out)
            elif role == "vlm_drafter":
                tiny.build_vlm_drafter(family, out)
            self.dirs[key] = out
        return self.dirs[key]

    def target(self, family: str):
        if family not in self.targets:
            self.targets[family] = load_target(str(self.dir(family)), MODEL_OPTIONS)
        return self.targets[family]

    def drafter(self, family: str, role: str):
        """role: text_drafter (target's own language weights), vlm_drafter (other weights),
        same_vlm (the target's own folder as a VLM drafter), ngram."""
        key = (family, role)
        if key not in self.drafters:
            name = {"ngram": "ngram", "same_vlm": str(self.dir(family))}.get(role) or str(self.dir(family, role))
            self.drafters[key] = load_drafter(name, self.target(family), MODEL_OPTIONS)
        return self.drafters[key]


@pytest.fixture(scope="session")
def zoo(model_root):
    return TinyZoo(model_root)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread of a busy 2-core machine; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
