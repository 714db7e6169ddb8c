"""Shared by the multi-process tests and their worker scripts: tiny models, a learnable dataset, launching."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def tiny_llama(num_layers: int = 4, hidden: int = 32, vocab: int = 64, seed: int = 0):
    """A 4-block llama built from config; the same seed gives the same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class PatternDataset(torch.utils.data.Dataset):
    """``num_unique`` fixed token sequences repeated: a model can memorise them, so the loss goes down within a few
    steps (random tokens would leave nothing to learn). Labels = inputs, no padding, so every example has the same
    number of loss tokens and per-rank means average to the global mean."""

    def __init__(self, num_examples: int = 32, num_unique: int = 8, seq_len: int = 12, vocab: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        unique = torch.randint(0, vocab, (num_unique, seq_len), generator=gen)
        self.input_ids = unique[torch.arange(num_examples) % num_unique]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_of(name: str) -> Optional[int]:
    """Block index of a parameter name like ``model.layers.2.mlp.up_proj.weight``; ``None`` outside the blocks."""
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def launch(command: Sequence[str], extra_env: Optional[dict] = None, timeout: int = 240) -> str:
    """Run a launcher command from the repository root; fail with the output's tail if it fails. Returns stdout+err."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.update(extra_env or {})
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(
        list(command), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed with exit code {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout
