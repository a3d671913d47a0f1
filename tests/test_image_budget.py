"""The vision-token budget per image (`Family.image_budget`): each family's processor,
called with the budget's options, makes an image at most that many tokens, and a budget above
what the processor already allows changes nothing."""

from __future__ import annotations

import pytest
from PIL import Image

from transformers import AutoConfig

from models.families import REGISTRY
from tests.conftest import ROOT

PHOTO = f"{ROOT}/assets/examples/rocket.jpg"  # 640 x 427


class Budgeted:
    """A folder's processor and its family's image budget."""

    def __init__(self, folder):
        self.family = REGISTRY[AutoConfig.from_pretrained(folder).model_type]
        self.processor = self.family.load_processor(str(folder))

    def options(self, max_image_tokens) -> dict:
        return self.family.image_budget(self.processor, max_image_tokens)


def image_tokens(budgeted: Budgeted, max_image_tokens) -> int:
    """How many of the prompt's tokens are the image token, for one photo."""
    processor = budgeted.processor
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(PHOTO)], return_tensors="pt",
                       **budgeted.options(max_image_tokens))
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int((inputs["input_ids"] == image_token_id).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "idefics3"])
def test_a_budget_caps_the_tokens_of_an_image(zoo, family):
    budgeted = Budgeted(zoo.dir(family))
    # The tiny processors allow 9 tokens an image (Qwen) or 2 x 2 tiles (Idefics3); real ones far more.
    budgeted.processor.image_processor.size.longest_edge = 10**6 if family.startswith("qwen") else 5 * 32
    assert_budget_caps(budgeted, smallest=4)


@pytest.mark.parametrize("family", ["step3p7", "muse_glimmer"])
def test_a_budget_caps_the_tokens_of_an_image_in_newer_families(tmp_path, family):
    from tests import tiny_next

    budgeted = Budgeted(tiny_next.build_target(family, tmp_path / family))
    processor = budgeted.processor
    if family == "step3p7":
        # Crops up to the published 3024 pixels. The least is the 16-token view plus the crops
        # along an elongated image's long side (this photo, scaled, is just over 1.5 : 1): 24.
        processor.image_processor.max_image_size = 3024
    else:
        processor.image_processor.max_image_tokens = 4096  # MuseGlimmer's own limit
    assert_budget_caps(budgeted, smallest=32 if family == "step3p7" else 4)


def assert_budget_caps(budgeted: Budgeted, smallest: int):
    natural = image_tokens(budgeted, None)
    budgets = sorted({smallest, 2 * smallest + 8, natural // 2, natural - 1})
    counts = [image_tokens(budgeted, budget) for budget in budgets]
    assert all(count <= budget for count, budget in zip(counts, budgets)), (natural, budgets, counts)
    assert counts == sorted(counts) and counts[0] < counts[-1] < natural  # a larger budget, more detail
    assert image_tokens(budgeted, natural * 100) == natural  # never enlarges


def test_gemma4_budget_picks_a_supported_size(tmp_path):
    """Gemma 4 takes 70, 140, 280, 560 or 1120 tokens an image: the largest within the budget
    and the processor's own, never fewer than 70."""
    from tests import tiny_next

    budgeted = Budgeted(tiny_next.build_target("gemma4", tmp_path / "gemma4"))
    budgeted.processor.image_processor.max_soft_tokens = 280
    assert [budgeted.options(budget)["max_soft_tokens"] for budget in (4, 70, 150, 300, 5000)] == \
        [70, 70, 140, 280, 280]
    assert image_tokens(budgeted, 150) <= 140 < image_tokens(budgeted, None) <= 280


def test_fixed_count_families_have_nothing_to_cap(zoo):
    for family in ("llava", "gemma3"):
        assert Budgeted(zoo.dir(family)).options(4) == {}
