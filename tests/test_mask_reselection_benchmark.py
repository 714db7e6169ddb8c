"""Smoke test of ``benchmarks/mask_reselection.py --tiny``: it runs, re-selects, and keep_learned keeps more of ΔW."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import mask_reselection  # noqa: E402

pytestmark = pytest.mark.slow  # a benchmark smoke run: two training runs with evaluation


def test_tiny_run_reselects_and_keep_learned_retains_more_energy(tmp_path, capsys):
    report = mask_reselection.main(["--tiny", "--output-dir", str(tmp_path)])

    rows = {row["mask_keep_learned"]: row for row in report["rows"]}
    assert sorted(rows) == [0.0, 1.0]
    for run in report["runs"]:
        reselections = [u for u in run["mask_updates"] if u["kind"] == "reselection"]
        assert len(reselections) >= 1
        assert rows[run["mask_keep_learned"]]["reselections"] == len(reselections)
        for u in reselections:
            assert 0.0 <= u["retained_energy"] <= 1.0
            assert 0.0 <= u["changed_fraction"] <= 1.0
            assert math.isfinite(u["loss_jump"])
        assert math.isfinite(run["eval_loss"])
    assert rows[1.0]["retained_energy_mean"] >= rows[0.0]["retained_energy_mean"]

    # the JSON on disk is the report, and the table was printed
    saved = json.loads(Path(report["json_path"]).read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert Path(report["json_path"]).parent == tmp_path and "mask-reselection-tiny" in report["json_path"]
    assert "| mask_keep_learned |" in capsys.readouterr().out
