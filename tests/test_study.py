"""The study of issue 37 (``benchmarks/study.py``): its planner, one real run per method kind, and its report.

The planner is a function of the recorded results: it extends a grid outward while the best rate sits at an edge,
then plans the reported seeds and the diagnostics at that rate; a second invocation plans only what is missing, which
is what lets the study resume across sessions. The runs are real ``transformers.Trainer`` runs on a tiny llama.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_fixtures import build_tiny_lm_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import study  # noqa: E402
from benchmarks.study_report import interval, write_report  # noqa: E402


def _record(method: str, lr: float, seed: int, loss: float, preset: str = "cpu") -> dict:
    run = study.Run(method, lr, seed, preset)
    return {"key": run.key, "run": {"method": method, "lr": lr, "seed": seed, "preset": preset, "memory": None},
            "evals": [{"step": 300, "selection_loss": loss, "report_loss": loss + 0.01}]}


def test_the_grid_extends_until_the_best_rate_is_interior_then_the_seeds_run_at_it():
    lora = study.methods_for(300)["lora"]
    results = {}
    missing, best = study.grid_state(lora, "cpu", results)
    assert missing == [1e-4, 3e-4, 1e-3] and best is None
    # best at the top edge: the next rate up on the x3 ladder is planned
    for lr, loss in ((1e-4, 0.9), (3e-4, 0.7), (1e-3, 0.5)):
        results[study.Run("lora", lr, 0, "cpu").key] = _record("lora", lr, 0, loss)
    assert study.grid_state(lora, "cpu", results) == ([3e-3], None)
    # 3e-3 is worse: 1e-3 is now interior and decided
    results[study.Run("lora", 3e-3, 0, "cpu").key] = _record("lora", 3e-3, 0, 0.6)
    assert study.grid_state(lora, "cpu", results) == ([], 1e-3)
    planned = {run.key for run in study.plan("cpu", results)}
    assert {study.Run("lora", 1e-3, s, "cpu").key for s in (1, 2, 3, 4)} <= planned
    # the LoRA diagnostics run once, at LoRA's rate; seed 0 (which chose the rate) is not among the reported seeds
    assert {study.Run(name, 1e-3, 0, "cpu").key for name in ("lora-r4", "lora-r128", "lora-qv-r128")} <= planned
    assert study.Run("lora", 1e-3, 0, "cpu").key not in planned
    # a decided method's diagnostics, then its seeds, run before the grids still open (full's, here)
    order = [(run.method, run.seed) for run in study.plan("cpu", results)]
    first_grid = next(i for i, (name, _) in enumerate(order) if name == "full")
    assert order[:3] == [("lora-r4", 0), ("lora-r128", 0), ("lora-qv-r128", 0)]
    assert order[3:first_grid] == [("lora", s) for s in (1, 2, 3, 4)]


def test_a_method_out_of_its_regime_runs_its_grid_but_no_reported_seeds():
    """GaLore's projection gap (200) gives fewer than two updates in 300 steps: its grid runs, for the record, and once
    decided it is not ranked, so its reported seeds are not planned (BAdam, in its regime, gets them)."""
    results = {}
    for name in ("galore", "badam"):
        for lr, loss in ((1e-5, 0.5), (3e-5, 0.4), (1e-4, 0.45)):
            results[study.Run(name, lr, 0, "cpu").key] = _record(name, lr, 0, loss)
    assert study.grid_state(study.methods_for(300)["galore"], "cpu", results) == ([], 3e-5)
    planned = {(run.method, run.seed) for run in study.plan("cpu", results)}
    assert not {m for m, _ in planned} & {"galore"}
    assert {("badam", s) for s in (1, 2, 3, 4)} <= planned


def test_a_grid_whose_every_rate_failed_is_left_undecided_and_not_extended():
    full = study.methods_for(300)["full"]
    results = {study.Run("full", lr, 0, "cpu").key: {**_record("full", lr, 0, 0.0), "error": "boom"}
               for lr in full.grid}
    assert study.grid_state(full, "cpu", results) == ([], None)


def test_a_failure_of_the_machine_is_planned_again_a_bounded_number_of_times(tmp_path, monkeypatch, capsys):
    """A broken pipe (the parent restarted), a full disk or a kill is no result: before, it was recorded like a
    diverged rate (infinite loss) and could decide a grid. Now it is planned again, at most INFRASTRUCTURE_RETRIES
    times more, then left out and named; a failure of the method itself stays a result."""
    from benchmarks import study_run

    out = tmp_path / "s.jsonl"
    run = study.Run("lora", 1e-3, 0, "cpu")

    def broken_pipe(run, model_path, config):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(study_run, "_run", broken_pipe)
    with pytest.raises(SystemExit):
        study_run.run_one(run, out, None)
    assert run.key not in study.read_results(out) and study.infrastructure_failures(out) == {run.key: 1}
    assert run.key in {r.key for r in study.plan("cpu", study.read_results(out))}

    def diverged(run, model_path, config):
        raise FloatingPointError("loss is nan")

    monkeypatch.setattr(study_run, "_run", diverged)
    with pytest.raises(SystemExit):
        study_run.run_one(run, out, None)
    assert study.read_results(out)[run.key]["error"].startswith("FloatingPointError")
    assert study.selection_loss(study.read_results(out)[run.key]) == float("inf")

    # a run the machine keeps failing is left out after 1 + INFRASTRUCTURE_RETRIES tries, named, instead of looping
    other = tmp_path / "t.jsonl"
    for _ in range(study.INFRASTRUCTURE_RETRIES + 1):
        study.append_record(other, {"key": run.key, "run": {}, "infrastructure": True, "error": "killed by signal 9"})
    launched = []
    monkeypatch.setattr(study, "plan", lambda preset, results, config=None: [] if launched else [run])
    monkeypatch.setattr(study, "launch", lambda *a: launched.append(a))
    study.study("cpu", other, None, None, 1, memory=False)
    assert not launched
    assert f"left out after {study.INFRASTRUCTURE_RETRIES + 1} failures" in capsys.readouterr().out


def test_a_run_starts_as_soon_as_a_slot_frees(tmp_path, monkeypatch):
    """Two slots, three runs, the first two of unequal length: the third starts when the short one ends, not when the
    whole batch does (before, a 10-minute run waited on its 16-minute neighbour)."""
    import threading

    out = tmp_path / "s.jsonl"
    runs = [study.Run(m, 1e-3, 0, "cpu") for m in ("a", "b", "c")]
    length = {"a": 0.05, "b": 1.0, "c": 0.05}
    events, lock = [], threading.Lock()

    def launch(run, out_path, *args):
        with lock:
            events.append(("start", run.method))
        time.sleep(length[run.method])
        study.append_record(out_path, {"key": run.key, "run": {}})
        with lock:
            events.append(("end", run.method))

    monkeypatch.setattr(study, "plan", lambda preset, results, config=None: [r for r in runs if r.key not in results])
    monkeypatch.setattr(study, "launch", launch)
    study.study("cpu", out, None, None, 2, memory=False)
    assert events.index(("start", "c")) < events.index(("end", "b"))
    assert sorted(e for e in events if e[0] == "start") == [("start", m) for m in "abc"]  # each once


def test_the_rate_ladder_is_spaced_by_three():
    assert study._ladder(1e-3, up=True) == 3e-3 and study._ladder(3e-3, up=True) == 1e-2
    assert study._ladder(1e-5, up=False) == 3e-6 and study._ladder(3e-6, up=False) == 1e-6


def test_the_interval_is_students_t():
    mean, half = interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.182 * 1.2909944 / 2, rel=1e-4)


@pytest.mark.slow
def test_real_runs_record_losses_coverage_and_resume_from_the_file(tmp_path):
    model = build_tiny_lm_dir(tmp_path / "model", num_layers=4)
    out = tmp_path / "res" / "t.jsonl"
    for method in ("lora", "lisa-k5", "full", "lisa-adapter-k1"):
        run = json.dumps({"method": method, "lr": 3e-3, "seed": 0, "preset": "tiny"})
        subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "study.py"), "--preset", "tiny", "--model",
                        model, "--out", str(out), "--run-one", run], check=True, capture_output=True, cwd=tmp_path)
    records = study.read_results(out)
    assert len(records) == 4
    for record in records.values():
        assert [e["step"] for e in record["evals"]] == [0, 3, 6]
        # every method starts from the same weights and moves away from them
        assert record["evals"][0]["selection_loss"] == pytest.approx(records["tiny|full|0.003|0"]["evals"][0]["selection_loss"])
        assert record["evals"][-1]["selection_loss"] < record["evals"][0]["selection_loss"]
        assert 0.0 <= record["exact_match"] <= 1.0 and record["peak_rss_bytes"] > 0
    lisa = records["tiny|lisa-k5|0.003|0"]["coverage"]
    # γ = 2 blocks in each of 6 steps; K = 5 switches once, at step 5
    assert sum(lisa["steps_per_block"].values()) == 12 and 2 <= lisa["distinct_blocks"] <= 4
    assert records["tiny|lora|0.003|0"]["coverage"]["steps_per_block"] == {str(b): 6 for b in range(4)}
    # the sampled LISA adapter (γ = 2, K = T/10 = 1): two blocks' adapters in each of 6 steps, redrawn every step
    adapter = records["tiny|lisa-adapter-k1|0.003|0"]["coverage"]
    assert sum(adapter["steps_per_block"].values()) == 12 and adapter["distinct_blocks"] >= 3
    # the planner sees what ran: those three rates are not planned again
    planned = {run.key for run in study.plan("tiny", records)}
    assert not planned & set(records)
    report = write_report(out.parent, "t", "tiny")
    text = report.read_text()
    assert "| lisa-k5 | 0.003: " in text and "| full | 0.003: " in text


# -- the study as configs: benchmarks/configs/*.json read by one harness ------------------------------------------------
CONFIGS = REPO_ROOT / "benchmarks" / "configs"


def test_the_study_config_holds_the_studys_methods_and_presets():
    """The study's methods, grids and presets are data (benchmarks/configs/study.json); K = T/10 per preset."""
    config = study.load_config(CONFIGS / "study.json")
    assert config is not None and study.CONFIG.name == "study"
    methods = config.methods_for(300)
    assert list(methods) == ["lora", "full", "lisa-k5", "lisa-k30", "lisa-adapter-k30", "badam", "galore", "lora-r4",
                             "lora-r128", "lora-qv-r128", "lisa-eh-frozen", "lisa-g6"]
    assert methods["lora"].grid == (1e-4, 3e-4, 1e-3) and methods["full"].grid == (1e-5, 3e-5, 1e-4)
    assert methods["lisa-k30"].option("K") == 30 and methods["lisa-g6"].parent == "lisa-k30"
    assert config.methods_for(1000)["lisa-k100"].option("K") == 100  # the gpu preset's T/10
    assert (config.presets["cpu"].steps, config.presets["cpu"].seeds) == (300, (1, 2, 3, 4))
    assert [r.key for r in config.memory_runs("cpu")][:2] == ["cpu|lora|0.0003|0|mem1024-gc0",
                                                              "cpu|lora|0.0003|0|mem1024-gc1"]


