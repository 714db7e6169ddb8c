"""Smoke test of ``benchmarks/packing.py --tiny``: both modes train over the same rows, packed in fewer steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import packing  # noqa: E402

pytestmark = pytest.mark.slow  # a benchmark smoke run: two short training runs


def test_tiny_run_trains_the_same_rows_packed_in_fewer_steps(tmp_path, capsys):
    report = packing.main(["--tiny", "--rows", "16", "--pack-length", "256", "--output-dir", str(tmp_path)])

    unpacked, packed = report["rows"]
    assert (unpacked["mode"], packed["mode"]) == ("unpacked", "packed")
    assert unpacked["rows"] == packed["rows"] == unpacked["sequences"] == 16
    assert packed["sequences"] < 16 and packed["packing_ratio"] == 16 / packed["sequences"]
    assert unpacked["steps"] == 4 and packed["steps"] == -(-packed["sequences"] // 4)  # one pass, 4 per step
    for row in (unpacked, packed):
        assert row["seconds_per_step"] > 0 and row["tokens_per_second"] > 0 and 0 <= row["padding"] < 1
    assert [len(r["step_seconds"]) for r in report["runs"]] == [unpacked["steps"], packed["steps"]]
    assert report["tokens_per_second_ratio"] == packed["tokens_per_second"] / unpacked["tokens_per_second"]

    saved = json.loads(Path(report["json_path"]).read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert Path(report["json_path"]).parent == tmp_path and "packing-tiny" in report["json_path"]
    out = capsys.readouterr().out
    assert "| mode | rows | sequences |" in out and "packed / unpacked tokens per second" in out
