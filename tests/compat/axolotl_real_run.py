"""axolotl's real trainer with hf-lisa's plugin (issue 35, item 2): the set-up and the checks of
``tests/compat/axolotl_real_run.sh``; run with the python of the axolotl virtualenv.

    python axolotl_real_run.py setup WORKDIR     # a tiny local llama (4 blocks), a jsonl dataset, config.yml
    python axolotl_real_run.py check WORKDIR     # after `axolotl train WORKDIR/config.yml` (log: WORKDIR/train.log)

The checks read what the run saved (checkpoint-2/4/6: model.safetensors, optimizer.pt, trainer_state.json) and its
log; each failed check is printed and the exit status is 1.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 4
GAMMA = 1  # lisa_n_layers
K = 2  # lisa_step_interval
MAX_STEPS = 6
CHECKPOINTS = [2, 4, 6]
BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def setup(work: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from train_fixtures import build_tiny_lm_dir, write_jsonl

    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_lm_dir(work / "tiny-llama", num_layers=NUM_BLOCKS, hidden=32, seed=0)
    rows = [{"text": f"say {c}: {c * 3}. then {d}: {d * 3}."} for c in "abcdefgh" for d in "abcd"]
    data = write_jsonl(work / "data.jsonl", rows)
    config = f"""\
base_model: {model_dir}
plugins:
  - hf_lisa.integrations.axolotl.LisaPlugin
# LISA: γ = {GAMMA} of the {NUM_BLOCKS} blocks, re-drawn every K = {K} optimizer steps (axolotl's own keys)
lisa_n_layers: {GAMMA}
lisa_step_interval: {K}
lisa_layers_attribute: model.layers
lisa_sampling: uniform
datasets:
  - path: {data}
    ds_type: json
    type: completion