def test_the_levers_config_plans_each_lever_once_beside_its_reference():
    """benchmarks/configs/levers.json (the retired sweep.py's levers): a fixed-rate reference and one change each,
    all at its rate and seed 0; nothing else, and no grid."""
    levers = study.load_config(CONFIGS / "levers.json")
    runs = study.plan("cpu", {}, levers)
    assert {(r.method, r.lr, r.seed) for r in runs} == {
        (name, 3e-4, 0) for name in ("lisa-reference", "lisa-eh-frozen", "lisa-importance", "lisa-cyclic", "lisa-g1",
                                     "lisa-g4", "lisa-k5", "lisa-k20", "lisa-k50")}
    assert levers.presets == study.CONFIG.presets and levers.memory is None  # extends study.json, no memory table
    assert levers.methods_for(300)["lisa-cyclic"].option("sampling") == "cyclic"


@pytest.mark.parametrize("change, words", [
    ({"colour": 1}, "unknown key(s) colour; allowed:"),
    ({"task": "poetry"}, "task='poetry' is invalid; allowed: instructions"),
    ({"methods": [{"name": "x", "kind": "qlora", "grid": "adapter"}]}, "methods[x].kind='qlora' is invalid; allowed:"),
    ({"methods": [{"name": "x", "kind": "lora", "grid": "adapter", "lr": 1e-3}]},
     "methods[x]: give exactly one of grid, lr, parent (given: grid, lr)"),
    ({"methods": [{"name": "x", "kind": "lora", "grid": "huge"}]},
     "methods[x].grid='huge' is invalid; allowed: adapter"),
    ({"methods": [{"name": "x", "kind": "lora", "parent": "y"}]}, "methods[x].parent='y' is invalid"),
    ({"methods": [{"name": "x", "kind": "lora", "lr": 1e-3, "rank": 4}]}, "methods[x]: unknown key(s) rank"),
])
def test_a_wrong_config_is_refused_naming_the_key(tmp_path, change, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"extends": str(CONFIGS / "study.json"), **change}))
    with pytest.raises(ValueError) as err:
        study.load_config(path)
    assert words in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("change, words", [
    ({"protocol": "tournament"}, "protocol='tournament' is invalid; allowed: study, side-by-side"),
    ({"grids": {}}, "unknown key(s) grids; allowed:"),
    ({"run": "everything"}, "run='everything' is invalid; allowed: default, peers"),
    ({"sets": {"default": ["lora", "qlora"]}}, "sets.default: unknown method(s) qlora"),
    ({"presets": {"cpu-small": {"stepz": 3}}}, "presets.cpu-small: unknown key(s) stepz"),
    ({"methods": [{"name": "x", "train_method": "lora", "family": "adapter", "rank": 4}]},
     "methods[x]: unknown key(s) rank"),
    ({"methods": [{"name": "x", "train_method": "lora", "family": "adaptor"}]},
     "methods[x].family='adaptor' is invalid; allowed: full-parameter, adapter"),
    ({"checks": [{"claim": "c", "method": "lisa", "against": "lorra", "metric": "tokens_per_second", "at_least": 1}]},
     "checks[0].against='lorra' is invalid; allowed: a method of this config"),
    ({"checks": [{"claim": "c", "method": "lisa", "against": "lora", "metric": "speed", "at_least": 1}]},
     "checks[0].metric='speed' is invalid; allowed: tokens_per_second"),
])
def test_a_wrong_side_by_side_config_is_refused_naming_the_key(tmp_path, change, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"extends": str(CONFIGS / "bench.json"), **change}))
    with pytest.raises(ValueError) as err:
        study.load_config(path)
    assert words in str(err.value) and str(path) in str(err.value)


