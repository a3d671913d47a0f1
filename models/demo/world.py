"""A small synthetic visual world that the bundled demo models are trained on.

Every picture is 84 x 84 pixels: a 3 x 3 grid of 28-pixel cells, so that each cell is exactly
one merged vision token of a Qwen2-VL model with patch 14 and merge 2 (9 tokens a picture).
There are three kinds of picture:

- scenes: one to five coloured shapes (circle, square, triangle, diamond in six colours), at
  most one a cell;
- bar charts: three bars labelled A, B and C, each with its own colour and a value from 1 to 9;
- text cards: a three-letter word (one letter a cell, top row, in colour) over a number from
  10 to 99 (bottom row, black).

Questions ask about one picture or compare two to four scenes. Some want one word ("3",
"red", "top left", "second"); others want a sentence or a description of several sentences
("The image shows three shapes. There is a red circle in the top left corner. ...").

Splits. A picture's content (not its pixel jitter) is hashed; a tenth of all contents belong to
the evaluation split. Training questions only ever use training pictures; an evaluation question
has at least one evaluation picture. Seeds live in separate namespaces too: training example
``i`` comes from the seed ``("train", i)``, evaluation question ``i`` of ``eval_questions(S, n)``
from ``("eval", S, i)``. So no evaluation picture is ever seen in training, whatever the seeds.

Public API:
    Question                                 a held-out question (images, prompt, answer, ...)
    Example                                  a training conversation (images, messages, kind)
    eval_questions(seed, n) -> list[Question]
    train_examples(start, count) -> Iterator[Example]
    answer_matches(answer_text, expected) -> bool
    render(spec) -> PIL.Image.Image          draw one picture spec
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 84
CELL = 28
EVAL_BUCKETS = 10  # one content hash bucket in EVAL_BUCKETS is held out for evaluation

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# Cells are numbered 0..8 in reading order.
# Short names for "where" answers: none is a whole-word part of another, so matching is exact.
CELL_NAMES = (
    "top left", "top middle", "top right", "middle left", "centre", "middle right",
    "bottom left", "bottom middle", "bottom right",
)
CELL_PHRASES = (
    "in the top left corner", "at the top", "in the top right corner",
    "on the left", "in the middle", "on the right",
    "in the bottom left corner", "at the bottom", "in the bottom right corner",
)
WORDS = (
    "ant", "bag", "bed", "bee", "box", "bus", "car", "cat", "cow", "cup", "dog", "egg", "elk", "fig",
    "fox", "gum", "hat", "ink", "jam", "jar", "key", "kit", "leg", "log", "map", "mud", "net", "nut",
    "oak", "owl", "pen", "pig", "pot", "ram", "rug", "sky", "sun", "toy", "urn", "van", "vet", "web",
    "wig", "yak", "yam", "zip", "zoo",
)
BAR_LABELS = ("A", "B", "C")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ORDINALS = ("first", "second", "third", "fourth")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You answer questions about pictures.",
    "You are a careful assistant that looks at images.",
)


# ---------------------------------------------------------------- picture specs


@dataclass(frozen=True)
class Item:
    """One shape of a scene."""

    shape: str
    colour: str
    cell: int


@dataclass(frozen=True)
class Scene:
    items: tuple[Item, ...]  # sorted by cell
    style: int = field(default=0, compare=False)  # seed of pixel jitter; not part of the content


@dataclass(frozen=True)
class Chart:
    colours: tuple[str, str, str]
    values: tuple[int, int, int]  # distinct, 1..9
    style: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Card:
    word: str
    number: int  # 10..99
    colour: str
    style: int = field(default=0, compare=False)


Spec = Scene | Chart | Card


def content_key(spec: Spec) -> str:
    """What a picture shows, without its pixel jitter: the unit of the train / eval split."""
    if isinstance(spec, Scene):
        return "scene:" + ",".join(f"{i.colour} {i.shape}@{i.cell}" for i in spec.items)
    if isinstance(spec, Chart):
        return f"chart:{spec.colours}:{spec.values}"
    return f"card:{spec.word}:{spec.number}:{spec.colour}"


def is_eval_picture(spec: Spec) -> bool:
    digest = hashlib.sha256(content_key(spec).encode()).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0


# ---------------------------------------------------------------- rendering


def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def _cell_centre(cell: int) -> tuple[int, int]:
    return (cell % 3) * CELL + CELL // 2, (cell // 3) * CELL + CELL // 2


def _draw_shape(draw: ImageDraw.ImageDraw, item: Item, rng: random.Random) -> None:
    cx, cy = _cell_centre(item.cell)
    cx, cy = cx + rng.randint(-1, 1), cy + rng.randint(-1, 1)
    r = rng.randint(10, 12)
    fill = COLOURS[item.colour]
    if item.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif item.shape == "square":
        draw.rectangle((cx - r + 1, cy - r + 1, cx + r - 1, cy + r - 1), fill=fill)
    elif item.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r - 1), (cx - r, cy + r - 1)], fill=fill)
    else:  # diamond
        draw.polygon([(cx, cy - r - 1), (cx + r, cy), (cx, cy + r + 1), (cx - r, cy)], fill=fill)


def _draw_chart(draw: ImageDraw.ImageDraw, chart: Chart, rng: random.Random) -> None:
    base = 72  # bars stand on y = 72; labels go below
    draw.line((2, base, IMAGE_SIZE - 3, base), fill=(90, 90, 90), width=1)
    font = _font(11)
    for column, (colour, value, label) in enumerate(zip(chart.colours, chart.values, BAR_LABELS)):
        half_width = rng.randint(6, 9)
        x = column * CELL + CELL // 2
        draw.rectangle((x - half_width, base - 7 * value, x + half_width, base - 1), fill=COLOURS[colour])
        draw.text((x, base + 6), label, fill=(20, 20, 20), font=font, anchor="mm")


def _draw_card(draw: ImageDraw.ImageDraw, card: Card, rng: random.Random) -> None:
    font = _font(rng.randint(20, 23))
    for column, letter in enumerate(card.word):
        x, y = _cell_centre(column)
        draw.text((x + rng.randint(-1, 1), y + rng.randint(-1, 1)), letter, fill=COLOURS[card.colour], font=font, anchor="mm")
    for column, digit in enumerate(str(card.number)):
        x, y = _cell_centre(6 + column)
        draw.text((x + rng.randint(-1, 1), y + rng.randint(-1, 1)), digit, fill=(20, 20, 20), font=font, anchor="mm")


def _background(shift: int) -> Image.Image:
    """Light background, redder towards the top and bluer towards the left: a vision tower
    sees only relative positions (2-D RoPE), so the shading is what tells a patch where in
    the picture it is."""
    ramp = [250 - 70 * i // (IMAGE_SIZE - 1) + shift for i in range(IMAGE_SIZE)]
    red = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE))
    red.putdata([ramp[y] for y in range(IMAGE_SIZE) for _ in range(IMAGE_SIZE)])
    blue = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE))
    blue.putdata([ramp[x] for _ in range(IMAGE_SIZE) for x in range(IMAGE_SIZE)])
    return Image.merge("RGB", (red, Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 235 + shift), blue))


def render(spec: Spec) -> Image.Image:
    """Draw one picture (RGB, 84 x 84); the same spec always gives the same pixels."""
    rng = random.Random(spec.style)
    image = _background(rng.randint(-8, 8))
    draw = ImageDraw.Draw(image)
    if isinstance(spec, Scene):
        for item in spec.items:
            _draw_shape(draw, item, rng)
    elif isinstance(spec, Chart):
        _draw_chart(draw, spec, rng)
    else:
        _draw_card(draw, spec, rng)
    return image


# ---------------------------------------------------------------- random pictures


def _random_scene(rng: random.Random, min_items: int = 1, max_items: int = 5) -> Scene:
    cells = sorted(rng.sample(range(9), rng.randint(min_items, max_items)))
    items = tuple(Item(rng.choice(SHAPES), rng.choice(list(COLOURS)), cell) for cell in cells)
    return Scene(items, rng.getrandbits(32))


def _random_chart(rng: random.Random) -> Chart:
    colours = tuple(rng.sample(list(COLOURS), 3))
    values = tuple(rng.sample(range(1, 10), 3))
    return Chart(colours, values, rng.getrandbits(32))


def _random_card(rng: random.Random) -> Card:
    return Card(rng.choice(WORDS), rng.randint(10, 99), rng.choice(list(COLOURS)), rng.getrandbits(32))


# ---------------------------------------------------------------- phrasing helpers


def _count_words(n: int, noun: str) -> str:
    """_count_words(3, "circle") == "three circles"; _count_words(0, "circle") == "no circles"."""
    return f"{NUMBER_WORDS[n] if n else 'no'} {noun}" + ("" if n == 1 else "s")


def _be(n: int) -> str:
    return "is" if n == 1 else "are"


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _article(item: Item) -> str:
    return ("an " if item.colour == "orange" else "a ") + f"{item.colour} {item.shape}"


def describe_scene(scene: Scene) -> str:
    sentences = [f"The image shows {_count_words(len(scene.items), 'shape')}."]
    sentences += [f"There is {_article(i)} {CELL_PHRASES[i.cell]}." for i in scene.items]
    return " ".join(sentences)


def describe_chart(chart: Chart) -> str:
    sentences = ["The chart shows three bars."]
    sentences += [
        f"Bar {label} is {colour} and has a value of {value}."
        for label, colour, value in zip(BAR_LABELS, chart.colours, chart.values)
    ]
    sentences.append(f"The tallest bar is {BAR_LABELS[chart.values.index(max(chart.values))]}.")
    return " ".join(sentences)


def describe_card(card: Card) -> str:
    return f"The image shows the word {card.word} written in {card.colour} letters. Below it is the number {card.number}."


# ---------------------------------------------------------------- questions

# A drawn question before its pictures are rendered: (specs, prompt, answer, reference, kind).
@dataclass(frozen=True)
class _Draft:
    specs: tuple[Spec, ...]
    prompt: str
    answer: str
    reference: str
    kind: str


def _short_or_sentence(rng: random.Random, prompt: str, short: str, sentence: str, kind: str, specs, key: str):
    """Half the time the short answer, else a sentence: the expected word is `key` in both."""
    if rng.random() < 0.5:
        return _Draft(specs, prompt, short, short, kind)
    return _Draft(specs, prompt + " Answer in a sentence.", key, sentence, kind + "_sentence")


def _ask_scene(rng: random.Random, scene: Scene) -> _Draft:
    items, specs = scene.items, (scene,)
    choice = rng.randrange(7)
    item = rng.choice(items)
    if choice == 6 and sum((i.shape, i.colour) == (item.shape, item.colour) for i in items) > 1:
        choice = 5  # "where is the red circle?" needs a single red circle
    if choice == 0:
        prompt = rng.choice(("Describe the image.", "What is in this picture?", "Describe what you see."))
        return _Draft(specs, prompt, describe_scene(scene), describe_scene(scene), "scene_describe")
    if choice == 1:
        n = len(items)
        sentence = f"There {_be(n)} {_count_words(n, 'shape')} in the image."
        return _short_or_sentence(rng, "How many shapes are there?", str(n), sentence, "scene_count", specs, _count_words(n, "shape"))
    if choice == 2:
        shape = rng.choice(SHAPES)
        n = sum(i.shape == shape for i in items)
        sentence = f"There {_be(n)} {_count_words(n, shape)} in the image."
        return _short_or_sentence(rng, f"How many {shape}s are there?", str(n), sentence, "scene_count_shape", specs, _count_words(n, shape))
    if choice == 3:
        colour = rng.choice(list(COLOURS))
        n = sum(i.colour == colour for i in items)
        sentence = f"There {_be(n)} {_count_words(n, colour + ' shape')} in the image."
        return _short_or_sentence(rng, f"How many {colour} shapes are there?", str(n), sentence, "scene_count_colour", specs, _count_words(n, colour + " shape"))
    where = CELL_PHRASES[item.cell]
    if choice == 4:
        sentence = f"The shape {where} is {item.colour}."
        return _short_or_sentence(rng, f"What colour is the shape {where}?", item.colour, sentence, "scene_colour_at", specs, item.colour)
    if choice == 5:
        sentence = f"The shape {where} is a {item.shape}."
        return _short_or_sentence(rng, f"What shape is {where}?", item.shape, sentence, "scene_shape_at", specs, item.shape)
    name = CELL_NAMES[item.cell]
    sentence = f"The {item.colour} {item.shape} is {where}."
    return _short_or_sentence(rng, f"Where is the {item.colour} {item.shape}?", name, sentence, "scene_where", specs, where)


def _ask_chart(rng: random.Random, chart: Chart) -> _Draft:
    specs = (chart,)
    choice = rng.randrange(5)
    bar = rng.randrange(3)
    label, colour, value = BAR_LABELS[bar], chart.colours[bar], chart.values[bar]
    if choice == 0:
        prompt = rng.choice(("Describe the chart.", "What does this chart show?"))
        return _Draft(specs, prompt, describe_chart(chart), describe_chart(chart), "chart_describe")
    if choice == 1:
        top = BAR_LABELS[chart.values.index(max(chart.values))]
        sentence = f"Bar {top} is the tallest."
        return _short_or_sentence(rng, "Which bar is the tallest?", top, sentence, "chart_tallest", specs, f"Bar {top}")
    if choice == 2:
        low = BAR_LABELS[chart.values.index(min(chart.values))]
        sentence = f"Bar {low} is the shortest."
        return _short_or_sentence(rng, "Which bar is the shortest?", low, sentence, "chart_shortest", specs, f"Bar {low}")
    if choice == 3:
        sentence = f"Bar {label} has a value of {value}."
        return _short_or_sentence(rng, f"What is the value of bar {label}?", str(value), sentence, "chart_value", specs, f"value of {value}")
    sentence = f"Bar {label} is {colour}."
    return _short_or_sentence(rng, f"What colour is bar {label}?", colour, sentence, "chart_colour", specs, colour)


def _ask_card(rng: random.Random, card: Card) -> _Draft:
    specs = (card,)
    choice = rng.randrange(4)
    if choice == 0:
        prompt = rng.choice(("Read the text in the image.", "Describe the image."))
        return _Draft(specs, prompt, describe_card(card), describe_card(card), "card_describe")
    if choice == 1:
        sentence = f"The word is {card.word}."
        return _short_or_sentence(rng, "What word is written in the image?", card.word, sentence, "card_word", specs, card.word)
    if choice == 2:
        sentence = f"The number is {card.number}."
        n = str(card.number)
        return _short_or_sentence(rng, "What number is written in the image?", n, sentence, "card_number", specs, n)
    sentence = f"The word is written in {card.colour}."
    return _short_or_sentence(rng, "What colour is the word?", card.colour, sentence, "card_colour", specs, card.colour)


def unique_best(counts: list[int]) -> int | None:
    """Index of the single largest count, or None on a tie."""
    best = max(counts)
    return counts.index(best) if counts.count(best) == 1 else None


def _multi_question(rng: random.Random) -> _Draft:
    scenes = tuple(_random_scene(rng, 1, 4) for _ in range(rng.randint(2, 4)))
    choice = rng.randrange(4)
    if choice == 0:
        parts = []
        for ordinal, scene in zip(ORDINALS, scenes):
            things = _listing([_article(i) for i in scene.items])
            parts.append(f"The {ordinal} image shows {_count_words(len(scene.items), 'shape')}: {things}.")
        text = " ".join(parts)
        return _Draft(scenes, "Describe each image.", text, text, "multi_describe")
    if choice == 1:
        colour = rng.choice(list(COLOURS))
        n = sum(i.colour == colour for s in scenes for i in s.items)
        sentence = f"There {_be(n)} {_count_words(n, colour + ' shape')} in all the images."
        prompt = f"How many {colour} shapes are there in all the images?"
        return _short_or_sentence(rng, prompt, str(n), sentence, "multi_total", scenes, _count_words(n, colour + " shape"))
    if choice == 2:
        shape = rng.choice(SHAPES)
        best = unique_best([sum(i.shape == shape for i in s.items) for s in scenes])
        prompt = f"Which image has more {shape}s?" if len(scenes) == 2 else f"Which image has the most {shape}s?"
        noun, adjective = f"{shape}s", "more" if len(scenes) == 2 else "the most"
    else:
        best = unique_best([len(s.items) for s in scenes])
        prompt = "Which image has more shapes?" if len(scenes) == 2 else "Which image has the most shapes?"
        noun, adjective = "shapes", "more" if len(scenes) == 2 else "the most"
    if best is None:
        return _multi_question(rng)
    sentence = f"The {ORDINALS[best]} image has {adjective} {noun}."
    return _short_or_sentence(rng, prompt, ORDINALS[best], sentence, "multi_compare", scenes, ORDINALS[best])


# How to ask about one picture of each kind (used for follow-up questions too).
_ASK = {Scene: _ask_scene, Chart: _ask_chart, Card: _ask_card}
_FAMILIES = (
    (lambda rng: _ask_scene(rng, _random_scene(rng)), 0.35),
    (lambda rng: _ask_chart(rng, _random_chart(rng)), 0.2),
    (lambda rng: _ask_card(rng, _random_card(rng)), 0.2),
    (_multi_question, 0.25),
)
# Training draws more of what is hard to learn (several images, descriptions) and less of the
# text cards, which are learnt early. Evaluation keeps `_FAMILIES`' mix: the held-out accuracy
# is over the world as users meet it.
_TRAIN_WEIGHTS = (0.36, 0.17, 0.1, 0.37)


def _seeded_rng(*namespace: object) -> random.Random:
    digest = hashlib.sha256(repr(namespace).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _draw_question(rng: random.Random, split: str) -> _Draft:
    """Pick a family (with the split's weights), then draw from it until a question belongs to
    `split` ("train": no eval picture; "eval": at least one). Picking the family first keeps the
    split's mix whatever share of each family's pictures is held out."""
    families, weights = zip(*_FAMILIES)
    family = rng.choices(families, _TRAIN_WEIGHTS if split == "train" else weights)[0]
    while True:
        draft = family(rng)
        has_eval_picture = any(is_eval_picture(s) for s in draft.specs)
        if has_eval_picture == (split == "eval"):
            return draft


# ---------------------------------------------------------------- public API


@dataclass
class Question:
    """One held-out question. `answer` is the expected substring (see `answer_matches`);
    `reference` is the full answer the models were trained to give."""

    images: list[Image.Image]
    prompt: str
    answer: str
    kind: str
    reference: str
    pictures: tuple[Spec, ...] = ()  # what the images show (specs for `render`)

    def messages(self) -> list[dict]:
        """The question as a conversation of one user turn: its images, then its prompt."""
        content = [{"type": "image", "image": image} for image in self.images]
        return [{"role": "user", "content": content + [{"type": "text", "text": self.prompt}]}]


@dataclass
class Example:
    """One training conversation in the chat-template message format: user turns hold
    ``{"type": "image"}`` entries in the order of `images`."""

    images: list[Image.Image]
    messages: list[dict]
    kind: str
    pictures: tuple[Spec, ...] = ()  # what the images show (specs for `render`)


def _user_turn(draft: _Draft) -> dict:
    content = [{"type": "image"} for _ in draft.specs] + [{"type": "text", "text": draft.prompt}]
    return {"role": "user", "content": content}


def assistant_turn(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def eval_questions(seed: int, n: int) -> list[Question]:
    """`n` held-out questions drawn from the namespace ("eval", seed); never seen in training."""
    questions = []
    for index in range(n):
        draft = _draw_question(_seeded_rng("eval", seed, index), "eval")
        images = [render(s) for s in draft.specs]
        questions.append(Question(images, draft.prompt, draft.answer, draft.kind, draft.reference, draft.specs))
    return questions


def train_examples(start: int, count: int) -> Iterator[Example]:
    """Training conversations number `start` .. `start + count - 1`, from the namespace ("train", i).

    Most are one question and one answer; about one in six has a second turn (half the time a
    follow-up on the same single picture, not shown again; else new pictures); about one in five
    starts with a system message.
    """
    for index in range(start, start + count):
        rng = _seeded_rng("train", index)
        first = _draw_question(rng, "train")
        drafts = [first]
        messages = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": [{"type": "text", "text": rng.choice(SYSTEM_PROMPTS)}]})
        messages += [_user_turn(first), assistant_turn(first.reference)]
        if rng.random() < 0.16:
            if rng.random() < 0.5 and len(first.specs) == 1:
                follow = _ASK[type(first.specs[0])](rng, first.specs[0])
                second = _Draft((), follow.prompt, follow.answer, follow.reference, follow.kind)
            else:
                second = _draw_question(rng, "train")
            drafts.append(second)
            messages += [_user_turn(second), assistant_turn(second.reference)]
        pictures = tuple(s for d in drafts for s in d.specs)
        yield Example([render(s) for s in pictures], messages, "+".join(d.kind for d in drafts), pictures)


def answer_matches(answer_text: str, expected: str) -> bool:
    """True when `expected` occurs in `answer_text` as whole words, ignoring case and spacing.

    "Whole words" means the match is not part of a longer word or number: expected "3" matches
    "There are 3 circles" and "3" but not "13"; expected "red" matches "Red." but not "bored".
    A long expected answer (a full description) must appear word for word.
    """
    text = " ".join(answer_text.split()).lower()
    wanted = " ".join(expected.split()).lower()
    return re.search(r"(?<!\w)" + re.escape(wanted) + r"(?!\w)", text) is not None
