"""Supported model families, looked up by `config.model_type`. Adding a family = adding one
file here that defines `FAMILIES`, and naming it below."""

from __future__ import annotations

from . import gemma3, gemma4, idefics3, llava, muse_glimmer, qwen3_5, qwen_vl, step3p7
from .base import Family, MRopeFamily

VLM_FAMILIES: tuple[Family, ...] = (qwen_vl.FAMILIES + idefics3.FAMILIES + llava.FAMILIES + gemma3.FAMILIES
                                     + qwen3_5.FAMILIES + step3p7.FAMILIES + muse_glimmer.FAMILIES + gemma4.FAMILIES)

# Any text-only causal LM (a drafter) numbers positions on one axis.
TEXT_LM = Family("text_lm", ())


def family_for_config(config) -> Family:
    """The family of a VLM config; refuses loudly when the family is not supported."""
    for family in VLM_FAMILIES:
        if config.model_type in family.model_types:
            return family
    supported = ", ".join(t for f in VLM_FAMILIES for t in f.model_types)
    raise ValueError(
        f"model type {config.model_type!r} is not a supported vision-language family "
        f"(supported: {supported}). Pick a model of one of these families."
    )


__all__ = ["Family", "MRopeFamily", "VLM_FAMILIES", "TEXT_LM", "family_for_config"]
