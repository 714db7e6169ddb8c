"""The sparse adapter's forward ``s · h (M ⊙ (B A))ᵀ`` without keeping ``M ⊙ (B A)`` alive for the backward pass.

Autograd applied to ``F.linear(h, s * (B @ A) * M)`` saves the materialised delta, an ``out × in`` tensor per adapted
linear, in every block the backward pass crosses (trained or not), and the layer used to keep the expanded boolean
mask of every layer for good. :class:`SparseDeltaLinear` saves ``h`` (only when ``A``/``B`` train), ``A``, ``B``
and the bit-packed mask; the backward pass recomputes ``M ⊙ (B A)`` (a rank-``r`` matmul and two elementwise
products) and applies, step by step, the tensor operations autograd applied to the old graph. Outputs, ``dh``,
``dA``, ``dB`` and the dense ``dL/dΔ`` handed to importance tracking are bitwise those of the old graph
(``tests/test_sparse_delta.py`` asserts it against a copy of the old code), in fp32, in bf16 and under autocast.

The mask goes from its packed bits straight to a multiplier in the delta's dtype (one table lookup per byte) that
broadcasts over a view of the delta; for blocks it has one value per block row and input, so the ``out × in`` mask
never exists. Multiplying by ``1.0``/``0.0`` is the very product autograd computed with the boolean mask.

Only row-major (contiguous) ``h``, ``A`` and ``B`` take this path (:func:`supports_fast_path`): those are the layouts
for which the backward's operations are known to be autograd's own. Anything else (a strided input, meta tensors)
uses the old graph, which is correct for every layout.

:class:`FusedSparseLinear` (``LisaConfig.fuse_sparse_delta``, the default) goes further: one matmul with
``W + Δ`` instead of the base's and the delta's, equal to the unfused path up to fp32 rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import masks as M

__all__ = [
    "FusedSparseLinear",
    "MaskLayout",
    "SparseDeltaLinear",
    "fused_sparse_linear",
    "sparse_delta",
    "sparse_delta_linear",
    "supports_fast_path",
]

#: structures whose expanded mask is the grid repeated over blocks (``"block"``) or the grid itself
_GRID_STRUCTURES = ("block", "n:m", "unstructured")
#: blocks at most this wide are repeated along the input dimension by the lookup table itself
_MAX_TABLE_REPEAT = 16
_BIT_TABLES: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}


def _bit_table(dtype: torch.dtype, device: torch.device, repeat: int) -> torch.Tensor:
    """``(256, 8 * repeat)``: row ``b`` holds the 8 bits of byte ``b`` (lowest first, as packed) as ``1``/``0`` in
    ``dtype``, each repeated ``repeat`` times."""
    key = (dtype, device, repeat)
    table = _BIT_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = bits.repeat_interleave(repeat, dim=1).to(dtype=dtype, device=device)
        _BIT_TABLES[key] = table
    return table


@dataclass(frozen=True)
class MaskLayout:
    """Where a packed mask's bits go: the weight's ``(out, in)`` shape, its structure and block size."""

    shape: tuple[int, int]
    structure: str
    block_size: tuple[int, int] = (2, 2)

    @property
    def grid_shape(self) -> tuple[int, int]:
        """Shape of the selection grid the packed bits describe (one cell per block for ``"block"``)."""
        return M.grid_shape(self.shape, self.structure, self.block_size)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The boolean selection grid (not the expanded ``(out, in)`` mask) of ``packed``."""
        return M.unpack_mask(packed, self.grid_shape)

    def multiplier(self, packed: torch.Tensor, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.Tensor]:
        """``(view, factor)``: ``delta.view(view) * factor`` is ``delta * M``, with ``factor`` in ``dtype``.

        For ``b_out × b_in`` blocks the factor is one value per block row and input (``b_out`` times smaller than
        the mask) when ``b_in`` is small, else one per block; for the other structures it is the full mask.
        """
        out_f, in_f = self.shape
        (b_out, b_in) = self.block_size if self.structure == "block" else (1, 1)
        g_out, g_in = out_f // b_out, in_f // b_in
        repeat = b_in if b_in <= _MAX_TABLE_REPEAT else 1
        table = _bit_table(dtype, packed.device, repeat)
        values = table.index_select(0, packed.int()).view(-1)[: g_out * g_in * repeat]
        if repeat == b_in:
            return (g_out, b_out, in_f), values.view(g_out, 1, in_f)
        return (g_out, b_out, g_in, b_in), values.view(g_out, 1, g_in, 1)


