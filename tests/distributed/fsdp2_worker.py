"""Worker of ``test_fsdp2.py``: full-parameter LISA on a model sharded with FSDP2 (``fully_shard`` per block), gloo::

    torchrun --nproc_per_node 2 --master_port P tests/distributed/fsdp2_worker.py OUTPUT_DIR

(accelerate and the Trainer replace FSDP with DDP on CPU, so FSDP2 is driven directly, as in a custom loop.)
Writes ``rank{r}.json`` with what each scenario observed.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dist_common import block_of, tiny_llama  # noqa: E402

GAMMA, INTERVAL, SEED, STEPS, SAVE_AT = 1, 2, 5, 6, 3


def build(mp_policy=None, fix: bool = True):
    from torch.distributed.fsdp import fully_shard

    from hf_lisa.distributed import fully_shard_blocks
    from hf_lisa.scheduler import LayerwiseScheduler

    model = tiny_llama()
    if fix:
        fully_shard_blocks(model, mp_policy=mp_policy)
    else:  # what a user gets from plain fully_shard calls
        kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
        for block in model.model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over every candidate, before freezing
    scheduler = LayerwiseScheduler(model, lisa_activated_layers=GAMMA, lisa_interval_steps=INTERVAL, seed=SEED)
    return model, optimizer, scheduler


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    return {"input_ids": ids, "labels": ids}


def full_weights(model) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter (a collective: every rank calls it in the same order)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().clone()
    return out


def train(model, optimizer, scheduler, steps, observe: bool = False) -> list[dict]:
    records = []
    for step in steps:
        scheduler.maybe_switch(step, optimizer)
        before = full_weights(model) if observe else None
        model(**batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if observe:
            after = full_weights(model)
            changed = [n for n in after if not torch.equal(before[n], after[n])]
            trainable = {id(p) for p in scheduler.trainable_parameters()}
            records.append({
                "step": step,
                "active": list(scheduler.active),
                "changed_blocks": sorted({block_of(n) for n in changed if block_of(n) is not None}),
                "changed_outside": sorted(n for n in changed if block_of(n) is None),
                "state_only_for_trainable": all(id(p) in trainable for p, s in optimizer.state.items() if s),
                "params_with_state": sum(1 for s in optimizer.state.values() if s),
                "trainable_params": len(trainable),
            })
    return records


def fsdp1_scenarios() -> dict:
    """FSDP1 (one unit per block): refused without use_orig_params; with it, switching trains the sampled blocks."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from hf_lisa.distributed import UnsupportedEngineError, check_layer_switching_supported
    from hf_lisa.scheduler import LayerwiseScheduler

    out: dict = {}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    flat = FSDP(tiny_llama(), use_orig_params=False, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    try:
        out["flat_params"] = check_layer_switching_supported(flat)
    except UnsupportedEngineError as err:
        out["flat_params"] = "refused: " + str(err)
    model = FSDP(tiny_llama(), use_orig_params=True, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    out["orig_params"] = check_layer_switching_supported(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = LayerwiseScheduler(model, lisa_activated_layers=GAMMA, lisa_interval_steps=INTERVAL, seed=SEED)
    scheduler.freeze_all_but_active(optimizer)

    def full() -> dict:
        with FSDP.summon_full_params(model):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}

    out["steps"] = []
    for step in range(4):
        scheduler.maybe_switch(step, optimizer)
        before = full()
        model(**batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = full()
        changed = sorted({block_of(n) for n in after if not torch.equal(after[n], before[n])} - {None})
        out["steps"].append({"active": list(scheduler.active), "changed_blocks": changed})
    return out


def main(output_dir: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hf_lisa.distributed import (
        UnsupportedEngineError,
        check_layer_switching_supported,
        load_fsdp2_checkpoint,
        save_fsdp2_checkpoint,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {"world_size": dist.get_world_size()}

    # -- uninterrupted run, observed step by step ----------------------------------------------------------------
    model, optimizer, scheduler = build()
    results["engine"] = check_layer_switching_supported(model, optimizer)
    scheduler.freeze_all_but_active(optimizer)
    results["steps"] = train(model, optimizer, scheduler, range(STEPS), observe=True)
    results["history"] = [[s, b] for s, b in scheduler.history]
    reference = full_weights(model)

    # -- checkpoint at SAVE_AT (mid-period), resume in fresh objects ---------------------------------------------
    checkpoint = os.path.join(output_dir, "checkpoint")
    model, optimizer, scheduler = build()
    scheduler.freeze_all_but_active(optimizer)
    train(model, optimizer, scheduler, range(SAVE_AT))
    save_fsdp2_checkpoint(checkpoint, model, optimizer, scheduler)
    del model, optimizer, scheduler

    # loading the optimizer state with every candidate still trainable: strict loading expects state nobody saved
    model, optimizer, _ = build()
    try:
        load_fsdp2_checkpoint(checkpoint, model, optimizer, scheduler=None)
        results["naive_load_error"] = None
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        results["naive_load_error"] = f"{type(err).__name__}: {err}"[-3000:]
    del model, optimizer

    model, optimizer, scheduler = build()
    load_fsdp2_checkpoint(checkpoint, model, optimizer, scheduler)
    results["resumed_active"] = list(scheduler.active)
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    resumed = full_weights(model)
    results["resume_max_abs_diff"] = max(float((resumed[n] - reference[n]).abs().max()) for n in reference)
    results["resume_bit_identical"] = all(torch.equal(resumed[n], reference[n]) for n in reference)
    results["resumed_history"] = [[s, b] for s, b in scheduler.history]
    del model, optimizer, scheduler

    # -- bf16 MixedPrecisionPolicy: blocks frozen at lazy init must train when unfrozen (pytorch#186998) -------------
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, optimizer, scheduler = build(policy, fix=True)
    results["bf16_fix_installed"] = bool(getattr(model, "_lisa_unfreeze_fix", False))
    scheduler.freeze_all_but_active(optimizer)
    results["bf16_steps"] = train(model, optimizer, scheduler, range(STEPS), observe=True)
    del model, optimizer, scheduler

    model, optimizer, scheduler = build(policy, fix=False)
    try:
        check_layer_switching_supported(model, optimizer)
        results["bf16_unfixed_refusal"] = None
    except UnsupportedEngineError as err:
        results["bf16_unfixed_refusal"] = str(err)
    # and what the guard prevents: the first switch to a block frozen at lazy init fails in backward
    scheduler.freeze_all_but_active(optimizer)
    try:
        train(model, optimizer, scheduler, range(STEPS))
        results["bf16_unfixed_error"] = None
    except RuntimeError as err:
        results["bf16_unfixed_error"] = str(err)[:300]

    results["fsdp1"] = fsdp1_scenarios()

    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
