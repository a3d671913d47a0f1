"""engine/prompt.py messages in the OpenAI chat format that llama-server, vLLM and SGLang take:
text parts and `image_url` parts with data URLs, in the order the user gave them.

    counter = iter(range(1, 10**6))          # images are numbered across the conversation
    content = openai_content(message["content"], label_images=True, counter=counter)

- Adjacent text parts are merged (a template concatenates them; llama.cpp would join them with
  "\n"). Text-only content becomes a plain string, which every chat template takes.
- `label_images`: "Picture N: " is written as text before each image, for a server that flattens
  a message before the chat template sees it (llama-server: common/chat.cpp `to_json_oaicompat`)
  when the model's template labels images (Qwen2-VL's `add_vision_id`; on by default in the demo
  model's template: `labels_images`). A server that hands the template the image parts (vLLM,
  SGLang) lets the template label them itself.
- Images: shrunk to what the backend's model takes (`fit`: the backend's `image_fit()`, the same
  options engine/image_jail.py `ImageJail.load` decodes with, so an image the app loaded is not touched
  again and one given at full size is shrunk the same way; `fit_to_processor`, never enlarged),
  then a PNG data URL, or a JPEG one (quality 90) when the PNG is over
  PNG_BUDGET bytes and the JPEG is smaller: diagrams and the demo's pictures stay lossless,
  a photo is sent in a few hundred kilobytes instead of megabytes.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass

from engine.images import fit_to_processor

MAX_SIDE = 1536  # the longest side of an image sent to a server, in pixels
PNG_BUDGET = 1_000_000  # bytes; a larger PNG is sent as JPEG when that is smaller
JPEG_QUALITY = 90
LABEL_RULE = "add_vision_id is not defined or add_vision_id"  # a template that labels images by default


@dataclass(frozen=True)
class LongestSide:
    """What engine/images.py's `fit` takes (a processor's `size`): at most `longest_edge` pixels on
    the longest side. `ImageJail.load(path, fit=LongestSide(1536))` shrinks as it decodes."""

    longest_edge: int = MAX_SIDE

    @property
    def size(self) -> dict:
        return {"longest_edge": self.longest_edge}


def labels_images(chat_template: str) -> bool:
    """The template writes "Picture N: " before each image unless told not to."""
    return LABEL_RULE in chat_template


def openai_content(parts: list[dict], label_images: bool, counter: Iterator[int],
                   fit: dict | None = None, lossless: bool = False) -> str | list[dict]:
    """One message's parts in OpenAI's format (the module docstring); `fit`: load_image's options
    that shrink images ({"fit": LongestSide(1536)}, or a processor and its family); `lossless`:
    PNG always (a server in this process: no bytes to save, and the pixels the built-in engine
    sees, so that greedy answers can be compared)."""
    out, text = [], ""
    for part in parts:
        if part["type"] == "text":
            text += part["text"]
            continue
        text += f"Picture {next(counter)}: " if label_images else ""
        out += [{"type": "text", "text": text}] if text else []
        image = part["image"] if not fit else fit_to_processor(part["image"], fit["fit"], fit.get("family"))
        out.append({"type": "image_url", "image_url": {"url": data_url(image, None if lossless else PNG_BUDGET)}})
        text = ""
    out += [{"type": "text", "text": text}] if text else []
    return text if not any(p["type"] == "image_url" for p in out) else out


def data_url(image, png_budget: int | None = PNG_BUDGET) -> str:
    """A PNG data URL, or a JPEG one when the PNG is over `png_budget` bytes (None: no budget) and
    the JPEG is smaller."""
    encoded, kind = _encode(image, "PNG"), "png"
    if png_budget is not None and len(encoded) > png_budget:
        jpeg = _encode(image.convert("RGB"), "JPEG", quality=JPEG_QUALITY)
        encoded, kind = (jpeg, "jpeg") if len(jpeg) < len(encoded) else (encoded, kind)
    return f"data:image/{kind};base64," + base64.b64encode(encoded).decode()


def _encode(image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()
