"""Single-process checks of hf_lisa.distributed: the shipped accelerate configs, the DDP options and the guards."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from dist_common import REPO, PatternDataset, tiny_llama

from hf_lisa.distributed import (
    GradientBytesMeter,
    LisaDDPKwargs,
    UnsupportedEngineError,
    check_layer_switching_supported,
    configure_trainer_for_lisa,
    ddp_kwargs_for_lisa,
    ddp_training_arguments,
    detect_engine,
    fsdp2_unfreeze_fix_needed,
    gradient_bytes,
    install_fsdp2_unfreeze_fix,
)

CONFIG_DIR = REPO / "examples" / "accelerate_configs"
# file -> (distributed_type, num_processes, num_machines)
EXPECTED_CONFIGS = {
    "single_cpu.yaml": ("NO", 1, 1),
    "single_gpu.yaml": ("NO", 1, 1),
    "multi_gpu.yaml": ("MULTI_GPU", 8, 1),
    "multi_node.yaml": ("MULTI_GPU", 16, 2),
    "fsdp2.yaml": ("FSDP", 8, 1),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 8, 1),
    "deepspeed_zero2_offload.yaml": ("DEEPSPEED", 8, 1),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 8, 1),
    "deepspeed_zero3_offload.yaml": ("DEEPSPEED", 8, 1),
    "cpu_2proc.yaml": ("MULTI_GPU", 2, 1),
}


def _launch_args(path: Path):
    """What ``accelerate launch --config_file path script.py`` resolves, without launching."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "script.py"])
    return _validate_launch_command(args)


def test_the_shipped_configs_are_the_documented_set():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_config_loads_with_accelerates_parser(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = CONFIG_DIR / name
    config = load_config_from_file(str(path))
    distributed_type, num_processes, num_machines = EXPECTED_CONFIGS[name]
    assert config.distributed_type.value == distributed_type
    assert config.num_processes == num_processes and config.num_machines == num_machines
    args, _, _ = _launch_args(path)  # accelerate launch's own validation of the merged arguments
    assert args.num_processes == num_processes
    assert args.use_fsdp == (distributed_type == "FSDP") and args.use_deepspeed == (distributed_type == "DEEPSPEED")
    assert path.read_text().startswith("#"), "each shipped config opens with a comment on when to use it"


def test_fsdp2_config_builds_a_version_2_plugin_wrapping_each_block():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _launch_args(CONFIG_DIR / "fsdp2.yaml")
    with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"


@pytest.mark.parametrize("name,stage,offload_optimizer,offload_param", [
    ("deepspeed_zero2.yaml", 2, "none", "none"), ("deepspeed_zero2_offload.yaml", 2, "cpu", "none"),
    ("deepspeed_zero3.yaml", 3, "none", "none"), ("deepspeed_zero3_offload.yaml", 3, "cpu", "cpu"),
])
def test_deepspeed_configs_build_plugins(name, stage, offload_optimizer, offload_param):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[distributed]'")
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults, _ = _launch_args(CONFIG_DIR / name)
    args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
    _, env = prepare_deepspeed_cmd_env(args)
    with mock.patch.dict(os.environ, env):
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == offload_optimizer and zero["offload_param"]["device"] == offload_param


def test_ddp_kwargs_carry_the_comm_hook_options():
    from accelerate.utils import DDPCommunicationHookType

    kwargs = ddp_kwargs_for_lisa("powersgd", powersgd_rank=4, powersgd_start_iter=50, bucket_cap_mb=10)
    assert isinstance(kwargs, LisaDDPKwargs)
    assert kwargs.comm_hook == DDPCommunicationHookType.POWER_SGD
    assert kwargs.comm_state_option["matrix_approximation_rank"] == 4
    assert kwargs.comm_state_option["start_powerSGD_iter"] == 50
    assert kwargs.comm_state_option["warm_start"] is False  # see ddp_kwargs_for_lisa: frozen blocks stale warm starts
    # accelerate passes only non-default values to DDP; find_unused_parameters must always reach it
    assert kwargs.to_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 10}
    assert ddp_kwargs_for_lisa("fp16").comm_hook == DDPCommunicationHookType.FP16
    assert ddp_kwargs_for_lisa(None).comm_hook == DDPCommunicationHookType.NO


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(comm_hook="int8"), "ddp_comm_hook='int8'"),
        (dict(comm_hook="powersgd", powersgd_rank=0), "powersgd_rank=0"),
        (dict(comm_hook="powersgd", powersgd_start_iter=1), "powersgd_start_iter=1"),
        (dict(comm_hook="batched_powersgd"), "ddp_comm_hook='batched_powersgd'"),
    ],
)
def test_invalid_comm_hook_options_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        ddp_kwargs_for_lisa(**kwargs)


