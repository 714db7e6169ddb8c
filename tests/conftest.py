"""Shared fixtures. Kept small: tiny llama models built from config and a token dataset, for Trainer-level tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences for causal-LM training (labels = inputs)."""

    def __init__(self, num_examples: int = 64, seq_len: int = 8, vocab: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab, (num_examples, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def build_tiny_llama(num_layers: int = 4, hidden: int = 32, vocab: int = 64, seed: int = 0, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def build_training_args(output_dir, **overrides):
    """CPU TrainingArguments for fast, deterministic Trainer tests (no logging integrations, no tqdm)."""
    from transformers import TrainingArguments

    kwargs = dict(
        max_steps=8, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(str(output_dir), **kwargs)


@pytest.fixture
def tiny_llama():
    """Factory: ``tiny_llama(num_layers=4, hidden=32, vocab=64, seed=0, tie=False)``."""
    return build_tiny_llama


@pytest.fixture
def token_dataset():
    """Factory: ``token_dataset(num_examples=64, seq_len=8, vocab=64, seed=0)``."""
    return TokenDataset


@pytest.fixture
def training_args(tmp_path):
    """Factory: ``training_args(**overrides)`` writing under the test's ``tmp_path``."""
    return lambda **overrides: build_training_args(tmp_path / "out", **overrides)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: they gain nothing from more, and on a busy 2-core machine the
    spinning threads made tests/test_trl.py 5x slower (measured: 45 s with one thread, 273 s with two). A module opts
    in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- test lanes ---------------------------------------------------------------------------------------------------------
# Markers (pyproject.toml): slow, distributed, gguf. `make test` runs every test; `make test-fast` deselects the three.
# A test file says its own markers (`pytestmark`, decorators); added here at collection: `distributed` on all of
# tests/distributed.
TESTS = Path(__file__).resolve().parent

_DESELECTED = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if TESTS not in item.path.parents:
            continue
        relative = item.path.relative_to(TESTS)
        if relative.parts[0] == "distributed":  # every test there starts 2 ranks, or checks their launch
            item.add_marker(pytest.mark.distributed)


def pytest_deselected(items):
    if items:
        items[0].config.stash.setdefault(_DESELECTED, []).extend(items)


@pytest.fixture(scope="session")
def collected_items(request):
    """Every test item this session collected, those deselected by ``-m``/``-k`` included (tests/test_markers.py)."""
    return [*request.session.items, *request.config.stash.get(_DESELECTED, [])]
