"""One owner of the block index, the parameter-to-group map and the active set; every consumer reads it."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from conftest import TokenDataset, build_tiny_llama, build_training_args
from transformers import Trainer, TrainerCallback

import hf_lisa
from hf_lisa.scheduler import LayerwiseScheduler
from hf_lisa.scheduler.active_set import EMBEDDINGS_GROUP, HEAD_GROUP, ActiveSet, BlockIndex
from hf_lisa.scheduler.param_groups import layerwise_lr_decay_param_groups
from hf_lisa.train.outputs import trainable_summary
from hf_lisa.trainer_callbacks import LisaCallback
from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

SCHEDULER_DIR = pathlib.Path(hf_lisa.__file__).parent / "scheduler"


class _SummaryAtTrainBegin(TrainerCallback):
    """Records the start-of-training summary after the LISA callback has frozen what does not train."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.summary = trainable_summary(model)


def test_one_index_per_model_serves_llrd_schedule_monitor_and_summary(tmp_path, monkeypatch):
    built = []
    original_init = BlockIndex.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(BlockIndex, "__init__", counting_init)
    model = build_tiny_llama(num_layers=4)
    optimizer = torch.optim.AdamW(layerwise_lr_decay_param_groups(model, lr=1e-2, decay=0.9))
    lisa = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2, seed=0)
    recorder = _SummaryAtTrainBegin()
    trainer = Trainer(
        model=model, args=build_training_args(tmp_path, max_steps=2), train_dataset=TokenDataset(16),
        callbacks=[lisa, recorder], optimizers=(optimizer, None),
    )
    monitor = TrainingMonitorCallback(num_block_groups=2).attach(trainer)
    trainer.train()

    # LLRD built the index; the schedule, the monitor and the summary read that very object
    (index,) = built
    assert lisa.layer_scheduler.index is index
    assert lisa.layer_scheduler.active_set.index is index
    assert monitor.index is index
    assert BlockIndex.of(model) is index
    assert index.block_names == tuple(f"model.layers.{i}" for i in range(4))

    # LLRD groups: every parameter sits in its index group
    for group in optimizer.param_groups:
        names = [name for name, p in model.named_parameters() if any(p is q for q in group["params"])]
        assert names and all(index.groups[name] == group["name"].split("/")[0] for name in names)
    # monitor groups: the index's blocks, coarsened into two ranges, plus its embeddings and head
    monitored = {name: group for group, params in monitor._groups for name, _ in params}
    for name, group in monitored.items():
        block = index.block_of(name)
        if block is None:
            assert group == index.groups[name] and group in (EMBEDDINGS_GROUP, HEAD_GROUP)
        else:
            assert group == ("blocks_00-01" if block < 2 else "blocks_02-03")
    assert set(monitored) == set(index.groups)
    # the summary counts by the same blocks, and its active blocks are the schedule's first active set
    assert recorder.summary["num_blocks"] == index.num_blocks
    assert recorder.summary["active_blocks"] == lisa.layer_scheduler.history[0][1]


def test_adapter_schedule_and_llrd_share_the_index_and_put_adapters_in_their_block():
    from peft import get_peft_model

    base = build_tiny_llama(num_layers=3)
    before = BlockIndex.of(base)
    model = get_peft_model(base, hf_lisa.LisaConfig(r=2, lisa_activated_layers=1, lisa_interval_steps=2))
    # PEFT injected adapters into the base model: its parameter names changed, so its index is rebuilt
    assert BlockIndex.of(base) is not before
    assert any("lisa_A" in name for name in BlockIndex.of(base).groups)

    scheduler = LayerwiseScheduler.for_adapter(model)
    index = BlockIndex.of(model)
    assert scheduler.index is index
    layerwise_lr_decay_param_groups(model, lr=1.0, decay=0.5)
    assert BlockIndex.of(model) is index  # LLRD found the same object
    lisa_names = [name for name in index.groups if "lisa_A" in name]
    assert lisa_names and all(index.groups[name] == f"block.{index.block_of(name)}" for name in lisa_names)
    assert [index.block_names[index.block_of(name)] for name in lisa_names] == [
        name.split(".self_attn")[0].removeprefix("base_model.model.") for name in lisa_names
    ]


