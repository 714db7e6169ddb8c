"""Smoke test of ``benchmarks/sweep.py`` (the lever study and the fair learning-rate comparison) on a tiny llama.

The figures checked would differ if a lever did not take effect: with E+H frozen the optimizer holds the active
blocks' state only (closed form from the config), γ changes the state by whole blocks, and a fair comparison picks,
per method, the rate whose final eval loss is lowest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import sweep  # noqa: E402
from benchmarks.presets import PRESETS  # noqa: E402

LAYERS, HIDDEN, VOCAB, STEPS = 4, 32, 128, 4
INTERMEDIATE, KV = 2 * HIDDEN, 2 * (HIDDEN // 4)
BLOCK = [HIDDEN * HIDDEN, KV * HIDDEN, KV * HIDDEN, HIDDEN * HIDDEN,
         INTERMEDIATE * HIDDEN, INTERMEDIATE * HIDDEN, HIDDEN * INTERMEDIATE, HIDDEN, HIDDEN]
OUTSIDE = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN]


def adamw(numels: list[int]) -> int:
    return sum(8 * n + 4 for n in numels)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    model_dir = build_tiny_lm_dir(root / "model", num_layers=LAYERS, hidden=HIDDEN)
    data = write_jsonl(root / "data.jsonl", copy_task_rows(80))
    return PRESETS["cpu-small"].updated(
        model=model_dir, data=data, steps=STEPS, batch_size=2, seq_len=64, eval_every=2, eval_samples=4,
        exact_match_samples=0, timing_warmup_steps=1, lisa_interval_steps=1, lisa_activated_layers=2, lora_r=4,
    )


def test_lever_variants_change_one_setting_each(base):
    variants = sweep.lever_variants(base)
    labels = [v.label for v in variants]
    assert labels[0].endswith("(reference)") and len(labels) == len(set(labels))
    levers = {v.lever for v in variants}
    assert levers == {"reference", "E+H", "sampler", "γ", "K"}
    # γ=2 is the reference's, so only 1 and 4 appear as levers
    assert sorted(v.preset(base).lisa_activated_layers for v in variants if v.lever == "γ") == [1, 4]


@pytest.mark.slow  # a benchmark smoke run: sweeps of training runs
def test_eh_frozen_and_gamma_take_effect(base, tmp_path):
    variants = [v for v in sweep.lever_variants(base) if v.lever in ("reference", "E+H") or v.label == "γ=1"]
    results = {r["label"]: r for r in sweep.run_variants(base, variants, in_process=True, log=lambda m: None)}
    assert all(r["ok"] for r in results.values()), [r.get("error") for r in results.values()]
    reference, frozen, gamma1 = (results[v.label] for v in variants)
    block = adamw(BLOCK)
    assert [s["optimizer_state_bytes"] for s in reference["steps"]] == [adamw(OUTSIDE) + 2 * block] * STEPS
    # E+H frozen: the optimizer holds the two active blocks and nothing else, and fewer parameters train
    assert frozen["state_kind"] == "lisa-blocks"
    assert [s["optimizer_state_bytes"] for s in frozen["steps"]] == [2 * block] * STEPS
    assert frozen["optimizer_state"]["steps_equal_to_formula"] == STEPS
    assert frozen["params"]["trainable_max"] == sum(BLOCK) * 2
    assert [s["optimizer_state_bytes"] for s in gamma1["steps"]] == [adamw(OUTSIDE) + block] * STEPS

    report = {"date": "d", "command": "c", "study": "levers", "results": list(results.values())}
    table = sweep.render_levers(report)
    assert "E+H frozen" in table and "gain per GiB" in table
    sweep.plot(report, tmp_path / "levers.png")
    assert (tmp_path / "levers.png").stat().st_size > 0


@pytest.mark.slow  # a benchmark smoke run: sweeps of training runs
def test_fair_comparison_picks_each_methods_lowest_eval_loss(base, tmp_path):
    variants = [v for v in sweep.fair_variants(base, ["lisa"])][:2]
    results = sweep.run_variants(base, variants, in_process=True, log=lambda m: None)
    assert [r["learning_rate"] for r in results] == list(sweep.LR_GRID["full-parameter"][:2])
    best = sweep.best_per_method(results)["lisa"]
    assert best["evals"][-1][1] == min(r["evals"][-1][1] for r in results)
    # the eval loss at the run's whole training time is its final eval loss; before any step, the step-0 loss
    total = sum(s["seconds"] for s in best["steps"])
    assert sweep.eval_loss_at_time(best, total) == pytest.approx(best["evals"][-1][1])
    assert sweep.eval_loss_at_time(best, 0.0) == pytest.approx(best["evals"][0][1])
    table = sweep.render_fair({"date": "d", "command": "c", "results": results})
    assert f"| lisa | {sweep.LR_GRID['full-parameter'][0]:g}:" in table
    sweep.plot({"study": "fair-lr", "results": results}, tmp_path / "fair.png")
    assert (tmp_path / "fair.png").stat().st_size > 0


def test_an_unknown_method_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as info:
        sweep.main(["--study", "fair-lr", "--methods", "lora,qlora"])
    assert info.value.code == 2
    assert "--methods: unknown qlora; allowed: full, lora" in capsys.readouterr().err
