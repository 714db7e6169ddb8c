"""The study's memory table (benchmarks/study_memory.py) and the GPU protocol (benchmarks/gpu_protocol.sh), run for
real on CPU at the tiny shape: every row trains through a plain Trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import study_memory  # noqa: E402

PROTOCOL = REPO_ROOT / "benchmarks" / "gpu_protocol.sh"


def records(path: Path) -> dict[str, dict]:
    return {r["key"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The whole tiny table, every row in this process, at two lengths."""
    out = tmp_path_factory.mktemp("memory") / "memory-tiny.jsonl"
    summary = study_memory.main(["--shape", "tiny", "--lengths", "32,48", "--in-process", "--out", str(out)])
    return out, summary


@pytest.mark.slow
def test_a_row_for_each_method_checkpointing_and_length(table):
    out, summary = table
    found = records(out)
    expected = {f"tiny|{m}|L{n}|gc{gc}" for m in ("lora", "lisa", "full") for n in (32, 48) for gc in (0, 1)}
    assert set(found) == expected and sorted(summary["ran"]) == sorted(expected)
    for key, r in found.items():
        assert r["status"] == "ok", r.get("traceback")
        assert r["checkpointing_on"] == r["row"]["checkpointing"], key  # the Trainer really turned it on (or off)
        assert len(r["step_s"]) == 4 and r["peak_bytes"] > 0 and r["median_step_s"] > 0, key
        assert all(g > 0 for g in r["grad_norms"]), key  # something trained at every step, with checkpointing too
    # checkpointing recomputes the same forward: same data and seed, the same first gradient norm
    for m in ("lora", "lisa", "full"):
        off, on = found[f"tiny|{m}|L32|gc0"], found[f"tiny|{m}|L32|gc1"]
        assert on["grad_norms"][0] == pytest.approx(off["grad_norms"][0], rel=1e-4), m


@pytest.mark.slow
def test_lisa_trains_embeddings_head_norm_and_two_blocks(table):
    """When training begins (after LisaCallback's on_train_begin), LISA trains E + H + the final norm + γ=2 blocks of
    the tiny model: not every weight (full), not the blocks alone, not LoRA's adapters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**study_memory.TINY))
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    block = count(model.model.layers[0])
    e_h_norm = count(model.model.embed_tokens) + count(model.lm_head) + count(model.model.norm)
    assert model.model.embed_tokens.weight.data_ptr() != model.lm_head.weight.data_ptr()  # untied: E and H both count
    found = records(table[0])
    lisa = found["tiny|lisa|L32|gc0"]
    assert lisa["trainable_at_begin"] == e_h_norm + 2 * block == lisa["trainable_max"]
    assert found["tiny|full|L32|gc0"]["trainable_at_begin"] == count(model) == lisa["total_params"]
    lora = found["tiny|lora|L32|gc0"]["trainable_at_begin"]
    hidden, inter, kv = 32, 64, 16  # LoRA r=16 on q, k, v, o, gate, up, down of 4 blocks
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter),
              (inter, hidden)]
    assert lora == 4 * sum(16 * (i + o) for i, o in shapes)
    del torch


@pytest.mark.slow
def test_a_rerun_skips_recorded_rows_and_the_table_comes_from_the_jsonl(table, tmp_path):
    out, _ = table
    before = out.read_text()
    again = study_memory.main(["--shape", "tiny", "--lengths", "32,48", "--in-process", "--out", str(out)])
    assert again["ran"] == [] and len(again["skipped"]) == 12 and out.read_text() == before
    # one more length: only its rows run
    copy = tmp_path / "memory-tiny.jsonl"
    copy.write_text(before)
    more = study_memory.main(["--shape", "tiny", "--lengths", "32,48,16", "--methods", "lisa", "--in-process",
                              "--out", str(copy)])
    assert sorted(more["ran"]) == ["tiny|lisa|L16|gc0", "tiny|lisa|L16|gc1"] and len(records(copy)) == 14
    # the table is written from the JSONL alone: a row edited there shows in the table
    lines = before.splitlines()
    edited = json.loads(lines[0])
    edited["trainable_at_begin"] = 123456789
    copy.write_text("\n".join([json.dumps(edited), *lines[1:]]) + "\n")
    study_memory.main(["--table", "--out", str(copy)])
    md = copy.with_suffix(".md").read_text()
    assert "123,456,789" in md and md.count("\n| ") == 1 + 12  # header + one line per row
    assert "| 32 | lisa | on |" in md and "| 48 | full | off |" in md


@pytest.mark.slow
def test_a_row_in_its_own_process_and_the_budget(tmp_path):
    """The default: each row in a fresh process; a row still running at the budget is stopped, not recorded."""
    out = tmp_path / "m.jsonl"
    study_memory.main(["--shape", "tiny", "--lengths", "16", "--methods", "lisa", "--out", str(out)])
    found = records(out)
    assert sorted(found) == ["tiny|lisa|L16|gc0", "tiny|lisa|L16|gc1"]
    assert all(r["status"] == "ok" and r["trainable_at_begin"] < r["total_params"] for r in found.values())
    started = time.time()
    cut = study_memory.main(["--shape", "tiny", "--lengths", "16", "--methods", "full", "--out", str(out),
                             "--budget-min", "0.01"])  # 0.6 s: less than a process takes to start
    assert time.time() - started < 30
    assert cut["ran"] == [] and len(cut["not_started"]) == 2 and len(records(out)) == 2


def test_bad_options_are_refused_naming_them(tmp_path):
    for argv, words in ((["--lengths", "1024,x"], "--lengths"), (["--methods", "lisa,dora"], "--methods"),
                        (["--steps", "1"], "--steps"), (["--budget-min", "0"], "--budget-min")):
        with pytest.raises(SystemExit, match=words):
            study_memory.main([*argv, "--out", str(tmp_path / "x.jsonl")])
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # starts bash
def test_the_protocol_script_parses_and_shows_its_plan():
    subprocess.run(["bash", "-n", str(PROTOCOL)], check=True)
    plan = subprocess.run(["bash", str(PROTOCOL)], env={**os.environ, "DRY_RUN": "1"}, capture_output=True,
                          text=True, check=True).stdout
    assert "study_memory.py --shape 1.7b --lengths 1024,2048" in plan and "--budget-min 3.00" in plan
    assert "benchmarks/study.py --preset gpu" in plan


@pytest.mark.slow
def test_the_protocol_runs_end_to_end_within_its_budget(tmp_path):
    """The script itself on CPU (ALLOW_CPU, the tiny shape and preset) with an 80 s budget: both parts run, each is
    stopped at its budget, and the results are copied to $OUT."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "ALLOW_CPU": "1", "SHAPE": "tiny", "LENGTHS": "32", "PRESET": "tiny",
           "RESULTS": str(tmp_path / "results"), "OUT": str(out), "TOTAL_S": "80", "MEMORY_S": "20",
           "MARGIN_S": "5", "MIN_STUDY_S": "10", "STUDY_RUN_S": "5", "OMP_NUM_THREADS": "1"}
    started = time.time()
    done = subprocess.run(["bash", str(PROTOCOL)], env=env, capture_output=True, text=True, timeout=200)
    assert time.time() - started < 80 + 25, done.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "part 1: the memory table" in done.stdout and "part 2: the study" in done.stdout
    assert (out / "memory-tiny-cpu.md").exists() and (out / "gpu_protocol.log").exists()
    assert (tmp_path / "results" / "study" / "study-tiny.md").exists()
