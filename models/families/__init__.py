"""Supported model families, registered by `config.model_type` (as vLLM's multimodal registry
registers one processing class per model type). A family is one file in this package that
defines `FAMILIES`, a tuple of `Family` objects (base.py says what a family knows): every module
here is imported and its families registered, so adding a family touches no other file."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Family, MRopeFamily


def _registry() -> dict[str, Family]:
    """model_type -> Family for every family module of this package; a model type claimed twice is an error."""
    registry: dict[str, Family] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        for family in getattr(importlib.import_module(f"{__name__}.{module_info.name}"), "FAMILIES", ()):
            for model_type in family.model_types:
                if model_type in registry:
                    raise ValueError(f"model type {model_type!r} is claimed by {registry[model_type].name} "
                                     f"and {family.name}")
                registry[model_type] = family
    return registry


REGISTRY: dict[str, Family] = _registry()
VLM_FAMILIES: tuple[Family, ...] = tuple(dict.fromkeys(REGISTRY.values()))

# Any text-only causal LM (a drafter) numbers positions on one axis; Llama and Qwen2 ones decode fast.
TEXT_LM = Family("text_lm", (), fast_text_types=("llama", "qwen2"))


def fast_text_types() -> tuple[str, ...]:
    """Every text model type whose decoder layers the fast path runs, as the families declare
    (engine/fast_decode.py `TEXT_TYPES`)."""
    return tuple(dict.fromkeys(kind for family in (*VLM_FAMILIES, TEXT_LM) for kind in family.fast_text_types))


def fast_head_layers() -> tuple[str, ...]:
    """The families whose layers a drafter head may be built from and still run on the fast path
    (models/drafter_heads.py `layers_from`; engine/fast_heads.py)."""
    return tuple(family.name for family in VLM_FAMILIES if family.fast_heads)


def family_of_type(model_type: str | None) -> Family | None:
    """The registered family of `model_type` (a config's), or None: for declarations that apply
    only where a family declares them (models/gguf.py's quirks)."""
    return REGISTRY.get(model_type)


def family_for_config(config) -> Family:
    """The family of a VLM config; refuses loudly when the family is not supported."""
    if config.model_type in REGISTRY:
        return REGISTRY[config.model_type]
    raise ValueError(
        f"model type {config.model_type!r} is not a supported vision-language family "
        f"(supported: {', '.join(REGISTRY)}). Pick a model of one of these families."
    )


__all__ = ["Family", "MRopeFamily", "REGISTRY", "VLM_FAMILIES", "TEXT_LM", "family_for_config", "family_of_type",
           "fast_head_layers", "fast_text_types"]
