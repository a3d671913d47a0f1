"""The demo's picture task as the training scripts teach it: the words each cell and picture
should name (`cell_words`, `picture_words`), the counts a probe should read (`probe_rows`), the
batches and their assistant labels (`encode`, `batches`), the cell, picture and probe losses, and
the held-out accuracy. models/demo/train.py (the 3.6 M demo, from scratch) and train_smol.py (the
SmolLM2 demo's vision part) both train on it; models/demo/train.py's docstring explains the losses."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch

from models.demo import world
from models.demo.processor import ImageOnlyQwen2VLProcessor


def cell_words(spec: world.Spec) -> list[list[str]]:
    """For each of a picture's 9 cells (merged vision tokens), the words that name what it shows.

    Training pulls each vision token towards the (tied) embeddings of its words, so that the
    language model reads a vision token much like the words of its content; grounding from
    scratch is otherwise too slow for a one-hour CPU budget. A scene cell names its row and its
    column ("top" / "middle" / "bottom", "left" / "middle" / "right"): two words every cell, so
    that no two cells differ only by a missing word. A card's letter cells name the word, its
    colour and their own letter.
    """
    rows, columns = ("top", "middle", "bottom"), ("left", "middle", "right")
    if isinstance(spec, world.Scene):
        words = [[rows[c // 3], columns[c % 3]] for c in range(9)]
        for item in spec.items:
            words[item.cell] += [item.colour, item.shape]
        return words
    if isinstance(spec, world.Chart):
        return [[spec.colours[c % 3], str(spec.values[c % 3]), world.BAR_LABELS[c % 3]] for c in range(9)]
    digits = str(spec.number)
    letters = [[spec.word, spec.colour, Bare(letter)] for letter in spec.word]
    return letters + [[]] * 3 + [[str(spec.number), d] for d in digits] + [[]]


def turn_pictures(example: world.Example) -> list[list[world.Spec]]:
    """The pictures of `example`, grouped by the user turn that shows them (turns without
    pictures give an empty list)."""
    pictures = iter(example.pictures)
    return [
        [next(pictures) for c in m["content"] if c["type"] == "image"] for m in example.messages if m["role"] == "user"
    ]


def picture_words(example: world.Example) -> list[list[list[str]]]:
    """For each picture of `example` and each of its 9 cells, words its vision token should
    carry once the language model has read it (see `picture_loss`): which picture of its turn it
    is ("first" ... "fourth"); for a scene, how many shapes the picture holds ("three"); and on a
    shape, how many shapes of its colour the turn's pictures hold up to this one (" 2"), so that
    the last picture's tokens know the totals that questions over several pictures ask for. On a
    card's letter cells, the word spelt as a one-word answer starts ("yak" is "y" + "ak", unlike
    " yak"), which the cell words alone do not teach."""
    words = []
    for turn in turn_pictures(example):
        colour_counts: dict[str, int] = {}
        for ordinal, spec in zip(world.ORDINALS, turn):
            cells = [[ordinal] for _ in range(9)]
            if isinstance(spec, world.Scene):
                for cell in cells:
                    cell.append(world.NUMBER_WORDS[len(spec.items)])
                for item in spec.items:
                    colour_counts[item.colour] = colour_counts.get(item.colour, 0) + 1
                for item in spec.items:
                    cells[item.cell].append(str(colour_counts[item.colour]))
            elif isinstance(spec, world.Card):
                for cell in cells[:3]:
                    cell.append(Bare(spec.word))
            words.append(cells)
    return words


class Bare(str):
    """A word spelt as it starts an answer, with no space before it: `word_targets` encodes
    "yak" as "y" + "ak" for a Bare word, as the one token " yak" otherwise."""


def word_targets(cells: list[list[str]], tokenizer) -> torch.Tensor:
    """(len(cells), vocab): for each cell, a distribution spread evenly over the tokens of its
    words (" red" ..., `Bare` words without the space); rows of cells without words are all zero."""
    targets = torch.zeros(len(cells), len(tokenizer))
    for row, words in enumerate(cells):
        ids = [i for w in words for i in tokenizer.encode(w if isinstance(w, Bare) else " " + w)]
        if ids:
            targets[row, ids] += 1.0 / len(ids)
    return targets


def cell_targets(pictures: list[world.Spec], tokenizer) -> torch.Tensor:
    """(num_pictures * 9, vocab) target distributions over each cell's word tokens."""
    return word_targets([words for spec in pictures for words in cell_words(spec)], tokenizer)


def picture_targets(examples: list[world.Example], tokenizer) -> torch.Tensor:
    """(num_pictures * 9, vocab): each cell's words plus its `picture_words`."""
    cells = []
    for example in examples:
        for spec, extras in zip(example.pictures, picture_words(example)):
            cells += [words + extra for words, extra in zip(cell_words(spec), extras)]
    return word_targets(cells, tokenizer)