def test_the_active_set_is_one_fact_held_by_the_scheduler():
    model = build_tiny_llama(num_layers=4)
    scheduler = LayerwiseScheduler(model, lisa_activated_layers=2, lisa_interval_steps=2, seed=3)
    assert scheduler.active == [] and scheduler.active_set.blocks == []
    scheduler.freeze_all_but_active()
    assert scheduler.active == scheduler.active_set.blocks and len(scheduler.active) == 2
    # the sampler proposes and keeps no copy; an explicit switch changes the one record
    assert not hasattr(scheduler.sampler, "current") and "current" not in scheduler.sampler.state_dict()
    scheduler.switch_to([3, 1, 3])
    assert scheduler.active == scheduler.active_set.blocks == [1, 3]
    assert scheduler.active_set.names == ["model.layers.1", "model.layers.3"]
    with pytest.raises(AttributeError):
        scheduler.active = [0]  # read-only: there is nothing to keep in sync
    with pytest.raises(IndexError, match="out of range"):
        scheduler.switch_to([4])
    assert scheduler.active == [1, 3]
    # only the blocks with trainable parameters are mapped by training; their requires_grad follows the record
    trains = [any(p.requires_grad for p in block.parameters()) for _, block in scheduler.index.blocks]
    assert trains == [False, True, False, True]


def test_a_state_written_with_the_sampler_copy_restores_the_schedulers_active_set():
    # hf-lisa 0.1 also saved the active set inside the sampler's state ("current"); the scheduler's "active" wins
    model = build_tiny_llama(num_layers=4)
    scheduler = LayerwiseScheduler(model, lisa_activated_layers=1, lisa_interval_steps=2, seed=0)
    scheduler.freeze_all_but_active()
    scheduler.switch_to([2], global_step=2)
    state = scheduler.state_dict()
    state["sampler"]["current"] = [0]
    restored = LayerwiseScheduler(build_tiny_llama(num_layers=4), lisa_activated_layers=1, lisa_interval_steps=2,
                                  seed=0)
    restored.load_state_dict(state)
    assert restored.active == [2] and restored.last_switch_step == 2
    assert [restored.sampler.sample() for _ in range(5)] == [scheduler.sampler.sample() for _ in range(5)]


def test_a_model_without_blocks_is_refused_by_the_schedule_and_monitored_as_embeddings_and_head():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match="lisa_layers_attribute"):
        BlockIndex.of(model)
    index = BlockIndex.of(model, require_blocks=False)
    assert index.num_blocks == 0 and index.discovery_error
    assert index.groups == {"0.weight": EMBEDDINGS_GROUP, "1.weight": HEAD_GROUP, "1.bias": HEAD_GROUP}
    monitor = TrainingMonitorCallback()
    monitor._build_groups(model)
    assert monitor.index is index
    assert [(group, [name for name, _ in params]) for group, params in monitor._groups] == [
        ("embeddings", ["0.weight"]), ("head", ["1.weight", "1.bias"])
    ]


def test_active_set_refuses_blocks_the_model_does_not_have():
    index = BlockIndex.of(build_tiny_llama(num_layers=2))
    with pytest.raises(ValueError, match="are not blocks of this model"):
        ActiveSet(index, ["model.layers.0", "model.layers.7"])


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Absolute names of every module ``path`` imports, at top level or inside functions."""
    package = "hf_lisa.scheduler"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_scheduler_imports_no_engine_and_no_callback_code():
    files = sorted(SCHEDULER_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"layerwise.py", "active_set.py", "sampler.py", "mask_schedule.py"}
    for path in files:
        forbidden = sorted(
            name for name in _imported_modules(path)
            if name.split(".")[:2] in (["hf_lisa", "distributed"], ["hf_lisa", "trainer_callbacks"])
            or name.split(".")[0] == "trainer_callbacks"
        )
        assert not forbidden, f"{path.name} imports {forbidden}"
