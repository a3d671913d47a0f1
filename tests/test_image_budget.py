"""The vision-token budget per image (`models.processors.image_budget`): each family's processor,
called with the budget's options, makes an image at most that many tokens, and a budget above
what the processor already allows changes nothing."""

from __future__ import annotations

import pytest
from PIL import Image

from models.processors import image_budget, load_processor
from tests.conftest import ROOT

PHOTO = f"{ROOT}/assets/examples/rocket.jpg"  # 640 x 427


def image_tokens(processor, max_image_tokens) -> int:
    """How many of the prompt's tokens are the image token, for one photo."""
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(PHOTO)], return_tensors="pt",
                       **image_budget(processor, max_image_tokens))
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int((inputs["input_ids"] == image_token_id).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "idefics3"])
def test_a_budget_caps_the_tokens_of_an_image(zoo, family):
    processor = load_processor(str(zoo.dir(family)))
    # The tiny processors allow 9 tokens an image (Qwen) or 2 x 2 tiles (Idefics3); real ones far more.
    processor.image_processor.size.longest_edge = 10**6 if family.startswith("qwen") else 5 * 32
    natural = image_tokens(processor, None)
    budgets = sorted({4, 9, 16, natural // 2, natural - 1})
    counts = [image_tokens(processor, budget) for budget in budgets]
    assert all(count <= budget for count, budget in zip(counts, budgets)), (natural, budgets, counts)
    assert counts == sorted(counts) and counts[0] < counts[-1] < natural  # a larger budget, more detail
    assert image_tokens(processor, natural * 100) == natural  # never enlarges


def test_fixed_count_families_have_nothing_to_cap(zoo):
    for family in ("llava", "gemma3"):
        assert image_budget(load_processor(str(zoo.dir(family))), 4) == {}
