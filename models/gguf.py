"""Convert a checkpoint folder to GGUF, for the llama.cpp backend (engine/backends/llamacpp.py).

    python -m models.gguf SRC_DIR OUT_DIR [--outtype f32|bf16|q8_0|q4_0] [--mmproj]

writes OUT_DIR/model-{outtype}.gguf (the language model) or, with --mmproj, OUT_DIR/mmproj-{outtype}.gguf
(the vision tower and its projector). `converted(src, outtype, mmproj)` does the same once per
source: the files are cached under .gguf/ (gitignored), keyed by a hash of the source's files.

The converter is llama.cpp's own (`convert_hf_to_gguf.py`, its `conversion/` package and its
`gguf-py`), taken at run time from the sdist of the installed `xllamacpp`, so that it is the
llama.cpp the server runs: the sdist is found in .gguf/ or fetched with `pip download` (pip's
cache answers after the first time); nothing of llama.cpp is copied into this repository. The
`gguf` package from PyPI (0.19.0) is not enough for this: it has no converter, and this
converter needs names (e.g. `MODEL_ARCH.DFLASH`) that PyPI's 0.19.0 lacks. The conversion runs in
a process of its own because the sdist's `gguf` shadows the installed one.

Four adaptations (nothing of the converter is edited; 1-3 are overrides in `_adapted`):
1. `no_sentencepiece`: without the `sentencepiece` package the converter raises
   ModuleNotFoundError before it looks for `tokenizer.model`; a folder without that file gets
   the FileNotFoundError on which the converter itself falls back to the BPE tokenizer.
2. `gpt2_pre_tokenizer`: a BPE tokenizer whose pre-tokenizer hash llama.cpp does not know (the
   demo model's) is written as `gpt-2` when its pre-tokenizer is exactly GPT-2's (ByteLevel
   with GPT-2's regex, no normalizer), which is what the `gpt-2` rules implement.
3. `merger_blocks`: the Qwen2-VL / Qwen2.5-VL projector is `visual.merger.mlp.0` and `.mlp.2`, but the name map
   covers `visual.merger.mlp.{n}` only for n below the vision depth (2 in the demo model), so the
   map is built for at least the family's `gguf_merger_blocks` (3).
4. `text_architectures`: the converter picks the language model's class from
   `text_config.architectures`; a config without it (SmolVLM / Idefics3 random-weight shapes built
   here) gets the family's `gguf_text_architectures` (`["VLlama3ForCausalLM"]`, what the published
   SmolVLM configs say).
The families declare both (models/families/: `Family.gguf_*`); this file names no family.

`q4_0`: every 2-D weight of the language model (the embedding and the output layer too: llama-quantize's
`--pure`) in Q4_0, quantized by the converter's gguf-py (its numpy copy of llama.cpp's
quantize_row_q4_0_ref, the same bits: tests/test_q4.py), the rest as bf16 would be; the weights
`--quantization q4_0` quantizes (engine/quantized.py), for measure/alternate.py.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".gguf"
OUTTYPES = ("f32", "bf16", "q8_0", "q4_0")


class ConversionError(RuntimeError):
    """The checkpoint could not be converted; the message says why."""


def converted(src: str | os.PathLike, outtype: str = "f32", mmproj: bool = False, cache: Path = CACHE) -> Path:
    """The GGUF file of `src` (the language model, or with mmproj the vision projector), converted
    once and cached under `cache`/<folder name>-<hash of the source files>/."""
    src = Path(src)
    out_dir = cache / f"{src.name}-{source_hash(src)[:16]}"
    path = out_dir / output_name(outtype, mmproj)
    if not path.is_file():
        print(f"Converting {src} to GGUF for llama.cpp ({output_name(outtype, mmproj)}, once) ...", file=sys.stderr)
        command = [sys.executable, "-m", "models.gguf", str(src), str(out_dir), "--outtype", outtype]
        done = subprocess.run(command + (["--mmproj"] if mmproj else []), cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConversionError(f"converting {src} to GGUF ({outtype}{', mmproj' if mmproj else ''}) failed: {last}")
    return path


def output_name(outtype: str, mmproj: bool) -> str:
    return f"{'mmproj' if mmproj else 'model'}-{outtype}.gguf"


def source_hash(src: str | os.PathLike) -> str:
    """sha256 over the source folder's file names and contents, and the converter's version."""
    src = Path(src)
    digest = hashlib.sha256(xllamacpp_version().encode())
    for path in sorted(p for p in src.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def xllamacpp_version() -> str:
    return importlib.metadata.version("xllamacpp")


def xllamacpp_sdist(cache: Path = CACHE) -> Path:
    """The installed xllamacpp's sdist (llama.cpp's source inside), downloaded with pip the first time."""
    version = xllamacpp_version()
    sdist = cache / "sdist" / f"xllamacpp-{version}.tar.gz"
    if not sdist.is_file():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "xllamacpp",
                   f"xllamacpp=={version}", "-d", str(sdist.parent)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConversionError(f"could not download xllamacpp {version}'s sdist with pip: {last}")
    return sdist


def llama_cpp_sources(cache: Path = CACHE) -> Path:
    """A folder with llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/, extracted from
    the installed xllamacpp's sdist (downloaded with pip the first time)."""
    version = xllamacpp_version()
    folder = cache / f"llama.cpp-{version}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    sdist = xllamacpp_sdist(cache)
    prefix = f"xllamacpp-{version}/thirdparty/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
    partial = folder.with_name(folder.name + ".partial")
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers()
                   if m.isfile() and m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(partial, members=members, filter="data")
    partial.rename(folder)
    return folder


