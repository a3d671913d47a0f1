"""The demo world generator and the bundled demo models (assets/demo)."""

import io
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from models.demo import world
from models.demo.processor import load_processor
from models.demo.train import answer

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "demo"


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_eval_questions_are_deterministic():
    first, again = world.eval_questions(7, 20), world.eval_questions(7, 20)
    for a, b in zip(first, again):
        assert (a.prompt, a.answer, a.kind, a.reference) == (b.prompt, b.answer, b.kind, b.reference)
        assert [_png(i) for i in a.images] == [_png(i) for i in b.images]
    assert [q.prompt for q in world.eval_questions(8, 20)] != [q.prompt for q in first]


def test_train_examples_are_deterministic():
    first, again = list(world.train_examples(100, 10)), list(world.train_examples(100, 10))
    for a, b in zip(first, again):
        assert a.messages == b.messages
        assert [_png(i) for i in a.images] == [_png(i) for i in b.images]


def test_no_eval_picture_in_training():
    examples, questions = list(world.train_examples(0, 3000)), world.eval_questions(0, 300)
    assert not any(world.is_eval_picture(p) for e in examples for p in e.pictures)
    assert all(any(world.is_eval_picture(p) for p in q.pictures) for q in questions)
    # A multi-picture eval question may also show training pictures, never the other way round.
    train_keys = {world.content_key(p) for e in examples for p in e.pictures}
    eval_keys = {world.content_key(p) for q in questions for p in q.pictures if world.is_eval_picture(p)}
    assert eval_keys and not eval_keys & train_keys


def test_questions_have_short_and_long_answers():
    questions = world.eval_questions(0, 200)
    lengths = [len(q.reference.split()) for q in questions]
    assert min(lengths) == 1 and sum(n >= 25 for n in lengths) >= 20
    assert {q.kind.split("_")[0] for q in questions} == {"scene", "chart", "card", "multi"}
    assert all(world.answer_matches(q.reference, q.answer) for q in questions)


@pytest.mark.parametrize(
    "text, expected, matches",
    [
        ("3", "3", True),
        ("There are 3 circles.", "3", True),
        ("13", "3", False),
        ("Red.", "red", True),
        ("bored", "red", False),
        ("The red triangle is  at the top.", "at the top", True),
        ("in the top left corner", "top middle", False),
    ],
)
def test_answer_matches(text, expected, matches):
    assert world.answer_matches(text, expected) is matches


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(ASSETS / "target")
    return model.eval(), load_processor(str(ASSETS / "target"))


def test_bundle_loads_with_shared_vocabulary(target):
    model, processor = target
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    vocab = processor.tokenizer.get_vocab()
    assert AutoTokenizer.from_pretrained(ASSETS / "text_drafter").get_vocab() == vocab
    assert load_processor(str(ASSETS / "vlm_drafter")).tokenizer.get_vocab() == vocab
    text_drafter = AutoModelForCausalLM.from_pretrained(ASSETS / "text_drafter")
    assert type(text_drafter).__name__ == "Qwen2ForCausalLM"
    assert text_drafter.config.vocab_size == model.config.text_config.vocab_size


# Kinds the bundled target got right on every held-out question of its evaluation
# (assets/demo/training_stage2.json). Its overall held-out accuracy is lower (models/demo/README.md).
RELIABLE_KINDS = {"scene_count", "scene_count_sentence", "card_colour", "card_colour_sentence", "card_number",
                  "scene_describe", "chart_describe"}


def test_target_answers_held_out_questions(target):
    model, processor = target
    questions = [q for q in world.eval_questions(2024, 150) if q.kind in RELIABLE_KINDS][:8]
    answers = [answer(model, processor, q) for q in questions]
    right = [world.answer_matches(a, q.answer) for a, q in zip(answers, questions)]
    assert len(questions) == 8 and sum(right) >= 7, list(zip([q.prompt for q in questions], answers))
