"""``--cpu_allocator``: glibc's mmap threshold fixed on CPU (``lean``), left alone otherwise."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from hf_lisa.train import parse_args
from hf_lisa.train.memory import LEAN_MMAP_THRESHOLD, apply_cpu_allocator


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


def test_lean_maps_every_large_block_on_its_own(monkeypatch):
    libc = _glibc()
    if libc is None:
        pytest.skip("glibc malloc only")
    for name in [k for k in os.environ if k.startswith("MALLOC_")] + ["LD_PRELOAD", "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)
    note = apply_cpu_allocator("lean", on_cpu=True)
    assert note is not None and f"{LEAN_MMAP_THRESHOLD // 1024} KiB" in note
    # a freed 4 MiB block would have raised glibc's dynamic threshold above 4 MiB, putting the next one on the heap;
    # with the threshold fixed, each one is mapped on its own (and unmapped when freed)
    for _ in range(3):
        before = _mapped_bytes(libc)
        block = torch.empty(1 << 20)  # 4 MiB
        assert _mapped_bytes(libc) - before >= 4 << 20
        del block
        assert _mapped_bytes(libc) - before < 4 << 20


def test_left_alone_off_cpu_by_choice_or_when_the_user_configured_malloc(monkeypatch):
    assert apply_cpu_allocator("default", on_cpu=True) is None
    assert apply_cpu_allocator("lean", on_cpu=False) is None
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert apply_cpu_allocator("lean", on_cpu=True) is None
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert apply_cpu_allocator("lean", on_cpu=True) is None


def test_option_values():
    *_, lisa_args, _ = parse_args(["--output_dir", "unused", "--report_to", "none", "--method", "lora",
                                   "--cpu_allocator", "default"])
    assert lisa_args.cpu_allocator == "default"
    with pytest.raises(ValueError, match=r"--cpu_allocator='tcmalloc' is invalid; allowed: lean, default"):
        parse_args(["--output_dir", "unused", "--report_to", "none", "--cpu_allocator", "tcmalloc"])
