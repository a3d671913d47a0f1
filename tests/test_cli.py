"""`python -m engine`: a JSON answer identical across modes, and one-line errors for user mistakes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.__main__ import main
from models import tiny
from tests.conftest import ROOT
from tests.helpers import cli_json


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, image in enumerate(tiny.tiny_images(2)):
        paths.append(str(folder / f"picture{i}.png"))
        image.save(paths[-1])
    return paths


def test_json_answer_speculative_equals_plain(zoo, image_files, capsys):
    model, drafter = str(zoo.dir("qwen2_vl")), str(zoo.dir("qwen2_vl", "text_drafter"))
    common = ["--model", model, "--image", image_files[0], "--image", image_files[1],
              "--max-new-tokens", "12", "--dtype", "float32", "--device", "cpu", "What is shown?"]
    plain = cli_json(capsys, common + ["--mode", "plain"])
    speculative = cli_json(capsys, common + ["--drafter", drafter, "--draft-tokens", "3"])
    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 0
    assert speculative["text"] == plain["text"]
    assert plain["stats"]["mode"] == "plain" and speculative["stats"]["mode"] == "speculative"
    assert "draft length 3" in speculative["stats"]["draft_length_reason"]  # (fixed), or paused when rejected
    auto = cli_json(capsys, common + ["--drafter", f"auto,{drafter},ngram"])  # k from cost, drafter picked
    assert auto["token_ids"] == plain["token_ids"]
    assert auto["stats"]["auto_choice"].startswith("auto: ") and "(fixed)" not in auto["stats"]["draft_length_reason"]
    assert speculative["stats"]["drafter_kind"] == "text_lm"
    assert speculative["stats"]["prefill_image_tokens"] > 0
    for key in ("ttft_s", "decode_tok_s", "acceptance", "tokens_per_forward", "accepted_by_position"):
        assert key in speculative["stats"]
    tree = cli_json(capsys, common + ["--drafter", drafter, "--draft-tokens", "3", "--draft-tree", "5"])
    assert tree["token_ids"] == plain["token_ids"]
    assert tree["stats"]["draft_shape"] == "tree" and tree["stats"]["nodes_per_forward"] > 1


def swapped_vocabulary_drafter(source, out):
    """A copy of a drafter whose tokenizer gives two common tokens each other's ids."""
    shutil.copytree(source, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.mark.parametrize("case", ["missing_image", "not_an_image", "unknown_model", "incompatible_drafter",
                                  "text_model_as_target"])
def test_user_errors_exit_2_with_one_line(zoo, image_files, tmp_path, capsys, case):
    model = str(zoo.dir("qwen2_vl"))
    argv = {
        "missing_image": ["--model", model, "--image", str(tmp_path / "nope.png"), "hi"],
        "not_an_image": ["--model", model, "--image", __file__, "hi"],
        "unknown_model": ["--model", str(tmp_path / "no-such-model"), "hi"],
        "incompatible_drafter": ["--model", model, "--drafter",
                                 str(swapped_vocabulary_drafter(zoo.dir("qwen2_vl", "text_drafter"), tmp_path / "d")), "hi"],
        "text_model_as_target": ["--model", str(zoo.dir("qwen2_vl", "text_drafter")), "hi"],
    }[case]
    assert main(argv + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    expected = {"missing_image": "no such file", "not_an_image": "not an image", "unknown_model": "no-such-model",
                "incompatible_drafter": "vocabulary", "text_model_as_target": "vision"}[case]
    assert expected in err


def test_module_entry_point_runs(zoo):
    out = subprocess.run([sys.executable, "-m", "engine", "--model", str(zoo.dir("qwen2_vl")), "--drafter", "ngram",
                          "--max-new-tokens", "5", "--device", "cpu", "--json", "hello"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 5
