"""Saves that exist only once complete: what :class:`~hf_lisa.trainer.LisaTrainer` writes a checkpoint through, and
what ``hf-lisa train``'s output-folder safety (:mod:`hf_lisa.train.run_folder.output_dir`) recognises as unfinished.

A save is written into a hidden staging folder named with :data:`STAGING_PREFIX`, flushed with :func:`fsync_tree`,
and renamed into place; ``transformers.trainer_utils.get_last_checkpoint`` never matches a staging folder.
"""

from __future__ import annotations

import os

__all__ = ["STAGING_PREFIX", "fsync_tree"]

#: names of the folders a save writes before it is complete (hidden; ``get_last_checkpoint`` never matches them)
STAGING_PREFIX = ".partial-"


def fsync_tree(folder: str) -> None:
    """Flush every file under ``folder``, then the folders themselves (not on Windows, which cannot open a folder),
    so that a rename after it publishes data that survives a power loss, not only a killed process."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        if os.name == "nt":
            continue
        descriptor = os.open(root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
