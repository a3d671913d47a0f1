"""The tiny models of models/tiny.py load, generate with images and agree with their text drafters."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from models.families import REGISTRY
from models.processors import load_processor
from models.tiny import FAMILIES, build_target, build_text_drafter, build_vlm_drafter, tiny_images

TEXT_PROMPT = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture? Two apples."}]}]
IMAGE_PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the first image."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red car on the road."}]},
    {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target_dir(family, tmp_path_factory):
    return build_target(family, tmp_path_factory.mktemp(family) / "target")


def _inputs(processor, messages, images=None):
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=text, images=images, return_tensors="pt")


def test_generates_with_two_images(target_dir):
    model = AutoModelForImageTextToText.from_pretrained(target_dir)
    processor = load_processor(str(target_dir))
    inputs = _inputs(processor, IMAGE_PROMPT, tiny_images(2))

    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)

    new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 8 or new_tokens[-1] == model.generation_config.eos_token_id
    assert len(set(new_tokens)) > 1, f"greedy output repeats one token: {new_tokens}"


def test_text_drafter_predicts_like_target(target_dir, tmp_path):
    drafter_dir = build_text_drafter(target_dir, tmp_path / "text_drafter")
    target = AutoModelForImageTextToText.from_pretrained(target_dir)
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir)
    tokenizer = AutoTokenizer.from_pretrained(drafter_dir)
    assert tokenizer.get_vocab() == load_processor(str(target_dir)).tokenizer.get_vocab()

    text = tokenizer.apply_chat_template(TEXT_PROMPT, tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    if "sliding_attention" in (getattr(drafter.config, "layer_types", None) or []):
        assert input_ids.shape[1] > drafter.config.sliding_window  # positions beyond the window
    with torch.no_grad():
        target_logits = target(input_ids=input_ids).logits
        drafter_logits = drafter(input_ids=input_ids).logits

    torch.testing.assert_close(drafter_logits, target_logits, rtol=1e-5, atol=1e-5)


def test_image_token_ids(target_dir):
    processor = load_processor(str(target_dir))
    config = AutoModelForImageTextToText.from_pretrained(target_dir).config
    ids = REGISTRY[config.model_type].placeholder_ids(processor)

    image_token_id = getattr(config, "image_token_id", None) or config.image_token_index
    assert image_token_id in ids
    plain_text = "The first image shows a red car on the road. <b>Two</b> apples!"
    assert ids.isdisjoint(processor.tokenizer(plain_text).input_ids)
    # Every placeholder the processor puts into a prompt with images is listed.
    without_images = [
        {**message, "content": [part for part in message["content"] if part["type"] != "image"]}
        if isinstance(message["content"], list) else message
        for message in IMAGE_PROMPT
    ]
    with_images = _inputs(processor, IMAGE_PROMPT, tiny_images(2)).input_ids[0].tolist()
    placeholders = set(with_images) - set(_inputs(processor, without_images).input_ids[0].tolist())
    special = set(processor.tokenizer.get_added_vocab().values())
    assert placeholders & special <= ids


def test_same_seed_same_weights(family, target_dir, tmp_path):
    again = build_target(family, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (target_dir / "model.safetensors").read_bytes()


def test_vlm_drafter_shares_processor(family, target_dir, tmp_path):
    drafter_dir = build_vlm_drafter(family, tmp_path / "vlm_drafter")
    drafter = AutoModelForImageTextToText.from_pretrained(drafter_dir)
    processor = load_processor(str(drafter_dir))
    target_processor = load_processor(str(target_dir))
    assert processor.tokenizer.get_vocab() == target_processor.tokenizer.get_vocab()
    assert processor.chat_template == target_processor.chat_template

    inputs = _inputs(processor, IMAGE_PROMPT, tiny_images(2, seed=1))
    output = drafter.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[1] <= inputs["input_ids"].shape[1] + 4


def test_loads_checkpoint_that_names_a_video_processor(tmp_path):
    """Real Qwen-VL checkpoints ship a video_preprocessor_config.json that needs torchvision."""
    folder = shutil.copytree(build_target("qwen2_vl", tmp_path / "target"), tmp_path / "with_video")
    video_config = {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video_config))

    processor = load_processor(str(folder))

    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert "pixel_values" in _inputs(processor, IMAGE_PROMPT, tiny_images(2))


def test_image_only_folder_loads_where_torchvision_is_installed(monkeypatch):
    """The bundled demo saves an image-only processor (no video processor settings). Where
    torchvision is installed (a GPU machine, a Space), AutoProcessor refuses such a folder for its
    missing video processor; it is loaded image-only there too."""
    import models.processors

    monkeypatch.setattr(models.processors, "is_torchvision_available", lambda: True)
    demo = os.path.join(os.path.dirname(__file__), "..", "assets", "demo", "target")

    processor = load_processor(demo)

    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert getattr(processor, "video_processor", None) is None
    assert "pixel_values" in _inputs(processor, IMAGE_PROMPT, tiny_images(2))


def test_folder_without_processor_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="processor"):
        load_processor(str(tmp_path))
    drafter_dir = build_text_drafter(build_target("llava", tmp_path / "target"), tmp_path / "text_only")
    with pytest.raises(ValueError, match="save_pretrained"):
        load_processor(str(drafter_dir))
