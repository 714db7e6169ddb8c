"""The scaling preset (``benchmarks/scaling.py``): the config-only floor against built models, the memory policy, and
a tiny grid end to end (table, ratios, crossings, plot; one cell in its own process, one past its timeout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import scaling  # noqa: E402
from benchmarks import scaling_report  # noqa: E402
from benchmarks.scaling_report import crossings, ratio, render_markdown  # noqa: E402
from benchmarks.theory import (  # noqa: E402
    activation_bytes,
    block_kinds_for,
    config_floor,
    config_shapes,
    expected_state_bytes,
    parameter_inventory,
)

GIB = 2**30
TINY = {"vocab_size": 96, "hidden_size": 16, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
TINY_WIDE = {**TINY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4}


def _build(config_kwargs: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**config_kwargs)
    return config, LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_config_floor_matches_the_built_model(tied, bias):
    config, model = _build({**TINY, "tie_word_embeddings": tied, "attention_bias": bias, "mlp_bias": bias})
    h, i, kv, vocab, layers = 16, 40, 8, 96, 3  # kv: 2 kv heads of head_dim 4
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h + ((2 * h + 2 * kv) + (2 * i + h) if bias else 0)
    outside = vocab * h * (1 if tied else 2) + h
    inventory = parameter_inventory(model)
    assert config_shapes(config).total_params == inventory.total_params == outside + layers * block

    tokens = 7
    full = config_floor(config, "full", tokens)
    assert full["weights_bytes"] == inventory.weight_bytes == 4 * (outside + layers * block)
    assert full["optimizer_state_bytes"] == expected_state_bytes(inventory, "full")
    assert full["grad_bytes"] == inventory.weight_bytes
    assert full["activation_bytes"] == activation_bytes(config, tokens, ["train"] * layers)

    lisa = config_floor(config, "lisa", tokens, activated_layers=2)
    assert lisa["optimizer_state_bytes"] == expected_state_bytes(inventory, "lisa", active=[0, 2])
    assert lisa["trainable_params"] == outside + 2 * block
    assert lisa["activation_bytes"] == activation_bytes(config, tokens, ["train", "train", "frozen"])
    # the floor's parts add up, and the sum orders the methods as the shapes say
    assert lisa["total_bytes"] == sum(lisa[k] for k in ("weights_bytes", "grad_bytes", "optimizer_state_bytes",
                                                        "activation_bytes"))
    assert lisa["total_bytes"] < full["total_bytes"]

    from peft import LoraConfig, get_peft_model

    lora_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    lora_inventory = parameter_inventory(lora_model)
    lora = config_floor(config, "lora", tokens, lora_r=4)
    assert lora["optimizer_state_bytes"] == expected_state_bytes(lora_inventory, "lora")
    assert lora["weights_bytes"] == lora_inventory.weight_bytes
    assert lora["trainable_params"] == sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    kinds = block_kinds_for("lora", layers, active=[])
    assert lora["activation_bytes"] == activation_bytes(config, tokens, kinds, adapter_rank=4, head_trains=False)


def test_config_floor_refuses_what_it_cannot_compute():
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY)
    with pytest.raises(ValueError, match="method='dora' is invalid; allowed: full, lora, lisa"):
        config_floor(config, "dora", 8)
    with pytest.raises(ValueError, match=r"activated_layers=4 is invalid; allowed: 1\.\.3"):
        config_floor(config, "lisa", 8, activated_layers=4)


def test_smollm2_shapes_have_the_published_sizes():
    from transformers import LlamaConfig

    sizes = {name: config_shapes(LlamaConfig(**kw)).total_params for name, kw in scaling.SHAPES.items()}
    assert sizes == {"SmolLM2-135M": 134_515_008, "SmolLM2-360M": 361_821_120, "SmolLM2-1.7B": 1_711_376_384}
    models = pytest.importorskip("hf_lisa.models")
    try:
        path = models.default_model_path()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"embedded model unavailable: {err}")
    embedded = json.loads((Path(path) / "config.json").read_text())
    for key, value in scaling.SHAPES["SmolLM2-135M"].items():
        if key != "rms_norm_eps":
            assert embedded[key] == value, key


def test_memory_policy_runs_defers_and_refuses():
    policy = scaling.MemoryPolicy(fit_limit_gib=22, gate_gib=8, headroom_gib=4)
    assert scaling.decide(2 * GIB, None, policy) == ("run", "")  # small: runs whatever is free
    assert scaling.decide(10 * GIB, 15 * GIB, policy) == ("run", "")  # 10 + 4 < 15
    verdict, why = scaling.decide(10 * GIB, 13 * GIB, policy)
    assert verdict == "defer" and "needs floor 10.0 + 4 GiB available, had 13.0 GiB" in why
    assert scaling.decide(23 * GIB, 100 * GIB, policy) == (
        "does-not-fit", "does not fit (floor 23.0 GiB > 22 GiB limit)")


def _grid(tmp_path, cells, settings, policy, in_process):
    report = {"shapes": {c["shape"]: c["config"] for c in cells}, "seq_lens": sorted({c["seq_len"] for c in cells}),
              "methods": list(dict.fromkeys(c["method"] for c in cells)), "settings": vars(settings)}
    scaling.run_grid(cells, settings, policy, report, lambda rep: scaling.write_outputs(rep, tmp_path, "grid", False),
                     in_process=in_process, log=lambda message: None)
    return report


@pytest.mark.slow  # a benchmark smoke run: a grid of training cells (~10 s)
def test_tiny_grid_reports_ratios_floors_and_what_did_not_fit(tmp_path):
    from transformers import LlamaConfig

    settings = scaling.ScalingSettings(steps=2, lisa_activated_layers=1, lora_r=4)
    too_big = {**TINY_WIDE, "hidden_size": 128, "intermediate_size": 256}  # never built: its floor refuses it
    shapes = {"tiny": TINY, "wide": TINY_WIDE, "too-big": too_big}
    limit = config_floor(LlamaConfig(**TINY_WIDE), "full", 16)["total_bytes"] * 1.01 / GIB  # too-big's floors exceed it
    policy = scaling.MemoryPolicy(fit_limit_gib=limit)
    cells = [c for c in scaling.grid_cells(shapes, [8, 16], scaling.METHODS)
             if (c["shape"], c["seq_len"]) != ("wide", 8)]
    report = _grid(tmp_path, cells, settings, policy, in_process=True)
    cells = {(c["shape"], c["seq_len"], c["method"]): c for c in report["cells"]}
    assert len(cells) == 15
    for (shape, n, method), cell in cells.items():
        if shape == "too-big":
            assert cell["status"] == "does-not-fit" and cell["reason"].startswith("does not fit (floor"), cell
            continue
        assert cell["status"] == "ok", cell
        assert cell["optimizer_state_bytes"] == cell["expected_state_bytes"] == cell["floor"]["optimizer_state_bytes"]
        assert cell["trainable_params"] == cell["floor"]["trainable_params"]
        assert len(cell["step_seconds"]) == 2 and cell["median_step_seconds"] == cell["step_seconds"][1]
        assert 0.9 < cell["activation_probe"]["measured_bytes"] / cell["activation_probe"]["estimate_bytes"] < 1.1
    value = ratio(report, "tiny", 16, "lisa", "lora", "peak_bytes")
    assert value == cells["tiny", 16, "lisa"]["peak_bytes"] / cells["tiny", 16, "lora"]["peak_bytes"]
    assert ratio(report, "too-big", 16, "lisa", "full", "peak_bytes") is None

    text = render_markdown(report)
    saved = json.loads((tmp_path / "grid.json").read_text())
    assert len(saved["cells"]) == 15  # written as the grid went
    assert "| too-big |" in text and "does not fit (floor" in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny |") and "| 16 |" in line)
    assert f"{value:.2f} (floor " in row
    lines = crossings(report)
    assert any(line.startswith("  - tiny, along row length:") and ("throughout" in line or "crosses 1" in line)
               for line in lines)
    assert any("rows of 16, along parameter count" in line for line in lines)
    scaling.write_outputs(report, tmp_path, "grid")
    assert (tmp_path / "grid.png").stat().st_size > 10_000


@pytest.mark.slow  # benchmark cells in their own processes
def test_cells_run_in_their_own_process_and_a_timeout_is_recorded(tmp_path):
    settings = scaling.ScalingSettings(steps=2, lisa_activated_layers=1, lora_r=4)
    cells = scaling.grid_cells({"tiny": TINY}, [8], ["lisa"])
    report = _grid(tmp_path, cells, settings, scaling.MemoryPolicy(), in_process=False)
    (cell,) = report["cells"]
    assert cell["status"] == "ok", cell
    assert cell["peak_scope"] == "RSS (training)" and cell["peak_bytes"] > cell["rss_before_model_bytes"] > 0
    timed = _grid(tmp_path, cells, settings, scaling.MemoryPolicy(timeout_s=1.0), in_process=False)["cells"][0]
    assert timed["status"] == "timed-out" and timed["reason"].startswith("timed out after 1 s (0 of 2 steps done)")


def test_the_gpu_grid_dry_run_plans_every_cell(capsys):
    assert scaling.main(["--gpu", "--dry-run", "--gpu-memory-gib", "20"]) is None
    out = capsys.readouterr().out
    assert "27 cells, limit 20 GiB, bf16 autocast, 10 steps (3 warm-up)" in out
    lines = [line for line in out.splitlines() if " floor " in line]
    assert len(lines) == 27
    assert all("does not fit" in line for line in lines if "SmolLM2-1.7B" in line and " full " in line)
    assert all("would run" in line for line in lines if "SmolLM2-135M" in line)
    with pytest.raises(SystemExit, match="--shapes='SmolLM2-7B' is invalid"):
        scaling.main(["--gpu", "--dry-run", "--shapes", "SmolLM2-7B"])
    with pytest.raises(SystemExit, match="--dry-run: options of --gpu"):
        scaling.main(["--dry-run"])


def test_resuming_a_subset_keeps_the_whole_grid_and_refuses_other_settings():
    settings = scaling.ScalingSettings()
    stored = {"shapes": {name: scaling.SHAPES[name] for name in ("SmolLM2-135M", "SmolLM2-360M")},
              "seq_lens": [128, 512, 2048], "methods": ["full", "lora", "lisa"],
              "settings": {k: v for k, v in scaling.asdict(settings).items() if k != "chunked_loss"}}
    with pytest.raises(SystemExit, match=r"chunked_loss=False there, True here"):  # an older file: the full loss
        scaling._resumed_grid(stored, settings, {"SmolLM2-1.7B": scaling.SHAPES["SmolLM2-1.7B"]}, [512], ["lisa"])
    same = scaling.ScalingSettings(chunked_loss=False)
    shapes, seq_lens, methods = scaling._resumed_grid(
        stored, same, {"SmolLM2-1.7B": scaling.SHAPES["SmolLM2-1.7B"]}, [512], ["lisa"])
    assert list(shapes) == ["SmolLM2-135M", "SmolLM2-360M", "SmolLM2-1.7B"]
    assert (seq_lens, methods) == ([128, 512, 2048], ["full", "lora", "lisa"])


def test_a_resumed_subset_run_keeps_the_files_other_cells_in_grid_order(tmp_path):
    """``run_grid`` on a subset of a resumed file's grid adds its cells; it does not drop the file's others."""
    settings = scaling.ScalingSettings(steps=2)
    policy = scaling.MemoryPolicy(fit_limit_gib=0.0)  # every floor refuses: nothing is built
    everything = scaling.grid_cells({"a": TINY, "b": TINY_WIDE}, [8, 16], ["lora", "lisa"])
    report = _grid(tmp_path, [c for c in everything if c["seq_len"] == 8], settings, policy, in_process=True)
    assert len(report["cells"]) == 4
    scaling.run_grid([c for c in everything if c["shape"] == "a" and c["seq_len"] == 16], settings, policy, report,
                     lambda rep: None, in_process=True, log=lambda message: None)
    assert [scaling._key(c) for c in report["cells"]] == [
        ("a", 8, "lora"), ("a", 8, "lisa"), ("a", 16, "lora"), ("a", 16, "lisa"), ("b", 8, "lora"), ("b", 8, "lisa")]
    assert all(c["status"] == "does-not-fit" for c in report["cells"])


def test_a_cell_stopped_before_its_peak_bounds_the_memory_ratio():
    """LoRA aborted at 22 GiB (its peak at least that) beside LISA's 19.87 GiB: LISA/LoRA < 0.90, in the table and
    in the crossings; a finished pair gives no bound."""
    gib = 2**30
    report = {"shapes": {"m": TINY}, "seq_lens": [2048], "methods": ["lora", "lisa"], "settings": {"device": "cpu"},
              "cells": [{"shape": "m", "seq_len": 2048, "method": "lora", "status": "aborted",
                         "peak_bytes_seen": 22 * gib, "reason": "aborted"},
                        {"shape": "m", "seq_len": 2048, "method": "lisa", "status": "ok", "peak_bytes": 19.8 * gib,
                         "median_step_seconds": 1.0}]}
    assert scaling_report.peak_ratio_bound(report, "m", 2048, "lisa", "lora") == ("<", 0.9)
    assert scaling_report.peak_ratio_bound(report, "m", 2048, "lora", "lisa") == (">", 22 / 19.8)
    assert scaling_report._ratio_text(report, "m", 2048, "lisa", "lora", "peak_bytes") == "< 0.90"
    assert any(line == "  - m x 2048: < 0.90, from the peak lora reached before it was stopped (its own peak is at "
               "least that)" for line in crossings(report))
    report["cells"][0].update(status="ok", peak_bytes=22 * gib, median_step_seconds=1.0)
    assert scaling_report.peak_ratio_bound(report, "m", 2048, "lisa", "lora") is None