# Groups of the count probe (see `probe_targets`), each a class index 0..PROBE_CLASSES - 1:
# first those of a whole picture (`probe_rows`), then those of one cell (`probe_cells`).
PICTURE_GROUPS = (
    ["ordinal", "picture shapes"]
    + [f"picture {s}s" for s in world.SHAPES] + [f"picture {c}" for c in world.COLOURS]
    + [f"turn {s}s" for s in world.SHAPES] + [f"turn {c}" for c in world.COLOURS] + ["turn shapes"]
    + [f"most {s}s so far" for s in world.SHAPES] + ["most shapes so far"]
    + ["tallest bar", "shortest bar"]
)


CELL_GROUPS = ["row", "column", "item number", "cell shape", "cell colour"]


PROBE_GROUPS = PICTURE_GROUPS + CELL_GROUPS


PROBE_CLASSES = 21  # counts 0..20 (a turn holds at most 4 x 5 shapes); "most so far": ordinal, or 4 on a tie


def probe_rows(example: world.Example) -> list[list[int]]:
    """For each picture of `example`, one row of `PICTURE_GROUPS` class indices (-100 where a
    group does not apply): which picture of its turn it is; for a scene, how many shapes, how
    many of each shape and of each colour it holds; how many of each the turn's pictures hold up
    to this one; and which picture so far holds the most of each shape (and of all shapes). For a
    chart, its tallest and shortest bar. These are what questions over one or several pictures
    ask; `probe_loss` asks a middle layer to carry them at every vision token of the picture."""
    rows = []
    for pictures in turn_pictures(example):
        turn: dict[str, int] = {}
        per_picture: list[dict[str, int]] = []
        for ordinal, spec in enumerate(pictures):
            row = {"ordinal": ordinal}
            if isinstance(spec, world.Scene):
                here = {"shapes": len(spec.items)}
                for key in [f"{i.shape}s" for i in spec.items] + [i.colour for i in spec.items]:
                    here[key] = here.get(key, 0) + 1
                per_picture.append(here)
                for key, n in here.items():
                    turn[key] = turn.get(key, 0) + n
                for key in ["shapes"] + [f"{s}s" for s in world.SHAPES] + list(world.COLOURS):
                    row[f"picture {key}"], row[f"turn {key}"] = here.get(key, 0), turn.get(key, 0)
                for key in [f"{s}s" for s in world.SHAPES] + ["shapes"]:
                    counts = [p.get(key, 0) for p in per_picture]
                    best = world.unique_best(counts) if max(counts) > 0 else None
                    row[f"most {key} so far"] = 4 if best is None else best
            elif isinstance(spec, world.Chart):
                row["tallest bar"] = spec.values.index(max(spec.values))
                row["shortest bar"] = spec.values.index(min(spec.values))
            rows.append([row.get(group, -100) for group in PICTURE_GROUPS])
    return rows


