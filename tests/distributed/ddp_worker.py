"""Worker of ``test_ddp.py``: LISA with a plain ``transformers.Trainer`` under DDP, launched as users launch it::

    ACCELERATE_USE_CPU=1 accelerate launch --config_file examples/accelerate_configs/cpu_2proc.yaml \
        --main_process_port P tests/distributed/ddp_worker.py OUTPUT_DIR

One launch runs every scenario (process start-up dominates on 2 cores) and writes, per rank, ``rank{r}.json`` and the
final weights of the full-parameter run. ``run_full`` also serves as the single-process reference of the test.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import PatternDataset, tiny_llama  # noqa: E402

GAMMA, INTERVAL, SEED = 1, 2, 3


def training_args(output_dir: str, per_device_batch: int, max_steps: int, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        max_steps=max_steps, per_device_train_batch_size=per_device_batch, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, train_sampling_strategy="sequential",
    )
    kwargs.update(overrides)
    return TrainingArguments(output_dir, **kwargs)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_full(output_dir: str, per_device_batch: int = 2, max_steps: int = 8, comm_hook=None, **overrides) -> dict:
    """Full-parameter LISA (γ=1 of 4 blocks, K=2: switches at steps 2, 4, 6). Returns history, losses, bytes."""
    from transformers import Trainer

    from hf_lisa.distributed import configure_trainer_for_lisa
    from hf_lisa.trainer_callbacks import LisaCallback

    model = tiny_llama()
    callback = LisaCallback(lisa_activated_layers=GAMMA, lisa_interval_steps=INTERVAL, seed=SEED)
    args = training_args(output_dir, per_device_batch, max_steps, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=PatternDataset(), callbacks=[callback])
    handler = configure_trainer_for_lisa(trainer, comm_hook=comm_hook, powersgd_rank=1, powersgd_start_iter=2)
    trainer.train()
    meter = handler.comm_state.meter if handler is not None and handler.comm_state is not None else None
    return {
        "history": [[step, blocks] for step, blocks in callback.layer_scheduler.history],
        "losses": _losses(trainer),
        "bytes": meter.steps if meter is not None else None,
        "logged_bytes": [h.get("ddp/grad_bytes_per_step") for h in trainer.state.log_history if "loss" in h],
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "state_dict": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def run_adapter(output_dir: str) -> dict:
    """LISA adapters with sparse masks chosen from |dL/dW| (calibration in each block's first active period, then
    re-selection once per interval of 3 steps in which a block trains) and γ=1."""
    from peft import get_peft_model
    from transformers import Trainer

    import hf_lisa
    from hf_lisa.distributed import configure_trainer_for_lisa
    from hf_lisa.tuner.layer import LisaLayer
    from hf_lisa.trainer_callbacks import LisaAdapterCallback

    config = hf_lisa.LisaConfig(
        r=4, lisa_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], sparsity=0.5, mask_init="importance",
        mask_update_interval=3, importance_steps=2, lisa_activated_layers=1, lisa_interval_steps=2,
    )
    model = get_peft_model(tiny_llama(), config)
    initial = {n: m.lisa_mask["default"].clone() for n, m in model.named_modules() if isinstance(m, LisaLayer)}
    callback = LisaAdapterCallback(seed=SEED)
    trainer = Trainer(model=model, args=training_args(output_dir, 2, 12), train_dataset=PatternDataset(),
                      callbacks=[callback])
    configure_trainer_for_lisa(trainer)
    trainer.train()
    masks = {n: m.lisa_mask["default"] for n, m in model.named_modules() if isinstance(m, LisaLayer)}
    return {
        "mask_crc": {n: zlib.crc32(t.numpy().tobytes()) for n, t in masks.items()},
        "changed_from_initial": sum(int(not bool((masks[n] == initial[n]).all())) for n in masks),
        "mask_updates": [[u["step"], u["kind"], u["layers"]] for u in callback.mask_updates],
        "history": [[step, blocks] for step, blocks in callback.layer_scheduler.history],
        "losses": _losses(trainer),
    }


def run_user_code(output_dir: str) -> dict:
    """A user's script: LISA adapters with interpolation and γ=1, ``evaluate()`` before ``train()``, and no call to
    ``configure_trainer_for_lisa``: the callback prepares the Trainer itself. Also the β penalty's gradient on 2 ranks.
    """
    from peft import get_peft_model
    from transformers import Trainer, TrainerCallback

    import hf_lisa
    from hf_lisa.trainer_callbacks import LisaAdapterCallback, prepare_trainer

    def build(lam: float):
        config = hf_lisa.LisaConfig(r=4, target_modules=["q_proj", "v_proj"], lisa_activated_layers=1,
                                    lisa_interval_steps=2, layer_interpolation=True, interpolation_beta_l2=lam)
        model = get_peft_model(tiny_llama(), config)
        with torch.no_grad():
            model.base_model.lisa_interp_beta["default"].copy_(torch.tensor([0.5, -1.0, 0.25, 2.0]))
        return model

    import torch

    model = build(0.01)
    callback = LisaAdapterCallback(seed=SEED)
    trainer = Trainer(model=model, args=training_args(output_dir, 2, 4), train_dataset=PatternDataset(),
                      eval_dataset=PatternDataset(num_examples=8), callbacks=[callback])
    prepare_trainer(trainer)  # user code hands the Trainer to the callbacks (a Trainer does not pass itself)
    trainer.evaluate()
    trainer.train()
    weights = {n: p.detach() for n, p in model.named_parameters() if "lisa_" in n}

    grads = {}

    class BetaGrad(TrainerCallback):
        def __init__(self, model):
            self.model = model

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.setdefault(self.lam, self.model.base_model.lisa_interp_beta["default"].grad.clone())

    for lam in (0.01, 0.0):
        probe_model = build(lam)
        probe = BetaGrad(probe_model)
        probe.lam = lam
        probe_trainer = Trainer(model=probe_model, train_dataset=PatternDataset(),
                                args=training_args(os.path.join(output_dir, f"beta{lam}"), 2, 1, learning_rate=0.0),
                                callbacks=[LisaAdapterCallback(seed=SEED), probe])
        prepare_trainer(probe_trainer)
        probe_trainer.train()
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "weights_crc": {n: zlib.crc32(t.contiguous().numpy().tobytes()) for n, t in weights.items()},
        "weight_sum": float(sum(t.double().sum() for t in weights.values())),
        "history": [[step, blocks] for step, blocks in callback.layer_scheduler.history],
        "penalty_grad": (grads[0.01] - grads[0.0]).tolist(),
    }


def run_refusals(output_dir: str) -> dict:
    """What the option layer refuses on this backend (gloo), and reentrant checkpointing under DDP."""
    from transformers import Trainer

    from hf_lisa.distributed import UnsupportedEngineError, ddp_kwargs_for_lisa
    from hf_lisa.trainer_callbacks import LisaCallback, prepare_trainer

    out = {}
    args = training_args(output_dir, 2, 2, activation_checkpointing=True,
                         activation_checkpointing_kwargs={"use_reentrant": True})
    try:  # the run's one engine check, as training begins, sees the checkpointed model inside the DDP wrap
        refused = Trainer(model=tiny_llama(), args=args, train_dataset=PatternDataset(), callbacks=[LisaCallback(1, 2)])
        prepare_trainer(refused)
        refused.train()
        out["reentrant_checkpointing"] = None
    except UnsupportedEngineError as err:
        out["reentrant_checkpointing"] = str(err)
    # raw DDP, as in a custom loop: what check_layer_switching_supported says about each wrapping
    from torch.nn.parallel import DistributedDataParallel

    from hf_lisa.distributed import check_layer_switching_supported

    checkpointed = tiny_llama()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    for name, (model, find_unused) in {"raw_ddp_find_unused": (tiny_llama(), True),
                                       "raw_ddp_no_find_unused": (tiny_llama(), False),
                                       "raw_ddp_reentrant": (checkpointed, True)}.items():
        try:
            wrapped = DistributedDataParallel(model, find_unused_parameters=find_unused)
            out[name] = check_layer_switching_supported(wrapped)
        except UnsupportedEngineError as err:
            out[name] = "refused: " + str(err)
    for name, kwargs in {"bf16_torch_hook": dict(comm_hook="bf16", active_set_sync=False),
                         "batched_powersgd": dict(comm_hook="batched_powersgd")}.items():
        try:
            ddp_kwargs_for_lisa(**kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def main(output_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    results = {}
    full = run_full(os.path.join(output_dir, "full"))
    state = full.pop("state_dict")
    results["full"] = full
    for hook in ("fp16", "bf16", "powersgd"):
        run = run_full(os.path.join(output_dir, hook), comm_hook=hook)
        run.pop("state_dict")
        results[hook] = run
    # activation checkpointing turns find_unused_parameters off in the Trainer; configure_trainer_for_lisa turns it on
    checkpointed = run_full(os.path.join(output_dir, "gc"), max_steps=4, activation_checkpointing=True)
    checkpointed.pop("state_dict")
    results["checkpointing"] = checkpointed
    results["adapter"] = run_adapter(os.path.join(output_dir, "adapter"))
    results["user_code"] = run_user_code(os.path.join(output_dir, "user_code"))
    results["refusals"] = run_refusals(os.path.join(output_dir, "refusals"))
    rank = dist.get_rank()
    results["rank"], results["world_size"] = rank, dist.get_world_size()
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output_dir, f"full_rank{rank}.safetensors"))
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
