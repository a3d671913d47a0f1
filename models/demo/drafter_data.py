"""What the demo's drafter training scripts (models/demo/train_drafters.py, train_eagle3.py)
share: the target's answers and its batched pass (`TargetPass`: hidden states, greedy labels),
the conversations distilled from the target (models/demo/distill_smol.py's answers.jsonl), the
batches, the answer positions' chains, and the reduced draft vocabulary."""

from __future__ import annotations

import collections
import itertools
import json
import os
import random

import torch

from models.demo import world
from models.demo.picture_task import assistant_labels


DEFAULT_TARGET = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "assets", "demo", "target"))


def target_answers(target, processor, examples: list[world.Example], max_new_tokens: int) -> list[world.Example]:
    """`examples` with each assistant turn replaced by the target's greedy answer to the
    conversation so far (its own earlier answers included). One batched `generate` per turn."""
    examples = [world.Example(e.images, list(e.messages), e.kind, e.pictures) for e in examples]
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        slots = [[i for i, m in enumerate(e.messages) if m["role"] == "assistant"] for e in examples]
        for turn in range(max(map(len, slots))):
            asks = [(e, at[turn]) for e, at in zip(examples, slots) if turn < len(at)]  # (example, message index)
            history = [e.messages[:i] for e, i in asks]
            texts = [processor.apply_chat_template(h, add_generation_prompt=True) for h in history]
            shown = [sum(c.get("type") == "image" for m in h for c in m["content"]) for h in history]
            images = [image for (e, _), n in zip(asks, shown) for image in e.images[:n]]
            enc = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
            with torch.inference_mode():
                out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for (example, index), answer in zip(asks, answers):
                example.messages[index] = world.assistant_turn(answer.strip())
    finally:
        tokenizer.padding_side = side
    return examples


class TargetPass:
    """What one frozen target forward gives the drafters for a batch (B conversations, S tokens)."""

    def __init__(self, target, processor, examples: list[world.Example], layers: tuple[int, ...], top_k: int = 0):
        texts = [processor.apply_chat_template(e.messages) for e in examples]
        images = [image for e in examples for image in e.images]
        enc = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
        with torch.inference_mode():
            out = target(**inputs, output_hidden_states=True)
            self.positions, _ = target.model.get_rope_index(  # (3, B, S): the target's own positions
                inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), inputs["attention_mask"])
        count = len(out.hidden_states)  # a layer named twice (-1 and the depth) is kept once
        kept = {layer % count: out.hidden_states[layer].clone() for layer in set(layers)}
        self.hidden = {layer: kept[layer % count] for layer in layers}  # (B, S, H) each
        self.greedy = out.logits.argmax(-1)  # (B, S): the target's next token after each prefix
        # (B, S, top_k) each: the target's top_k logits and their token ids (soft labels), or None
        self.top_logits, self.top_ids = out.logits.topk(top_k, dim=-1) if top_k else (None, None)
        self.input_ids = inputs["input_ids"]  # (B, S), right-padded
        self.valid = inputs["attention_mask"].bool()  # (B, S)
        self.answer = assistant_labels(inputs["input_ids"], processor.tokenizer) != -100  # (B, S)


def draft_vocabulary(processor, size: int, examples: list[world.Example] | None = None) -> torch.Tensor:
    """(size,) ascending target ids: the end-of-turn tokens, the most frequent tokens of the
    answers of `examples` (default: the first 4,000 training conversations), then, while room is
    left, the lowest ids (a byte-level BPE numbers its earliest, most common merges first); never
    another special token (the image placeholders among them)."""
    tokenizer = processor.tokenizer
    counts = collections.Counter()
    for example in examples if examples is not None else world.train_examples(0, 4000):
        for message in example.messages:
            if message["role"] == "assistant":
                text = " ".join(c["text"] for c in message["content"] if c.get("type") == "text")
                counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    always = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", tokenizer.eos_token) if t}
    special = (set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)) - always
    chosen = dict.fromkeys(sorted(always))
    for token in [t for t, _ in counts.most_common()] + list(range(len(tokenizer))):
        if len(chosen) >= min(size, len(tokenizer) - len(special)):
            break
        if token not in special:
            chosen[token] = None
    return torch.tensor(sorted(chosen))


