"""Worker of ``test_deepspeed_lisa.py``: LISA layer switching under DeepSpeed ZeRO-2/3 on CPU, 2 ranks::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 --master_port P tests/distributed/deepspeed_lisa_worker.py OUT

For each shipped DeepSpeed accelerate config (its ZeRO stage and offload settings) and LISA form (full-parameter,
adapters with γ > 0), on every rank: a single-process reference (torch AdamW, global batch 4, drop policy), the
ZeRO run with :class:`hf_lisa.distributed.DeepSpeedLayerSwitcher` (micro batch 2 per rank), and the same run
interrupted by a DeepSpeed checkpoint in the middle of an interval and resumed in a fresh engine. Writes
``rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from dist_common import REPO, PatternDataset, tiny_llama  # noqa: E402

STEPS, K, GAMMA, SEED = 8, 3, 1, 7
LR, WD, CLIP = 1e-2, 0.01, 1.0  # CLIP: the configs' gradient_clipping, over the trainable set
CHECKPOINT_AFTER = 5  # steps done when the checkpoint is taken: in the middle of the period [3, 6)


#: the shipped accelerate configs whose zero_optimization settings (stage, offload) the runs use, and the LISA forms
#: run with each
CONFIGS = {
    "deepspeed_zero2.yaml": ("full", "adapter"),
    "deepspeed_zero2_offload.yaml": ("full",),
    "deepspeed_zero3.yaml": ("full", "adapter"),
    "deepspeed_zero3_offload.yaml": ("full",),
}


def ds_config(name: str) -> dict:
    """The DeepSpeed config of a ``deepspeed.initialize`` run with the ZeRO settings of accelerate config ``name``."""
    import yaml

    settings = yaml.safe_load((REPO / "examples" / "accelerate_configs" / name).read_text())["deepspeed_config"]
    stage = int(settings["zero_stage"])
    zero: dict = {"stage": stage}
    for kind in ("optimizer", "param"):
        device = settings.get(f"offload_{kind}_device", "none")
        if device != "none":
            zero[f"offload_{kind}"] = {"device": device}
    if stage == 3:  # partition every parameter: by default ZeRO-3 keeps those under 100k elements whole
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": int(settings["gradient_accumulation_steps"]),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": CLIP if float(settings["gradient_clipping"]) == CLIP else None,  # the reference clips
        # fp32 and torch's AdamW (also on the host when offloading): DeepSpeed's CPU Adam would need a C++ build
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
    }


def examples(step: int, rank=None) -> dict:
    data = PatternDataset()
    index = range(4 * step, 4 * step + 4) if rank is None else range(4 * step + 2 * rank, 4 * step + 2 * rank + 2)
    ids = torch.stack([data[i]["input_ids"] for i in index])
    return {"input_ids": ids, "labels": ids}


def model_for(form: str):
    """``full``: a plain model, E+H+γ blocks train; ``adapter``: LISA adapters, γ blocks' adapters train."""
    if form == "full":
        return tiny_llama()
    from peft import get_peft_model

    import hf_lisa
    from hf_lisa.tuner.schedule_guard import attach_schedule

    config = hf_lisa.LisaConfig(r=4, lisa_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                lisa_activated_layers=GAMMA, lisa_interval_steps=K)
    torch.manual_seed(1)
    model = get_peft_model(tiny_llama(), config)
    attach_schedule(model, model)  # this loop runs the layer schedule itself
    return model


def scheduler_for(model, form: str):
    from hf_lisa.scheduler import LayerwiseScheduler

    if form == "adapter":
        return LayerwiseScheduler.for_adapter(model, seed=SEED)
    return LayerwiseScheduler(model, lisa_activated_layers=GAMMA, lisa_interval_steps=K, seed=SEED)


def reference(form: str) -> dict:
    model = model_for(form)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    scheduler = scheduler_for(model, form)
    names = {n for n, p in model.named_parameters() if p.requires_grad}  # the candidates
    scheduler.freeze_all_but_active(optimizer)
    for step in range(STEPS):
        scheduler.maybe_switch(step, optimizer)
        model(**examples(step)).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters() if n in names},
            "history": [list(a) for _, a in scheduler.history]}


def build(form: str, config: str):
    import deepspeed

    from hf_lisa.distributed import DeepSpeedLayerSwitcher

    model = model_for(form)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config(config))
    scheduler = scheduler_for(engine.module, form)
    return engine, scheduler, DeepSpeedLayerSwitcher(engine, scheduler)


