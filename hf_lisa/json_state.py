"""Exact, pickle-free JSON encoding of scheduler state (nested dicts/lists of Python scalars and tensors).

``transformers.TrainerState`` stores the state of ``ExportableState`` callbacks inside ``trainer_state.json``, so
everything a LISA callback needs to resume (generator state, active set, mask bookkeeping, importance accumulators)
must be JSON. Tensors are stored as base64 of their raw bytes with dtype and shape, which round-trips bit for bit.
Tensors too large for a JSON file (the importance accumulators of a big model, mid-window) can be *spilled*: they are
replaced by a reference and written next to the checkpoint as safetensors.
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Optional

import torch

TENSOR_KEY = "__tensor__"
SPILLED_KEY = "__spilled_tensor__"


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"__tensor__": base64, "dtype": "float32", "shape": [...]}`` for any dtype, bf16 included."""
    t = tensor.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {TENSOR_KEY: base64.b64encode(raw).decode("ascii"), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}


def decode_tensor(data: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`."""
    dtype = getattr(torch, data["dtype"])
    raw = base64.b64decode(data[TENSOR_KEY])
    if not raw:
        return torch.empty(data["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(data["shape"]).clone()


def encode_state(
    obj: Any,
    *,
    spill: Optional[dict[str, torch.Tensor]] = None,
    inline_max_bytes: Optional[int] = None,
    _path: str = "",
) -> Any:
    """Turn ``obj`` into JSON-serialisable data.

    Args:
        obj: nested ``dict`` (string keys) / ``list`` / ``tuple`` of scalars, strings, ``None`` and tensors.
        spill: if given, tensors larger than ``inline_max_bytes`` are put here under a unique key and replaced by a
            reference; the caller writes them to a side file.
        inline_max_bytes: size limit for inline tensors when ``spill`` is given.
    """
    if isinstance(obj, torch.Tensor):
        nbytes = obj.numel() * obj.element_size()
        if spill is not None and inline_max_bytes is not None and nbytes > inline_max_bytes:
            key = _path.strip("/") or f"tensor_{len(spill)}"
            spill[key] = obj.detach().cpu().contiguous()
            return {SPILLED_KEY: key}
        return encode_tensor(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"state keys must be strings to survive JSON, got {k!r} at {_path or '/'}")
            out[k] = encode_state(v, spill=spill, inline_max_bytes=inline_max_bytes, _path=f"{_path}/{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [
            encode_state(v, spill=spill, inline_max_bytes=inline_max_bytes, _path=f"{_path}/{i}")
            for i, v in enumerate(obj)
        ]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot encode {type(obj).__name__} at {_path or '/'} as JSON state")


def decode_state(obj: Any, load_spilled: Optional[Callable[[str], torch.Tensor]] = None) -> Any:
    """Inverse of :func:`encode_state`. ``load_spilled(key)`` returns a spilled tensor."""
    if isinstance(obj, dict):
        if TENSOR_KEY in obj:
            return decode_tensor(obj)
        if SPILLED_KEY in obj:
            if load_spilled is None:
                raise ValueError(f"state references a spilled tensor {obj[SPILLED_KEY]!r} but no side file was given")
            return load_spilled(obj[SPILLED_KEY])
        return {k: decode_state(v, load_spilled) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_state(v, load_spilled) for v in obj]
    return obj


def has_spilled(obj: Any) -> bool:
    """Whether ``obj`` (encoded state) references spilled tensors."""
    if isinstance(obj, dict):
        return SPILLED_KEY in obj or any(has_spilled(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_spilled(v) for v in obj)
    return False
