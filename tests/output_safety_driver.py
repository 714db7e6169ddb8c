"""``hf-lisa train`` that stops in the middle of a save, for the SIGKILL tests of ``tests/test_output_safety.py``.

``python tests/output_safety_driver.py [hf-lisa train options]`` runs ``hf_lisa.train.main`` with one write blocked:
``HF_LISA_TEST_BLOCK=<point>`` picks the kind of write, ``HF_LISA_TEST_BLOCK_IN=<text>`` the first call whose path
contains ``text``. That call prints ``BLOCKED <path>`` and sleeps until the test kills the process.
``HF_LISA_TEST_BLOCK=preflight`` (for ``tests/test_run_races.py``) instead holds the run at the meta-model preflight,
once ``--output_dir`` has been checked: it prints ``BLOCKED preflight`` and waits until the file
``HF_LISA_TEST_BLOCK_IN`` exists, then runs on.

Points:
    weights: a safetensors file of model weights (transformers' and PEFT's ``save_pretrained``), left half-written;
    lisa_state: the LISA schedule's ``lisa_state.safetensors``, before it is written;
    rename: an ``os.replace`` (the renames that put a finished save into place), before it happens;
    preflight: the meta-model preflight (``check_before_loading``), until the file ``HF_LISA_TEST_BLOCK_IN`` appears.
"""

from __future__ import annotations

import os
import sys
import time

POINT = os.environ["HF_LISA_TEST_BLOCK"]
MATCH = os.environ["HF_LISA_TEST_BLOCK_IN"]


def _block_at(path: str) -> None:
    if MATCH in str(path):
        print(f"\nBLOCKED {path}", flush=True)  # on a line of its own: progress bars end without a newline
        while True:
            time.sleep(60)


def _install() -> None:
    if POINT == "weights":
        import peft.peft_model
        import transformers.modeling_utils

        real = transformers.modeling_utils.safe_save_file

        def save_half(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            if MATCH in str(filename):
                with open(filename, "r+b") as f:
                    f.truncate(os.path.getsize(filename) // 2)
            _block_at(filename)

        transformers.modeling_utils.safe_save_file = save_half
        peft.peft_model.safe_save_file = save_half
    elif POINT == "lisa_state":
        import hf_lisa.trainer_callbacks.state as callback_state

        real_state = callback_state.write_state_file

        def block_state(directory, tensors, **metadata):
            _block_at(directory)
            return real_state(directory, tensors, **metadata)

        callback_state.write_state_file = block_state
    elif POINT == "rename":
        real_replace = os.replace

        def block_rename(src, dst, *args, **kwargs):
            _block_at(src)
            return real_replace(src, dst, *args, **kwargs)

        os.replace = block_rename
    elif POINT == "preflight":
        import hf_lisa.train.run

        run = sys.modules["hf_lisa.train.run"]  # the package's ``run`` is the function of that name
        real_preflight = run.check_before_loading

        def hold_preflight(*args, **kwargs):
            print("\nBLOCKED preflight", flush=True)
            while not os.path.exists(MATCH):
                time.sleep(0.05)
            return real_preflight(*args, **kwargs)

        run.check_before_loading = hold_preflight
    else:
        raise ValueError(f"HF_LISA_TEST_BLOCK={POINT!r}; allowed: weights, lisa_state, rename, preflight")


if __name__ == "__main__":
    _install()
    from hf_lisa.train import main

    main(sys.argv[1:])
    print("FINISHED without blocking", flush=True)