dataset_prepared_path: {work / "prepared"}
val_set_size: 0
output_dir: {work / "out"}
sequence_len: 64
sample_packing: false
micro_batch_size: 2
gradient_accumulation_steps: 1
max_steps: {MAX_STEPS}
num_epochs: 1
optimizer: adamw_torch
weight_decay: 0.0
learning_rate: 0.01
lr_scheduler: constant
warmup_steps: 0
bf16: false
fp16: false
tf32: false
logging_steps: 1
save_strategy: steps
save_steps: {K}
save_total_limit: 10
seed: 42
use_wandb: false
"""
    (work / "config.yml").write_text(config)
    print(f"wrote {work / 'config.yml'}")


def group_of(name: str) -> str:
    match = BLOCK.match(name)
    return f"block{match.group(1)}" if match else name


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def active_blocks(checkpoint: Path) -> list[int]:
    """The blocks the schedule had active when the checkpoint was written (trainer_state.json's stateful callback)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    callbacks = state.get("stateful_callbacks") or {}
    entry = callbacks.get("LisaCallback")
    if entry is None:
        raise AssertionError(f"{checkpoint}/trainer_state.json has no LisaCallback state: {sorted(callbacks)}")
    entry = entry[0] if isinstance(entry, list) else entry

    def find(obj):
        if isinstance(obj, dict):
            if "active" in obj and "block_names" in obj:
                return obj
            for value in obj.values():
                found = find(value)
                if found is not None:
                    return found
        return None

    layers = find(entry)
    if layers is None:
        raise AssertionError(f"no active set in {checkpoint}/trainer_state.json: {json.dumps(entry)[:500]}")
    return [int(i) for i in layers["active"]]


def check(work: Path) -> int:
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    out = work / "out"
    log = (work / "train.log").read_text(errors="replace")
    base = load_weights(work / "tiny-llama")
    block_numel = sum(t.numel() for n, t in base.items() if n.startswith("model.layers.0."))
    outside = {n: t for n, t in base.items() if not BLOCK.match(n)}
    outside_numel = sum(t.numel() for t in outside.values())
    expect(set(outside) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"},
           f"E+H+norm are {sorted(outside)}")

    # 1. only the sampled blocks (plus E+H+norm) change in each interval of K steps
    previous, previous_name = base, "the base model"
    schedule = []
    for step in CHECKPOINTS:
        checkpoint = out / f"checkpoint-{step}"
        if not checkpoint.is_dir():
            expect(False, f"{checkpoint} exists")
            return report(failures)
        weights = load_weights(checkpoint)
        changed = sorted({group_of(n) for n, t in weights.items() if not torch.equal(t, previous[n])})
        active = active_blocks(checkpoint)
        schedule.append(active)
        wanted = sorted({f"block{i}" for i in active} | set(outside))
        expect(changed == wanted, f"steps {step - K + 1}-{step} (vs {previous_name}): changed {changed}, "
                                  f"sampled blocks {active} + E+H+norm")
        expect(len(active) == GAMMA, f"γ = {GAMMA} block(s) active at step {step}: {active}")
        previous, previous_name = weights, f"checkpoint-{step}"
    print(f"schedule (active block per interval): {schedule}")
    expect(any(a != b for a, b in zip(schedule, schedule[1:])),
           "the sampled blocks changed at least once (else the optimizer check below sees no switch)")

    # 2. the optimizer state after a switch is E+H+γL: one exp_avg and one exp_avg_sq per trainable tensor
    for step in CHECKPOINTS:
        optimizer = torch.load(out / f"checkpoint-{step}" / "optimizer.pt", map_location="cpu", weights_only=False)
        states = [s for s in optimizer["state"].values() if s]
        moments = sum(v.numel() for s in states for key, v in s.items() if key in ("exp_avg", "exp_avg_sq"))
        moment_bytes = sum(v.numel() * v.element_size() for s in states for key, v in s.items()
                           if key in ("exp_avg", "exp_avg_sq"))
        n_tensors = len(outside) + GAMMA * sum(1 for n in base if n.startswith("model.layers.0."))
        formula = 2 * (outside_numel + GAMMA * block_numel)
        every_block = 2 * (outside_numel + NUM_BLOCKS * block_numel)
        expect(len(states) == n_tensors and moments == formula,
               f"checkpoint-{step} optimizer.pt: {len(states)} tensors with state (E+H+norm {len(outside)} + "
               f"γ·block = {n_tensors}), {moments} moment values = 2·(E+H+norm {outside_numel} + γ·L {block_numel}) = "
               f"{formula} ({moment_bytes} bytes; with every block: {every_block})")

    # 3. axolotl's own LISA callback is not running: the plugin took it out, and its log line never appears
    expect("LISA will activate" in log, "axolotl built its own LISACallback (its constructor's log line), the one "
                                        "the plugin must take out")
    expect("Activating layers at indices" not in log, "axolotl's LISACallback never switched layers (its log line "
                                                      "'Activating layers at indices' is absent)")
    expect("replaces axolotl's LISACallback" in log, "the plugin logged that it replaces axolotl's LISACallback")
    expect("LisaCallback" in json.dumps(json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
                                        .get("stateful_callbacks", {})), "hf-lisa's LisaCallback is in the trainer")

    # 4. the saved model loads with transformers and equals the last checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    last = load_weights(out / "checkpoint-6")
    same = all(torch.equal(p.detach(), last[n]) for n, p in model.state_dict().items() if n in last)
    ids = tokenizer("say a:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    expect(same and bool(torch.isfinite(logits).all()),
           f"{out} loads with transformers ({type(model).__name__}), equals checkpoint-6, finite logits")
    return report(failures)


def report(failures: list[str]) -> int:
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    command, directory = sys.argv[1], Path(sys.argv[2])
    if command == "setup":
        setup(directory)
    elif command == "check":
        sys.exit(check(directory))
    else:
        sys.exit(f"unknown command {command!r}: setup or check")
