"""Gradient bytes all-reduced per optimizer step under DDP, SmolLM2-135M shapes: LISA's active set vs the whole model.

Launch with 2 ranks on CPU (gloo); weights are random (the byte counts depend on shapes only)::

    torchrun --nproc_per_node 2 --master_port 29531 benchmarks/ddp_grad_bytes.py --output results/

Each configuration wraps the model in DDP with ``find_unused_parameters=True`` and ``hf_lisa.distributed``'s counting
hook, runs a few forward/backward passes on 16 tokens, and records what each rank handed to ``all_reduce`` per step
(``sent``) against what plain DDP all-reduces (``full``: every bucket). Writes ``ddp_grad_bytes.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SmolLM2-135M(-Instruct): the embedded default model of hf-lisa
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
)


def build(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))


def measure(name: str, model, scheduler=None, compress=None, steps: int = 2) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from hf_lisa.distributed import register_lisa_comm_hook

    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    comm = register_lisa_comm_hook(ddp, compress_dtype=compress)
    if scheduler is not None:
        scheduler.freeze_all_but_active()
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(steps):
        if scheduler is not None and step:
            scheduler.switch_to(scheduler.sampler.sample())  # the bytes do not depend on which blocks are active
        ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, 16), generator=gen)
        ddp(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    last = comm.meter.last
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"name": name, "sent_bytes": last["sent"], "full_bytes": last["full"],
            "sent_fraction": last["sent"] / last["full"], "trainable_params": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.environ.get("OUT", "results"))
    parser.add_argument("--gamma", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    from peft import LoraConfig, get_peft_model

    from hf_lisa.scheduler import LayerwiseScheduler

    rows = [measure("full fine-tuning (plain DDP)", build())]
    model = build()
    rows.append(measure(f"LISA E+H+{args.gamma}L", model, LayerwiseScheduler(model, args.gamma, 1)))
    model = build()
    rows.append(measure(f"LISA E+H+{args.gamma}L, fp16 hook", model, LayerwiseScheduler(model, args.gamma, 1),
                        compress=torch.float16))
    model = build()
    rows.append(measure(f"LISA {args.gamma}L (no E+H)", model,
                        LayerwiseScheduler(model, args.gamma, 1, lisa_always_trainable=())))
    lora = get_peft_model(build(), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    rows.append(measure("LoRA r16 all-linear", lora))
    if dist.get_rank() == 0:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "ddp_grad_bytes.json"), "w") as f:
            json.dump({"model": "SmolLM2-135M shapes", "world_size": dist.get_world_size(), "rows": rows}, f, indent=1)
        lines = ["| configuration | trainable params | all-reduced per step (per rank) | plain DDP | fraction |",
                 "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['trainable_params'] / 1e6:.1f} M | {r['sent_bytes'] / 2**20:.1f} MiB | "
                         f"{r['full_bytes'] / 2**20:.1f} MiB | {r['sent_fraction']:.3f} |")
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(args.output, "ddp_grad_bytes.md"), "w") as f:
            f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
