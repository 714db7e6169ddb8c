"""The benchmark's memory variants of full-parameter LISA on a tiny llama: AdamW stepped in the backward pass, and
bitsandbytes' 8-bit AdamW with the E/H state at 32 bits (the Trainer's choice) or in 8 bits; each method's measured
optimizer state against its formula from shapes, computed here from the config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import study  # noqa: E402

pytestmark = pytest.mark.slow  # a benchmark smoke run: five methods trained (~10 s)

LAYERS, HIDDEN, VOCAB, STEPS, GAMMA = 4, 32, 128, 4, 2
INTERMEDIATE, KV = 2 * HIDDEN, 2 * (HIDDEN // 4)
OUTSIDE = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN]  # embed_tokens, lm_head (untied), final norm
BLOCK = [HIDDEN * HIDDEN, KV * HIDDEN, KV * HIDDEN, HIDDEN * HIDDEN, INTERMEDIATE * HIDDEN, INTERMEDIATE * HIDDEN,
         HIDDEN * INTERMEDIATE, HIDDEN, HIDDEN]


def adamw(numels):
    return sum(8 * n + 4 for n in numels)


def adamw8bit(numels, fp32=()):
    """bitsandbytes: tensors of 4096+ elements in 8 bits (+ absmax per 256 values + two 256-float code books)."""
    return sum(8 * n if n < 4096 or i in fp32 else 2 * n + 8 * -(-n // 256) + 2 * 1024 for i, n in enumerate(numels))


def test_memory_variants_of_lisa(tmp_path):
    methods = ["lisa", "lisa-fused"]
    if _has_bitsandbytes():  # the 8-bit variants need the optional bitsandbytes
        methods += ["lisa-adamw8bit", "lisa-adamw8bit-eh", "lisa-fused-8bit"]
    model_dir = build_tiny_lm_dir(tmp_path / "model", num_layers=LAYERS, hidden=HIDDEN)
    data = write_jsonl(tmp_path / "data.jsonl", copy_task_rows(60))
    settings = {"data": data, "steps": STEPS, "batch_size": 2, "seq_len": 64, "eval_every": 2, "eval_samples": 4,
                "lisa_interval_steps": 2, "lisa_activated_layers": GAMMA, "timing_warmup_steps": 1}
    report = study.main([
        "--config", str(REPO_ROOT / "benchmarks" / "configs" / "bench.json"), "--methods", ",".join(methods),
        "--model", model_dir, *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")],
        "--results-dir", str(tmp_path / "out"), "--name", "memory", "--in-process"])
    results = {r["method"]: r for r in report["results"]}
    assert all(r["ok"] for r in results.values()), [r.get("error") for r in results.values()]
    for r in results.values():  # measured state equals the formula at every step
        assert r["optimizer_state"]["steps_equal_to_formula"] == STEPS, r["method"]
    states = {name: r["optimizer_state"]["max_bytes"] for name, r in results.items()}
    assert states["lisa-fused"] == states["lisa"] == adamw(OUTSIDE) + GAMMA * adamw(BLOCK)
    fused = results["lisa-fused"]
    assert fused["optimizer"] == {"optim": "adamw_torch", "max_grad_norm": 0.0, "step_in_backward": True}
    assert results["lisa"]["optimizer"]["step_in_backward"] is False
    if "lisa-adamw8bit" in results:
        # the Trainer keeps nn.Embedding weights at 32 bits; the untied head (a Linear) goes to 8 bits
        assert states["lisa-adamw8bit"] == adamw8bit(OUTSIDE, fp32={0}) + GAMMA * adamw8bit(BLOCK)
        assert states["lisa-adamw8bit-eh"] == adamw8bit(OUTSIDE) + GAMMA * adamw8bit(BLOCK)
        assert states["lisa-adamw8bit-eh"] < states["lisa-adamw8bit"] < states["lisa"]
        # the same 8-bit state stepped in the backward pass (the update bit for bit bitsandbytes')
        assert states["lisa-fused-8bit"] == states["lisa-adamw8bit-eh"]
        assert results["lisa-fused-8bit"]["optimizer"] == {"optim": "adamw_bnb_8bit", "max_grad_norm": 0.0,
                                                           "step_in_backward": True}
        markdown = Path(report["paths"]["markdown"]).read_text()
        assert "bitsandbytes 8-bit AdamW, E/H state at 32 bits" in markdown
        assert "`lisa-adamw8bit` optim=adamw_bnb_8bit" in markdown


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True