def test_ddp_training_arguments_force_unused_parameter_detection():
    assert ddp_training_arguments() == {"ddp_find_unused_parameters": True}
    assert ddp_training_arguments(True)["gradient_checkpointing_kwargs"] == {"use_reentrant": False}


def test_single_process_trainer_needs_no_ddp_setup(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=tiny_llama(), args=args)
    assert configure_trainer_for_lisa(trainer) is None
    with pytest.warns(UserWarning, match="single process"):
        assert configure_trainer_for_lisa(trainer, comm_hook="fp16") is None
    # launched as 2 processes that the Trainer does not see as connected: two silently independent runs
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}):
        with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU=1"):
            configure_trainer_for_lisa(trainer)


def test_an_optimizer_that_holds_none_of_the_schedule_parameters_is_refused():
    from hf_lisa.scheduler import LayerwiseScheduler

    model = tiny_llama()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]  # like ZeRO's flat partitions
    scheduler = LayerwiseScheduler(model, lisa_activated_layers=1, lisa_interval_steps=2)
    with pytest.raises(UnsupportedEngineError, match="holds none of them"):
        check_layer_switching_supported(model, torch.optim.AdamW(copies), params=scheduler.candidates)


@pytest.mark.parametrize(
    "case,overrides,message",
    [
        ("deepspeed", {"deepspeed": "ds_config.json"}, r"DeepSpeed ZeRO fixes the trainable set.*FSDP2"),
        ("fsdp1-flat", {"fsdp": "full_shard", "fsdp_config": {"version": 1, "use_orig_params": "false"}},
         r"use_orig_params=True.*FSDP2"),
        ("ddp-no-unused", {"ddp_find_unused_parameters": False}, r"Expected to have finished reduction"),
        ("ddp-static-graph", {"ddp_static_graph": True}, r"static_graph=True forbids"),
        ("ddp-reentrant", {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
         r"use_reentrant"),
    ],
)
def test_trainer_arguments_are_judged_by_the_same_check_before_the_wrap(case, overrides, message):
    from types import SimpleNamespace

    from transformers.training_args import ParallelMode

    args = SimpleNamespace(
        deepspeed=None, fsdp="", fsdp_config={}, parallel_mode=ParallelMode.DISTRIBUTED, world_size=2,
        ddp_find_unused_parameters=True, ddp_static_graph=False, gradient_checkpointing=False,
        gradient_checkpointing_kwargs=None,
    )
    vars(args).update(overrides)
    with pytest.raises(UnsupportedEngineError, match=message):
        check_layer_switching_supported(tiny_llama(), args=args, form="full-parameter LISA")
    # a schedule that freezes nothing (γ = N, or masks only) is never refused
    assert check_layer_switching_supported(tiny_llama(), args=args, freezes=False) in ("deepspeed", "fsdp1", "ddp")


def test_a_training_run_checks_its_engine_once(tmp_path):
    from transformers import Trainer, TrainingArguments

    import hf_lisa.distributed
    from hf_lisa.trainer_callbacks import LisaCallback

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=4, save_strategy="no")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=PatternDataset(),
                      callbacks=[LisaCallback(lisa_activated_layers=1, lisa_interval_steps=2)])
    check = mock.Mock(wraps=check_layer_switching_supported)
    with mock.patch.object(hf_lisa.distributed, "check_layer_switching_supported", check):
        trainer.train()
    assert check.call_count == 1
    assert check.call_args.kwargs["freezes"] is True and check.call_args.kwargs["form"] == "full-parameter LISA"


def test_plain_model_and_optimizer_are_single_engine():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    assert detect_engine(model, optimizer) == "single"
    assert check_layer_switching_supported(model, optimizer, params=list(model.parameters())) == "single"
    assert not fsdp2_unfreeze_fix_needed(model) and install_fsdp2_unfreeze_fix(model) is False


def test_gradient_bytes_meter_closes_a_step_at_the_last_bucket():
    meter = GradientBytesMeter()
    meter.record(100, 400, last_bucket=False)
    meter.record(0, 600, last_bucket=True)
    meter.record(300, 1000, last_bucket=True)
    assert meter.steps == [{"sent": 100, "full": 1000}, {"sent": 300, "full": 1000}]
    assert meter.summary()["sent_fraction"] == pytest.approx(0.2)
    shared = torch.nn.Parameter(torch.zeros(3, 4))
    assert gradient_bytes([shared, shared, torch.zeros(2, dtype=torch.float16)]) == 48 + 4
