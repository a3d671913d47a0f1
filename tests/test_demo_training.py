"""The training recipe of the bundled demo models (models/demo/train.py), on a few batches."""

import pytest
import torch

from models.demo import train, world


@pytest.fixture(scope="module")
def processor():
    return train.build_processor(train.world_tokenizer())


def test_labels_cover_exactly_the_assistant_answers(processor):
    example = next(e for e in world.train_examples(0, 50) if len(e.messages) >= 4)  # two turns
    batch = train.encode(processor, [example])
    labelled = processor.tokenizer.decode(batch.labels[0][batch.labels[0] != -100])
    answers = [c["text"] for m in example.messages if m["role"] == "assistant" for c in m["content"]]
    assert labelled == "<|im_end|>".join(answers) + "<|im_end|>"


def test_batches_group_similar_lengths_and_differ_with_the_seed(processor):
    batches = list(train.batches(processor, steps=4, batch_size=8, seed=0, pool=4))
    assert len(batches) == 4
    real = sum(int(b.attention_mask.sum()) for b in batches)
    padded = sum(b.attention_mask.numel() for b in batches)
    unsorted = train.encode(processor, list(world.train_examples(0, 32)))  # the same 32, one batch
    assert real / padded > int(unsorted.attention_mask.sum()) / unsorted.attention_mask.numel()
    again = list(train.batches(processor, steps=4, batch_size=8, seed=1, pool=4))
    assert [b.input_ids.shape for b in again] != [b.input_ids.shape for b in batches]


def test_text_drafter_view_drops_the_vision_tokens(processor):
    batch = train.encode(processor, list(world.train_examples(0, 4)))
    view = train.text_only(batch, processor.tokenizer)
    vision = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    assert not torch.isin(view["input_ids"], torch.tensor(vision)).any()
    assert int((view["labels"] != -100).sum()) == int((batch.labels != -100).sum())


def test_a_few_steps_lower_every_models_loss(processor):
    trainees = train.build_models(processor.tokenizer, seed=0)
    batch = train.encode(processor, list(world.train_examples(0, 8)))
    first = [train.train_step(t, batch, processor.tokenizer, 2e-3, False, 1.0) for t in trainees]
    for _ in range(5):
        last = [train.train_step(t, batch, processor.tokenizer, 2e-3, False, 1.0) for t in trainees]
    assert all(after < before * 0.8 for before, after in zip(first, last)), (first, last)
