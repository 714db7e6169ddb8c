"""The side-by-side protocol's settings: the methods it can run and the presets it runs them under.

The data live in ``benchmarks/configs/bench.json`` (``make bench``) and ``configs/peers.json`` (``make
bench-peers``), run by the one harness, ``benchmarks/study.py``; this module holds their shape
(:class:`MethodSpec`, :class:`Preset`), the reader (:func:`side_by_side_settings`) and, for the tools that run one
method outside a config (``benchmarks/scaling.py``, the tests), the methods and presets of ``bench.json``.

A preset fixes everything that must be equal across methods (model, data, seed, batch, steps, evaluation) plus the
few per-family knobs (learning rate, LISA's γ and K); ``--set FIELD=VALUE`` overrides any field.

* ``cpu-small``: the embedded SmolLM2-135M-Instruct in fp32 on the bundled arithmetic task, sized to finish the
  seven default methods in about 20 minutes on 2 CPU cores. K is 5 instead of the paper's 20 so that eight active
  sets occur in 40 steps; the table says so.
* ``gpu``: the same model and task with bf16 autocast (fp32 master weights), a larger batch, 200 steps and the
  K = 20 (LMFlow's script default): meant for a one-shot run on a single GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: how it maps onto ``hf_lisa.train``'s ``LisaArguments``.

    Args:
        name: the name used by ``--methods`` and in the tables.
        train_method: ``LisaArguments.method`` (``lisa-naive`` trains as ``full`` plus the naive callback).
        family: ``"full-parameter"`` or ``"adapter"``; selects the learning rate.
        lisa_overrides: extra ``LisaArguments`` fields (besides γ, K, r and alpha, which come from the preset).
        model_overrides: arguments of ``hf_lisa.models.quantization_config``, e.g. ``{"load_in_4bit": True}`` for a
            quantized base.
        training_overrides: ``TrainingArguments`` fields that differ from the preset's, e.g. ``{"optim": ...}``.
        naive: add ``benchmarks.naive_lisa.NaiveLisaCallback`` (requires_grad toggling only).
        peer: ``"badam"`` or ``"galore"``: another package's method, run in a plain ``transformers.Trainer`` as its
            docs say (``benchmarks/peers.py``); the model is loaded as for ``full``.
        description: one line for the table.
    """

    name: str
    train_method: str
    family: str
    lisa_overrides: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    training_overrides: dict = field(default_factory=dict)
    naive: bool = False
    peer: str = ""
    description: str = ""


