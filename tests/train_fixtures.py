"""A tiny causal LM *on disk* (character-level tokenizer with a chat template + a 2-block llama), for end-to-end tests
of ``hf-lisa train`` and the examples. Built once per session, in well under a second."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (vocab < 128) with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # characters join without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:], clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_lm_dir(directory: Path, num_layers: int = 3, hidden: int = 32, seed: int = 0) -> str:
    """Save the tokenizer and a tiny ``LlamaForCausalLM`` to ``directory``; return its path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def copy_task_rows(n: int, seed: int = 0) -> list[dict]:
    """A trivially learnable prompt/completion task: the completion repeats the prompt's letter."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letter = rng.choice("abcdefgh")
        rows.append({"prompt": f"say {letter}", "completion": f"{letter}{letter}{letter}"})
    return rows


def encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """The ``input_ids`` and ``labels`` expected for a row written as ``(text, trained)`` pieces: each piece tokenised
    on its own (as the loss masks are), its labels -100 unless trained."""
    input_ids, labels = [], []
    for text, trained in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if trained else [-100] * len(ids)
    return input_ids, labels
