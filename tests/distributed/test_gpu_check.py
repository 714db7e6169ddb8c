"""Smoke test of the one-GPU check (``benchmarks/configs/gpu-check.json``: the peer comparison on one GPU with the
LISA paper's speed claim) on CPU with a tiny model, each method in its own process as on the GPU, so that the check
cannot rot before it reaches a GPU. Values checked: trainable parameter counts against closed forms."""

from __future__ import annotations

import json
import sys

import pytest

from dist_common import REPO

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks import study  # noqa: E402

GPU_CHECK = str(REPO / "benchmarks" / "configs" / "gpu-check.json")


def test_without_cuda_it_refuses_and_says_why(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; the no-GPU path is not taken")
    with pytest.raises(SystemExit) as exit_:
        study.main(["--config", GPU_CHECK, "--results-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "sees no CUDA device here; nothing was run" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cpu_smoke_run_measures_full_lora_and_lisa(tmp_path):
    from train_fixtures import build_tiny_lm_dir

    model = build_tiny_lm_dir(tmp_path / "model", num_layers=3, hidden=32)  # vocab 128, untied, kv heads 2
    out = tmp_path / "out"
    settings = {"device": "cpu", "bf16": False, "steps": 3, "timing_warmup_steps": 1, "batch_size": 2,
                "seq_len": 128, "lisa_interval_steps": 2, "exact_match_samples": 0}  # the bundled rows fit 128
    report = study.main(["--config", GPU_CHECK, "--model", model, "--methods", "full,lora,lisa", "--results-dir",
                         str(out), "--name", "gpu-check",
                         *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]])
    rows = {r["method"]: r for r in report["results"]}
    assert all(r["ok"] and not r["in_process"] for r in rows.values())
    block = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32  # q,o + k,v + gate,up,down + 2 norms
    outside = 2 * 128 * 32 + 32  # embeddings, head, final norm
    assert rows["full"]["params"]["trainable_max"] == 3 * block + outside
    assert rows["lisa"]["params"]["trainable_max"] == 2 * block + outside  # E+H+2L
    lora_block = 16 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 3)  # r (in + out) per linear layer
    assert rows["lora"]["params"]["trainable_max"] == 3 * lora_block
    for row in rows.values():  # the peers run in tests/test_benchmark_peers.py
        assert row["timing"]["tokens_per_second"] > 0 and row["optimizer_state"]["max_bytes"] > 0
        assert len(row["steps"]) == 3
    saved = json.loads((out / "gpu-check.json").read_text())
    assert saved["checks"][0]["passed"] is None  # the 1.5x claim is judged on a GPU only
    assert "the claim is for cuda" in (out / "gpu-check.md").read_text()
