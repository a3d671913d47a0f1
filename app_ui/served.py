"""What the app serves, as its pages and callbacks need it: one description, whether the answers
come from the built-in engine or from another backend (engine/backend.py), such as a remote
OpenAI-compatible server (`python app.py --backend URL`).

    served = Served.built_in(engine)                      # the default: the loaded model
    served = Served.remote(OpenAIServer(url), max_images=8)
    for event in served.backend.stream(Request(...)): ...

The attributes that app_ui/session.py reads (`drafters`, `default_drafter`, `auto`,
`context_limit()`, `max_images`, `max_image_tokens`) have the names and meanings of Engine's, so
the request checks read the same for both. What a backend cannot tell (a remote model's context,
its processor) is None, and the app then checks less and lets the server refuse, in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from app_ui.line import AnswerTimes
from engine.backend import Backend, BuiltIn
from engine.engine import Engine
from engine.image_jail import ImageJail
from engine.prompt import Prompt
from models.presets import DEMO_MODEL, SMOL_DEMO

IMAGE_BUDGET_STEP, MAX_IMAGE_BUDGET = 16, 4096  # the tokens-per-image slider


@dataclass
class Served:
    backend: Backend
    model: str  # the model's name for the header: "Qwen/Qwen2.5-VL-3B-Instruct", or the server's name
    family: str | None = None  # the model family's name, where known
    drafters: dict[str, object] = field(default_factory=dict)  # the drafters a request may name: key -> its `.kind`
    auto: bool = False  # the default drafter is "auto" (engine/auto.py)
    max_images: int = 8
    max_image_tokens: int | None = None  # the default budget of tokens per image (built-in only)
    image_budget: int | None = None  # the largest tokens-per-image budget worth offering; None: none
    demo: bool = False  # the bundled demo model
    smol: bool = False  # the SmolLM2 demo (--preset smol): real English text, pictures of the demo world
    engine: Engine | None = None  # the built-in engine; None for another backend
    # Where visitors' images are decoded (engine/image_jail.py): the app's main() builds it from
    # VLM_DECODE_*; a Served made without one (tests) gets the defaults' own, its children started at first use.
    jail: ImageJail = field(default_factory=ImageJail)
    answer_times: AnswerTimes = field(default_factory=AnswerTimes)  # the line's estimate (app_ui/line.py)

    @classmethod
    def built_in(cls, engine: Engine, jail: ImageJail | None = None) -> Served:
        return cls(BuiltIn(engine), engine.target.name, engine.target.family.name, dict(engine.drafters), engine.auto,
                   engine.max_images, engine.max_image_tokens, _image_budget_range(engine),
                   _is_demo(engine.target.name), _is_smol(engine.target.name), engine, jail=jail or ImageJail())

    @classmethod
    def remote(cls, backend: Backend, max_images: int = 8, jail: ImageJail | None = None) -> Served:
        """Another backend: the drafters its capabilities name (none: it decides its own decoding,
        as an OpenAI-compatible server does), no image budget, no draft-length settings."""
        capabilities = backend.capabilities
        kinds = dict(zip(capabilities.drafters, capabilities.drafter_kinds))
        checkpoint = getattr(backend, "checkpoint", None)  # llama.cpp here: the folder it was converted from
        return cls(backend, capabilities.name, drafters={name: Named(kinds.get(name, name))
                                                         for name in capabilities.drafters},
                   max_images=max_images, demo=checkpoint is not None and _is_demo(checkpoint),
                   jail=jail or ImageJail())

    @property
    def reads_images(self) -> bool:
        """Messages may carry images (a llama.cpp model without its vision projector: no)."""
        return self.engine is not None or self.backend.capabilities.images

    @property
    def name(self) -> str:
        """The backend's name: "built-in", or the server's address (never its API key)."""
        return self.backend.capabilities.name

    @property
    def server_decides(self) -> bool:
        """The backend decodes speculatively or not by its own configuration; requests name no drafter."""
        return self.engine is None and not self.drafters

    @property
    def default_drafter(self) -> str | None:
        return (self.engine or self.backend.capabilities).default_drafter

    @property
    def tokenizer(self):
        """For comparing answers token by token (A/B); None: compared as text."""
        return self.engine.target.tokenizer if self.engine is not None else None

    def context_limit(self) -> int | None:
        return self.engine.context_limit() if self.engine is not None else None

    def image_fit(self) -> dict:
        """engine/image_jail.py ImageJail.load's options that shrink an image, as it is decoded, to the
        size the model's processor uses; for another backend, what it says it sends (a remote
        server: images shrunk to its longest side; llama.cpp here: to its checkpoint's processor's size)."""
        if self.engine is None:
            return getattr(self.backend, "image_fit", dict)()
        return {"fit": self.engine.target.processor, "family": self.engine.target.family}

    def prepare(self, messages: list[dict], max_image_tokens: int | None = None) -> Prompt | None:
        """The prompt, made here for the built-in engine; None: the backend takes the messages."""
        return self.engine.prepare(messages, max_image_tokens) if self.engine is not None else None


@dataclass(frozen=True)
class Named:
    """Another backend's drafter, known by its kind (its name where the backend does not say)."""

    kind: str


def served_of(engine: Engine | Served) -> Served:
    """`engine` described, or the description itself."""
    return engine if isinstance(engine, Served) else Served.built_in(engine)


def _is_smol(model) -> bool:
    """The SmolLM2 demo (its folder as models/demo/smol.py assembles it: smol-demo-<parts hash>)."""
    return os.path.basename(str(model).rstrip("/")).startswith(SMOL_DEMO)


def _is_demo(model) -> bool:
    """The bundled demo model (its checkpoint folder)."""
    return os.path.abspath(str(model)) == os.path.abspath(DEMO_MODEL)


def _image_budget_range(engine: Engine) -> int | None:
    """The largest tokens-per-image budget worth offering; None when a budget changes nothing (a
    model that reads every image as a fixed number of tokens, or as at most one slider step)."""
    processor = engine.target.processor
    if not engine.target.family.image_budget(processor, IMAGE_BUDGET_STEP):
        return None
    image_processor = processor.image_processor
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    max_pixels = getattr(getattr(image_processor, "size", None), "longest_edge", None)
    if patch and merge and max_pixels:  # a patchifier: its own limit, in tokens
        own = max_pixels // (patch * merge) ** 2
        return own if own > IMAGE_BUDGET_STEP else None
    return MAX_IMAGE_BUDGET
