"""Module paths of hf-lisa 0.1, kept importable for one release: each one warns and hands over its new module.

``import hf_lisa.config`` gives the very module object of ``hf_lisa.tuner.config`` (same classes, same state), with a
``FutureWarning`` that names the new path. Nothing is copied; the finder only aliases.
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


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the module is already executed under its new name
        pass


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"`{fullname}` moved to `{new}` in hf-lisa 0.2; the old path is removed in 0.3.", FutureWarning, stacklevel=3
        )
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
