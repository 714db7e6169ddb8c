"""LISA's peers in the side-by-side benchmark (``benchmarks/configs/peers.json``): BAdam (``badam``) and GaLore (``galore-torch``) from the package index,
each in a plain ``transformers.Trainer`` as its docs say, on a tiny llama built from config, a handful of steps.

The values checked come from the config alone: each peer's optimizer state at every step, which parameters its steps
move (BAdam: exactly the active block's; GaLore: every parameter, with a rank-r update on its target linears), and the
side-by-side table with its ratios against LoRA and full fine-tuning. A peer's upgrade that changes any of these
fails here. A last test runs the methods no other benchmark test runs, so every method of the harness is covered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import side_by_side, study  # noqa: E402
from benchmarks.peers import package_version  # noqa: E402
from benchmarks.presets import DEFAULT_METHODS, METHODS, PEER_COMPARISON  # noqa: E402

pytestmark = pytest.mark.slow  # benchmark smoke runs: several methods trained in this process (seconds)

LAYERS, HIDDEN, VOCAB = 4, 32, 128
INTERMEDIATE, KV = 2 * HIDDEN, 2 * (HIDDEN // 4)  # 4 heads, 2 kv heads of head_dim 8
STEPS, K, RANK = 6, 2, 4
OUTSIDE = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN]  # embed_tokens, lm_head (untied), final norm
NORMS = [HIDDEN, HIDDEN]  # per block
LINEARS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # q k v o as (out, in)
           (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # gate up down
BLOCK = [m * n for m, n in LINEARS] + NORMS


def adamw(numels):
    """torch AdamW on fp32 tensors: two moments + a 4-byte step tensor each."""
    return sum(8 * n + 4 for n in numels)


def galore():
    """galore-torch 1.0 AdamW, fp32: moments of r x max(m, n) and the min(m, n)^2 SVD factor the rank-r basis is a
    view of, per attention/MLP linear; two plain moments for everything else; the step is a Python int."""
    targets = sum(2 * RANK * max(m, n) * 4 + min(m, n) ** 2 * 4 for m, n in LINEARS)
    return sum(8 * n for n in OUTSIDE) + LAYERS * (targets + sum(8 * n for n in NORMS))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    model_dir = build_tiny_lm_dir(root / "model", num_layers=LAYERS, hidden=HIDDEN)
    data = write_jsonl(root / "data.jsonl", copy_task_rows(80))
    return root, model_dir, data


SETTINGS = {"steps": STEPS, "batch_size": 2, "seq_len": 64, "eval_every": 3, "eval_samples": 4,
            "lisa_interval_steps": K, "lisa_activated_layers": 2, "lora_r": RANK, "timing_warmup_steps": 1}


def bench_args(model_dir, data, out, methods):
    return ["--config", str(REPO_ROOT / "benchmarks" / "configs" / "peers.json"), "--methods", methods,
            "--model", model_dir, "--set", f"data={data}", "--results-dir", str(out), "--name", "peers",
            "--in-process", *[arg for key, value in SETTINGS.items() for arg in ("--set", f"{key}={value}")]]


class WeightWatch(TrainerCallback):
    """Records, per optimizer step, the change of every parameter (a copy at ``on_step_begin``, the difference at
    ``on_step_end``): what the step moved, whatever the optimizer believes it trains."""

    def __init__(self) -> None:
        self.deltas: list[dict[str, torch.Tensor]] = []
        self._before: dict[str, torch.Tensor] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.deltas.append({n: p.detach() - self._before[n] for n, p in model.named_parameters()})


def run_watched(method, model_dir, data, tmp_path):
    config = study.load_config(REPO_ROOT / "benchmarks" / "configs" / "peers.json")
    preset = side_by_side.resolve_preset(config, "cpu-small", {**SETTINGS, "data": data}, model_dir)
    watch = WeightWatch()
    result = side_by_side.run_method(method, preset, str(tmp_path), extra_callbacks=[watch], methods=config.methods)
    assert result["ok"], result.get("error")
    return result, watch.deltas


def moved(delta: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, d in delta.items() if d.abs().max() > 0}


def test_badam_trains_one_block_at_a_time_and_holds_only_its_state(tiny, tmp_path):
    _, model_dir, data = tiny
    result, deltas = run_watched("badam", model_dir, data, tmp_path)
    blocks = [s["active_blocks"] for s in result["steps"]]
    assert all(len(b) == 1 for b in blocks), blocks
    for step, (active, delta) in enumerate(zip(blocks, deltas), start=1):
        prefix = f"model.layers.{active[0]}."
        # exactly the active block's nine tensors moved; the embeddings, the head and the final norm never do
        assert moved(delta) == {n for n in delta if n.startswith(prefix)}, (step, sorted(moved(delta)))
        assert len(moved(delta)) == len(BLOCK)
    # BAdam 1.4 switches after the step s where (s + 1) % K == 0 (the first block gets K - 1 steps), to the next block
    # of a random order: with 6 steps and K = 2, blocks for steps 1 | 2 3 | 4 5 | 6, one permutation of the 4 blocks
    windows = [blocks[0], blocks[1], blocks[3], blocks[5]]
    assert blocks[1] == blocks[2] and blocks[3] == blocks[4]
    assert sorted(b[0] for b in windows) == list(range(LAYERS))
    # its state right after each AdamW step: one block's, on its fp32 copy (which the results report beside it)
    assert [s["optimizer_state_bytes"] for s in result["steps"]] == [adamw(BLOCK)] * STEPS
    assert [s["master_copy_bytes"] for s in result["steps"]] == [4 * sum(BLOCK)] * STEPS
    assert result["optimizer_state"]["steps_equal_to_formula"] == STEPS
    assert result["params"]["trainable_max"] == sum(BLOCK)
    assert result["peer"]["package"] == "badam" and result["peer"]["version"] == package_version("badam")
    assert result["peer"]["settings"]["switch_block_every"] == K
    assert result["optimizer"]["optim"] == "badam.BlockOptimizer(torch.optim.AdamW)"
    assert result["evals"][-1][1] < result["evals"][0][1]


def test_galore_projects_its_target_linears_to_rank_r_and_trains_the_rest_in_full(tiny, tmp_path):
    _, model_dir, data = tiny
    result, deltas = run_watched("galore", model_dir, data, tmp_path)
    for delta in deltas:
        assert moved(delta) == set(delta)  # every parameter trains
        for name, d in delta.items():
            # float32 rounding of W + ΔW adds noise ~1e-7 |W| in every direction: count singular values > 1e-3 σ_max
            rank = int(torch.linalg.matrix_rank(d.double(), rtol=1e-3)) if d.dim() == 2 else None
            if ".self_attn." in name or ".mlp." in name:  # GaLore's targets: the update is projected back from rank r
                assert rank <= RANK, (name, rank)
            elif d.dim() == 2:  # embeddings, head: plain AdamW, a full-rank update
                assert rank > RANK, (name, rank)
    assert [s["optimizer_state_bytes"] for s in result["steps"]] == [galore()] * STEPS
    assert result["optimizer_state"]["steps_equal_to_formula"] == STEPS
    assert result["training_overrides"]["optim"] == "galore_adamw"
    assert result["training_overrides"]["optim_args"] == f"rank={RANK}, update_proj_gap={K}, scale=1"
    assert result["peer"]["version"] == package_version("galore")
    assert result["evals"][-1][1] < result["evals"][0][1]


def test_the_peer_comparison_is_one_table_with_ratios_against_lora_and_full(tiny, tmp_path):
    _, model_dir, data = tiny
    report = study.main(bench_args(model_dir, data, tmp_path, "peers"))
    assert [r["method"] for r in report["results"]] == list(PEER_COMPARISON)
    assert all(r["ok"] for r in report["results"]), [r.get("error") for r in report["results"]]
    markdown = Path(report["paths"]["markdown"]).read_text()
    ratios = markdown.split("## Ratios")[1].split("\n## ")[0].splitlines()
    for peer, package in (("badam", "badam"), ("galore", "galore-torch")):
        row = next(line for line in ratios if line.startswith(f"| `{peer}` | "))
        assert row.count("|") == 12, row  # method + 5 metrics x (vs lora, vs full)
        assert f"**Peer `{peer}`:** {package} {package_version(peer)} in a plain `transformers.Trainer`" in markdown
    states = {r["method"]: r["optimizer_state"]["max_bytes"] for r in report["results"]}
    assert states["badam"] == adamw(BLOCK) and states["galore"] == galore()
    assert states["full"] == adamw(OUTSIDE) + LAYERS * adamw(BLOCK)
    assert "`lisa` vs `badam`:" in markdown and "`lisa` vs `galore`:" in markdown


#: the benchmark methods the other tests run: DEFAULT_METHODS (test_benchmark_smoke.py), the LISA memory variants
#: (test_memory_benchmark.py), the peers (above)
COVERED_ELSEWHERE = {*DEFAULT_METHODS, "lisa-fused", "lisa-adamw8bit", "lisa-adamw8bit-eh", "lisa-fused-8bit",
                     "badam", "galore"}


def test_every_method_of_the_harness_runs_on_a_tiny_model(tiny, tmp_path):
    _, model_dir, data = tiny
    rest = [m for m in METHODS if m not in COVERED_ELSEWHERE]
    if any(METHODS[m].model_overrides for m in rest):
        pytest.importorskip("bitsandbytes")  # the 4-bit and 8-bit bases
    report = study.main(bench_args(model_dir, data, tmp_path, ",".join(rest)))
    assert [r["method"] for r in report["results"]] == rest
    for r in report["results"]:
        assert r["ok"], (r["method"], r.get("error"))
        assert r["optimizer_state"]["steps_equal_to_formula"] == STEPS, r["method"]
        assert r["evals"][-1][1] < r["evals"][0][1], r["method"]


GPU_CHECK = str(REPO_ROOT / "benchmarks" / "configs" / "gpu-check.json")


def test_the_gpu_check_plans_the_peer_comparison_and_refuses_without_a_gpu(tmp_path, capsys):
    assert study.main(["--config", GPU_CHECK, "--dry-run", "--results-dir", str(tmp_path)]) is None
    plan = capsys.readouterr().out
    assert f"would run, each method in its own process: {', '.join(PEER_COMPARISON)}" in plan
    assert "steps=100" in plan and "device=cuda" in plan and "bf16=True" in plan
    assert "then the check: LISA tokens/s >= 1.5 x LoRA's" in plan
    if not torch.cuda.is_available():  # the CI machines: nothing run, said so, nothing written
        with pytest.raises(SystemExit):
            study.main(["--config", GPU_CHECK, "--results-dir", str(tmp_path)])
        assert "device=cuda, and torch" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_gpu_check_judges_its_claim_only_on_the_gpu(tiny, tmp_path):
    _, model_dir, data = tiny
    settings = {**SETTINGS, "data": data, "device": "cpu", "bf16": False, "exact_match_samples": 0}
    report = study.main(["--config", GPU_CHECK, "--methods", "lisa,lora", "--model", model_dir, "--in-process",
                         "--results-dir", str(tmp_path), "--name", "check",
                         *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]])
    speed = {r["method"]: r["timing"]["tokens_per_second"] for r in report["results"]}
    (check,) = report["checks"]
    assert check["ratio"] == speed["lisa"] / speed["lora"]
    assert check["passed"] is None and check["why"] == "not judged: measured on cpu, the claim is for cuda"
    assert side_by_side.exit_status(report) == 0
    markdown = (tmp_path / "check.md").read_text()
    assert f"- LISA tokens/s >= 1.5 x LoRA's (the LISA paper's speed claim): measured {check['ratio']:.2f}×" in markdown
    # judged where it was measured: the verdict, and the exit status of a failed claim
    failed = side_by_side.judge([{**check, "device": "cpu", "at_least": check["ratio"] * 2}], report["results"])
    assert failed[0]["passed"] is False
    assert side_by_side.exit_status({**report, "checks": failed}) == side_by_side.CHECK_FAILED