def distilled_examples(folder: str, tokenizer) -> list[world.Example]:
    """The conversations of `folder`/answers.jsonl (models.demo.distill_smol), each ending in the
    target's own answer."""

    examples = []
    with open(os.path.join(folder, "answers.jsonl")) as file:
        for line in file:
            record = json.loads(line)
            messages, images = conversation(record)
            answer = tokenizer.decode(record["answer_ids"], skip_special_tokens=True).strip()
            examples.append(world.Example(list(images), messages + [world.assistant_turn(answer)], record["kind"]))
    return examples


def batches(examples: list[world.Example] | None, batch_size: int, seed: int, mixed: bool = False,
            split_pictures: bool = False, first: int = 0):
    """Step by step (batch key, examples): fresh world conversations from number `first` (key None), or `examples`
    cut once into batches, of similar length (less padding) or, `mixed`, in a seeded random order
    (each batch mixes kinds of question and answer lengths), the batches' order shuffled each
    epoch (seed, epoch); a batch's key is the same every epoch, so its target pass can be kept.
    `split_pictures`: no batch mixes text-only conversations with picture ones (a target with
    picture weights runs them on other weights, models/picture_weights.py)."""
    if examples is None:
        yield from ((None, list(world.train_examples(first + step * batch_size, batch_size)))
                    for step in itertools.count())
        return
    groups = []
    for pictures in ((False, True) if split_pictures else (None,)):
        order = sorted((i for i in range(len(examples)) if pictures is None or bool(examples[i].images) == pictures),
                       key=lambda i: (len(examples[i].images), len(str(examples[i].messages))))
        if mixed:
            random.Random(f"{seed}:batches" + ("" if pictures is None else f":{pictures}")).shuffle(order)
        groups += [order[first: first + batch_size] for first in range(0, len(order), batch_size)]  # the last may be short
    for epoch in itertools.count():
        keys = list(range(len(groups)))
        random.Random(f"{seed}:{epoch}").shuffle(keys)
        for key in keys:
            yield key, [examples[i] for i in groups[key]]


def answer_chains(batch: TargetPass) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unrolled draft chains of a batch: chain c starts at entry c when token c + 1 is in an
    answer. Returns chains (B, A) (entry indices, padded), used (B, A), and the masks of steps
    2..: sees (B, 1, A, n), a chain's step sees the step-1 entries <= c, and eye (B, 1, A, A),
    each chain sees its own earlier steps."""
    starts = batch.answer[:, 1:]  # (B, n): chains that draft inside an answer
    bsz, n = starts.shape
    width = int(starts.sum(1).max())
    chains = torch.zeros(bsz, width, dtype=torch.long)
    used = torch.zeros(bsz, width, dtype=torch.bool)
    for row in range(bsz):
        found = starts[row].nonzero()[:, 0]
        chains[row, :len(found)], used[row, :len(found)] = found, True
    sees = (torch.arange(n)[None, None, :] <= chains[:, :, None])[:, None]
    eye = torch.eye(width, dtype=torch.bool).expand(bsz, 1, width, width)
    return chains, used, sees, eye


def draft_index(vocabulary: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) each target id's index in a draft vocabulary (ascending target ids), -1 outside it."""
    draft_of = torch.full((vocab_size,), -1, dtype=torch.long)
    draft_of[vocabulary] = torch.arange(len(vocabulary))
    return draft_of


def conversation(record: dict) -> tuple[list[dict], list]:
    """The messages (with image entries) and images of one answers.jsonl record."""
    if record["kind"] == "text":
        return [{"role": "user", "content": [{"type": "text", "text": record["prompt"]}]}], []
    example = next(world.train_examples(record["example"], 1))
    first = example.messages[: next(i for i, m in enumerate(example.messages) if m["role"] == "assistant")]
    shown = sum(c["type"] == "image" for m in first for c in m["content"])
    return first, example.images[:shown]
