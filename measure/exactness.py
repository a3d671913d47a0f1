"""Speculative greedy against plain greedy on the tiny random-weight models (models/tiny.py): the
models, conversations and runs that the exactness tests (tests/test_engine_exact.py) and the GPU
check (measure/gpu_check.py, through `check`) share."""

from __future__ import annotations

from pathlib import Path

from engine.drafters.registry import load_drafter
from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from engine.target import load_target
from models import tiny
from models.loading import LoadOptions

DRAFTERS = ("text_drafter", "vlm_drafter", "ngram")
MAX_NEW = 24
CASES = [(n, False) for n in (0, 1, 2, 4)] + [(2, True)]  # (images, two turns)


class TinyZoo:
    """Builds each tiny model under `root` on first use; targets and drafters are loaded once."""

    def __init__(self, root: Path, options: LoadOptions = LoadOptions(dtype="float32", device="cpu")):
        self.root, self.options = root, options
        self.dirs, self.targets, self.drafters = {}, {}, {}

    def dir(self, family: str, role: str = "target"):
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
            self.targets[family] = load_target(str(self.dir(family)), self.options)
        return self.targets[family]

    def drafter(self, family: str, role: str):
        """role: text_drafter (target's own language weights), vlm_drafter (other weights),
        same_vlm (the target's own folder as a VLM drafter), ngram."""
        key = (family, role)
        if key not in self.drafters:
            name = {"ngram": "ngram", "same_vlm": str(self.dir(family))}.get(role) or str(self.dir(family, role))
            self.drafters[key] = load_drafter(name, self.target(family), self.options)
        return self.drafters[key]


def user(text, images=()):
    return {"role": "user", "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]}


def conversation(num_images: int, two_turns: bool = False):
    images = tiny.tiny_images(max(num_images, 1) + 1, seed=num_images)
    if not two_turns:
        return [user("Describe what you see, then say more.", images[:num_images])]
    return [user("What is in these pictures?", images[:2]),
            {"role": "assistant", "content": [{"type": "text", "text": "A red square and a blue circle."}]},
            user("And which one is larger?")]


def run(zoo: TinyZoo, family, drafter_role, messages, k=4, adaptive=False, events=False, draft_tree=0):
    """The answer (its Done, or every event) of `family`'s tiny target with `drafter_role`
    (None: plain), MAX_NEW tokens with no stop token."""
    target = zoo.target(family)
    drafters = {drafter_role: zoo.drafter(family, drafter_role)} if drafter_role else {}
    engine = Engine(target, drafters)
    stream = list(engine.stream(messages, drafter=drafter_role,
                                decode=DecodeSettings(max_new_tokens=MAX_NEW, draft_tokens=k, adaptive=adaptive,
                                                      stop_token_ids=frozenset({-1}), draft_tree=draft_tree)))
    done = stream[-1]
    assert isinstance(done, Done)
    assert sum(len(e.token_ids) for e in stream[:-1]) == len(done.token_ids)
    return stream if events else done


def check(zoo: TinyZoo, families, cases=CASES, trees: bool = True) -> tuple[int, list[str]]:
    """(how many comparisons, a "FAILED ..." line for each that failed): for each family, case
    (images, two turns) and drafter, speculative greedy (chains; with `trees`, also draft trees of
    6 nodes, up to 2 images) must give plain greedy's tokens without falling back to plain decoding."""
    compared, failures = 0, []
    for family in families:
        for num_images, two_turns in cases:
            messages = conversation(num_images, two_turns)
            plain = run(zoo, family, None, messages).token_ids
            for drafter in DRAFTERS:
                for tree in (0, 6) if trees and num_images < 4 else (0,):
                    compared += 1
                    done = run(zoo, family, drafter, messages, adaptive=num_images % 2 == 1, draft_tree=tree)
                    case = f"{family} {drafter} with {num_images} images" + (", two turns" if two_turns else "") + \
                        (f", tree {tree}" if tree else "")
                    if done.token_ids != plain:
                        failures.append(f"FAILED {case}: the tokens differ from plain greedy's")
                    elif done.stats.fallback_reason:
                        failures.append(f"FAILED {case}: fell back to plain decoding ({done.stats.fallback_reason})")
    return compared, failures
