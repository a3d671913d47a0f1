"""Per family, on tiny random-weight models: acceptance of same-weights drafters, and whether
speculative greedy equals plain greedy for each drafter kind (float32).

    python -m tests.report_families

Same-weights drafters: the target's own folder as a VLM drafter (2-image prompt), and a
text-only LM holding the target's language weights (text prompt). Acceptance below 1.0 there
comes only from image placeholder ids that the random target emits and drafters never propose.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from engine.engine import Engine
from engine.loop import DecodeSettings, Done
from models import tiny
from measure.exactness import CASES, TinyZoo, conversation

DECODE = DecodeSettings(max_new_tokens=24, draft_tokens=4, stop_token_ids=frozenset({-1}))


def answer(zoo, family, role, messages) -> Done:
    drafters = {role: zoo.drafter(family, role)} if role else {}
    return [e for e in Engine(zoo.target(family), drafters).stream(messages, role, decode=DECODE)][-1]


def main() -> int:
    torch.set_num_threads(2)
    zoo = TinyZoo(Path(tempfile.mkdtemp()))
    print("| family | same-weights VLM drafter, 2 images | text drafter with the target's weights, text |"
          " exact: text LM | exact: VLM | exact: n-gram |")
    print("|---|---|---|---|---|---|")
    for family in tiny.FAMILIES:
        vlm = answer(zoo, family, "same_vlm", conversation(2)).stats
        text = answer(zoo, family, "text_drafter", conversation(0)).stats
        exact = []
        for role in ("text_drafter", "vlm_drafter", "ngram"):
            same = all(answer(zoo, family, role, conversation(n, two)).token_ids
                       == answer(zoo, family, None, conversation(n, two)).token_ids for n, two in CASES)
            exact.append("yes" if same else "NO")
        print(f"| {family} | {vlm.acceptance:.2f} ({vlm.accepted}/{vlm.drafted}) | {text.acceptance:.2f} "
              f"({text.accepted}/{text.drafted}) | " + " | ".join(exact) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