def train(engine, scheduler, switcher, rank: int, start: int, stop: int, log: dict) -> None:
    for step in range(start, stop):
        if switcher.maybe_switch(step) or step == 0:
            trainable = sum(numel(p) for p in scheduler.candidates if p.requires_grad)
            log["switches"].append({
                "step": step, "active": list(scheduler.active), "trainable_numel": trainable,
                "trainable_tensors": sum(int(p.requires_grad) for p in scheduler.candidates),
                "all_numel": sum(numel(p) for p in scheduler.candidates),
                "state_bytes": switcher.state_bytes(), "partition_numel": switcher.partition_numel(),
                "groups": len(engine.optimizer.optimizer.state),  # every flat group has its state
            })
        loss = engine(**examples(step, rank)).loss
        engine.backward(loss)
        # frozen blocks: no gradient computed, none kept
        log["frozen_grads"] += sum(int(p.grad is not None) for p in scheduler.frozen_candidates())
        engine.step()
        log["losses"].append(loss.item())
        if step == 0:
            log["state_bytes_after_first_step"] = switcher.state_bytes()


def weights_of(engine) -> dict:
    """Full copies of the model's parameters (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def numel(p) -> int:
    return getattr(p, "ds_numel", p.numel())  # ZeRO-3: the full size of a partitioned parameter


def diff(weights: dict, engine) -> float:
    return max(float((p - weights[n]).abs().max()) for n, p in weights_of(engine).items() if n in weights)


def run_form(form: str, rank: int, output_dir: str, config: str) -> dict:
    """Reference, uninterrupted ZeRO-2 run and interrupted + resumed ZeRO-2 run of one LISA form."""
    from hf_lisa.distributed import check_layer_switching_supported

    ref = reference(form)
    out: dict = {"reference_history": ref["history"]}

    engine, scheduler, switcher = build(form, config)
    log = {"switches": [], "losses": [], "frozen_grads": 0}
    switcher.start()
    out["engine_check"] = check_layer_switching_supported(engine, engine.optimizer, params=scheduler.candidates)
    train(engine, scheduler, switcher, rank, 0, STEPS, log)
    log["history"] = [list(a) for _, a in scheduler.history]
    log["max_diff_vs_reference"] = diff(ref["weights"], engine)
    uninterrupted = weights_of(engine)
    log["per_param"] = {n: float((p - ref["weights"][n]).abs().max())
                        for n, p in uninterrupted.items() if n in ref["weights"]}
    log["rebuilds"] = switcher.rebuilds
    out["run"] = log
    engine.destroy()

    # interrupted in the middle of an interval, resumed in a fresh engine from DeepSpeed's own checkpoint
    checkpoint = os.path.join(output_dir, f"ckpt_{form}_{config}")
    engine, scheduler, switcher = build(form, config)
    first = {"switches": [], "losses": [], "frozen_grads": 0}
    switcher.start()
    train(engine, scheduler, switcher, rank, 0, CHECKPOINT_AFTER, first)
    engine.save_checkpoint(checkpoint, tag="mid", client_state={
        "lisa_schedule": scheduler.state_dict(), "lisa_zero_steps": switcher.state_dict()})
    engine.destroy()
    engine, scheduler, switcher = build(form, config)
    # the schedule and the group layout first (they decide the ZeRO partitions), then DeepSpeed's own load
    # (client_state is in every *model_states.pt: mp_rank_00_... under ZeRO-1/2, zero_pp_rank_R_... under ZeRO-3)
    states = sorted(f for f in os.listdir(os.path.join(checkpoint, "mid")) if f.endswith("model_states.pt"))
    client = torch.load(os.path.join(checkpoint, "mid", states[0]), weights_only=False)
    scheduler.load_state_dict(client["lisa_schedule"])
    switcher.load_state_dict(client["lisa_zero_steps"])
    switcher.start(CHECKPOINT_AFTER)
    engine.load_checkpoint(checkpoint, tag="mid")
    second = {"switches": [], "losses": [], "frozen_grads": 0}
    train(engine, scheduler, switcher, rank, CHECKPOINT_AFTER, STEPS, second)
    out["partitioned"] = sum(int(p.numel() == 0) for p in engine.module.parameters())  # ZeRO-3: released params
    out["resume"] = {
        "losses": first["losses"] + second["losses"],
        "max_diff_vs_uninterrupted": diff(uninterrupted, engine),
        "frozen_grads": first["frozen_grads"] + second["frozen_grads"],
    }
    engine.destroy()
    return out


def main(output_dir: str) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # The CPU accelerator would JIT-compile a shared-memory all-reduce (about 2 minutes on 2 cores); gloo is enough.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"world_size": world}
    for config, forms in CONFIGS.items():
        out[config] = {form: run_form(form, rank, output_dir, config) for form in forms}
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