def test_the_side_by_side_configs_hold_the_benchmarks_methods_and_sets():
    bench, peers = study.load_config(CONFIGS / "bench.json"), study.load_config(CONFIGS / "peers.json")
    assert bench.protocol == peers.protocol == "side-by-side"
    assert bench.presets["cpu-small"].methods == ("full", "lora", "lisa", "lisa-naive", "lisa-adapter",
                                                  "lisa-adapter-sparse", "lisa-adapter-interp")
    assert peers.presets["cpu-small"].methods == ("full", "lora", "dora", "lisa", "lisa-naive", "lisa-adapter",
                                                  "badam", "galore")
    assert bench.methods == peers.methods and bench.methods["badam"].peer == "badam"
    assert (bench.presets["cpu-small"].steps, bench.presets["cpu-small"].lisa_interval_steps) == (40, 5)
    assert peers.results == "{date}-{machine}-peers"


def test_the_command_refuses_a_bad_config_or_preset_before_running_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        study.main(["--config", str(tmp_path / "missing.json"), "--results-dir", str(tmp_path)])
    assert "--config:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--config", str(CONFIGS / "levers.json"), "--preset", "huge", "--results-dir", str(tmp_path)])
    assert "--preset='huge' is invalid; allowed: cpu, gpu, tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--config", str(CONFIGS / "levers.json"), "--memory", "--results-dir", str(tmp_path)])
    assert "has no memory table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--config", str(CONFIGS / "levers.json"), "--set", "steps=3", "--results-dir", str(tmp_path)])
    assert "--set: options of the side-by-side protocol" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_config_of_its_own_runs_through_the_same_harness(tmp_path):
    """The levers config's cyclic lever on the tiny preset, one real run through ``--config``: the sampling option
    reaches LisaCallback (cyclic order trains each of 4 blocks in exactly 3 of 6 steps at γ = 2, K = 1), and the
    report is titled by the config."""
    model = build_tiny_lm_dir(tmp_path / "model", num_layers=4)
    out = tmp_path / "res" / "levers-tiny.jsonl"
    run = json.dumps({"method": "lisa-cyclic", "lr": 3e-4, "seed": 0, "preset": "tiny"})
    subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "study.py"), "--config",
                    str(CONFIGS / "levers.json"), "--preset", "tiny", "--model", model, "--out", str(out),
                    "--run-one", run], check=True, capture_output=True, cwd=tmp_path)
    record = study.read_results(out)["tiny|lisa-cyclic|0.0003|0"]
    assert record["coverage"]["steps_per_block"] == {str(b): 3 for b in range(4)}
    assert record["evals"][-1]["selection_loss"] != record["evals"][0]["selection_loss"]
    levers = study.load_config(CONFIGS / "levers.json")
    text = write_report(out.parent, "levers-tiny", "tiny", levers).read_text()
    assert text.startswith("# Study levers") and "--config benchmarks/configs/levers.json" in text
    assert "| lisa-reference | fixed by the config | 0.0003 |" in text
