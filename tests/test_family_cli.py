"""Every seed family through the command line and the app's setup, as a user runs them.

Tiny random-weight checkpoint folders (tests/tiny_next.py), saved with their processor files,
load through their family's real `load_processor`; nothing is patched:
    step3p7       --drafter mtp         its checkpoint's MTP layers (Step-3.7 local crops included)
    muse_glimmer  --drafter DIR         its DFlash assistant
    gemma4        --drafter DIR         its shared-cache assistant
    qwen3_5       --drafter mtp         its checkpoint's mtp.* weights as the project's MTP head
With one and two photos, float32: the speculative answer is the plain one, token for token, and
the speculative run drafted every round (the drafters' random weights accept almost nothing;
tests/test_target_drafters.py forces acceptances through the same drafters).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from app_ui import setup
from app_ui.setup import load_engine, read_config, warm_up
from models.families import REGISTRY
from tests import tiny_next
from tests.conftest import ROOT
from tests.helpers import cli_json

PHOTOS = [f"{ROOT}/assets/examples/rocket.jpg", f"{ROOT}/assets/examples/chelsea.png"]  # 640 x 427, 451 x 300
DRAFTERS = {"step3p7": ("mtp", "mtp"), "muse_glimmer": ("assistant", "dflash"),
            "gemma4": ("assistant", "shared_cache"), "qwen3_5": ("mtp", "mtp")}  # --drafter, its kind
DRAFT_TOKENS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


class Folders:
    """Each family's target folder, and its assistant's, built on first use."""

    def __init__(self, root):
        self.root, self.built = root, {}

    def __call__(self, family: str) -> tuple[str, str]:
        """(target folder, --drafter value)."""
        if family not in self.built:
            target = tiny_next.build_target(family, self.root / family)
            drafter = DRAFTERS[family][0]
            if drafter == "assistant":
                drafter = str(tiny_next.build_assistant(family, self.root / f"{family}-assistant"))
            self.built[family] = str(target), drafter
        return self.built[family]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("family-cli"))


def command(target: str, num_images: int) -> list[str]:
    images = [arg for photo in PHOTOS[:num_images] for arg in ("--image", photo)]
    return ["--model", target, *images, "--max-new-tokens", "16", "--dtype", "float32", "--device", "cpu",
            "What is shown?"]


@pytest.mark.parametrize("num_images", [1, 2])
@pytest.mark.parametrize("family", DRAFTERS)
def test_speculative_answer_equals_plain(folders, capsys, family, num_images):
    target, drafter = folders(family)
    plain = cli_json(capsys, command(target, num_images) + ["--mode", "plain"])
    speculative = cli_json(capsys, command(target, num_images) + ["--drafter", drafter,
                                                                  "--draft-tokens", str(DRAFT_TOKENS)])

    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0
    stats = speculative["stats"]
    assert stats["mode"] == "speculative" and stats["drafter_kind"] == DRAFTERS[family][1]
    assert stats["fallback_reason"] is None and stats["draft_lengths"][0] == DRAFT_TOKENS
    # every round drafted: at most one token is committed per round without acceptances
    assert stats["drafted"] >= len(plain["token_ids"]) - 1 + stats["accepted"], stats
    assert stats["prefill_image_tokens"] == plain["stats"]["prefill_image_tokens"] > 0


@pytest.mark.parametrize("family", ["step3p7", "muse_glimmer", "gemma4"])
def test_photos_become_the_tokens_their_pixels_say(folders, family):
    """The loaded processor's pixels are its image processor's (Gemma 4: transformers' own PIL
    class), and each image gets as many tokens as they say. Step-3.7 (224-pixel view, 112-pixel
    crops, photos scaled to 448 at most): each photo is a view of 16 tokens and 3 x 4 crops of 4."""
    processor = REGISTRY[family].load_processor(folders(family)[0])
    photos = [Image.open(photo) for photo in PHOTOS]
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * 2}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=photos, return_tensors="pt")
    pixels = processor.image_processor(photos, return_tensors="pt")

    assert torch.equal(inputs["pixel_values"], pixels["pixel_values"])
    expected = {"step3p7": lambda: 2 * 16 + 4 * int(pixels["num_local_patches"].sum()),
                "muse_glimmer": lambda: int(pixels["image_grid_thw"].prod(-1).sum()) // 4,
                "gemma4": lambda: sum(pixels["num_soft_tokens_per_image"])}[family]()
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == expected
    if family == "step3p7":
        assert inputs["num_local_patches"].tolist() == [12, 12]
        assert torch.equal(inputs["pixel_values_local"], pixels["pixel_values_local"])


def test_module_entry_point_with_images(folders, capsys):
    """`python -m engine` in its own process, as a user types it: Step-3.7 and its MTP layers on
    two photos give the answer the plain run gives in this process."""
    target, drafter = folders("step3p7")
    plain = cli_json(capsys, command(target, 2) + ["--mode", "plain"])
    out = subprocess.run([sys.executable, "-m", "engine", *command(target, 2), "--drafter", drafter, "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    speculative = json.loads(out.stdout)
    assert speculative["token_ids"] == plain["token_ids"] and speculative["stats"]["drafted"] > 0


@pytest.mark.parametrize("family", DRAFTERS)
def test_app_setup_serves_the_folder(folders, family, monkeypatch):
    """The app's path: flags read, engine built with the drafter and n-gram, one warm-up answer
    per decoding mode, then the heap's free pages given back once (malloc_trim)."""
    target, drafter = folders(family)
    config = read_config(["--model", target, "--drafter", drafter, "--dtype", "float32", "--device", "cpu"], environ={})
    engine = load_engine(config)
    trims = []
    monkeypatch.setattr(setup, "return_freed_memory", lambda: trims.append(1))
    warm_up(engine)
    assert len(trims) == 1
    assert [d.kind for d in engine.drafters.values()] == [DRAFTERS[family][1], "ngram"]
