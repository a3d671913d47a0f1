"""The benchmark runs end to end on tiny models, with every kind of drafter, and writes its JSON
and plot (figures not asserted: the machine is noisy; exactness and the rows' shape are)."""

from __future__ import annotations

import json

import pytest

from measure.bench import main
from tests import tiny_next

ROW_KEYS = {"engine", "mode", "drafter", "decode_tok_s", "first_token_s", "answer_s", "tokens_per_forward",
            "identical_to_plain", "requests", "speedup_vs_plain", "error", "limit"}


def bench(tmp_path, argv) -> dict:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(argv + ["--requests", "2", "--requests-from", "demo", "--max-new-tokens", "8", "--dtype", "float32",
                        "--device", "cpu", "--json", str(out), "--plot", str(png)])
    assert code == 0
    assert png.stat().st_size > 1000
    result = json.loads(out.read_text())
    for row in result["rows"]:
        assert set(row) >= ROW_KEYS
    return result


def test_bench_runs_end_to_end_with_text_vlm_and_ngram_drafters(zoo, tmp_path, capsys):
    """With --tree: a chain row and a tree row per drafter, side by side, both exact."""
    result = bench(tmp_path, ["--model", str(zoo.dir("qwen2_vl")),
                              "--drafter", str(zoo.dir("qwen2_vl", "text_drafter")),
                              "--drafter", str(zoo.dir("qwen2_vl", "vlm_drafter")), "--drafter", "ngram", "--tree"])
    rows = {(r["engine"], r["mode"], r["drafter"]): r for r in result["rows"]}
    assert ("this", "plain", None) in rows and ("transformers", "plain", None) in rows
    for name in ("qwen2_vl-text_drafter", "qwen2_vl-vlm_drafter", "ngram"):
        for label, nodes in [(f"{name}, chain", 0), (f"{name}, tree 4", 4)]:
            row = rows[("this", "speculative", label)]
            assert row["identical_to_plain"] == 2  # float32: exact
            assert row["limit"] is not None and row["draft_tree"] == nodes  # the cost model covers it
            assert row["tree_fallback"] is None
    assert rows[("this", "speculative", "auto")]["identical_to_plain"] == 2  # --drafter auto's row
    assert rows[("this", "speculative", "auto")]["mean_draft_length"] is not None  # k chosen from cost
    assert sum(rows[("this", "speculative", "auto")]["auto_picked"].values()) == 2
    assert ("transformers", "speculative", "qwen2_vl-vlm_drafter") in rows
    assert ("transformers", "speculative", "ngram") not in rows  # prompt lookup is its own row
    assert rows[("transformers", "speculative", "prompt_lookup")]["error"]  # crashes on image prompts
    assert set(result["costs"]["draft_step_s"]) == set(result["costs"]["draft_tree_s"]) == {"text", "vlm", "ngram"}
    assert "| this plain |" in capsys.readouterr().out


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family, drafter, label", [("step3p7", "mtp", "mtp"), ("qwen3_5", "mtp", "mtp"),
                                                    ("muse_glimmer", "assistant", "assistant"),
                                                    ("gemma4", "assistant", "assistant")])
def test_bench_covers_drafters_that_read_the_target(tmp_path, family, drafter, label):
    """MTP, DFlash and shared-cache drafters: rows, exactness and a draft-step cost; no
    transformers assisted-generation row (that needs a drafter that is its own model)."""
    folder = tiny_next.build_target(family, tmp_path / family)
    if drafter == "assistant":
        drafter = str(tiny_next.build_assistant(family, tmp_path / label))
    result = bench(tmp_path, ["--model", str(folder), "--drafter", drafter])
    rows = {(r["engine"], r["mode"], r["drafter"]): r for r in result["rows"]}
    speculative = [r for r in result["rows"] if r["engine"] == "this" and r["mode"] == "speculative"]
    assert len(speculative) == 1 and speculative[0]["error"] is None
    assert speculative[0]["identical_to_plain"] == 2 and speculative[0]["limit"] is not None
    assert [r["drafter"] for r in result["rows"] if r["engine"] == "transformers"] == [None, "prompt_lookup"]
    assert ("this", "plain", None) in rows
    (key, cost), = result["costs"]["draft_step_s"].items()
    assert cost > 0


def test_acceptance_gives_the_bench_fixed_k_rows_figures(zoo, tmp_path):
    """measure.acceptance (no timing) reports what the bench's k = 2 rows report on the same
    requests: acceptance, tokens per target forward, exactness, acceptance by position."""
    from measure import acceptance

    model = ["--model", str(zoo.dir("qwen2_vl")), "--drafter", str(zoo.dir("qwen2_vl", "vlm_drafter")),
             "--drafter", "ngram", "--fixed-k", "2"]
    fixed = [r for r in bench(tmp_path, model + ["--no-transformers"])["rows"] if str(r["drafter"]).endswith("k=2")]
    out = tmp_path / "acceptance.json"
    assert acceptance.main(model + ["--requests", "2", "--requests-from", "demo", "--max-new-tokens", "8", "--dtype",
                                    "float32", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    keys = ("drafter", "acceptance", "tokens_per_forward", "identical_to_plain", "accepted_by_position")
    assert len(fixed) == 2 and [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in fixed]
    assert all(r["identical_to_plain"] == 2 and r["acceptance"] is not None for r in rows)


def test_acceptance_by_position_counts_every_run_that_drafted_that_far():
    """A run whose drafts were all one token long (drafting paused, one-token probes) does not cut
    the other runs' later positions: each position is its accepted drafts over its drafts."""
    from measure.bench import _by_position
    from measure.bench_rows import Measurement

    long = Measurement(0, drafted_by_position=[4, 4, 2], accepted_by_position=[3, 2, 1])
    short = Measurement(1, drafted_by_position=[4], accepted_by_position=[1])
    plain = Measurement(2)
    assert _by_position([long, short, plain]) == [4 / 8, 2 / 4, 1 / 2]
    assert _by_position([plain]) is None
