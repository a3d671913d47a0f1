"""Named target/drafter pairs, and the bundled demo model that is the default.

Presets other than `demo` need the Hugging Face hub (or a local copy of the weights); their
loading code is the same `from_pretrained` path as the bundled model's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo")
DEFAULT_MODEL = os.path.join(ASSETS, "target")
DEFAULT_DRAFTER = os.path.join(ASSETS, "text_drafter")


@dataclass(frozen=True)
class Preset:
    target: str
    drafters: tuple[str, ...]  # the first is the default; "ngram" always works
    note: str = ""


PRESETS: dict[str, Preset] = {
    "demo": Preset(DEFAULT_MODEL, (DEFAULT_DRAFTER, os.path.join(ASSETS, "vlm_drafter"), "ngram"),
                   "bundled Qwen2-VL-family model trained on a synthetic world; runs offline on a CPU"),
}