def gpt2_pre_tokenizer(tokenizer_json: dict) -> bool:
    """Whether a tokenizer.json pre-tokenizes exactly as GPT-2 (llama.cpp's `gpt-2` rules)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    return (tokenizer_json.get("model", {}).get("type") == "BPE" and tokenizer_json.get("normalizer") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def _adapted(model_class, gguf, merger_blocks: int = 0, q4_0: bool = False):
    """`model_class` (the converter's class for this architecture) with the three adaptations;
    `merger_blocks`: the family's (0: none to cover); q4_0: every 2-D weight in Q4_0 (module doc)."""

    class Adapted(model_class):
        model_arch = model_class.model_arch  # the converter asks every subclass to name it

        def tensor_force_quant(self, name, new_name, bid, n_dims):
            if q4_0 and n_dims == 2 and new_name.endswith(".weight"):
                return gguf.GGMLQuantizationType.Q4_0  # norms stay float32: the converter decides after
            return super().tensor_force_quant(name, new_name, bid, n_dims)

        def _create_vocab_sentencepiece(self):  # 1. no_sentencepiece
            if not (self.dir_model / "tokenizer.model").is_file():
                raise FileNotFoundError(f"no tokenizer.model in {self.dir_model}")
            return super()._create_vocab_sentencepiece()

        def get_vocab_base_pre(self, tokenizer) -> str:  # 2. gpt2_pre_tokenizer
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:
                with open(self.dir_model / "tokenizer.json", encoding="utf-8") as file:
                    if gpt2_pre_tokenizer(json.load(file)):
                        return "gpt-2"
                raise

        def __init__(self, *args, **kwargs):  # 3. merger_blocks
            super().__init__(*args, **kwargs)
            if self.block_count < merger_blocks:
                self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, merger_blocks)

    Adapted.__name__ = model_class.__name__
    return Adapted


def convert(src: Path, out_dir: Path, outtype: str, mmproj: bool) -> Path:
    """Run llama.cpp's converter on `src` in this process (it imports the sdist's gguf)."""
    from models.families import Family, family_of_type

    sources = llama_cpp_sources()
    sys.path[:0] = [str(sources / "gguf-py"), str(sources)]
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_BF16}  # q4_0: forced
    hparams = ModelBase.load_hparams(src, False)
    family = family_of_type(hparams.get("model_type")) or Family("unregistered", ())
    text_config = hparams.get("text_config") or {}
    if family.gguf_text_architectures and not text_config.get("architectures"):  # 4.
        hparams["text_config"] = {**text_config, "architectures": list(family.gguf_text_architectures)}
    architecture = get_model_architecture(hparams, ModelType.MMPROJ if mmproj else ModelType.TEXT)
    model_class = _adapted(get_model_class(architecture, mmproj=mmproj), gguf,
                           family.gguf_merger_blocks if mmproj else 0,  # 3. the projector's name map only
                           q4_0=outtype == "q4_0" and not mmproj)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / output_name(outtype, mmproj)
    partial = path.with_name(path.name + ".partial")
    with torch.inference_mode():
        model = model_class(src, file_types[outtype], partial, model_name=src.name, hparams=hparams)
        model.write()
    partial.rename(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a checkpoint folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("out", type=Path, help="the folder to write the GGUF file into")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32")
    parser.add_argument("--mmproj", action="store_true", help="the vision tower and projector instead of the LM")
    args = parser.parse_args(argv)
    try:
        print(convert(args.src, args.out, args.outtype, args.mmproj))
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
