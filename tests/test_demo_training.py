"""The training recipe of the bundled demo models (models/demo/train.py, its picture task
models/demo/picture_task.py), on a few batches."""

import pytest
import torch

from models.demo import picture_task, train, world


@pytest.fixture(scope="module")
def processor():
    return train.build_processor(train.world_tokenizer())


def test_labels_cover_exactly_the_assistant_answers(processor):
    example = next(e for e in world.train_examples(0, 50) if len(e.messages) >= 4)  # two turns
    batch = picture_task.encode(processor, [example])
    labelled = processor.tokenizer.decode(batch.labels[0][batch.labels[0] != -100])
    answers = [c["text"] for m in example.messages if m["role"] == "assistant" for c in m["content"]]
    assert labelled == "<|im_end|>".join(answers) + "<|im_end|>"


def test_batches_group_similar_lengths_and_differ_with_the_seed(processor):
    batches = list(picture_task.batches(processor, steps=4, batch_size=8, seed=0, pool=4))
    assert len(batches) == 4
    real = sum(int(b.attention_mask.sum()) for b in batches)
    padded = sum(b.attention_mask.numel() for b in batches)
    unsorted = picture_task.encode(processor, list(world.train_examples(0, 32)))  # the same 32, one batch
    assert real / padded > int(unsorted.attention_mask.sum()) / unsorted.attention_mask.numel()
    again = list(picture_task.batches(processor, steps=4, batch_size=8, seed=1, pool=4))
    assert [b.input_ids.shape for b in again] != [b.input_ids.shape for b in batches]


def test_text_drafter_view_drops_the_vision_tokens(processor):
    batch = picture_task.encode(processor, list(world.train_examples(0, 4)))
    view = picture_task.text_only(batch, processor.tokenizer)
    vision = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    assert not torch.isin(view["input_ids"], torch.tensor(vision)).any()
    assert int((view["labels"] != -100).sum()) == int((batch.labels != -100).sum())


def test_a_few_steps_lower_every_models_loss(processor):
    trainees = train.build_models(processor.tokenizer, seed=0)
    batch = picture_task.encode(processor, list(world.train_examples(0, 8)))
    first = [train.train_step(t, batch, processor.tokenizer, 2e-3, False, 1.0) for t in trainees]
    for _ in range(5):
        last = [train.train_step(t, batch, processor.tokenizer, 2e-3, False, 1.0) for t in trainees]
    assert all(after < before * 0.8 for before, after in zip(first, last)), (first, last)


def test_every_scene_cell_names_one_row_and_one_column():
    scene = world.Scene((world.Item("circle", "red", 0), world.Item("square", "blue", 7)))
    words = picture_task.cell_words(scene)
    assert words[0] == ["top", "left", "red", "circle"]
    assert words[7] == ["bottom", "middle", "blue", "square"]
    assert words[4] == ["middle", "middle"]
    assert len({tuple(w[:2]) for w in words}) == 9


def test_card_letter_cells_name_their_letter_and_the_word_as_an_answer_spells_it(processor):
    card = world.Card("yak", 42, "red")
    cells = picture_task.cell_words(card)
    assert [c[-1] for c in cells[:3]] == ["y", "a", "k"]
    assert all(c[:2] == ["yak", "red"] for c in cells[:3])
    example = world.Example([], [{"role": "user", "content": [{"type": "image"}]}], "card_word", (card,))
    first_cell = picture_task.picture_words(example)[0][0]
    assert first_cell == ["first", "yak"]
    tokenizer = processor.tokenizer
    targets = picture_task.word_targets([[first_cell[-1]], ["yak"]], tokenizer)
    bare, spaced = (set(row.nonzero().flatten().tolist()) for row in targets)
    assert bare == set(tokenizer.encode("yak")) and spaced == set(tokenizer.encode(" yak"))
    assert bare.isdisjoint(spaced)


def test_picture_words_number_pictures_within_their_turn_and_count_shapes():
    examples = list(world.train_examples(0, 400))
    several = next(e for e in examples if e.kind.startswith("multi") and "+" not in e.kind)
    words = picture_task.picture_words(several)
    assert [w[0][0] for w in words] == list(world.ORDINALS[: len(several.pictures)])
    assert [w[0][1] for w in words] == [world.NUMBER_WORDS[len(s.items)] for s in several.pictures]
    # On each shape: how many of its colour the turn has shown up to this picture.
    last = several.pictures[-1]
    for item in last.items:
        total = sum(i.colour == item.colour for s in several.pictures for i in s.items)
        assert words[-1][item.cell][-1] == str(total)
    # A second turn with new pictures counts them from "first" again.
    def turns_with_pictures(example):
        return sum(m["role"] == "user" and any(c["type"] == "image" for c in m["content"]) for m in example.messages)

    two_turns = next(e for e in examples if turns_with_pictures(e) == 2)
    ordinals = [w[0][0] for w in picture_task.picture_words(two_turns)]
    assert ordinals.count("first") == 2, ordinals