def _mask(delta: torch.Tensor, packed: torch.Tensor, layout: MaskLayout, inplace: bool) -> torch.Tensor:
    """``delta * M`` (``inplace``: into ``delta``, which must be contiguous and not needed by autograd)."""
    if layout.structure not in _GRID_STRUCTURES:  # a structure this module does not know: expand it fully
        mask = M.expand_grid(layout.unpack(packed), layout.structure, layout.block_size).to(delta.device)
        return delta.mul_(mask) if inplace else delta * mask
    view, factor = layout.multiplier(packed.to(delta.device), delta.dtype)
    if inplace:
        delta.view(view).mul_(factor)
        return delta
    return (delta.reshape(view) * factor).view(layout.shape)


def sparse_delta(
    weight_A: torch.Tensor,
    weight_B: torch.Tensor,
    packed: torch.Tensor,
    layout: MaskLayout,
    scaling: float,
    dtype: Optional[torch.dtype] = None,
    inplace: bool = False,
) -> torch.Tensor:
    """``s · M ⊙ (B A)`` in ``(out, in)`` layout, optionally with the factors cast to ``dtype`` first.

    The products (and their order) are the ones the layer has always computed, so that the result, and autograd's
    gradient through it, do not change. ``inplace`` reuses the buffer of ``B @ A`` for both products (only without
    autograd).
    """
    if dtype is not None:
        weight_B, weight_A = weight_B.to(dtype), weight_A.to(dtype)
    delta = _mask(weight_B @ weight_A, packed, layout, inplace)
    return delta.mul_(scaling) if inplace else delta * scaling


