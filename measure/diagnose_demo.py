"""Where the bundled demo target goes wrong: its vision tokens, or its reading of them.

    python -m measure.diagnose_demo [--model assets/demo/target] [--pictures 300] [--conversations 100]

1. Vision probe: each vision token of held-out pictures (eval seed 0), read through the tied
   output embedding as the training's cell loss reads it; prints how often the best-scoring
   colour / shape / value word is the cell's true one.
2. Training-distribution check: the first user turn of late training conversations (from
   index 90000, inside the 96000 the shipped recipe trains on) answered plainly through the
   engine; prints the share whose answer equals the training reference exactly, per kind.
If (1) is near 100 % and (2) is as low as the held-out accuracy, the language model is
under-trained on reading the vision tokens; it is not a train/eval gap.
"""

from __future__ import annotations

import argparse
import collections
import sys
from types import SimpleNamespace

import torch

from engine.build import EngineSpec, build_engine
from engine.loop import DecodeSettings
from measure.eval import answer
from models.demo import world
from models.presets import PRESETS


@torch.no_grad()
def vision_probe(target, count: int) -> dict[str, float]:
    tokenizer = target.tokenizer
    pictures = [p for q in world.eval_questions(0, count) for p in q.pictures][:count]
    encoded = target.processor.image_processor(images=[world.render(p) for p in pictures], return_tensors="pt")
    model = target.model
    out = model.model.visual(encoded["pixel_values"].to(model.dtype), grid_thw=encoded["image_grid_thw"])
    tokens = out.pooler_output if hasattr(out, "pooler_output") else out
    tokens = torch.cat(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
    logits = tokens.float() @ model.get_input_embeddings().weight.float().T  # (pictures * 9, V)

    def best(row, words):
        return max(words, key=lambda w: float(row[tokenizer.encode(" " + w)[0]]))

    right, total = collections.Counter(), collections.Counter()
    for p, spec in enumerate(pictures):
        for cell in range(9):
            row = logits[p * 9 + cell]
            if isinstance(spec, world.Scene):
                item = next((i for i in spec.items if i.cell == cell), None)
                if item:
                    for name, words, truth in (("scene colour", world.COLOURS, item.colour),
                                               ("scene shape", world.SHAPES, item.shape)):
                        total[name] += 1
                        right[name] += best(row, list(words)) == truth
            elif isinstance(spec, world.Chart) and cell < 3:
                for name, words, truth in (("bar value", [str(v) for v in range(1, 10)], str(spec.values[cell])),
                                           ("bar colour", list(world.COLOURS), spec.colours[cell])):
                    total[name] += 1
                    right[name] += best(row, words) == truth
    return {name: right[name] / total[name] for name in total}


def training_reference_match(engine, start: int, count: int) -> tuple[float, dict[str, str]]:
    per_kind: dict[str, list[bool]] = collections.defaultdict(list)
    for example in world.train_examples(start, count):
        messages = [m for m in example.messages if m["role"] != "system"]
        user, reference = messages[0], messages[1]["content"][0]["text"]
        num_images = sum(c["type"] == "image" for c in user["content"])
        question = SimpleNamespace(images=example.images[:num_images],
                                   prompt=next(c["text"] for c in user["content"] if c["type"] == "text"))
        done = answer(engine, question, None, DecodeSettings(max_new_tokens=160))
        per_kind[example.kind.split("+")[0]].append(done.text.strip() == reference.strip())
    overall = sum(sum(v) for v in per_kind.values()) / count
    return overall, {k: f"{sum(v)}/{len(v)}" for k, v in sorted(per_kind.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=PRESETS["demo"].target)
    parser.add_argument("--pictures", type=int, default=300)
    parser.add_argument("--conversations", type=int, default=100)
    args = parser.parse_args()
    engine = build_engine(EngineSpec(args.model))
    for name, share in vision_probe(engine.target, args.pictures).items():
        print(f"vision probe, {name}: {share:.1%}")
    overall, per_kind = training_reference_match(engine, 90000, args.conversations)
    print(f"training conversations answered exactly as the reference: {overall:.1%}")
    print("  per kind:", per_kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
