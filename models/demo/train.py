"""Train the bundled demo models from scratch, reproducibly, on a CPU.

    python -m models.demo.train --out assets/demo

writes three Hugging Face folders:
    target/        Qwen2VLForConditionalGeneration + processor (tokenizer, chat template)
    vlm_drafter/   a smaller Qwen2VLForConditionalGeneration + the same processor
    text_drafter/  Qwen2ForCausalLM + the same tokenizer; it never sees pictures
and training.json (settings, parameter counts, time, held-out accuracy).

The three models learn from the same batches in one loop: the two vision-language models on
the full conversations, the text drafter on their text-only view (the
<|vision_start|><|image_pad|>...<|vision_end|> runs removed, positions consecutive). The loss
covers assistant tokens only, each answer's <|im_end|> included. The vision-language models
also get a cell loss (see `cell_words`): each vision token, read through the tied output
embedding, should name what its cell shows; and a picture loss (see `picture_loss`): the
language model's output at each vision token should name the cell, which picture of its turn
it belongs to, how many shapes that picture holds and how many of its colour the turn has shown
so far; and a count probe (see `probe_loss`): a linear head on a middle layer's output at each
vision token should tell the picture's and the turn's counts (see `probe_rows`), where the layers
above can still read them when answering. All three only speed up learning; the probe head is
thrown away and the saved models are plain Qwen2-VL models.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from models.demo import world
from models.demo.processor import ImageOnlyQwen2VLProcessor, build_processor, build_tokenizer

VOCAB_SIZE = 640
TOKENIZER_EXAMPLES = 4000  # training conversations whose text the BPE is trained on

# Sizes. The target must be right; the drafters must be cheap per token (1-2 layers).
TARGET = dict(hidden=192, layers=6, heads=4, kv_heads=2, mlp=576, vision_dim=128, vision_depth=2, vision_heads=4)
VLM_DRAFTER = dict(hidden=128, layers=2, heads=4, kv_heads=2, mlp=384, vision_dim=96, vision_depth=2, vision_heads=4)
TEXT_DRAFTER = dict(hidden=128, layers=2, heads=4, kv_heads=2, mlp=384)


# ---------------------------------------------------------------- models


def _text_settings(size: dict, tokenizer) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=size["hidden"],
        intermediate_size=size["mlp"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=2048,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def vlm_config(size: dict, tokenizer) -> Qwen2VLConfig:
    """A Qwen2-VL config of the given size, patch 14 and merge 2 like the image processor."""
    head_dim = size["hidden"] // size["heads"]
    # M-RoPE splits head_dim / 2 rotary frequencies into (time, height, width) sections.
    t = head_dim // 2 // 4
    mrope_section = [t, (head_dim // 2 - t) // 2, head_dim // 2 - t - (head_dim // 2 - t) // 2]
    text = _text_settings(size, tokenizer) | dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
    )
    vision = dict(
        depth=size["vision_depth"],
        embed_dim=size["vision_dim"],
        hidden_size=size["hidden"],
        num_heads=size["vision_heads"],
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    )}
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def text_config(size: dict, tokenizer) -> Qwen2Config:
    return Qwen2Config(**_text_settings(size, tokenizer), rope_theta=10000.0, tie_word_embeddings=True)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- batches


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


# ---------------------------------------------------------------- training


@dataclass
class Trainee:
    name: str
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    sees_images: bool
    probe: torch.nn.Linear | None = None  # training-only head of `probe_loss` (VLMs); never saved
    loss_sum: float = 0.0


def learning_rate(step: int, steps: int, peak: float, warmup: int = 60) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


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


def train_step(trainee: Trainee, batch: Batch, tokenizer, lr: float, bf16: bool, cell_weight: float,
               picture_weight: float = 0.0, probe_weight: float = 0.0) -> float:
    """One optimiser step; returns the language-model loss (for VLMs the cell loss, and the
    picture and probe losses when their weights are > 0, are added)."""
    inputs = batch.vlm_inputs() if trainee.sees_images else text_only(batch, tokenizer)
    for group in trainee.optimizer.param_groups:
        group["lr"] = lr
    captured = []
    hook = trainee.model.model.visual.register_forward_hook(lambda m, i, out: captured.append(out.pooler_output)) if trainee.sees_images else None
    probing = trainee.probe is not None and probe_weight > 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outputs = trainee.model(**inputs, output_hidden_states=probing)
    loss = total = outputs.loss
    if hook is not None:
        hook.remove()
        vision_tokens = torch.cat(list(captured[0])) if isinstance(captured[0], (list, tuple)) else captured[0]
        image_token_id = trainee.model.config.image_token_id
        total = loss + cell_weight * cell_loss(trainee.model, vision_tokens, batch.cell_targets)
        if picture_weight > 0:
            total = total + picture_weight * picture_loss(outputs.logits, batch.input_ids, image_token_id, batch.picture_targets)
        if probing:
            hidden = outputs.hidden_states[probe_layer(trainee.model)]
            total = total + probe_weight * probe_loss(trainee.probe, hidden, batch.input_ids, image_token_id, batch.probe_targets)
    total.backward()
    torch.nn.utils.clip_grad_norm_(trainee.model.parameters(), 1.0)
    trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def make_trainee(name: str, model: PreTrainedModel, sees_images: bool, lr: float) -> Trainee:
    """A model, its AdamW and, for a VLM, the training-only head of `probe_loss`."""
    probe = torch.nn.Linear(model.config.text_config.hidden_size, len(PROBE_GROUPS) * PROBE_CLASSES) if sees_images else None
    named = list(model.named_parameters()) + (list(probe.named_parameters()) if probe is not None else [])
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return Trainee(name, model, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98)), sees_images, probe)


def build_models(tokenizer, seed: int) -> list[Trainee]:
    torch.manual_seed(seed)
    target = Qwen2VLForConditionalGeneration(vlm_config(TARGET, tokenizer))
    torch.manual_seed(seed + 1)
    vlm_drafter = Qwen2VLForConditionalGeneration(vlm_config(VLM_DRAFTER, tokenizer))
    torch.manual_seed(seed + 2)
    text_drafter = Qwen2ForCausalLM(text_config(TEXT_DRAFTER, tokenizer))
    return [
        make_trainee("target", target, True, 0.0),
        make_trainee("vlm_drafter", vlm_drafter, True, 0.0),
        make_trainee("text_drafter", text_drafter, False, 0.0),
    ]


def load_models(folder: Path) -> list[Trainee]:
    """The three models of an earlier run, in float32, to continue training them."""
    return [
        make_trainee("target", Qwen2VLForConditionalGeneration.from_pretrained(folder / "target", dtype=torch.float32), True, 0.0),
        make_trainee("vlm_drafter", Qwen2VLForConditionalGeneration.from_pretrained(folder / "vlm_drafter", dtype=torch.float32), True, 0.0),
        make_trainee("text_drafter", Qwen2ForCausalLM.from_pretrained(folder / "text_drafter", dtype=torch.float32), False, 0.0),
    ]


def world_tokenizer():
    """The BPE, trained on the text of the first TOKENIZER_EXAMPLES training conversations."""
    texts = ["user\n", "assistant\n", "system\n"] * 100 + [f"Picture {i}: " for i in range(1, 9)] * 100
    texts += list(world.WORDS) + list(world.SYSTEM_PROMPTS) * 10
    for example in world.train_examples(0, TOKENIZER_EXAMPLES):
        texts += [c["text"] for m in example.messages for c in m["content"] if c["type"] == "text"]
    return build_tokenizer(texts, VOCAB_SIZE)


# ---------------------------------------------------------------- evaluation


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


@torch.no_grad()
def ms_per_token(model, inputs: dict, new_tokens: int = 48, repeats: int = 3) -> float:
    """Milliseconds per token of plain greedy decoding with a KV cache, prefill excluded: the
    time of `new_tokens` tokens less the time of one, over `new_tokens - 1` (best of `repeats`)."""

    def seconds(n: int) -> float:
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    return min(1000 * (seconds(new_tokens) - seconds(1)) / (new_tokens - 1) for _ in range(repeats))


def decoding_costs(trainees: list[Trainee], processor, question: world.Question) -> dict[str, float]:
    """`ms_per_token` of each model on one held-out question (the text drafter without its images)."""
    content = [{"type": "image"} for _ in question.images] + [{"type": "text", "text": question.prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    vlm_inputs = processor(text=[text], images=question.images, return_tensors="pt")
    plain = processor.apply_chat_template([{"role": "user", "content": content[-1:]}], add_generation_prompt=True)
    text_inputs = processor.tokenizer([plain], return_tensors="pt")
    return {
        t.name: round(ms_per_token(t.model.eval(), vlm_inputs if t.sees_images else text_inputs), 2) for t in trainees
    }


# ---------------------------------------------------------------- saving


def save(trainee: Trainee, processor, out: Path) -> None:
    folder = out / trainee.name
    model = trainee.model
    model.generation_config = GenerationConfig(
        eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id,
        do_sample=False, max_new_tokens=120,
    )
    model.save_pretrained(folder)
    if trainee.sees_images:
        processor.save_pretrained(folder)
        # The folder should name the stock class, so that standard loaders recognise it.
        config_path = folder / "processor_config.json"
        config = json.loads(config_path.read_text())
        config["processor_class"] = "Qwen2VLProcessor"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    else:
        processor.tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets/demo"))
    parser.add_argument("--steps", type=int, default=3100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the target")
    parser.add_argument("--drafter-lr", type=float, default=3e-3, help="peak learning rate of the two drafters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cell-weight", type=float, default=1.0, help="weight of the vision-token word loss")
    parser.add_argument("--picture-weight", type=float, default=1.0,
                        help="weight of the loss on the language model's output at vision tokens (see picture_loss)")
    parser.add_argument("--probe-weight", type=float, default=1.0,
                        help="weight of the count probe on a middle layer at vision tokens (see probe_loss)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (bitwise results can depend on it)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (no faster on this CPU; float32 by default)")
    parser.add_argument("--eval-questions", type=int, default=100, help="held-out questions to score at the end")
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--init", type=Path, help="continue training the three models saved in this folder "
                        "(a run of this command) instead of starting from random weights")
    args = parser.parse_args()

    # 1. Seeds, threads, tokenizer and processor.
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    tokenizer = world_tokenizer()
    processor = build_processor(tokenizer)

    # 2. Three fresh models (or the three of an earlier run, to continue it).
    trainees = build_models(tokenizer, args.seed) if args.init is None else load_models(args.init)
    for t in trainees:
        print(f"{t.name}: {count_parameters(t.model):,} parameters", flush=True)

    # 3. One loop: every model takes a step on every batch.
    for step, batch in enumerate(batches(processor, args.steps, args.batch_size, args.seed)):
        if step == args.steps:
            break
        for t in trainees:
            lr = learning_rate(step, args.steps, args.lr if t.name == "target" else args.drafter_lr)
            t.loss_sum += train_step(t, batch, tokenizer, lr, args.bf16, args.cell_weight, args.picture_weight,
                                    args.probe_weight)
        if (step + 1) % 25 == 0:
            losses = "  ".join(f"{t.name} {t.loss_sum / 25:.3f}" for t in trainees)
            print(f"step {step + 1}/{args.steps}  {time.time() - started:.0f}s  lr {learning_rate(step, args.steps, args.lr):.2e}  {losses}", flush=True)
            for t in trainees:
                t.loss_sum = 0.0
    train_seconds = time.time() - started

    # 4. Save, then score the two vision-language models on held-out questions.
    args.out.mkdir(parents=True, exist_ok=True)
    for t in trainees:
        save(t, processor, args.out)
    questions = world.eval_questions(args.eval_seed, args.eval_questions)
    report = {
        "command": f"python -m models.demo.train --out {args.out} --steps {args.steps} --seed {args.seed} "
                   f"--lr {args.lr} --drafter-lr {args.drafter_lr}" + (f" --init {args.init}" if args.init else ""),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "train_seconds": round(train_seconds),
        "parameters": {t.name: count_parameters(t.model) for t in trainees},
    }
    for t in trainees[:2]:
        total, per_kind = accuracy(t.model, processor, questions)
        report[f"{t.name}_accuracy"] = {"eval_seed": args.eval_seed, "questions": len(questions), "overall": total, "per_kind": per_kind}
        print(f"{t.name} held-out accuracy: {total:.3f}", flush=True)
    report["ms_per_token_float32"] = decoding_costs(trainees, processor, questions[0])
    print(f"ms per token: {report['ms_per_token_float32']}", flush=True)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
