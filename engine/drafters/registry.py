"""Which drafter serves a `--drafter` value: each drafter file's `serves(name, config)` is asked
in this order, and the first that claims it loads it (`load(name, config, target, options)`,
with its own fit checks). Adding a drafter = its file plus one line here.

`config` is None for the keywords (`ngram`, `mtp`), which name no checkpoint; an EAGLE-3
checkpoint's (SpecForge or speculators, read from its config.json: transformers has no config
class for either) for eagle3; else the checkpoint's transformers config. The model drafter
comes last (language_model.py): it takes any other language model.
"""

from __future__ import annotations

from engine.drafters import block, dflash, eagle3, language_model, mtp, mtp_head, ngram, shared_cache
from engine.drafters.base import Drafter
from models.loading import LoadError, LoadOptions, load_config

DRAFTERS = (
    ngram,  # "ngram": prompt lookup, no model
    mtp,  # "mtp": the target checkpoint's own MTP layers
    eagle3,  # an EAGLE-3 checkpoint (SpecForge's LlamaForCausalLMEagle3, or speculators' eagle3)
    dflash,  # a DFlash block assistant (config names target_layer_ids and block_size)
    shared_cache,  # an assistant attending to the target's shared K/V (config names backbone_hidden_size)
    mtp_head,  # the project's own MTP head (config model_type "mtp_head", models/drafter_heads.py)
    block,  # the project's own block drafter (config model_type "block_drafter", models/drafter_heads.py)
    language_model,  # any other causal LM or VLM of the target's family
)
KEYWORDS = (ngram.KEYWORD, mtp.KEYWORD)
NONE = ("", "none")


def load_drafter(name: str | None, target, options: LoadOptions = LoadOptions()) -> Drafter | None:
    """The drafter `name` names, fitted to `target`; None for plain decoding (None, "", "none")."""
    if name is None or name in NONE:
        return None
    config = None if name in KEYWORDS else eagle3.read_config(name) or load_config(name, options)
    for drafter in DRAFTERS:
        if drafter.serves(name, config):
            return drafter.load(name, config, target, options)
    raise LoadError(f"no drafter serves {name!r}")  # unreachable: the model drafter takes any config