def supports_fast_path(h: torch.Tensor, weight_A: torch.Tensor, weight_B: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether :class:`SparseDeltaLinear` reproduces the old graph bit for bit for these tensors.

    It needs real (non-meta) tensors, an ``h`` of at least two dimensions and row-major ``h``, ``A`` and ``B``
    (the layouts whose gradient formulas it applies). Everything else goes through the old graph.
    """
    tensors = (h, weight_A, weight_B, packed)
    return h.dim() >= 2 and not any(t.is_meta for t in tensors) and all(t.is_contiguous() for t in tensors[:3])


def _factor_grads(ctx, grad_delta: torch.Tensor, packed, weight_Ac, weight_Bc, need_A: bool, need_B: bool):
    """``dA``, ``dB`` from ``dL/dΔ``: ``d(BA) = M ⊙ (s · dL/dΔ)``, ``dB = d(BA) Aᵀ``, ``dA = Bᵀ d(BA)``."""
    if ctx.on_delta_grad is not None:
        ctx.on_delta_grad(grad_delta)
    grad_ba = _mask(grad_delta * ctx.scaling, packed, ctx.layout, inplace=True)
    grad_B = grad_ba.mm(weight_Ac.t()) if need_B else None
    grad_A = weight_Bc.t().mm(grad_ba) if need_A else None
    return grad_A, grad_B


class SparseDeltaLinear(torch.autograd.Function):
    """``F.linear(h, (s · M ⊙ (B A)).to(h.dtype))`` whose backward pass recomputes the delta instead of saving it.

    Forward runs exactly the old operations, autocast included (``B @ A`` and ``F.linear`` run in autocast's dtype
    when it is on). Backward, with ``g`` the incoming gradient folded to ``(tokens, out)``, ``h_c`` the input in the
    dtype the linear ran in and ``Δ`` the recomputed delta:

    * ``dh = g · Δ`` (cast back to ``h``'s dtype);
    * ``dL/dΔ = gᵀ · h_c``, handed to ``on_delta_grad`` (importance tracking) before it is masked;
    * ``d(BA) = M ⊙ (s · dL/dΔ)``, ``dB = d(BA) · Aᵀ``, ``dA = Bᵀ · d(BA)`` (cast back to the factors' dtype).
    """

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        weight_A: torch.Tensor,
        weight_B: torch.Tensor,
        packed: torch.Tensor,
        layout: MaskLayout,
        scaling: float,
        on_delta_grad: Optional[Callable[[torch.Tensor], None]],
    ) -> torch.Tensor:
        delta = sparse_delta(weight_A, weight_B, packed, layout, scaling, inplace=True)
        out = F.linear(h, delta.to(h.dtype))
        factors_train = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        # the dtypes of the old graph's casts: delta (autocast's for B @ A), h, and the dtype F.linear ran in
        ctx.delta_dtype, ctx.h_dtype, ctx.h_shape = delta.dtype, h.dtype, h.shape
        ctx.layout, ctx.scaling = layout, scaling
        ctx.on_delta_grad = on_delta_grad if factors_train else None
        # what the old graph kept of h: its copy in the linear's dtype, and only for the factors' gradient
        h_saved = h.to(out.dtype) if factors_train else None
        ctx.save_for_backward(h_saved, weight_A, weight_B, packed)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h_c, weight_A, weight_B, packed = ctx.saved_tensors
        need_h, need_A, need_B = ctx.needs_input_grad[:3]
        grad_h = grad_A = grad_B = None
        # backward ops run in the dtypes the forward recorded, never in an autocast context of the caller
        with torch.autocast(grad_out.device.type, enabled=False), torch.no_grad():
            weight_Bc, weight_Ac = weight_B.to(ctx.delta_dtype), weight_A.to(ctx.delta_dtype)
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
            if need_h:
                delta = sparse_delta(weight_Ac, weight_Bc, packed, ctx.layout, ctx.scaling, inplace=True)
                grad_h = grad_2d.mm(delta.to(ctx.h_dtype).to(grad_out.dtype)).view(ctx.h_shape).to(ctx.h_dtype)
                del delta
            if need_A or need_B:
                grad_w = grad_2d.t().mm(h_c.reshape(-1, h_c.shape[-1]))
                grad_A, grad_B = _factor_grads(
                    ctx, grad_w.to(ctx.h_dtype).to(ctx.delta_dtype), packed, weight_Ac, weight_Bc, need_A, need_B
                )
        grad_A = None if grad_A is None else grad_A.to(weight_A.dtype)
        grad_B = None if grad_B is None else grad_B.to(weight_B.dtype)
        return grad_h, grad_A, grad_B, None, None, None, None


def _needs_graph(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def sparse_delta_linear(
    h: torch.Tensor,
    weight_A: torch.Tensor,
    weight_B: torch.Tensor,
    packed: torch.Tensor,
    layout: MaskLayout,
    scaling: float,
    on_delta_grad: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """``s · h (M ⊙ (B A))ᵀ`` with the mask given by its packed bits.

    Without autograd (inference, ``torch.no_grad``, or nothing that requires a gradient) the delta is computed,
    used and freed; otherwise :class:`SparseDeltaLinear` keeps only ``h``, ``A``, ``B`` and the packed mask.
    ``on_delta_grad`` receives the dense ``dL/dΔ`` (masked-out entries too) in the backward pass, when ``A`` or ``B``
    trains.
    """
    if not _needs_graph(h, weight_A, weight_B):
        delta = sparse_delta(weight_A, weight_B, packed, layout, scaling, inplace=True)
        return F.linear(h, delta.to(h.dtype))
    return SparseDeltaLinear.apply(h, weight_A, weight_B, packed, layout, scaling, on_delta_grad)


# -- fused into the base matmul (LisaConfig.fuse_sparse_delta) ---------------------------------------------------------
def _effective_weight(weight_A, weight_B, packed, layout, scaling, base_weight, fan_in_fan_out) -> torch.Tensor:
    """``W + M ⊙ ((s · B) A)`` in ``(out, in)`` layout, in one buffer (``s`` folded into the thin ``B``: this path
    does not reproduce the unfused rounding anyway)."""
    delta = _mask((weight_B * scaling) @ weight_A, packed, layout, inplace=True)
    return delta.add_(base_weight.t() if fan_in_fan_out else base_weight)


def _base_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fan_in_fan_out: bool):
    """The base layer's operation with an ``(out, in)`` weight: ``F.linear``, or ``addmm`` as ``Conv1D`` does."""
    if not fan_in_fan_out:
        return F.linear(x, weight, bias)
    x_2d = x.reshape(-1, x.shape[-1])
    y = x_2d.mm(weight.t()) if bias is None else torch.addmm(bias, x_2d, weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


class FusedSparseLinear(torch.autograd.Function):
    """``base(x) + s · x (M ⊙ (B A))ᵀ`` as one matmul with ``W + s · M ⊙ (B A)``, recomputed in the backward pass.

    One weight-sized matmul per pass instead of two (base and delta), at the price of rounding: ``x (W + Δ)ᵀ`` is
    not bitwise ``x Wᵀ + x Δᵀ`` (they agree to fp32 rounding). ``Linear._fused_forward_ok`` admits it only where it
    computes the same function as the unfused path: fp32 weights, no autocast, a frozen plain ``nn.Linear`` or
    ``Conv1D`` base without hooks, one active adapter without dropout. Backward, with ``g`` folded to
    ``(tokens, out)``: ``dx = g · W_eff``, ``dL/dΔ = gᵀ · x`` (to ``on_delta_grad``), then ``dA`` and ``dB`` as in
    :class:`SparseDeltaLinear`.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight_A: torch.Tensor,
        weight_B: torch.Tensor,
        packed: torch.Tensor,
        base_weight: torch.Tensor,
        base_bias: Optional[torch.Tensor],
        layout: MaskLayout,
        scaling: float,
        fan_in_fan_out: bool,
        on_delta_grad: Optional[Callable[[torch.Tensor], None]],
    ) -> torch.Tensor:
        weight = _effective_weight(weight_A, weight_B, packed, layout, scaling, base_weight, fan_in_fan_out)
        out = _base_linear(x, weight, base_bias, fan_in_fan_out)
        factors_train = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.layout, ctx.scaling, ctx.fan_in_fan_out, ctx.x_shape = layout, scaling, fan_in_fan_out, x.shape
        ctx.on_delta_grad = on_delta_grad if factors_train else None
        ctx.save_for_backward(x if factors_train else None, weight_A, weight_B, packed, base_weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight_A, weight_B, packed, base_weight = ctx.saved_tensors
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        grad_x = grad_A = grad_B = None
        with torch.autocast(grad_out.device.type, enabled=False), torch.no_grad():
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
            if need_x:
                weight = _effective_weight(
                    weight_A, weight_B, packed, ctx.layout, ctx.scaling, base_weight, ctx.fan_in_fan_out
                )
                grad_x = grad_2d.mm(weight).view(ctx.x_shape)
                del weight
            if need_A or need_B:
                grad_delta = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
                grad_A, grad_B = _factor_grads(ctx, grad_delta, packed, weight_A, weight_B, need_A, need_B)
        return grad_x, grad_A, grad_B, None, None, None, None, None, None, None


def fused_sparse_linear(
    x: torch.Tensor,
    weight_A: torch.Tensor,
    weight_B: torch.Tensor,
    packed: torch.Tensor,
    base_weight: torch.Tensor,
    base_bias: Optional[torch.Tensor],
    layout: MaskLayout,
    scaling: float,
    fan_in_fan_out: bool,
    on_delta_grad: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """``x (W + s · M ⊙ (B A))ᵀ + bias`` in one matmul; see :class:`FusedSparseLinear` for when it may be used."""
    if not _needs_graph(x, weight_A, weight_B):
        weight = _effective_weight(weight_A, weight_B, packed, layout, scaling, base_weight, fan_in_fan_out)
        return _base_linear(x, weight, base_bias, fan_in_fan_out)
    return FusedSparseLinear.apply(
        x, weight_A, weight_B, packed, base_weight, base_bias, layout, scaling, fan_in_fan_out, on_delta_grad
    )
