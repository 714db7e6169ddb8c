"""``--cpu_allocator``: glibc's mmap threshold fixed on CPU (``lean``), the heap trimmed where a step's peak forms
(``trim``), left alone otherwise."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from hf_lisa.train import parse_args
from hf_lisa.optim.memory import LEAN_MMAP_THRESHOLD, apply_cpu_allocator, heap_trim


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2") else None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes(libc) -> int:
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


_LEAN_CHECK = """
import ctypes, sys, torch
from hf_lisa.optim.memory import LEAN_MMAP_THRESHOLD, apply_cpu_allocator
sys.path.insert(0, sys.argv[1])
from test_cpu_allocator import _glibc, _mapped_bytes
libc = _glibc()
note = apply_cpu_allocator(sys.argv[2], on_cpu=True)
assert sys.argv[2] == "default" or f"{LEAN_MMAP_THRESHOLD // 1024} KiB" in note, note
for _ in range(3):
    before = _mapped_bytes(libc)
    block = torch.empty(1 << 20)  # 4 MiB
    mapped = _mapped_bytes(libc) - before >= 4 << 20
    del block
    assert _mapped_bytes(libc) - before < 4 << 20
    if not mapped:
        sys.exit(3)
"""


@pytest.mark.slow  # a fresh process: glibc serves a request from free heap space first, and earlier tests leave some
@pytest.mark.parametrize("policy, mapped_every_time", [("lean", True), ("default", False)])
def test_lean_maps_every_large_block_on_its_own(monkeypatch, policy, mapped_every_time):
    # a freed 4 MiB block raises glibc's dynamic threshold above 4 MiB, putting the next one on the heap (default);
    # with the threshold fixed (lean), each one is mapped on its own (and unmapped when freed)
    import subprocess

    if _glibc() is None:
        pytest.skip("glibc malloc only")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", _LEAN_CHECK, os.path.dirname(__file__), policy], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if mapped_every_time else 3), done.stderr[-2000:]


def test_left_alone_off_cpu_by_choice_or_when_the_user_configured_malloc(monkeypatch):
    assert apply_cpu_allocator("default", on_cpu=True) is None
    assert apply_cpu_allocator("lean", on_cpu=False) is None
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert apply_cpu_allocator("lean", on_cpu=True) is None
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert apply_cpu_allocator("lean", on_cpu=True) is None


def test_option_values():
    *_, training_args = parse_args(["--output_dir", "unused", "--report_to", "none", "--method", "lora",
                                    "--cpu_allocator", "default"])
    assert training_args.cpu_allocator == "default"
    with pytest.raises(ValueError, match=r"--cpu_allocator='tcmalloc' is invalid; allowed: default, trim, lean"):
        parse_args(["--output_dir", "unused", "--report_to", "none", "--cpu_allocator", "tcmalloc"])


def _train(tiny_llama, token_dataset, training_args, allocator: str, method: str = "full"):
    from hf_lisa.trainer import LisaTrainer

    model = tiny_llama(num_layers=2, tie=True)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = LisaTrainer(model=model, args=training_args(max_steps=3, logging_steps=1),
                          train_dataset=token_dataset(num_examples=12), cpu_allocator=allocator)
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trim_runs_at_the_start_of_each_backward_and_before_the_embeddings_backward(
        tiny_llama, token_dataset, training_args):
    if _glibc() is None:
        pytest.skip("glibc malloc only")
    plain, expected = _train(tiny_llama, token_dataset, training_args, "default")
    assert plain.heap_trim is None
    trimmed, weights = _train(tiny_llama, token_dataset, training_args, "trim")
    assert trimmed.heap_trim.calls == 2 * 3  # the loss and the embeddings' output, in each of 3 steps
    for name, value in weights.items():  # the hooks pass every gradient through unchanged
        assert torch.equal(value, expected[name]), name
    trimmed.evaluate(token_dataset(num_examples=4))  # no backward pass: no trim
    assert trimmed.heap_trim.calls == 6


def test_trim_skips_the_embeddings_hook_when_no_gradient_reaches_them(tiny_llama, token_dataset, training_args):
    if _glibc() is None:
        pytest.skip("glibc malloc only")
    trimmed, _ = _train(tiny_llama, token_dataset, training_args, "trim", method="lora")
    assert trimmed.heap_trim.calls == 3  # frozen embeddings: their output needs no gradient; the loss's hook only


def test_trim_is_off_the_cpu_or_unless_chosen(monkeypatch):
    assert heap_trim("default", on_cpu=True) is None
    assert heap_trim("lean", on_cpu=True) is None
    assert heap_trim("trim", on_cpu=False) is None
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert heap_trim("trim", on_cpu=True) is None
    with pytest.raises(ValueError, match="allowed: default, trim, lean"):
        heap_trim("sometimes", on_cpu=True)
