"""Smoke test of the side-by-side protocol (``benchmarks/study.py --config benchmarks/configs/bench.json``) on a tiny llama built from config, so that the benchmark cannot rot.

The values checked are the ones the README quotes: the optimizer-state bytes of each method against closed forms
computed here from the config alone (not from the benchmark's own inventory), and the table that reports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import study  # noqa: E402
from benchmarks.presets import DEFAULT_METHODS  # noqa: E402
from benchmarks.report import render_markdown  # noqa: E402

pytestmark = pytest.mark.slow  # benchmark smoke runs: every method trained, in this process and one process each

LAYERS, HIDDEN, VOCAB = 4, 32, 128
INTERMEDIATE, KV = 2 * HIDDEN, 2 * (HIDDEN // 4)  # 4 heads, 2 kv heads of head_dim 8
STEPS, GAMMA, K, RANK = 4, 2, 1, 4


def adamw(numels: list[int]) -> int:
    """AdamW state of fp32 tensors: two moments + a 4-byte step counter each."""
    return sum(8 * n + 4 for n in numels)


# parameter tensors of the tiny llama, from its config
OUTSIDE = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN]  # embed_tokens, lm_head (untied), final norm
BLOCK = [HIDDEN * HIDDEN, KV * HIDDEN, KV * HIDDEN, HIDDEN * HIDDEN,  # q k v o
         INTERMEDIATE * HIDDEN, INTERMEDIATE * HIDDEN, HIDDEN * INTERMEDIATE, HIDDEN, HIDDEN]  # gate up down, 2 norms
LINEARS = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
           (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # (in, out)
LORA_BLOCK = [n for fan_in, fan_out in LINEARS for n in (RANK * fan_in, fan_out * RANK)]  # A, B


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model_dir = build_tiny_lm_dir(root / "model", num_layers=LAYERS, hidden=HIDDEN)
    data = write_jsonl(root / "data.jsonl", copy_task_rows(80))
    return root, model_dir, data


BENCH = str(REPO_ROOT / "benchmarks" / "configs" / "bench.json")


def common_args(model_dir, data, out, steps=STEPS):
    settings = {"data": data, "steps": steps, "batch_size": 2, "seq_len": 64, "eval_every": 2, "eval_samples": 4,
                "lisa_interval_steps": K, "lisa_activated_layers": GAMMA, "lora_r": RANK, "timing_warmup_steps": 1}
    return ["--config", BENCH, "--model", model_dir, "--results-dir", str(out), "--name", "smoke",
            *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]]


def test_every_method_matches_its_optimizer_state_formula_and_the_table_reports_it(tiny_setup):
    root, model_dir, data = tiny_setup
    out = root / "in_process"
    report = study.main(common_args(model_dir, data, out) + ["--in-process"])
    results = {r["method"]: r for r in report["results"]}
    assert list(results) == list(DEFAULT_METHODS)
    assert all(r["ok"] for r in results.values()), [r.get("error") for r in results.values()]

    for r in results.values():
        assert [s["step"] for s in r["steps"]] == list(range(1, STEPS + 1))
        assert [s for s, _ in r["evals"]] == [0, 2, 4]
    # every method starts from the same function: adapters start at zero, interpolation at alpha=1, beta=0
    start = {name: r["evals"][0][1] for name, r in results.items()}
    assert max(start.values()) - min(start.values()) < 1e-5, start

    def states(name):
        return [s["optimizer_state_bytes"] for s in results[name]["steps"]]

    eh = adamw(OUTSIDE)
    block = adamw(BLOCK)
    assert states("full") == [eh + LAYERS * block] * STEPS
    # LISA: exactly E+H+γL after every step, while the active blocks change every step (K = 1)
    assert states("lisa") == [eh + GAMMA * block] * STEPS
    lisa_sets = [tuple(s["active_blocks"]) for s in results["lisa"]["steps"]]
    assert len(set(lisa_sets)) > 1 and all(len(b) == GAMMA for b in lisa_sets)
    assert results["lisa"]["params"]["trainable_max"] == sum(OUTSIDE) + GAMMA * sum(BLOCK)
    # the naive callback keeps the state of every block it ever activated
    seen, expected = set(), []
    for step in results["lisa-naive"]["steps"]:
        seen.update(step["active_blocks"])
        expected.append(eh + len(seen) * block)
    assert states("lisa-naive") == expected
    assert expected[-1] > expected[0]
    assert states("lora") == [LAYERS * adamw(LORA_BLOCK)] * STEPS
    assert results["lora"]["params"]["trainable_max"] == LAYERS * sum(LORA_BLOCK)
    assert states("lisa-adapter") == [GAMMA * adamw(LORA_BLOCK)] * STEPS
    # a fresh sparse layer's first mask is scored before the first optimizer step: it trains, and holds state, from it
    sparse = states("lisa-adapter-sparse")
    assert sparse == [GAMMA * adamw(LORA_BLOCK)] * STEPS
    assert all(s <= GAMMA * adamw(LORA_BLOCK) for s in sparse)
    # interpolation: delta and beta, one entry per block each, train throughout
    assert states("lisa-adapter-interp") == [GAMMA * adamw(LORA_BLOCK) + adamw([LAYERS, LAYERS])] * STEPS
    for r in results.values():
        assert r["optimizer_state"]["max_abs_diff_from_formula"] == 0
        assert r["optimizer_state"]["steps_equal_to_formula"] == STEPS
        floor = r["floor"]
        assert floor["total_bytes"] == (floor["weights_bytes"] + floor["grad_bytes"] + floor["optimizer_state_bytes"]
                                        + floor["activation_bytes"])
        assert r["timing"]["median_step_seconds"] > 0 and r["timing"]["tokens_per_second"] > 0
        # the activation estimate from the config against what autograd actually saved in one step
        probe = floor["activation_probe"]
        assert probe["step"] == 2, probe
        assert abs(probe["measured_bytes"] / probe["estimate_bytes"] - 1) < 0.1, (r["method"], probe)

    # outputs: the markdown is the JSON rendered, and it carries the numbers checked above
    paths = report["paths"]
    for key in ("markdown", "json", "eval_loss_plot", "optimizer_state_plot"):
        assert os.path.getsize(paths[key]) > 0
    with open(paths["json"]) as f:
        saved = json.load(f)
    markdown = Path(paths["markdown"]).read_text()
    assert render_markdown(saved) == markdown
    lisa_mib = (eh + GAMMA * block) / 2**20
    assert f"| `lisa` | E+H+norm + γ blocks (E+H+γL) | {lisa_mib:.3f} | {STEPS}/{STEPS} | 0 |" in markdown
    ratio_row = next(line for line in markdown.splitlines() if line.startswith("| `lora` | 1.00× |"))
    assert ratio_row.count("|") == 12  # method + 5 metrics × (vs lora, vs full)
    assert "exactly the E+H+γL optimizer state at 4 of 4 steps" in markdown


def test_cli_runs_each_method_in_its_own_process(tiny_setup, capsys):
    root, model_dir, data = tiny_setup
    out = root / "subprocess"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "study.py"), "--methods", "lisa"]
        + common_args(model_dir, data, out, steps=2),
        cwd=str(root), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## Memory, speed and quality" in proc.stdout  # the table goes to stdout, progress to stderr
    report = json.loads((out / "smoke.json").read_text())
    (result,) = report["results"]
    assert result["ok"] and not result["in_process"]
    assert [s["optimizer_state_bytes"] for s in result["steps"]] == [adamw(OUTSIDE) + GAMMA * adamw(BLOCK)] * 2
    memory = result["memory"]
    # a fresh process: the training peak holds at least the weights, above what the process held before the model
    if memory["peak_scope"] == "training":
        assert memory["peak_rss_bytes"] - memory["rss_before_model_bytes"] >= result["floor"]["weights_bytes"]

    # the records are the results: the same command again reports them and trains nothing; other settings are refused
    again = study.main(["--methods", "lisa"] + common_args(model_dir, data, out, steps=2))
    assert again["results"] == report["results"]
    with pytest.raises(SystemExit):
        study.main(["--methods", "lisa"] + common_args(model_dir, data, out, steps=3))
    assert "holds runs made with other settings (steps)" in capsys.readouterr().err
    # a failed method runs again on the next command (its later record wins), as after a fix
    failed = {**result, "ok": False, "error": "RuntimeError: as a failed run records it"}
    with open(out / "smoke.jsonl", "a") as f:
        f.write(json.dumps(failed) + "\n")
    rerun = study.main(["--methods", "lisa", "--in-process"] + common_args(model_dir, data, out, steps=2))
    (again,) = rerun["results"]
    assert again["ok"] and again["in_process"] and len((out / "smoke.jsonl").read_text().splitlines()) == 3


def test_a_wrong_setting_or_method_is_refused_naming_it(tiny_setup, capsys):
    root, model_dir, data = tiny_setup
    for extra, named in ((["--set", "stepz=3"], "stepz"), (["--set", "steps=0"], "steps=0"),
                         (["--methods", "lisa,lorra"], "lorra"), (["--memory"], "--memory")):
        with pytest.raises(SystemExit):
            study.main(common_args(model_dir, data, root / "refused") + extra)
        assert named in capsys.readouterr().err
    assert not (root / "refused").exists()  # nothing was written
