"""`python -m measure.realscale --int8 --llamacpp` (and `--quantization q4_0`) at the shrunken Qwen2.5-VL-3B shape, end to end
(figures not asserted: the machine is noisy). The int8 rows run on int8 weights, and their
greedy answers with the replay drafter equal plain decoding's on the same int8 weights: in
float32, where a verify pass over k+1 tokens picks the tokens a one-token pass picks (in
bfloat16, random weights' near-ties can part them: measure/replay.py). llama.cpp runs last, once
this engine is freed, beside the unquantized rows in their dtype and beside the int8 rows in
Q8_0 (Q4_0 beside q4_0); here a recorder stands in for it (converting to GGUF and llama-server are
tests/test_gguf.py's and tests/test_llamacpp.py's)."""

from __future__ import annotations

import contextlib
import gc
import io
import json

import pytest

from engine.target import Target
from measure import llamacpp_rows, realscale, shapes


QUANTIZED = {"int8": (["--int8"], "int8 weights", "q8_0"), "q4_0": (["--quantization", "q4_0"], "q4_0 weights", "q4_0")}


@pytest.fixture(scope="module", params=sorted(QUANTIZED))
def run(request, tmp_path_factory, one_thread):
    """(the preset's figures, llama.cpp's calls, what was printed, the kind) of one quick run."""
    flags, _, _ = QUANTIZED[request.param]
    folder = tmp_path_factory.mktemp("realscale")
    calls = []

    def recorder(target_dir, drafter_dir, outtype, messages, decode):
        alive = [o for o in gc.get_objects() if type(o) is Target and o.name == str(target_dir)]
        calls.append({"outtype": outtype, "targets_alive": len(alive)})
        return {"outtype": outtype, "bandwidth_gb_s": 1.0, "threads": 1, "plain_tok_s": 1.0, "image_error": None,
                "text_plain_tok_s": 1.0, "text_draft_tok_s": 1.0, "text_drafted": 0, "text_accepted": 0,
                "weights_bytes": 1, "bound_tok_s": 1.0}

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(shapes, "CACHE", folder / "cache")
        patch.setattr(llamacpp_rows, "realscale_figures", recorder)
        assert realscale.main(["--quick", "--preset", "qwen2.5-vl-3b", "--dtype", "float32", *flags, "--llamacpp",
                               "--max-new-tokens", "12", "--image-size", "56", "--acceptances", "1.0,0.8",
                               "--json", str(folder / "realscale.json")]) == 0
    (result,) = json.loads((folder / "realscale.json").read_text(), object_hook=realscale._int_keys)["results"]
    return result, calls, printed.getvalue(), request.param


def test_quantized_rows_read_quantized_weights_and_replay_their_own_plain_answer(run):
    result, _, _, kind = run
    int8 = result["int8"]
    assert int8["quantization"] == kind
    # float32 products read as int8 (and scales), or as 4-bit codes (and scales)
    assert int8["weights_bytes"] < result["weights_bytes"] / (3 if kind == "int8" else 5)
    assert set(int8["t_s"]) == set(range(1, 10)) and int8["draft_step_s"] > 0
    assert len(int8["answer"]) == 12
    assert int8["replay_answer_is_plain"]  # the fixed point is the int8 plain answer itself
    replay = {(r["acceptance"], r["k"]): r for r in int8["replay"]}
    assert set(replay) == {(1.0, 4), (1.0, "cost"), (0.8, 4), (0.8, "cost")}
    assert all(r["equals_plain"] for r in replay.values()), replay
    assert int8["text_drafter"]["equals_plain"]
    assert replay[(1.0, 4)]["measured_acceptance"] == 1.0
    assert replay[(0.8, 4)]["measured_acceptance"] < 1.0  # some proposals corrupted, and rejected


def test_llamacpp_runs_last_once_this_engine_is_freed_beside_each_kind_of_weights(run):
    result, calls, printed, kind = run
    _, label, gguf = QUANTIZED[kind]
    assert calls == [{"outtype": "f32", "targets_alive": 0}, {"outtype": gguf, "targets_alive": 0}]
    assert result["llamacpp"]["outtype"] == "f32" and result["int8"]["llamacpp"]["outtype"] == gguf
    assert f"| float32 + {label} (drafter" in printed  # the quantized row of the first table
    assert f"qwen2.5-vl-3b: float32 + {label} / {gguf}" in printed  # beside llama.cpp's GGUF of that kind
    assert "qwen2.5-vl-3b: float32 / f32" in printed


def test_bytes_read_counts_one_row_of_an_input_embedding_the_output_layer_does_not_share():
    """measure.alternate's bound: a decode step looks up one row of the input embedding; when the
    output layer is that table (tied), it reads all of it."""
    import torch

    from engine.target import load_target
    from models.loading import LoadOptions
    from tests.helpers import DEMO_TARGET

    target = load_target(DEMO_TARGET, LoadOptions(dtype="float32", device="cpu"))
    model = target.model
    embedding = model.get_input_embeddings().weight
    row = embedding[0].numel() * embedding.element_size()
    if embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr():
        assert llamacpp_rows.bytes_read(target) == llamacpp_rows.weight_bytes(target)
        model.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())  # untied from here on
    before = llamacpp_rows.weight_bytes(target)
    assert llamacpp_rows.bytes_read(target) == before - (len(embedding) - 1) * row
