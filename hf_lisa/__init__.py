"""hf-lisa: LISA fine-tuning for the Hugging Face stack.

``import hf_lisa`` registers ``LISA`` as a PEFT method next to LoRA::

    import hf_lisa
    from peft import get_peft_model
    model = get_peft_model(base_model, hf_lisa.LisaConfig(r=8, sparsity=0.4))

The import itself is light: it loads no torch, transformers or PEFT. The public names below resolve on first use
(PEP 562), and LISA is registered with PEFT as soon as PEFT is imported, before or after ``hf_lisa`` (see
:func:`_register_when_peft_is_imported` and docs/architecture.md, "Imports").
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ._lazy import lazy_attributes

__version__ = "0.2.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time these resolve lazily in __getattr__
    from .blocks import find_blocks
    from .hub import push_to_hub
    from .hub.load import from_pretrained
    from .tuner import PEFT_TYPE_LISA, LisaConfig, LisaLayer, LisaModel, Linear, register

# public name -> the submodule it comes from, imported on first access
_LAZY = {
    "LisaConfig": "tuner",
    "LisaModel": "tuner",
    "LisaLayer": "tuner",
    "Linear": "tuner",
    "PEFT_TYPE_LISA": "tuner",
    "register": "tuner",
    "find_blocks": "blocks",
    # huggingface_hub's upload machinery and the card templates are not needed to train
    "push_to_hub": "hub",
    "from_pretrained": "hub.load",
}
# submodules reachable as attributes of the package (``hf_lisa.tuner``), imported on first access
_SUBMODULES = frozenset({
    "blocks", "cli", "data", "demo", "demo_task", "distributed", "errors", "evaluation", "export", "hub", "methods",
    "model_cards", "models", "optim", "scheduler", "train", "trainer", "trainer_callbacks", "tuner",
})


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, _SUBMODULES)


# ----------------------------------------------------------------------------------------------------------------------
# PEFT registration without importing PEFT
#
# PEFT resolves ``"peft_type": "LISA"`` through its own mappings (``PeftConfig.from_pretrained``, ``PeftModel``,
# ``AutoPeftModel*``, transformers' ``load_adapter``), which code outside hf-lisa reads without ever touching
# ``hf_lisa.LisaConfig``. So LISA must be registered whenever PEFT is usable after ``import hf_lisa``:
#
# * PEFT already imported: register now (torch and PEFT are loaded anyway);
# * otherwise: a one-shot ``sys.meta_path`` finder for the top-level ``peft`` module runs ``register()`` right after
#   ``peft/__init__.py`` has executed, then removes itself; PEFT's loader object is kept (only its ``exec_module`` is
#   wrapped, on that one instance), so ``peft.__loader__``/``__spec__`` are what they would be without hf-lisa.
#
# Importing ``hf_lisa.tuner`` (what ``hf_lisa.LisaConfig`` does) registers as well.
# ----------------------------------------------------------------------------------------------------------------------
_HOOK_MARK = "_hf_lisa_register_on_peft_import"


def _register_with_peft() -> None:
    """Register LISA with PEFT (imports :mod:`hf_lisa.tuner`, hence torch). Idempotent."""
    tuner = sys.modules.get(f"{__name__}.tuner")
    if tuner is not None and not hasattr(tuner, "register"):
        return  # hf_lisa.tuner is being imported (and imported PEFT): it registers itself when it finishes
    from .tuner import register

    register()


def _remove_peft_hooks() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, _HOOK_MARK, False)]


class _RegisterOnPeftImport:
    """A ``sys.meta_path`` finder that lets the other finders find ``peft`` and has LISA registered right after
    ``peft/__init__.py`` ran. Every other module, ``peft``'s submodules included, passes through untouched."""

    _hf_lisa_register_on_peft_import = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "peft":
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if getattr(finder, _HOOK_MARK, False) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None  # PEFT is not installed: nothing to register with
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # no per-import loader instance to wrap: registration waits for hf_lisa.LisaConfig
        exec_module = loader.exec_module

        def exec_module_then_register(module: Any) -> None:
            exec_module(module)
            vars(loader).pop("exec_module", None)
            _remove_peft_hooks()
            try:
                _register_with_peft()
            except Exception as exc:  # noqa: BLE001 - PEFT itself imported fine; do not break code that only uses it
                import warnings

                warnings.warn(f"hf-lisa could not register LISA with PEFT: {type(exc).__name__}: {exc}. Importing "
                              "hf_lisa.tuner shows the full error.", RuntimeWarning, stacklevel=2)

        try:
            loader.exec_module = exec_module_then_register  # this loader instance only, restored once it ran
        except (AttributeError, TypeError):  # a loader with __slots__
            pass
        return spec


def _register_when_peft_is_imported() -> None:
    """Register LISA with PEFT now if PEFT is imported, or as soon as it is."""
    _remove_peft_hooks()  # a reload of hf_lisa replaces its hook
    peft = sys.modules.get("peft")
    if peft is None:
        sys.meta_path.insert(0, _RegisterOnPeftImport())
    elif not getattr(getattr(peft, "__spec__", None), "_initializing", False):
        _register_with_peft()
    # else: hf_lisa is imported from inside PEFT's own import; hf_lisa.LisaConfig (or hf_lisa.tuner) registers


_register_when_peft_is_imported()

__all__ = [
    "LisaConfig", "LisaModel", "LisaLayer", "Linear", "PEFT_TYPE_LISA", "find_blocks", "push_to_hub",
    "from_pretrained", "__version__",
]