def test_picture_loss_reads_one_row_per_vision_token_and_falls_with_training(processor):
    examples = [e for e in world.train_examples(0, 60) if e.kind.startswith("multi")][:4]
    batch = picture_task.encode(processor, examples)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch.input_ids == image_pad).sum()) == batch.picture_targets.shape[0] == 9 * sum(len(e.pictures) for e in examples)
    target = train.build_models(processor.tokenizer, seed=0)[0]

    def loss() -> float:
        with torch.no_grad():
            logits = target.model(**batch.vlm_inputs()).logits
        return picture_task.picture_loss(logits, batch.input_ids, image_pad, batch.picture_targets).item()

    before = loss()
    for _ in range(6):
        train.train_step(target, batch, processor.tokenizer, 2e-3, False, 1.0, picture_weight=1.0)
    assert loss() < before * 0.8, (before, loss())


def test_probe_rows_count_each_picture_and_the_turn_so_far():
    several = next(e for e in world.train_examples(0, 400) if e.kind.startswith("multi") and "+" not in e.kind and len(e.pictures) >= 3)
    rows = picture_task.probe_rows(several)
    group = {name: i for i, name in enumerate(picture_task.PROBE_GROUPS)}
    assert [r[group["ordinal"]] for r in rows] == list(range(len(several.pictures)))
    for index, (row, scene) in enumerate(zip(rows, several.pictures)):
        seen = several.pictures[: index + 1]
        assert row[group["picture shapes"]] == len(scene.items)
        for shape in world.SHAPES:
            assert row[group[f"picture {shape}s"]] == sum(i.shape == shape for i in scene.items)
            counts = [sum(i.shape == shape for i in s.items) for s in seen]
            expected = counts.index(max(counts)) if max(counts) > 0 and counts.count(max(counts)) == 1 else 4
            assert row[group[f"most {shape}s so far"]] == expected
        for colour in world.COLOURS:
            assert row[group[f"turn {colour}"]] == sum(i.colour == colour for s in seen for i in s.items)
        assert row[group["turn shapes"]] == sum(len(s.items) for s in seen)
        assert row[group["tallest bar"]] == row[group["shortest bar"]] == -100
    chart = next(e for e in world.train_examples(0, 200) if e.kind.startswith("chart") and "+" not in e.kind)
    (row,) = picture_task.probe_rows(chart)
    values = chart.pictures[0].values
    assert (row[group["tallest bar"]], row[group["shortest bar"]]) == (values.index(max(values)), values.index(min(values)))
    assert row[group["picture shapes"]] == -100


def test_probe_loss_reads_a_middle_layer_and_falls_with_training(processor):
    examples = [e for e in world.train_examples(0, 60) if e.kind.startswith("multi")][:4]
    batch = picture_task.encode(processor, examples)
    assert batch.probe_targets.shape == (9 * sum(len(e.pictures) for e in examples), len(picture_task.PROBE_GROUPS))
    target = train.build_models(processor.tokenizer, seed=0)[0]
    assert picture_task.probe_layer(target.model) == 3  # of 6
    image_pad = target.model.config.image_token_id

    def loss() -> float:
        with torch.no_grad():
            hidden = target.model(**batch.vlm_inputs(), output_hidden_states=True).hidden_states[3]
            return picture_task.probe_loss(target.probe, hidden, batch.input_ids, image_pad, batch.probe_targets).item()

    before = loss()
    for _ in range(6):
        train.train_step(target, batch, processor.tokenizer, 2e-3, False, 1.0, probe_weight=1.0)
    assert loss() < before * 0.8, (before, loss())


def test_probe_cells_name_row_column_and_the_item_in_reading_order():
    scene = world.Scene((world.Item("circle", "red", 1), world.Item("diamond", "blue", 5)))
    cells = picture_task.probe_cells(scene)
    assert cells[1] == [0, 1, 1, 1 + world.SHAPES.index("circle"), 1 + list(world.COLOURS).index("red")]
    assert cells[5] == [1, 2, 2, 1 + world.SHAPES.index("diamond"), 1 + list(world.COLOURS).index("blue")]
    assert cells[8] == [2, 2, 0, 0, 0]
    assert picture_task.probe_cells(world.Card("cat", 42, "red")) == [[-100] * len(picture_task.CELL_GROUPS)] * 9
