"""Smoke test of ``benchmarks/gpu_check.py`` (the prepared one-GPU LISA vs LoRA check) on CPU with a tiny model, so
that the script cannot rot before it reaches a GPU. Values checked: trainable parameter counts against closed forms."""

from __future__ import annotations

import json
import sys

import pytest

from dist_common import REPO

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from benchmarks import gpu_check  # noqa: E402


def test_without_cuda_it_exits_cleanly_and_says_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; the no-GPU path is not taken")
    assert gpu_check.main(["--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["status"] == "skipped" and "No CUDA device" in report["reason"]
    assert "skipped" in (tmp_path / "gpu_check.md").read_text()


def test_cpu_smoke_run_measures_full_lora_and_lisa(tmp_path):
    from train_fixtures import build_tiny_lm_dir

    model = build_tiny_lm_dir(tmp_path / "model", num_layers=3, hidden=32)  # vocab 128, untied, kv heads 2
    out = tmp_path / "out"
    code = gpu_check.main(["--output", str(out), "--allow_cpu", "--no_autocast", "--model", model, "--steps", "3",
                           "--warmup", "1", "--batch_size", "2", "--seq_len", "128",  # the bundled rows fit
                           "--lisa_interval_steps", "2", "--methods", "full,lora,lisa",
                           "--exact_match_samples", "0"])
    assert code == 0
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    block = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32  # q,o + k,v + gate,up,down + 2 norms
    outside = 2 * 128 * 32 + 32  # embeddings, head, final norm
    assert rows["full"]["trainable_params"] == 3 * block + outside
    assert rows["lisa"]["trainable_params"] == 2 * block + outside  # E+H+2L
    lora_block = 16 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 3)  # r (in + out) per linear layer
    assert rows["lora"]["trainable_params"] == 3 * lora_block
    for row in rows.values():  # the peers run in tests/test_benchmark_peers.py
        assert row["tokens_per_second"] > 0 and row["optimizer_state_bytes"] > 0
    harness = {r["method"]: r for r in json.loads((out / "gpu-compare.json").read_text())["results"]}
    assert all(len(r["steps"]) == 3 for r in harness.values())
    assert "not judged" in (out / "gpu_check.md").read_text()  # the 1.5x check is for a GPU only
