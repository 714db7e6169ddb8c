"""The tokenizer metadata of a GGUF file (``tokenizer.*`` keys): copied from a reference GGUF, or written from a
byte-level BPE ``tokenizer.json``.

llama.cpp tokenizes with the vocabulary, merges and token types stored in the file, and splits text first with a
named pre-tokenizer (``tokenizer.ggml.pre``), which llama.cpp's own converter identifies by hashing tokenizer outputs.
A reference GGUF of the same tokenizer (the demo model's, or the base model's as llama.cpp converted it) carries all
of that exactly; hf-lisa copies it when given one, and uses the demo model's file by itself when the tokenizer is the
demo model's. Otherwise the keys are written from ``tokenizer.json``: the pre-tokenizer name is known for GPT-2's
split (``gpt-2``) and must be named (``tokenizer_pre``) for any other, or llama.cpp falls back to its default split.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import UsageError

logger = logging.getLogger(__name__)

TOKENS_KEY, MERGES_KEY = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"


@dataclass
class TokenizerMetadata:
    """``tokenizer.*`` key/value entries for a GGUF writer, and where they came from."""

    source: str
    entries: list[tuple[str, Any, Any, Any]] = field(default_factory=list)  # (key, value, vtype, sub_type)
    warnings: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        return next((value for k, value, *_ in self.entries if k == key), None)

    def write(self, writer) -> None:
        for key, value, vtype, sub_type in self.entries:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)


# the scalar value types of GGUF metadata: GGUFValueType -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: str, prefix: str = "") -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, vtype, sub_type)`` of the metadata entries of the GGUF file at ``path`` whose key starts with
    ``prefix``. Reads the header only (a 49k-token vocabulary in well under a second, where ``gguf.GGUFReader``
    maps every tensor and string first)."""
    import struct

    import numpy as np
    from gguf import GGUFValueType

    def unpack(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise UsageError(f"{path!r} ends inside its metadata; it is not a complete GGUF file.")
        return struct.unpack(fmt, data)[0]

    def string(f):
        return f.read(unpack(f, "<Q")).decode("utf-8", errors="replace")

    def value(f, vtype):
        if vtype == _STRING:
            return string(f)
        if vtype in _SCALARS:
            return unpack(f, _SCALARS[vtype])
        raise UsageError(f"{path!r} has a metadata value of unknown type {vtype}.")

    entries = []
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UsageError(f"{path!r} is not a GGUF file (no GGUF magic).")
        version = unpack(f, "<I")
        if version < 2:
            raise UsageError(f"{path!r} is GGUF version {version}; versions 2 and 3 are read.")
        unpack(f, "<Q")  # tensor count
        for _ in range(unpack(f, "<Q")):
            key, vtype = string(f), unpack(f, "<I")
            sub_type = None
            if vtype == _ARRAY:
                sub_type, count = unpack(f, "<I"), unpack(f, "<Q")
                if sub_type in _SCALARS and sub_type != 7:
                    fmt = _SCALARS[sub_type]
                    item = struct.calcsize(fmt)
                    data = np.frombuffer(f.read(item * count), fmt).tolist()
                else:
                    data = [value(f, sub_type) for _ in range(count)]
            else:
                data = value(f, vtype)
            if key.startswith(prefix):
                entries.append((key, data, GGUFValueType(vtype),
                                GGUFValueType(sub_type) if sub_type is not None else None))
    return entries


def from_reference(path: str) -> TokenizerMetadata:
    """Every ``tokenizer.*`` entry of the GGUF file at ``path``, as it is."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer_from={path!r} is not a file; give a GGUF file of the same tokenizer.")
    metadata = TokenizerMetadata(source=f"copied from {path}", entries=read_metadata(path, "tokenizer."))
    if metadata.value(TOKENS_KEY) is None:
        raise UsageError(f"tokenizer_from={path!r} has no {TOKENS_KEY}: it carries no tokenizer.")
    return metadata


def _byte_level(part: Optional[dict]) -> bool:
    if not part:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_byte_level(p) for p in part.get("pretokenizers", []) + part.get("decoders", []))


def _pre_tokenizer_name(pre_tokenizer: dict) -> Optional[str]:
    """llama.cpp's name of the pre-tokenizer, where it is certain: GPT-2's regex split alone is ``gpt-2``."""
    if pre_tokenizer.get("type") == "ByteLevel" and pre_tokenizer.get("use_regex", True):
        return "gpt-2"
    return None


def _special_flags(tokenizer, bos: Optional[int], eos: Optional[int]) -> tuple[bool, bool]:
    """Whether encoding adds BOS / EOS, observed on a sample text (what llama.cpp needs to know)."""
    ids = tokenizer("Hello world")["input_ids"]
    plain = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    added = len(ids) - len(plain)
    return (added > 0 and bos is not None and ids[0] == bos), (added > 0 and eos is not None and ids[-1] == eos)


def from_tokenizer(tokenizer, vocab_size: int, pre: Optional[str] = None) -> TokenizerMetadata:
    """``tokenizer.*`` entries from a fast byte-level BPE tokenizer (GPT-2, SmolLM, Llama 3, Qwen2 style).

    Tokens are ordered by id and padded to the model's ``vocab_size`` with ``[PAD<i>]`` (type unused), added tokens
    are typed control (special) or user-defined, and BOS/EOS insertion is observed, not guessed.

    Raises:
        UsageError: for a tokenizer that is not byte-level BPE (SentencePiece, WordPiece, Unigram): give
            ``tokenizer_from`` a GGUF file of it instead.
    """
    from gguf import GGUFValueType, TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    data = json.loads(backend.to_str()) if backend is not None else {}
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not (_byte_level(data.get("pre_tokenizer")) and _byte_level(data.get("decoder"))):
        raise UsageError(
            f"the tokenizer ({type(tokenizer).__name__}, model {model.get('type')!r}) is not a byte-level BPE "
            "tokenizer, the one kind hf-lisa writes into GGUF itself. Pass tokenizer_from=<a GGUF file of the same "
            "tokenizer> (--tokenizer_from), e.g. the base model converted by llama.cpp's convert_hf_to_gguf.py."
        )
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    vocab.update({content: t["id"] for content, t in added.items()})
    size = max(max(vocab.values()) + 1, vocab_size)
    tokens: list[Optional[str]] = [None] * size
    for token, index in vocab.items():
        tokens[index] = token
    types = [int(TokenType.NORMAL)] * size
    for t in added.values():
        types[t["id"]] = int(TokenType.CONTROL if t.get("special") else TokenType.USER_DEFINED)
    for index, token in enumerate(tokens):
        if token is None:
            tokens[index], types[index] = f"[PAD{index}]", int(TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    metadata = TokenizerMetadata(source="written from tokenizer.json")
    add = metadata.entries.append
    add(("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None))
    pre = pre or _pre_tokenizer_name(data.get("pre_tokenizer") or {})
    if pre:
        add(("tokenizer.ggml.pre", pre, GGUFValueType.STRING, None))
    else:
        metadata.warnings.append(
            "tokenizer.ggml.pre not written: this tokenizer splits text with its own pre-tokenizer "
            f"({(data.get('pre_tokenizer') or {}).get('type')}), whose llama.cpp name hf-lisa cannot tell. llama.cpp "
            "then uses its default split, which can tokenize some text differently. Pass --tokenizer_pre NAME (the "
            "name llama.cpp's convert_hf_to_gguf.py gives it, e.g. llama-bpe, qwen2) or --tokenizer_from a GGUF "
            "file of the same tokenizer. transformers' GGUF loader is not affected."
        )
    add((TOKENS_KEY, tokens, GGUFValueType.ARRAY, GGUFValueType.STRING))
    add(("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32))
    add((MERGES_KEY, merges, GGUFValueType.ARRAY, GGUFValueType.STRING))
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        if ids[name] is not None:
            add((f"tokenizer.ggml.{key}", int(ids[name]), GGUFValueType.UINT32, None))
    add_bos, add_eos = _special_flags(tokenizer, ids["bos"], ids["eos"])
    add(("tokenizer.ggml.add_bos_token", add_bos, GGUFValueType.BOOL, None))
    add(("tokenizer.ggml.add_eos_token", add_eos, GGUFValueType.BOOL, None))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        add(("tokenizer.chat_template", template, GGUFValueType.STRING, None))
    return metadata


def matching_reference(metadata: TokenizerMetadata, candidates: list[str]) -> Optional[str]:
    """The first GGUF file in ``candidates`` whose tokens and merges are exactly ``metadata``'s, or ``None``."""
    tokens, merges = metadata.value(TOKENS_KEY), metadata.value(MERGES_KEY)
    for path in candidates:
        if not os.path.isfile(path):
            continue
        reference = TokenizerMetadata(source=path, entries=read_metadata(path, "tokenizer.ggml."))
        if reference.value(TOKENS_KEY) == tokens and reference.value(MERGES_KEY) == merges:
            return path
    return None


def demo_gguf_candidates() -> list[str]:
    """The embedded demo model's GGUF file, when its package is installed."""
    from ..models import DEFAULT_GGUF_FILE, gguf_package_dir

    try:
        return [os.path.join(gguf_package_dir(), DEFAULT_GGUF_FILE)]
    except ImportError:
        return []


def tokenizer_metadata(
    tokenizer, vocab_size: int, tokenizer_from: Optional[str] = None, tokenizer_pre: Optional[str] = None
) -> TokenizerMetadata:
    """The ``tokenizer.*`` entries to write: from ``tokenizer_from`` when given; else from the demo model's GGUF when
    the tokenizer is exactly its tokenizer; else written from ``tokenizer.json``."""
    if tokenizer_from:
        return with_chat_template(from_reference(tokenizer_from), tokenizer)
    if tokenizer is None:
        raise UsageError("no tokenizer found beside the model (nor at its base model); a GGUF file needs one. Save "
                         "the tokenizer with the model, or pass --tokenizer_from a GGUF file of the same tokenizer.")
    written = from_tokenizer(tokenizer, vocab_size, tokenizer_pre)
    reference = None if tokenizer_pre else matching_reference(written, demo_gguf_candidates())
    if reference is None:
        return written
    copied = with_chat_template(from_reference(reference), tokenizer)
    copied.source = f"copied from the demo model's GGUF ({os.path.basename(reference)}): same tokens and merges"
    return copied


CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def with_chat_template(metadata: TokenizerMetadata, tokenizer) -> TokenizerMetadata:
    """``metadata`` with the chat template of ``tokenizer`` (the one the model was trained with), not the one of
    the file the tokens were copied from: a run trained with ``--chat_template chatml`` must be prompted in ChatML by
    llama.cpp and ollama, whatever its base's GGUF says. A tokenizer without a template drops the copied one."""
    if tokenizer is None:
        return metadata
    from gguf import GGUFValueType

    metadata.entries = [entry for entry in metadata.entries if entry[0] != CHAT_TEMPLATE_KEY]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        metadata.entries.append((CHAT_TEMPLATE_KEY, template, GGUFValueType.STRING, None))
    return metadata
