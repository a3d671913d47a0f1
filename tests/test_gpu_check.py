"""The GPU check's short mode (what runs on a CPU): exactness of one family in float32, then the real-scale measurement on the shrunken SmolVLM shape, with a report
(figures not asserted: the machine is noisy; their presence and the replay's acceptance are)."""

from __future__ import annotations

import json
import pathlib
import re

from measure import gpu_check, shapes


def test_short_mode_runs_exactness_and_the_real_scale_measurement(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shapes, "CACHE", tmp_path / "cache")
    out = tmp_path / "check.json"
    assert gpu_check.main(["--short", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (exact,) = report["exactness"]
    assert exact["passed"] and exact["dtype"] == "float32" and exact["summary"].startswith("6 passed, 0 failed")
    scale = report["realscale"]
    assert scale["preset"] == "smolvlm-256m" and scale["quick"]
    assert set(scale["t_s"]) == {str(n) for n in range(1, 10)}
    assert scale["prefill"]["vision_s"] > 0 and scale["draft_step_s"] > 0
    replay = {(r["acceptance"], r["k"]): r for r in scale["replay"]}
    assert replay[(1.0, 4)]["measured_acceptance"] == 1.0  # the fixed point is replayed exactly
    assert replay[(0.2, 4)]["measured_acceptance"] < 0.6
    assert all(r["bound"] > 0 for r in scale["replay"])
    assert "gpu check: float32 exactness passed" in capsys.readouterr().out
    assert (tmp_path / "cache" / "smolvlm-256m-quick" / "config.json").exists()  # cached for the next run


def test_no_shipped_module_imports_or_runs_the_tests():
    root = pathlib.Path(__file__).resolve().parent.parent
    shipped = [root / "app.py", *(p for folder in ("app_ui", "engine", "measure", "models")
                                  for p in (root / folder).rglob("*.py"))]
    offenders = [str(p.relative_to(root)) for p in shipped
                 if re.search(r"^\s*(from|import) tests\b|\"pytest\"", p.read_text(), re.M)]  # imports, or runs pytest
    assert len(shipped) > 50 and not offenders, offenders
