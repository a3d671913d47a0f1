"""The benchmark runs end to end on a tiny model and writes its JSON and plot (figures not asserted)."""

from __future__ import annotations

import json

from engine.bench import main


def test_bench_runs_end_to_end(zoo, tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["--model", str(zoo.dir("qwen2_vl")), "--drafter", str(zoo.dir("qwen2_vl", "text_drafter")),
                 "--drafter", "ngram", "--requests", "2", "--requests-from", "demo", "--max-new-tokens", "8",
                 "--dtype", "float32", "--json", str(out), "--plot", str(png)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {(r["engine"], r["mode"], r["drafter"]): r for r in result["rows"]}
    assert ("this", "plain", None) in rows and ("transformers", "plain", None) in rows
    assert rows[("this", "speculative", "ngram")]["identical_to_plain"] == 2  # float32: exact
    assert rows[("this", "speculative", "qwen2_vl-text_drafter")]["identical_to_plain"] == 2
    assert rows[("transformers", "speculative", "prompt_lookup")]["error"]  # crashes on image prompts
    for row in result["rows"]:
        assert set(row) >= {"engine", "mode", "drafter", "decode_tok_s", "first_token_s", "answer_s",
                            "tokens_per_forward", "identical_to_plain", "requests", "speedup_vs_plain", "error"}
    assert png.stat().st_size > 1000
    assert "| this plain |" in capsys.readouterr().out
