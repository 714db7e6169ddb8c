"""Module paths of hf-lisa 0.1, kept importable for one release: each one warns and hands over its new module.

``import hf_lisa.config`` gives the very module object of ``hf_lisa.tuner.config`` (same classes, same state), with a
``FutureWarning`` that names the new path; so do the old top-level packages ``trainer_callbacks`` and ``model_cards``
(now ``hf_lisa.trainer_callbacks`` and ``hf_lisa.model_cards``) and their submodules. Nothing is copied; the finder
only aliases.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

#: old module path -> new module path (hf-lisa 0.1 -> 0.2); removed in 0.3
MOVED_MODULES = {
    "hf_lisa.config": "hf_lisa.tuner.config",
    "hf_lisa.layer": "hf_lisa.tuner.layer",
    "hf_lisa.model": "hf_lisa.tuner.model",
    "hf_lisa.masks": "hf_lisa.tuner.masks",
    "hf_lisa.registration": "hf_lisa.tuner",
    "hf_lisa.sampler": "hf_lisa.scheduler.sampler",
    "hf_lisa.optim": "hf_lisa.scheduler.param_groups",
    "hf_lisa.optim_state": "hf_lisa.scheduler.optim_state",
    "hf_lisa.data": "hf_lisa.train.data",
    "hf_lisa.loading": "hf_lisa.hub.load",
}
#: old top-level packages -> their place in the one namespace; their submodules follow
MOVED_PACKAGES = {"trainer_callbacks": "hf_lisa.trainer_callbacks", "model_cards": "hf_lisa.model_cards"}


def new_name(fullname: str):
    """The 0.2 path of an 0.1 module path, or ``None`` when ``fullname`` did not move."""
    if fullname in MOVED_MODULES:
        return MOVED_MODULES[fullname]
    top, _, rest = fullname.partition(".")
    if top in MOVED_PACKAGES and rest:
        return f"{MOVED_PACKAGES[top]}.{rest}"
    return None


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"`{old}` moved to `{new}` in hf-lisa 0.2; the old path is removed in 0.3.", FutureWarning, stacklevel=stacklevel
    )


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the module is already executed under its new name
        pass


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        if fullname in MOVED_MODULES:  # submodules of a moved package: its own import already warned
            _warn(fullname, new, stacklevel=3)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the alias finder first: a moved package's folder may still be on ``sys.path`` (a checkout, an old wheel)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())


def hand_over(old: str) -> None:
    """Called by the old top-level package ``old`` as it is imported: warn, then become the canonical module."""
    new = MOVED_PACKAGES[old]
    _warn(old, new, stacklevel=4)
    install()
    sys.modules[old] = importlib.import_module(new)
