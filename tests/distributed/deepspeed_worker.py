"""Worker of ``test_deepspeed.py``: DeepSpeed ZeRO-2 and ZeRO-3 on CPU through ``deepspeed.initialize``::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 --master_port P tests/distributed/deepspeed_worker.py OUTPUT_DIR

(``accelerate launch --use_deepspeed`` does not run on CPU.) Fixed trainable sets (LoRA, LISA adapters with sparse-mask
re-selection) must train; layer switching (full-parameter LISA, adapters with γ > 0) must be refused. Writes
``rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from dist_common import PatternDataset, tiny_llama  # noqa: E402

STEPS = 6


def ds_config(stage: int, with_optimizer: bool = True) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if with_optimizer:
        # torch's AdamW: DeepSpeed's fused CPU Adam would need a C++ build
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
    return config


def batch(rank: int) -> dict:
    data = PatternDataset()
    ids = torch.stack([data[2 * rank]["input_ids"], data[2 * rank + 1]["input_ids"]])
    return {"input_ids": ids, "labels": ids}


def snapshot(params, stage: int) -> list[torch.Tensor]:
    import deepspeed

    params = list(params)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def train_adapter(kind: str, stage: int, rank: int) -> dict:
    import deepspeed
    from peft import LoraConfig, get_peft_model

    import hf_lisa
    from hf_lisa.tuner.layer import LisaLayer
    from hf_lisa.tuner.schedule_guard import attach_schedule
    from hf_lisa.scheduler import MaskScheduler

    if kind == "lora":
        model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    else:
        config = hf_lisa.LisaConfig(r=4, lisa_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], sparsity=0.5,
                                    mask_init="magnitude", mask_update_interval=3, importance_steps=2)
        model = get_peft_model(tiny_llama(), config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config(stage))
    masks = MaskScheduler(model) if kind == "lisa" else None
    if masks is not None:  # this loop runs the mask schedule itself: declare it (hf_lisa.tuner.schedule_guard)
        attach_schedule(model, masks)
    layers = [m for m in model.modules() if isinstance(m, LisaLayer)]
    initial_masks = [m.lisa_mask["default"].clone() for m in layers]
    before = snapshot(trainable, stage)
    losses = []
    for step in range(STEPS):
        if masks is not None:
            masks.step(step)  # importance over steps 0-1 (all-reduced), re-selection as step 2 begins
        loss = engine(**batch(rank)).loss
        engine.backward(loss)
        if masks is not None:
            masks.end_step()
        engine.step()
        losses.append(loss.item())
    after = snapshot(trainable, stage)
    result = {
        "losses": losses,
        "trainable_changed": sum(int(not torch.equal(a, b)) for a, b in zip(before, after)),
        "trainable_tensors": len(trainable),
    }
    if masks is not None:
        result["mask_updates"] = masks.num_updates
        result["mask_crc"] = [zlib.crc32(m.lisa_mask["default"].numpy().tobytes()) for m in layers]
        final_masks = [m.lisa_mask["default"] for m in layers]
        result["masks_changed"] = sum(int(not torch.equal(a, b)) for a, b in zip(initial_masks, final_masks))
    engine.destroy()
    return result


def layer_switching_refusals(stage: int) -> dict:
    """Full-parameter LISA and adapters with γ > 0 under ZeRO: the engine check refuses before the first freeze, with
    what a custom loop has at hand (the scheduler's candidates and the optimizer it steps)."""
    import deepspeed
    from peft import get_peft_model

    import hf_lisa
    from hf_lisa.distributed import UnsupportedEngineError, check_layer_switching_supported
    from hf_lisa.scheduler import LayerwiseScheduler

    out = {}

    def attempt(name, build):
        try:
            scheduler, optimizer = build()
            check_layer_switching_supported(optimizer=optimizer, params=scheduler.candidates)
            scheduler.freeze_all_but_active(optimizer)
            out[name] = None
        except UnsupportedEngineError as err:
            out[name] = str(err)

    def full_with_engine_optimizer():
        model = tiny_llama()
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=ds_config(stage))
        return LayerwiseScheduler(engine.module, lisa_activated_layers=1, lisa_interval_steps=2), optimizer

    def full_with_client_optimizer():
        # the user keeps the torch optimizer they handed to deepspeed.initialize and gives that to the scheduler
        model = tiny_llama()
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=ds_config(stage, False))
        return LayerwiseScheduler(engine.module, lisa_activated_layers=1, lisa_interval_steps=2), client

    def adapter_with_gamma():
        model = get_peft_model(tiny_llama(), hf_lisa.LisaConfig(r=4, lisa_activated_layers=1, lisa_interval_steps=2))
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config(stage))
        return LayerwiseScheduler.for_adapter(engine.module), optimizer

    attempt("full_engine_optimizer", full_with_engine_optimizer)
    attempt("full_client_optimizer", full_with_client_optimizer)
    attempt("adapter_gamma", adapter_with_gamma)
    return out


def main(output_dir: str) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # The CPU accelerator would JIT-compile a shared-memory all-reduce (about 2 minutes on 2 cores); gloo is enough.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    results: dict = {"world_size": dist.get_world_size()}
    for stage in (2, 3):
        results[f"zero{stage}"] = {
            "lora": train_adapter("lora", stage, rank),
            "lisa": train_adapter("lisa", stage, rank),
            "refusals": layer_switching_refusals(stage),
        }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
