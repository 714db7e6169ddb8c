"""Where full-parameter LISA's peak memory goes, phase by phase of a training step (CPU, glibc).

A plain training loop over the cpu-small preset's model and batches (E+H + γ sampled blocks train, AdamW, as
``hf-lisa train --method lisa`` runs them, without the Trainer around it) with a sampling thread that records, for
each phase of the step, the highest RSS and what made it up at that moment:

* **weights**: the model's parameters (fixed);
* **optimizer state** and **gradients**: the tensors in ``optimizer.state`` and the ``.grad`` of the parameters;
* **activations + temporaries**: everything else ``malloc`` had handed out (values saved for the backward pass, the
  logits and log-softmax of the vocabulary and their gradients, kernel outputs);
* **allocator slack**: resident memory ``malloc`` holds but has not handed out (freed heap fragments), plus the rest
  of the process (libraries loaded after the baseline).

Usage::

    python benchmarks/peak_breakdown.py                          # glibc's dynamic mmap threshold (hf-lisa's default)
    python benchmarks/peak_breakdown.py --cpu-allocator trim     # the heap trimmed where the peak forms
    python benchmarks/peak_breakdown.py --cpu-allocator lean     # the mmap threshold fixed at 128 KiB
    python benchmarks/peak_breakdown.py --chunked-loss false     # transformers' loss over the whole vocabulary
    python benchmarks/peak_breakdown.py --step-in-backward       # AdamW stepped in the backward pass

Linux with glibc only (``mallinfo2``, glibc >= 2.33).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use(libc) -> int:
    """Bytes ``malloc`` has handed out and not got back: heap chunks in use plus mapped blocks."""
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def breakdown(steps: int = 8, cpu_allocator: str = "default", step_in_backward: bool = False, chunked_loss: bool = True,
              gamma: int = 2,
              interval: int = 3, batch_size: int = 4, seq_len: int = 128, seed: int = 42) -> dict:
    """Run ``steps`` LISA steps and return, per phase, the peak RSS and its make-up (MiB above the RSS before the
    model was loaded)."""
    import torch

    from benchmarks.tasks import task_files
    from benchmarks.measure import current_rss_bytes
    from hf_lisa.optim.in_backward import AdamWInBackward
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_lisa.models import default_model_path
    from hf_lisa import data as data_lib
    from hf_lisa.optim import install_chunked_loss
    from hf_lisa.optim import apply_cpu_allocator, heap_trim

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    allocator = apply_cpu_allocator(cpu_allocator, on_cpu=True)
    torch.manual_seed(seed)
    train_file, validation_file = task_files("arithmetic")
    raw = data_lib.load_raw_datasets(train_file=train_file, validation_file=validation_file, seed=seed)
    raw["train"] = raw["train"].select(range(steps * batch_size))
    rss0, used0 = current_rss_bytes(), _malloc_in_use(libc)
    path = default_model_path()  # the embedded SmolLM2-135M-Instruct, in float32 as hf-lisa train loads it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)  # it has a pad token
    tokenized, _ = data_lib.tokenize_datasets(raw, tokenizer, max_seq_length=seq_len)
    collate = data_lib.data_collator(tokenizer)
    rows = tokenized["train"]
    batches = [collate([rows[i] for i in range(j, j + batch_size)]) for j in range(0, len(rows), batch_size)]
    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    optimizer = (AdamWInBackward if step_in_backward else torch.optim.AdamW)(params, lr=1e-4, weight_decay=0.0)
    blocks = model.model.layers
    generator = torch.Generator().manual_seed(seed)

    def activate() -> None:  # E+H+norm always; γ blocks drawn; deactivated blocks' state and gradients dropped
        active = set(torch.randperm(len(blocks), generator=generator)[:gamma].tolist())
        for i, block in enumerate(blocks):
            for p in block.parameters():
                p.requires_grad_(i in active)
                if i not in active:
                    p.grad = None
                    optimizer.state.pop(p, None)

    phase, peaks, stop = ["setup"], {}, [False]

    def sample() -> None:
        while not stop[0]:
            rss, name = current_rss_bytes(), phase[0]
            if rss > peaks.get(name, {}).get("rss", 0):
                try:  # the training thread may add or drop state meanwhile: then the next sample counts
                    used = _malloc_in_use(libc) - used0
                    state = sum(v.numel() * v.element_size() for s in list(optimizer.state.values())
                                for v in list(s.values()) if torch.is_tensor(v))
                    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
                except RuntimeError:
                    continue
                peaks[name] = {"rss": rss, "used": used, "state": state, "grads": grads}
            time.sleep(0.0005)

    chunked = chunked_loss and install_chunked_loss(model)  # as LisaTrainer does
    trim = heap_trim(cpu_allocator, on_cpu=True)
    if trim is not None:
        trim.attach(model)
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda *_: phase.__setitem__(0, "forward: logits and loss"))
    head.register_full_backward_pre_hook(lambda *_: phase.__setitem__(0, "backward: LM head"))
    blocks[-1].register_full_backward_pre_hook(lambda *_: phase.__setitem__(0, "backward: blocks"))
    blocks[0].register_full_backward_hook(lambda *_: phase.__setitem__(0, "backward: embedding"))
    for p in params:
        p.requires_grad_(False)
    for p in list(model.model.embed_tokens.parameters()) + list(model.model.norm.parameters()) + \
            list(head.parameters()):
        p.requires_grad_(True)
    threading.Thread(target=sample, daemon=True).start()
    model.train()
    saved: dict[int, int] = {}  # storages autograd saves in the forward pass (parameters excluded), per step
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    vocab_bytes = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    saved_per_step = []
    for step, batch in enumerate(batches[:steps]):
        if step % interval == 0:
            phase[0] = "switch"
            activate()
        phase[0] = "forward"
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(**batch).loss
        saved_per_step.append(sum(saved.values()))
        vocab_bytes.append(batch["input_ids"].numel() * model.config.vocab_size * 4)
        phase[0] = "backward: loss"
        if trim is not None:
            trim.trim_before_backward_of(loss)
        loss.backward()
        del loss
        phase[0] = "clipping (global norm)"
        if not step_in_backward:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        phase[0] = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stop[0] = True
    time.sleep(0.01)
    rows_out = {}
    for name, p in sorted(peaks.items(), key=lambda kv: -kv[1]["rss"]):
        if name == "setup":
            continue
        rss = p["rss"] - rss0
        rows_out[name] = {
            "peak_rss": rss / MIB, "weights": weights / MIB, "optimizer_state": p["state"] / MIB,
            "gradients": p["grads"] / MIB, "activations_temporaries": (p["used"] - p["state"] - p["grads"]) / MIB,
            "allocator_slack_other": (rss - weights - p["used"]) / MIB,
        }
    if trim is not None:
        allocator = f"glibc, heap trimmed where the peak forms ({trim.calls} trims)"
    return {"allocator": allocator or "glibc defaults", "step_in_backward": step_in_backward, "steps": steps,
            "chunked_loss": chunked,
            "phases": rows_out, "saved_for_backward_max": max(saved_per_step) / MIB,
            "vocabulary_tensor_max": max(vocab_bytes) / MIB}


def render(result: dict) -> str:
    cols = ("peak_rss", "weights", "optimizer_state", "gradients", "activations_temporaries", "allocator_slack_other")
    lines = [f"allocator: {result['allocator']}; step in backward: {result['step_in_backward']}; chunked loss: "
             f"{result.get('chunked_loss', False)}; "
             f"{result['steps']} steps (MiB above the RSS before the model loaded)", "",
             "| phase | peak RSS | weights | optimizer state | gradients | activations + temporaries | "
             "allocator slack + other |", "|---|--:|--:|--:|--:|--:|--:|"]
    for name, row in result["phases"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.0f}" for c in cols) + " |")
    vocab = f"{result['vocabulary_tensor_max']:.0f} MiB"
    if result.get("chunked_loss"):
        loss = (f"of which the logits are {vocab} (the chunked loss keeps them and 4 bytes a token); the only other "
                "vocabulary-sized tensor, their gradient, is as large")
    else:
        loss = (f"of which the fp32 log-softmax of the vocabulary is {vocab}; each other vocabulary-sized tensor "
                "(logits, the NLL and log-softmax gradients) is as large")
    lines += ["", f"Saved for the backward pass (largest step, parameters excluded): "
              f"{result['saved_for_backward_max']:.0f} MiB, {loss}. Gradients are the `.grad` tensors: a tied E/H "
              "gradient waits in autograd's buffer (counted as a temporary) until the embedding's half arrives."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks/peak_breakdown.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cpu-allocator", choices=("default", "trim", "lean"), default="default")
    parser.add_argument("--chunked-loss", choices=("true", "false"), default="true")
    parser.add_argument("--step-in-backward", action="store_true")
    parser.add_argument("--json", help="Also write the numbers to this file.")
    ns = parser.parse_args(argv)
    result = breakdown(steps=ns.steps, cpu_allocator=ns.cpu_allocator, step_in_backward=ns.step_in_backward,
                       chunked_loss=ns.chunked_loss == "true")
    print(render(result))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