@dataclass(frozen=True)
class Preset:
    """Settings shared by every method of one benchmark run.

    Args:
        model: model path or Hub id; ``None`` is the embedded SmolLM2-135M-Instruct.
        data: training file (any format ``hf_lisa.train`` accepts); ``None`` is the preset's ``task``.
        task: a task of ``benchmarks/tasks.py`` (``arithmetic``, ``instructions``, ``classification``) when ``data``
            is ``None``.
        steps: optimizer steps per method.
        batch_size: sequences per optimizer step (no gradient accumulation).
        seq_len: ``max_seq_length`` of tokenisation; batches are padded to their longest row, as in ``hf-lisa train``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        dtype: dtype of the loaded weights (``"float32"`` or ``"bfloat16"``).
        bf16: bf16 autocast (mixed precision, fp32 master weights when ``dtype`` is float32).
        eval_every: evaluate the eval loss every this many steps (and at step 0 and at the end).
        eval_samples: validation rows in the fixed eval set.
        exact_match_samples: validation prompts scored by greedy generation at the end (bundled task only; 0 skips).
        timing_warmup_steps: first steps left out of the median step time.
        lr_full_parameter: learning rate of full, lisa, lisa-naive and the peers badam and galore.
        lr_adapter: learning rate of lora, dora and the lisa-adapter variants.
        lisa_activated_layers: γ.
        lisa_interval_steps: K (also BAdam's ``switch_block_every`` and GaLore's ``update_proj_gap``).
        lora_r: rank of LoRA, of the LISA adapters and of GaLore's projection.
        lora_alpha: scaling numerator (scale = alpha / r).
        importance_steps: calibration batches of the sparse adapter's importance-based first mask.
        seed: seed of everything (model wrapping, data order, LISA's sampler).
        methods: the methods run by default (the config's ``run`` set).
        cpu_allocator: ``hf-lisa train``'s ``--cpu_allocator`` for every method: ``"default"`` (glibc's own
            behaviour), ``"trim"`` (free heap pages returned where the peak forms) or ``"lean"`` (the mmap threshold
            fixed: freed tensors leave the heap; slower).
        chunked_loss: ``hf-lisa train``'s ``--chunked_loss`` for every method.
        lisa_extra: further ``LisaArguments`` fields as ``(name, value)`` pairs, applied to every method after its
            own overrides (one-lever-at-a-time variants of a method).
    """

    name: str
    model: Optional[str] = None
    data: Optional[str] = None
    task: str = "arithmetic"
    steps: int = 40
    batch_size: int = 4
    seq_len: int = 128
    device: str = "auto"
    dtype: str = "float32"
    bf16: bool = False
    eval_every: int = 10
    eval_samples: int = 32
    exact_match_samples: int = 32
    timing_warmup_steps: int = 3
    lr_full_parameter: float = 1e-4
    lr_adapter: float = 5e-4
    lisa_activated_layers: int = 2
    lisa_interval_steps: int = 20
    lora_r: int = 16
    lora_alpha: float = 32.0
    importance_steps: int = 8
    seed: int = 42
    methods: tuple[str, ...] = ()
    cpu_allocator: str = "default"
    chunked_loss: bool = True
    lisa_extra: tuple[tuple[str, Any], ...] = ()

    def updated(self, **overrides: Any) -> "Preset":
        """A copy with the non-``None`` ``overrides`` applied; unknown names raise ``TypeError``."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown preset field(s) {unknown}; allowed: {sorted(known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


_METHOD_FIELDS = {f.name for f in fields(MethodSpec)}
_PRESET_FIELDS = {f.name for f in fields(Preset)} - {"name", "methods"}
_FAMILIES = ("full-parameter", "adapter")


#: what a side-by-side config's ``checks`` can compare: the ratio of ``method``'s measure to ``against``'s
CHECK_METRICS = ("tokens_per_second",)
_CHECK_KEYS = {"claim", "method", "against", "metric", "at_least", "device"}


def side_by_side_settings(raw: dict, where: str) -> tuple[dict[str, Preset], dict[str, MethodSpec], dict[str, tuple]]:
    """``(presets, methods, sets)`` of a side-by-side config (``raw``: its JSON, ``extends`` already merged). The
    config's keys: ``presets`` (name -> :class:`Preset` fields that differ from the defaults), ``methods`` (a list of
    :class:`MethodSpec` fields), ``sets`` (name -> method names), ``run`` (the set a run takes by default), ``checks``
    (claims judged from the results, :func:`check_specs`). A wrong key or value is refused, naming it and ``where``
    (the file)."""

    def fail(message: str) -> None:
        raise ValueError(f"{where}: {message}")

    methods: dict[str, MethodSpec] = {}
    for spec in raw.get("methods") or []:
        name = spec.get("name", "?")
        bad = sorted(set(spec) - _METHOD_FIELDS)
        if bad:
            fail(f"methods[{name}]: unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(_METHOD_FIELDS))}")
        if spec.get("family") not in _FAMILIES:
            fail(f"methods[{name}].family={spec.get('family')!r} is invalid; allowed: {', '.join(_FAMILIES)}")
        if name in methods:
            fail(f"methods[{name}] is given twice")
        try:
            methods[name] = MethodSpec(**spec)
        except TypeError as err:
            fail(f"methods[{name}]: {err}")
    presets: dict[str, Preset] = {}
    for name, values in (raw.get("presets") or {}).items():
        bad = sorted(set(values) - _PRESET_FIELDS)
        if bad:
            fail(f"presets.{name}: unknown key(s) {', '.join(bad)}; allowed: {', '.join(sorted(_PRESET_FIELDS))}")
        presets[name] = Preset(name=name, **{k: tuple(v) if k == "lisa_extra" else v for k, v in values.items()})
    sets = {name: tuple(names) for name, names in (raw.get("sets") or {}).items()}
    for name, names in sets.items():
        unknown = [m for m in names if m not in methods]
        if unknown:
            fail(f"sets.{name}: unknown method(s) {', '.join(unknown)}; allowed: {', '.join(methods)}")
    if raw.get("run") not in sets:
        fail(f"run={raw.get('run')!r} is invalid; allowed: {', '.join(sets)}")
    presets = {name: replace(p, methods=sets[raw["run"]]) for name, p in presets.items()}
    check_specs(raw.get("checks") or [], methods, where)
    return presets, methods, sets


def check_specs(checks: list, methods: dict, where: str) -> tuple[dict, ...]:
    """A config's ``checks``: each ``{"claim", "method", "against", "metric", "at_least", "device"}``: passed when
    ``metric`` of ``method`` is at least ``at_least`` times that of ``against``; judged only when both ran on
    ``device`` (optional), else reported as not judged."""
    for i, check in enumerate(checks):
        bad = sorted(set(check) - _CHECK_KEYS)
        if bad:
            raise ValueError(f"{where}: checks[{i}]: unknown key(s) {', '.join(bad)}; allowed: "
                             f"{', '.join(sorted(_CHECK_KEYS))}")
        if check.get("metric") not in CHECK_METRICS:
            raise ValueError(f"{where}: checks[{i}].metric={check.get('metric')!r} is invalid; allowed: "
                             f"{', '.join(CHECK_METRICS)}")
        for key in ("method", "against"):
            if check.get(key) not in methods:
                raise ValueError(f"{where}: checks[{i}].{key}={check.get(key)!r} is invalid; allowed: a method of "
                                 "this config")
        if not isinstance(check.get("at_least"), (int, float)) or isinstance(check.get("at_least"), bool):
            raise ValueError(f"{where}: checks[{i}].at_least={check.get('at_least')!r} is invalid; allowed: a number")
    return tuple(checks)


def _bench() -> tuple[dict[str, Preset], dict[str, MethodSpec], dict[str, tuple]]:
    return side_by_side_settings(json.loads((CONFIG_DIR / "bench.json").read_text()), str(CONFIG_DIR / "bench.json"))


PRESETS, METHODS, METHOD_SETS = _bench()
#: what ``make bench`` runs, in the order of the tables; ratios are taken against ``lora`` and ``full``. The other
#: methods (``dora`` and the variants the studies add) run when ``--methods`` names them.
DEFAULT_METHODS: tuple[str, ...] = METHOD_SETS["default"]
#: what ``make bench-peers`` runs: LISA beside its peers from other packages (BAdam, GaLore) and PEFT's LoRA and DoRA,
#: in one table with ratios against ``lora`` and ``full`` (issue 26)
PEER_COMPARISON: tuple[str, ...] = METHOD_SETS["peers"]