def probe_cells(spec: world.Spec) -> list[list[int]]:
    """For each of a scene's 9 cells, one row of `CELL_GROUPS` class indices: its row and column
    (0..2), which shape of the picture in reading order it holds (1..5, 0 if empty: the order
    in which descriptions list them), its shape and its colour (1.., 0 if empty). -100 for
    charts and cards."""
    if not isinstance(spec, world.Scene):
        return [[-100] * len(CELL_GROUPS) for _ in range(9)]
    rows = [[cell // 3, cell % 3, 0, 0, 0] for cell in range(9)]
    for number, item in enumerate(spec.items, start=1):
        rows[item.cell][2:] = [number, 1 + world.SHAPES.index(item.shape), 1 + list(world.COLOURS).index(item.colour)]
    return rows


def probe_targets(examples: list[world.Example]) -> torch.Tensor:
    """(num_pictures * 9, len(PROBE_GROUPS)) class indices: for each vision token, its
    picture's `probe_rows` row followed by its cell's `probe_cells` row."""
    rows = [
        picture + cell
        for example in examples
        for spec, picture in zip(example.pictures, probe_rows(example))
        for cell in probe_cells(spec)
    ]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, len(PROBE_GROUPS))


@dataclass
class Batch:
    """One padded batch (right padding). `labels` is -100 outside assistant answers."""

    input_ids: torch.Tensor  # (B, S)
    attention_mask: torch.Tensor  # (B, S)
    mm_token_type_ids: torch.Tensor  # (B, S): 1 on image tokens
    pixel_values: torch.Tensor  # (num_patches, 1176)
    image_grid_thw: torch.Tensor  # (num_images, 3)
    labels: torch.Tensor  # (B, S)
    cell_targets: torch.Tensor  # (num_images * 9, vocab), see `cell_targets`
    picture_targets: torch.Tensor  # (num_images * 9, vocab), see `picture_targets`
    probe_targets: torch.Tensor  # (num_images * 9, len(PROBE_GROUPS)), see `probe_targets`

    def to(self, device) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def vlm_inputs(self) -> dict:
        return dict(
            input_ids=self.input_ids, attention_mask=self.attention_mask, mm_token_type_ids=self.mm_token_type_ids,
            pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw, labels=self.labels,
        )


def assistant_labels(input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Copy of `input_ids` (B, S) with -100 everywhere but the assistant answers (each from the
    token after "<|im_start|>assistant\\n" up to and including its <|im_end|>)."""
    prefix = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode("assistant\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = torch.full_like(input_ids, -100)
    for row, ids in enumerate(input_ids.tolist()):
        inside = False
        for pos in range(len(ids)):
            if ids[pos : pos + len(prefix)] == prefix:
                start = pos + len(prefix)
                inside = True
            if inside and pos >= start:
                labels[row, pos] = ids[pos]
                inside = ids[pos] != im_end
    return labels


def encode(processor: ImageOnlyQwen2VLProcessor, examples: list[world.Example]) -> Batch:
    texts = [processor.apply_chat_template(e.messages) for e in examples]
    images = [image for e in examples for image in e.images]
    encoded = processor(text=texts, images=images, padding=True, return_tensors="pt")
    return Batch(
        input_ids=encoded["input_ids"],
        attention_mask=encoded["attention_mask"],
        mm_token_type_ids=encoded["mm_token_type_ids"],
        pixel_values=encoded["pixel_values"],
        image_grid_thw=encoded["image_grid_thw"],
        labels=assistant_labels(encoded["input_ids"], processor.tokenizer),
        cell_targets=cell_targets([p for e in examples for p in e.pictures], processor.tokenizer),
        picture_targets=picture_targets(examples, processor.tokenizer),
        probe_targets=probe_targets(examples),
    )


def text_only(batch: Batch, tokenizer) -> dict:
    """The text drafter's view of `batch`: vision tokens dropped, rows re-padded on the right."""
    vision = torch.tensor([tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")])
    keep = (batch.attention_mask == 1) & ~torch.isin(batch.input_ids, vision)
    rows = [(ids[k], labels[k]) for ids, labels, k in zip(batch.input_ids, batch.labels, keep)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(rows):
        input_ids[row, : len(ids)] = ids
        labels[row, : len(ids)] = row_labels
        attention_mask[row, : len(ids)] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def batches(processor, steps: int, batch_size: int, seed: int, pool: int = 8):
    """`steps` batches of training conversations 0, 1, 2, ... Each group of `pool` batches is
    sorted by length (less padding) and then shuffled with `seed`."""
    rng = random.Random(seed)
    next_example = 0
    for _ in range(0, steps, pool):
        group = list(world.train_examples(next_example, pool * batch_size))
        next_example += len(group)
        group.sort(key=lambda e: len(e.images) * 20 + sum(len(str(m["content"])) for m in e.messages) // 4)
        chunks = [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield encode(processor, chunk)


def cell_loss(model, vision_tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between each vision token read through the tied output embedding,
    (num_tokens, hidden) @ (hidden, vocab), and its cell's word distribution."""
    rows = targets.sum(-1) > 0
    logits = vision_tokens[rows].float() @ model.get_input_embeddings().weight.float().T
    return torch.nn.functional.cross_entropy(logits, targets[rows])


def picture_loss(logits: torch.Tensor, input_ids: torch.Tensor, image_token_id: int, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between the language model's output at each vision token, (B, S, vocab)
    logits at the <|image_pad|> positions of `input_ids` (B, S), and `picture_targets`. Nothing
    reads these outputs when answering (they predict the next prompt token), so the loss only
    teaches the layers to carry what `picture_words` names (which picture a token belongs to,
    shape and colour counts), which questions over several pictures need."""
    return torch.nn.functional.cross_entropy(logits[input_ids == image_token_id].float(), targets)


def probe_layer(model) -> int:
    """The layer whose output `probe_loss` reads: the middle one, so that the layers above it can
    still use what it carries when answering."""
    return max(1, model.config.text_config.num_hidden_layers // 2)


def probe_loss(probe: torch.nn.Linear, hidden: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
               targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a linear head on one layer's output at each vision token, (B, S, hidden)
    `hidden` at the <|image_pad|> positions of `input_ids` (B, S), against `probe_targets`
    (num_tokens, groups): one PROBE_CLASSES-way classification a group, -100 ignored."""
    logits = probe(hidden[input_ids == image_token_id].float())  # (num_tokens, groups * classes)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, PROBE_CLASSES), targets.reshape(-1), ignore_index=-100)


@torch.no_grad()
def answer(model, processor, question: world.Question, max_new_tokens: int = 120) -> str:
    """Plain greedy `generate` on one held-out question; returns the decoded answer."""
    content = [{"type": "image"} for _ in question.images] + [{"type": "text", "text": question.prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[text], images=question.images, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def accuracy(model, processor, questions: list[world.Question]) -> tuple[float, dict]:
    """Share of `questions` whose greedy answer matches (`world.answer_matches`), and per kind."""
    per_kind: dict[str, list[int]] = {}
    model.eval()
    for question in questions:
        right = world.answer_matches(answer(model, processor, question), question.answer)
        per_kind.setdefault(question.kind, []).append(int(right))
    total = sum(sum(v) for v in per_kind.values()) / len(questions)
    return total, {kind: sum(v) / len(v) for kind, v in sorted(per_kind.items())}
